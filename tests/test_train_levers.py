"""train.py's training-procedure levers (issue 23): --optimizer muon, --feature-noise,
--distill-topk, --loss-positions, --ttt-decay. Each is checked for its math and for reaching the training step, and only it:
the held-out eval must not see the noise or the cut labels. Resume with all three on is
test_train.py's Ctrl-C test. Tiny random targets, fp32."""
import os

import torch

from test_train import (FP32, data_dir, expect_error, final_state, read_log, run_train,  # noqa: F401
                        target_dir, tiny_draft, ttt_inputs)
import ttt
from train_data import loss_positions


def test_top_k_labels():
    p = torch.softmax(torch.randn(5, 12, generator=torch.Generator().manual_seed(0)), -1)
    p[4] = 0                                              # a row never needed stays zero
    one = ttt.top_k_labels(p, 1)
    assert torch.equal(one[:4], torch.nn.functional.one_hot(p[:4].argmax(-1), 12).float())
    assert torch.equal(one[4], p[4])
    two = ttt.top_k_labels(p, 2)
    top = p[:4].topk(2, -1)
    assert torch.allclose(two[:4].gather(-1, top.indices), top.values / top.values.sum(-1, keepdim=True))
    assert int((two[:4] > 0).sum()) == 8
    assert torch.allclose(ttt.top_k_labels(p, 12), p)      # K = the vocabulary: nothing cut


def test_noisy_features_scale_with_each_layer():
    """Three captured layers of RMS 1, 5 and 20: the noise is 0.1 of each, not of their mix."""
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1.0, 5.0, 20.0])
    x = torch.randn(4, 300, 3, 64, generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * scales[:, None]
    aux = x.reshape(4, 300, 192).clone()
    aux[:, 250:] = 0                                       # padding: no noise
    out = ttt.noisy_features(aux, 3, 0.1, torch.Generator().manual_seed(1))
    d = (out - aux).view(4, 300, 3, 64)
    std = d[:, :250].pow(2).mean((0, 1, 3)).sqrt()
    assert torch.allclose(std, 0.1 * scales, rtol=0.03), std
    assert torch.equal(out[:, 250:], aux[:, 250:])
    assert torch.equal(out, ttt.noisy_features(aux, 3, 0.1, torch.Generator().manual_seed(1)))


def test_loss_positions():
    """assistant: the loss mask as it is; all: every real token (prompt rows too), padding never."""
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(loss_positions(mask, [5, 3], "assistant"), mask)
    assert loss_positions(mask, [5, 3], "all").tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]


def test_ttt_decay_weighs_step_j_by_decay_to_the_j():
    """TTTLoss(decay=D): loss = sum_j D**j * CE_j / rows_j, from the same statistics for every D
    (the statistics do not depend on the weights); the default is 0.8."""
    draft = tiny_draft()
    B, T, J = 2, 9, 3
    ids, aux, targ_p, valid, denom, _ = ttt_inputs(draft, B, T, J, seed=3)
    args = (ids, aux, targ_p, targ_p.argmax(-1), valid, denom, 1.0)
    with torch.no_grad():
        base, st, _ = ttt.TTTLoss(draft, J)(*args)
        for d in (0.8, 0.5, 1.0):
            loss, st_d, _ = ttt.TTTLoss(draft, J, decay=d)(*args)
            assert torch.equal(st_d, st)
            want = sum(d ** j * st[0, j] / denom[j] for j in range(J))
            assert abs(loss.item() - want.item()) < 1e-5, (d, loss, want)
        assert abs(base.item() - sum(0.8 ** j * st[0, j] / denom[j] for j in range(J)).item()) < 1e-5


def one_step(data, out, lr, *flags, steps=1):
    run_train(["--data", data, "--out", out, "--offline", "--batch-size", "2", "--max-steps", str(steps),
               "--lr", lr, "--ttt-length", "3", "--warmup", "0", *flags] + FP32)
    return final_state(out)["model"]


def test_muon_orthogonalises_matrices_and_leaves_lm_head_to_adamw(tmp_path, data_dir):
    """One step from the same start: W(lr) - W(~0) is the step's update. Muon's is the momentum
    orthogonalised (singular values near one, times 0.2 sqrt(max dim) lr with match_rms_adamw);
    AdamW's first step, lr sign(g), is not. lm_head stays on AdamW: its update is AdamW's."""
    w0 = one_step(data_dir, str(tmp_path / "w0"), "1e-12")
    adam = one_step(data_dir, str(tmp_path / "adam"), "1e-3")
    muon = one_step(data_dir, str(tmp_path / "muon"), "1e-3", "--optimizer", "muon")
    for k in ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "fc.weight"):
        sm = torch.linalg.svdvals((muon[k] - w0[k]).double())
        sa = torch.linalg.svdvals((adam[k] - w0[k]).double())
        expect = 1e-3 * 0.2 * max(w0[k].shape) ** 0.5
        assert 0.6 < sm.median() / expect < 1.3, (k, sm.median() / expect)
        assert sm.max() / sm.median() < 1.7, (k, sm.tolist())          # flat: orthogonalised
        assert sa.max() / sa.median() > 2.2, (k, sa.tolist())          # AdamW's is not
    k = "lm_head.weight"
    assert not torch.equal(adam[k], w0[k]) and torch.allclose(muon[k], adam[k], atol=1e-7)
    # --muon-lr: the matrices' first update scales with it (linear in lr), the head's stays --lr's
    split = one_step(data_dir, str(tmp_path / "split"), "1e-3", "--optimizer", "muon", "--muon-lr", "2e-3")
    for k in ("midlayer.self_attn.q_proj.weight", "fc.weight"):
        want = 2 * (muon[k] - w0[k])
        assert (split[k] - w0[k] - want).norm() < 1e-3 * want.norm(), k
    k = "lm_head.weight"
    assert torch.allclose(split[k], adam[k], atol=1e-7)


def test_noise_and_cut_labels_reach_training_not_the_eval(tmp_path, data_dir):
    """From one --init draft, two steps each: the step-0 held-out eval is the same bit for bit
    with or without the levers (the eval sees clean features and full labels), and the weights
    after the steps differ (each lever reaches the training step). Two, because AdamW's first
    step is lr sign(g): a changed gradient of unchanged signs moves nothing."""
    start = str(tmp_path / "start")
    run_train(["--data", data_dir, "--out", start, "--offline", "--batch-size", "2", "--max-steps",
               "4", "--lr", "3e-3", "--ttt-length", "3"] + FP32)
    init = os.path.join(start, "checkpoints", "step-000004")
    runs = {}
    for name, flags in {"plain": [], "noise": ["--feature-noise", "0.2"],
                        "top1": ["--distill-topk", "1"], "all": ["--loss-positions", "all"],
                        "decay": ["--ttt-decay", "0.5"]}.items():
        out = str(tmp_path / name)
        runs[name] = (one_step(data_dir, out, "1e-3", "--init", init, "--eval-every", "100",
                               "--log-every", "1", *flags, steps=2),
                      read_log(out, "eval"), read_log(out))
    plain_w, plain_ev, plain_tr = runs["plain"]
    for name in ("noise", "top1", "all", "decay"):
        w, ev, tr = runs[name]
        assert ev[0]["step"] == 0 and ev[0] == plain_ev[0], name
        assert ev[-1]["rows"] == plain_ev[-1]["rows"], name          # the eval's rows: answers only
        assert any(not torch.equal(w[k], plain_w[k]) for k in w), name
    # prompt rows join the training loss: more rows than the answers alone, at every step (the
    # fixture's prompts are short, 2..T/2 tokens; which rows, exactly: test_loss_positions)
    assert len(plain_tr) == 2
    for a, p in zip(runs["all"][2], plain_tr):
        assert a["rows"] > p["rows"], (a["rows"], p["rows"])
    assert [t["rows"] for t in runs["decay"][2]] == [t["rows"] for t in plain_tr]
    expect_error(["--data", data_dir, "--out", str(tmp_path / "x"), "--feature-noise", "-1"],
                 "--feature-noise -1.0: expected >= 0")
    expect_error(["--data", data_dir, "--out", str(tmp_path / "x"), "--distill-topk", "-2"],
                 "--distill-topk -2: expected >= 1")
    expect_error(["--data", data_dir, "--out", str(tmp_path / "x"), "--ttt-decay", "0"],
                 "--ttt-decay 0.0: expected in (0, 1]")
    expect_error(["--data", data_dir, "--out", str(tmp_path / "x"), "--muon-lr", "3e-3"],
                 "--muon-lr 0.003: applies only with --optimizer muon")
    expect_error(["--data", data_dir, "--out", str(tmp_path / "x"), "--min-lr-ratio", "-0.1"],
                 "--min-lr-ratio -0.1: expected in [0, 1] (a share of --lr)")
    expect_error(["--data", data_dir, "--out", str(tmp_path / "x"), "--grad-clip", "-1"],
                 "--grad-clip -1.0: expected > 0 (inf: no clipping)")
    expect_error(["--data", data_dir, "--out", str(tmp_path / "x"), "--weight-decay", "-0.1"],
                 "--weight-decay -0.1: expected >= 0")


def test_weight_decay_shrinks_every_parameter_on_both_optimizers():
    """Decoupled decay with a zero gradient is the whole step: p <- p (1 - lr wd), on AdamW's
    parameters (lm_head, norms) and on Muon's matrices alike, at the scheduled lr (the recipe's
    --weight-decay 0.3 reaches both optimizers, not one)."""
    import argparse
    import torch.optim._muon as muon_mod
    import optim
    torchs = muon_mod._zeropower_via_newtonschulz
    g = torch.Generator().manual_seed(0)
    named = [("midlayer.mlp.up_proj.weight", torch.nn.Parameter(torch.randn(12, 8, generator=g))),
             ("lm_head.weight", torch.nn.Parameter(torch.randn(10, 8, generator=g))),
             ("norm.weight", torch.nn.Parameter(torch.rand(8, generator=g) + 0.5))]
    start = [p.detach().clone() for _, p in named]
    try:
        for name in ("adamw", "muon"):
            for wd in (0.0, 0.3):
                args = argparse.Namespace(optimizer=name, lr=1e-2, muon_lr=None, weight_decay=wd,
                                          min_lr_ratio=0.1)
                for (_, p), p0 in zip(named, start):
                    p.data.copy_(p0)
                    p.grad = torch.zeros_like(p)
                opts, scheds = optim.make_optimizers(named, args, 0, 10, "cpu", verbose=False)
                assert len(opts) == (2 if name == "muon" else 1)
                for o in opts:
                    o.step()
                for (n, p), p0 in zip(named, start):
                    assert torch.allclose(p.detach(), p0 * (1 - 1e-2 * wd), atol=1e-7), (name, wd, n)
    finally:
        muon_mod._zeropower_via_newtonschulz = torchs


def test_muon_newton_schulz_in_fp32_where_bf16_is_slow():
    """Both branches by injected CPU flags: AVX2 only -> optim.py's fp32 iteration; avx512_bf16
    -> torch's own (bf16). The fp32 one is torch's math: same result to bf16 rounding."""
    import torch.optim._muon as muon
    import optim
    torchs = muon._zeropower_via_newtonschulz
    try:
        assert not optim.muon_in_fp32_here("cpu", flags={"avx2", "avx512f", "avx512_bf16"})
        assert muon._zeropower_via_newtonschulz is torchs
        assert optim.muon_in_fp32_here("cpu", flags={"avx2", "fma"})
        assert muon._zeropower_via_newtonschulz is optim.newton_schulz_fp32
    finally:
        muon._zeropower_via_newtonschulz = torchs
    coef = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
    for shape in ((24, 40), (40, 24)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        ours, ref = optim.newton_schulz_fp32(g, coef, 5, 1e-7), torchs(g, coef, 5, 1e-7).float()
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        assert (ours - ref).abs().max() < 0.03 * ref.abs().max(), (ours - ref).abs().max()
        sv = torch.linalg.svdvals(ours)
        assert 0.5 < sv.min() and sv.max() < 1.3, sv            # about U V^T


def test_resume_refuses_another_optimizer(tmp_path, data_dir):
    """A checkpoint holds AdamW's moments and one schedule; resuming it as Muon would silently
    start Muon's momentum from nothing, so it is an error naming the flag."""
    out = str(tmp_path / "run")
    common = ["--data", data_dir, "--out", out, "--offline", "--batch-size", "2", "--ttt-length", "3"]
    run_train(common + ["--max-steps", "2"] + FP32)
    expect_error(common + ["--max-steps", "4", "--resume", "--optimizer", "muon"],
                 "--resume: the run used --optimizer adamw, not muon")
    expect_error(common + ["--max-steps", "4", "--resume", "--loss-positions", "all"],
                 "--resume: the run used --loss-positions assistant, not all")
