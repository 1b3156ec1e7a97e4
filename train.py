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
import functools
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from common import UserError, run_main
from hidden import Offline, Online
from rundir import (best_so_far, list_checkpoints, load_checkpoint, save_best, save_checkpoint,
                    truncate_log, write_eval_prompts, write_plots)
from ttt import TTTLoss, metrics, replay_decoding, shift_left, target_side, valid_rows


# ----------------------------------------------------------------------------------------------
# Data: the generate.py directory

def read_data(path):
    """(manifest, sequences, vocab) of a generate.py directory (dataset.load_dataset_dir checks
    files and shapes), plus the checks training needs: a consistent vocab map and the manifest
    fields used below."""
    from dataset import load_dataset_dir
    if not os.path.isdir(path):
        raise UserError(f"--data {path}: no such directory")
    manifest, seqs, vocab = load_dataset_dir(path)
    need = ["target", "tokenizer_hash", "vocab_size", "draft_vocab_size", "aux_layer_ids"]
    missing = [k for k in need if k not in manifest]
    if missing:
        raise UserError(f"{path}/manifest.json: missing {', '.join(missing)}; re-run generate.py")
    V, Vd = manifest["vocab_size"], manifest["draft_vocab_size"]
    ids = vocab["draft_ids"].long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids.clamp(0, V - 1)] = True
    ok = (bool((ids[1:] > ids[:-1]).all()) and int(ids.min()) >= 0 and int(ids.max()) < V
          and torch.equal(vocab["d2t"].long(), ids - torch.arange(Vd))
          and torch.equal(vocab["t2d"].bool(), t2d))
    if not ok:
        raise UserError(f"{path}/vocab.safetensors: draft_ids/d2t/t2d are not one consistent "
                        f"vocab map (sorted ids, d2t = id - index, t2d = membership)")
    vocab["draft_ids"] = ids
    return manifest, seqs, vocab


def check_data(manifest, seqs, target, tok, target_name, data_path, max_positions):
    """The data set must come from this target and tokenizer and fit the draft."""
    tcfg = getattr(target.config, "text_config", target.config)
    if manifest["vocab_size"] != tcfg.vocab_size:
        raise UserError(f"--data {data_path} was made for a vocabulary of {manifest['vocab_size']} "
                        f"tokens; target {target_name} has {tcfg.vocab_size}")
    from dataset import tokenizer_hash
    h = tokenizer_hash(tok)
    if manifest["tokenizer_hash"] != h:
        raise UserError(f"--data {data_path} was tokenized by another tokenizer "
                        f"(hash {str(manifest['tokenizer_hash'])[:12]}, target {target_name}'s "
                        f"is {h[:12]}); regenerate it for this target")
    if not seqs:
        raise UserError(f"--data {data_path}: sequences.jsonl holds no sequences")
    if sum(sum(s["loss_mask"]) for s in seqs) == 0:
        raise UserError(f"--data {data_path}: no sequence has a loss token (assistant text)")
    for n, s in enumerate(seqs):
        if len(s["input_ids"]) > max_positions:
            raise UserError(f"--data {data_path}: sequence {n} has {len(s['input_ids'])} tokens, more "
                            f"than the draft's max_position_embeddings {max_positions}")
        if s["input_ids"] and not 0 <= min(s["input_ids"]) <= max(s["input_ids"]) < tcfg.vocab_size:
            raise UserError(f"--data {data_path}: sequence {n} has token ids outside the target "
                            f"vocabulary of {tcfg.vocab_size}")


def split_data(n, eval_fraction, seed):
    """A fixed held-out split: a seeded permutation, the first ones held out. It does not depend
    on the number of processes, so 1 and N processes train on the same sequences."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = 0 if eval_fraction == 0 or n < 2 else max(1, round(n * eval_fraction))
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def eval_batches_for(eval_ids, rank, world, per_rank):
    """This rank's eval batches as (sequence ids, how many are real). Every rank must run the same
    number of forwards (each one gathers FSDP shards), so short ranks repeat a sequence whose rows
    are then masked out of every sum."""
    mine = eval_ids[rank::world]
    n_batches = math.ceil(math.ceil(len(eval_ids) / world) / per_rank) if eval_ids else 0
    out = []
    for i in range(n_batches):
        real = mine[i * per_rank:(i + 1) * per_rank]
        out.append((real + [eval_ids[0]] * (per_rank - len(real)), len(real)))
    return out


def batch_indices(train_ids, step, batch_size, seed, lengths=None):
    """Global batch `step`: one seeded shuffle per epoch, the last partial batch dropped. A pure
    function of the step, so the data position of a resumed run is exact. With `lengths` (the
    token count of every sequence) batches are length-grouped (epoch_batches)."""
    per_epoch = len(train_ids) // batch_size
    epoch, i = divmod(step, per_epoch)
    lens = None if lengths is None else tuple(lengths[k] for k in train_ids)
    batch = epoch_batches(len(train_ids), batch_size, seed, epoch, lens)[i]
    return [train_ids[k] for k in batch], {"epoch": epoch, "batch_in_epoch": i}


@functools.lru_cache(maxsize=4)
def epoch_batches(n, batch_size, seed, epoch, lens=None, window=32):
    """One epoch's batches (positions into the training ids). Plain: a seeded shuffle cut into
    batches. Length-grouped: the shuffle is cut into windows of `window` batches, each window
    sorted by length and cut into batches, and the batches shuffled again, so a batch holds
    sequences of similar length (padded rows, measured on the README's full-run data at batch 8:
    19.7% random, 1.4% grouped) while the order stays random at the scale of a window."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()[:n // batch_size * batch_size]
    if lens is not None:
        w = window * batch_size
        perm = [k for c in range(0, len(perm), w) for k in sorted(perm[c:c + w], key=lens.__getitem__)]
    batches = [perm[b:b + batch_size] for b in range(0, len(perm), batch_size)]
    if lens is not None:
        batches = [batches[b] for b in torch.randperm(len(batches), generator=g).tolist()]
    return batches


def rank_share(idx, rank, world):
    """Contiguous slice of a global batch for this rank."""
    b = len(idx) // world
    return idx[rank * b:(rank + 1) * b]


# ----------------------------------------------------------------------------------------------
# Batches

def collate(seqs, idx, hidden, device):
    """Right-padded batch. Padding has loss mask 0, and causal attention keeps real rows from
    ever seeing padded ones, so padding changes no real row."""
    T = max(len(seqs[k]["input_ids"]) for k in idx)
    B = len(idx)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    A, Ht = hidden[0][0].shape[1], hidden[0][1].shape[1]
    aux = torch.zeros(B, T, A)
    final = torch.zeros(B, T, Ht)
    for b, (k, (a, f)) in enumerate(zip(idx, hidden)):
        n = len(seqs[k]["input_ids"])
        if a.shape[0] != n or f.shape[0] != n:
            raise UserError(f"hidden states of sequence {k} cover {a.shape[0]} positions, "
                            f"the sequence has {n} tokens")
        ids[b, :n] = torch.tensor(seqs[k]["input_ids"])
        mask[b, :n] = torch.tensor(seqs[k]["loss_mask"], dtype=torch.bool)
        aux[b, :n] = a.float()
        final[b, :n] = f.float()
    return ids.to(device), mask.to(device), aux.to(device), final.to(device)


@torch.no_grad()
def init_fc_for_features(module, hidden, seed):
    """--fc-init rms (model.fc_weight_for_features): measure the captured layers' scale on the
    hidden states of a few sequences (the median row RMS of each layer: the first row of a
    sequence, an attention sink, can be 100x the rest) and redraw fc for it. Done after
    sharding: every rank draws the same full matrix from a seeded generator and keeps its shard,
    so N processes start where one does. The RMS is of the features as fc sees them: after the
    layout's norm_before_fc / fc_norm (model.py), here at their fresh weights of one, so as plain
    x / rms(x) (the weights are DTensor shards by now). Returns the RMS [n], one per layer."""
    from model import fc_weight_for_features
    cfg = module.draft.config
    unit = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    aux = torch.cat([a for a, _ in hidden]).float()
    if cfg.norm_before_fc:
        aux = unit(aux)
    aux = aux.view(aux.shape[0], len(cfg.aux_layer_ids), -1)
    if cfg.fc_norm:
        aux = unit(aux)
    rms = aux.pow(2).mean(-1).sqrt().median(0).values
    if not bool(torch.isfinite(rms).all()) or not bool((rms > 0).all()):
        raise UserError(f"--fc-init rms: the target's hidden states of the first training "
                        f"sequences have RMS {rms.tolist()} (not finite or zero); check the data, "
                        f"or use --fc-init normal")
    w = module.draft.fc.weight
    full = fc_weight_for_features(w.shape[0], w.shape[1] // len(rms), rms,
                                  torch.Generator().manual_seed(seed)).to(w.dtype)
    if hasattr(w, "device_mesh"):    # an FSDP2 DTensor: keep this rank's shard
        from torch.distributed.tensor import distribute_tensor
        full = distribute_tensor(full.to(w.device_mesh.device_type), w.device_mesh, w.placements)
    w.copy_(full)
    return rms


@torch.no_grad()
def init_lm_head(draft, target, args):
    """--lm-head-init target: lm_head starts as the target's own read-out restricted to the draft
    vocabulary (row i = the target's row for draft id i); the target's lm_head reads its final-
    normed state as the draft's reads its own. --freeze-lm-head then keeps it fixed (before FSDP
    wraps the module, so the optimizer never sees it)."""
    if args.lm_head_init == "target":
        w = target.get_output_embeddings().weight
        if w.shape[1] != draft.lm_head.weight.shape[1]:
            raise UserError(f"--lm-head-init target: the target's lm_head is {w.shape[1]} wide, "
                            f"the draft's {draft.lm_head.weight.shape[1]}")
        draft.lm_head.weight.copy_(w[draft.draft_ids].float())
    if args.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)


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
    ap.add_argument("--freeze-lm-head", action="store_true",
                    help="keep lm_head fixed (with --lm-head-init target or --init): Vd*H fewer "
                         "trainable parameters, no lm_head gradient")
    ap.add_argument("--ttt-loss-rows", default="all", choices=["all", "chain"],
                    help="all: every valid row at every TTT step; chain: step j only on rows whose "
                         "steps 0..j-1 were right, the rows a greedy chain reaches (GRIFFIN-style)")
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
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=0.5)
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
    if not a.lr > 0 or not math.isfinite(a.lr):
        raise UserError(f"--lr {a.lr}: expected > 0")
    if a.max_steps is not None and a.max_steps < 1:
        raise UserError(f"--max-steps {a.max_steps}: expected >= 1")
    if not 0 <= a.eval_fraction < 1:
        raise UserError(f"--eval-fraction {a.eval_fraction}: expected in [0, 1)")
    if not 0 <= a.warmup < 1:
        raise UserError(f"--warmup {a.warmup}: expected in [0, 1)")
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
    if a.freeze_lm_head and a.lm_head_init == "random" and not a.init:
        raise UserError("--freeze-lm-head would freeze a random lm_head: add --lm-head-init target "
                        "(or --init DRAFT)")


def lr_lambda(warmup, total, min_ratio):
    """Linear warmup, then cosine from 1 to min_ratio at the last step."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    from common import load_target_heads, parse_dtype
    from model import Eagle3Draft, load_draft_for
    from draft_config import apply_draft_config, check_fits, config_from_target
    manifest, seqs, vocab = read_data(args.data)
    if args.target is None:
        args.target = manifest["target"]
    elif args.target != manifest["target"] and not same_target(args.target, manifest["target"]):
        raise UserError(f"--data {args.data} was made with target {manifest['target']!r}, not "
                        f"{args.target!r}: its responses and hidden states are another model's")
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world, device = setup_dist(args.device)
    from common import machine_summary, resolve_dtype
    (dt, why), (tdt, twhy) = resolve_dtype(args.dtype, device), resolve_dtype(args.target_dtype, device)
    args.dtype, args.target_dtype = (str(d).replace("torch.", "") for d in (dt, tdt))
    if rank == 0:
        print(f"dtype {why}; target dtype {twhy}; machine: {machine_summary()}", file=sys.stderr)
    if world > 1 and not args.threads:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    online = None
    try:
        if args.batch_size % world:
            raise UserError(f"--batch-size {args.batch_size} must be a multiple of the "
                            f"{world} processes")
        # ---- the target: only its embedding, lm_head and config stay in the trainer ----
        target, tok = load_target_heads(args.target, args.trust_remote_code)
        cfg = config_from_target(target.config, manifest["draft_vocab_size"],
                                 manifest["aux_layer_ids"])
        check_fits(cfg, target.config, where=f"{args.data}/manifest.json aux_layer_ids")
        if args.draft_config:
            cfg = apply_draft_config(cfg, args.draft_config)
        check_data(manifest, seqs, target, tok, args.target, args.data, cfg.max_position_embeddings)
        compute_dtype = parse_dtype(args.dtype)
        lm_w = target.get_output_embeddings().weight.detach().to(device, compute_dtype)
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
        del target
        draft_ids = vocab["draft_ids"].to(device)
        t2d = draft.t2d.clone().to(device)
        lm_w_draft = lm_w[draft_ids].contiguous()   # [Vd, Ht]: all the soft labels need

        # ---- data split and schedule ----
        train_ids, eval_ids = split_data(len(seqs), args.eval_fraction, args.seed)
        if len(train_ids) < args.batch_size:
            raise UserError(f"--batch-size {args.batch_size} is more than the {len(train_ids)} "
                            f"training sequences of {args.data}")
        per_epoch = len(train_ids) // args.batch_size
        lengths = [len(q["input_ids"]) for q in seqs]

        def batches(step):
            return batch_indices(train_ids, step, args.batch_size, args.seed, lengths)
        total = args.max_steps or max(1, int(args.epochs * per_epoch))
        warmup = int(args.warmup * total)

        # ---- model, FSDP2, optimizer ----
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        module = TTTLoss(draft.to(device), args.ttt_length, args.accept_loss,
                         chain_rows=args.ttt_loss_rows == "chain")
        mesh = init_device_mesh(device.split(":")[0], (world,))
        fully_shard(module, mesh=mesh)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total, args.min_lr_ratio))

        os.makedirs(args.out, exist_ok=True)
        log_path = os.path.join(args.out, "log.jsonl")
        start, tokens_seen = 0, 0
        if args.resume:
            ck = list_checkpoints(args.out)
            if not ck:
                raise UserError(f"--resume: no checkpoint in {args.out}/checkpoints")
            from draft_config import SHAPE_FIELDS, read_config
            saved = read_config(ck[-1])
            diff = [k for k in SHAPE_FIELDS if getattr(saved, k) != getattr(cfg, k)]
            if diff:
                raise UserError(f"--resume: {ck[-1]} holds a draft of another shape ({diff[0]} "
                                f"{getattr(saved, diff[0])}, now {getattr(cfg, diff[0])}): resume "
                                f"with the run's --draft-config")
            st = load_checkpoint(ck[-1], module, opt, sched, rank, world, vocab["draft_ids"])
            old = st["args"]
            for k in ("batch_size", "seed", "ttt_length", "eval_fraction"):
                if old[k] != getattr(args, k):
                    raise UserError(f"--resume: the run used --{k.replace('_', '-')} {old[k]}, "
                                    f"not {getattr(args, k)}")
            start, tokens_seen = st["step"], st["data"].get("tokens", 0)
            if rank == 0:
                truncate_log(log_path, start)
                print(f"resumed from {ck[-1]} at step {start}", file=sys.stderr)
        elif rank == 0:
            if list_checkpoints(args.out):
                raise UserError(f"--out {args.out} already holds checkpoints: add --resume, or "
                                f"choose another directory")
            open(log_path, "w").close()
            with open(os.path.join(args.out, "args.json"), "w") as f:
                json.dump({**vars(args), "world_size": world, "total_steps": total,
                           "train_sequences": len(train_ids), "eval_sequences": eval_ids}, f, indent=1)
            write_eval_prompts(args.data, seqs, eval_ids, os.path.join(args.out, "eval_prompts.jsonl"))
        stop_at = min(total, args.stop_at) if args.stop_at else total

        # ---- data source: the producer's job list is exactly the trainer's consumption order ----
        # (a fresh --fc-init rms run first takes the states of 8 training sequences to scale fc)
        rms_ids = train_ids[:8] if args.fc_init == "rms" and start == 0 and not args.init else []
        eval_batches = eval_batches_for(eval_ids, rank, world, args.batch_size // world)
        if args.offline:
            source = Offline(args.data, manifest)
        else:
            jobs = [(("rms", 0), rms_ids)] if rms_ids else []
            jobs += [(("eval", i), b) for i, (b, _) in enumerate(eval_batches)]
            jobs += [(("train", s), rank_share(batches(s)[0], rank, world))
                     for s in range(start, stop_at)]
            online = source = Online(args, seqs, jobs, manifest["aux_layer_ids"])
        if rms_ids:
            rms = init_fc_for_features(module, source.get_ids(rms_ids) if args.offline
                                       else source.get(("rms", 0)), args.seed)
            if rank == 0:
                print(f"fc initialised for feature RMS {' / '.join(f'{r:.2f}' for r in rms.tolist())}"
                      f" (layers {manifest['aux_layer_ids']})", file=sys.stderr)
        # online, the producer sends the eval set next, once: keep it
        eval_cache = {} if args.offline else {
            ("eval", i): source.get(("eval", i)) for i in range(len(eval_batches))}

        def hidden_for(key, idx):
            if args.offline:
                return source.get_ids(idx)
            return eval_cache[key] if key[0] == "eval" else source.get(key)

        autocast = torch.autocast(device.split(":")[0], dtype=compute_dtype,
                                  enabled=compute_dtype != torch.float32)

        in_vocab_seen = {}   # sequence -> in_vocab [T]: the one bit that needs the full lm_head

        def prepare(key, idx):
            ids, mask, aux, final = collate(seqs, idx, hidden_for(key, idx), device)
            known = None
            if all(k in in_vocab_seen for k in idx):
                known = torch.zeros_like(mask)
                for b, k in enumerate(idx):
                    known[b, :len(in_vocab_seen[k])] = in_vocab_seen[k]
            with autocast:
                # the target at p is needed only where x[p+1] is a loss token (valid_rows)
                targ_p, targ_argmax, in_vocab = target_side(final, lm_w_draft,
                                                            need=shift_left(mask, 1, False),
                                                            in_vocab=known, lm_w=lm_w, t2d=t2d)
            if known is None:
                for b, k in enumerate(idx):
                    in_vocab_seen[k] = in_vocab[b, :len(seqs[k]["input_ids"])].clone()
            valid = valid_rows(mask, in_vocab, args.ttt_length)
            return ids, mask, aux, targ_p, targ_argmax, valid

        def evaluate():
            tot = torch.zeros(3, args.ttt_length, device=device)
            replay = torch.zeros(2, device=device)
            with torch.no_grad():
                for i, (idx, real) in enumerate(eval_batches):
                    ids, mask, aux, targ_p, targ_argmax, valid = prepare(("eval", i), idx)
                    valid[:, real:] = False          # repeated filler sequences count for nothing
                    mask[real:] = False
                    denom = all_sum(valid.sum((1, 2)).float())
                    with autocast:
                        _, st_, correct = module(ids, aux, targ_p, targ_argmax, valid, denom,
                                                 float(world))
                    tot += st_
                    replay += replay_decoding(correct.cpu(), mask.cpu()).to(device)
            return metrics(all_sum(tot).cpu(), all_sum(replay).cpu())

        # ---- Ctrl-C / SIGTERM: finish the step, save, exit (all ranks agree on when) ----
        stop = {"flag": False}

        def on_signal(sig, frame):
            if stop["flag"]:
                raise KeyboardInterrupt
            stop["flag"] = True
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

        bar = None
        if rank == 0 and not args.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=total, initial=start, dynamic_ncols=True, file=sys.stderr,
                       desc="train")
        win_stats = torch.zeros(3, args.ttt_length)
        win_replay = torch.zeros(2)
        win_t0, win_tokens, win_wait0 = time.perf_counter(), 0, source.wait
        step = start
        last_ckpt = list_checkpoints(args.out)[-1] if start else None
        best_replay = best_so_far(args.out) if start else float("-inf")

        def checkpoint(step):
            data_pos = {"next_step": step, "tokens": tokens_seen,
                        **batches(step)[1]}
            return save_checkpoint(args.out, step, module, opt, sched, data_pos, args, cfg,
                                   vocab["draft_ids"], rank, args.keep, parse_dtype(args.export_dtype))

        def log(rec):
            if rank == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")

        module.train()
        while step < stop_at:
            idx_global, _ = batches(step)
            idx = rank_share(idx_global, rank, world)
            ids, mask, aux, targ_p, targ_argmax, valid = prepare(("train", step), idx)
            denom = all_sum(valid.sum((1, 2)).float())
            with autocast:
                loss, st_, correct = module(ids, aux, targ_p, targ_argmax, valid, denom, float(world))
            ch = replay_decoding(correct.cpu(), mask.cpu()).to(device)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
            # one all-reduce for everything the ranks must agree on: step statistics, tokens,
            # "not finite here", "Ctrl-C here"
            J = args.ttt_length
            flags = [float(sum(len(seqs[k]["input_ids"]) for k in idx)),
                     0.0 if bool(torch.isfinite(loss.detach())) and bool(torch.isfinite(gnorm)) else 1.0,
                     1.0 if stop["flag"] else 0.0]
            packed = all_sum(torch.cat([st_.flatten(), ch, torch.tensor(flags, device=device)])).cpu()
            n_tok, bad, stopping = packed[-3].item(), packed[-2].item() > 0, packed[-1].item() > 0
            if bad:
                raise UserError(f"step {step}: loss or gradient is not finite (batch of sequences "
                                f"{idx_global}); nothing saved, the last good checkpoint is "
                                f"{last_ckpt or 'none'}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            tokens_seen += int(n_tok)
            win_tokens += n_tok
            win_stats += packed[:3 * J].view(3, J)
            win_replay += packed[3 * J:3 * J + 2]
            if bar is not None:
                bar.update(1)
            if step % args.log_every == 0 or step == stop_at:
                m = metrics(win_stats, win_replay)
                dt = time.perf_counter() - win_t0
                rec = {"step": step, "split": "train", "tokens": tokens_seen,
                       "lr": sched.get_last_lr()[0], "grad_norm": gnorm.item(), **m,
                       "tokens_per_s": win_tokens / max(dt, 1e-9),
                       "data_wait": (source.wait - win_wait0) / max(dt, 1e-9)}
                log(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_j'][0]:.2f}",
                                    al3=f"{m['accept_len_3']:.2f}", wait=f"{rec['data_wait']:.0%}")
                win_stats.zero_()
                win_replay.zero_()
                win_t0, win_tokens, win_wait0 = time.perf_counter(), 0, source.wait
            if eval_batches and (step % args.eval_every == 0 or step == total):
                module.eval()
                m = evaluate()
                module.train()
                log({"step": step, "split": "eval", "tokens": tokens_seen, **m})
                if args.keep_best and m["replay_accept_3"] > best_replay:
                    best_replay = m["replay_accept_3"]
                    save_best(args.out, step, module, cfg, rank, parse_dtype(args.export_dtype), m)
                if rank == 0:
                    write_plots(args.out, log_path)
                    msg = (f"eval step {step}: loss {m['loss']:.3f}, acc "
                           f"{' '.join(f'{a:.2f}' for a in m['acc_j'])}, accept length (3 drafts) "
                           f"{m['accept_len_3']:.2f} simulated, {m['replay_accept_3']:.2f} replayed")
                    (bar.write(msg, file=sys.stderr) if bar is not None else print(msg, file=sys.stderr))
            if step % args.save_every == 0 or step == stop_at or stopping:
                last_ckpt = checkpoint(step)
            if stopping:
                if rank == 0:
                    print(f"\ninterrupted: saved {last_ckpt}; continue with --resume", file=sys.stderr)
                if bar is not None:
                    bar.close()
                source.close()
                dist.destroy_process_group()
                sys.exit(130)
        if bar is not None:
            bar.close()
        if rank == 0:
            write_plots(args.out, log_path)
            print(f"done: step {step}/{total}, draft in {last_ckpt or list_checkpoints(args.out)[-1]}",
                  file=sys.stderr)
        source.close()
    finally:
        if online is not None:
            online.close()
        if dist.is_initialized():
            dist.destroy_process_group()


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
