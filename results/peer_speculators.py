"""
A peer's own trainer, side by side (issue 23 item 3): train an EAGLE-3 draft with
vllm-project/speculators 0.9.0's trainer (its own code, run in a throwaway virtualenv; nothing of
it is imported by this project) on the SAME data this project's train.py trains on, then decode
the result with this project's speculate.py (which reads speculators' layout through layouts.py)
and report the accept length. A benchmark script, not part of the pytest suite.

    python results/peer_speculators.py --data DIR [--work W] [--arms defaults,ours[,trainpy]]
        [--epochs E | --tokens N] [--prompts P] [--n-prompts 8] [--max-new-tokens 64]
    python results/peer_speculators.py --make-tiny-target DIR     # a tiny case to try it on

DIR is a generate.py data directory (with or without hidden-state shards). Every output goes to
--work (default /root/scratch/peer/<name of DIR>-speculators), outside the git tree. The steps:

 1. convert (project python): DIR -> speculators' offline format in W/spec-data:
      an Arrow data set (datasets.save_to_disk, written by the venv's `datasets`) with one row
        per sequence: input_ids, loss_mask (assistant tokens, as speculators' prepare_data writes
        it), seq_len; rows in the order train.py's split puts them (its training sequences first,
        its held-out ones last) and --train-data-ratio chosen so that speculators' train/val
        split is exactly train.py's;
      hidden_states/hs_{i}.safetensors: hidden_states [T, n+1, H] = the n captured layers (the
        shards' aux, or the target's) and then the LAST DECODER LAYER'S OUTPUT BEFORE THE FINAL
        NORM (speculators applies the verifier's norm itself: core.py forward,
        verifier_lm_head(verifier_norm(.)) ; generate.py's shards store it AFTER the norm, which
        cannot be undone, so it is always recomputed with the target, here, by a forward
        pre-hook on the final norm, and checked: norm(pre) == transformers' hidden_states[-1]
        exactly, and against the shards' stored final state), and token_ids [T];
      d2t-{Vd}.npy (offsets) / t2d-{Vd}.npy (mask) from DIR/vocab.safetensors, so both drafts
        share this project's draft vocabulary.
 2. train (the venv's python): speculators' own `speculators train` entry point
    (TrainConfig.resolve + speculators.train.cli.main), behind a CPU shim written to
    results/speculators_venv/, once per arm:
      defaults  speculators' own defaults (Muon, lr 1e-3, linear decay, 1% warmup, TTT 3 with step
                decay 1.0, kl_div, norm_before_fc + norm_output + norm_before_residual, frozen
                lm_head from the target, sliding-window layer of 2048, packed batches of 8192
                tokens, bf16 autocast);
      ours      as close to train.py (its defaults with --trainpy-flags, read from
                train.parse_args here: the same settings as the trainpy arm) as its flags
                allow (AdamW, train.py's lr / warmup / weight decay, cosine, TTT length, step
                decay ttt.LOSS_DECAY, no norms, full attention, packed batches of batch-size x
                mean length tokens, train.py's dtype); what no flag can express is listed in the
                summary under "not_mappable";
      trainpy   (optional) this project's own train.py on the same data and token budget.
    Every arm gets the same number of training tokens (--tokens, or --epochs of the training
    split; default train.py's --epochs): the step count is planned with speculators' own batch
    sampler (MultipackDistributedBatchSamplerV2, the seed it will use).
 3. decode (project python): `python model.py CKPT --doctor --target T` and `python speculate.py
    --draft CKPT --target T --check --dtype float32 ...` on the held-out prompts (or --prompts):
    accept length, losslessness; everything into W/summary.json.

The CPU shim (speculators' trainer assumes an accelerator; nothing of speculators is edited):
  train/trainer.py:228  device_type = "cuda" when there is no accelerator -> torch.autocast("cuda")
                        (disabled with a warning, bf16 batches then meet fp32 weights): "cpu";
  train/trainer.py:348  model.to(local_rank) with the integer 0 = cuda:0 (and :533/:643 for the
                        batches): trainer.get_local_rank -> torch.device("cpu");
  train/trainer.py:80,92  _StepTimer calls torch.accelerator.synchronize(), which raises without
                        an accelerator (every logged step, --log-freq 1): a no-op;
  utils/util.py:17      get_current_device() -> "cuda:0" (used only to resume from a checkpoint):
                        not patched; every run starts in a fresh directory with
                        --no-resume-from-checkpoint.
  Attention (on a CPU only): --draft-attn-impl sdpa in every arm. speculators' default
  simple_flex_attention cannot train on a CPU at all: torch 2.13's flex_attention refuses the
  backward there (torch/nn/attention/flex_attention.py:2082 _validate_device, "FlexAttention
  does not support backward on CPU"), a torch limit, not speculators'. sdpa is speculators' own
  documented alternative ("for hardware that doesn't support flex attention"; core.py builds
  the same document-causal + TTT-diagonal mask densely, models/eagle3/attention.py
  extend_dense_mask_for_draft_tokens).
  Loss (on a CPU only): --loss-implementation eager in every arm. The default "fused" losses
  are Triton kernels (losses/fused.py `import triton`; losses/utils.py:121 raises "Fused losses
  require Triton"), GPU only; eager is speculators' own reference implementation of the same KL
  (losses/eager.py kl_div_loss: KL(softmax(target) || softmax(draft)) per row, masked mean).
  DataLoader workers: --num-workers 0 in every arm (12 spawned workers per loader on 2 cores;
  no effect on the math). models/utils.py:74 compiles forward only with CUDA, so CPU runs eager.
  A JSON-lines handler on the "speculators.metrics" logger writes W/<arm>/metrics.jsonl.

Decoding a defaults-arm draft: its layer is sliding-window (layer_types, window 2048), which this
project reads as such (draft_config.py) and runs only within the window, where it is full attention
exactly (speculate.py refuses a longer context by name). Positions: speculators trains row p at RoPE
position p + 1 (shift_batch keeps position_ids[1:]), this project at p; RoPE sees only position
differences, so the shift changes nothing (the doctor decodes both conventions).
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import UserError, atomic_write_text, run_main  # noqa: E402
from peer_speculators_data import SHIM_DIR, convert, run_venv, say, venv_env  # noqa: E402

SPEC_PYTHON = "/root/scratch/spec-venv/bin/python"
WORK_ROOT = "/root/scratch/peer"
ARMS = ("defaults", "ours", "trainpy")
# the fields of speculators' resolved run.yaml worth having in the summary
RESOLVED_KEYS = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay",
                 "scheduler_type", "scheduler_warmup_steps", "scheduler_warmup_ratio", "ttt_steps",
                 "ttt_step_loss_decay", "loss_fn", "loss_implementation", "norm_before_fc",
                 "norm_output", "norm_before_residual", "fc_norm", "embed_requires_grad",
                 "sliding_window", "full_attention_indices", "draft_attn_impl", "total_seq_len",
                 "hidden_states_dtype", "train_data_ratio", "target_layer_ids", "draft_vocab_size",
                 "epochs", "max_steps", "seed", "num_layers")


# ----------------------------------------------------------------------------------------------
# Step 2: speculators' trainer, two flag sets, one token budget

def train_py_defaults(args):
    """train.py's settings: its defaults with --trainpy-flags on top, read from its own parser (so
    the ours arm's mapping follows the train.py run it is compared with)."""
    from train import parse_args
    from ttt import LOSS_DECAY
    a = parse_args(["--data", "D", "--out", "O", *shlex.split(args.trainpy_flags)])
    return a, LOSS_DECAY


def cuda_available():
    """On a GPU speculators runs as it ships (flex attention, Triton losses; cpu_shim does
    nothing there); only on a CPU do the two CPU flags below replace them."""
    import torch
    return torch.cuda.is_available()


def arm_flags(args, conv, arm):
    """(speculators flags of this arm, what train.py does that no flag expresses (defaults arm:
    what this machine changes from speculators' defaults), the mapping)."""
    from common import resolve_dtype
    a, decay = train_py_defaults(args)
    n_train = conv["train_rows"]
    lengths = conv["lengths"][:n_train]
    common = ["--verifier-name-or-path", args.target_path,
              "--data-path", conv["spec_data"],
              "--d2t-path", os.path.join(conv["spec_data"], conv["vocab_files"][0]),
              "--t2d-path", os.path.join(conv["spec_data"], conv["vocab_files"][1]),
              "--draft-vocab-size", str(conv["draft_vocab_size"]),
              "--target-layer-ids", *map(str, conv["aux_layer_ids"]["speculators_input_of_layer"]),
              "--train-data-ratio", repr(conv["train_data_ratio"]),
              "--num-workers", "0", "--on-missing", "raise", "--no-resume-from-checkpoint",
              "--log-freq", "1"]
    if not cuda_available():
        common += [
              # speculators' default simple_flex_attention cannot train on CPU: torch's
              # flex_attention has no CPU backward (torch/nn/attention/flex_attention.py
              # _validate_device: "FlexAttention does not support backward on CPU"); sdpa is
              # speculators' own alternative (--draft-attn-impl, core.py: create_mask, the same
              # document/causal/TTT-diagonal mask as a dense boolean)
              "--draft-attn-impl", "sdpa",
              # the default fused losses are Triton kernels (losses/fused.py; losses/utils.py:121
              # "Fused losses require Triton"); eager is speculators' reference implementation
              # of the same losses (losses/eager.py)
              "--loss-implementation", "eager"]
    if arm == "defaults":
        from common import native_bf16
        ok, why = native_bf16("cuda" if cuda_available() else "cpu")
        changed = []
        if not ok:
            # speculators' default bf16 autocast on a CPU without native bf16 (AVX2 only) runs
            # its matmuls in torch's reference gemm (cpublas_gemm_impl): on a 2-core AVX2 EPYC
            # the first 8192-token step was not done after 19 minutes in bf16, and takes 148 s in
            # fp32. The dtype is the machine's, not the recipe's (train.py's auto picks fp32 too)
            common += ["--hidden-states-dtype", "float32"]
            changed = [f"--hidden-states-dtype float32, not bf16 ({why}; bf16 >8x slower): "
                       f"the only change from speculators' defaults besides the CPU flags"]
        return common + shlex.split(args.defaults_flags), changed, {}
    mean = sum(lengths) / len(lengths)
    tsl = max(max(lengths), round(a.batch_size * mean))
    dt, _ = resolve_dtype(a.dtype, "cuda" if cuda_available() else "cpu")
    dt = str(dt).replace("torch.", "")
    mapping = {
        "--optimizer": "adamw (train.py: AdamW)",
        "--lr": f"{a.lr} (train.py --lr)",
        "--weight-decay": f"{a.weight_decay} (train.py --weight-decay)",
        "--scheduler-type": "cosine (train.py: linear warmup then cosine)",
        "--scheduler-warmup-ratio": f"{a.warmup} (train.py --warmup)",
        "--ttt-steps": f"{a.ttt_length} (train.py --ttt-length)",
        "--ttt-step-loss-decay": f"{decay} (ttt.LOSS_DECAY: step j weighs {decay}**j)",
        "--loss-fn": "kl_div (train.py: soft cross-entropy to the target's distribution over the "
                     "draft vocabulary = KL + a constant)",
        "--no-norm-before-fc --no-norm-output --no-norm-before-residual":
            "train.py's default draft has none of these norms",
        "--full-attention-indices 0": "train.py's draft has full attention (speculators' default "
                                      "is a 2048-token sliding window)",
        "--total-seq-len": f"{tsl} = max(longest sequence, train.py --batch-size {a.batch_size} x "
                           f"mean length {mean:.1f}): speculators packs tokens, train.py batches "
                           f"sequences",
        "--hidden-states-dtype": f"{dt} (train.py --dtype {a.dtype} on this machine)",
        "--seed": f"{args.seed} (train.py --seed; also its split)",
    }
    flags = ["--optimizer", "adamw", "--lr", repr(a.lr), "--weight-decay", repr(a.weight_decay),
             "--scheduler-type", "cosine", "--scheduler-warmup-ratio", repr(a.warmup),
             "--ttt-steps", str(a.ttt_length), "--ttt-step-loss-decay", repr(decay),
             "--loss-fn", "kl_div", "--no-norm-before-fc", "--no-norm-output",
             "--no-norm-before-residual", "--full-attention-indices", "0",
             "--total-seq-len", str(tsl), "--hidden-states-dtype", dt, "--seed", str(args.seed)]
    not_mappable = [
        "AdamW betas: train.py (0.9, 0.95); speculators torch's default (0.9, 0.999), no flag "
        "(train/optimizers.py build_optimizers)",
        f"cosine floor: train.py --min-lr-ratio {a.min_lr_ratio}; speculators' cosine decays to 0",
        f"gradient clipping: train.py --grad-clip {a.grad_clip}; speculators fixed 1.0 "
        f"(train/trainer.py:551)",
        f"lm_head: train.py --lm-head-init {a.lm_head_init}, trained; speculators copies the "
        f"target's lm_head rows for the draft vocabulary and freezes them (speculators model.py:207)",
        f"fc init: train.py --fc-init {a.fc_init} (scaled to the captured layers' RMS); "
        f"speculators transformers' default (PreTrainedModel._init_weights: normal, std 0.02)",
        "loss rows: train.py drops rows whose target argmax is outside the draft vocabulary; "
        "speculators keeps them (loss mask only)",
        "loss-mask alignment: train.py counts row t at step j if x[t+j+2] (the predicted token) "
        "is an assistant token, speculators if x[t+j+1] is (models/eagle3/metrics.py "
        "align_for_step, data.py shift_batch); --loss-mask train-py shifts the mask to match",
        f"batches: train.py --batch-size {a.batch_size} sequences (padded), speculators packs "
        f"up to --total-seq-len tokens into one row with document masks",
        f"eval: train.py --eval-every {a.eval_every} steps on the held-out split; speculators "
        f"validates once per epoch on the same split",
    ]
    return flags + common + shlex.split(args.ours_flags), not_mappable, mapping


def plan(args, conv, tsl, seed):
    lengths = conv["lengths"][:conv["train_rows"]]
    return run_venv(args, "spec_plan.py", [json.dumps({"lengths": lengths, "total_seq_len": tsl,
                                                       "seed": seed, "tokens": args.budget})],
                    "planning speculators' batches")


def read_metrics(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def last_checkpoint(save_path):
    eps = [int(d) for d in os.listdir(save_path) if d.isdigit()
           and os.path.exists(os.path.join(save_path, d, "model.safetensors"))] \
        if os.path.isdir(save_path) else []
    return os.path.join(save_path, str(max(eps))) if eps else None


def train_speculators(args, conv, arm):
    flags, not_mappable, mapping = arm_flags(args, conv, arm)
    # what speculators resolves these flags to (its defaults and derived defaults included);
    # its batch sampler then packs with that total_seq_len and seed
    flat = run_venv(args, "spec_train.py", ["-resolve-", "1", "--"] + flags,
                    f"resolving the {arm} flags (speculators' TrainConfig)")
    resolved = {k: flat.get(k) for k in RESOLVED_KEYS if k in flat}
    tsl, seed = flat["total_seq_len"], flat["seed"]
    longest = max(conv["lengths"])
    if longest > tsl:
        raise UserError(f"--data: a sequence of {longest} tokens is longer than the {arm} arm's "
                        f"--total-seq-len {tsl}: speculators would cut it")
    p = plan(args, conv, tsl, seed)
    adir = os.path.join(args.work, arm)
    if os.path.exists(adir):
        shutil.rmtree(adir)
    os.makedirs(adir)
    flags += ["--epochs", str(p["epochs"]), "--max-steps", str(p["steps"]),
              "--save-path", os.path.join(adir, "checkpoints"),
              "--log-dir", os.path.join(adir, "logs")]
    metrics = os.path.join(adir, "metrics.jsonl")
    cmd = [args.spec_python, os.path.join(SHIM_DIR, "spec_train.py"), metrics,
           str(args.threads), "--"] + flags
    resolved.update(epochs=p["epochs"], max_steps=p["steps"])
    with open(os.path.join(adir, "command.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    say(f"train {arm}", f"speculators' trainer: {p['steps']} steps ({p['epochs']} epochs of "
                        f"{p['batches_per_epoch']} packed batches of <= {tsl} tokens; "
                        f"{p['tokens']:,} training tokens); log {adir}/train.log")
    t0 = time.time()
    with open(os.path.join(adir, "train.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=adir,
                                env=venv_env(args.threads))
        shown = -1
        while proc.poll() is None:
            time.sleep(2)
            steps = [r for r in read_metrics(metrics) if "train" in r]
            if steps and steps[-1].get("global_step", -1) != shown:
                r = steps[-1]
                shown = r.get("global_step")
                say(f"train {arm}", f"step {shown + 1}/{p['steps']}: loss "
                                    f"{r['train'].get('loss', float('nan')):.3f}, "
                                    f"full_acc_0 {r['train'].get('full_acc_0', float('nan')):.3f} "
                                    f"({time.time() - t0:.0f} s)")
    wall = time.time() - t0
    if proc.returncode != 0:
        with open(os.path.join(adir, "train.log")) as f:
            tail = [l.strip() for l in f if l.strip()]
        last = next((l for l in reversed(tail) if "Error" in l or "error" in l),
                    tail[-1] if tail else "")
        raise UserError(f"speculators' trainer ({arm}) failed (rc {proc.returncode}): "
                        f"{last[:300]}; log {adir}/train.log")
    ckpt = last_checkpoint(os.path.join(adir, "checkpoints"))
    if ckpt is None:
        raise UserError(f"speculators' trainer ({arm}) wrote no checkpoint in {adir}/checkpoints")
    recs = read_metrics(metrics)
    tr = [r for r in recs if "train" in r]
    va = [r for r in recs if "val" in r]
    steps_run = (tr[-1]["global_step"] + 1) if tr else None
    say(f"train {arm}", f"done: {steps_run} steps in {wall:.0f} s, checkpoint {ckpt}")
    return {"flags": flags, "command": shlex.join(cmd), "resolved_config": resolved,
            "flag_mapping": mapping,
            "not_mappable": not_mappable, "plan": p, "steps_run": steps_run,
            "train_seconds": round(wall, 1), "checkpoint": ckpt,
            "last_train": tr[-1]["train"] if tr else None,
            "val": va[-1]["val"] if va else None,
            "seconds_per_step": round(wall / max(steps_run or 1, 1), 2)}


def offline_flag(args):
    """train.py reads the data's hidden-state shards when it has them (else the target runs)."""
    from dataset import load_dataset_dir
    manifest, _, _ = load_dataset_dir(args.data)
    return ["--offline"] if (manifest.get("hidden") or {}).get("shards") else []


def train_trainpy(args, conv):
    """This project's own train.py, same data, same token budget (its batches: train.batch_indices)."""
    from train_data import batch_indices
    a, _ = train_py_defaults(args)
    lengths_by_seq = {}
    for k, n in zip(conv["train_ids"] + conv["eval_ids"], conv["lengths"]):
        lengths_by_seq[k] = n
    lens = [lengths_by_seq[k] for k in range(len(lengths_by_seq))]
    steps = tokens = 0
    while tokens < args.budget:
        idx, _ = batch_indices(conv["train_ids"], steps, a.batch_size, args.seed, lens)
        tokens += sum(lens[k] for k in idx)
        steps += 1
    adir = os.path.join(args.work, "trainpy")
    if os.path.exists(adir):
        shutil.rmtree(adir)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data", args.data, "--out", adir,
           "--target", args.target_path, "--max-steps", str(steps), "--eval-every", str(steps),
           "--save-every", str(steps), "--threads", str(args.threads), "--no-progress",
           "--producer-threads", str(args.threads), "--eval-fraction", repr(args.eval_fraction),
           "--seed", str(args.seed), *offline_flag(args)]
    cmd += shlex.split(args.trainpy_flags)
    say("train trainpy", f"train.py: {steps} steps of {a.batch_size} sequences ({tokens:,} tokens)")
    t0 = time.time()
    os.makedirs(adir)
    with open(os.path.join(adir, "train.log"), "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    wall = time.time() - t0
    if p.returncode != 0:
        with open(os.path.join(adir, "train.log")) as f:
            tail = [l.strip() for l in f if l.strip()]
        raise UserError(f"train.py failed (rc {p.returncode}): {(tail or [''])[-1][:300]}; "
                        f"log {adir}/train.log")
    from rundir import list_checkpoints
    ckpt = list_checkpoints(adir)[-1]
    log_recs = [json.loads(l) for l in open(os.path.join(adir, "log.jsonl")) if l.strip()]
    ev = [r for r in log_recs if r.get("split") == "eval"]
    say("train trainpy", f"done: {steps} steps in {wall:.0f} s, checkpoint {ckpt}")
    return {"command": shlex.join(cmd), "plan": {"steps": steps, "tokens": tokens},
            "steps_run": steps, "train_seconds": round(wall, 1), "checkpoint": ckpt,
            "val": ev[-1] if ev else None, "seconds_per_step": round(wall / steps, 2)}


# ----------------------------------------------------------------------------------------------
# Step 3: this project's doctor and speculate.py on the result

def eval_prompts(args, conv):
    if args.prompts:
        src = args.prompts
    else:
        from dataset import load_dataset_dir
        from rundir import write_eval_prompts
        _, seqs, _ = load_dataset_dir(args.data)
        src = os.path.join(args.work, "src", "eval_prompts_all.jsonl")
        write_eval_prompts(args.data, seqs, conv["eval_ids"], src)
        if not os.path.exists(src) or not os.path.getsize(src):
            raise UserError(f"--data {args.data}: no conversations.jsonl to take held-out prompts "
                            f"from; give --prompts")
    with open(src) as f:
        lines = [l for l in f if l.strip()][:args.n_prompts]
    out = os.path.join(args.work, "src", "prompts.jsonl")
    with open(out, "w") as f:
        f.writelines(lines)
    return out, src, len(lines)


def run_project(cmd, log):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n{p.stdout}{p.stderr}")
    return p


def decode(args, conv, arm, ckpt, prompts):
    adir = os.path.join(args.work, arm)
    res = {}
    doc = run_project([sys.executable, os.path.join(ROOT, "model.py"), ckpt, "--doctor",
                       "--target", args.target_path], os.path.join(adir, "doctor.log"))
    lines = (doc.stdout + doc.stderr).splitlines()
    res["doctor_original"] = {"rc": doc.returncode,
                              "fail": [l for l in lines if l.startswith("FAIL ") or "error:" in l]}
    # (a sliding-window draft, speculators' default, is read as such: speculate.py runs it
    # within its window, where it is full attention, and refuses a longer context)
    draft = ckpt
    fails = res["doctor_original"]["fail"]
    say(f"decode {arm}", f"doctor: rc {res['doctor_original']['rc']}"
        + (f" ({len(fails)} FAIL/error lines)" if fails else ""))
    js = os.path.join(adir, "speculate.json")
    if os.path.exists(js):
        os.remove(js)
    cmd = [sys.executable, os.path.join(ROOT, "speculate.py"), "--draft", draft, "--target",
           args.target_path, "--check", "--dtype", "float32", "--prompts", prompts,
           "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps),
           "--threads", "1", "--quiet", "--json", js]
    t0 = time.time()
    p = run_project(cmd, os.path.join(adir, "speculate.log"))
    res["speculate_command"] = shlex.join(cmd)
    if p.returncode not in (0, 1) or not os.path.exists(js):
        last = ((p.stderr or p.stdout).strip().splitlines() or [""])[-1]
        raise UserError(f"speculate.py on {draft} failed (rc {p.returncode}): {last[:300]}; "
                        f"log {adir}/speculate.log")
    with open(js) as f:
        s = json.load(f)["summary"]
    res["speculate"] = {k: s.get(k) for k in ("prompts", "new_tokens", "rounds", "accept_length",
                                              "per_prompt_mean_accept_length",
                                              "position_acceptance", "mismatches",
                                              "tokens_per_s", "plain_tokens_per_s", "steps")}
    res["lossless"] = s.get("mismatches") == 0
    res["decode_seconds"] = round(time.time() - t0, 1)
    say(f"decode {arm}", f"accept length {s['accept_length']:.3f} over {s['prompts']} prompts "
                         f"({s['new_tokens']} tokens / {s['rounds']} rounds), "
                         f"{s['prompts'] - s.get('mismatches', 0)}/{s['prompts']} identical to "
                         f"the target's greedy decoding")
    return res


def held_out_replay(args, arm, ckpt):
    """The held-out replayed accept length (chain of 3) that train.py logs and results/levers.py
    compares, for any draft: train.py --init CKPT evaluates its start as step 0 on the same
    held-out split (--eval-fraction, --seed), before its one training step; only step 0 is read."""
    out = os.path.join(args.work, arm, "replay")
    if os.path.exists(out):
        shutil.rmtree(out)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data", args.data, "--out", out,
           "--target", args.target_path, "--init", ckpt, "--max-steps", "1", "--ttt-length", "3",
           "--eval-fraction", repr(args.eval_fraction), "--seed", str(args.seed), "--threads", "1",
           "--no-progress", "--batch-size", "8", *offline_flag(args)]
    p = run_project(cmd, os.path.join(args.work, arm, "replay.log"))
    recs = read_metrics(os.path.join(out, "log.jsonl"))
    start = [r for r in recs if r["split"] == "eval" and r["step"] == 0]
    if p.returncode != 0 or not start:
        last = ((p.stderr or p.stdout).strip().splitlines() or [""])[-1]
        raise UserError(f"train.py --init {ckpt} (the held-out replay) failed (rc {p.returncode}): "
                        f"{last[:300]}; log {args.work}/{arm}/replay.log")
    say(f"decode {arm}", f"held-out replayed accept length {start[0]['replay_accept_3']:.3f}")
    return {"replay_accept_3": start[0]["replay_accept_3"], "acc_j": start[0]["acc_j"],
            "replay_command": shlex.join(cmd)}


def mtbench(args, ckpt):
    """results/levers.py's MT-Bench N x 2 (chain 3/1/4, 128 tokens, fp32), cached by path in
    WORK/mtbenchN.json: the same prompts and decoding as the lever arms' column."""
    from levers import mtbench as levers_mtbench
    path = os.path.join(args.work, f"mtbench{args.mtbench}.json")
    cache = json.load(open(path)) if os.path.exists(path) else {}
    levers_mtbench([ckpt], args.mtbench, cache, args.target_path)
    atomic_write_text(path, json.dumps(cache, indent=1))
    return cache[ckpt]


# ----------------------------------------------------------------------------------------------
# The tiny case

def make_tiny_target(out):
    """A tiny random Llama (tests/conftest.py make_tiny_target: hidden 32, 8 layers) with the
    default target's tokenizer, saved with save_pretrained, and 40 short prompts next to it."""
    import random
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import make_tiny_target as make
    from common import resolve_target
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_target("default"))
    m = make(vocab_size=tok.vocab_size, layers=8, eos_token_id=2)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    r = random.Random(0)
    words = "the a cat dog sun rain code list sort tree river blue seven write explain why how".split()
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for _ in range(40):
            f.write(json.dumps({"prompt": " ".join(r.choice(words) for _ in range(r.randint(4, 12)))})
                    + "\n")
    print(f"{out}: tiny target and {out}/prompts.jsonl; next:\n"
          f"  python generate.py --target {out} --prompts {out}/prompts.jsonl --out DATA "
          f"--temperature 0 --max-new-tokens 48 --draft-vocab-size 512 --fill-vocab --hidden-states")


# ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", help="generate.py data directory")
    ap.add_argument("--target", default=None, help="target (default: the manifest's)")
    ap.add_argument("--work", default=None,
                    help=f"work directory (default {WORK_ROOT}/<data name>-speculators)")
    ap.add_argument("--spec-python", default=SPEC_PYTHON,
                    help="python of the virtualenv holding speculators==0.9.0")
    ap.add_argument("--arms", default="defaults,ours", help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--stages", default="convert,train,decode", help="comma list")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=float, default=None,
                   help="token budget in epochs of train.py's training split (default train.py's "
                        "--epochs)")
    g.add_argument("--tokens", type=int, default=None, help="token budget per arm")
    ap.add_argument("--eval-fraction", type=float, default=None, help="default train.py's")
    ap.add_argument("--seed", type=int, default=None, help="train.py's split seed (default its)")
    ap.add_argument("--hs-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the hidden states written for speculators")
    ap.add_argument("--target-dtype", default="float32", help="the target's dtype for the forward")
    ap.add_argument("--target-batch-size", type=int, default=8)
    ap.add_argument("--aux-from", default="auto", choices=["auto", "shards", "target"],
                    help="captured layers from the data's shards (auto: when it has them) or "
                         "recomputed by the target")
    ap.add_argument("--loss-mask", default="assistant", choices=["assistant", "train-py"],
                    help="assistant: generate.py's mask as is (speculators' own convention); "
                         "train-py: shifted so speculators' loss rows are train.py's")
    ap.add_argument("--defaults-flags", default="", help="extra speculators flags, defaults arm")
    ap.add_argument("--ours-flags", default="", help="extra speculators flags, ours arm")
    ap.add_argument("--trainpy-flags", default="",
                    help="train.py flags of the trainpy arm; the ours arm maps the same settings")
    ap.add_argument("--prompts", default=None, help="JSONL prompts (default: the held-out split)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="speculate.py --steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--replay", action="store_true",
                    help="decode: also the held-out replayed accept length (train.py's eval)")
    ap.add_argument("--mtbench", type=int, default=0, metavar="N",
                    help="decode: also MT-Bench N x 2 as results/levers.py decodes it")
    ap.add_argument("--force", action="store_true", help="redo the conversion")
    ap.add_argument("--summary", default=None, help="default WORK/summary.json")
    ap.add_argument("--make-tiny-target", metavar="DIR", default=None,
                    help="only write a tiny target (+ prompts) to DIR and exit")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.make_tiny_target:
        return make_tiny_target(args.make_tiny_target)
    if not args.data:
        raise UserError("--data: required (a generate.py directory)")
    if not os.path.isdir(args.data):
        raise UserError(f"--data {args.data}: no such directory")
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise UserError(f"--arms {args.arms}: expected a comma list of {', '.join(ARMS)}")
    stages = [s for s in args.stages.split(",") if s]
    if not stages or any(s not in ("convert", "train", "decode") for s in stages):
        raise UserError(f"--stages {args.stages}: expected a comma list of convert, train, decode")
    if any(a != "trainpy" for a in arms) and not os.access(args.spec_python, os.X_OK):
        raise UserError(f"--spec-python {args.spec_python}: not an executable (the virtualenv "
                        f"with speculators==0.9.0, tests/fixtures/speculators/make_fixture.py)")
    for name in ("n_prompts", "max_new_tokens", "steps", "threads", "target_batch_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    from common import resolve_target
    from dataset import load_dataset_dir
    manifest, _, _ = load_dataset_dir(args.data)
    a, _ = train_py_defaults(args)
    args.eval_fraction = a.eval_fraction if args.eval_fraction is None else args.eval_fraction
    args.seed = a.seed if args.seed is None else args.seed
    args.target_path = os.path.abspath(resolve_target(args.target or manifest["target"])) \
        if os.path.isdir(resolve_target(args.target or manifest["target"])) else None
    if args.target_path is None:
        raise UserError(f"--target {args.target or manifest['target']}: speculators' trainer "
                        f"reads the verifier's files offline; give a local model directory")
    args.work = os.path.abspath(args.work or os.path.join(
        WORK_ROOT, os.path.basename(os.path.normpath(args.data)) + "-speculators"))
    data_real = os.path.realpath(args.data)
    if os.path.realpath(args.work) == data_real or \
            os.path.realpath(args.work).startswith(data_real + os.sep):
        raise UserError(f"--work {args.work}: is (inside) the data directory; choose another")
    if os.path.realpath(args.work).startswith(os.path.realpath(ROOT) + os.sep):
        raise UserError(f"--work {args.work}: inside the git tree; choose a directory outside it")
    os.makedirs(args.work, exist_ok=True)
    summary_path = args.summary or os.path.join(args.work, "summary.json")
    summary = {}
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    summary.update({"data": os.path.abspath(args.data), "target": args.target_path,
                    "work": args.work, "speculators_python": args.spec_python})

    def save():
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)

    t_all = time.time()
    if "convert" in stages or not os.path.exists(os.path.join(args.work, "convert.json")):
        conv = convert(args)
    else:
        with open(os.path.join(args.work, "convert.json")) as f:
            conv = json.load(f)
    if summary.get("convert_key") != conv["key"]:
        summary["arms"] = {}          # results on other data (or another split) are not kept
    summary["convert_key"] = conv["key"]
    summary["convert"] = {k: v for k, v in conv.items()
                          if k not in ("lengths", "train_ids", "eval_ids", "key")}
    if args.tokens is not None:
        args.budget = args.tokens
    else:
        ep = a.epochs if args.epochs is None else args.epochs
        args.budget = max(1, round(ep * conv["train_tokens"]))
    if args.budget < 1:
        raise UserError(f"--tokens {args.budget}: expected >= 1")
    summary["budget_tokens"] = args.budget
    save()
    arms_out = summary.setdefault("arms", {})
    prompts = None
    for arm in arms:
        rec_file = os.path.join(args.work, arm, "train_record.json")
        r = {}
        if "train" in stages:
            r = train_speculators(args, conv, arm) if arm != "trainpy" else train_trainpy(args, conv)
            r["convert_key"] = conv["key"]
            with open(rec_file, "w") as f:
                json.dump(r, f, indent=1)
            arms_out[arm] = r
            save()
        elif os.path.exists(rec_file):        # trained by an earlier run of this script
            with open(rec_file) as f:
                r = json.load(f)
            if r.get("convert_key") != conv["key"]:
                raise UserError(f"{rec_file}: trained on another conversion of the data; run "
                                f"--stages train again")
        if "decode" in stages:
            if not r.get("checkpoint"):       # trained by an earlier run of this script
                d = os.path.join(args.work, arm)
                if arm == "trainpy":
                    from rundir import list_checkpoints
                    ck = list_checkpoints(d) if os.path.isdir(d) else []
                    r["checkpoint"] = ck[-1] if ck else None
                else:
                    r["checkpoint"] = last_checkpoint(os.path.join(d, "checkpoints"))
            if not r.get("checkpoint"):
                raise UserError(f"--stages decode: arm {arm} has no trained checkpoint in "
                                f"{summary_path}; run --stages train first")
            if prompts is None:
                prompts, src, n = eval_prompts(args, conv)
                summary["prompts"] = {"file": prompts, "from": src, "count": n,
                                      "max_new_tokens": args.max_new_tokens, "steps": args.steps}
            r.update(decode(args, conv, arm, r["checkpoint"], prompts))
            if args.replay:
                r.update(held_out_replay(args, arm, r["checkpoint"]))
            if args.mtbench:
                r[f"mtbench{args.mtbench}"] = mtbench(args, r["checkpoint"])
            arms_out[arm] = r
            save()
    summary["seconds"] = round(time.time() - t_all, 1)
    save()
    print(json.dumps({arm: {"accept_length": (r.get("speculate") or {}).get("accept_length"),
                            "lossless": r.get("lossless"), "steps": r.get("steps_run"),
                            "train_seconds": r.get("train_seconds")}
                      for arm, r in arms_out.items() if arm in arms}, indent=1))
    say("done", f"summary {summary_path}")


if __name__ == "__main__":
    run_main(main)
