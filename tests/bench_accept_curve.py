"""Benchmark (not a unit test): accept length against training tokens, measured, for a train.py run.

For every checkpoint a run kept (train.py --keep N), decode benchmark prompts with speculate.py's
Speculator (greedy, steps 3, topk 1, 4 draft tokens by default) and measure the accept length; put
it next to what training predicted at the same step (eval's simulated and replayed accept length
from log.jsonl). One plot answers both "how much does more data buy?" and "does the training
metric tell the truth?".

    python tests/bench_accept_curve.py runs/NAME [--benchmark mtbench:8] [--max-new-tokens 128]
        [--stride K] [--reference DRAFT ...]

--stride K measures every K-th kept checkpoint (and always the last); --reference measures other
drafts (e.g. the shipped one) on the same prompts, drawn as horizontal lines: where the run's curve
crosses one is the training tokens this recipe needs to match that draft.

Writes runs/NAME/accept_curve.json and .png (atomically). Prompts are the first turns of the
benchmark's items, plus their second turns answered by the target's own greedy first answer.
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import UserError, atomic_write, atomic_write_text, run_main  # noqa: E402


def checkpoints(run):
    found = sorted(glob.glob(os.path.join(run, "checkpoints", "step-*")))
    found = [d for d in found if os.path.exists(os.path.join(d, "model.safetensors"))]
    if not found:
        raise UserError(f"{run}: no checkpoints/step-*/model.safetensors (is it a train.py run?)")
    return [(int(os.path.basename(d).split("-")[1]), d) for d in found]


def read_log(run):
    """step -> training tokens seen, and step -> eval record."""
    path = os.path.join(run, "log.jsonl")
    if not os.path.exists(path):
        raise UserError(f"{run}: no log.jsonl")
    tokens, evals = {}, {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("split") == "train":
                tokens[r["step"]] = r["tokens"]
            elif r.get("split") == "eval":
                evals[r["step"]] = r
                tokens.setdefault(r["step"], r.get("tokens"))
    return tokens, evals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="train.py run directory")
    ap.add_argument("--target", default="default")
    ap.add_argument("--benchmark", default="mtbench:8", help="name[:count], as bench.py")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stride", type=int, default=1, metavar="K",
                    help="every K-th checkpoint (and the last)")
    ap.add_argument("--reference", nargs="*", default=[], metavar="DRAFT",
                    help="draft directories measured on the same prompts, drawn as lines")
    args = ap.parse_args()
    if args.stride < 1:
        raise UserError(f"--stride {args.stride}: expected >= 1")
    for d in args.reference:
        if not os.path.exists(os.path.join(d, "config.json")):
            raise UserError(f"--reference {d}: no config.json (expected a draft directory)")

    import torch
    from tqdm import tqdm
    from benchmarks import greedy_turn_prompts, parse_benchmark
    from common import load_target, pack_linears, stop_token_ids
    from model import load_draft_for
    from speculate import Speculator
    if args.threads:
        torch.set_num_threads(args.threads)

    ckpts = checkpoints(args.run)
    ckpts = ckpts[::-1][::args.stride][::-1]            # every K-th, counted back from the last
    tokens, evals = read_log(args.run)
    label, items = parse_benchmark(args.benchmark)
    target, tok = load_target(args.target, args.dtype, "cpu")
    pack_linears(target)
    stop = stop_token_ids(tok, target.generation_config)

    # Prompts: first turns, then second turns after the target's own greedy first answer.
    prompts = greedy_turn_prompts(target, tok, items, args.max_new_tokens, stop)

    def measure(path):
        """(accept length, rounds): verified tokens per verify round over all the prompts."""
        draft = pack_linears(load_draft_for(path, target, target.dtype))
        spec = Speculator(target, draft, args.steps, args.topk, args.num_draft_tokens, 0.0, 1.0,
                          stop)
        rounds = verified = 0
        for ids in prompts:
            _, s = spec.generate(ids, args.max_new_tokens)
            rounds += s["rounds"]
            verified += sum(s["accepted"]) + s["rounds"]
        return verified / max(rounds, 1), rounds

    references = []
    for path in args.reference:
        a, r = measure(path)
        references.append({"draft": path, "accept_length": a, "rounds": r})
        print(f"reference {path}: measured {a:.3f}", file=sys.stderr)

    points = []
    for step, path in tqdm(ckpts, desc="checkpoints", file=sys.stderr):
        a, r = measure(path)
        ev = evals.get(step, {})
        points.append({"step": step, "tokens": tokens.get(step), "checkpoint": path,
                       "accept_length": a, "rounds": r,
                       "simulated": ev.get("accept_len_3"), "replayed": ev.get("replay_accept_3")})
        print(f"step {step}: tokens {tokens.get(step)}, measured {points[-1]['accept_length']:.3f}, "
              f"simulated {ev.get('accept_len_3')}, replayed {ev.get('replay_accept_3')}",
              file=sys.stderr)

    out = {"run": args.run, "benchmark": label, "prompts": len(prompts),
           "settings": {k: getattr(args, k) for k in ("max_new_tokens", "steps", "topk",
                                                       "num_draft_tokens", "dtype")},
           "points": points, "references": references}
    base = os.path.join(args.run, "accept_curve")
    atomic_write_text(base + ".json", json.dumps(out, indent=2) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = [p["tokens"] or p["step"] for p in points]
    ax.plot(x, [p["accept_length"] for p in points], "o-",
            label=f"measured, speculate.py on {label} ({len(prompts)} prompts)")
    ev = [(xi, p) for xi, p in zip(x, points) if p["simulated"] is not None]
    if ev:
        ax.plot([e[0] for e in ev], [e[1]["simulated"] for e in ev], "s--",
                label="training eval: simulated (held-out split)")
        ax.plot([e[0] for e in ev], [e[1]["replayed"] for e in ev], "^:",
                label="training eval: replayed")
    for i, r in enumerate(references):
        ax.axhline(r["accept_length"], color=f"C{3 + i}", lw=1,
                   label=f"{os.path.basename(os.path.normpath(r['draft']))}: {r['accept_length']:.3f}")
    ax.set_xlabel("training tokens seen" if points[0]["tokens"] else "step")
    ax.set_ylabel(f"accept length (steps {args.steps}, topk {args.topk}, greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(os.path.basename(os.path.normpath(args.run)))
    fig.tight_layout()
    atomic_write(base + ".png", lambda p: fig.savefig(p, dpi=120, format="png"))
    print(f"wrote {base}.json and {base}.png", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
