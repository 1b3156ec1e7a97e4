"""Benchmark (not part of the test suite): which dtype is faster on this machine for what the
speculative loop does, a 1-token decode step and a 4-token verify on a 200-token cache, in fp32 and
bf16, with nn.Linear's own kernel and with oneDNN's prepacked one (common.pack_linears; bf16
packing only where it runs here). The numbers behind `--dtype auto` (README, *Which dtype*).

    OMP_NUM_THREADS=2 python tests/bench_dtype.py [--target default] [--repeats 30] [--threads 2]

Every variant is timed in each round, in turn, so a noisy machine hits them alike; the table gives
medians over rounds, and each variant's verify / decode ratio (below ~1.5 speculation can pay)."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from common import load_target, machine_summary, pack_linears, packed_linear_works  # noqa: E402


def timed_forward(model, cache, ids):
    """ms of one forward of `ids` on top of `cache`, then the cache is cut back to where it was."""
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    ms = (time.perf_counter() - t0) * 1e3
    cache.crop(-ids.shape[1])
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}")
    from transformers import DynamicCache
    variants = {}   # name -> (model, its cache holding the prefix)
    for dtype in (torch.float32, torch.bfloat16):
        for packed in (False, True):
            name = f"{str(dtype)[6:]} {'packed' if packed else 'plain'}"
            if packed and not packed_linear_works(dtype):
                print(f"{name}: oneDNN's prepack does not run for this dtype on this CPU, skipped")
                continue
            model, _ = load_target(args.target, dtype, "cpu")
            if packed:
                pack_linears(model)
            prefix = torch.randint(100, model.config.vocab_size, (1, args.prefix),
                                   generator=torch.Generator().manual_seed(0))
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(prefix, cache=cache, use_cache=True)
            variants[name] = (model, cache)
    one = torch.randint(100, 1000, (1, 1), generator=torch.Generator().manual_seed(1))
    four = torch.randint(100, 1000, (1, 4), generator=torch.Generator().manual_seed(1))
    times = {k: ([], []) for k in variants}
    for _ in range(3):   # warm-up
        for m, cache in variants.values():
            timed_forward(m, cache, one), timed_forward(m, cache, four)
    for _ in range(args.repeats):
        for k, (m, cache) in variants.items():
            times[k][0].append(timed_forward(m, cache, one))
            times[k][1].append(timed_forward(m, cache, four))
    base = statistics.median(times["float32 plain"][0])
    print(f"\n{args.prefix}-token cache, {torch.get_num_threads()} threads, medians of "
          f"{args.repeats} rounds")
    print(f"{'variant':16s} {'decode ms':>10s} {'verify-4 ms':>12s} {'verify/decode':>14s} "
          f"{'decode vs fp32 plain':>21s}")
    for k, (d, v) in times.items():
        md, mv = statistics.median(d), statistics.median(v)
        print(f"{k:16s} {md:10.1f} {mv:12.1f} {mv / md:14.2f} {base / md:20.2f}x")


if __name__ == "__main__":
    main()
