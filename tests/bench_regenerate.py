"""Benchmark (not part of the test suite): where generate.py's regeneration spends its time. One
batched prefill of --batch prompts of --prompt-len tokens, then --steps batched decode steps, each
timed, on the target as generate.py runs it (packed linears, some rows left-padded), once with
transformers' DynamicCache (torch.cat of the whole cache at every step) and once with
prompts.growing_cache (generate.py's). Regeneration's cost per conversation is then about

    prefill tokens / prefill rate  +  decode steps x step time / batch

where a turn after the first prefills only what the conversation gained since the last one
(generate.fill_hf carries each conversation's cache from turn to turn; before, every turn
re-prefilled the whole conversation, a third of the time).

--conversations FILE times that directly: generate.fill_hf on the first --batch conversations of
FILE (their first user turns, --followups more rounds), once carrying the caches and once
re-prefilling every turn (hf_generate with its `past` dropped: the code before the change), in
alternating order --repeats times, with the seconds spent in prefills and in decode steps, and
how many conversations the two ways wrote identically.

    OMP_NUM_THREADS=1 python tests/bench_regenerate.py [--batch 64] [--prompt-len 300] [--steps 40]
    OMP_NUM_THREADS=1 python tests/bench_regenerate.py --conversations DATA/conversations.jsonl
"""
import argparse
import functools
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
    ap.add_argument("--conversations", metavar="FILE", help="time whole multi-turn regeneration instead")
    ap.add_argument("--followups", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--followup-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    from prompts import growing_cache
    from speculate import new_target_cache
    dtype, why = resolve_dtype(args.dtype)
    target, tok = load_target(args.target, dtype)
    pack_linears(target)
    print(f"dtype {why}; machine: {machine_summary()}")
    if args.conversations:
        return conversations(target, tok, args)
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


def conversations(target, tok, args):
    """Multi-turn regeneration (generate.fill_hf, greedy answers, sampled follow-ups) carrying each
    conversation's cache between turns against re-prefilling every turn."""
    import generate
    import prompts
    from common import read_prompts
    convs = [c[:next(j for j, m in enumerate(c) if m["role"] == "user") + 1]
             for c in read_prompts(args.conversations)[:args.batch]]
    skeletons = [generate.skeleton(c, args.followups) for c in convs]
    real_forward, spent = type(target).forward, []

    @functools.wraps(real_forward)            # generate reads forward's signature
    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = real_forward(self, *a, **kw)
        spent.append((kw["input_ids"].shape[1] > 1, time.perf_counter() - t0))
        return out
    type(target).forward = timed
    real = prompts.hf_generate
    ways = {"carried": real, "re-prefilled": lambda *a: real(*a[:7])}
    times, outs = {w: [] for w in ways}, {}
    for r in range(args.repeats):
        for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            generate.hf_generate = ways[way]
            spent.clear()
            t0 = time.perf_counter()
            outs[way] = generate.fill_hf(target, tok, skeletons, args.max_new_tokens, 0.0, 1.0, 0,
                                         followup=(args.followup_tokens, 1.0, 0.95))
            total = time.perf_counter() - t0
            pre = sum(t for p, t in spent if p)
            times[way].append(total)
            print(f"{way}: {total:.1f} s ({pre:.1f} s in prefills, {sum(t for p, t in spent if not p):.1f} s "
                  f"in {sum(not p for p, _ in spent)} decode steps)", flush=True)
    generate.hf_generate, type(target).forward = real, real_forward
    a, b = (statistics.median(times[w]) for w in ways)
    same = sum(x == y for x, y in zip(*outs.values()))
    print(f"{len(convs)} conversations: carried {a:.1f} s, re-prefilled {b:.1f} s (medians): {b / a:.2f}x; "
          f"{same} of {len(convs)} written identically")


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
