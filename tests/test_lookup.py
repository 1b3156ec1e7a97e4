"""speculate.py against a target that needs three tokens of context and a draft that gets long
runs accepted only when everything on the draft side is right (tests/lookup_fixture.py).

Losslessness alone cannot fail on a bad draft side (the target corrects every wrong guess), so
these tests also pin what is accepted: for chains exactly what a plain-Python replay of the
draft's own table predicts, for trees paths of depth >= 3 in most rounds, never less than the
chain from the same root, and more than the chain on average. The position convention is pinned
twice: speculate.py's measured acceptance equals ttt.py's replay over the same greedy data (both
break under a one-position shift, in either direction), and --sglang-positions shifts exactly
the draft's decode steps by one."""
import pytest
import torch

from lookup_fixture import V, chain_replay, lookup_prompts
from speculate import Speculator, target_generate

MAX_NEW = 40
PROMPTS = lookup_prompts(8, seed=1)


_REFS = {}


def references(target, steps):
    """Per prompt: the target's greedy continuation, `steps` + 1 tokens past MAX_NEW."""
    key = (id(target), steps)
    if key not in _REFS:
        _REFS[key] = [target_generate(target, p, MAX_NEW + steps + 1)[0] for p in PROMPTS]
    return _REFS[key]


def run_all(spec, refs):
    """Generate every prompt; assert each output equals the target's own greedy decoding."""
    stats = []
    for i, (p, ref) in enumerate(zip(PROMPTS, refs)):
        out, st = spec.generate(p, MAX_NEW)
        assert out == ref[:MAX_NEW], f"prompt {i}: not the target's greedy output"
        stats.append(st)
    return stats


def accept_length(stats):
    acc = [a for st in stats for a in st["accepted"]]
    return 1 + sum(acc) / len(acc), acc


def test_target_needs_three_tokens_of_context(lookup):
    """The fixture's premise: greedy output = the table of the last three tokens, and the token
    three back changes the next token in most contexts."""
    t, _ = lookup
    for p, ref in zip(PROMPTS, references(t, 0)):
        seq = p + ref
        assert all(seq[k] == int(t.table[seq[k - 3], seq[k - 2], seq[k - 1]])
                   for k in range(len(p), len(seq)))
    g = torch.Generator().manual_seed(0)
    bc = torch.randint(0, V, (40, 2), generator=g)
    x = torch.cat([torch.arange(V).repeat(40)[:, None], bc.repeat_interleave(V, 0)], 1)
    with torch.no_grad():
        nxt = t(input_ids=x).logits[:, -1].argmax(-1).view(40, V)
    assert (nxt != nxt[:, :1]).any(1).float().mean() > 0.9


@pytest.mark.parametrize("steps", [3, 5])
def test_chain_accepts_exactly_what_the_draft_table_predicts(lookup, steps):
    t, d = lookup
    refs = references(t, steps)
    stats = run_all(Speculator(t, d, steps, 1), refs)
    for i, (p, ref, st) in enumerate(zip(PROMPTS, refs, stats)):
        assert st["accepted"] == chain_replay(d.first, p + ref, len(p), MAX_NEW, steps), f"prompt {i}"
    al, acc = accept_length(stats)
    full = sum(a == steps for a in acc) / len(acc)
    assert al > {3: 3.5, 5: 4.85}[steps] and full > {3: 0.7, 5: 0.6}[steps], (al, full)


TREES = [(4, 2, 8), (4, 3, 10), (6, 3, 16)]


@pytest.mark.parametrize("steps,topk,ndt", TREES)
def test_tree_accepts_deep_paths_and_beats_the_chain(lookup, steps, topk, ndt):
    """Every draft distribution here has the same shape, so the top-1 chain is the tree's best
    path and is always kept: from the same root the tree accepts at least what the chain does,
    and its second branches recover the draft's wrong table entries."""
    t, d = lookup
    refs = references(t, steps)
    stats = run_all(Speculator(t, d, steps, topk, ndt), refs)
    for i, (p, ref, st) in enumerate(zip(PROMPTS, refs, stats)):
        seq, r = p + ref, len(p)
        for a in st["accepted"]:
            chain = chain_replay(d.first, seq[:r + steps + 1], r, 2, steps)[0]
            assert a >= chain, f"prompt {i}, root at {r}: tree {a} < chain {chain}"
            r += a + 1
    al, acc = accept_length(stats)
    deep = sum(a >= 3 for a in acc) / len(acc)
    chain_al, _ = accept_length(run_all(Speculator(t, d, steps, 1), refs))
    # measured 4.38 / 0.71, 4.71 / 0.97, 6.11 / 1.00 (the chain of the same depth 4.28, 5.25)
    want_al, want_deep, gain = {(4, 2, 8): (4.33, 0.68, 0.05), (4, 3, 10): (4.65, 0.93, 0.3),
                                (6, 3, 16): (6.05, 0.95, 0.6)}[(steps, topk, ndt)]
    assert al > want_al and deep > want_deep and al > chain_al + gain, (al, deep, chain_al)


class PositionSpy:
    """Wraps the draft's forward and records the position ids of every call."""

    def __init__(self, draft):
        self.draft, self.calls = draft, []

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def __call__(self, ids, g, pos, cache=None, mask=None):
        self.calls.append((ids.shape[1], pos[0].tolist(), cache.len))
        return self.draft(ids, g, pos, cache, mask)


@pytest.mark.parametrize("topk,ndt", [(1, 4), (3, 8)])
@pytest.mark.parametrize("sglang", [False, True])
def test_draft_positions(lookup, topk, ndt, sglang):
    """Row convention: an extend over committed rows n0..n-1 runs at positions n0..n-1; draft
    step i (i = 1 is the first token after the root) runs at position n + i - 1, or one later
    with --sglang-positions (SGLang's draft loop: the first decode after a prefill ending at
    position n-1 runs at n+1). Lossless either way; our draft is built for our convention, so
    SGLang's costs it most of its acceptance."""
    t, d = lookup
    spy = PositionSpy(d)
    spec = Speculator(t, spy, 3, topk, ndt, sglang_positions=sglang)
    refs = references(t, 3)
    stats = run_all(spec, refs)
    shift, K, calls, i, rounds = int(sglang), topk, spy.calls, 0, 0
    # the calls are: prefill extend, then per round (steps - 1) decode calls and, unless it was
    # the prompt's last round, the extend over the committed rows
    while i < len(calls):
        T, pos, past = calls[i]
        assert pos == list(range(past, past + T)), ("extend rows sit at their own index", calls[i])
        n, i = past + T, i + 1
        for step in range(2, 3 + 1):
            T2, pos2, past2 = calls[i]
            assert (T2, past2) == (K, n + (step - 2) * K), (n, step, calls[i])
            assert pos2 == [n + step - 2 + shift] * K, (n, step, calls[i])
            i += 1
        rounds += 1
    assert rounds == sum(st["rounds"] for st in stats)
    al, _ = accept_length(stats)
    if sglang:   # measured 2.12 (chain) / 2.18 (tree)
        assert al < 2.5, al
    else:        # 3.54 / 3.88
        assert al > 3.5, al


def replayed_accept_length(target, draft, seqs, prompt_lens, J=3):
    """train.py's eval path, in process: target_side, valid_rows, the TTT unroll (TTTLoss) and
    replay_decoding over target-greedy sequences whose continuations are the loss tokens."""
    import ttt
    from hidden import target_hidden_states
    B, T = len(seqs), max(map(len, seqs))
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    hs = target_hidden_states(target, seqs, draft.config.aux_layer_ids)
    aux = torch.zeros(B, T, hs[0][0].shape[-1])
    final = torch.zeros(B, T, hs[0][1].shape[-1])
    for b, (s, P) in enumerate(zip(seqs, prompt_lens)):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, P:len(s)] = True
        aux[b, :len(s)], final[b, :len(s)] = hs[b][0].float(), hs[b][1].float()
    lm_w = target.lm_head.weight
    with torch.no_grad():
        targ_p, targ_argmax, in_vocab = ttt.target_side(
            final, lm_w[draft.draft_ids], need=ttt.shift_left(mask, 1, False), lm_w=lm_w,
            t2d=draft.t2d)
        valid = ttt.valid_rows(mask, in_vocab, J)
        _, _, correct = ttt.TTTLoss(draft, J)(ids, aux, targ_p, targ_argmax, valid,
                                              valid.sum((1, 2)).float(), 1.0)
    tokens, rounds = ttt.replay_decoding(correct, mask, k=3).tolist()
    return tokens / rounds


def test_training_replay_equals_speculate(lookup):
    """The row/position convention of ttt.py (training) and speculate.py (decoding) must agree:
    over the target's own greedy continuations, eval's replayed accept length equals what
    speculate.py measures. With this draft a one-position shift on either side, in either
    direction, or a wrong token at a draft step costs about half of the acceptance."""
    t, d = lookup
    refs = references(t, 3)
    stats = run_all(Speculator(t, d, 3, 1), refs)
    measured, _ = accept_length(stats)
    replay = replayed_accept_length(t, d, [p + r[:MAX_NEW] for p, r in zip(PROMPTS, refs)],
                                    [len(p) for p in PROMPTS])
    # measured 3.54, replayed 3.46: the replay ends with the data, speculate.py past max-new
    assert measured > 3.5 and abs(replay - measured) < 0.04 * measured, (replay, measured)


# ----------------------------------------------------------------------------------------------
# The command lines on the same pair, saved to disk: --check and bench.py must show the
# acceptance too, and count a mismatch when the verifier is broken

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import json
    from lookup_fixture import save_lookup
    root = tmp_path_factory.mktemp("lookup")
    tdir, ddir = save_lookup(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{i}" for i in p)}) + "\n"
                               for p in PROMPTS[:4]))
    return {"target": tdir, "draft": ddir, "prompts": str(prompts), "root": root}


def speculate_cli(monkeypatch, saved, out, *extra):
    """speculate.py's main, in process (the entry point itself is run once, below)."""
    import json
    import sys
    argv = ["speculate.py", "--target", saved["target"], "--draft", saved["draft"],
            "--prompts", saved["prompts"], "--max-new-tokens", "30", "--dtype", "float32",
            "--quiet", "--check", "--json", str(out), *extra]
    monkeypatch.setattr(sys, "argv", argv)
    import speculate
    speculate.main()
    return json.loads(out.read_text())["summary"]


@pytest.mark.parametrize("extra,lo,hi", [
    ([], 3.3, 4.0),
    (["--steps", "4", "--topk", "3", "--num-draft-tokens", "10"], 4.4, 5.0),
    (["--sglang-positions"], 1.0, 2.5),
    # SGLang's tree-draft attention: depth >= 3 reads the slot's rows, not the parent's; this
    # draft's next token depends on the tokens two back, so it loses (measured 4.138 vs 4.444)
    (["--steps", "4", "--topk", "3", "--num-draft-tokens", "10", "--sglang-tree-slots"], 3.9, 4.3)])
def test_speculate_check_cli_accepts(monkeypatch, saved, tmp_path, extra, lo, hi):
    s = speculate_cli(monkeypatch, saved, tmp_path / "r.json", *extra)
    assert s["mismatches"] == 0 and s["prompts"] == 4
    assert lo < s["accept_length"] < hi, s
    if not extra:   # a chain of 3: the third draft is accepted in most rounds
        assert s["position_acceptance"][2] > 0.6, s


def test_check_counts_a_broken_verifier_and_exits_1(saved, tmp_path):
    """--check is the user's proof of losslessness: with a verifier that accepts every draft it
    must report the differences and exit 1 (through the real entry point)."""
    import json
    import subprocess
    import sys
    from conftest import ROOT
    out = tmp_path / "r.json"
    code = ("import sys, speculate\n"
            "def accept_all(self, tree, logits):\n"
            "    path = list(range(len(tree.tokens)))\n"
            "    return path, int(logits[-1].argmax())\n"
            "speculate.Speculator.accept_greedy = accept_all\n"
            f"sys.argv = {['speculate.py', '--target', saved['target'], '--draft', saved['draft'], '--prompts', saved['prompts'], '--max-new-tokens', '30', '--dtype', 'float32', '--quiet', '--check', '--json', str(out)]!r}\n"
            "speculate.run_main(speculate.main)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    s = json.loads(out.read_text())["summary"]
    assert s["mismatches"] >= 3, s
    assert "DIFFERENT" in r.stderr and f"{4 - s['mismatches']}/4 outputs identical" in r.stdout


def bench_results(saved, out, *extra):
    import json
    import bench
    bench.main(["--target", saved["target"], "--draft", saved["draft"], "--dtype", "float32",
                "--benchmark-list", saved["prompts"], "--config-list", "1,3,1,4", "1,4,3,10",
                "--max-new-tokens", "30", "--no-peers", "--output", str(out), *extra])
    return {e["config"]: e for e in json.loads(out.read_text())["results"]}


def test_bench_end_to_end_accepts(saved, tmp_path):
    res = bench_results(saved, tmp_path / "b.json")
    assert res["1,0,0,0"]["accept_length"] == 1.0
    for cfg, lo in [("1,3,1,4", 3.2), ("1,4,3,10", 4.3)]:
        e = res[cfg]
        assert e["mismatches"] == 0 and e["accept_length"] > lo, e
    assert res["1,4,3,10"]["accept_length"] > res["1,3,1,4"]["accept_length"] + 0.5


def test_bench_counts_mismatches(saved, tmp_path, monkeypatch):
    import speculate

    def accept_all(self, tree, logits):
        return list(range(len(tree.tokens))), int(logits[-1].argmax())
    monkeypatch.setattr(speculate.Speculator, "accept_greedy", accept_all)
    res = bench_results(saved, tmp_path / "b.json")
    assert res["1,0,0,0"]["mismatches"] == 0
    assert res["1,3,1,4"]["mismatches"] >= 3 and res["1,4,3,10"]["mismatches"] >= 3, res
