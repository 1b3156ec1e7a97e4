"""Losslessness of speculate.py, in fp32 on tiny targets.

Greedy: token-identical to the target's own greedy decoding, for chains and trees, with a random
draft (almost nothing accepted) and with a hand-built draft that agrees with the target most of
the time (full acceptance, bonus tokens, EOS inside an accepted run, the max-new-tokens cut).

Sampling: the empirical distribution of the first three generated tokens over many seeded runs is
within a stated total-variation bound of the target's exact distribution. tests/test_sampling.py
checks every token of many rounds, and that deliberately wrong samplers fail it.
"""
import math

import pytest
import torch

from conftest import make_tiny_target
from model import Eagle3Draft
from draft_config import config_from_target
from speculate import Speculator, target_generate

CONFIGS = [(3, 1, 4), (5, 4, 8), (6, 8, 32)]   # (steps, topk, num_draft_tokens)


def random_pair(V=64, Vd=48, seed=0):
    """A random target (lm_head scaled so logit gaps are far above fp32 noise) and random draft."""
    t = make_tiny_target(vocab_size=V, hidden_size=32, layers=8, seed=seed)
    with torch.no_grad():
        t.lm_head.weight.mul_(20)
    torch.manual_seed(seed + 1)
    d = Eagle3Draft(config_from_target(t.config, Vd), t.get_input_embeddings().weight)
    d.set_vocab(torch.randperm(V)[:Vd].sort().values)
    return t, d.eval()


def bigram_pair(V=32, H=64, Vd=28, eos=5, gamma=4.7, seed=0):
    """A target that mostly follows a fixed successor permutation f (one cycle through every token,
    EOS included), plus a draft built by hand to predict f, so acceptance is high.

    Target: embeddings are one-hot (u_x in the first V dims); its random decoder layers are scaled by
    `gamma` so context still changes about 5% of greedy tokens (which keeps the target's KV cache
    relevant: a wrong cache changes outputs); lm_head maps u_x to token f(x).
    Draft: fc copies the one-hot part of the highest captured layer into g; attention is switched off
    (o_proj = 0); the gated MLP turns c*u_x into c*u_{f(x)} (a one-hot "advance" by f), so h2 encodes
    the next token and each draft step moves one token ahead; lm_head maps u_y to f(y)."""
    g = torch.Generator().manual_seed(seed)
    t = make_tiny_target(vocab_size=V, hidden_size=H, layers=8, seed=seed, eos_token_id=eos)
    others = torch.tensor([x for x in range(V) if x != eos])[torch.randperm(V - 1, generator=g)]
    cyc = [eos] + others.tolist()
    f = torch.empty(V, dtype=torch.long)
    for i in range(V):
        f[cyc[i]] = cyc[(i + 1) % V]
    eye = torch.arange(V)
    with torch.no_grad():
        E = torch.zeros(V, H)
        E[eye, eye] = 1.0
        t.model.embed_tokens.weight.copy_(E)
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight.mul_(gamma)
            layer.mlp.down_proj.weight.mul_(gamma)
        W = torch.zeros(V, H)
        W[f, eye] = 4.0
        t.lm_head.weight.copy_(W)
    d = Eagle3Draft(config_from_target(t.config, Vd), t.get_input_embeddings().weight)
    S = torch.randperm(V, generator=g)[:Vd].sort().values
    d.set_vocab(S)
    alpha = 4.0
    with torch.no_grad():
        d.midlayer.self_attn.o_proj.weight.zero_()
        d.fc.weight.zero_()
        d.fc.weight[:V, 2 * H:2 * H + V] = torch.eye(V)
        mlp = d.midlayer.mlp
        I = mlp.gate_proj.weight.shape[0]
        mlp.gate_proj.weight.zero_()
        mlp.gate_proj.weight[:V, :V] = torch.eye(V) * alpha
        mlp.up_proj.weight.zero_()
        mlp.up_proj.weight[:V, :V] = torch.eye(V) / H ** 0.5
        act = torch.nn.functional.silu(torch.tensor(alpha * H ** 0.5)).item()
        D = torch.zeros(H, I)
        D[f, eye] += 1.0 / act
        D[eye, eye] -= 1.0 / act
        mlp.down_proj.weight.copy_(D)
        Wd = torch.zeros(Vd, H)
        Wd[torch.arange(Vd), torch.argsort(f)[S]] = 4.0
        d.lm_head.weight.copy_(Wd)
    return t, d.eval()


def prompts(n, V, seed, lo=3, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_plain_decoding_equals_transformers_generate():
    """Anchor the reference itself: our plain loop == transformers' own greedy generate."""
    t, _ = random_pair()
    for p in prompts(3, 64, seed=5):
        ours, _ = target_generate(t, p, 20)
        ref = t.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                         eos_token_id=None)[0, len(p):].tolist()
        assert ours == ref


@pytest.mark.parametrize("steps,topk,ndt", CONFIGS)
def test_greedy_identical_random_draft(steps, topk, ndt):
    t, d = random_pair()
    spec = Speculator(t, d, steps, topk, ndt, stop_ids=())
    accepted = 0
    for i, p in enumerate(prompts(12, 64, seed=steps)):
        n = 8 + 5 * i
        ref, _ = target_generate(t, p, n)
        out, st = spec.generate(p, n)
        assert out == ref, f"prompt {i}"
        accepted += sum(st["accepted"])
    if topk > 1:
        assert accepted > 0  # trees do accept some random guesses, so the KV gather is exercised


class TreeSpy:
    """Wraps the draft's forward and records, for every masked call (a tree depth >= 2), the
    cache length before it, the tokens in, the attention mask and the logits out."""

    def __init__(self, draft):
        self.draft, self.calls = draft, []

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def __call__(self, ids, g, pos, cache=None, mask=None):
        before = cache.len
        lg, h = self.draft(ids, g, pos, cache, mask)
        if mask is not None:
            self.calls.append((before, ids[0].tolist(), mask[0, 0].clone(), lg[0].clone()))
        return lg, h


@pytest.mark.parametrize("slots", [False, True])
def test_tree_draft_attends_to_ancestors_or_sglang_slots(slots):
    """At depth d >= 3 each frontier row sees one tree row per earlier depth. EAGLE-2 (the
    default): the row of its parent, checked here independently: the row's token is among the
    top-k children the draft predicted at the row it attends to. --sglang-tree-slots (SGLang
    0.5.23's draft decode): the rows its own slot wrote, i.e. slot t sees column t of every
    earlier depth, whoever its parent is. A random draft, so frontier parents move between
    slots; lossless either way."""
    t, d = random_pair()
    K = 3
    spy = TreeSpy(d)
    spec = Speculator(t, spy, 4, K, 10, stop_ids=(), sglang_tree_slots=slots)
    for i, p in enumerate(prompts(6, 64, seed=11)):
        ref, _ = target_generate(t, p, 24)
        assert spec.generate(p, 24)[0] == ref, f"prompt {i}"
    moved = 0   # frontier rows whose own slot's previous row is not a parent of theirs
    for prev, cur in zip(spy.calls, spy.calls[1:]):
        before, toks, mask, _ = cur
        if before != prev[0] + K:
            continue                                    # a new round starts at depth 2
        plog = prev[3]
        last = mask[:, -2 * K:-K]                       # the rows the previous depth wrote
        assert (last.sum(1) == 1).all() and (mask[:, -K:] == torch.eye(K, dtype=torch.bool)).all()
        col = last.float().argmax(1).tolist()
        kids = plog.topk(K, dim=-1).indices
        for r in range(K):
            parent = [j for j in range(K) if int(d.draft_ids[kids[j]].eq(toks[r]).any())]
            moved += r not in parent
            if slots:
                assert col[r] == r, (r, col)
            else:
                assert col[r] in parent, (r, col[r], parent)
    assert moved >= 10, moved   # so the two views really differ (measured 14 / 17 rows)


@pytest.mark.parametrize("steps,topk,ndt", CONFIGS)
def test_greedy_identical_high_acceptance(steps, topk, ndt):
    eos = 5
    t, d = bigram_pair(eos=eos)
    seen = {"full": 0, "eos_inside": 0, "cut": 0, "eos": 0}
    for stop in [(eos,), ()]:
        spec = Speculator(t, d, steps, topk, ndt, stop_ids=stop)
        for i, p in enumerate(prompts(15, 32, seed=10 + steps)):
            n = [1, 2, 7, 23, 40][i % 5]
            ref, _ = target_generate(t, p, n, stop_ids=stop)
            out, st = spec.generate(p, n)
            assert out == ref, f"prompt {i}, max_new {n}, stop {stop}"
            seen["full"] += sum(a == steps for a in st["accepted"])
            if out[-1] in stop:
                seen["eos"] += 1
                # EOS came out of the accepted drafts, not as the bonus token: later tokens dropped
                seen["eos_inside"] += st["last_emitted"] <= st["accepted"][-1] if st["accepted"] else 0
            elif st["accepted"] and len(out) == n and st["last_emitted"] < st["accepted"][-1] + 1:
                seen["cut"] += 1    # the limit fell inside a round's accepted run
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_prepacked_linears_keep_logits_and_losslessness():
    """common.pack_linears (what speculate.py, bench.py and generate.py's decoding do on CPU) swaps
    the matmul kernel of every Linear: logits stay within fp32 rounding, greedy speculation stays
    token-identical, gradients still flow where one is asked for (fallback to F.linear), bf16
    weights are packed too, and unpack_linears restores transformers' own results bit for bit."""
    from common import pack_linears, unpack_linears
    t, d = bigram_pair()
    x = torch.tensor([prompts(1, 32, seed=3)[0]])
    with torch.no_grad():
        before = t(x).logits
    pack_linears(t), pack_linears(d)
    assert isinstance(t.lm_head.forward, __import__("functools").partial)  # really swapped
    with torch.no_grad():
        after = t(x).logits
    assert torch.allclose(before, after, rtol=1e-5, atol=1e-4)
    for steps, topk, ndt in CONFIGS[:2]:
        spec = Speculator(t, d, steps, topk, ndt, stop_ids=())
        for i, p in enumerate(prompts(6, 32, seed=20 + steps)):
            ref, _ = target_generate(t, p, 30)
            out, st = spec.generate(p, 30)
            assert out == ref, f"prompt {i}"
    unpack_linears(t)
    assert "forward" not in vars(t.lm_head)
    with torch.no_grad():
        assert torch.equal(t(x).logits, before)
    lin = pack_linears(torch.nn.Linear(8, 4))
    inp = torch.randn(3, 8, requires_grad=True)
    lin(inp).sum().backward()
    assert inp.grad is not None and lin.weight.grad is not None
    lin16 = torch.nn.Linear(16, 8).to(torch.bfloat16)
    want = lin16(torch.ones(2, 16, dtype=torch.bfloat16)).detach()
    pack_linears(lin16.requires_grad_(False))
    assert torch.allclose(lin16(torch.ones(2, 16, dtype=torch.bfloat16)).float(), want.float(),
                          rtol=2e-2, atol=2e-2)


def test_high_acceptance_draft_really_accelerates_in_rounds():
    """Sanity of the fixture the tests above rely on: the hand-built draft is accepted often."""
    t, d = bigram_pair()
    out, st = Speculator(t, d, 3, 1, 4, stop_ids=()).generate(prompts(1, 32, 3)[0], 60)
    assert st["accept_length"] > 2.0


# ----------------------------------------------------------------------------------------------
# Sampling

def exact_first3(t, prompt, temperature, top_p):
    """Exact joint distribution of the first three sampled tokens, by enumeration. The processed
    distribution comes from transformers' own warpers, not from speculate.target_probs (the
    function under test)."""
    from test_sampling import reference_probs as target_probs
    V = t.config.vocab_size
    with torch.no_grad():
        base = torch.tensor([prompt])
        p1 = target_probs(t(base).logits[0, -1], temperature, top_p)              # [V]
        seq2 = torch.cat([base.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = target_probs(t(seq2).logits[:, -1], temperature, top_p)              # [V, V]
        seq3 = torch.cat([seq2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p3 = target_probs(t(seq3).logits[:, -1], temperature, top_p).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def tv(counts, p):
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def tv_bound(k, n, delta=1e-6):
    """E[TV] <= 0.5*sqrt(k/n) for k outcomes (Cauchy-Schwarz), and TV concentrates around its mean
    with bounded differences 1/n (McDiarmid): P(TV > E + s) <= exp(-2 n s^2). So a correct sampler
    exceeds this bound with probability below delta."""
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def sample_runs(cls, t, d, cfg, prompt, n, temperature, top_p):
    V = t.config.vocab_size
    spec = cls(t, d, *cfg, temperature=temperature, top_p=top_p, stop_ids=())
    counts = torch.zeros(V, V, V)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(n):
        out, _ = spec.generate(prompt, 3, gen)
        counts[out[0], out[1], out[2]] += 1
    return counts


def sampling_pair(V=12):
    """A small peaked target and a draft whose q differs a lot from the target's p (ten of the
    twelve tokens in its vocabulary): every branch of the accept/resample rule is taken."""
    t = make_tiny_target(vocab_size=V, hidden_size=32, layers=6, seed=3)
    with torch.no_grad():
        t.lm_head.weight.mul_(12)     # peaked enough that the draft's q differs a lot from p
    torch.manual_seed(7)
    d = Eagle3Draft(config_from_target(t.config, 10, [1, 2, 3]), t.get_input_embeddings().weight)
    with torch.no_grad():
        d.lm_head.weight.mul_(30)
    d.set_vocab(torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 9, 11]))
    return t, d.eval()


@pytest.mark.parametrize("cfg,temperature,top_p", [((3, 1, 4), 1.0, 1.0), ((3, 1, 4), 0.7, 0.9),
                                                   ((3, 3, 7), 1.0, 1.0)])
def test_sampling_preserves_target_distribution(cfg, temperature, top_p):
    """Joint distributions of the first tokens against exact enumeration. (tests/test_sampling.py
    checks every token of many rounds, with negative controls for chains and trees.)"""
    V, n = 12, 1500
    t, d = sampling_pair(V)
    prompt = [3, 1, 4, 1, 5]
    exact = exact_first3(t, prompt, temperature, top_p)
    counts = sample_runs(Speculator, t, d, cfg, prompt, n, temperature, top_p)
    # joint of the first two tokens, and the marginals of tokens 2 and 3 (token 1 is plain sampling)
    checks = {"joint(1,2)": (counts.sum(2), exact.sum(2), V * V),
              "token 2": (counts.sum((0, 2)), exact.sum((0, 2)), V),
              "token 3": (counts.sum((0, 1)), exact.sum((0, 1)), V)}
    for name, (c, p, k) in checks.items():
        assert tv(c, p) < tv_bound(k, n), (name, tv(c, p), tv_bound(k, n))
