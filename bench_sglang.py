"""
bench.py's SGLang backend: for each config an SGLang server is launched with the matching
speculative flags (sglang_engine.py holds every SGLang call), the prompts are sent to its native
/generate endpoint `batch_size` at a time, and accept length is sum(completion_tokens) /
sum(spec_verify_ct) from the responses' meta_info, as SpecForge's bench_eagle3.py reports it.
"""
import contextlib
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks import Config, conversation
from common import UserError


def send_all(base_url, prompts, batch_size, sampling):
    """All prompts, `batch_size` requests in flight. Returns (texts, metas, wall seconds)."""
    from sglang_engine import generate as sglang_generate
    t0 = time.perf_counter()
    ex = ThreadPoolExecutor(max_workers=batch_size)
    try:
        got = list(ex.map(lambda ids: sglang_generate(base_url, ids, sampling), prompts))
    finally:
        # on an error or Ctrl-C do not wait for requests still in flight: the server is killed next
        ex.shutdown(wait=False, cancel_futures=True)
    return [g[0] for g in got], [g[1] for g in got], time.perf_counter() - t0


def run_sglang(args, benches, configs, tok, stop, target_dir):
    """Each config on its own server (or all on the running one with --skip-launch-server)."""
    from tqdm import tqdm
    from common import chat_prompt_ids
    import sglang_engine as sge  # every SGLang call lives there
    if not args.skip_launch_server:
        sge.require_sglang()
    base_url = f"http://{args.host}:{args.port}"
    sampling = {"temperature": args.temperature, "top_p": args.top_p,
                "max_new_tokens": args.max_new_tokens, "stop_token_ids": list(stop)}
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(args.dtype, args.dtype)
    # Plain decoding first: its answers make the MT-Bench second-turn prompts of every config.
    order = sorted(configs, key=lambda c: c.speculative)
    answers = {}    # (benchmark, item) -> answers to earlier turns, from the first config run
    reference = {}  # (benchmark, item, turn) -> first config's text, for greedy mismatches
    results = {}
    log_dir = None if args.skip_launch_server else tempfile.mkdtemp(prefix="bench-sglang-")
    try:
        for cfg in order:
            if args.skip_launch_server:
                if not sge.healthy(base_url):
                    raise UserError(f"--skip-launch-server: no healthy server at {base_url}/health")
                server = contextlib.nullcontext()
            else:
                draft = args.draft and os.path.abspath(args.draft)
                cmd = sge.server_command(target_dir, draft, cfg, args.host, args.port, dtype,
                                         args.server_args.split())
                print(f"launching: {' '.join(cmd)}", file=sys.stderr)
                server = sge.launched_server(cmd, base_url, args.server_timeout,
                                             os.path.join(log_dir, f"server-{cfg.label}.log"),
                                             env=sge.server_env(cfg))
            with server:
                sge.generate(base_url, chat_prompt_ids(tok, "Hi"), dict(sampling, max_new_tokens=4))
                for label, items in tqdm(benches, desc=f"sglang {cfg.label}", file=sys.stderr):
                    metas, walls, mismatches = [], 0.0, 0
                    for turn in range(max(len(it.turns) for it in items)):
                        todo = [qi for qi, it in enumerate(items) if turn < len(it.turns)]
                        prompts = [chat_prompt_ids(tok, conversation(
                            items[qi], turn, answers.get((label, qi), []))) for qi in todo]
                        texts, m, wall = send_all(base_url, prompts, cfg.batch_size, sampling)
                        metas += m
                        walls += wall
                        for qi, text in zip(todo, texts):
                            key = (label, qi, turn)
                            if key not in reference:
                                reference[key] = text
                                answers.setdefault((label, qi), []).append(text)
                            mismatches += text != reference[key]
                    entry = sge.metrics(metas, walls)
                    entry.update(prompts=len(metas), runs=len(metas), position_acceptance=None,
                                 mismatches=mismatches if args.temperature == 0 else None)
                    results.setdefault(label, {})[cfg.label] = entry
    except BaseException as e:
        # a server that failed to start keeps its log (the error names it); nothing else stays
        if log_dir and log_dir not in str(e):
            shutil.rmtree(log_dir)
        raise
    if log_dir:
        shutil.rmtree(log_dir)
    # Speedup: throughput over plain decoding at the same batch size, when that config ran.
    for per_cfg in results.values():
        for c in configs:
            base = per_cfg.get(Config(c.batch_size, 0, 0, 0).label)
            e = per_cfg[c.label]
            e["speedup"] = (e["tokens_per_s"] / base["tokens_per_s"]
                            if base and base["tokens_per_s"] > 0 else None)
    return results
