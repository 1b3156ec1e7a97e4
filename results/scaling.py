"""
MT-Bench accept length (chain 1,3,1,4, bf16, greedy, 128 new tokens, the first 8 questions x 2
turns) against training tokens, with a log-linear fit: how many training tokens the issue's 2.3
would take at the rate these runs learn.

    python results/scaling.py --curve drafts/smollm2-135m-eagle3-6k/accept_curve.json \
        --point results/mt-run/step-683/mtbench8.json --point results/mt-run/mtbench8.json \
        --point drafts/smollm2-135m-eagle3-8k/mtbench8.json

--curve: tests/bench_accept_curve.py output (every checkpoint of a run).
--point: bench.py output for one draft with `training.json` (its training tokens) beside it.
"""
import argparse
import json
import math
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chain_accept(bench_json, config="1,3,1,4"):
    d = json.load(open(bench_json))
    return next(r for r in d["results"] if r["config"] == config)["accept_length"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--curve", action="append", default=[])
    ap.add_argument("--point", action="append", default=[])
    ap.add_argument("--target", type=float, default=2.3)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs, ys = [], []
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in args.curve:
        pts = json.load(open(c))["points"]
        x, y = [p["tokens"] for p in pts], [p["accept_length"] for p in pts]
        ax.plot(x, y, "o-", label=f"{os.path.basename(os.path.dirname(c))}: every checkpoint")
        xs, ys = xs + x, ys + y
    for p in args.point:
        tokens = json.load(open(os.path.join(os.path.dirname(p), "training.json")))["tokens"]
        a = chain_accept(p)
        ax.plot([tokens], [a], "s", ms=9, label=f"{os.path.basename(os.path.dirname(p))}: {a:.3f}")
        xs, ys = xs + [tokens], ys + [a]
    b, a0 = np.polyfit(np.log2(xs), ys, 1)          # accept = a0 + b * log2(tokens)
    need = 2 ** ((args.target - a0) / b)
    grid = np.logspace(math.log10(min(xs)), math.log10(need * 1.5), 100)
    ax.plot(grid, a0 + b * np.log2(grid), "k--", lw=1,
            label=f"fit over all points: +{b:.3f} per doubling of training tokens")
    ax.axhline(args.target, color="r", lw=1, ls=":")
    ax.annotate(f"{args.target} at ~{need / 1e6:.0f}M training tokens", (need, args.target),
                textcoords="offset points", xytext=(-190, 8), color="r")
    ax.set(xscale="log", xlabel="training tokens (log)", ylabel="accept length, chain 1,3,1,4",
           title="SmolLM2-135M drafts on this CPU: MT-Bench (8 x 2) accept length")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "results", "scaling.png"), dpi=90)
    with open(os.path.join(ROOT, "results", "scaling.json"), "w") as f:
        json.dump({"fit": {"intercept": a0, "per_doubling": b}, "target": args.target,
                   "tokens_for_target": need,
                   "points": [{"tokens": x, "accept_length": y} for x, y in zip(xs, ys)]}, f, indent=1)
    print(f"accept = {a0:.3f} + {b:.4f} * log2(tokens): {args.target} at {need:.3g} training tokens "
          f"(results/scaling.png, results/scaling.json)")


if __name__ == "__main__":
    main()
