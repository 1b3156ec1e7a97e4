"""
Train an EAGLE-3 draft head with training-time test (TTT), sharded with FSDP2.

    python train.py --data DIR --out runs/NAME [--offline] [--ttt-length 7] [--batch-size 8]
        [--epochs 1 | --max-steps N] [--lr 1e-4] [--dtype bfloat16] [--resume]
    torchrun --nproc_per_node N train.py ...          # data parallel, same results at the same batch

DIR is a data set written by generate.py (manifest.json, sequences.jsonl, vocab.safetensors and,
for --offline, hidden/shard-*.safetensors). Online (the default) a producer process runs the target
next to the trainer and hands its hidden states over through a bounded queue.

The math of one step (TTT, the loss, the metrics) is ttt.py; this file is everything around it.

The run directory (rundir.py) holds log.jsonl, curves.png and checkpoints/step-NNNNNN/ (config.json
+ model.safetensors, which SGLang and speculate.py load directly, plus trainer_state.pt for --resume).
"""
import argparse
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from common import UserError, run_main
from draft_init import init_fc_for_features, init_layer_from_target, init_lm_head
from hidden import Offline, Online
from optim import make_optimizers
from train_data import (batch_indices, check_data, collate, eval_batches_for, loss_positions,
                        rank_share, read_data, split_data)
from rundir import (best_so_far, list_checkpoints, load_checkpoint, save_best, save_checkpoint,
                    truncate_log, write_eval_prompts, write_plots)
from ttt import (LOSS_DECAY, TTTLoss, metrics, noisy_features, replay_decoding, shift_left, target_side,
                 top_k_labels, valid_rows)


# ----------------------------------------------------------------------------------------------
# Distributed setup

def setup_dist(device):
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` is a world of one (a HashStore,
    no ports). gloo on CPU, nccl on GPU."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return rank, world, device


def all_sum(x):
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


# ----------------------------------------------------------------------------------------------
# main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train an EAGLE-3 draft with training-time test.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", required=True, help="data directory written by generate.py")
    ap.add_argument("--out", required=True, help="run directory (log, plots, checkpoints)")
    ap.add_argument("--target", default=None, help="target model; default: the manifest's")
    ap.add_argument("--offline", action="store_true", help="read stored hidden states instead "
                    "of running the target concurrently")
    ap.add_argument("--fc-init", default="rms", choices=["rms", "normal"],
                    help="fc's initialisation: scaled to the captured layers' RMS so fc(aux) "
                         "starts at RMS ~1 (rms, measured better), or plain std 0.02 (normal)")
    ap.add_argument("--init", default=None, help="start from this draft directory's weights")
    ap.add_argument("--lm-head-init", default="random", choices=["random", "target"],
                    help="a new draft's lm_head: std-0.02 random, or the target's lm_head rows for "
                         "the draft vocabulary (both read a final-normed H-wide state)")
    ap.add_argument("--layer-init-from", type=int, default=None, metavar="L",
                    help="a new draft's decoder layer starts from the target's layer L (-1: the "
                         "last): MLP, o_proj, norms and the feature half of q/k/v")
    ap.add_argument("--freeze-lm-head", action="store_true",
                    help="keep lm_head fixed (with --lm-head-init target or --init): Vd*H fewer "
                         "trainable parameters, no lm_head gradient")
    ap.add_argument("--ttt-loss-rows", default="all", choices=["all", "chain"],
                    help="all: every valid row at every TTT step; chain: step j only on rows whose "
                         "steps 0..j-1 were right, the rows a greedy chain reaches (GRIFFIN-style)")
    ap.add_argument("--loss-positions", default="assistant", choices=["assistant", "all"],
                    help="training only: which positions the TTT loss reads. assistant: the "
                    "answers (the loss mask); all: every real token, prompts too, each labelled "
                    "by the target's own distribution there (the held-out eval stays assistant)")
    ap.add_argument("--ttt-decay", type=float, default=LOSS_DECAY, metavar="D",
                    help="TTT step j's loss weighs D**j (the reported loss keeps 0.8**j)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                    help="muon: torch.optim.Muon on the 2D weight matrices (fc, attention, MLP), "
                    "AdamW on the rest (lm_head, norms), both at --lr")
    ap.add_argument("--muon-lr", type=float, default=None, metavar="LR",
                    help="with --optimizer muon: Muon's lr (default: --lr); --lr stays AdamW's "
                    "(lm_head, norms)")
    ap.add_argument("--feature-noise", type=float, default=0.0, metavar="STD",
                    help="training only: add Gaussian noise of STD x each captured layer's RMS "
                    "to the target features (the target's states at decode time are not the "
                    "training set's)")
    ap.add_argument("--distill-topk", type=int, default=0, metavar="K",
                    help="training only: the target's distribution cut to its K most likely "
                    "draft tokens and renormalised (1: hard argmax labels; 0: the full soft label)")
    ap.add_argument("--draft-config", default=None,
                    help="JSON draft config whose shape fields (heads, head_dim, MLP size, RoPE, "
                         "max positions) and layout options (fc_norm, norm_before_fc, norm_output, "
                         "num_hidden_layers) replace the automatic choice (see model.py)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run Python code shipped with the target (Kimi-K2's model and tokenizer)")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    ap.add_argument("--ttt-length", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--max-steps", type=int, default=None, help="overrides --epochs")
    ap.add_argument("--accept-loss", type=float, default=0.0, metavar="W",
                    help="add W x -log sum_x min(p, q) (acceptance) to the soft cross-entropy")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, share of --lr")
    ap.add_argument("--warmup", type=float, default=0.015, help="warmup share of the steps")
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="decoupled, on AdamW and Muon alike; the measured recipe uses 0.3 "
                         "(README, Lever ablations)")
    ap.add_argument("--grad-clip", type=float, default=0.5,
                    help="largest gradient norm of a step (inf: no clipping)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="autocast dtype of the draft's compute (auto: bf16 where the device "
                         "computes it natively, else fp32); weights stay fp32")
    ap.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="held-out share of sequences")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    ap.add_argument("--keep-best", action="store_true",
                    help="also keep RUN/best/: the draft at the eval with the highest held-out "
                         "replayed accept length")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--stop-at", type=int, default=None,
                    help="save and stop at this step without changing the schedule (a planned break)")
    # online producer
    ap.add_argument("--target-dtype", default="auto", help="producer's target dtype (auto | float32 "
                    "| bfloat16)")
    ap.add_argument("--target-backend", default="transformers", choices=["transformers", "sglang"],
                    help="what runs the producer's target (sglang: in-process, sglang_engine.py)")
    ap.add_argument("--hidden-dtype", default="bfloat16",
                    help="dtype of hidden states handed over (the shards store bfloat16)")
    ap.add_argument("--prefetch", type=int, default=4, help="batches the producer may run ahead")
    ap.add_argument("--producer-batch-size", type=int, default=8)
    ap.add_argument("--producer-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="trainer torch threads")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def check_args(a):
    for name in ("ttt_length", "batch_size", "eval_every", "save_every", "keep", "log_every",
                 "prefetch", "producer_batch_size", "producer_threads"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(a, name)}: expected >= 1")
    if not a.accept_loss >= 0 or not math.isfinite(a.accept_loss):
        raise UserError(f"--accept-loss {a.accept_loss}: expected >= 0")
    if not a.feature_noise >= 0 or not math.isfinite(a.feature_noise):
        raise UserError(f"--feature-noise {a.feature_noise}: expected >= 0")
    if not 0 < a.ttt_decay <= 1:
        raise UserError(f"--ttt-decay {a.ttt_decay}: expected in (0, 1]")
    if a.distill_topk < 0:
        raise UserError(f"--distill-topk {a.distill_topk}: expected >= 1 (or 0: off)")
    if not a.lr > 0 or not math.isfinite(a.lr):
        raise UserError(f"--lr {a.lr}: expected > 0")
    if a.muon_lr is not None and a.optimizer != "muon":
        raise UserError(f"--muon-lr {a.muon_lr}: applies only with --optimizer muon")
    if a.muon_lr is not None and (not a.muon_lr > 0 or not math.isfinite(a.muon_lr)):
        raise UserError(f"--muon-lr {a.muon_lr}: expected > 0")
    if a.max_steps is not None and a.max_steps < 1:
        raise UserError(f"--max-steps {a.max_steps}: expected >= 1")
    if not 0 <= a.eval_fraction < 1:
        raise UserError(f"--eval-fraction {a.eval_fraction}: expected in [0, 1)")
    if not 0 <= a.warmup < 1:
        raise UserError(f"--warmup {a.warmup}: expected in [0, 1)")
    if not 0 <= a.min_lr_ratio <= 1:   # below 0 the rate turns negative: gradient ascent
        raise UserError(f"--min-lr-ratio {a.min_lr_ratio}: expected in [0, 1] (a share of --lr)")
    if not a.grad_clip > 0:   # clip_grad_norm_ scales by grad_clip / norm: 0 zeroes, < 0 flips it
        raise UserError(f"--grad-clip {a.grad_clip}: expected > 0 (inf: no clipping)")
    if not a.weight_decay >= 0 or not math.isfinite(a.weight_decay):
        raise UserError(f"--weight-decay {a.weight_decay}: expected >= 0")
    if a.offline and a.target_backend != "transformers":
        raise UserError("--target-backend runs the online producer; --offline reads stored states")
    if a.hidden_dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--hidden-dtype {a.hidden_dtype}: expected float32, bfloat16 or float16")
    if a.resume and a.init:
        raise UserError("--resume continues a run; --init starts a new one: give one of them")
    if a.init and a.draft_config:
        raise UserError("--init takes the draft's shape from its config.json; --draft-config "
                        "shapes a new draft: give one of them")
    if a.keep_best and a.eval_fraction == 0:
        raise UserError("--keep-best picks by the held-out eval: it needs --eval-fraction > 0")
    if a.init and a.lm_head_init != "random":
        raise UserError("--lm-head-init starts a new draft's lm_head; --init brings its own")
    if a.init and a.layer_init_from is not None:
        raise UserError("--layer-init-from starts a new draft's layer; --init brings its own")
    if a.freeze_lm_head and a.lm_head_init == "random" and not a.init:
        raise UserError("--freeze-lm-head would freeze a random lm_head: add --lm-head-init target "
                        "(or --init DRAFT)")


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    manifest, seqs, vocab = read_data(args.data)
    pick_target(args, manifest)
    rank, world, device = start_processes(args)
    r = Run(args=args, manifest=manifest, seqs=seqs, vocab=vocab, rank=rank, world=world,
            device=device, source=None)
    try:
        build_draft(r)         # the target's heads, the draft (fresh or --init), its config
        plan_steps(r)          # train/eval split, batch order, total steps, warmup
        build_optimizer(r)     # TTT module, FSDP2, optimizers and schedule (optim.py)
        open_run_dir(r)        # --resume from the last checkpoint, or a fresh run directory
        open_data_source(r)    # offline shards or the online producer; fc scaled to the features
        train_loop(r)          # steps, logs, evals, checkpoints, Ctrl-C
    finally:
        if r.source is not None:
            r.source.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class Run:
    """What the steps of main hand to each other (a plain namespace)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def pick_target(args, manifest):
    """--target defaults to the data's; another name for the same target is fine, another model is not."""
    if args.target is None:
        args.target = manifest["target"]
    elif args.target != manifest["target"] and not same_target(args.target, manifest["target"]):
        raise UserError(f"--data {args.data} was made with target {manifest['target']!r}, not "
                        f"{args.target!r}: its responses and hidden states are another model's")


def start_processes(args):
    """Threads, the process group (one process, or torchrun's), and the dtypes, said once."""
    from common import machine_summary, resolve_dtype
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world, device = setup_dist(args.device)
    (dt, why), (tdt, twhy) = resolve_dtype(args.dtype, device), resolve_dtype(args.target_dtype, device)
    args.dtype, args.target_dtype = (str(d).replace("torch.", "") for d in (dt, tdt))
    if rank == 0:
        print(f"dtype {why}; target dtype {twhy}; machine: {machine_summary()}", file=sys.stderr)
    if world > 1 and not args.threads:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    return rank, world, device


def build_draft(r):
    """Only the target's embedding, lm_head and config stay in the trainer: the soft labels are
    lm_head(final hidden state), over the draft vocabulary's rows of lm_head."""
    from common import load_target_heads, parse_dtype
    from model import Eagle3Draft, load_draft_for
    from draft_config import apply_draft_config, check_fits, config_from_target
    args, manifest, vocab = r.args, r.manifest, r.vocab
    target, tok = load_target_heads(args.target, args.trust_remote_code)
    cfg = config_from_target(target.config, manifest["draft_vocab_size"], manifest["aux_layer_ids"])
    check_fits(cfg, target.config, where=f"{args.data}/manifest.json aux_layer_ids")
    if args.draft_config:
        cfg = apply_draft_config(cfg, args.draft_config)
    check_data(manifest, r.seqs, target, tok, args.target, args.data, cfg.max_context(),
               "max_position_embeddings" if cfg.sliding_window is None else
               "max_position_embeddings / sliding_window")
    r.compute_dtype = parse_dtype(args.dtype)
    r.lm_w = target.get_output_embeddings().weight.detach().to(r.device, r.compute_dtype)
    embed = target.get_input_embeddings().weight.detach().float()
    if args.init:
        draft = load_draft_for(args.init, target, torch.float32)
        if not torch.equal(draft.draft_ids.cpu(), vocab["draft_ids"]):
            raise UserError(f"--init {args.init}: its draft vocabulary (d2t) does not match "
                            f"{args.data}/vocab.safetensors")
        if list(draft.config.aux_layer_ids) != list(manifest["aux_layer_ids"]):
            raise UserError(f"--init {args.init}: captures layers {draft.config.aux_layer_ids}, "
                            f"the data {manifest['aux_layer_ids']}")
        cfg = draft.config
    else:
        torch.manual_seed(args.seed)
        draft = Eagle3Draft(cfg, embed)
        draft.set_vocab(vocab["draft_ids"])
    init_lm_head(draft, target, args)
    init_layer_from_target(draft, args, r.seqs)
    r.draft, r.cfg = draft, cfg
    r.t2d = draft.t2d.clone().to(r.device)
    r.lm_w_draft = r.lm_w[vocab["draft_ids"].to(r.device)].contiguous()   # [Vd, Ht]


def plan_steps(r):
    args = r.args
    if args.batch_size % r.world:
        raise UserError(f"--batch-size {args.batch_size} must be a multiple of the "
                        f"{r.world} processes")
    r.train_ids, r.eval_ids = split_data(len(r.seqs), args.eval_fraction, args.seed)
    if len(r.train_ids) < args.batch_size:
        raise UserError(f"--batch-size {args.batch_size} is more than the {len(r.train_ids)} "
                        f"training sequences of {args.data}")
    per_epoch = len(r.train_ids) // args.batch_size
    lengths = [len(q["input_ids"]) for q in r.seqs]
    r.batches = lambda step: batch_indices(r.train_ids, step, args.batch_size, args.seed, lengths)
    r.total = args.max_steps or max(1, int(args.epochs * per_epoch))
    r.warmup = int(args.warmup * r.total)


def build_optimizer(r):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    args = r.args
    r.module = TTTLoss(r.draft.to(r.device), args.ttt_length, args.accept_loss,
                       chain_rows=args.ttt_loss_rows == "chain", decay=args.ttt_decay)
    fully_shard(r.module, mesh=init_device_mesh(r.device.split(":")[0], (r.world,)))
    named = [(n, p) for n, p in r.module.named_parameters() if p.requires_grad]
    r.params = [p for _, p in named]
    r.opts, r.scheds = make_optimizers(named, args, r.warmup, r.total, r.device, verbose=r.rank == 0)


def open_run_dir(r):
    """Sets r.start (the first step to run) and r.tokens_seen: from the last checkpoint with
    --resume (same shape and schedule-defining flags), else 0 in a directory without checkpoints."""
    args, rank = r.args, r.rank
    os.makedirs(args.out, exist_ok=True)
    r.log_path = os.path.join(args.out, "log.jsonl")
    start, tokens_seen = 0, 0
    if args.resume:
        ck = list_checkpoints(args.out)
        if not ck:
            raise UserError(f"--resume: no checkpoint in {args.out}/checkpoints")
        from draft_config import SHAPE_FIELDS, read_config
        saved = read_config(ck[-1])
        diff = [k for k in SHAPE_FIELDS if getattr(saved, k) != getattr(r.cfg, k)]
        if diff:
            raise UserError(f"--resume: {ck[-1]} holds a draft of another shape ({diff[0]} "
                            f"{getattr(saved, diff[0])}, now {getattr(r.cfg, diff[0])}): resume "
                            f"with the run's --draft-config")
        def same_run(old):    # before any state is loaded: another optimizer's would not fit
            before = {"optimizer": "adamw", "loss_positions": "assistant",   # runs before them
                      "ttt_decay": LOSS_DECAY}
            for k in ("batch_size", "seed", "ttt_length", "eval_fraction", "optimizer",
                      "loss_positions", "ttt_decay"):
                was = old.get(k, before.get(k))
                if was != getattr(args, k):
                    raise UserError(f"--resume: the run used --{k.replace('_', '-')} {was}, "
                                    f"not {getattr(args, k)}")
        st = load_checkpoint(ck[-1], r.module, r.opts, r.scheds, rank, r.world, r.vocab["draft_ids"],
                             same_run)
        start, tokens_seen = st["step"], st["data"].get("tokens", 0)
        if rank == 0:
            truncate_log(r.log_path, start)
            print(f"resumed from {ck[-1]} at step {start}", file=sys.stderr)
    elif rank == 0:
        if list_checkpoints(args.out):
            raise UserError(f"--out {args.out} already holds checkpoints: add --resume, or "
                            f"choose another directory")
        open(r.log_path, "w").close()
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump({**vars(args), "world_size": r.world, "total_steps": r.total,
                       "train_sequences": len(r.train_ids), "eval_sequences": r.eval_ids}, f,
                      indent=1)
        write_eval_prompts(args.data, r.seqs, r.eval_ids, os.path.join(args.out, "eval_prompts.jsonl"))
    r.start, r.tokens_seen = start, tokens_seen
    r.stop_at = min(r.total, args.stop_at) if args.stop_at else r.total


def open_data_source(r):
    """The hidden states: offline shards, or an online producer whose job list is exactly the
    trainer's consumption order. A fresh --fc-init rms run first takes the states of 8 training
    sequences to scale fc; online, the producer sends the eval set next, once: it is kept."""
    args, rank, world = r.args, r.rank, r.world
    rms_ids = r.train_ids[:8] if args.fc_init == "rms" and r.start == 0 and not args.init else []
    r.eval_batches = eval_batches_for(r.eval_ids, rank, world, args.batch_size // world)
    if args.offline:
        r.source = Offline(args.data, r.manifest)
    else:
        jobs = [(("rms", 0), rms_ids)] if rms_ids else []
        jobs += [(("eval", i), b) for i, (b, _) in enumerate(r.eval_batches)]
        jobs += [(("train", s), rank_share(r.batches(s)[0], rank, world))
                 for s in range(r.start, r.stop_at)]
        r.source = Online(args, r.seqs, jobs, r.manifest["aux_layer_ids"])
    if rms_ids:
        rms = init_fc_for_features(r.module, r.source.get_ids(rms_ids) if args.offline
                                   else r.source.get(("rms", 0)), args.seed)
        if rank == 0:
            print(f"fc initialised for feature RMS {' / '.join(f'{x:.2f}' for x in rms.tolist())}"
                  f" (layers {r.manifest['aux_layer_ids']})", file=sys.stderr)
    r.eval_cache = {} if args.offline else {
        ("eval", i): r.source.get(("eval", i)) for i in range(len(r.eval_batches))}
    r.in_vocab_seen = {}   # sequence -> in_vocab [T]: the one bit that needs the full lm_head
    r.autocast = torch.autocast(r.device.split(":")[0], dtype=r.compute_dtype,
                                enabled=r.compute_dtype != torch.float32)


def prepare(r, key, idx):
    """One batch on the device: ids, mask, aux, the target's soft labels and argmax, valid rows."""
    seqs = r.seqs
    hidden = (r.source.get_ids(idx) if r.args.offline else
              r.eval_cache[key] if key[0] == "eval" else r.source.get(key))
    ids, mask, aux, final = collate(seqs, idx, hidden, r.device)
    # --loss-positions all (training only): every real token is a loss position, prompt rows
    # included. The label at any position is the target's own next-token distribution there,
    # so prompt rows are as well supervised as answer rows, and their draft forward is already
    # paid for (the unroll runs over the whole sequence); `mask` itself stays the answers, for
    # the replayed accept length.
    loss_mask = mask if key[0] == "eval" else loss_positions(
        mask, [len(seqs[k]["input_ids"]) for k in idx], r.args.loss_positions)
    known = None
    if all(k in r.in_vocab_seen for k in idx):
        known = torch.zeros_like(mask)
        for b, k in enumerate(idx):
            known[b, :len(r.in_vocab_seen[k])] = r.in_vocab_seen[k]
    with r.autocast:
        # the target at p is needed only where x[p+1] is a loss token (valid_rows)
        targ_p, targ_argmax, in_vocab = target_side(final, r.lm_w_draft,
                                                    need=shift_left(loss_mask, 1, False),
                                                    in_vocab=known, lm_w=r.lm_w, t2d=r.t2d)
    if known is None:
        for b, k in enumerate(idx):
            r.in_vocab_seen[k] = in_vocab[b, :len(seqs[k]["input_ids"])].clone()
    valid = valid_rows(loss_mask, in_vocab, r.args.ttt_length)
    if key[0] == "train" and r.args.distill_topk:     # the held-out loss keeps the full label
        targ_p = top_k_labels(targ_p, r.args.distill_topk)
    if key[0] == "train" and r.args.feature_noise:    # seeded by step: resume draws the same
        gen = torch.Generator().manual_seed(r.args.seed * 1_000_003 + key[1] * r.world + r.rank)
        aux = noisy_features(aux, len(r.manifest["aux_layer_ids"]), r.args.feature_noise, gen)
    return ids, mask, aux, targ_p, targ_argmax, valid


def evaluate(r):
    """Held-out TTT metrics and the replayed accept length, summed over all ranks."""
    tot = torch.zeros(3, r.args.ttt_length, device=r.device)
    replay = torch.zeros(2, device=r.device)
    with torch.no_grad():
        for i, (idx, real) in enumerate(r.eval_batches):
            ids, mask, aux, targ_p, targ_argmax, valid = prepare(r, ("eval", i), idx)
            valid[:, real:] = False          # repeated filler sequences count for nothing
            mask[real:] = False
            denom = all_sum(valid.sum((1, 2)).float())
            with r.autocast:
                _, st_, correct = r.module(ids, aux, targ_p, targ_argmax, valid, denom,
                                           float(r.world))
            tot += st_
            replay += replay_decoding(correct.cpu(), mask.cpu()).to(r.device)
    return metrics(all_sum(tot).cpu(), all_sum(replay).cpu())


def train_loop(r):
    """Steps from r.start to r.stop_at: each one a train_step, then, on their own schedules, a
    training log line, a held-out eval and a checkpoint. Ctrl-C / SIGTERM finish the step, save
    and exit 130 (all ranks agree on when: the flag travels in the step's all-reduce)."""
    from common import parse_dtype
    args, rank = r.args, r.rank
    stop = catch_stop_signals()
    r.bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        r.bar = tqdm(total=r.total, initial=r.start, dynamic_ncols=True, file=sys.stderr,
                     desc="train")
    r.last_ckpt = list_checkpoints(args.out)[-1] if r.start else None
    r.best_replay = best_so_far(args.out) if r.start else float("-inf")
    r.export_dtype = parse_dtype(args.export_dtype)
    if r.eval_batches and r.start == 0 and args.init:
        # the starting draft's own held-out numbers, step 0: where a continued run's curve
        # begins, and --keep-best's answer if training on never beats it
        held_out_eval(r, 0)
    window = LogWindow(r)           # opened after that eval: the eval is not training time
    r.module.train()
    step = r.start
    while step < r.stop_at:
        stats, gnorm, n_tok, stopping = train_step(r, step, stop["flag"])
        step += 1
        r.tokens_seen += n_tok
        window.add(stats, n_tok)
        if r.bar is not None:
            r.bar.update(1)
        if step % args.log_every == 0 or step == r.stop_at:
            window.flush(step, gnorm)
        if r.eval_batches and (step % args.eval_every == 0 or step == r.total):
            held_out_eval(r, step)
        if step % args.save_every == 0 or step == r.stop_at or stopping:
            r.last_ckpt = checkpoint(r, step)
        if stopping:
            if rank == 0:
                print(f"\ninterrupted: saved {r.last_ckpt}; continue with --resume", file=sys.stderr)
            if r.bar is not None:
                r.bar.close()
            r.source.close()
            dist.destroy_process_group()
            sys.exit(130)
    if r.bar is not None:
        r.bar.close()
    if rank == 0:
        write_plots(args.out, r.log_path)
        print(f"done: step {step}/{r.total}, draft in {r.last_ckpt or list_checkpoints(args.out)[-1]}",
              file=sys.stderr)


def catch_stop_signals():
    """Ctrl-C / SIGTERM set a flag the loop acts on after the step; a second one stops at once."""
    stop = {"flag": False}

    def on_signal(sig, frame):
        if stop["flag"]:
            raise KeyboardInterrupt
        stop["flag"] = True
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def train_step(r, step, stop_here):
    """One optimizer step: forward (TTT), backward, clip, one all-reduce of everything the ranks
    must agree on, update. Returns the summed step statistics ([3, J] then the replay's 2), the
    gradient norm, the step's tokens over all ranks, and whether any rank was asked to stop."""
    idx_global, _ = r.batches(step)
    idx = rank_share(idx_global, r.rank, r.world)
    ids, mask, aux, targ_p, targ_argmax, valid = prepare(r, ("train", step), idx)
    denom = all_sum(valid.sum((1, 2)).float())
    with r.autocast:
        loss, st_, correct = r.module(ids, aux, targ_p, targ_argmax, valid, denom, float(r.world))
    ch = replay_decoding(correct.cpu(), mask.cpu()).to(r.device)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(r.params, r.args.grad_clip)
    gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    # step statistics, tokens, "not finite here", "Ctrl-C here": one all-reduce
    flags = [float(sum(len(r.seqs[k]["input_ids"]) for k in idx)),
             0.0 if bool(torch.isfinite(loss.detach())) and bool(torch.isfinite(gnorm)) else 1.0,
             1.0 if stop_here else 0.0]
    packed = all_sum(torch.cat([st_.flatten(), ch, torch.tensor(flags, device=r.device)])).cpu()
    n_tok, bad, stopping = packed[-3].item(), packed[-2].item() > 0, packed[-1].item() > 0
    if bad:
        raise UserError(f"step {step}: loss or gradient is not finite (batch of sequences "
                        f"{idx_global}); nothing saved, the last good checkpoint is "
                        f"{r.last_ckpt or 'none'}")
    for o, sc in zip(r.opts, r.scheds):
        o.step()
        o.zero_grad(set_to_none=True)
        sc.step()
    return packed[:-3], gnorm, int(n_tok), stopping


class LogWindow:
    """The training log: step statistics summed since the last line, written every --log-every
    steps with the window's tokens/s and the share of it spent waiting for hidden states."""

    def __init__(self, r):
        self.r = r
        self.reset()

    def reset(self):
        J = self.r.args.ttt_length
        self.stats, self.replay = torch.zeros(3, J), torch.zeros(2)
        self.t0, self.tokens, self.wait0 = time.perf_counter(), 0, self.r.source.wait

    def add(self, packed, n_tok):
        J = self.r.args.ttt_length
        self.stats += packed[:3 * J].view(3, J)
        self.replay += packed[3 * J:3 * J + 2]
        self.tokens += n_tok

    def flush(self, step, gnorm):
        r = self.r
        m = metrics(self.stats, self.replay)
        dt = time.perf_counter() - self.t0
        rec = {"step": step, "split": "train", "tokens": r.tokens_seen,
               "lr": r.scheds[0].get_last_lr()[0], "grad_norm": gnorm.item(), **m,
               "tokens_per_s": self.tokens / max(dt, 1e-9),
               "data_wait": (r.source.wait - self.wait0) / max(dt, 1e-9)}
        log(r, rec)
        if r.bar is not None:
            r.bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_j'][0]:.2f}",
                              al3=f"{m['accept_len_3']:.2f}", wait=f"{rec['data_wait']:.0%}")
        self.reset()


def held_out_eval(r, step):
    """evaluate, log it, keep the best checkpoint by replayed accept length (--keep-best)."""
    r.module.eval()
    m = evaluate(r)
    r.module.train()
    log(r, {"step": step, "split": "eval", "tokens": r.tokens_seen, **m})
    if r.args.keep_best and m["replay_accept_3"] > r.best_replay:
        r.best_replay = m["replay_accept_3"]
        save_best(r.args.out, step, r.module, r.cfg, r.rank, r.export_dtype, m)
    if r.rank == 0:
        write_plots(r.args.out, r.log_path)
        msg = (f"eval step {step}: loss {m['loss']:.3f}, acc "
               f"{' '.join(f'{a:.2f}' for a in m['acc_j'])}, accept length (3 drafts) "
               f"{m['accept_len_3']:.2f} simulated, {m['replay_accept_3']:.2f} replayed")
        # through the bar when there is one, so the line does not break it
        (r.bar.write(msg, file=sys.stderr) if r.bar is not None else print(msg, file=sys.stderr))


def checkpoint(r, step):
    data_pos = {"next_step": step, "tokens": r.tokens_seen, **r.batches(step)[1]}
    return save_checkpoint(r.args.out, step, r.module, r.opts, r.scheds, data_pos, r.args, r.cfg,
                           r.vocab["draft_ids"], r.rank, r.args.keep, r.export_dtype)


def log(r, rec):
    if r.rank == 0:
        with open(r.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def same_target(a, b):
    """Two names for one target: equal strings, or paths that resolve to the same directory."""
    from common import resolve_target
    try:
        ra, rb = resolve_target(a), resolve_target(b)
    except UserError:
        return False
    return os.path.realpath(ra) == os.path.realpath(rb)


if __name__ == "__main__":
    run_main(main)
