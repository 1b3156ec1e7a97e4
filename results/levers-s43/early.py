"""Does an early read of a lever arm rank it as its end does? No new runs: the held-out replayed
accept length that sessions 33-42's arms logged at every eval (their summary.json files, each arm
and its base from the same seed on the same data and the same held-out split) is read at the first
eval (20-25% of the run), at 40-50% and at the end, as the difference from the arm's base.

    python results/levers-s43/early.py      # writes early.json and early.png here

Arms fall in three kinds, because what an early read can see depends on it:
  same    the same schedule as the base (weight decay, clipping, labels, layer init, data subsets)
  sched   the lever is the learning-rate schedule itself (the cosine's floor, warmup)
  short   fewer steps at equal compute, each arm with its own full cosine (TTT 4 / 5): at the
          base's 40-50% such an arm is further down its own cosine
"""
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
R = os.path.dirname(HERE)
# (summary file, arm, base, kind, label)
ARMS = [
    ("levers-s33", "s33-minlr03", "s33-base", "sched", "cosine floor 0.3"),
    ("levers-s33", "s33-const", "s33-base", "sched", "constant lr"),
    ("levers-s34", "s34-wu0", "s33-base", "sched", "no warmup"),
    ("levers-s34", "s34-wu10", "s33-base", "sched", "warmup 0.10"),
    ("levers-s34", "s34-wu25", "s33-base", "sched", "warmup 0.25"),
    ("levers-s35", "s35-clip2", "s33-base", "same", "clip 2"),
    ("levers-s35", "s35-noclip", "s33-base", "same", "no clipping"),
    ("levers-s36/wd", "s35-wd01", "s33-base", "same", "weight decay 0.1"),
    ("levers-s36/wd", "s36-wd03", "s33-base", "same", "weight decay 0.3"),
    ("levers-s36/wd", "s36-wd10", "s33-base", "same", "weight decay 1.0"),
    ("levers-s36/wd", "s36-wd01-s1", "s36-base-s1", "same", "weight decay 0.1, seed 1"),
    ("levers-s36/wd", "s36-wd03-s1", "s36-base-s1", "same", "weight decay 0.3, seed 1"),
    ("levers-s36", "s36-rand50", "s33-base", "same", "a random half of the data"),
    ("levers-s36", "s36-flat50", "s33-base", "same", "the flattest half (SFDD)"),
    ("levers-s41", "s41-layer29s", "s41-base", "same", "decoder layer from the target's"),
    ("levers-s41", "s41-topk32", "s41-base", "same", "top-32 labels"),
    ("levers-s42", "s42-ttt4", "s41-base", "short", "TTT 4 (850 steps)"),
    ("levers-s42", "s42-ttt5", "s41-base", "short", "TTT 5 (780 steps)"),
]


def curve(summary, run):
    """[(x, held-out replayed accept length)] at each eval: x is a step or a token count."""
    if "own_split" in summary:
        return [tuple(p) for p in summary["own_split"][run]]
    return [(p[0], p[2]) for p in summary[run]["heldout_replay_3"]]   # levers-s42's layout


def reads(arm, base):
    """The arm's difference from its base at the first eval, at the eval nearest 45% of the
    base's run and at the end, each eval paired with the base's at the same index."""
    n = min(len(arm), len(base))
    mid = min(range(n), key=lambda i: abs(base[i][0] / base[-1][0] - 0.45))
    d = [arm[i][1] - base[i][1] for i in range(n)]
    return {"first": d[0], "mid": d[mid], "mid_frac": base[mid][0] / base[-1][0],
            "end": arm[-1][1] - base[-1][1]}


def main():
    rows = []
    for path, arm, base, kind, label in ARMS:
        with open(os.path.join(R, path, "summary.json")) as f:
            s = json.load(f)
        rows.append({"arm": arm, "base": base, "kind": kind, "label": label, "file": path,
                     **reads(curve(s, arm), curve(s, base))})
    with open(os.path.join(HERE, "early.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['label']:34s} {r['kind']:5s} first {r['first']:+.3f}  "
              f"at {r['mid_frac']:.0%} {r['mid']:+.3f}  end {r['end']:+.3f}")

    for kind in ("same", "sched", "short"):
        for key in ("first", "mid"):
            sel = [r for r in rows if r["kind"] == kind and abs(r[key]) >= 0.02]
            agree = sum((r[key] > 0) == (r["end"] > 0) for r in sel)
            small = [r["end"] for r in rows if r["kind"] == kind and abs(r[key]) < 0.01]
            print(f"{kind:5s} {key:5s}: |difference| >= 0.02 in {len(sel)} arms, the end's sign in "
                  f"{agree}; < 0.01 in {len(small)}, ending at "
                  f"{', '.join(f'{e:+.3f}' for e in small) or '-'}")

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), sharey=True)
    style = {"same": ("tab:blue", "o", "same schedule as the base"),
             "sched": ("tab:orange", "s", "the lever is the lr schedule"),
             "short": ("tab:red", "^", "fewer steps, own cosine (equal compute)")}
    for ax, key, title in ((axes[0], "first", "first eval (20-25% of the run)"),
                           (axes[1], "mid", "eval at 40-50% of the run")):
        for kind, (c, m, name) in style.items():
            sel = [r for r in rows if r["kind"] == kind]
            ax.scatter([r[key] for r in sel], [r["end"] for r in sel], c=c, marker=m, label=name)
            for r in sel:
                ax.annotate(r["label"], (r[key], r["end"]), fontsize=7, xytext=(3, 2),
                            textcoords="offset points")
        lim = 0.25
        ax.plot([-lim, lim], [-lim, lim], color="0.7", lw=0.8, ls="--")
        ax.axhline(0, color="0.5", lw=0.6)
        ax.axvline(0, color="0.5", lw=0.6)
        ax.set_xlabel(f"arm - base at the {title}")
        ax.set_title(title)
    axes[0].set_ylabel("arm - base at the end (held-out replayed accept length)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Lever arms, sessions 33-42: the early difference from the base against the final one")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "early.png"), dpi=110)


if __name__ == "__main__":
    main()
