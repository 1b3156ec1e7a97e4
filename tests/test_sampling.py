"""Lossless sampling over many rounds: every emitted token, at every depth of every round, must be
distributed as the target's processed distribution given everything before it.

The reference is independent of speculate.py: transformers' own temperature and top-p logits
warpers, then a softmax, over one plain target forward of the finished sequence. The target is
the lookup target of tests/lookup_fixture.py with soft logits (its table's token has about 45%
of the mass; small random weights break every tie, so the top-p set is unambiguous), the draft its
hand-built draft, near-certain (a wrong-depth q is then far off) and with soft logits (its guess
has about a third of the mass, so the ratio p/q matters: a near-certain draft, q(x) ~ 1, cannot
tell min(1, p/q) from min(1, p/q^2)). Acceptance, rejection and residual sampling all happen
often, at every depth.

For a correct sampler the emitted tokens x_k satisfy P(x_k = v | past) = p_k(v), so pooled over
all tokens of all runs:
  - no token outside the reference support (top-p) is ever emitted;
  - the counts of "x_k was the target's r-th most likely token" match sum_k p_k(r-th): Pearson's
    statistic, compared with a chi-square tail bound (Laurent & Massart 2000) at 1e-6;
  - the total log-probability of the emitted tokens matches its expectation (a z-score < 5).
Negative controls run the same checks on deliberately wrong samplers (accept every draft; the
depth-1 draft distribution at every depth; temperature and top-p ignored) and require a failure,
so the test is shown to have the power to catch them, for chains and trees, at T != 1 and
top-p < 1."""
import math

import pytest
import torch

import speculate
from lookup_fixture import lookup_prompts, make_draft, make_target
from speculate import Speculator

RUNS, NEW = 40, 40


@pytest.fixture(scope="module")
def soft():
    """The soft target and its draft at two logit scales: near-certain guesses (5) and spread
    ones (0.6)."""
    t = make_target(seed=0, beta=0.6, noise=0.1)
    return t, {h: make_draft(t, seed=0, err=0.1, head=h) for h in (5.0, 0.6)}


def reference_probs(logits, temperature, top_p):
    """[T, V] logits -> the processed distributions, by transformers' warpers (not speculate.py)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper
    x = TemperatureLogitsWarper(temperature)(None, logits.double().reshape(-1, logits.shape[-1]))
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, -1).reshape(logits.shape)


def emitted_with_reference(spec, target, temperature, top_p, seed=0):
    """(p_k [N, V], x_k [N]) over every emitted token of RUNS sampled generations, and the
    accepted drafts of every round."""
    gen = torch.Generator().manual_seed(seed)
    ps, xs, acc = [], [], []
    for prompt in lookup_prompts(RUNS, seed=3, lo=4, hi=8):
        out, st = spec.generate(prompt, NEW, gen)
        acc += st["accepted"]
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt + out])).logits[0]
        P = len(prompt)
        ps.append(reference_probs(logits[P - 1:P - 1 + len(out)], temperature, top_p))
        xs.append(torch.tensor(out))
    return torch.cat(ps), torch.cat(xs), acc


def chi2_bound(d, delta=1e-6):
    """P(chi2_d >= d + 2 sqrt(d x) + 2 x) <= exp(-x) (Laurent & Massart 2000), x = ln(1/delta)."""
    x = math.log(1 / delta)
    return d + 2 * math.sqrt(d * x) + 2 * x


def statistics(p, x):
    """(tokens outside the support, Pearson's statistic over ranks / its bound, |z| of the total
    log-probability). A correct sampler gives (0, < 1, < 5) except with probability ~1e-6."""
    outside = int((p.gather(1, x[:, None]) == 0).sum())
    order = p.argsort(dim=1, descending=True, stable=True)
    rank = (order == x[:, None]).float().argmax(1)
    exp = p.gather(1, order).sum(0)                       # expected count of each rank
    obs = torch.bincount(rank, minlength=p.shape[1]).double()
    keep = exp >= 5                                        # rare ranks pooled into one cell
    E = torch.cat([exp[keep], exp[~keep].sum()[None]])
    O = torch.cat([obs[keep], obs[~keep].sum()[None]])
    O, E = O[E > 0], E[E > 0]
    chi2 = float(((O - E) ** 2 / E).sum())
    lp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    mean = (p * lp).sum(1)
    var = (p * lp ** 2).sum(1) - mean ** 2
    got = lp.gather(1, x[:, None]).squeeze(1)
    z = float((got - mean).sum() / var.sum().sqrt())
    return outside, chi2 / chi2_bound(len(E) - 1), abs(z)


def passes(stats):
    outside, chi2_ratio, z = stats
    return outside == 0 and chi2_ratio < 1 and z < 5


CASES = [((3, 1, 4), 1.0, 1.0, 5.0), ((3, 1, 4), 1.0, 1.0, 0.6), ((3, 1, 4), 0.7, 0.9, 5.0),
         ((4, 3, 8), 1.0, 1.0, 5.0), ((4, 3, 8), 0.8, 0.8, 5.0)]


@pytest.mark.parametrize("cfg,temperature,top_p,head", CASES)
def test_every_emitted_token_has_the_target_distribution(soft, cfg, temperature, top_p, head):
    t, d = soft[0], soft[1][head]
    spec = Speculator(t, d, *cfg, temperature=temperature, top_p=top_p)
    p, x, acc = emitted_with_reference(spec, t, temperature, top_p)
    stats = statistics(p, x)
    assert passes(stats), stats
    # the drafts really are accepted at depth >= 2, so every rule of accept_sample is exercised
    assert sum(a >= 2 for a in acc) / len(acc) > 0.1, acc   # measured 0.15 - 0.37


class AlwaysAccept(Speculator):
    """Wrong: every drafted token is accepted."""

    def accept_sample(self, tree, logits, gen):
        path = [0]
        while True:
            kids = [r for r in range(1, len(tree.tokens)) if tree.parent[r] == path[-1]]
            if not kids:
                return path, speculate.sample(
                    speculate.target_probs(logits[path[-1]], self.temperature, self.top_p), gen)
            path.append(kids[0])


class Depth1Q(Speculator):
    """Wrong: the chain's acceptance test uses the depth-1 draft distribution at every depth."""

    def draft_chain(self, n, gen):
        tree = super().draft_chain(n, gen)
        if tree.q:
            tree.q = [tree.q[0]] * len(tree.q)
        return tree


@pytest.mark.parametrize("wrong,cfg,temperature,top_p", [
    ("always-accept", (3, 1, 4), 0.7, 0.9), ("always-accept", (4, 3, 8), 0.8, 0.8),
    ("depth-1-q", (3, 1, 4), 1.0, 1.0),
    ("no-temperature-no-top-p", (3, 1, 4), 0.7, 0.9),
    ("no-temperature-no-top-p", (4, 3, 8), 0.8, 0.8)])
def test_wrong_samplers_fail(soft, monkeypatch, wrong, cfg, temperature, top_p):
    t, d = soft[0], soft[1][5.0]
    cls = {"always-accept": AlwaysAccept, "depth-1-q": Depth1Q}.get(wrong, Speculator)
    if wrong == "no-temperature-no-top-p":
        plain = speculate.target_probs
        monkeypatch.setattr(speculate, "target_probs", lambda lg, T, tp: plain(lg, 1.0, 1.0))
    spec = cls(t, d, *cfg, temperature=temperature, top_p=top_p)
    stats = statistics(*emitted_with_reference(spec, t, temperature, top_p)[:2])
    assert not passes(stats), f"no power against {wrong}: {stats}"


# ---- the rules one node at a time, against exact distributions -------------------------------
# The pooled test above sees a rule only as often as the fixture exercises it; these give each
# rule a distribution where getting it wrong moves a lot of mass, and draw many samples.

def rank_chi2_ok(counts, probs):
    """Pearson's statistic of observed counts against n * probs, below the 1e-6 tail bound."""
    n = counts.sum()
    E, O = n * probs, counts.double()
    keep = E >= 5
    E, O = torch.cat([E[keep], E[~keep].sum()[None]]), torch.cat([O[keep], O[~keep].sum()[None]])
    O, E = O[E > 0], E[E > 0]
    return float(((O - E) ** 2 / E).sum()) < chi2_bound(len(E) - 1)


def test_tree_siblings_rule_on_one_node(soft):
    """Root with three drafted children holding 45%, 30% and 15% of the target's mass: the first
    emitted token must follow the target exactly. Without renormalising after a rejected sibling
    the second child would come out at 0.55 * 30% instead of 30%."""
    t, d = soft[0], soft[1][5.0]
    spec = Speculator(t, d, 2, 3, 4, temperature=1.0)
    V = t.config.vocab_size
    p = torch.full((V,), 0.10 / (V - 3))
    p[[7, 3, 11]] = torch.tensor([0.45, 0.30, 0.15])
    logits = p.log()[None].expand(4, V).clone()
    tree = speculate.Tree(tokens=[0, 7, 3, 11], parent=[-1, 0, 0, 0], depth=[0, 1, 1, 1],
                          score=[0.0, -0.1, -0.2, -0.3])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(6000):
        path, bonus = spec.accept_sample(tree, logits, g)
        counts[tree.tokens[path[1]] if len(path) > 1 else bonus] += 1
    assert rank_chi2_ok(counts, p.double())
    assert counts[3] / counts.sum() > 0.25          # and the second child does come out


def test_first_token_is_sampled(soft):
    """The token after the prefill (no draft involved) is drawn from the target too."""
    t, d = soft[0], soft[1][5.0]
    for cfg in ((3, 1, 4), (3, 3, 6)):
        spec = Speculator(t, d, *cfg, temperature=0.8, top_p=0.9)
        prompt = lookup_prompts(1, seed=11, lo=6, hi=7)[0]
        with torch.no_grad():
            logits = t(input_ids=torch.tensor([prompt])).logits[0, -1]
        p = reference_probs(logits[None], 0.8, 0.9)[0]
        g = torch.Generator().manual_seed(1)
        counts = torch.zeros(p.numel())
        for _ in range(1500):
            counts[spec.generate(prompt, 1, g)[0][0]] += 1
        assert counts[p == 0].sum() == 0 and rank_chi2_ok(counts, p)
