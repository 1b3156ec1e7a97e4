"""Every CPU: the two capability decisions (does oneDNN's prepacked linear run for this dtype here,
and is bf16 native on this device) are injected, so both branches run on any machine, with and
without AVX-512. (On an AVX2-only CPU the real bf16 prepack raises; on an AVX-512 one it runs.)"""
import functools
import os
import pytest
import torch

import common
from common import native_bf16, pack_linears, packed_linear_works, resolve_dtype

from test_speculate import bigram_pair, prompts
from speculate import Speculator, target_generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma"}                 # e.g. AMD Zen 3, Intel Alder Lake
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile"}


@pytest.fixture
def fresh_probe(monkeypatch):
    """An empty probe cache for the test, restored afterwards (the real one is per process)."""
    monkeypatch.setattr(common, "_PACK_WORKS", {})


def is_packed(lin):
    return isinstance(vars(lin).get("forward"), functools.partial)


def test_auto_picks_bf16_only_where_it_is_native():
    assert resolve_dtype("auto", "cpu", AVX2)[0] == torch.float32
    assert "no avx512_bf16/amx_bf16" in resolve_dtype("auto", "cpu", AVX2)[1]
    assert resolve_dtype("auto", "cpu", AVX512_BF16)[0] == torch.bfloat16
    assert resolve_dtype("auto", "cpu", AMX)[0] == torch.bfloat16
    assert resolve_dtype("auto", "cpu", set())[0] == torch.float32        # unknown CPU: safe side
    assert resolve_dtype("auto", "cuda")[0] == torch.bfloat16
    assert native_bf16("cpu", {"avx512f"})[0] is False   # AVX-512 alone is not native bf16


def test_explicit_dtypes_are_kept_and_slow_bf16_is_said_once(capsys):
    assert resolve_dtype("float32", "cpu", AVX512_BF16)[0] == torch.float32
    assert resolve_dtype("bfloat16", "cpu", AVX512_BF16)[0] == torch.bfloat16
    assert capsys.readouterr().err == ""
    dt, why = resolve_dtype("bfloat16", "cpu", AVX2)
    assert dt == torch.bfloat16 and "slow" in why
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "--dtype bfloat16" in err and "slower" in err
    with pytest.raises(common.UserError, match="--dtype fp8: expected one of auto"):
        resolve_dtype("fp8", "cpu", AVX2)


def test_probe_is_cached_and_matches_the_real_kernel(fresh_probe):
    """The real probe on this machine: fp32 packs wherever oneDNN exists; bf16 packs exactly when
    the reorder runs (AVX-512 machines), and either way pack_linears never raises."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    assert packed_linear_works(torch.float32) is True
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 8).bfloat16())
        bf16_runs = True
    except RuntimeError:
        bf16_runs = False
    assert packed_linear_works(torch.bfloat16) is bf16_runs
    assert set(common._PACK_WORKS) == {(torch.float32, "cpu"), (torch.bfloat16, "cpu")}
    lin = torch.nn.Linear(16, 8).to(torch.bfloat16).requires_grad_(False)
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    want = lin(x)
    pack_linears(lin)
    assert is_packed(lin) is bf16_runs
    assert torch.allclose(lin(x).float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_raising_packed_kernel_leaves_plain_linears_and_stays_lossless(fresh_probe, monkeypatch):
    """The AVX2-only branch, on any machine: the reorder raises as oneDNN does there; the probe
    says no, every Linear keeps nn.Linear's own forward, decoding runs and stays token-identical."""
    def raises(*a, **k):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                           "avx_ne_convert or avx512bw, avx512vl and avx512dq")
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", raises)
    t, d = bigram_pair()
    pack_linears(t), pack_linears(d)
    assert packed_linear_works(torch.float32) is False
    assert not any(is_packed(m) for m in list(t.modules()) + list(d.modules()))
    spec = Speculator(t, d, 3, 1, 4, stop_ids=())
    acc = []
    for p in prompts(4, 32, seed=5):
        out, st = spec.generate(p, 30)
        assert out == target_generate(t, p, 30)[0]
        acc.append(st["accept_length"])
    assert sum(acc) / len(acc) > 1.5     # drafts were accepted: the loop really ran speculation


def test_a_wrong_packed_kernel_is_not_used(fresh_probe, monkeypatch):
    """A kernel that runs but gives a wrong product (a broken build) is rejected by the probe."""
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: real(*a) + 1.0)
    lin = pack_linears(torch.nn.Linear(16, 8).requires_grad_(False))
    assert not is_packed(lin)


def test_packing_where_the_probe_says_yes(fresh_probe, monkeypatch):
    """The AVX-512 branch: with the probe answering yes, fp32 Linears are packed."""
    monkeypatch.setattr(common, "packed_linear_works", lambda dtype, device="cpu": True)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    lin = pack_linears(torch.nn.Linear(16, 8).requires_grad_(False))
    assert is_packed(lin)


def test_scripts_say_which_dtype_and_machine(tmp_path):
    """speculate.py's first status line names the dtype auto chose, why, and the machine; with
    --check, auto is float32 (the proof is exact only there)."""
    from test_cli import default_cfg, make_draft, run
    from common import resolve_target
    from transformers import AutoConfig
    d = make_draft(tmp_path / "d", AutoConfig.from_pretrained(resolve_target("default")))
    want = "bfloat16" if native_bf16("cpu")[0] else "float32"
    for extra, dtype in [([], want), (["--check"], "float32")]:
        r = run("speculate.py", "--draft", d, "--prompt", "Hi.", "--max-new-tokens", "4",
                "--quiet", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        first = r.stderr.splitlines()[0]
        assert first.startswith(f"dtype auto: {dtype} (") and "machine: " in first, first
        assert common.cpu_name() is None or common.cpu_name() in first


@pytest.mark.parametrize("flags,fp32", [(AVX2, True), (AVX512_BF16, False)])
def test_peer_defaults_arm_dtype_follows_the_cpu(monkeypatch, flags, fp32):
    """results/peer_speculators.py's defaults arm keeps speculators' bf16 where bf16 is native and
    trains in fp32 elsewhere (bf16 there is torch's reference gemm), saying so; the CPU flags are
    injected, so both branches run on any machine."""
    import argparse
    import sys
    sys.path.insert(0, os.path.join(ROOT, "results"))
    import peer_speculators
    monkeypatch.setattr(common, "cpu_flags", lambda: flags)
    monkeypatch.setattr(peer_speculators, "cuda_available", lambda: False)
    args = argparse.Namespace(target_path="T", defaults_flags="", trainpy_flags="")
    conv = {"train_rows": 2, "lengths": [10, 20], "spec_data": "S", "vocab_files": ["d", "t"],
            "draft_vocab_size": 8, "aux_layer_ids": {"speculators_input_of_layer": [2, 3, 4]},
            "train_data_ratio": 0.5}
    cmd, changed, _ = peer_speculators.arm_flags(args, conv, "defaults")
    if fp32:
        assert cmd[cmd.index("--hidden-states-dtype") + 1] == "float32"
    else:
        assert "--hidden-states-dtype" not in cmd              # speculators' own bf16 default
    assert bool(changed) == fp32 and all("float32" in c for c in changed)
