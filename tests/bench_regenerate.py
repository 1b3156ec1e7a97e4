"""Benchmark (not part of the test suite): where generate.py's regeneration spends its time. One
batched prefill of --batch prompts of --prompt-len tokens, then --steps batched decode steps, each
timed, on the target as generate.py runs it (packed linears, some rows left-padded), once with
transformers' DynamicCache (torch.cat of the whole cache at every step) and once with
prompts.growing_cache (generate.py's). Regeneration's cost per conversation is then about

    prefill tokens / prefill rate  +  decode steps x step time / batch

where every turn after the first re-prefills the conversation so far (each turn is a fresh
batched `generate` call), which is why the prefill rate matters as much as the step time.

    OMP_NUM_THREADS=1 python tests/bench_regenerate.py [--batch 64] [--prompt-len 300] [--steps 40]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from common import load_target, machine_summary, pack_linears, resolve_dtype  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from prompts import growing_cache
    from speculate import new_target_cache
    dtype, why = resolve_dtype(args.dtype)
    target, _ = load_target(args.target, dtype)
    pack_linears(target)
    print(f"dtype {why}; machine: {machine_summary()}")
    B, P = args.batch, args.prompt_len
    ids = torch.randint(100, 20000, (B, P), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, P, dtype=torch.long)
    mask[: B // 2, : P // 10] = 0                       # half the rows left-padded, as in a batch
    for name, make in (("DynamicCache", new_target_cache), ("growing_cache", growing_cache)):
        prefill, steps = run(target, ids, mask, make(target), args.steps)
        print(f"{name}: prefill {B} x {P} tokens {prefill:.1f} s ({B * P / prefill:.0f} tok/s); "
              f"decode step of {B} rows, context {P}..{P + args.steps}: median "
              f"{statistics.median(steps) * 1e3:.0f} ms (first {steps[0] * 1e3:.0f}, last "
              f"{steps[-1] * 1e3:.0f}; {B / statistics.median(steps):.0f} new tok/s)")


def run(target, ids, mask, cache, n_steps):
    """Seconds of the prefill and of each greedy decode step on top of it."""
    from speculate import cache_kwarg
    kw = {cache_kwarg(target): cache, "use_cache": True}
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = target(input_ids=ids, attention_mask=mask, logits_to_keep=1, **kw)
        prefill = time.perf_counter() - t0
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(n_steps):
            mask = torch.cat([mask, torch.ones(len(ids), 1, dtype=torch.long)], 1)
            t0 = time.perf_counter()
            out = target(input_ids=nxt, attention_mask=mask, **kw)
            steps.append(time.perf_counter() - t0)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, steps


if __name__ == "__main__":
    main()
