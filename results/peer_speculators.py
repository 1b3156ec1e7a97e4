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
    W/speculators_shim/ (below), once per arm:
      defaults  speculators' own defaults (Muon, lr 1e-3, linear decay, 1% warmup, TTT 3 with step
                decay 1.0, kl_div, norm_before_fc + norm_output + norm_before_residual, frozen
                lm_head from the target, sliding-window layer of 2048, packed batches of 8192
                tokens, bf16 autocast);
      ours      as close to train.py's defaults (read from train.parse_args here) as its flags
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

Decoding a defaults-arm draft: its layer is sliding-window (transformer_layer_config
use_sliding_window / layer_types, window 2048), which this project refuses by name
(draft_config.py FIXED_KEYS, the doctor's config.json FAIL). When the window covers every
context decoded (longest prompt + new tokens), sliding-window attention is full attention, so a
copy of the checkpoint whose config.json says full attention (tensors symlinked, unchanged) is
decoded instead; the summary says so ("decode_note"). Positions: speculators trains row p at RoPE
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

from common import UserError, run_main  # noqa: E402

SPEC_PYTHON = "/root/scratch/spec-venv/bin/python"
WORK_ROOT = "/root/scratch/peer"
ARMS = ("defaults", "ours", "trainpy")
SPEC_DATA = "spec-data"
SHIM_DIR = "speculators_shim"
# the fields of speculators' resolved run.yaml worth having in the summary
RESOLVED_KEYS = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay",
                 "scheduler_type", "scheduler_warmup_steps", "scheduler_warmup_ratio", "ttt_steps",
                 "ttt_step_loss_decay", "loss_fn", "loss_implementation", "norm_before_fc",
                 "norm_output", "norm_before_residual", "fc_norm", "embed_requires_grad",
                 "sliding_window", "full_attention_indices", "draft_attn_impl", "total_seq_len",
                 "hidden_states_dtype", "train_data_ratio", "target_layer_ids", "draft_vocab_size",
                 "epochs", "max_steps", "seed", "num_layers")


def say(stage, msg):
    print(f"[{stage}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# What runs in the speculators virtualenv (written into W/speculators_shim/)

CPU_SHIM = r'''
"""CPU shim for speculators 0.9.0's trainer (results/peer_speculators.py says why, file:line).
Patches objects at run time; no file of speculators is changed. Does nothing on a machine with
an accelerator."""
import json
import logging
import time

import torch


def install(metrics_path=None):
    if torch.accelerator.current_accelerator() is None:
        # train/trainer.py:80,92: _StepTimer.mark/now synchronize; raises without an accelerator
        torch.accelerator.synchronize = lambda *a, **k: None
        import speculators.train.trainer as trainer
        # train/trainer.py:348,533,643: .to(self.local_rank) with local_rank 0 means cuda:0
        trainer.get_local_rank = lambda: torch.device("cpu")
        orig_init = trainer.Trainer.__init__

        def init(self, *a, **k):
            orig_init(self, *a, **k)
            # train/trainer.py:228: "cuda" when there is no accelerator (autocast device type)
            self.device_type = "cpu"
        trainer.Trainer.__init__ = init
    if metrics_path:
        import speculators.train.cli as cli
        orig_setup = cli.setup_metric_logger

        class Jsonl(logging.Handler):
            def __init__(self):
                super().__init__()
                self.f = open(metrics_path, "a")

            def emit(self, record):
                if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
                    self.f.write(json.dumps({"time": time.time(), **record.msg}, default=float) + "\n")
                    self.f.flush()

        def setup(*a, **k):
            orig_setup(*a, **k)              # dictConfig: our handler must come after it
            logging.getLogger("speculators.metrics").addHandler(Jsonl())
        cli.setup_metric_logger = setup
'''

SPEC_TRAIN = r'''
"""speculators' own `speculators train` (cli/train.py: main(TrainConfig.resolve(args))), behind
cpu_shim. Usage: spec_train.py METRICS_JSONL THREADS -- <speculators train flags>
(METRICS_JSONL "-resolve-": print the fully resolved flat config as JSON and exit)"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import cpu_shim  # noqa: E402

metrics, threads = sys.argv[1], int(sys.argv[2])
assert sys.argv[3] == "--"
torch.set_num_threads(threads)
cpu_shim.install(metrics)
from importlib.metadata import version  # noqa: E402
assert version("speculators") == "0.9.0", version("speculators")
from speculators.train.cli import main  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

cfg = TrainConfig.resolve(sys.argv[4:])
if metrics == "-resolve-":
    import json
    print(json.dumps(cfg.flatten(), default=str))
    sys.exit(0)
main(cfg)
'''

SPEC_ARROW = r'''
"""rows.jsonl (input_ids, loss_mask, seq_len) -> the Arrow data set speculators' ArrowDataset
reads (as cli/prepare_data.py writes it: set_format("torch") then save_to_disk)."""
import json
import sys

import torch
from datasets import Dataset, load_from_disk

src, out = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(src)]
cols = {k: [r[k] for r in rows] for k in ("input_ids", "loss_mask", "seq_len")}
ds = Dataset.from_dict(cols)
ds.set_format(type="torch")
ds.save_to_disk(out)
back = load_from_disk(out)
assert len(back) == len(rows)
for i in (0, len(rows) - 1):
    assert isinstance(back[i]["input_ids"], torch.Tensor), type(back[i]["input_ids"])
    assert back[i]["input_ids"].tolist() == rows[i]["input_ids"]
    assert back[i]["loss_mask"].tolist() == rows[i]["loss_mask"]
print(json.dumps({"rows": len(back), "columns": back.column_names}))
'''

SPEC_PLAN = r'''
"""How many of speculators' packed batches (its own MultipackDistributedBatchSamplerV2, as
train/dataloader.py builds it for the training split) hold a token budget: JSON in, JSON out."""
import json
import sys

from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

p = json.loads(sys.argv[1])
lengths = p["lengths"]
s = MultipackDistributedBatchSamplerV2(batch_max_length=p["total_seq_len"], lengths=lengths,
                                       num_replicas=1, rank=0, seed=p["seed"])
steps = tokens = epoch = 0
per_epoch = []
while tokens < p["tokens"]:
    s.set_epoch(epoch)
    batches = list(iter(s))
    per_epoch.append(len(batches))
    for b in batches:
        tokens += sum(min(lengths[i], p["total_seq_len"]) for i in b)
        steps += 1
        if tokens >= p["tokens"]:
            break
    epoch += 1
print(json.dumps({"steps": steps, "epochs": epoch, "tokens": tokens,
                  "batches_per_epoch": per_epoch[0], "total_seq_len": p["total_seq_len"]}))
'''


def write_shim(work):
    d = os.path.join(work, SHIM_DIR)
    os.makedirs(d, exist_ok=True)
    for name, text in (("cpu_shim.py", CPU_SHIM), ("spec_train.py", SPEC_TRAIN),
                       ("spec_arrow.py", SPEC_ARROW), ("spec_plan.py", SPEC_PLAN)):
        with open(os.path.join(d, name), "w") as f:
            f.write(text.lstrip())
    return d


def venv_env(threads):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), COLUMNS="160", TERM="dumb", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)     # nothing of this project in the venv, nothing of it here
    return env


def run_venv(args, script, argv, what, log=None):
    """Run a helper in the speculators venv; its last stdout line is JSON. One-line error."""
    cmd = [args.spec_python, os.path.join(args.work, SHIM_DIR, script)] + argv
    p = subprocess.run(cmd, capture_output=True, text=True, env=venv_env(args.threads),
                       cwd=args.work)
    if log:
        with open(log, "w") as f:
            f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"--spec-python {args.spec_python}: {what} failed (rc {p.returncode}): "
                        f"{last[:300]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# Step 1: the data, in speculators' offline format

def prenorm_states(target, seqs, layer_ids, batch_size):
    """For each token-id list: (aux [T, n*Ht] = outputs of decoder layers `layer_ids`, pre [T, Ht]
    = the last decoder layer's output before the final norm, post [T, Ht] = transformers'
    hidden_states[-1]), in the target's dtype on CPU, plus whether norm(pre) == post held exactly
    on every batch (it says hidden_states[-1] is after the norm, so `pre` is the state before it).
    Batched longest first with right padding, as hidden.target_hidden_states."""
    import torch
    decoder = target.base_model
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise UserError(f"--target: {type(decoder).__name__} has no final norm module `norm`; "
                        f"cannot capture the state before it")
    got = {}
    hook = norm.register_forward_pre_hook(lambda m, a: got.__setitem__("pre", a[0]))
    dev = next(target.parameters()).device
    order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k]))
    out, exact = [None] * len(seqs), True
    try:
        with torch.inference_mode():
            for s in range(0, len(order), batch_size):
                idx = order[s:s + batch_size]
                lens = [len(seqs[k]) for k in idx]
                T = max(lens)
                ids = torch.zeros((len(idx), T), dtype=torch.long)
                mask = torch.zeros((len(idx), T), dtype=torch.long)
                for r, k in enumerate(idx):
                    ids[r, :lens[r]] = torch.as_tensor(seqs[k])
                    mask[r, :lens[r]] = 1
                got.clear()
                res = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                              output_hidden_states=True, use_cache=False)
                hs = res.hidden_states
                if "pre" not in got:
                    raise UserError("--target: the final norm was never called in a forward")
                pre, post = got.pop("pre"), hs[-1]
                exact &= bool(torch.equal(norm(pre), post)) and not bool(torch.equal(pre, post))
                aux = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
                for r, k in enumerate(idx):
                    n = lens[r]
                    out[k] = (aux[r, :n].cpu().clone(), pre[r, :n].cpu().clone(),
                              post[r, :n].cpu().clone())
    finally:
        hook.remove()
    return out, exact


def rel_err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def data_key(args, manifest):
    st = os.stat(os.path.join(args.data, "manifest.json"))
    return {"data": os.path.abspath(args.data), "manifest_mtime": st.st_mtime,
            "num_sequences": manifest["num_sequences"], "eval_fraction": args.eval_fraction,
            "seed": args.seed, "hs_dtype": args.hs_dtype, "target_dtype": args.target_dtype,
            "aux_from": args.aux_from, "loss_mask": args.loss_mask, "target": args.target_path}


def convert(args):
    """generate.py directory -> W/spec-data (module docstring, step 1). Returns the record."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from common import load_target, parse_dtype
    from hidden import hidden_states_for
    from train_data import read_data, split_data
    t0 = time.time()
    manifest, seqs, vocab = read_data(args.data)
    rec_path = os.path.join(args.work, "convert.json")
    key = data_key(args, manifest)
    out = os.path.join(args.work, SPEC_DATA)
    if not args.force and os.path.exists(rec_path):
        with open(rec_path) as f:
            rec = json.load(f)
        if rec.get("key") == key and os.path.isdir(os.path.join(out, "hidden_states")):
            say("convert", f"reusing {out} (same data and settings; --force redoes it)")
            return rec
    ids_ours = list(manifest["aux_layer_ids"])
    train_ids, eval_ids = split_data(len(seqs), args.eval_fraction, args.seed)
    if not eval_ids:
        raise UserError(f"--eval-fraction {args.eval_fraction}: speculators' trainer needs a "
                        f"validation split (train_data_ratio < 1); use > 0")
    rows = train_ids + eval_ids
    n, n_train = len(rows), len(train_ids)
    ratio = (n_train + 0.5) / n
    assert int(n * ratio) == n_train, (n, n_train, ratio)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(args.work, "src"), exist_ok=True)
    shift = args.loss_mask == "train-py"
    rows_path = os.path.join(args.work, "src", "rows.jsonl")
    with open(rows_path, "w") as f:
        for k in rows:
            s = seqs[k]
            m = [int(x) for x in s["loss_mask"]]
            if shift:   # speculators counts row r if x[r+1] is masked; train.py if x[r+2] is
                m = m[1:] + [0]
            f.write(json.dumps({"input_ids": s["input_ids"], "loss_mask": m,
                                "seq_len": len(s["input_ids"])}) + "\n")
    say("convert", f"{n} sequences ({n_train} train.py training sequences first, {n - n_train} "
                   f"held out last; --train-data-ratio {ratio:.6f}); writing the Arrow data set")
    arrow = run_venv(args, "spec_arrow.py", [rows_path, out], "writing the Arrow data set")

    # the hidden states: the shards' aux (what train.py --offline reads) or the target's, and
    # the pre-norm final state, always from the target
    has_shards = bool((manifest.get("hidden") or {}).get("shards"))
    aux_from = args.aux_from if args.aux_from != "auto" else ("shards" if has_shards else "target")
    if aux_from == "shards" and not has_shards:
        raise UserError(f"--aux-from shards: {args.data} has no hidden-state shards "
                        f"(generate.py --hidden-states)")
    say("convert", f"loading target {args.target_path} ({args.target_dtype}) for the final "
                   f"pre-norm states; captured layers from the {aux_from}")
    target, _ = load_target(args.target_path, args.target_dtype)
    hd = parse_dtype(args.hs_dtype)
    hdir = os.path.join(out, "hidden_states")
    os.makedirs(hdir)
    exact_all, worst_aux, worst_final, done, tok = True, 0.0, 0.0, 0, 0
    chunk = max(args.target_batch_size * 8, 64)
    for c in range(0, n, chunk):
        part = rows[c:c + chunk]
        res, exact = prenorm_states(target, [seqs[k]["input_ids"] for k in part], ids_ours,
                                    args.target_batch_size)
        exact_all &= exact
        for j, (k, (aux, pre, post)) in enumerate(zip(part, res)):
            if has_shards:
                s_aux, s_final = hidden_states_for(args.data, manifest, k)
                if s_aux.shape != aux.shape or s_final.shape != post.shape:
                    raise UserError(f"{args.data}: shard of sequence {k} holds aux "
                                    f"{list(s_aux.shape)} / final {list(s_final.shape)}, the "
                                    f"target gives {list(aux.shape)} / {list(post.shape)}")
                worst_aux = max(worst_aux, rel_err(s_aux, aux))
                worst_final = max(worst_final, rel_err(s_final, post))
                if aux_from == "shards":
                    aux = s_aux
            T, H = pre.shape
            hs = torch.cat([aux.to(hd).reshape(T, len(ids_ours), H), pre.to(hd).unsqueeze(1)], 1)
            save_file({"hidden_states": hs.contiguous(),
                       "token_ids": torch.as_tensor(seqs[k]["input_ids"], dtype=torch.long)},
                      os.path.join(hdir, f"hs_{c + j}.safetensors"))
            tok += T
        done += len(part)
        say("convert", f"hidden states {done}/{n} sequences ({tok:,} tokens)")
    del target
    if not exact_all:
        raise UserError(f"--target {args.target_path}: norm(state before the final norm) is not "
                        f"transformers' hidden_states[-1] here; the 'final before norm' state "
                        f"cannot be told apart, nothing written")
    # bf16 shards against an fp32 forward differ by ~2^-8 of a value; a different target or
    # different data by O(1)
    if has_shards and max(worst_aux, worst_final) > 0.1:
        raise UserError(f"{args.data}/hidden: the stored states differ from the target's by up to "
                        f"{max(worst_aux, worst_final):.3g} (relative): not this target's (or "
                        f"--target-dtype {args.target_dtype} is not the one they were made in)")
    V, Vd = manifest["vocab_size"], manifest["draft_vocab_size"]
    d2t = vocab["d2t"].long().numpy()
    t2d = vocab["t2d"].bool().numpy()
    np.save(os.path.join(out, f"d2t-{Vd}.npy"), d2t)
    np.save(os.path.join(out, f"t2d-{Vd}.npy"), t2d)
    lengths = [len(seqs[k]["input_ids"]) for k in rows]
    rec = {
        "key": key, "spec_data": out, "arrow": arrow, "num_rows": n, "train_rows": n_train,
        "val_rows": n - n_train, "train_data_ratio": ratio,
        "train_tokens": sum(lengths[:n_train]), "lengths": lengths,
        "train_ids": train_ids, "eval_ids": eval_ids,
        "loss_mask": ("assistant tokens, shifted left by one (speculators then counts the rows "
                      "train.py counts)" if shift else "assistant tokens (generate.py's mask, as "
                      "speculators' prepare_data writes it)"),
        "loss_tokens": sum(sum(seqs[k]["loss_mask"]) for k in rows),
        "hidden_states": {"shape": f"[T, {len(ids_ours) + 1}, {manifest.get('hidden_size')}]",
                          "dtype": args.hs_dtype, "aux_from": aux_from,
                          "final": "last decoder layer's output before the final norm "
                                   "(forward pre-hook on the final norm)",
                          "norm_of_pre_equals_hidden_states_minus_1_exactly": exact_all,
                          "shards_vs_target_rel_err": ({"aux": worst_aux, "final_post_norm": worst_final}
                                                       if has_shards else None)},
        "aux_layer_ids": {"this_project_output_of_layer": ids_ours,
                          "speculators_input_of_layer": [i + 1 for i in ids_ours]},
        "draft_vocab_size": Vd, "vocab_size": V,
        "vocab_files": [f"d2t-{Vd}.npy", f"t2d-{Vd}.npy"],
        "seconds": round(time.time() - t0, 1),
    }
    with open(rec_path, "w") as f:
        json.dump(rec, f, indent=1)
    say("convert", f"done in {rec['seconds']} s: {out} ({tok:,} tokens; pre-norm check exact: "
                   f"{exact_all}" + (f"; shards vs target: aux {worst_aux:.2g}, final "
                                     f"{worst_final:.2g} relative" if has_shards else "") + ")")
    return rec


# ----------------------------------------------------------------------------------------------
# Step 2: speculators' trainer, two flag sets, one token budget

def train_py_defaults():
    """train.py's defaults, read from its own parser (so the mapping follows it)."""
    from train import parse_args
    from ttt import LOSS_DECAY
    a = parse_args(["--data", "D", "--out", "O"])
    return a, LOSS_DECAY


def cuda_available():
    """On a GPU speculators runs as it ships (flex attention, Triton losses; cpu_shim does
    nothing there); only on a CPU do the two CPU flags below replace them."""
    import torch
    return torch.cuda.is_available()


def arm_flags(args, conv, arm):
    """(speculators flags of this arm, what train.py does that no flag expresses, the mapping)."""
    from common import resolve_dtype
    a, decay = train_py_defaults()
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
        return common + shlex.split(args.defaults_flags), [], {}
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
    cmd = [args.spec_python, os.path.join(args.work, SHIM_DIR, "spec_train.py"), metrics,
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


def train_trainpy(args, conv):
    """This project's own train.py, same data, same token budget (its batches: train.batch_indices)."""
    from train_data import batch_indices
    a, _ = train_py_defaults()
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
    from dataset import load_dataset_dir
    manifest, _, _ = load_dataset_dir(args.data)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data", args.data, "--out", adir,
           "--target", args.target_path, "--max-steps", str(steps), "--eval-every", str(steps),
           "--save-every", str(steps), "--threads", str(args.threads), "--no-progress",
           "--producer-threads", str(args.threads), "--eval-fraction", repr(args.eval_fraction),
           "--seed", str(args.seed)]
    if (manifest.get("hidden") or {}).get("shards"):
        cmd.append("--offline")
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

def decode_view(args, conv, arm, ckpt):
    """A speculators draft with a sliding-window layer (its default) whose window covers every
    context decoded here is exactly a full-attention draft: such a copy, config edited and
    nothing else, is what this project can load (draft_config.py refuses sliding windows).
    Returns (directory to decode, note or None)."""
    with open(os.path.join(ckpt, "config.json")) as f:
        d = json.load(f)
    tl = d.get("transformer_layer_config") or {}
    types = tl.get("layer_types") or []
    if not (tl.get("use_sliding_window") or any(t != "full_attention" for t in types)):
        return ckpt, None
    win = tl.get("sliding_window")
    need = args.longest_prompt + args.max_new_tokens + args.steps + 1
    if not isinstance(win, int) or win < need:
        raise UserError(f"{ckpt}/config.json: sliding window {win} is shorter than the longest "
                        f"context decoded here ({need} tokens): this project has no sliding-window "
                        f"attention to decode it exactly")
    view = os.path.join(args.work, arm, "decode-draft")
    if os.path.exists(view):
        shutil.rmtree(view)
    os.makedirs(view)
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(ckpt, name), os.path.join(view, name))
    tl = dict(tl, use_sliding_window=False, layer_types=["full_attention"] * len(types or [0]))
    tl.pop("sliding_window", None)
    d = dict(d, transformer_layer_config=tl)
    with open(os.path.join(view, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    return view, (f"speculators' draft has sliding-window attention (window {win}); every "
                  f"context decoded here is <= {need} tokens, inside the window, so the decoded "
                  f"copy {view} says full attention (config only; the tensors are the checkpoint's)")


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
    # the longest prompt as speculate.py renders it (common.read_prompts, chat_prompt_ids)
    from common import chat_prompt_ids, load_tokenizer, read_prompts
    tok = load_tokenizer(args.target_path)
    args.longest_prompt = max(len(chat_prompt_ids(tok, m)) for m in read_prompts(out))
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
    draft, note = decode_view(args, conv, arm, ckpt)
    if draft != ckpt:
        doc = run_project([sys.executable, os.path.join(ROOT, "model.py"), draft, "--doctor",
                           "--target", args.target_path], os.path.join(adir, "doctor-view.log"))
        lines = (doc.stdout + doc.stderr).splitlines()
        res["doctor_decoded"] = {"rc": doc.returncode,
                                 "fail": [l for l in lines if l.startswith("FAIL ") or "error:" in l]}
    res["decoded_draft"], res["decode_note"] = draft, note
    fails = res["doctor_original"]["fail"]
    say(f"decode {arm}", f"doctor: rc {res['doctor_original']['rc']}"
        + (f" ({len(fails)} FAIL/error lines)" if fails else "")
        + (f"; decoding {draft}" if draft != ckpt else ""))
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
    ap.add_argument("--trainpy-flags", default="", help="extra train.py flags, trainpy arm")
    ap.add_argument("--prompts", default=None, help="JSONL prompts (default: the held-out split)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="speculate.py --steps")
    ap.add_argument("--threads", type=int, default=1)
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
    a, _ = train_py_defaults()
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
    write_shim(args.work)
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
