"""The command lines on the real default target: a clean run with --check, and every user mistake
answered by one clear error line and a non-zero exit (never a traceback)."""
import glob
import json
import os

import pytest
import torch

from conftest import ROOT
from runscript import run_script


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_script(args, cwd=ROOT, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def default_cfg():
    from common import resolve_target
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(resolve_target("default"))


def make_draft(path, tcfg, **override):
    from model import Eagle3Draft
    from draft_config import config_from_target
    cfg = config_from_target(tcfg, 256)
    for k, v in override.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    Eagle3Draft(cfg).save_pretrained(str(path))
    return str(path)


def assert_user_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), r.stderr[-2000:]
    for n in needles:
        assert n in last, last


def test_model_cli_creates_and_describes(tmp_path):
    r = run("model.py", "--target", "default", "--out", str(tmp_path / "d"), "--draft-vocab-size", "1024")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "parameters" in r.stdout and "[1, 14, 26]" in r.stdout
    r = run("model.py", str(tmp_path / "d"))
    assert r.returncode == 0 and "LlamaForCausalLMEagle3" in r.stdout and "lm_head.weight" in r.stdout
    assert_user_error(run("model.py", "--out", str(tmp_path / "e"), "--draft-vocab-size", "0"),
                      "--draft-vocab-size")


def test_model_cli_averages_checkpoints(tmp_path, default_cfg):
    """--average writes the elementwise mean of the checkpoints' weights (every tensor, two decoder
    layers so the vLLM norm copies are exercised) and refuses checkpoints of different drafts."""
    from safetensors.torch import load_file
    from model import Eagle3Draft
    paths = [make_draft(tmp_path / f"c{i}", default_cfg, num_hidden_layers=2) for i in range(3)]
    # make_draft seeds 0 every time: give each checkpoint its own weights, as a run's steps would have
    emb = torch.zeros(default_cfg.vocab_size, default_cfg.hidden_size)
    for i, p in enumerate(paths):
        d = Eagle3Draft.from_pretrained(p, embed_weight=emb)
        with torch.no_grad():
            g = torch.Generator().manual_seed(100 + i)
            for name, t in d.named_parameters():
                if name != "embed_tokens.weight":
                    t.add_(torch.randn(t.shape, generator=g))
        d.save_pretrained(p)
    r = run("model.py", "--average", *paths, "--out", str(tmp_path / "avg"))
    assert r.returncode == 0, r.stderr[-2000:]
    sds = [load_file(os.path.join(p, "model.safetensors")) for p in paths]
    got = load_file(str(tmp_path / "avg" / "model.safetensors"))
    assert set(got) == set(sds[0]) and "layers.1.input_layernorm.weight" in got
    for k, v in got.items():
        if v.is_floating_point():
            want = (sum(sd[k].double() for sd in sds) / 3).to(v.dtype)
            assert torch.equal(v, want), k
            assert not torch.equal(v, sds[-1][k]), k
        else:
            assert torch.equal(v, sds[0][k]), k
    # a different vocabulary map is another draft: refused, naming the file
    other = Eagle3Draft.from_pretrained(paths[0], embed_weight=emb)
    ids = torch.arange(256) * 2
    other.d2t.copy_(ids - torch.arange(256))
    other.t2d.zero_()
    other.t2d[ids] = True
    other.save_pretrained(str(tmp_path / "other"))
    assert_user_error(run("model.py", "--average", paths[0], str(tmp_path / "other"),
                          "--out", str(tmp_path / "x")), "other", "d2t")
    assert_user_error(run("model.py", "--average", paths[0], "--out", str(tmp_path / "x")),
                      "two or more")
    assert_user_error(run("model.py", "--average", *paths), "--out")
    assert not (tmp_path / "x").exists()


SHIPPED_DRAFT = os.path.join(ROOT, "drafts", "smollm2-135m-eagle31-3k2")   # README's main command


@pytest.mark.skipif(not os.path.isdir(SHIPPED_DRAFT), reason="the shipped draft is not checked out")
def test_speculate_check_on_default_target(tmp_path):
    """--check on the real target with a trained draft, chain and tree: identical outputs AND
    drafts accepted (a random draft accepts nothing, so it would prove nothing about the
    verify / commit paths)."""
    out = tmp_path / "r.json"
    for extra, lo in [([], 1.3), (["--steps", "3", "--topk", "2", "--num-draft-tokens", "6"], 1.4)]:
        r = run("speculate.py", "--draft", SHIPPED_DRAFT, "--prompt", "Name three colours.",
                "--max-new-tokens", "24", "--dtype", "float32", "--check", "--json", str(out), *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "1/1 outputs identical" in r.stdout
        rec = json.loads(out.read_text())
        assert rec["summary"]["mismatches"] == 0 and len(rec["records"][0]["tokens"]) <= 24
        assert rec["summary"]["accept_length"] > lo, rec["summary"]
        assert max(rec["records"][0]["accepted"]) >= 2, rec["records"][0]["accepted"]


def test_speculate_bad_inputs(tmp_path, default_cfg):
    good = make_draft(tmp_path / "good", default_cfg)
    base = ["speculate.py", "--prompt", "hi", "--max-new-tokens", "4"]
    assert_user_error(run(*base, "--draft", str(tmp_path / "missing")), "no such directory")
    (tmp_path / "empty").mkdir()
    assert_user_error(run(*base, "--draft", str(tmp_path / "empty")), "config.json")
    bad_h = make_draft(tmp_path / "h", default_cfg, target_hidden_size=512)
    assert_user_error(run(*base, "--draft", bad_h), "hidden_size")
    bad_v = make_draft(tmp_path / "v", default_cfg, vocab_size=32000)
    assert_user_error(run(*base, "--draft", bad_v), "vocab_size")
    bad_l = make_draft(tmp_path / "l", default_cfg, aux_layer_ids=[1, 14, 29])
    assert_user_error(run(*base, "--draft", bad_l), "layer")
    corrupt = make_draft(tmp_path / "c", default_cfg)
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.truncate(1000)
    assert_user_error(run(*base, "--draft", corrupt), "model.safetensors")
    assert_user_error(run(*base, "--draft", good, "--dtype", "float64"), "--dtype")
    assert_user_error(run(*base, "--draft", good, "--topk", "0"), "--topk")
    assert_user_error(run(*base, "--draft", good, "--num-draft-tokens", "6"), "--num-draft-tokens")
    assert_user_error(run(*base, "--draft", good, "--topk", "2", "--num-draft-tokens", "40"),
                      "--num-draft-tokens")
    assert_user_error(run(*base, "--draft", good, "--temperature", "0.5", "--check"), "--check")
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert_user_error(run("speculate.py", "--draft", good, "--prompts", str(p)), f"{p}:2")
    r = run(*base, "--draft", good, "--steps", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr   # argparse's own usage error


SHIPPED = sorted(os.path.relpath(os.path.dirname(p), ROOT)
                 for p in glob.glob(os.path.join(ROOT, "drafts", "*", "config.json")))


@pytest.fixture(scope="module")
def sea_poem():
    """The default target in fp32 (packed, as speculate.py runs it) and its own greedy answer to
    one prompt: the reference every committed draft must reproduce. Computed once for all of
    them (speculate.py --check would decode it again per draft; the CLI path itself is
    test_speculate_check_on_default_target)."""
    from common import chat_prompt_ids, load_target, pack_linears, stop_token_ids
    from speculate import target_generate
    target, tok = load_target("default", torch.float32, "cpu")
    pack_linears(target)
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "Write a short poem about the sea."}])
    stop = stop_token_ids(tok, target.config)
    ref, _ = target_generate(target, ids, 48, stop_ids=stop)
    return target, ids, stop, ref


@pytest.mark.parametrize("draft", SHIPPED)
def test_committed_draft_is_lossless_and_accepts(sea_poem, draft):
    # the shipped draft: small, loads against the default target, exact in fp32, and trained
    # (a random draft's accept length is ~1.0; this one must get well past it on a plain prompt)
    from common import pack_linears
    from model import load_draft_for
    from speculate import Speculator
    size = sum(os.path.getsize(os.path.join(ROOT, draft, f)) for f in os.listdir(os.path.join(ROOT, draft)))
    assert size < 25e6, size
    target, ids, stop, ref = sea_poem
    d = pack_linears(load_draft_for(os.path.join(ROOT, draft), target, torch.float32))
    out, s = Speculator(target, d, 3, 1, 4, stop_ids=stop).generate(ids, 48, torch.Generator().manual_seed(0))
    assert out == ref
    assert s["accept_length"] > 1.2, s


def test_default_target_converts_once_when_two_start_together(tmp_path, monkeypatch):
    """Two processes (two scripts, two test workers) on an empty cache: one converts the GGUF, the
    other waits on the lock and finds the finished directory, never a half-written or deleted one.
    Threads stand in for processes: flock locks an open file, so two opens exclude each other."""
    import threading
    import time
    import common
    calls = []

    def slow_convert(gguf_dir, out):
        calls.append(out)
        time.sleep(0.3)   # a window in which the other caller must wait, not convert
        tmp = str(tmp_path / "half")
        os.makedirs(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
        os.replace(tmp, out)

    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(common, "convert_gguf", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(common.default_target_dir()))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = str(tmp_path / "cache" / "SmolLM2-135M-Instruct")
    assert got == [out, out]
    assert calls == [out], calls   # converted once
    assert os.path.exists(os.path.join(out, "config.json"))


def test_default_target_converts_without_fcntl(tmp_path, monkeypatch):
    """Where fcntl does not exist (not POSIX) the conversion runs unlocked, and still once."""
    import sys
    import common
    calls = []

    def convert(gguf_dir, out):
        calls.append(out)
        os.makedirs(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setitem(sys.modules, "fcntl", None)     # `import fcntl` raises ImportError
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(common, "convert_gguf", convert)
    out = common.default_target_dir()
    assert common.default_target_dir() == out and calls == [out]
