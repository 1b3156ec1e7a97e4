"""
EAGLE-3 speculative decoding in plain PyTorch: the draft proposes, the target verifies, and the
output is exactly what the target alone would have produced.

One round, with n tokens committed to both KV caches and the next token `root` already chosen:

  1. draft   The draft extends from its last row. topk = 1: a chain of `steps` tokens. topk > 1: an
             EAGLE-2 tree: at each depth the `topk` best frontier nodes are expanded by their `topk`
             best children (score = product of draft probabilities along the path, kept as a sum of
             log-probs), and finally the best `num_draft_tokens - 1` nodes overall are kept.
  2. verify  The target runs root + drafted nodes in ONE forward. Each node sits at position
             n + depth and sees the prefix, its ancestors and itself (a tree attention mask).
  3. accept  Walk from the root: greedy accepts a child equal to the target's argmax; sampling uses
             rejection rules that leave the target's distribution unchanged (see `accept_sample`).
             The target's own token after the last accepted node is the bonus token, the new root.
  4. commit  Keep the target KV rows of root + accepted path (a gather; for a chain just a crop).
             The draft drops the rows it wrote while drafting and re-extends over the committed
             rows with the target's fresh hidden states, so its cache never holds its own guesses.

Draft row convention (the same as train.py's and SGLang's prefill): row p pairs the target features
h_p with the token x_{p+1}, at RoPE position p, and predicts x_{p+2}. `--sglang-positions` shifts
the draft's decode steps one position later: what a reading of SGLang's draft loop suggested. Run
here, SGLang 0.5.23's own EAGLE3 worker matches the default instead, verify round for verify round
(tests/test_sglang_cpu.py); the flag stays as the one-later control. In trees SGLang's draft
attention differs from EAGLE-2's at depth >= 3 (see draft_tree); `--sglang-tree-slots` copies it.

    python speculate.py --draft DIR [--prompt TEXT | --prompts FILE.jsonl] [--steps 3 --topk 1
        --num-draft-tokens 4] [--temperature 0] [--max-new-tokens 256] [--dtype bfloat16] [--check]
"""
import argparse
import functools
import inspect
import json
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from common import UserError, run_main


# ----------------------------------------------------------------------------------------------
# Distributions

def target_probs(logits, temperature, top_p):
    """Softmax with temperature and nucleus (top-p) filtering, in fp32. This processed
    distribution is what plain sampling draws from, so it is what speculation must preserve."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, idx = p.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp >= top_p  # keep the smallest head whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


# A torch.Generator draws only on its own device: speculate.py's is a CPU one (the same stream on
# any device), bench.py's lives on the target's. Probabilities go to the generator, not back.
def sample(p, gen):
    return int(torch.multinomial(p if gen is None else p.to(gen.device), 1, generator=gen))


def uniform(gen):
    """u ~ U[0, 1) from gen, on gen's device."""
    return float(torch.rand((), generator=gen, device=None if gen is None else gen.device))


# ----------------------------------------------------------------------------------------------
# The target side

def target_forward(target, ids, cache, layer_ids, position_ids=None, mask=None, last_only=False):
    """One target forward on top of `cache`. Returns (logits [T, V] fp32, aux [T, 3*Ht]) where aux
    concatenates the outputs of decoder layers `layer_ids` (hidden_states[i + 1]; the last entry
    of hidden_states is final-normed, so layer ids must be < L - 1)."""
    out = target(input_ids=ids, position_ids=position_ids, attention_mask=mask,
                 **{cache_kwarg(target): cache}, use_cache=True,
                 output_hidden_states=layer_ids is not None, logits_to_keep=1 if last_only else 0)
    aux = None
    if layer_ids is not None:
        hs = out.hidden_states
        aux = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)
    return out.logits[0].float(), aux


def cache_kwarg(model):
    """The KV-cache keyword of a transformers model: `cache` since transformers 5.2x,
    `past_key_values` before (5.19, which SGLang 0.5.23 pins, silently drops an unknown `cache=`
    into **kwargs and runs without a cache)."""
    return _cache_kwarg(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls):   # once per model class: inspect.signature is not free in the decode loop
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def new_target_cache(target):
    from transformers import DynamicCache
    return DynamicCache(config=target.config)


def keep_rows(cache, n, rows):
    """Keep cache rows [0, n) plus rows n + r for r in `rows` (root and accepted path)."""
    k = len(rows)
    contiguous = rows == list(range(k))
    idx = None if contiguous else torch.tensor(rows, device=cache.layers[0].keys.device) + n
    for layer in cache.layers:
        if idx is not None:  # a tree path: move the accepted rows down, then crop
            layer.keys[:, :, n:n + k] = layer.keys[:, :, idx]
            layer.values[:, :, n:n + k] = layer.values[:, :, idx]
        layer.keys = layer.keys[:, :, :n + k]
        layer.values = layer.values[:, :, :n + k]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def target_generate(target, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0,
                    stop_ids=(), generator=None):
    """Plain decoding, one target forward per token: the reference output and the baseline speed."""
    device = target.device
    cache = new_target_cache(target)
    ids = torch.tensor([prompt_ids], device=device)
    out, t0 = [], time.perf_counter()
    stop = set(stop_ids)
    while True:
        logits, _ = target_forward(target, ids, cache, None, last_only=True)
        logits = logits[-1]
        tok = int(logits.argmax()) if temperature == 0 else sample(
            target_probs(logits, temperature, top_p), generator)
        out.append(tok)
        if tok in stop or len(out) >= max_new_tokens:
            break
        ids = torch.tensor([[tok]], device=device)
    _sync(device)
    return out, {"new_tokens": len(out), "time": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------
# Speculative decoding

@dataclass
class Tree:
    """Drafted nodes to verify. Row 0 is the root (already chosen, not drafted); rows 1.. are
    drafted nodes with parents before children. A chain is a tree where parent[r] = r - 1."""
    tokens: list             # target token id per row (root included)
    parent: list             # parent row per row (-1 for the root)
    depth: list              # 0 for the root
    score: list              # draft log-prob of the path (sibling order for sampling)
    q: list = None           # chain sampling: the draft distribution each token was drawn from


@dataclass
class Stats:
    rounds: int = 0
    accepted: list = field(default_factory=list)   # accepted drafts per round
    draft_time: float = 0.0
    verify_time: float = 0.0
    time: float = 0.0
    new_tokens: int = 0
    last_emitted: int = 0                          # tokens the final round emitted (<= accepted + 1)

    def summary(self, max_depth):
        r = max(self.rounds, 1)
        pos = [sum(a > i for a in self.accepted) / r for i in range(max_depth)]
        # accept length: SGLang's definition (completion_tokens / spec_verify_ct), README
        return {"rounds": self.rounds, "new_tokens": self.new_tokens,
                "accept_length": self.new_tokens / r,
                "accepted": self.accepted, "last_emitted": self.last_emitted,
                "position_acceptance": pos, "draft_time": self.draft_time,
                "verify_time": self.verify_time, "time": self.time,
                "tokens_per_s": self.new_tokens / max(self.time, 1e-9)}


class Speculator:
    def __init__(self, target, draft, steps=3, topk=1, num_draft_tokens=None, temperature=0.0,
                 top_p=1.0, stop_ids=(), sglang_positions=False, sglang_tree_slots=False):
        check_spec_args(steps, topk, num_draft_tokens, draft.config.draft_vocab_size)
        check_sampling_args(temperature, top_p)
        self.target, self.draft = target, draft
        self.steps, self.topk = steps, topk
        self.num_draft_tokens = num_draft_tokens or default_num_draft_tokens(steps, topk)
        self.temperature, self.top_p = temperature, top_p
        self.stop = set(stop_ids)
        self.layer_ids = draft.config.aux_layer_ids
        self.draft_ids = draft.draft_ids            # [Vd] target id of every draft id
        self.device = target.device
        self.pos_shift = 1 if sglang_positions else 0
        self.sglang_slots = sglang_tree_slots       # SGLang 0.5.23's tree-draft attention, see draft_tree
        # Greedy draws nothing at random; sampling chains draw tokens from the draft distribution.
        self.greedy = temperature == 0

    # ---- the draft side ----

    def draft_extend(self, aux, tokens, n):
        """Draft rows n .. n+T-1: features from the target (fc(aux)) paired with the next tokens.
        Returns logits and h2 of the last row, from which drafting continues."""
        T = len(tokens)
        pos = torch.arange(n, n + T, device=self.device)[None]
        ids = torch.tensor([tokens], device=self.device)
        logits, h = self.draft(ids, self.draft.fuse(aux[None]), pos, self.dcache)
        return logits[0, -1], h[0, -1]

    def draft_chain(self, n, gen):
        """topk = 1: `steps` tokens, each from the previous draft step's output."""
        logits, f = self.last
        toks, qs = [], []
        for i in range(self.num_draft_tokens - 1):
            if self.greedy:
                d, q = int(logits.argmax()), None
            else:
                q = target_probs(logits, self.temperature, self.top_p)
                d = sample(q, gen)
            toks.append(int(self.draft_ids[d]))
            qs.append(q)
            if i == self.num_draft_tokens - 2:
                break
            # the drafted token's row: feature f (this step's h2), token toks[-1], one position on
            pos = torch.tensor([[n + i + self.pos_shift]], device=self.device)
            lg, h = self.draft(torch.tensor([[toks[-1]]], device=self.device), f[None, None],
                               pos, self.dcache)
            logits, f = lg[0, -1], h[0, -1]
        k = len(toks)
        return Tree(tokens=[self.root] + toks, parent=list(range(-1, k)), depth=list(range(k + 1)),
                    score=[0.0] * (k + 1), q=None if self.greedy else qs)

    def draft_tree(self, n):
        """EAGLE-2 dynamic tree. The pool of candidates is built depth by depth, so pool index
        order is depth order and a parent always precedes its children."""
        K, dev = self.topk, self.device
        logits, f = self.last
        top = torch.log_softmax(logits.float(), -1).topk(K)
        scores, toks = [top.values], [top.indices]             # pool, one tensor per depth
        parents, depths = [torch.full((K,), -1, device=dev)], [1]
        front_idx = torch.arange(K, device=dev)                 # pool index of frontier nodes
        front_score, front_tok = top.values, top.indices
        front_feat = f[None].expand(K, -1)
        anc = torch.zeros(K, 0, dtype=torch.bool, device=dev)   # frontier ancestry among tree rows
        base = 0                                                # pool size before this depth
        for depth in range(2, self.steps + 1):
            anc = torch.cat([anc, torch.eye(K, dtype=torch.bool, device=dev)], 1)
            mask = torch.cat([torch.ones(K, n, dtype=torch.bool, device=dev), anc], 1)[None, None]
            pos = torch.full((1, K), n + depth - 2 + self.pos_shift, device=dev)
            lg, h = self.draft(self.draft_ids[front_tok][None], front_feat[None], pos,
                               self.dcache, mask)
            child = torch.log_softmax(lg[0].float(), -1).topk(K)            # [K, K]
            cand_score = (front_score[:, None] + child.values).flatten()
            base += scores[-1].numel()
            scores.append(cand_score)
            toks.append(child.indices.flatten())
            parents.append(front_idx[:, None].expand(K, K).flatten())
            depths.append(depth)
            best = cand_score.topk(K).indices
            front_idx = base + best
            front_score, front_tok = cand_score[best], child.indices.flatten()[best]
            # a kept child continues from the state that predicted it (its parent's row) and sees
            # its parent's ancestry. SGLang 0.5.23 (topk > 1) gathers the state the same way but
            # not the ancestry: frontier slot t's draft attention reads the rows slot t wrote at
            # the earlier depths (intel_amx_backend.py:456, build_draft_decode_metadata: prefix +
            # slot t's own cache slots), whoever its parent is (sgl-project/sglang issue 7523), so
            # its depth >= 3 draft logits differ. --sglang-tree-slots reproduces that.
            front_feat = h[0][best // K]
            anc = anc if self.sglang_slots else anc[best // K]
        score = torch.cat(scores)
        tok = torch.cat(toks)
        parent = torch.cat(parents).tolist()
        depth = [d for d, s in zip(depths, scores) for _ in range(s.numel())]
        # Best N-1 nodes; a stable sort keeps parents (equal or higher score, earlier index) first,
        # so the kept set is closed under "parent of".
        order = torch.sort(score, descending=True, stable=True).indices[:self.num_draft_tokens - 1]
        keep = sorted(order.tolist())
        row_of = {p: r + 1 for r, p in enumerate(keep)}
        tgt_tok = self.draft_ids[tok[keep]].tolist()
        return Tree(tokens=[self.root] + tgt_tok,
                    parent=[-1] + [row_of.get(parent[p], 0) for p in keep],
                    depth=[0] + [depth[p] for p in keep],
                    score=[0.0] + score[keep].tolist())

    # ---- the target side ----

    def verify(self, tree, n):
        T = len(tree.tokens)
        ids = torch.tensor([tree.tokens], device=self.device)
        if self.topk == 1:   # a chain: ordinary causal attention at positions n .. n+T-1
            return target_forward(self.target, ids, self.tcache, self.layer_ids)
        anc = torch.zeros(T, T, dtype=torch.bool)
        for r in range(T):   # each row sees its ancestors and itself
            if tree.parent[r] >= 0:
                anc[r] = anc[tree.parent[r]]
            anc[r, r] = True
        mask = torch.cat([torch.ones(T, n, dtype=torch.bool), anc], 1)[None, None].to(self.device)
        pos = (n + torch.tensor(tree.depth, device=self.device))[None]
        return target_forward(self.target, ids, self.tcache, self.layer_ids, pos, mask)

    def children(self, tree):
        kids = [[] for _ in tree.tokens]
        for r in range(1, len(tree.tokens)):
            kids[tree.parent[r]].append(r)
        for k in kids:  # siblings in the draft's order of preference
            k.sort(key=lambda r: -tree.score[r])
        return kids

    def accept_greedy(self, tree, logits):
        """Follow the child that equals the target's argmax, as long as there is one."""
        best = logits.argmax(-1).tolist()
        kids, path = self.children(tree), [0]
        while True:
            cur = path[-1]
            nxt = next((c for c in kids[cur] if tree.tokens[c] == best[cur]), None)
            if nxt is None:
                return path, best[cur]
            path.append(nxt)

    def accept_sample(self, tree, logits, gen):
        """Lossless sampling.
        Chain with real draft probabilities q (Leviathan et al. 2023): accept x ~ q with
          probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)).
        Tree with top-k children as point masses (SpecInfer-style recursive rejection): try the
          siblings in order, accept x with probability p(x); on rejection set p(x) = 0 and
          renormalise; when every sibling fails, draw from what is left.
        Either way the emitted token is distributed exactly as p."""
        kids, path = self.children(tree), [0]
        while True:
            cur = path[-1]
            p = target_probs(logits[cur], self.temperature, self.top_p)
            if not kids[cur]:
                return path, sample(p, gen)
            if tree.q is not None:   # chain
                c = kids[cur][0]
                x = tree.tokens[c]
                q = torch.zeros_like(p)
                q[self.draft_ids] = tree.q[c - 1]
                if uniform(gen) * q[x] < p[x]:  # u < p/q without dividing
                    path.append(c)
                    continue
                resid = (p - q).clamp_min(0)
                return path, sample(resid / resid.sum() if resid.sum() > 0 else p, gen)
            moved = False
            for c in kids[cur]:
                x = tree.tokens[c]
                if uniform(gen) < p[x]:
                    path.append(c)
                    moved = True
                    break
                p[x] = 0.0
                if p.sum() <= 0:
                    break
                p = p / p.sum()
            if not moved:
                return path, sample(p, gen)

    # ---- the loop ----

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, generator=None):
        dev, st = self.device, Stats()
        t_start = time.perf_counter()
        P = len(prompt_ids)
        if max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {max_new_tokens}: expected >= 1")
        # (a sliding-window draft is run only within its window, where it is full attention)
        window = "" if self.draft.config.sliding_window is None else " / sliding_window"
        for who, limit in (("target", self.target.config.max_position_embeddings),
                           ("draft", self.draft.config.max_context())):
            if P + max_new_tokens + self.steps + 1 > limit:
                raise UserError(f"prompt ({P} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                                f"the {who}'s max_position_embeddings{window * (who == 'draft')} "
                                f"{limit}")
        self.tcache = new_target_cache(self.target)
        self.dcache = self.draft.new_cache(capacity=P + max_new_tokens + self.num_draft_tokens * 2)
        # Prefill: the target's first token and its features for every prompt position.
        logits, aux = target_forward(self.target, torch.tensor([prompt_ids], device=dev),
                                     self.tcache, self.layer_ids)
        self.root = int(logits[-1].argmax()) if self.greedy else sample(
            target_probs(logits[-1], self.temperature, self.top_p), generator)
        out = [self.root]
        n = P                                       # rows committed to both caches
        if self.root not in self.stop and max_new_tokens > 1:
            # draft prefill: row p = (h_p, x_{p+1}); the last row pairs h_{P-1} with the root
            self.last = self.draft_extend(aux, list(prompt_ids[1:]) + [self.root], 0)
        while out[-1] not in self.stop and len(out) < max_new_tokens:
            t0 = time.perf_counter()
            tree = self.draft_chain(n, generator) if self.topk == 1 else self.draft_tree(n)
            self.dcache.len = n                     # forget the draft's own speculative rows
            _sync(dev)
            t1 = time.perf_counter()
            logits, aux = self.verify(tree, n)
            path, bonus = (self.accept_greedy(tree, logits) if self.greedy
                           else self.accept_sample(tree, logits, generator))
            keep_rows(self.tcache, n, path)
            new = [tree.tokens[r] for r in path[1:]] + [bonus]
            st.rounds += 1
            st.accepted.append(len(path) - 1)
            st.last_emitted = 0
            for tok in new:                         # never emit past a stop token or the limit
                out.append(tok)
                st.last_emitted += 1
                if tok in self.stop or len(out) >= max_new_tokens:
                    break
            _sync(dev)
            t2 = time.perf_counter()
            if out[-1] not in self.stop and len(out) < max_new_tokens:
                self.root = bonus
                self.last = self.draft_extend(aux[path], new, n)
            n += len(path)
            _sync(dev)
            st.verify_time += t2 - t1
            st.draft_time += time.perf_counter() - t2 + t1 - t0
        st.time = time.perf_counter() - t_start
        st.new_tokens = len(out)
        return out, st.summary(self.steps)


def default_num_draft_tokens(steps, topk):
    return steps + 1 if topk == 1 else min(steps * topk, tree_capacity(steps, topk)) + 1


def tree_capacity(steps, topk):
    """Candidates an EAGLE-2 tree can offer: topk at depth 1, topk^2 at each later depth."""
    return topk + (steps - 1) * topk * topk


def check_sampling_args(temperature, top_p):
    if not temperature >= 0 or not math.isfinite(temperature):
        raise UserError(f"--temperature {temperature}: expected >= 0")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p {top_p}: expected in (0, 1]")


def check_spec_args(steps, topk, num_draft_tokens, draft_vocab_size):
    if steps < 1:
        raise UserError(f"--steps {steps}: expected >= 1")
    if not 1 <= topk <= draft_vocab_size:
        raise UserError(f"--topk {topk}: expected 1..{draft_vocab_size} (the draft vocabulary)")
    if num_draft_tokens is None:
        return
    if topk == 1 and num_draft_tokens != steps + 1:
        raise UserError(f"--num-draft-tokens {num_draft_tokens}: a chain of {steps} steps "
                        f"verifies exactly {steps + 1} tokens (root included)")
    cap = tree_capacity(steps, topk) + 1
    if not 2 <= num_draft_tokens <= cap:
        raise UserError(f"--num-draft-tokens {num_draft_tokens}: a tree of {steps} steps x topk "
                        f"{topk} holds 2..{cap} tokens (root included)")


@torch.inference_mode()
def divergence(target, prompt_ids, ref, out):
    """Where two greedy outputs first differ, and how close the target's call was there: the gap
    between its logits for the two tokens, from one fresh forward over the common prefix. A gap
    near the dtype's rounding (bf16 keeps ~3 significant digits) is a near-tie, not a bug."""
    i = next(k for k in range(min(len(ref), len(out)) + 1)
             if k == len(ref) or k == len(out) or ref[k] != out[k])
    if i == len(ref) or i == len(out):
        return i, float("nan")
    ids = torch.tensor([list(prompt_ids) + ref[:i]], device=target.device)
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    return i, float(logits[ref[i]] - logits[out[i]])


# ----------------------------------------------------------------------------------------------
# CLI

DEFAULT_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in three sentences.",
    "Give me three tips for learning to cook.",
    "What causes the seasons on Earth?",
]


def parse_args():
    """The command line, checked: (args, dtype, why). A bad value is a one-line UserError."""
    ap = argparse.ArgumentParser(description="EAGLE-3 draft-verify decoding in plain PyTorch.")
    ap.add_argument("--draft", required=True, help="draft directory (config.json + model.safetensors)")
    ap.add_argument("--target", default="default", help="target model ('default' = SmolLM2-135M)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run Python code shipped with the target (e.g. Kimi-K2's model and tokenizer)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompts", help="JSONL of prompts / messages / ShareGPT conversations")
    ap.add_argument("--steps", type=int, default=3, help="draft depth (SGLang num_steps)")
    ap.add_argument("--topk", type=int, default=1, help="branching per step; 1 = chain")
    ap.add_argument("--num-draft-tokens", type=int, default=None,
                    help="tokens verified per round, root included (chain: steps + 1)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto",
                    help="auto (bf16 where the device computes it natively, else fp32; fp32 with "
                         "--check) | float32 | bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (on a busy machine, 1 per concurrent process)")
    ap.add_argument("--sglang-positions", action="store_true",
                    help="draft decode steps one position later (a control: SGLang 0.5.23's "
                         "EAGLE3 worker matches the default positions, tests/test_sglang_cpu.py)")
    ap.add_argument("--sglang-tree-slots", action="store_true",
                    help="topk > 1: each frontier slot's draft attention reads its own slot's "
                         "earlier rows, not its parent's, as SGLang 0.5.23's draft decode does")
    ap.add_argument("--check", action="store_true",
                    help="also decode with the target alone; exit 1 if any greedy output differs")
    ap.add_argument("--json", help="write per-prompt tokens and stats here")
    ap.add_argument("--quiet", action="store_true", help="do not print the responses")
    args = ap.parse_args()
    if args.temperature < 0 or not math.isfinite(args.temperature):
        raise UserError(f"--temperature {args.temperature}: expected >= 0")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: expected in (0, 1]")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: expected >= 1")
    if args.check and args.temperature != 0:
        raise UserError("--check compares greedy outputs: use it with --temperature 0")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: expected >= 1")
    if args.sglang_tree_slots and args.topk == 1:
        raise UserError("--sglang-tree-slots: changes tree drafting only (--topk > 1); "
                        "a chain (--topk 1) has one slot")
    if args.check and args.dtype == "auto":  # the proof is exact in fp32 only (see divergence)
        dtype, why = torch.float32, "auto: float32 (--check proves losslessness in float32)"
    else:
        from common import resolve_dtype
        dtype, why = resolve_dtype(args.dtype, args.device)
    args.dtype = str(dtype).replace("torch.", "")
    return args, dtype, why


def decode_prompt(spec, tok, msgs, args, gen):
    """One prompt: speculative decoding, and with --check the target's own greedy decoding of it
    (the reference the output must equal token for token)."""
    from common import chat_prompt_ids
    ids = chat_prompt_ids(tok, msgs)
    out, s = spec.generate(ids, args.max_new_tokens, gen)
    rec = {"prompt": msgs[-1]["content"], "tokens": out, "text": tok.decode(out), **s}
    if args.check:
        ref, rs = target_generate(spec.target, ids, args.max_new_tokens, stop_ids=spec.stop)
        rec.update(plain_tokens_per_s=rs["new_tokens"] / rs["time"], matches_target=ref == out)
        if ref != out:
            rec["first_divergence"], rec["target_logit_gap"] = divergence(spec.target, ids, ref, out)
    return rec


def progress_line(i, n, rec, check):
    line = (f"[{i + 1}/{n}] {rec['new_tokens']} tokens, accept length "
            f"{rec['accept_length']:.2f}, {rec['tokens_per_s']:.1f} tok/s")
    if check:
        line += (f" (plain {rec['plain_tokens_per_s']:.1f} tok/s, "
                 f"{'identical' if rec['matches_target'] else 'DIFFERENT'})")
        if not rec["matches_target"]:
            line += (f": first at token {rec['first_divergence']}, where the target's own "
                     f"logits for the two tokens differ by {rec['target_logit_gap']:.3f}")
    return line


def summarize(records, args, spec):
    """Pooled over prompts. Accept length = all generated tokens / all verify rounds (SGLang's and
    SpecForge's figure); the mean of the per-prompt ratios is reported beside it under its own name."""
    tot_tokens = sum(r["new_tokens"] for r in records)
    tot_rounds = sum(r["rounds"] for r in records)
    tot_time = sum(r["time"] for r in records)
    summary = {"prompts": len(records), "new_tokens": tot_tokens, "rounds": tot_rounds,
               "accept_length": tot_tokens / max(tot_rounds, 1),
               "per_prompt_mean_accept_length":
                   sum(r["accept_length"] for r in records) / max(len(records), 1),
               "tokens_per_s": tot_tokens / max(tot_time, 1e-9),
               "draft_time": sum(r["draft_time"] for r in records),
               "verify_time": sum(r["verify_time"] for r in records),
               "steps": args.steps, "topk": args.topk,
               "num_draft_tokens": spec.num_draft_tokens, "dtype": args.dtype}
    summary["position_acceptance"] = [
        sum(r["position_acceptance"][j] * r["rounds"] for r in records) / max(tot_rounds, 1)
        for j in range(args.steps)]
    if args.check:
        mismatches = sum(not r["matches_target"] for r in records)
        plain = tot_tokens / sum(r["new_tokens"] / r["plain_tokens_per_s"] for r in records)
        summary.update(mismatches=mismatches, plain_tokens_per_s=plain)
    return summary


def report(summary, check):
    s = summary
    print(f"\naccept length {s['accept_length']:.3f} ({s['new_tokens']} tokens / {s['rounds']} "
          f"verify rounds; per-prompt mean accept length {s['per_prompt_mean_accept_length']:.3f}); "
          f"per-position acceptance {' '.join(f'{a:.2f}' for a in s['position_acceptance'])}; "
          f"{s['tokens_per_s']:.1f} tok/s (draft {s['draft_time']:.1f}s, verify {s['verify_time']:.1f}s)")
    if check:
        print(f"check: {s['prompts'] - s['mismatches']}/{s['prompts']} outputs identical to the "
              f"target's greedy decoding; plain {s['plain_tokens_per_s']:.1f} tok/s, "
              f"speedup {s['tokens_per_s'] / s['plain_tokens_per_s']:.2f}x")


def main():
    from common import (atomic_write_text, load_target, machine_summary, pack_linears, read_prompts,
                        stop_token_ids)
    from draft_config import read_config
    from model import load_draft_for
    args, dtype, why = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"dtype {why}; machine: {machine_summary()}", file=sys.stderr)
    check_spec_args(args.steps, args.topk, args.num_draft_tokens, read_config(args.draft).draft_vocab_size)
    prompts = (read_prompts(args.prompts) if args.prompts else
               [[{"role": "user", "content": p}] for p in
                ([args.prompt] if args.prompt is not None else DEFAULT_PROMPTS)])
    target, tok = load_target(args.target, dtype, args.device, args.trust_remote_code)
    draft = pack_linears(load_draft_for(args.draft, target, dtype))  # CPU: faster small matmuls
    pack_linears(target)
    spec = Speculator(target, draft, args.steps, args.topk, args.num_draft_tokens, args.temperature,
                      args.top_p, stop_token_ids(tok, target.config), args.sglang_positions,
                      args.sglang_tree_slots)
    gen = torch.Generator().manual_seed(args.seed)
    records = []
    for i, msgs in enumerate(prompts):
        records.append(decode_prompt(spec, tok, msgs, args, gen))
        if not args.quiet:
            print(f"\n### {records[-1]['prompt'][:200]}\n{records[-1]['text']}")
        print(progress_line(i, len(prompts), records[-1], args.check), file=sys.stderr)
    summary = summarize(records, args, spec)
    report(summary, args.check)
    if args.json:
        atomic_write_text(args.json, json.dumps({"summary": summary, "records": records}, indent=1))
    if args.check and summary["mismatches"]:
        if dtype != torch.float32:
            print(f"note: in {args.dtype}, verifying several tokens in one forward rounds differently "
                  f"from one-token decoding and can flip near-tied tokens; losslessness is exact "
                  f"in float32 (--dtype float32)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
