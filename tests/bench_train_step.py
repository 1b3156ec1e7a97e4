"""Benchmark (not a unit test): where one training step's time goes, at the recipe's shapes.

Times, in one process on one thread, the target side of the loss (ttt.target_side) computed the
first time a sequence is seen (full-vocabulary lm_head product, for the in-draft-vocabulary bit)
and every later time (only the draft vocabulary's rows), next to one TTT forward + backward +
AdamW step of the draft. Random features at SmolLM2-135M's sizes; only the shapes matter.

    python tests/bench_train_step.py [--ttt-length 3] [--batch-size 8] [--seq-len 256] [--vocab 8192]
    python tests/bench_train_step.py --variants base frozen-head 2-layers eagle31 5-aux muon [--repeats 7]

--shape picks the sizes: smollm2 (the default target's draft), llama3-8b (Llama-3.1-8B's: H 4096,
MLP 14336, 32 x 128 heads, vocab 128256, Vd 32000) or kimi-k2 (README, *On paper: training a
Kimi-K2 draft*: H 7168, MLP 18432, 64 x 128 heads, vocab 163840, Vd 32000); --device cuda times it
on a GPU (synchronised, with the peak memory of one process training the whole draft unsharded):

    python tests/bench_train_step.py --device cuda --shape kimi-k2 --batch-size 1 --seq-len 2048 \
        --ttt-length 7 --vocab 32000 --repeats 5

--variants times the draft step of issue 23's levers that change its cost, interleaved (one
step of each in turn, --repeats rounds, medians), so their ratios are measured side by side:
what "equal compute" means for them (results/levers.py). The target side is the same for all.
"""
import dataclasses
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ttt  # noqa: E402
from model import Eagle3Draft  # noqa: E402
from draft_config import DraftConfig  # noqa: E402
from common import resolve_dtype  # noqa: E402

SHAPES = {   # name -> (target vocab, hidden, MLP, heads, kv heads, head dim, aux layers)
    "smollm2": (49152, 576, 1536, 9, 3, 64, [1, 14, 26]),
    "llama3-8b": (128256, 4096, 14336, 32, 8, 128, [1, 15, 28]),
    "kimi-k2": (163840, 7168, 18432, 64, 64, 128, [2, 30, 57]),
}
VARIANTS = {"base": {}, "frozen-head": {}, "2-layers": {"num_hidden_layers": 2},
            "eagle31": {"fc_norm": True, "norm_output": True},
            "5-aux": {"aux_layer_ids": [1, 7, 14, 20, 26]},    # fc reads 5 x H, not 3 x H
            "muon": {},                  # the optimizer: train.py --optimizer muon's two groups
            "all-positions": {}}         # train.py --loss-positions all: prompt rows in the loss


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()      # GPU work is asynchronous: time it to its end


def timed(f, n=3):
    f()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        out = f()
    sync()
    return (time.perf_counter() - t) / n, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttt-length", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192, help="draft vocabulary")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="autocast dtype, as train.py's (auto: bf16 only where the CPU has it)")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt-share", type=float, default=1 / 6,
                    help="share of each sequence that is prompt (not in the loss); the lever "
                         "data's is 0.218 (140,249 tokens, 109,647 in the loss)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.set_num_threads(1 if dev.type == "cpu" else os.cpu_count())   # GPU: fast setup only
    torch.manual_seed(0)
    V, Ht, I, nh, nkv, hd, aux_ids = SHAPES[a.shape]
    B, T, J, Vd = a.batch_size, a.seq_len, a.ttt_length, a.vocab
    cfg = DraftConfig(hidden_size=Ht, target_hidden_size=Ht, intermediate_size=I,
                      num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, vocab_size=V,
                      draft_vocab_size=Vd, max_position_embeddings=max(8192, T), rope_theta=100000.0,
                      rms_norm_eps=1e-5, aux_layer_ids=aux_ids)
    with dev:                        # parameters made on the device (a 1.2B draft in seconds)
        draft = Eagle3Draft(cfg, torch.randn(V, Ht) * 0.02)
    ids_d = torch.randperm(V)[:Vd].sort().values
    draft.set_vocab(ids_d)
    draft.to(dev)
    lm_w = (torch.randn(V, Ht) * 0.02).bfloat16().to(dev)
    lm_wd = lm_w[ids_d.to(dev)].contiguous()
    module = ttt.TTTLoss(draft, J)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, V, (B, T), device=dev)
    aux, final = torch.randn(B, T, 3 * Ht, device=dev) * 5, torch.randn(B, T, Ht, device=dev)
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    mask[:, :int(T * a.prompt_share)] = False                 # a prompt: not in the loss
    need = ttt.shift_left(mask, 1, False)
    dt, why = resolve_dtype(a.dtype, a.device)
    print(f"dtype {why}; shape {a.shape}: {sum(p.numel() for p in draft.parameters() if p.requires_grad):,} "
          f"trainable parameters", file=sys.stderr)
    ac = torch.autocast(dev.type, dtype=dt, enabled=dt != torch.float32)
    with ac:
        t_first, (p, am, inv) = timed(lambda: ttt.target_side(final, lm_wd, need=need, lm_w=lm_w,
                                                              t2d=draft.t2d))
        t_later, _ = timed(lambda: ttt.target_side(final, lm_wd, need=need, in_vocab=inv))
    valid = ttt.valid_rows(mask, torch.ones_like(mask), J)
    denom = valid.sum((1, 2)).float()

    def step():
        with ac:
            loss, _, _ = module(ids, aux, p, am, valid, denom, 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    if a.variants:
        every = ttt.valid_rows(torch.ones_like(mask), torch.ones_like(mask), J)  # all-positions
        return time_variants(a, cfg, valid, denom, ids, aux, p, am, ac, B * T, every)
    t_step, _ = timed(step)
    n = B * T
    print(f"B={B} T={T} TTT {J} Vd {Vd}: target side first sight {t_first:.3f} s, later "
          f"{t_later:.3f} s; draft forward+backward+AdamW {t_step:.3f} s")
    print(f"share of a step: {t_first / (t_first + t_step):.0%} -> {t_later / (t_later + t_step):.0%}; "
          f"tok/s {n / (t_first + t_step):.0f} -> {n / (t_later + t_step):.0f}")
    if dev.type == "cuda":
        print(f"{torch.cuda.get_device_name()}: peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def time_variants(a, cfg, valid, denom, ids, aux, p, am, ac, n, every):
    steps = {}
    for name in a.variants:
        c = dataclasses.replace(cfg, **VARIANTS[name])
        torch.manual_seed(0)
        with torch.device(a.device):
            d = Eagle3Draft(c, torch.randn(c.vocab_size, c.hidden_size) * 0.02)
        d.set_vocab(torch.randperm(c.vocab_size)[:c.draft_vocab_size].sort().values)
        d.to(a.device)
        if name == "frozen-head":
            d.lm_head.weight.requires_grad_(False)
        m = ttt.TTTLoss(d, a.ttt_length)
        import optim    # train.py's own optimizers (Muon's Newton-Schulz in fp32 where bf16 is not native)
        params = [(k, q) for k, q in m.named_parameters() if q.requires_grad]
        opts, _ = optim.make_optimizers(params, argparse.Namespace(
            optimizer="muon" if name == "muon" else "adamw", lr=1e-4, muon_lr=None, weight_decay=0.0,
            min_lr_ratio=0.1), 0, 1, a.device, verbose=False)
        x = aux if len(c.aux_layer_ids) == 3 else \
            torch.randn(*aux.shape[:2], len(c.aux_layer_ids) * c.target_hidden_size, device=a.device) * 5

        v = every if name == "all-positions" else valid
        dn = v.sum((1, 2)).float()

        def step(m=m, opts=opts, x=x, v=v, dn=dn):
            with ac:
                loss, _, _ = m(ids, x, p, am, v, dn, 1.0)
            loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        step()                                        # warm up
        steps[name] = step
    times = {k: [] for k in steps}
    for _ in range(a.repeats):                        # interleaved: noise hits every variant
        for k, f in steps.items():
            sync()
            t = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ref = med[a.variants[0]]
    for k, t in med.items():
        print(f"{k:12s} draft step {t:.3f} s (median of {a.repeats}), {n / t:.0f} tok/s, "
              f"{t / ref:.2f}x the {a.variants[0]} step")


if __name__ == "__main__":
    main()
