"""train.py: TTT math against a step-by-step reference, and the promises of the training loop
(exact resume after a kill, 1 vs 2 processes, online vs offline, clear errors). Everything runs
on tiny random Llama targets in fp32; data sets are written in generate.py's on-disk format."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, make_tiny_target
from runscript import run_script

import hidden
import rundir
import train_data
import ttt
from model import Eagle3Draft
from draft_config import config_from_target

V, VD, LAYERS = 64, 48, 8
FP32 = ["--dtype", "float32", "--target-dtype", "float32", "--hidden-dtype", "float32",
        "--no-progress", "--threads", "1"]


# ----------------------------------------------------------------------------------------------
# Fixtures: a tiny target saved with a tokenizer, and data sets in generate.py's format

def save_tiny_target(path, max_positions=512):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast
    model = make_tiny_target(vocab_size=V, layers=LAYERS, max_positions=max_positions)
    model.save_pretrained(path)
    t = Tokenizer(WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    t.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="t0").save_pretrained(path)
    return str(path)


def tokenizer_hash(target_dir):
    from transformers import AutoTokenizer
    from dataset import tokenizer_hash
    return tokenizer_hash(AutoTokenizer.from_pretrained(target_dir))


def build_data(d, target_dir, n=12, seed=0, hidden=True, lengths=(12, 40), per_shard=5):
    """Random sequences with a prompt part (loss mask 0) and a response part (1), the most
    frequent response tokens as draft vocab, and target hidden states in shards."""
    from safetensors.torch import save_file
    from common import load_target
    os.makedirs(os.path.join(d, "hidden"), exist_ok=True)
    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        T = rng.randint(*lengths)
        p = rng.randint(2, T // 2)
        seqs.append({"input_ids": [rng.randrange(V) for _ in range(T)],
                     "loss_mask": [0] * p + [1] * (T - p)})
    counts = torch.zeros(V, dtype=torch.long)
    for s in seqs:
        for x, m in zip(s["input_ids"], s["loss_mask"]):
            counts[x] += m
    draft_ids = counts.topk(VD).indices.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    save_file({"draft_ids": draft_ids, "d2t": draft_ids - torch.arange(VD), "t2d": t2d,
               "counts": counts}, os.path.join(d, "vocab.safetensors"))
    with open(os.path.join(d, "sequences.jsonl"), "w") as f:
        for s in seqs:
            f.write(json.dumps(s) + "\n")
    layers = [1, LAYERS // 2 - 1, LAYERS - 4]
    shards = []
    if hidden:
        from hidden import target_hidden_states
        target, _ = load_target(target_dir)
        hs = target_hidden_states(target, [s["input_ids"] for s in seqs], layers)
        for start in range(0, n, per_shard):
            end = min(n, start + per_shard)
            name = f"hidden/shard-{len(shards):05d}.safetensors"
            t = {}
            for k in range(start, end):
                t[f"aux.{k}"] = hs[k][0].float().contiguous()
                t[f"final.{k}"] = hs[k][1].float().contiguous()
            save_file(t, os.path.join(d, name))
            shards.append({"file": name, "start": start, "end": end})
    manifest = {"format_version": 1, "complete": True, "target": target_dir,
                "tokenizer_hash": tokenizer_hash(target_dir),
                "vocab_size": V, "max_length": lengths[1], "num_sequences": n,
                "num_tokens": sum(len(s["input_ids"]) for s in seqs),
                "num_loss_tokens": int(counts.sum()), "draft_vocab_size": VD,
                "coverage": float(counts[draft_ids].sum() / counts.sum()), "aux_layer_ids": layers,
                "hidden": {"dtype": "float32", "shards": shards} if hidden else None}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return str(d)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is fastest, and on a busy machine a second OpenMP thread waiting
    at every barrier for a descheduled partner makes tiny ops up to 100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target_dir):
    return build_data(tmp_path_factory.mktemp("data"), target_dir)


def run_train(args, check=True, env=None, **kw):
    p = run_script([os.path.join(ROOT, "train.py")] + args, cwd=ROOT, env=env, timeout=300, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def final_state(run_dir):
    ck = rundir.list_checkpoints(run_dir)[-1]
    return torch.load(os.path.join(ck, "trainer_state.pt"), weights_only=False)


def read_log(run_dir, split="train"):
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


# ----------------------------------------------------------------------------------------------
# TTT math

def tiny_draft(seed=0):
    target = make_tiny_target(vocab_size=V, layers=LAYERS)
    cfg = config_from_target(target.config, VD)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    with torch.no_grad():   # larger weights than the 0.02 init, so attention is far from uniform
        for n, p in draft.named_parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    return draft.eval()


def ttt_inputs(draft, B, T, J, seed, keep=None):
    """Random TTTLoss inputs: token ids, aux features, soft target rows, and the valid mask
    (each row kept with probability `keep`, all kept if None; never a target past the end, as
    train.valid_rows) with its per-step row counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * draft.config.target_hidden_size, generator=g)
    targ_p = torch.softmax(torch.randn(B * T, VD, generator=g) * 3, -1)
    valid = (torch.rand(J, B, T, generator=g) < keep) if keep is not None \
        else torch.ones(J, B, T, dtype=torch.bool)
    for j in range(J):
        valid[j, :, T - j - 2:] = False
    return ids, aux, targ_p, valid, valid.sum((1, 2)).float(), g


def test_ttt_matches_step_by_step_decoding():
    """Row t at TTT step j must equal what the draft computes at decode time: a prefill over rows
    0..t (features fc(aux), tokens x_1..x_{t+1}, positions 0..t) into its KV cache, then j single
    steps for that row alone with feature = the previous h2, token x_{t+j+1}, position t+j."""
    draft = tiny_draft()
    B, T, J = 2, 11, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * draft.config.target_hidden_size, generator=g)
    with torch.no_grad():
        h2s = list(ttt.ttt_unroll(draft, ids, aux, J))
        logits = [draft.lm_head(draft.norm(h)) for h in h2s]
        worst = 0.0
        for b in range(B):
            for t in range(T - 1):
                cache = draft.new_cache(1)
                lg, h = draft(ids[b:b + 1, 1:t + 2], draft.fuse(aux[b:b + 1, :t + 1]),
                              torch.arange(t + 1)[None], cache)
                lg, h = lg[0, -1], h[0, -1]
                for j in range(J):
                    if t + j + 1 >= T:   # no ground-truth token left for this step
                        break
                    if j > 0:
                        lg, h = draft(ids[b:b + 1, t + j + 1:t + j + 2], h[None, None],
                                      torch.tensor([[t + j]]), cache)
                        lg, h = lg[0, -1], h[0, -1]
                    worst = max(worst, (h2s[j][b, t] - h).abs().max().item(),
                                (logits[j][b, t] - lg).abs().max().item())
    assert worst < 1e-4, worst


def test_accept_loss_adds_minus_log_acceptance():
    """--accept-loss W: each step's objective is the soft CE plus W * -log sum_x min(p, q), over the
    same valid rows with the same 0.8**j weights; W = 0 is the plain CE."""
    draft = tiny_draft()
    B, T, J = 2, 9, 3
    ids, aux, targ_p, valid, denom, _ = ttt_inputs(draft, B, T, J, seed=2, keep=0.7)
    args = (ids, aux, targ_p, targ_p.argmax(-1), valid, denom, 1.0)
    with torch.no_grad():
        ce, st, _ = ttt.TTTLoss(draft, J)(*args)
        mixed, st2, _ = ttt.TTTLoss(draft, J, accept_weight=0.5)(*args)
        extra = 0.0
        for j, h2 in enumerate(ttt.ttt_unroll(draft, ids, aux, J)):
            rows = valid[j].reshape(-1).nonzero().squeeze(1)
            q = torch.softmax(draft.lm_head(draft.norm(h2.reshape(B * T, -1)[rows])), -1)
            a = torch.minimum(targ_p[rows + j + 1], q).sum(-1)
            extra += 0.8 ** j * -torch.log(a).sum() / denom[j]
    assert torch.equal(st, st2)                      # statistics are the CE's, unchanged
    assert extra > 0.1
    assert abs((mixed - ce - 0.5 * extra).item()) < 1e-5


def test_ttt_attention_is_not_trivially_causal():
    """Guard for the test above: the own-row keys of later steps must change the result (if the
    diagonal terms were dropped, step j >= 1 would differ from the reference)."""
    torch.manual_seed(0)
    q, k0, v0 = (torch.randn(1, 2, 5, 8) for _ in range(3))
    k1, v1 = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with_diag = ttt.ttt_attention(q, k0, v0, [k1], [v1])
    without = ttt.ttt_attention(q, k0, v0, [], [])
    assert (with_diag - without).abs().max() > 1e-2
    # and the explicit softmax equals SDPA over the same key set for one row
    t = 3
    keys = torch.cat([k0[:, :, :t + 1], k1[:, :, t:t + 1]], 2)
    vals = torch.cat([v0[:, :, :t + 1], v1[:, :, t:t + 1]], 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, t:t + 1], keys, vals)
    assert torch.allclose(with_diag[:, :, t:t + 1], ref, atol=1e-5)


def test_target_side_and_masks():
    torch.manual_seed(0)
    W = torch.randn(10, 4)
    final = torch.randn(1, 6, 4)
    draft_ids = torch.tensor([1, 3, 4, 8])
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[draft_ids] = True
    p, am, inv = ttt.target_side(final, W[draft_ids], lm_w=W, t2d=t2d, chunk=4)
    full = final @ W.T
    assert torch.allclose(p.sum(-1), torch.ones(6))
    assert torch.allclose(p, torch.softmax(full[0][:, draft_ids], -1), atol=1e-6)
    assert torch.equal(am, p.argmax(-1))
    assert torch.equal(inv, t2d[full.argmax(-1)])
    # valid[j][t] = loss mask at t+j+2 and in-vocab argmax at t+j+1
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    inv = torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    v = ttt.valid_rows(mask, inv, 3)
    assert v[0].int().tolist() == [[1, 1, 0, 1, 0, 0]]   # t=2: argmax at 3 out of vocab
    assert v[1].int().tolist() == [[1, 0, 1, 0, 0, 0]]
    assert v[2].int().tolist() == [[0, 1, 0, 0, 0, 0]]


def test_metrics_accept_length():
    stats = torch.tensor([[1.0, 2.0, 3.0], [8.0, 4.0, 2.0], [10.0, 8.0, 4.0]])
    m = ttt.metrics(stats, torch.tensor([22.0, 10.0]))
    assert m["acc_j"] == [0.8, 0.5, 0.5]
    assert abs(m["accept_len_3"] - (1 + 0.8 + 0.4 + 0.2)) < 1e-9
    assert abs(m["replay_accept_3"] - 2.2) < 1e-9


def test_replay_decoding_follows_rounds():
    """Prompt x0..x2, assistant x3..x10. Rounds start at row 2 (root x3, the target's prefill
    token); a round at row t accepting a drafts moves to row t + a + 1; row 9 would guess x11,
    past the end, so row 8 (guessing x10) is the last round."""
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    correct = torch.zeros(3, 11, dtype=torch.bool)
    correct[:, 2] = True                       # row 2: 3 accepted -> 4 tokens, next row 6
    correct[0, 6] = True                       # row 6: 1 accepted (step 1 wrong) -> next row 8
    correct[2, 8] = True                       # row 8: step 0 wrong -> 0 accepted, then row 9: end
    tokens, rounds = ttt.replay_decoding(correct, mask).tolist()
    assert (tokens, rounds) == (4 + 2 + 1, 3)


def test_batches_cover_each_epoch_once():
    ids = list(range(100, 110))
    seen = [k for s in range(5) for k in train_data.batch_indices(ids, s, 2, seed=3)[0]]
    assert sorted(seen) == ids
    assert train_data.batch_indices(ids, 5, 2, 3)[1] == {"epoch": 1, "batch_in_epoch": 0}


def test_length_grouped_batches():
    # 200 sequences of random lengths: every epoch still covers each (full batch) sequence once,
    # batches hold similar lengths (much less padding than random batches), and epochs differ.
    g = torch.Generator().manual_seed(0)
    ids = list(range(1000, 1200))
    lengths = {k: int(x) for k, x in zip(ids, torch.randint(20, 300, (200,), generator=g))}

    def padding(lens):
        return sum(8 * max(lengths[k] for k in b) - sum(lengths[k] for k in b)
                   for b in (train_data.batch_indices(ids, s, 8, 1, lens)[0] for s in range(25)))
    for epoch in range(2):
        seen = [k for s in range(25 * epoch, 25 * epoch + 25)
                for k in train_data.batch_indices(ids, s, 8, 1, lengths)[0]]
        assert sorted(seen) == ids
    assert padding(lengths) < 0.2 * padding(None)
    assert (train_data.batch_indices(ids, 0, 8, 1, lengths)[0]
            != train_data.batch_indices(ids, 25, 8, 1, lengths)[0])


def test_target_side_only_needed_rows():
    torch.manual_seed(1)
    W, final = torch.randn(10, 4), torch.randn(2, 6, 4)
    draft_ids = torch.tensor([1, 3, 4, 8])
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[draft_ids] = True
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    need = ttt.shift_left(mask, 1, False)
    p, am, inv = ttt.target_side(final, W[draft_ids], lm_w=W, t2d=t2d, chunk=3)
    p2, am2, inv2 = ttt.target_side(final, W[draft_ids], need=need, lm_w=W, t2d=t2d, chunk=3)
    rows = need.reshape(-1)
    assert torch.allclose(p2[rows], p[rows], atol=1e-6) and torch.equal(am2[rows], am[rows])
    assert not p2[~rows].any()
    # every row the loss reads is the same
    assert torch.equal(ttt.valid_rows(mask, inv2, 3), ttt.valid_rows(mask, inv, 3))
    # a later epoch passes the remembered in_vocab bit and skips the full lm_head: same outputs
    # (the full product is not even available to it)
    p3, am3, inv3 = ttt.target_side(final, W[draft_ids], need=need, in_vocab=inv, chunk=3)
    assert torch.equal(p3, p2) and torch.equal(am3, am2) and torch.equal(inv3, inv2)


# ----------------------------------------------------------------------------------------------
# The loop

def test_log_window_sums_only_its_own_steps(tmp_path):
    """Each training log line is the metrics of the steps since the previous line: the window
    sums their statistics, then starts again (not a running total since step 0)."""
    from types import SimpleNamespace
    import train
    J = 3
    r = SimpleNamespace(args=SimpleNamespace(ttt_length=J), source=SimpleNamespace(wait=0.0),
                        scheds=[SimpleNamespace(get_last_lr=lambda: [1e-3])], rank=0, bar=None,
                        log_path=str(tmp_path / "log.jsonl"), tokens_seen=0)
    gen = torch.Generator().manual_seed(0)

    def step_stats():   # [ce, correct, rows] per TTT step, then the replay's (accepted, rounds)
        n = torch.randint(20, 40, (J,), generator=gen).float()
        correct = (n * torch.rand(J, generator=gen)).floor()
        ce = n * (1 + torch.rand(J, generator=gen))
        return torch.cat([torch.stack([ce, correct, n]).flatten(), torch.randint(10, 40, (2,), generator=gen).float()])

    steps = [step_stats() for _ in range(5)]
    w = train.LogWindow(r)
    for lo, hi in [(0, 2), (2, 5)]:                # two windows: steps 0-1, then 2-4
        for st in steps[lo:hi]:
            w.add(st, 100)
        w.flush(hi, torch.tensor(1.0))
    lines = read_log(str(tmp_path))
    for line, (lo, hi) in zip(lines, [(0, 2), (2, 5)]):
        tot = sum(steps[lo:hi])
        want = ttt.metrics(tot[:3 * J].view(3, J), tot[3 * J:])
        assert line["acc_j"] == pytest.approx(want["acc_j"]) and line["loss"] == pytest.approx(want["loss"])
        assert line["replay_accept_3"] == pytest.approx(want["replay_accept_3"])
    assert len(lines) == 2


def test_offline_run_exports_loadable_draft_and_learns(tmp_path, data_dir, target_dir):
    out = str(tmp_path / "run")
    p = run_train(["--data", data_dir, "--out", out, "--offline", "--batch-size", "2",
                   "--max-steps", "12", "--lr", "3e-3", "--ttt-length", "3", "--save-every", "5",
                   "--eval-every", "6", "--log-every", "2", "--keep", "2"] + FP32)
    ck = rundir.list_checkpoints(out)
    assert [os.path.basename(c) for c in ck] == ["step-000010", "step-000012"]   # keep 2
    train_log, eval_log = read_log(out), read_log(out, "eval")
    assert len(train_log) == 6 and len(eval_log) == 2
    r = train_log[-1]
    for k in ("loss", "loss_j", "acc_j", "accept_len_3", "accept_len_full", "lr",
              "tokens_per_s", "data_wait"):
        assert k in r
    a = r["acc_j"]
    assert len(a) == 3 and abs(r["accept_len_3"] - (1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])) < 1e-9
    assert train_log[-1]["loss"] < train_log[0]["loss"]
    assert os.path.getsize(os.path.join(out, "curves.png")) > 1000
    from common import load_target
    from model import load_draft_for
    target, _ = load_target(target_dir)
    draft = load_draft_for(ck[-1], target)           # strict: every SGLang name present
    st = final_state(out)
    # every exported tensor is the trainer's, rounded to the export dtype (bf16 by default)
    from safetensors.torch import load_file
    exported = load_file(os.path.join(ck[-1], "model.safetensors"))
    assert set(exported) == set(st["model"]), set(exported) ^ set(st["model"])
    for k, v in exported.items():
        assert torch.equal(v, st["model"][k].to(v.dtype)), k
    assert exported["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(draft.draft_ids, st["draft_ids"])


def interrupted_equals_uninterrupted(tmp_path, data_dir, how, online=False, extra=()):
    """Interrupt a run after its first checkpoint, resume it, compare with an uninterrupted run.
    Training is deterministic, so a "resume" that restored nothing and retrained from step 0
    would end identical too: the resumed process must also say it starts at the checkpoint's
    step N > 0 and leave the log records of steps <= N exactly as the first process wrote them
    (timings included), adding only the remaining steps."""
    common = ["--data", data_dir, "--batch-size", "2", "--max-steps", "40",
              "--lr", "1e-3", "--ttt-length", "3", "--save-every", "3", "--eval-every", "1000",
              "--log-every", "1"] + FP32 + ([] if online else ["--offline"]) + list(extra)
    ref = str(tmp_path / "ref")
    run_train(common + ["--out", ref])
    out = str(tmp_path / how)
    proc = subprocess.Popen([sys.executable, "train.py", "--out", out] + common, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "checkpoints", "step-000003")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (-9 if how == "kill" else 130), err
    stopped = int(os.path.basename(rundir.list_checkpoints(out)[-1])[5:])
    assert stopped < 40, "the run finished before it could be interrupted"
    if how == "interrupt":
        assert "interrupted: saved" in err
    assert stopped > 0
    before = [r for r in read_log(out) if r["step"] <= stopped]
    p = run_train(common + ["--out", out, "--resume"])
    ck = os.path.join(out, "checkpoints", f"step-{stopped:06d}")
    assert f"resumed from {ck} at step {stopped}" in p.stderr, p.stderr[-2000:]
    a, b = final_state(ref), final_state(out)
    assert a["step"] == b["step"] == 40
    for k in a["model"]:
        if online:   # the producer's batched forwards: equal to fp32 rounding, as online vs offline
            assert torch.allclose(a["model"][k], b["model"][k], atol=1e-5, rtol=1e-4), k
        else:
            assert torch.equal(a["model"][k], b["model"][k]), k
    la, lb = read_log(ref), read_log(out)
    assert [r["step"] for r in la] == [r["step"] for r in lb] == list(range(1, 41))
    assert lb[:len(before)] == before                  # the first process's records, untouched
    for ra, rb in zip(la, lb):
        assert ra["rows"] == rb["rows"] and abs(ra["loss"] - rb["loss"]) < 1e-4 * max(1, ra["loss"])


def test_kill_and_resume_gives_identical_weights(tmp_path, data_dir):
    interrupted_equals_uninterrupted(tmp_path, data_dir, "kill")


def test_ctrl_c_saves_and_resume_gives_identical_weights(tmp_path, data_dir):
    """With the levers that keep state across steps: Muon's momentum and its own schedule (a
    second optimizer in the checkpoint), and feature noise drawn per step."""
    interrupted_equals_uninterrupted(tmp_path, data_dir, "interrupt", extra=[
        "--optimizer", "muon", "--feature-noise", "0.1", "--distill-topk", "2"])


def test_online_kill_and_resume(tmp_path, data_dir):
    """Online (the producer computes the hidden states): a resumed run's producer must start at
    the checkpoint's step too."""
    interrupted_equals_uninterrupted(tmp_path, data_dir, "kill", online=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path, data_dir):
    common = ["--data", data_dir, "--offline", "--batch-size", "4", "--max-steps", "4",
              "--lr", "1e-3", "--ttt-length", "3", "--eval-every", "2", "--log-every", "1",
              "--fc-init", "rms"] + FP32     # rms: fc is redrawn after sharding, same on 1 and 2
    one = str(tmp_path / "one")
    assert "fc initialised for feature RMS" in run_train(common + ["--out", one]).stderr
    two = str(tmp_path / "two")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "train.py", "--out", two] + common
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = final_state(one), final_state(two)
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], atol=1e-5, rtol=1e-4), k
    la, lb = read_log(one) + read_log(one, "eval"), read_log(two) + read_log(two, "eval")
    assert [(r["split"], r["step"]) for r in la] == [(r["split"], r["step"]) for r in lb] and la
    for ra, rb in zip(la, lb):
        assert abs(ra["loss"] - rb["loss"]) < 1e-4 * max(1, ra["loss"])
        assert ra["acc_j"] == rb["acc_j"] and ra["rows"] == rb["rows"]


def test_two_processes_match_one_with_muon(tmp_path, data_dir):
    """Muon under FSDP2: each rank holds half of every matrix's rows (a DTensor), and Newton-
    Schulz must orthogonalise the whole matrix, not each half. DTensor's matmuls gather what
    X @ X^T needs, so two processes must take one process's steps. Both runs use the fp32
    iteration (optim.newton_schulz_fp32, forced by a sitecustomize on PYTHONPATH): torch's bf16
    one rounds differently under another reduction order (measured: 1-8% of the 4 steps'
    movement apart in bf16, ~1e-6 in fp32), which would hide a real difference."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        f"import sys; sys.path.insert(0, {ROOT!r})\n"
        "import torch.optim._muon, optim\n"
        "torch.optim._muon._zeropower_via_newtonschulz = optim.newton_schulz_fp32\n")
    env = dict(os.environ, PYTHONPATH=str(shim))
    common = ["--data", data_dir, "--offline", "--batch-size", "2", "--max-steps", "3",
              "--optimizer", "muon", "--lr", "3e-3", "--ttt-length", "3", "--eval-every", "3",
              "--fc-init", "rms"] + FP32
    one, two, still = (str(tmp_path / n) for n in ("one", "two", "still"))
    run_train(common + ["--out", one], env=env)
    run_train(common + ["--out", still, "--lr", "1e-12"], env=env)   # the start, for scale
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "train.py", "--out", two] + common
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b, s = final_state(one)["model"], final_state(two)["model"], final_state(still)["model"]
    muon_names = [n for n, w in a.items() if w.ndim == 2 and min(w.shape) > 1 and "lm_head" not in n]
    assert len(muon_names) == 8                  # fc, q/k/v/o, gate/up/down
    for k in muon_names:
        moved, apart = (a[k] - s[k]).norm(), (a[k] - b[k]).norm()
        assert moved > 1e-3 and apart < 1e-3 * moved, (k, float(moved), float(apart))


def test_online_matches_offline(tmp_path, data_dir):
    common = ["--data", data_dir, "--batch-size", "2", "--max-steps", "5", "--lr", "1e-3",
              "--ttt-length", "3", "--eval-every", "5", "--log-every", "1",
              "--fc-init", "rms"] + FP32   # rms: the producer's first job, the shards offline
    off, on = str(tmp_path / "off"), str(tmp_path / "on")
    run_train(common + ["--out", off, "--offline"])
    run_train(common + ["--out", on, "--prefetch", "2"])
    la, lb = read_log(off) + read_log(off, "eval"), read_log(on) + read_log(on, "eval")
    assert [(r["split"], r["step"]) for r in la] == [(r["split"], r["step"]) for r in lb] and la
    for ra, rb in zip(la, lb):
        assert ra["rows"] == rb["rows"] and ra["tokens"] == rb["tokens"]
        assert abs(ra["loss"] - rb["loss"]) < 1e-4 * max(1, ra["loss"])
    a, b = final_state(off), final_state(on)
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], atol=1e-5, rtol=1e-4), k
    assert all("data_wait" in r for r in read_log(on))


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, nothing written

def edit_json(path, **changes):
    with open(path) as f:
        d = json.load(f)
    d.update(changes)
    with open(path, "w") as f:
        json.dump(d, f)


def expect_error(args, pattern):
    p = run_train(args + FP32, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert lines[-1].startswith("error:") and pattern in lines[-1], p.stderr[-2000:]
    return lines[-1]


def test_bad_inputs(tmp_path, target_dir, data_dir):
    import shutil
    from safetensors.torch import load_file, save_file

    def copy(name):
        d = str(tmp_path / name)
        shutil.copytree(data_dir, d)
        return d

    out = str(tmp_path / "out")
    base = ["--out", out, "--offline", "--batch-size", "2", "--max-steps", "2"]
    d = copy("tok")
    edit_json(os.path.join(d, "manifest.json"), tokenizer_hash="0123456789abcdef")
    expect_error(["--data", d] + base, "another tokenizer")
    d = copy("othertarget")
    expect_error(["--data", d, "--target", str(tmp_path / "elsewhere")] + base, "was made with target")
    d = copy("d2t")
    v = load_file(os.path.join(d, "vocab.safetensors"))
    v["d2t"][3] += 1
    save_file(v, os.path.join(d, "vocab.safetensors"))
    expect_error(["--data", d] + base, "consistent vocab map")
    d = copy("empty")
    open(os.path.join(d, "sequences.jsonl"), "w").close()
    edit_json(os.path.join(d, "manifest.json"), num_sequences=0)
    expect_error(["--data", d] + base, "no sequences")
    d = copy("nohidden")
    edit_json(os.path.join(d, "manifest.json"), hidden=None)
    expect_error(["--data", d] + base, "no stored hidden states")
    expect_error(["--data", str(tmp_path / "missing")] + base, "no such directory")
    expect_error(["--data", data_dir] + base + ["--resume"], "no checkpoint")
    assert not rundir.list_checkpoints(out)


def test_bad_vocab_for_init_draft(tmp_path, target_dir, data_dir):
    from common import load_target
    target, _ = load_target(target_dir)
    cfg = config_from_target(target.config, VD, [1, 3, 4])
    draft = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    draft.set_vocab(torch.arange(VD))    # not the data's vocab
    draft.save_pretrained(str(tmp_path / "other"))
    expect_error(["--data", data_dir, "--out", str(tmp_path / "o"), "--offline",
                  "--init", str(tmp_path / "other")], "draft vocabulary")


def test_sequence_longer_than_draft_positions(tmp_path):
    tdir = save_tiny_target(tmp_path / "short_target", max_positions=32)
    d = build_data(tmp_path / "long", tdir, n=4, lengths=(30, 40), hidden=False)
    expect_error(["--data", d, "--out", str(tmp_path / "o")], "max_position_embeddings 32")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, data_dir):
    import shutil
    from safetensors.torch import load_file, save_file
    d = str(tmp_path / "nan")
    shutil.copytree(data_dir, d)
    # poison one sequence; find the step whose batch holds it
    m = json.load(open(os.path.join(d, "manifest.json")))
    seqs = [json.loads(l) for l in open(os.path.join(d, "sequences.jsonl"))]
    train_ids, _ = train_data.split_data(len(seqs), 0.05, 0)
    step = 3
    lengths = [len(q["input_ids"]) for q in seqs]
    k = train_data.batch_indices(train_ids, step, 2, 0, lengths)[0][0]
    shard = next(s for s in m["hidden"]["shards"] if s["start"] <= k < s["end"])
    t = load_file(os.path.join(d, shard["file"]))
    t[f"aux.{k}"][:] = float("nan")
    save_file(t, os.path.join(d, shard["file"]))
    # the poisoned sequence is among the 8 whose states scale fc (--fc-init rms, the default):
    # that is a one-line error before any step
    assert k in train_ids[:8]
    expect_error(["--data", d, "--out", str(tmp_path / "rms"), "--offline", "--batch-size", "2",
                  "--max-steps", "6"], "--fc-init rms: the target's hidden states")
    out = str(tmp_path / "run")
    line = expect_error(["--data", d, "--out", out, "--offline", "--batch-size", "2",
                         "--max-steps", "6", "--save-every", "2", "--fc-init", "normal"], f"step {step}")
    assert str(k) in line and "step-000002" in line
    assert [os.path.basename(c) for c in rundir.list_checkpoints(out)] == ["step-000002"]
    st = final_state(out)
    assert all(torch.isfinite(v).all() for v in st["model"].values() if v.is_floating_point())


# ----------------------------------------------------------------------------------------------
# Training metrics must predict decode-time acceptance

def test_replayed_accept_length_predicts_speculate(tmp_path, target_dir):
    """Data = the tiny target's own greedy continuations. After training, eval's replayed accept
    length must match speculate.py's measured accept length (steps 3, topk 1, greedy) on the
    held-out prompts, for a draft train.py itself trained. (The position convention is pinned by
    tests/test_lookup.py::test_training_replay_equals_speculate, with a draft whose acceptance
    collapses under a one-position shift; a draft trained here is less sensitive.)"""
    from safetensors.torch import save_file
    from common import load_target
    from model import load_draft_for
    from speculate import Speculator
    target, _ = load_target(target_dir)
    N, P, G = 48, 8, 40
    ids = torch.randint(0, V, (N, P), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():   # batched greedy continuation (no cache: G small forwards, fast)
        for _ in range(G):
            ids = torch.cat([ids, target(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    seqs = [{"input_ids": s, "loss_mask": [0] * P + [1] * G} for s in ids.tolist()]
    d = build_data(tmp_path / "greedy", target_dir, n=N)     # same format, then our sequences
    with open(os.path.join(d, "sequences.jsonl"), "w") as f:
        for s in seqs:
            f.write(json.dumps(s) + "\n")
    hs = hidden.target_hidden_states(target, [s["input_ids"] for s in seqs], [1, 3, 4])
    m = json.load(open(os.path.join(d, "manifest.json")))
    for sh in m["hidden"]["shards"]:
        save_file({**{f"aux.{k}": hs[k][0].float().contiguous() for k in range(sh["start"], sh["end"])},
                   **{f"final.{k}": hs[k][1].float().contiguous() for k in range(sh["start"], sh["end"])}},
                  os.path.join(d, sh["file"]))
    out = str(tmp_path / "run")
    run_train(["--data", d, "--out", out, "--offline", "--batch-size", "8", "--epochs", "40",
               "--lr", "3e-3", "--ttt-length", "4", "--eval-fraction", "0.25", "--eval-every", "1000",
               "--log-every", "50"] + FP32)
    ev = read_log(out, "eval")[-1]
    draft = load_draft_for(rundir.list_checkpoints(out)[-1], target, torch.float32)
    spec = Speculator(target, draft, steps=3, topk=1)
    tokens = rounds = 0
    for k in json.load(open(os.path.join(out, "args.json")))["eval_sequences"]:
        got, st = spec.generate(seqs[k]["input_ids"][:P], G)
        assert got == seqs[k]["input_ids"][P:]              # lossless, and the data is greedy
        tokens += sum(st["accepted"]) + st["rounds"]        # committed per round, as replay counts
        rounds += st["rounds"]
    measured = tokens / rounds
    assert measured > 1.4, measured                         # the draft learned something
    assert abs(ev["replay_accept_3"] - measured) < 0.05 * measured, \
        (ev["replay_accept_3"], measured, ev["accept_len_3"])


def test_eval_prompts_cover_every_held_out_turn(tmp_path):
    """eval_prompts.jsonl holds one prompt per assistant turn the held-out sequences train on,
    each the conversation up to that turn's user message: decoding the file covers the turns the
    replayed accept length counts, not only each conversation's last turn."""
    from common import read_prompts
    u = lambda t: {"role": "user", "content": t}
    a = lambda t: {"role": "assistant", "content": t}
    convs = [[{"role": "system", "content": "s"}, u("q0"), a("a0"), u("q1"), a("a1")],
             [u("r0"), a("b0")], [u("t0"), a("c0"), u("t1"), a("c1")]]
    (tmp_path / "conversations.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in convs))
    seqs = [{"conversation": 0}, {"conversation": 1},                # whole conversations
            {"conversation": 2, "turn": 1}, {"conversation": 2, "turn": 3}]   # one per turn
    out = tmp_path / "eval_prompts.jsonl"
    rundir.write_eval_prompts(str(tmp_path), seqs, [0, 2, 3], str(out))
    got = [[m["content"] for m in p] for p in read_prompts(str(out))]
    assert got == [["s", "q0"], ["s", "q0", "a0", "q1"], ["t0"], ["t0", "c0", "t1"]]
    rundir.write_eval_prompts(str(tmp_path), seqs, [1], str(out))
    assert [[m["content"] for m in p] for p in read_prompts(str(out))] == [["r0"]]


def test_draft_config_shapes_a_new_draft(tmp_path, data_dir):
    """--draft-config (SpecForge's --draft-model-config) replaces the automatic shape."""
    p = tmp_path / "draft.json"
    p.write_text(json.dumps({"intermediate_size": 40, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 12, "rope_theta": 1e6}))
    out = str(tmp_path / "run")
    run_train(["--data", data_dir, "--out", out, "--offline", "--batch-size", "2", "--max-steps",
               "2", "--ttt-length", "2", "--draft-config", str(p)] + FP32)
    cfg = json.load(open(os.path.join(rundir.list_checkpoints(out)[-1], "config.json")))
    assert (cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["rope_theta"]) == (40, 2, 1, 12, 1e6)
    p.write_text(json.dumps({"draft_vocab_size": 7}))
    expect_error(["--data", data_dir, "--out", str(tmp_path / "o"), "--offline",
                  "--draft-config", str(p)], "draft_vocab_size is 7")
    expect_error(["--data", data_dir, "--out", str(tmp_path / "o"), "--offline", "--init", out,
                  "--draft-config", str(p)], "--draft-config")
    expect_error(["--data", data_dir, "--out", out, "--offline", "--batch-size", "2", "--max-steps",
                  "3", "--ttt-length", "2", "--resume"], "another shape")


# ----------------------------------------------------------------------------------------------
# The online producer's failures reach the trainer as one clear error

def test_producer_death_stops_the_trainer(tmp_path, data_dir):
    """A producer killed mid-run (out of memory, say) must end the trainer with one error line,
    not leave it waiting forever."""
    out = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "train.py", "--data", data_dir, "--out", out,
                             "--batch-size", "2", "--max-steps", "100000", "--prefetch", "1",
                             "--log-every", "1", "--eval-every", "100000", "--save-every", "100000"]
                            + FP32, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 240
    log = os.path.join(out, "log.jsonl")
    while not (os.path.exists(log) and os.path.getsize(log) > 0):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.1)
    producers = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == proc.pid and "spawn_main" in cmd:
            producers.append(int(pid))
    assert len(producers) == 1, producers
    os.kill(producers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "producer process died" in last, err[-2000:]


def test_producer_error_is_one_error_line(tmp_path, data_dir):
    """An error inside the producer (here: --target-backend sglang without SGLang or a GPU) comes
    back through the queue as the trainer's error, exit 2."""
    p = run_train(["--data", data_dir, "--out", str(tmp_path / "run"), "--batch-size", "2",
                   "--max-steps", "2", "--target-backend", "sglang"] + FP32, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert any(l.startswith("error: ") and "sglang" in l.lower() for l in lines), p.stderr[-2000:]
