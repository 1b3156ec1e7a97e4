"""Session 32's two levers on one from-nothing run (results/RUNS.md, Session 32): checkpoint
averaging (model.py --average) and the cosine's floor (--min-lr-ratio 0). Reads the runs' own
log.jsonl and the fixed held-out set's evals (train.py --init CKPT --stop-at 1 on h41), writes
summary.json and curves.png here.

    python results/levers-s32/plot.py --runs /root/eagle3/runs
"""
import argparse
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))


def h41(runs, name):
    """The replayed accept length on h41 of a draft evaluated by /root/eagle3/b32/h41eval.sh."""
    path = os.path.join(runs, "h41-s32-" + name.replace("/", "_")[-59:], "log.jsonl")
    with open(path) as f:
        return json.loads(f.readline())["replay_accept_3"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="/root/eagle3/runs")
    args = ap.parse_args()
    R = args.runs
    out = {"runs": {}, "h41": {}}
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for run, label in [("s32-scratch", "floor 0.1 (the recipe)"), ("s32-minlr0", "floor 0 (--min-lr-ratio 0)")]:
        ev = [json.loads(l) for l in open(os.path.join(R, run, "log.jsonl"))]
        ev = [(d["step"], d["replay_accept_3"]) for d in ev if d["split"] == "eval"]
        out["runs"][run] = ev
        ax[0].plot(*zip(*ev), marker="o", label=label)
    ax[0].set(xlabel="step (2 sequences)", ylabel="replayed accept length",
              title="own 31-conversation split")
    ax[0].legend()
    ck = os.path.join(R, "s32-scratch", "checkpoints")
    pts = {s: h41(R, os.path.join(ck, f"step-{s:06d}")) for s in (500, 750, 992)}
    avg = {f: h41(R, os.path.join(R, f"s32-avg{f}")) for f in (10, 25, 50)}
    out["h41"] = {"s32-scratch": pts, "s32-scratch averaged (last % of checkpoints)": avg}
    ax[1].plot(list(pts), list(pts.values()), marker="o", label="floor 0.1: checkpoints")
    for f, v in avg.items():
        ax[1].scatter([992 - 992 * f / 200], [v], marker="s")
        ax[1].annotate(f"mean of last {f}%", (992 - 992 * f / 200, v), fontsize=8)
    try:
        last = h41(R, os.path.join(R, "s32-minlr0", "checkpoints", "step-000992"))
        out["h41"]["s32-minlr0"] = {992: last}
        ax[1].scatter([992], [last], marker="*", s=120, color="C1", label="floor 0: last")
    except FileNotFoundError:
        pass
    ax[1].set(xlabel="step (averages drawn at their window's centre)", ylabel="replayed accept length",
              title="held-out h41 (90 conversations, 24,541 rows)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "curves.png"), dpi=110)
    with open(os.path.join(HERE, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["h41"], indent=1))


if __name__ == "__main__":
    main()
