"""
A training run's directory, everything train.py writes besides the weights' math:

    RUN/log.jsonl               one JSON record per logged train step and per eval
    RUN/curves.png              loss, per-step accuracy and accept length, redrawn as it runs
    RUN/eval_prompts.jsonl      the held-out turns, one line each, as speculate.py --prompts input
    RUN/checkpoints/step-N/     config.json + model.safetensors (an SGLang/vLLM-loadable draft)
                                + trainer_state.pt (model, optimizer, schedule, RNG, data position)
    RUN/best/                   --keep-best: the draft at the held-out eval with the highest
                                replayed accept length so far, + best.json (step, eval metrics)

Checkpoints are written into a temporary directory and renamed into place, so a run killed at any
moment leaves only complete ones, and `train.py --resume` continues from the last one exactly.
"""
import glob
import json
import os
import random
import shutil

import torch
import torch.distributed as dist

from common import UserError, atomic_write_text


# ----------------------------------------------------------------------------------------------
# Checkpoints: checkpoints/step-NNNNNN/ = SGLang draft (config.json, model.safetensors) + trainer_state.pt

def state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def save_checkpoint(run_dir, step, module, opts, scheds, data_pos, args, draft_cfg, draft_ids,
                    rank, keep, export_dtype):
    """Write checkpoints/step-N atomically: everything goes into a temporary directory that is
    renamed into place at the end, so a kill at any moment leaves only complete checkpoints."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from model import Eagle3Draft
    msd = get_model_state_dict(module, options=state_options(cpu_offload=True))
    osd = get_optimizer_state_dict(module, opts, options=state_options(cpu_offload=True))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng)
    path = None
    if rank == 0:
        root = os.path.join(run_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, f"step-{step:06d}")
        tmp = os.path.join(root, f".tmp-step-{step:06d}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        # the embedding is the target's and frozen: not part of the trainer state
        sd = {k[len("draft."):]: v for k, v in msd.items() if k != "draft.embed_tokens.weight"}
        torch.save({"step": step, "model": sd, "optim": osd, "sched": [s.state_dict() for s in scheds],
                    "rng": rngs, "data": data_pos, "args": vars(args),
                    "draft_ids": draft_ids.cpu()}, os.path.join(tmp, "trainer_state.pt"))
        export = Eagle3Draft(draft_cfg)
        export.load_state_dict(sd, strict=False)   # embedding stays zero: not exported (H == Ht)
        export.save_pretrained(tmp, dtype=export_dtype)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


BEST_DIR = "best"


def save_best(run_dir, step, module, draft_cfg, rank, export_dtype, eval_metrics):
    """Write RUN/best/ (the draft now, and best.json with the step and its eval metrics): called
    when a held-out eval beats every earlier one on replayed accept length, which can peak and
    fall while the loss still falls (DeepSpec issue 84). Every rank calls it (the state dict is
    gathered); rank 0 writes, through a temporary directory renamed into place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from model import Eagle3Draft
    msd = get_model_state_dict(module, options=state_options(cpu_offload=True))
    if rank == 0:
        path = os.path.join(run_dir, BEST_DIR)
        tmp = os.path.join(run_dir, f".tmp-best-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        export = Eagle3Draft(draft_cfg)
        export.load_state_dict({k[len("draft."):]: v for k, v in msd.items()
                                if k != "draft.embed_tokens.weight"}, strict=False)
        export.save_pretrained(tmp, dtype=export_dtype)
        with open(os.path.join(tmp, "best.json"), "w") as f:
            json.dump({"step": step, "eval": eval_metrics}, f, indent=1)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    dist.barrier()


def best_so_far(run_dir):
    """The replayed accept length of RUN/best/ (for --resume), or -inf when there is none."""
    p = os.path.join(run_dir, BEST_DIR, "best.json")
    if not os.path.exists(p):
        return float("-inf")
    with open(p) as f:
        return float(json.load(f)["eval"]["replay_accept_3"])


def list_checkpoints(run_dir):
    return sorted(p for p in glob.glob(os.path.join(run_dir, "checkpoints", "step-*"))
                  if os.path.exists(os.path.join(p, "trainer_state.pt")))


def load_checkpoint(path, module, opts, scheds, rank, world, draft_ids, check_args=None):
    """Restore a checkpoint into the module, optimizers and schedules; check_args(saved args)
    runs first, so a refused resume loads nothing."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    try:
        st = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=False)
    except Exception as e:
        raise UserError(f"{path}: unreadable checkpoint ({str(e).splitlines()[0]})")
    if check_args:
        check_args(st["args"])
    if not torch.equal(st["draft_ids"], draft_ids.cpu()):
        raise UserError(f"{path}: the checkpoint's draft vocabulary does not match the data's "
                        f"vocab.safetensors")
    sd = {"draft." + k: v for k, v in st["model"].items()}
    set_model_state_dict(module, sd, options=state_options(strict=False))
    set_optimizer_state_dict(module, opts, st["optim"], options=state_options())
    # one schedule per optimizer (train.py --optimizer muon has two); older checkpoints hold one
    for s, sd in zip(scheds, st["sched"] if isinstance(st["sched"], list) else [st["sched"]]):
        s.load_state_dict(sd)
    if len(st["rng"]) == world:   # RNG streams are per rank; a different world size starts fresh
        r = st["rng"][rank]
        torch.set_rng_state(r["torch"])
        random.setstate(r["python"])
        if r.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(r["cuda"])
    return st


# ----------------------------------------------------------------------------------------------
# Logging and plots

def write_plots(run_dir, log_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train, evals = [], []
    with open(log_path) as f:
        for line in f:
            r = json.loads(line)
            (evals if r.get("split") == "eval" else train).append(r)
    if not train and not evals:
        return
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    if train:
        ax[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
        J = len(train[-1]["acc_j"])
        for j in range(J):
            ax[1].plot([r["step"] for r in train], [r["acc_j"][j] for r in train], label=f"step {j}")
        ax[2].plot([r["tokens"] for r in train], [r["accept_len_3"] for r in train],
                   label="train, chain of 3")
    if evals:
        ax[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
        ax[2].plot([r["tokens"] for r in evals], [r["accept_len_3"] for r in evals], "o-",
                   label="eval, chain of 3")
        ax[2].plot([r["tokens"] for r in evals], [r["replay_accept_3"] for r in evals], "s--",
                   label="eval, chain of 3, decoding replayed")
    ax[0].set(xlabel="step", ylabel="TTT loss", title="loss")
    ax[1].set(xlabel="step", ylabel="accuracy", title="train accuracy per TTT step", ylim=(0, 1))
    ax[2].set(xlabel="training tokens", ylabel="tokens per round",
              title="simulated accept length")
    for a in ax:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:     # a run's first record may be its step-0 eval
            a.legend(fontsize=8)
    fig.tight_layout()
    tmp = os.path.join(run_dir, ".curves.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, os.path.join(run_dir, "curves.png"))


def write_eval_prompts(data_path, seqs, eval_ids, out_path):
    """The held-out conversations as speculate.py --prompts input: one line per assistant turn
    of each held-out sequence (the conversation up to that turn's user message, earlier answers
    as in the data), so decoding every line covers the turns eval's replayed accept length is
    computed over. One line per conversation would decode only its last turn (speculate.py
    answers the last user message): on two-turn data the second answers accept more and read
    ~5-6% above the replay, all turns within 0.1% (results/RUNS.md, session 27)."""
    cpath = os.path.join(data_path, "conversations.jsonl")
    if not eval_ids or not os.path.exists(cpath):
        return
    with open(cpath) as f:
        convs = [json.loads(l) for l in f if l.strip()]
    lines = []
    for k in eval_ids:
        c = seqs[k].get("conversation", k)
        if not (isinstance(c, int) and 0 <= c < len(convs)):
            continue
        msgs = convs[c]["messages"]
        # a thinking template's data holds one sample per assistant turn (its message index)
        turn = seqs[k].get("turn")
        turns = [turn] if turn is not None else [i for i, m in enumerate(msgs)
                                                 if m["role"] == "assistant"]
        for i in turns:
            if any(m["role"] == "user" for m in msgs[:i]):
                lines.append(json.dumps({"messages": msgs[:i]}) + "\n")
    atomic_write_text(out_path, "".join(lines))


def truncate_log(log_path, step):
    """On resume, drop log records a killed run wrote after its last checkpoint."""
    if not os.path.exists(log_path):
        return
    with open(log_path) as f:
        keep = [l for l in f if l.strip() and json.loads(l)["step"] <= step]
    with open(log_path, "w") as f:
        f.writelines(keep)
