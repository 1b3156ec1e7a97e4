"""The same guarantees on a CUDA device (skipped where there is none: CI and most laptops).

What CPU tests cannot see: kernels that differ on the GPU (SDPA, cuBLAS), tensors or generators
left on the wrong device, nccl instead of gloo for the world of one, CUDA RNG state in a resume.
Run on a GPU machine with `python -m pytest -q tests/test_cuda.py` (README, *On a GPU*)."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from test_speculate import (CONFIGS, bigram_pair, exact_first3, prompts, random_pair,
                            sampling_pair, tv, tv_bound)
from test_train import (FP32, data_dir, interrupted_equals_uninterrupted, read_log,  # noqa: F401
                        run_train, target_dir)   # the fixtures too: the same tiny target and data
from speculate import Speculator, target_generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = ["--device", "cuda"]


@pytest.mark.parametrize("steps,topk,ndt", CONFIGS)
def test_greedy_identical_on_cuda(steps, topk, ndt):
    """Chain and trees past depth 2, on a random and on a high-acceptance draft: the output on the
    GPU is the GPU target's own greedy decoding, which is also the CPU target's (the random pair's
    logit gaps are far above the kernels' rounding)."""
    for make, V, stop in [(random_pair, 64, ()), (bigram_pair, 32, (5,))]:
        t, d = make()
        refs_cpu = [target_generate(t, p, 30, stop_ids=stop)[0] for p in prompts(8, V, seed=steps)]
        t, d = t.cuda(), d.cuda()
        spec = Speculator(t, d, steps, topk, ndt, stop_ids=stop)
        accepted = 0
        for i, p in enumerate(prompts(8, V, seed=steps)):
            ref, _ = target_generate(t, p, 30, stop_ids=stop)
            out, st = spec.generate(p, 30)
            assert out == ref, (make.__name__, i)
            accepted += sum(st["accepted"])
            if make is random_pair:
                assert ref == refs_cpu[i], (make.__name__, i)
        if make is bigram_pair:
            assert accepted > 0


@pytest.mark.parametrize("gen_device", ["cpu", "cuda"])
def test_sampling_preserves_target_distribution_on_cuda(gen_device):
    """speculate.py draws from a CPU generator and bench.py from one on the target's device: both
    must work with a GPU target and keep the target's joint distribution of the first tokens
    (exact enumeration on the CPU, the bound of tests/test_speculate.py)."""
    V, n, cfg = 12, 1500, (3, 1, 4)
    t, d = sampling_pair(V)
    prompt = [3, 1, 4, 1, 5]
    exact = exact_first3(t, prompt, 1.0, 1.0).cuda()
    spec = Speculator(t.cuda(), d.cuda(), *cfg, temperature=1.0, stop_ids=())
    gen = torch.Generator(device=gen_device).manual_seed(1234)
    counts = torch.zeros(V, V, V, device="cuda")
    for _ in range(n):
        out, _ = spec.generate(prompt, 3, gen)
        counts[out[0], out[1], out[2]] += 1
    for c, p, k in [(counts.sum(2), exact.sum(2), V * V), (counts.sum((0, 1)), exact.sum((0, 1)), V)]:
        assert tv(c, p) < tv_bound(k, n), (tv(c, p), tv_bound(k, n))


def test_train_on_cuda_matches_cpu(tmp_path, data_dir, target_dir):
    """The same offline run (fp32, same seed, so the same init and batches) on both devices: the
    losses agree to rounding, the CUDA run exports a draft, and speculate.py --check on the GPU
    finds it lossless."""
    common = ["--data", data_dir, "--offline", "--batch-size", "2", "--max-steps", "12", "--lr", "3e-3",
              "--ttt-length", "3", "--eval-every", "6", "--log-every", "1", "--save-every", "6"] + FP32
    cpu, gpu = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    run_train(common + ["--out", cpu, "--device", "cpu"])
    p = run_train(common + ["--out", gpu] + CUDA)
    la, lb = read_log(cpu) + read_log(cpu, "eval"), read_log(gpu) + read_log(gpu, "eval")
    assert [(r["split"], r["step"]) for r in la] == [(r["split"], r["step"]) for r in lb] and la
    for ra, rb in zip(la, lb):
        assert ra["rows"] == rb["rows"]
        assert abs(ra["loss"] - rb["loss"]) < 1e-3 * max(1, ra["loss"]), (ra, rb, p.stderr[-500:])
    assert lb[-1]["loss"] < lb[0]["loss"]
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text("".join('{"prompt": "%s"}\n' % " ".join(f"t{i % 60}" for i in range(k, k + 9))
                                    for k in range(3)))
    cli = [sys.executable, "speculate.py", "--target", target_dir, "--draft",
           os.path.join(gpu, "checkpoints", "step-000012"), "--prompts", str(prompts_file),
           "--max-new-tokens", "24", "--dtype", "float32", "--quiet", "--steps", "5", "--topk", "4",
           "--num-draft-tokens", "8"] + CUDA
    r = subprocess.run(cli + ["--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "check: 3/3 outputs identical" in r.stdout, r.stderr[-2000:]
    r = subprocess.run(cli + ["--temperature", "0.8"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)                    # sampling: speculate.py's CPU generator
    assert r.returncode == 0 and "accept length" in r.stdout, r.stderr[-2000:]


def test_kill_and_resume_on_cuda(tmp_path, data_dir):
    """Resume on the GPU (its RNG state, nccl's world of one) gives the uninterrupted run."""
    interrupted_equals_uninterrupted(tmp_path, data_dir, "kill", extra=CUDA)


def test_online_on_cuda_matches_offline(tmp_path, data_dir):
    """The online producer runs the target on the GPU: the same losses as the stored states."""
    common = ["--data", data_dir, "--batch-size", "2", "--max-steps", "5", "--lr", "1e-3",
              "--ttt-length", "3", "--eval-every", "5", "--log-every", "1", "--fc-init", "rms"] + FP32 + CUDA
    off, on = str(tmp_path / "off"), str(tmp_path / "on")
    run_train(common + ["--out", off, "--offline"])
    run_train(common + ["--out", on, "--prefetch", "2"])
    la, lb = read_log(off), read_log(on)
    assert [r["step"] for r in la] == [r["step"] for r in lb] and la
    for ra, rb in zip(la, lb):
        assert abs(ra["loss"] - rb["loss"]) < 1e-4 * max(1, ra["loss"]), (ra, rb)
