"""Session 42's lever: the TTT unroll's length (--ttt-length 4 / 5 against the recipe's 3) at equal
compute, from the same seed on the same data (results/RUNS.md, Session 42). Reads each run's own
log.jsonl (held-out replayed accept length of a 3-draft chain, the ship run's 5% split), the final
drafts' held-out accuracy per TTT step at TTT 5 (heldout5.sh: step 0 of a run started from the
draft) and their MT-Bench bench files; writes summary.json and curves.png here.

    python results/levers-s42/plot.py --runs /root/eagle3/runs --bench /root/eagle3/b42
"""
import argparse
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
# (run, label, bench name, step cost against the recipe's: train.py alone, one thread, the
#  median of three 10-step windows' tokens/s on the same first 30 steps: 260.5 / 224.0 / 213.4)
ARMS = [("s41-base", "TTT 3 (the recipe), 1,000 steps", "base", 1.0),
        ("s42-ttt4", "TTT 4, 850 steps", "ttt4", 260.5 / 224.0),
        ("s42-ttt5", "TTT 5, 780 steps", "ttt5", 260.5 / 213.4)]


def rows(path, split):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r.get("split") == split]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="/root/eagle3/runs")
    ap.add_argument("--bench", default="/root/eagle3/b42", help="bench_NAME.json files")
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args()
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    summary = {}
    for run, label, name, cost in ARMS:
        ev = rows(os.path.join(args.runs, run, "log.jsonl"), "eval")
        x = [r["step"] * cost for r in ev]
        y = [r["replay_accept_3"] for r in ev]
        ax[0].plot(x, y, "o-", label=label)
        h5 = rows(os.path.join(args.runs, f"s42-h5-{name}", "log.jsonl"), "eval")[0]
        ax[1].plot(range(5), h5["acc_j"], "o-", label=label)
        with open(os.path.join(args.bench, f"bench_{name}.json")) as f:
            bench = {r["config"]: r["accept_length"] for r in json.load(f)["results"]}
        summary[run] = {"cost": cost, "steps": ev[-1]["step"], "tokens": ev[-1]["tokens"],
                        "heldout_replay_3": [(r["step"], r["tokens"], r["replay_accept_3"])
                                             for r in ev],
                        "heldout_ttt5_acc": h5["acc_j"], "heldout_ttt5_simulated_5": h5["accept_len_full"],
                        "mtbench_40x2": bench}
    ax[0].set(xlabel="compute, in the recipe's steps (step x measured step cost)",
              ylabel="held-out replayed accept length (3 drafts)",
              title="equal compute: held-out (141 conversations)")
    ax[1].set_xticks(range(5))
    ax[1].set(xlabel="TTT step (draft position)", ylabel="held-out accuracy",
              title="final drafts, held-out at TTT 5 (steps 3-4 untrained for TTT 3)")
    configs = ["1,3,1,4", "1,5,4,8"]
    w = 0.25
    for i, (run, label, name, _) in enumerate(ARMS):
        ax[2].bar([c + (i - 1) * w for c in range(len(configs))],
                  [summary[run]["mtbench_40x2"][c] for c in configs], w, label=label)
    ax[2].set_xticks(range(len(configs)), [f"chain {configs[0]}", f"tree {configs[1]}"])
    ax[2].set_ylim(1.5, None)
    ax[2].set(ylabel="accept length", title="MT-Bench 40 x 2, 64 tokens, fp32")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("Session 42: the TTT unroll's length at equal compute (SmolLM2-135M, shipped recipe)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "curves.png"), dpi=110)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: {"replay": v["heldout_replay_3"][-1], "mt": v["mtbench_40x2"],
                          "acc5": [round(a, 3) for a in v["heldout_ttt5_acc"]]}
                      for k, v in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
