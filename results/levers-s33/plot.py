"""Session 33's lever: the cosine's floor (--min-lr-ratio) on the best recipe from nothing, arms
side by side from the same seed on the same data (results/RUNS.md, Session 33). Reads each run's
own log.jsonl and its checkpoints' evals on the fixed held-out set h41 (train.py --init CKPT
--stop-at 1, results/levers-s33/h41eval.sh), writes summary.json and curves.png here (or --out).
Later sessions' arms on the same protocol reuse it with --arms RUN=LABEL ... --out DIR.

    python results/levers-s33/plot.py --runs /root/eagle3/runs
"""
import argparse
import json
import os
import re

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = [("s33-base", "floor 0.1 (the recipe)"), ("s33-minlr03", "floor 0.3"),
        ("s33-const", "floor 1.0 (constant after warmup)")]


def log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="/root/eagle3/runs")
    ap.add_argument("--arms", nargs="+", metavar="RUN=LABEL", default=None,
                    help="runs to draw, in order; default: session 33's three floors")
    ap.add_argument("--out", default=HERE, help="where summary.json and curves.png go")
    ap.add_argument("--x", default="step", choices=["step", "tokens"],
                    help="x axis: the step, or training tokens (arms whose steps differ: "
                         "session 36's data subsets)")
    ap.add_argument("--own-title", default="own split (3% of the run's data)",
                    help="the middle panel's title: what the runs' own held-out split is")
    args = ap.parse_args()
    R, arms = args.runs, [tuple(x.split("=", 1)) for x in args.arms] if args.arms else ARMS
    if any(len(x) != 2 for x in arms):
        ap.error("--arms: expected RUN=LABEL pairs")
    os.makedirs(args.out, exist_ok=True)
    out = {"own_split": {}, "lr": {}, "h41": {}}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, (run, label) in enumerate(arms):
        if not os.path.exists(os.path.join(R, run, "log.jsonl")):
            continue
        rows = log(os.path.join(R, run, "log.jsonl"))
        # x of a step: itself, or the training tokens the log reports at it
        tok = {d["step"]: d["tokens"] for d in rows}
        x = (lambda s: s) if args.x == "step" else (lambda s: tok[s])
        ev = [(x(d["step"]), d["replay_accept_3"]) for d in rows if d["split"] == "eval"]
        lr = [(x(d["step"]), d["lr"]) for d in rows if d["split"] == "train"]
        out["own_split"][run], out["lr"][run] = ev, lr[-1]
        ax[0].plot(*zip(*lr), label=label)
        ax[1].plot(*zip(*ev), marker="o", label=label)
        # h41: one eval directory per checkpoint, h41-s33-<run>-<step> (h41eval.sh's NAME)
        pat = re.compile(re.escape(f"h41-s33-{run}-") + r"(\d+)")
        h = {}
        for s in sorted(int(m.group(1)) for m in map(pat.fullmatch, os.listdir(R)) if m):
            p = os.path.join(R, f"h41-s33-{run}-{s}", "log.jsonl")
            if os.path.exists(p) and s in tok:
                h[x(s)] = log(p)[0]["replay_accept_3"]
        out["h41"][run] = h
        if h:
            ax[2].plot(list(h), list(h.values()), marker="o", color=f"C{i}", label=label)
    xl = "step (2 sequences)" if args.x == "step" else "training tokens"
    ax[0].set(xlabel=xl, ylabel="learning rate", title="schedule")
    ax[1].set(xlabel=xl, ylabel="replayed accept length", title=args.own_title)
    ax[2].set(xlabel=xl, ylabel="replayed accept length",
              title="held-out h41 (90 conversations, 24,541 rows)")
    if not any(out["h41"].values()):   # arms measured only on their own split (session 41)
        ax[2].remove()
        ax = ax[:2]
        fig.set_size_inches(10, 4)
    for a in ax:
        a.legend(fontsize=8)
        if args.x == "tokens":
            a.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1e3:.0f}k"))
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "curves.png"), dpi=110)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["h41"], indent=1))


if __name__ == "__main__":
    main()
