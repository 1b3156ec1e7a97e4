"""Benchmark (not a unit test): issue 23's recipe levers, one change at a time, same data, same seed,
same held-out set, compared at equal compute.

    python results/levers.py run --data DATA --runs RUNS --arms continued/base,scratch/eagle31
    python results/levers.py summary --runs RUNS [--mtbench 8]
    python results/levers.py replicates --runs RUNS RUNS-seed1 RUNS-seed2 --out replicates.json

Two protocols, because this CPU cannot train a draft from nothing past the early regime per arm:
- `continued`: every arm starts from the shipped draft (`--init`, 13.85M training tokens already:
  past the early regime by construction) and trains on data new to it (written with its vocabulary,
  `generate.py --vocab-from`). Only levers that apply to a trained draft can run here: the loss rows,
  a frozen lm_head, the checkpoint choice. The starting draft's own held-out numbers are step 0.
- `scratch`: every arm starts from a random draft. Architecture levers (EAGLE-3.1 norms, layers)
  can only run here; it is the early regime, so its ranking is checked against `continued` on
  the levers both can run.
- `long`: scratch at 3x the steps (~7 epochs over the lever data); `scale`: long's steps on a
  larger data set (~2 epochs over 1,280 conversations), the at-scale check of the scratch ranking.

"Equal compute" is measured, not assumed: each train record of log.jsonl carries the window's
tokens and tokens_per_s, so a run's training seconds at every eval are known; `summary`
interpolates each arm's replayed accept length at the base arm's total training seconds (an arm
with cheaper steps, a frozen lm_head, gets more tokens in the same time; two layers get fewer).
Arms run as single-process trainers, two side by side (one thread each): step times compare
only between the two arms of one pair, and only if nothing else ran then; on a shared machine
time the cost-changing levers with tests/bench_train_step.py --variants instead.

Writes RUNS/levers.json and RUNS/levers.png (atomically) and prints a Markdown table.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import UserError, atomic_write, atomic_write_text, run_main  # noqa: E402

SHIPPED = os.path.join(ROOT, "drafts", "smollm2-135m-eagle3-11k2")
COMMON = ["--offline", "--ttt-length", "3", "--batch-size", "8", "--warmup", "0.03",
          "--eval-fraction", "0.1", "--threads", "1", "--keep", "1", "--keep-best",
          "--save-every", "30", "--no-progress"]
PROTOCOLS = {
    # the lineage's continued-training flags (README, Training further), 2 epochs
    "continued": ["--init", SHIPPED, "--lr", "1e-4", "--epochs", "2", "--eval-every", "10"],
    # the recipe's flags from nothing (README, Recipe ablations' arm B)
    "scratch": ["--lr", "1e-3", "--max-steps", "100", "--eval-every", "10"],
}


def scaled(flags, k):
    """flags with every --max-steps / --eval-every value times k (the same multiple of tokens)."""
    return [str(int(f) * k) if i and flags[i - 1] in ("--max-steps", "--eval-every") else f
            for i, f in enumerate(flags)]


# scratch for 3x the tokens (~7 epochs over the lever data): does a lever's gain outlast the early
# regime, or does the base catch up once it has seen the data as often as it can use? An arm's own
# --max-steps / --eval-every are written for scratch's 100 steps, so they scale with it.
STEP_SCALE = {"long": 3, "scale": 3}
PROTOCOLS["long"] = scaled(PROTOCOLS["scratch"], STEP_SCALE["long"])
# long's steps on a larger data set (session 18: 1,280 new conversations, so 300 x 8 sequences is
# ~2 epochs, not ~7): past the early regime by unique data, not by repeats. Its held-out share is
# 5% (64 conversations) and it evaluates every EVAL_SEQUENCES sequences whatever the arm's batch
# (at scratch's every-10-steps a 2-sequence arm would evaluate 4x as often as the base).
PROTOCOLS["scale"] = PROTOCOLS["long"] + ["--eval-fraction", "0.05"]
EVAL_SEQUENCES = {"scale": 240}
# the best recipe measured (sessions 13-16: +11.5% at equal tokens over base, three seeds)
BEST = ["--optimizer", "muon", "--lr", "3e-3", "--batch-size", "2", "--max-steps", "400",
        "--ttt-decay", "0.5"]

ARMS = {   # name -> (what changes, extra train.py flags)
    "base": ("the recipe as it is", []),
    "chain": ("step j's loss only on rows whose steps 0..j-1 were right", ["--ttt-loss-rows", "chain"]),
    "frozen-head": ("lm_head frozen (continued: the draft's own trained head)", ["--freeze-lm-head"]),
    "target-head": ("lm_head = the target's rows for the draft vocabulary, frozen",
                    ["--lm-head-init", "target", "--freeze-lm-head"]),
    "eagle31": ("EAGLE-3.1: fc_norm + norm_output", [{"fc_norm": True, "norm_output": True}]),
    # tests/bench_train_step.py --variants (AVX2 EPYC, fp32, one thread, interleaved): a second
    # layer makes the draft step 1.72x; with the target side (9.99 s at a sequence's first sight,
    # 1.24 s later, vs the 6.29 s draft step, B 8 x T 256) 62 steps cost the base's 100 over
    # this data (346 training sequences: the first 43 steps see them first). Scratch only: a
    # trained one-layer draft has no second layer to continue.
    "2-layers": ("two decoder layers, ~equal FLOPs", [{"num_hidden_layers": 2}, "--max-steps", "62"]),
    # the draft's layers come from the data: generate.py --aux-layers 1 7 14 20 26 --vocab-from
    # the shipped draft (its vocabulary only), same conversations; the step costs 1.02x (a wider fc)
    "5-aux": ("five captured layers (1, 7, 14, 20, 26), not three", []),
    # training-procedure levers: they apply to a trained draft too, so both protocols run them
    "muon": ("Muon on the 2D matrices (AdamW on lm_head, norms), same lr", ["--optimizer", "muon"]),
    "muon-3e-3": ("Muon, as muon, at 3x the lr (Muon's own best lr need not be AdamW's)",
                  ["--optimizer", "muon", "--lr", "3e-3"]),
    "lr-3e-3": ("AdamW at 3x the lr: muon-3e-3's control", ["--lr", "3e-3"]),
    # bench_train_step --variants base muon: the draft step 1.20x (fp32 Newton-Schulz on this
    # AVX2 CPU); with the target side, 86 Muon steps cost the base's 100 over this data
    "muon-3e-3-86": ("muon-3e-3 at the base's compute: 86 steps",
                     ["--optimizer", "muon", "--lr", "3e-3", "--max-steps", "86"]),
    "hard-labels": ("the target's argmax as a one-hot label, not its distribution",
                    ["--distill-topk", "1"]),
    "noise": ("Gaussian feature noise, 0.1 x each layer's RMS", ["--feature-noise", "0.1"]),
    # the optimizer-steps lever: the same tokens in twice the steps. Where data, not arithmetic,
    # is what this CPU lacks, more updates per token is the cheapest way to learn more from it.
    # Scratch only (its --max-steps is the scratch protocol's 100 x 8 sequences, in 4s).
    "batch-4": ("4 sequences a step, 200 steps: the base's tokens in twice the updates",
                ["--batch-size", "4", "--max-steps", "200"]),
    "muon-3e-3-batch-4": ("muon-3e-3 with batch-4's 200 steps of 4",
                          ["--optimizer", "muon", "--lr", "3e-3", "--batch-size", "4", "--max-steps", "200"]),
    "batch-2": ("2 sequences a step, 400 steps: the base's tokens in 4x the updates",
                ["--batch-size", "2", "--max-steps", "400"]),
    "muon-3e-3-batch-2": ("muon-3e-3 with batch-2's 400 steps of 2",
                          ["--optimizer", "muon", "--lr", "3e-3", "--batch-size", "2", "--max-steps", "400"]),
    # Muon's lr was chosen at 8 sequences a step (3e-3 over 1e-3); at 2 a step, half and twice it
    "muon-1.5e-3-batch-2": ("muon-3e-3-batch-2 at half the lr",
                            ["--optimizer", "muon", "--lr", "1.5e-3", "--batch-size", "2", "--max-steps", "400"]),
    "muon-6e-3-batch-2": ("muon-3e-3-batch-2 at twice the lr",
                          ["--optimizer", "muon", "--lr", "6e-3", "--batch-size", "2", "--max-steps", "400"]),
    # one sequence a step: the end of the 8 -> 4 -> 2 trend (evals every 20 sequences, as batch-2's)
    "batch-1": ("1 sequence a step, 800 steps: the base's tokens in 8x the updates",
                ["--batch-size", "1", "--max-steps", "800", "--eval-every", "20"]),
    "muon-3e-3-batch-1": ("muon-3e-3 with batch-1's 800 steps of 1",
                          ["--optimizer", "muon", "--lr", "3e-3", "--batch-size", "1", "--max-steps", "800",
                           "--eval-every", "20"]),
    # session 15: the loss's rows and weights. Prompt rows join the loss (the target labels every
    # position, and the draft's forward over them is paid already: equal compute, ~27% more rows
    # on this data); and TTT step j's weight, 0.8**j today (speculators' default is 1.0**j).
    "all-positions": ("the TTT loss on every real token, prompts too (labels: the target's)",
                      ["--loss-positions", "all"]),
    "decay-1": ("every TTT step weighs 1 (speculators' default), not 0.8**j", ["--ttt-decay", "1.0"]),
    "decay-0.5": ("TTT step j weighs 0.5**j, not 0.8**j: the first draft step counts most",
                  ["--ttt-decay", "0.5"]),
    # session 16: 1.0 -> 0.8 -> 0.5 rose monotonically (seed 0); does it go on, and does the
    # decay stack on the best training procedure (Muon 3e-3, 2 sequences a step)?
    "decay-0.3": ("TTT step j weighs 0.3**j", ["--ttt-decay", "0.3"]),
    "muon-3e-3-batch-2-decay-0.5": ("muon-3e-3-batch-2 with decay-0.5's step weights", BEST),
    # session 17: on top of the best so far (Muon 3e-3, 400 steps of 2, --ttt-decay 0.5), one
    # change each: the head's start, and the loss's rows
    "best-head-init": ("the best arm with lm_head started from the target's rows, trained (not frozen)",
                       BEST + ["--lm-head-init", "target"]),
    "best-chain": ("the best arm with step j's loss only on rows whose steps 0..j-1 were right",
                   BEST + ["--ttt-loss-rows", "chain"]),
    # AdamW (lm_head, norms) at its own best lr, 1e-3, while Muon keeps 3e-3 (train.py --muon-lr)
    "best-adamw-1e-3": ("the best arm with AdamW's part (lm_head, norms) at 1e-3, Muon's at 3e-3",
                        ["--optimizer", "muon", "--lr", "1e-3", "--muon-lr", "3e-3", "--batch-size", "2",
                         "--max-steps", "400", "--ttt-decay", "0.5"]),
    "best-head-init-adamw-1e-3": ("best-head-init with best-adamw-1e-3's lrs",
                                  ["--optimizer", "muon", "--lr", "1e-3", "--muon-lr", "3e-3",
                                   "--batch-size", "2", "--max-steps", "400", "--ttt-decay", "0.5",
                                   "--lm-head-init", "target"]),
    # session 23 (an AMX CPU: bf16 at ~10x fp32, so scale-protocol arms take minutes): the two
    # layouts the first ablation ran only under the old recipe, now on top of best-head-init
    "bhi-eagle31": ("best-head-init with EAGLE-3.1's layout (fc_norm + norm_output)",
                    BEST + ["--lm-head-init", "target", {"fc_norm": True, "norm_output": True}]),
    # tests/bench_train_step.py --variants base 2-layers --batch-size 2 --seq-len 360 --dtype
    # bfloat16 (AMX Xeon, one thread): the second layer makes the step 1.62x, so 400 / 1.62 steps
    "bhi-2-layers": ("best-head-init with two decoder layers, ~equal FLOPs (247 of 400 steps)",
                     [*BEST[:6], "--max-steps", "247", *BEST[8:], "--lm-head-init", "target",
                      {"num_hidden_layers": 2}]),
}   # a dict in the flags is a --draft-config, written to RUNS/ARM/draft_config.json
DATA_LAYERS = {"5-aux": 5}   # arms that need --data captured at this many layers


def arm_command(protocol, arm, data, out, seed=0, dtype="auto"):
    """The arm's train.py command. seed: train.py's --seed (init, batch order and the held-out
    split: the arms of one seed share their held-out set; another seed is a replicate, run into
    its own --runs so each seed's arms compare with that seed's base)."""
    flags = ["--seed", str(seed), "--dtype", dtype]
    for f in scaled(ARMS[arm][1], STEP_SCALE.get(protocol, 1)):
        if isinstance(f, dict):
            path = os.path.join(out, "draft_config.json")
            atomic_write_text(path, json.dumps(f) + "\n")
            f = ["--draft-config", path]
        flags += f if isinstance(f, list) else [f]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data", data, "--out", out,
           *COMMON, *PROTOCOLS[protocol], *flags]
    if protocol in EVAL_SEQUENCES:      # the last --batch-size is the one train.py applies
        batch = int(cmd[max(i for i, c in enumerate(cmd) if c == "--batch-size") + 1])
        cmd += ["--eval-every", str(EVAL_SEQUENCES[protocol] // batch)]
    return cmd



def done(out):
    """A run is finished when its log's last train record reached the planned total."""
    args_p, log_p = os.path.join(out, "args.json"), os.path.join(out, "log.jsonl")
    if not (os.path.exists(args_p) and os.path.exists(log_p)):
        return False
    total = json.load(open(args_p))["total_steps"]
    steps = [json.loads(line)["step"] for line in open(log_p) if line.strip()]
    return bool(steps) and max(steps) >= total


def run(args):
    """Start every arm not finished (resuming one that has a checkpoint), --parallel at a time."""
    specs = [a.split("/", 1) if "/" in a else (args.protocol, a) for a in args.arms]
    for proto, a in specs:
        if a not in ARMS or proto not in PROTOCOLS:
            raise UserError(f"--arms {proto}/{a}: expected PROTOCOL/ARM or ARM (with --protocol), "
                            f"protocols {', '.join(PROTOCOLS)}, arms {', '.join(ARMS)}")
    if not os.path.exists(os.path.join(args.data, "manifest.json")):
        raise UserError(f"--data {args.data}: no manifest.json (a generate.py --hidden-states dir)")
    layers = json.load(open(os.path.join(args.data, "manifest.json")))["aux_layer_ids"]
    for proto, a in specs:
        if len(layers) != DATA_LAYERS.get(a, len(layers)):
            raise UserError(f"--arms {proto}/{a}: needs --data captured at {DATA_LAYERS[a]} layers "
                            f"(generate.py --aux-layers), {args.data} has {layers}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    queue, live = specs, []
    while queue or live:
        while queue and len(live) < args.parallel:
            proto, arm = queue.pop(0)
            out = os.path.join(args.runs, f"{proto}-{arm}")
            if done(out):
                print(f"{arm}: done already ({out})", file=sys.stderr)
                continue
            os.makedirs(out, exist_ok=True)
            cmd = arm_command(proto, arm, args.data, out, args.seed, args.dtype)
            if os.path.isdir(os.path.join(out, "checkpoints")) and os.listdir(os.path.join(out, "checkpoints")):
                cmd = [c for c in cmd if c not in ("--init", SHIPPED)] + ["--resume"]
            with open(os.path.join(out, "command.txt"), "w") as f:
                f.write(" ".join(cmd) + "\n")
            log = open(os.path.join(out, "stderr.log"), "a")
            print(f"{arm}: {' '.join(cmd)}", file=sys.stderr)
            live.append((arm, subprocess.Popen(cmd, env=env, stderr=log, stdout=log)))
        while all(p.poll() is None for _, p in live):    # wait for any one to end
            time.sleep(5)
        for arm, p in [x for x in live if x[1].poll() is not None]:
            if p.returncode != 0:
                print(f"{arm}: train.py exited {p.returncode} (see its stderr.log)", file=sys.stderr)
            live.remove((arm, p))


def read_run(out):
    """Eval records with the training seconds spent before each (from the train windows)."""
    recs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if line.strip()]
    secs, prev_tokens, evals = 0.0, 0, []
    for r in recs:
        if r["split"] == "train":
            secs += (r["tokens"] - prev_tokens) / max(r["tokens_per_s"], 1e-9)
            prev_tokens = r["tokens"]
        elif r["tokens"] == prev_tokens:   # an eval right after the window it follows
            evals.append({"step": r["step"], "tokens": r["tokens"], "seconds": secs,
                          "replay": r["replay_accept_3"], "acc_j": r["acc_j"]})
    tps = [r["tokens_per_s"] for r in recs if r["split"] == "train"]
    return evals, sorted(tps)[len(tps) // 2] if tps else None


def at_seconds(evals, s, key="seconds"):
    """Replayed accept length at s training seconds (or at s of another eval field, key="tokens"),
    linear between evals (None past the end)."""
    for a, b in zip(evals, evals[1:]):
        if a[key] <= s <= b[key]:
            w = (s - a[key]) / max(b[key] - a[key], 1e-9)
            return a["replay"] + w * (b["replay"] - a["replay"])
    # an arm that finished its steps in less than s: its last eval (it never had more)
    return evals[-1]["replay"] if evals and evals[-1][key] <= s else None


def mtbench(drafts, n, cache, target="default", save=None):
    """MT-Bench n x 2 accept length (chain 3/1/4, greedy, 128 new tokens, fp32) of each draft
    directory, in one process: the target and the prompts (second turns after the target's own
    greedy first answers) are made once. cache: {draft path: accept length}, filled in place;
    save(cache) after each draft, so a stopped summary keeps what it decoded."""
    import torch
    from benchmarks import greedy_turn_prompts, parse_benchmark
    from common import load_target, pack_linears, stop_token_ids
    from model import load_draft_for
    from speculate import Speculator
    todo = [d for d in dict.fromkeys(drafts) if d not in cache]    # each draft once
    if not todo:
        return
    torch.set_num_threads(1)
    target, tok = load_target(target, "float32", "cpu")
    pack_linears(target)
    stop = stop_token_ids(tok, target.generation_config)
    prompts = greedy_turn_prompts(target, tok, parse_benchmark(f"mtbench:{n}")[1], 128, stop)
    for d in todo:
        spec = Speculator(target, pack_linears(load_draft_for(d, target, torch.float32)),
                          3, 1, 4, 0.0, 1.0, stop)
        runs = [spec.generate(ids, 128)[1] for ids in prompts]
        cache[d] = sum(sum(s["accepted"]) + s["rounds"] for s in runs) / sum(s["rounds"] for s in runs)
        print(f"MT-Bench {n} x 2: {d}: {cache[d]:.3f}", file=sys.stderr)
        if save:
            save(cache)


def summary(args):
    runs = sorted(d for d in os.listdir(args.runs) if os.path.exists(os.path.join(args.runs, d, "log.jsonl")))
    if not runs:
        raise UserError(f"--runs {args.runs}: no arm directories with a log.jsonl")
    out = {}
    for name in runs:
        evals, tps = read_run(os.path.join(args.runs, name))
        if evals:
            out[name] = {"evals": evals, "median_tokens_per_s": tps,
                         "command": open(os.path.join(args.runs, name, "command.txt")).read().strip()}
    cache_path = os.path.join(args.runs, f"mtbench{args.mtbench}.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    for proto in PROTOCOLS:
        base = out.get(f"{proto}-base")
        budget = base["evals"][-1]["seconds"] if base else None
        for name, r in out.items():
            if name.startswith(proto + "-"):
                r["replay_at_base_seconds"] = budget and at_seconds(r["evals"], budget)
                r["best"] = max(r["evals"], key=lambda e: e["replay"])
                run_dir = os.path.join(args.runs, name)
                ck = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step-*", "model.safetensors")))
                r["last_draft"] = os.path.dirname(ck[-1]) if ck else None
                r["best_draft"] = os.path.join(run_dir, "best") if os.path.isdir(
                    os.path.join(run_dir, "best")) else None
                if r["best"]["step"] == 0 and proto == "continued":
                    r["best_draft"] = SHIPPED                  # the start was never beaten
                elif ck and r["best"]["step"] == int(os.path.basename(r["last_draft"])[5:]):
                    r["best_draft"] = r["last_draft"]          # the same weights: decode once
    if args.mtbench:
        drafts = [SHIPPED] + [r[k] for r in out.values() for k in ("last_draft", "best_draft") if r.get(k)]
        mtbench(drafts, args.mtbench, cache,
                save=lambda c: atomic_write_text(cache_path, json.dumps(c, indent=1)))
        for r in out.values():
            r["mtbench_last"], r["mtbench_best"] = cache.get(r.get("last_draft")), cache.get(r.get("best_draft"))
        print(f"MT-Bench {args.mtbench} x 2, the shipped draft (every continued arm's start): "
              f"{cache[SHIPPED]:.3f}")
    atomic_write_text(os.path.join(args.runs, "levers.json"), json.dumps(out, indent=1))
    plot(out, os.path.join(args.runs, "levers.png"))
    print("| arm | change | tokens | tok/s | held-out replayed: start / last / best (step) | "
          "at base's compute | MT-Bench last / best |")
    print("|---|---|---|---|---|---|---|")
    for name, r in out.items():
        e, arm = r["evals"], name.split("-", 1)[1]
        mt = " / ".join("-" if r.get(k) is None else f"{r[k]:.3f}" for k in ("mtbench_last", "mtbench_best"))
        at = r.get("replay_at_base_seconds")
        print(f"| {name} | {ARMS.get(arm, ('?',))[0]} | {e[-1]['tokens']:,} | "
              f"{r['median_tokens_per_s']:.0f} | {e[0]['replay']:.3f} / {e[-1]['replay']:.3f} / "
              f"{r['best']['replay']:.3f} ({r['best']['step']}) | "
              f"{'-' if at is None else f'{at:.3f}'} | {mt} |")


def replicates(args):
    """The same arms from several seeds (one --runs per seed, `run --seed`): each finished arm's
    last held-out replayed accept length per seed, and its paired difference from that seed's base
    (same held-out split) at the base's training tokens: the mean and the range say whether a
    gain is more than seed noise."""
    table = {}      # arm -> {runs: evals}
    for runs in args.runs:
        if not os.path.isdir(runs):
            raise UserError(f"--runs {runs}: no such directory (one levers.py run --runs per seed)")
        for name in sorted(os.listdir(runs)):
            if os.path.exists(os.path.join(runs, name, "log.jsonl")):
                evals, _ = read_run(os.path.join(runs, name))
                if evals and done(os.path.join(runs, name)):     # a run still going is left out
                    table.setdefault(name, {})[runs] = evals
    if not table:
        raise UserError(f"--runs {' '.join(args.runs)}: no finished arm (a log.jsonl at its last step)")
    out = {}
    for name, by_seed in table.items():
        base = table.get(name.split("-", 1)[0] + "-base", {})
        # the arm at its seed's base's last token count: whole batches make the totals differ by
        # a few percent between batch sizes, and at equal tokens means equal tokens
        at_base = {r: at_seconds(e, base[r][-1]["tokens"], "tokens") for r, e in by_seed.items() if r in base}
        diffs = [v - base[r][-1]["replay"] for r, v in at_base.items() if v is not None]
        out[name] = {"last_replay": {r: e[-1]["replay"] for r, e in by_seed.items()},
                     "last_tokens": {r: e[-1]["tokens"] for r, e in by_seed.items()},
                     "at_base_tokens": at_base, "minus_base": diffs,
                     "mean_minus_base": sum(diffs) / len(diffs) if diffs else None}
    atomic_write_text(args.out, json.dumps(out, indent=1))
    plot_replicates({name: list(by_seed.values()) for name, by_seed in table.items()},
                    os.path.splitext(args.out)[0] + ".png")
    print("| arm | last held-out replayed, per --runs | at the base's tokens, minus that seed's base | mean |")
    print("|---|---|---|---|")
    for name, r in out.items():
        vals = " / ".join(f"{r['last_replay'][k]:.3f}" if k in r["last_replay"] else "-" for k in args.runs)
        diffs = " / ".join(f"{d:+.3f}" for d in r["minus_base"])
        mean = "-" if r["mean_minus_base"] is None else f"{r['mean_minus_base']:+.3f}"
        print(f"| {name} | {vals} | {diffs} | {mean} |")


def plot_replicates(curves, path):
    """Each arm's held-out curve from every seed: one colour an arm, a line a seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, runs), color in zip(curves.items(), plt.cm.tab10.colors * 3):
        for i, evals in enumerate(runs):
            ax.plot([e["tokens"] / 1e3 for e in evals], [e["replay"] for e in evals], "-", color=color,
                    alpha=0.8, lw=1.2, label=f"{name} ({len(runs)} seeds)" if i == 0 else None)
    ax.set(title="held-out replayed accept length (chain of 3), every seed",
           xlabel="training tokens (thousands)", ylabel="tokens per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    protos = [p for p in PROTOCOLS if any(n.startswith(p + "-") for n in out)] or ["scratch"]
    fig, axes = plt.subplots(1, len(protos), figsize=(1 + 5.5 * len(protos), 4.5), squeeze=False)
    for ax, proto in zip(axes[0], protos):     # a panel for each protocol that has arms
        ax.set_prop_cycle(color=plt.cm.tab20.colors)     # more arms than the default 10 colours
        for name, r in out.items():
            if name.startswith(proto + "-"):
                ax.plot([e["tokens"] / 1e3 for e in r["evals"]], [e["replay"] for e in r["evals"]],
                        "o-", ms=3, label=f"{name.split('-', 1)[1]} ({r['median_tokens_per_s']:.0f} tok/s)")
        ax.set(title=f"{proto}: held-out replayed accept length (chain of 3)",
               xlabel="training tokens (thousands)", ylabel="tokens per round")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--data", required=True)
    r.add_argument("--runs", required=True)
    r.add_argument("--protocol", default="continued", choices=list(PROTOCOLS),
                   help="for arms given without one")
    r.add_argument("--arms", type=lambda s: s.split(","), default=["base"],
                   help="ARM or PROTOCOL/ARM, comma-separated, run in this order")
    r.add_argument("--parallel", type=int, default=2, help="arms at a time (one thread each)")
    r.add_argument("--seed", type=int, default=0,
                   help="train.py --seed of every arm (a replicate: give it its own --runs)")
    r.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="train.py --dtype of every arm (auto: bf16 where native; the first "
                        "table ran fp32 on an AVX2 CPU, session 13's bf16 on an AMX one)")
    s = sub.add_parser("summary")
    s.add_argument("--runs", required=True)
    s.add_argument("--mtbench", type=int, default=0, metavar="N",
                   help="also decode MT-Bench N x 2 with each arm's last and best draft")
    p = sub.add_parser("replicates")
    p.add_argument("--runs", nargs="+", required=True, help="one run directory per seed")
    p.add_argument("--out", required=True, help="JSON of the per-seed numbers and differences")
    args = ap.parse_args()
    {"run": run, "summary": summary, "replicates": replicates}[args.cmd](args)


if __name__ == "__main__":
    run_main(main)
