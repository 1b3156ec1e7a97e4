"""Training levers of issue 23 (train.py flags; the ablations that rank them are runs, not tests):
--ttt-loss-rows chain (step j's loss only where steps 0..j-1 were right), --lm-head-init target,
--freeze-lm-head and --layer-init-from."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import ttt
from test_train import FP32, build_data, run_train, save_tiny_target, tiny_draft, ttt_inputs, VD


def test_chain_rows_loss_is_the_masked_sum():
    """chain: sum_j 0.8^j sum_{valid rows with steps 0..j-1 right} ce_j / (all valid rows of j);
    the statistics and the per-row correctness are those of the plain loss."""
    draft = tiny_draft()
    B, T, J = 2, 10, 3
    ids, aux, targ_p, valid, denom, g = ttt_inputs(draft, B, T, J, seed=5, keep=0.8)
    with torch.no_grad():
        # a target that agrees with the draft's own step-0 argmax on half the rows, so some
        # chains survive step 0 and some do not
        h0 = next(ttt.ttt_unroll(draft, ids, aux, 1))
        own = draft.lm_head(draft.norm(h0)).argmax(-1).reshape(-1)
        argmax = targ_p.argmax(-1)
        pick = torch.rand(B * T, generator=g) < 0.5
        argmax[1:][pick[:-1]] = own[:-1][pick[:-1]]      # the target at t+1 for row t
        args = (ids, aux, targ_p, argmax, valid, denom, 1.0)
        plain, st, corr = ttt.TTTLoss(draft, J)(*args)
        chain, st2, corr2 = ttt.TTTLoss(draft, J, chain_rows=True)(*args)
        assert torch.equal(st, st2) and torch.equal(corr, corr2)
        ref = 0.0
        for j, h2 in enumerate(ttt.ttt_unroll(draft, ids, aux, J)):
            lg = draft.lm_head(draft.norm(h2)).reshape(B * T, -1).float()
            for r in range(B * T):
                if valid[j].reshape(-1)[r] and all(corr[i, r] for i in range(j)):
                    ce = torch.logsumexp(lg[r], -1) - (targ_p[r + j + 1] * lg[r]).sum()
                    ref += 0.8 ** j * ce / denom[j]
    survivors = [int((corr[:j].all(0) & valid[j].reshape(-1)).sum()) for j in range(1, J)]
    assert 0 < survivors[0] < int(valid[1].sum()), survivors   # the mask drops some, keeps some
    assert abs(chain.item() - float(ref)) < 1e-4
    assert chain.item() < plain.item()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("levers")
    tdir = save_tiny_target(root / "t")
    return tdir, build_data(root / "data", tdir, n=8)


def test_lm_head_from_target_and_frozen(tmp_path, dirs):
    from common import load_target
    tdir, data = dirs
    out = str(tmp_path / "run")
    run_train(["--data", data, "--out", out, "--offline", "--batch-size", "2", "--max-steps", "2",
               "--ttt-length", "2", "--lr", "1e-2", "--lm-head-init", "target", "--freeze-lm-head",
               "--ttt-loss-rows", "chain", "--export-dtype", "float32"] + FP32)
    import rundir
    ck = rundir.list_checkpoints(out)[-1]
    sd = load_file(os.path.join(ck, "model.safetensors"))
    target, _ = load_target(tdir)
    ids = sd["d2t"] + torch.arange(VD)
    assert torch.equal(sd["lm_head.weight"], target.lm_head.weight[ids].float())   # never moved
    fresh = str(tmp_path / "fresh")
    run_train(["--data", data, "--out", fresh, "--offline", "--batch-size", "2", "--max-steps", "2",
               "--ttt-length", "2", "--lr", "1e-2", "--lm-head-init", "target",
               "--export-dtype", "float32"] + FP32)
    sd2 = load_file(os.path.join(rundir.list_checkpoints(fresh)[-1], "model.safetensors"))
    assert not torch.equal(sd2["lm_head.weight"], sd["lm_head.weight"])           # trained


def test_keep_best_is_the_best_held_out_eval(tmp_path, dirs):
    from common import load_target
    from model import load_draft_for
    tdir, data = dirs
    out = str(tmp_path / "run")
    run_train(["--data", data, "--out", out, "--offline", "--batch-size", "2", "--max-steps", "6",
               "--ttt-length", "2", "--lr", "3e-2", "--eval-every", "1", "--eval-fraction", "0.25",
               "--keep-best", "--save-every", "1", "--keep", "10", "--export-dtype", "float32"] + FP32)
    evals = [json.loads(x) for x in open(os.path.join(out, "log.jsonl"))]
    evals = [r for r in evals if r["split"] == "eval"]
    assert len(evals) == 6
    best = json.load(open(os.path.join(out, "best", "best.json")))
    top = max(r["replay_accept_3"] for r in evals)
    first = next(r for r in evals if r["replay_accept_3"] == top)   # the earliest of equals
    assert best["step"] == first["step"] and best["eval"]["replay_accept_3"] == top
    target, _ = load_target(tdir)
    load_draft_for(os.path.join(out, "best"), target)
    # the same weights as that step's checkpoint
    a = load_file(os.path.join(out, "best", "model.safetensors"))
    b = load_file(os.path.join(out, "checkpoints", f"step-{best['step']:06d}", "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_layer_init_from_target(tmp_path, dirs):
    """--layer-init-from -1 (after one step at lr 1e-9): the draft's layer is the target's last
    layer where both read the same input (MLP gate/up, norms, q/k/v's feature half) and its
    o_proj / down_proj are the target's times 1/r, r the RMS of the stream entering that layer on
    the data (the trainer prints it); so on a feature g that attends only to itself the draft's
    layer computes target_layer(r g) / r. The token half of q/k/v keeps its random start; a layer
    index out of range is a one-line error."""
    import re
    from common import load_target
    from model import load_draft_for
    tdir, data = dirs
    flags = ["--data", data, "--offline", "--batch-size", "2", "--max-steps", "1", "--ttt-length",
             "2", "--lr", "1e-9", "--export-dtype", "float32"] + FP32
    out = str(tmp_path / "run")
    p = run_train(flags + ["--out", out, "--layer-init-from", "-1"])
    r = float(re.search(r"its input RMS ([0-9.e+-]+)", p.stderr).group(1))
    import rundir
    ck = rundir.list_checkpoints(out)[-1]
    sd = load_file(os.path.join(ck, "model.safetensors"))
    target, _ = load_target(tdir)
    src = target.model.layers[-1]
    H = target.config.hidden_size
    # r is the median per-row RMS of that layer's input on the data (row 0 skipped), not 1
    seqs = [json.loads(x) for x in open(os.path.join(data, "sequences.jsonl"))][:8]
    with torch.no_grad():
        rows = torch.cat([target(torch.tensor(q["input_ids"][:256])[None], output_hidden_states=True)
                          .hidden_states[-2][0, 1:].pow(2).mean(-1).sqrt() for q in seqs])
    assert abs(r - float(rows.median())) < 0.01 * r and abs(r - 1) > 0.1
    same = {"midlayer.mlp.gate_proj.weight": src.mlp.gate_proj.weight,
            "midlayer.mlp.up_proj.weight": src.mlp.up_proj.weight,
            "midlayer.hidden_norm.weight": src.input_layernorm.weight,
            "midlayer.post_attention_layernorm.weight": src.post_attention_layernorm.weight,
            "midlayer.self_attn.o_proj.weight": src.self_attn.o_proj.weight / r,
            "midlayer.mlp.down_proj.weight": src.mlp.down_proj.weight / r}
    for n in ("q_proj", "k_proj", "v_proj"):
        w = sd[f"midlayer.self_attn.{n}.weight"]
        assert w.shape[1] == 2 * H
        same[n] = getattr(src.self_attn, n).weight
        sd[n] = w[:, H:]
        assert not torch.allclose(w[:, :H], same[n].float(), atol=1e-3)   # the token half
    for k, ref in same.items():
        assert torch.allclose(sd[k], ref.float(), atol=1e-5, rtol=1e-3), k
    # the function: one row attends only to itself, so attention is v -> o; with the token half
    # of q/k/v zeroed the draft's layer on g is the target's on r g, over r
    draft = load_draft_for(ck, target, torch.float32)
    lay = draft.midlayer
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj"):
            getattr(lay.self_attn, n).weight[:, :H] = 0
        g = torch.randn(1, 1, H, generator=torch.Generator().manual_seed(0))
        e = torch.randn(1, 1, H)
        cos, sin = draft.rotary(torch.zeros(1, 1, dtype=torch.long), torch.float32)
        ours = lay(e, g, cos, sin)
        x = (r * g).float()
        for norm in (src.input_layernorm, src.post_attention_layernorm):   # eps scales with r^2
            norm.variance_epsilon *= r * r
        cfg = target.config
        v = src.self_attn.v_proj(src.input_layernorm(x)).view(cfg.num_key_value_heads, -1)
        a = src.self_attn.o_proj(v.repeat_interleave(cfg.num_attention_heads
                                                     // cfg.num_key_value_heads, 0).reshape(1, 1, -1))
        h1 = x + a
        theirs = (h1 + src.mlp(src.post_attention_layernorm(h1))) / r
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-3), (ours - theirs).abs().max()
    # without the flag the layer is random: the checks above would fail
    plain = str(tmp_path / "plain")
    run_train(flags + ["--out", plain])
    sd0 = load_file(os.path.join(rundir.list_checkpoints(plain)[-1], "model.safetensors"))
    assert not torch.allclose(sd0["midlayer.mlp.gate_proj.weight"], src.mlp.gate_proj.weight,
                              atol=1e-3)
    p = run_train(flags + ["--out", str(tmp_path / "bad"), "--layer-init-from", "99"], check=False)
    assert p.returncode != 0 and "--layer-init-from 99" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("extra,msg", [
    (["--freeze-lm-head"], "would freeze a random lm_head"),
    (["--keep-best", "--eval-fraction", "0"], "needs --eval-fraction > 0"),
    (["--lm-head-init", "target", "--init", "x"], "--init brings its own"),
    (["--layer-init-from", "-1", "--init", "x"], "starts a new draft's layer"),
])
def test_lever_flag_errors(extra, msg):
    import train
    from common import UserError
    args = train.parse_args(["--data", "d", "--out", "o"] + extra)
    with pytest.raises(UserError, match=msg):
        train.check_args(args)


def test_continued_run_evaluates_its_start(tmp_path, dirs):
    """A run with --init logs the starting draft's held-out eval as step 0 (the same numbers the
    run that made it logged last, on the same split), and --keep-best can answer "the start"."""
    _, data = dirs
    first = str(tmp_path / "first")
    flags = ["--data", data, "--offline", "--batch-size", "2", "--ttt-length", "2",
             "--eval-fraction", "0.25", "--export-dtype", "float32"] + FP32
    run_train(flags + ["--out", first, "--max-steps", "30", "--lr", "3e-2"])
    import rundir
    last = [json.loads(x) for x in open(os.path.join(first, "log.jsonl"))][-1]
    assert last["split"] == "eval" and last["step"] == 30
    # a learning rate that wrecks the draft: the best held-out eval is the one before training
    again = str(tmp_path / "again")
    run_train(flags + ["--out", again, "--max-steps", "2", "--lr", "30", "--eval-every", "1",
                       "--keep-best", "--init", rundir.list_checkpoints(first)[-1]])
    evals = [json.loads(x) for x in open(os.path.join(again, "log.jsonl"))]
    evals = [r for r in evals if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and evals[0]["tokens"] == 0
    assert abs(evals[0]["replay_accept_3"] - last["replay_accept_3"]) < 1e-6
    assert max(abs(a - b) for a, b in zip(evals[0]["acc_j"], last["acc_j"])) < 1e-6
    assert evals[0]["replay_accept_3"] > max(r["replay_accept_3"] for r in evals[1:])
    best = json.load(open(os.path.join(again, "best", "best.json")))
    assert best["step"] == 0


def test_levers_compares_at_equal_training_seconds(tmp_path):
    """results/levers.py's equal-compute arithmetic: training seconds are the sum over the log's
    train windows of tokens / tokens_per_s; an arm's replayed accept length at the base arm's
    seconds is interpolated between its evals, or its last eval when it finished sooner."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "results"))
    import levers
    recs = [{"step": 0, "split": "eval", "tokens": 0, "replay_accept_3": 2.0, "acc_j": [0.5]},
            {"step": 10, "split": "train", "tokens": 1000, "tokens_per_s": 100.0},
            {"step": 10, "split": "eval", "tokens": 1000, "replay_accept_3": 1.5, "acc_j": [0.4]},
            {"step": 20, "split": "train", "tokens": 3000, "tokens_per_s": 50.0},
            {"step": 20, "split": "eval", "tokens": 3000, "replay_accept_3": 2.5, "acc_j": [0.6]}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    evals, median_tps = levers.read_run(str(tmp_path))
    assert [(e["step"], e["seconds"]) for e in evals] == [(0, 0.0), (10, 10.0), (20, 50.0)]
    assert median_tps == 100.0                            # the upper median of two windows
    assert levers.at_seconds(evals, 5.0) == pytest.approx(1.75)
    assert levers.at_seconds(evals, 30.0) == pytest.approx(2.0)
    assert levers.at_seconds(evals, 80.0) == 2.5          # finished sooner: its last eval


def test_levers_five_aux_arm_needs_five_layer_data(tmp_path):
    """The 5-aux arm's layers come from its data: run on data captured at three layers it is a
    one-line error naming the arm and the data's layers, before any train.py starts."""
    import argparse
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "results"))
    import levers
    from common import UserError
    (tmp_path / "manifest.json").write_text(json.dumps({"aux_layer_ids": [1, 14, 26]}))
    a = argparse.Namespace(data=str(tmp_path), runs=str(tmp_path / "runs"), protocol="scratch",
                           arms=["scratch/base", "scratch/5-aux"], parallel=1)
    with pytest.raises(UserError, match=r"scratch/5-aux: needs --data captured at 5 layers .*\[1, 14, 26\]"):
        levers.run(a)
    assert not os.path.exists(tmp_path / "runs")


def test_levers_seed_and_dtype_reach_every_arm(tmp_path):
    """levers.py run --seed / --dtype: every arm's train.py gets them (a replicate's arms share
    that seed's held-out split and batch order), and the default is the tables' seed 0."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "results"))
    import levers

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]
    for arm in ("base", "muon-3e-3", "eagle31"):
        cmd = levers.arm_command("scratch", arm, "DATA", str(tmp_path / arm), 2, "float32")
        assert flag(cmd, "--seed") == "2" and flag(cmd, "--dtype") == "float32"
    cmd = levers.arm_command("scratch", "muon-3e-3", "DATA", str(tmp_path / "m"))
    assert flag(cmd, "--seed") == "0" and flag(cmd, "--dtype") == "auto"
    last_lr = len(cmd) - 1 - cmd[::-1].index("--lr")     # argparse: the last one wins
    assert cmd[last_lr + 1] == "3e-3" and cmd.count("--lr") == 2   # the arm's over the protocol's
    # long: 3x scratch's tokens, so an arm's own steps (and eval spacing) scale with it
    cmd = levers.arm_command("long", "muon-3e-3-batch-1", "DATA", str(tmp_path / "l"))
    last = lambda name: cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]
    assert last("--max-steps") == "2400" and last("--eval-every") == "60" and last("--batch-size") == "1"
    cmd = levers.arm_command("long", "base", "DATA", str(tmp_path / "b"))
    assert last("--max-steps") == "300" and cmd.count("--max-steps") == 1
    # scale: long's steps on larger data; evals every 240 sequences whatever the arm's batch
    for arm, steps, every in (("base", "300", "30"), ("best-head-init", "1200", "120"),
                              ("bhi-2-layers", "741", "120")):   # 2 layers: 1/1.62 the steps
        os.makedirs(tmp_path / arm, exist_ok=True)
        cmd = levers.arm_command("scale", arm, "DATA", str(tmp_path / arm))
        assert last("--max-steps") == steps and last("--eval-every") == every
        assert last("--eval-fraction") == "0.05"
    # an arm's layout reaches train.py as the --draft-config it writes
    assert json.load(open(last("--draft-config"))) == {"num_hidden_layers": 2}


def test_levers_replicates_pairs_each_arm_with_its_own_seeds_base(tmp_path, capsys):
    """levers.py replicates: an arm's difference is taken from the base of the same --runs (its
    seed), never across seeds; an arm without that seed's base gets no difference; a run that has
    not reached its last step is not counted."""
    import argparse
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "results"))
    import levers

    def arm(runs, name, last, total=10, more=None):
        d = tmp_path / runs / name
        d.mkdir(parents=True)
        recs = [{"step": 10, "split": "train", "tokens": 100, "tokens_per_s": 10.0},
                {"step": 10, "split": "eval", "tokens": 100, "replay_accept_3": last, "acc_j": [0.1]}]
        if more:     # (tokens, replayed) of a later eval: an arm that saw more tokens than its base
            recs += [{"step": 20, "split": "train", "tokens": more[0], "tokens_per_s": 10.0},
                     {"step": 20, "split": "eval", "tokens": more[0], "replay_accept_3": more[1],
                      "acc_j": [0.1]}]
        (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (d / "args.json").write_text(json.dumps({"total_steps": total}))
    arm("s0", "scratch-base", 1.30)
    arm("s0", "scratch-batch-4", 1.90, total=20)   # still going: not a result yet
    arm("s0", "scratch-muon-3e-3", 1.20, total=20, more=(300, 1.44))   # at 100 tokens: 1.20
    arm("s1", "scratch-base", 1.40)
    arm("s1", "scratch-muon-3e-3", 1.38)
    arm("s2", "scratch-muon-3e-3", 1.50)           # no base for this seed
    runs = [str(tmp_path / s) for s in ("s0", "s1", "s2")]
    out = tmp_path / "rep.json"
    levers.replicates(argparse.Namespace(runs=runs, out=str(out)))
    r = json.loads(out.read_text())
    assert (tmp_path / "rep.png").stat().st_size > 0          # every seed's curve, one plot
    # compared at the base's 100 tokens (interpolated for s0's 300-token arm), not at its end
    assert r["scratch-muon-3e-3"]["minus_base"] == pytest.approx([-0.10, -0.02])
    assert r["scratch-muon-3e-3"]["mean_minus_base"] == pytest.approx(-0.06)
    assert r["scratch-muon-3e-3"]["last_replay"][runs[0]] == pytest.approx(1.44)
    assert r["scratch-base"]["mean_minus_base"] == pytest.approx(0.0)
    assert "scratch-batch-4" not in r
    assert "| scratch-muon-3e-3 | 1.440 / 1.380 / 1.500 | -0.100 / -0.020 | -0.060 |" in capsys.readouterr().out
    from common import UserError
    with pytest.raises(UserError, match=r"--runs .*nope: no such directory"):
        levers.replicates(argparse.Namespace(runs=[runs[0], str(tmp_path / "nope")], out=str(out)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no finished arm"):
        levers.replicates(argparse.Namespace(runs=[str(tmp_path / "empty")], out=str(tmp_path / "e.json")))
    assert not (tmp_path / "e.json").exists()


def test_every_arm_is_a_valid_train_command(tmp_path):
    """Each arm's command parses and passes train.py's own checks (a misspelt flag or
    value in ARMS would otherwise surface only as a failed run an hour in), and carries its
    arm's flags."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "results"))
    import levers
    import train
    for arm, (_, flags) in levers.ARMS.items():
        protocol = "continued" if arm == "frozen-head" else "scratch"   # it freezes a trained head
        cmd = levers.arm_command(protocol, arm, "DATA", str(tmp_path / arm))
        args = train.parse_args(cmd[2:])
        train.check_args(args)
        plain = [f for f in flags if isinstance(f, str)]
        for name, value in zip(plain, plain[1:]):
            if name.startswith("--") and not value.startswith("--"):
                dest = name[2:].replace("-", "_")
                assert str(getattr(args, dest)) == value or float(getattr(args, dest)) == float(value), (arm, name)
    a = train.parse_args(levers.arm_command("scratch", "all-positions", "DATA", str(tmp_path / "x"))[2:])
    assert a.loss_positions == "all" and a.ttt_decay == 0.8
    a = train.parse_args(levers.arm_command("scratch", "decay-0.5", "DATA", str(tmp_path / "y"))[2:])
    assert a.loss_positions == "assistant" and a.ttt_decay == 0.5
