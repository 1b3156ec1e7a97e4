"""The test-only pure-torch sgl_kernel CPU ops (tests/sglang_cpu_spec_shims/sgl_kernel/ops.py),
each against an independent reference: the draft tree against speculate.py's own EAGLE-2 tree
built from the same draft outputs, greedy verification against speculate.py's accept_greedy,
attention against torch's scaled_dot_product_attention, cache bookkeeping against element-by-element
loops. They need only torch, so they run in the default suite and in the SGLang CPU environment
(the file name matches `-k sglang`). No SGLang import: ops.py is loaded by path, not as `sgl_kernel`,
so this process never registers the stand-in's torch ops (the SGLang tests run SGLang in
subprocesses that do)."""
import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT

SPEC_SHIMS = os.path.join(ROOT, "tests", "sglang_cpu_spec_shims")
_spec = importlib.util.spec_from_file_location(
    "sglang_cpu_spec_ops", os.path.join(SPEC_SHIMS, "sgl_kernel", "ops.py"))
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)

QLEN_ONLY = 1   # sglang TreeMaskMode.QLEN_ONLY, the CPU mode (speculative/eagle_utils.py)


# ----------------------------------------------------------------------------------------------
# The draft tree: SGLang's draft loop and speculate.py's draft_tree on one stub draft

class StubDraft:
    """A deterministic stand-in for the draft network with speculate.py's call signature:
    logits and next feature depend on the input token and the incoming feature, so which path a
    node lies on matters (ties have probability zero)."""

    def __init__(self, vocab=40, draft_vocab=24, hidden=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(vocab, hidden, generator=g)
        self.out = torch.randn(hidden, draft_vocab, generator=g) * 3
        self.draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab]   # draft id -> target id
        self.config = SimpleNamespace(draft_vocab_size=draft_vocab, aux_layer_ids=[0])

    def step(self, ids, feat):
        """ids [K] target token ids, feat [K, H] -> logits [K, Vd], next feature [K, H]."""
        h = torch.tanh(feat + self.emb[ids])
        return h @ self.out, h

    def __call__(self, ids, feat, pos, cache, mask=None):   # speculate.py's draft(...) call
        lg, h = self.step(ids[0], feat[0])
        return lg[None], h[None]


def speculate_tree(stub, last_logits, last_feat, root, steps, topk, n_draft):
    from speculate import Speculator
    target = SimpleNamespace(device=torch.device("cpu"))
    spec = Speculator(target, stub, steps, topk, n_draft)
    spec.last, spec.root, spec.dcache = (last_logits, last_feat), root, None   # the stub has no cache
    return spec.draft_tree(n=5) if topk > 1 else spec.draft_chain(n=5, gen=None)


def sglang_draft_loop(stub, last_logits, last_feat, steps, topk, n_draft):
    """SGLang 0.5.23's draft side for one request, as its CPU path runs it: eagle_worker_v2.py
    draft_forward (topk_p/topk_index from the softmax, hot_token_id mapping), spec_utils.py
    _select_top_k_tokens_first/_later, eagle_utils.py organize_draft_results; for topk 1 the
    chain shortcut's constant parent_list / top_scores_index (base_spec_worker.py:141-149).
    Returns (parent_list [1, P], top_scores_index [1, N-1], draft_tokens [1, N-1])."""
    hot = stub.draft_ids
    if topk == 1:
        toks, logits, h = [], last_logits[None], last_feat[None]
        for i in range(steps):
            toks.append(hot[logits.argmax(-1)])
            if i < steps - 1:
                logits, h = stub.step(toks[-1], h)
        parent = torch.arange(-1, steps - 1)[None] if steps > 1 else torch.empty(1, 0).long()
        return parent, torch.arange(steps)[None], torch.stack(toks, 1)
    topk_p, topk_index = torch.softmax(last_logits, -1)[None].topk(topk)
    topk_index = hot[topk_index]
    hidden, scores = last_feat[None], None
    score_list, token_list, parents_list = [], [], []
    for i in range(steps):
        if i == 0:
            input_ids = topk_index.flatten()
            hidden = hidden.repeat_interleave(topk, dim=0)
            scores = topk_p
            info = (topk_p[:, None], topk_index, torch.arange(-1, topk)[None])
        else:
            expand = scores[:, :, None] * topk_p.view(-1, topk, topk)
            cs_p, cs_index = expand.flatten(1).topk(topk)
            flat_index = topk_index.view(-1, topk * topk)
            input_ids = torch.gather(flat_index, 1, cs_index).flatten()
            hidden = hidden[cs_index.flatten() // topk]
            scores = cs_p
            info = (expand, flat_index, cs_index + topk * topk * (i - 1) + topk)
        for lst, x in zip((score_list, token_list, parents_list), info):
            lst.append(x)
        if i == steps - 1:
            break
        logits, hidden = stub.step(input_ids, hidden)
        topk_p, topk_index = torch.softmax(logits, -1).topk(topk)
        topk_index = hot[topk_index]
    score = torch.cat(score_list, 1).flatten(1)
    top = torch.sort(score.topk(n_draft - 1, dim=-1).indices).values
    draft_tokens = torch.gather(torch.cat(token_list, 1), 1, top)
    return torch.cat(parents_list[:-1], 1), top, draft_tokens


def build_tree(parent_list, top, seq_lens, topk, steps, n):
    bs = seq_lens.numel()
    mask = torch.full((bs * n * n,), True)
    positions = torch.empty(bs * n, dtype=torch.long)
    ri, nt, ns = torch.full((3, bs, n), -1, dtype=torch.long)
    ops.build_tree_kernel_efficient(parent_list, top, seq_lens, mask, positions, ri, nt, ns, topk,
                                    steps, n, QLEN_ONLY)
    return mask.view(bs, n, n), positions.view(bs, n), ri, nt, ns


def parents_from_links(nt, ns):
    """Parent of every node, read back from the first-child / next-sibling links."""
    parent = [-1] * len(nt)
    for p in range(len(nt)):
        c = int(nt[p])
        while c != -1:
            parent[c] = p
            c = int(ns[c])
    return parent


@pytest.mark.parametrize("steps,topk,n_draft", [(3, 1, 4), (3, 4, 8), (4, 3, 10), (2, 2, 3)])
def test_sglang_tree_stand_in_equals_speculate_tree(steps, topk, n_draft):
    for seed in range(5):
        stub = StubDraft(seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        last_logits, last_feat = torch.randn(24, generator=g) * 3, torch.randn(8, generator=g)
        root, seq_len = 7, 11
        ref = speculate_tree(stub, last_logits, last_feat, root, steps, topk, n_draft)
        parent_list, top, draft_tokens = sglang_draft_loop(stub, last_logits, last_feat, steps,
                                                           topk, n_draft)
        mask, pos, ri, nt, ns = build_tree(parent_list, top, torch.tensor([seq_len]), topk,
                                           steps, n_draft)
        assert [root] + draft_tokens[0].tolist() == ref.tokens
        assert parents_from_links(nt[0], ns[0]) == ref.parent
        assert (pos[0] - seq_len).tolist() == ref.depth
        assert ri[0].tolist() == list(range(n_draft))
        for i in range(n_draft):   # row i: the root, i's ancestors and i itself
            anc, j = {0}, i
            while j > 0:
                anc.add(j)
                j = ref.parent[j]
            assert mask[0, i].tolist() == [c in anc for c in range(n_draft)]


def test_sglang_tree_stand_in_batched_offsets():
    """Two requests in one call: request b's retrive_index starts at b*n, its mask block and
    positions use its own seq_len, and its links stay within its own row."""
    trees = []
    for seed in (1, 2):
        stub = StubDraft(seed=seed)
        g = torch.Generator().manual_seed(seed)
        trees.append(sglang_draft_loop(stub, torch.randn(24, generator=g) * 3,
                                       torch.randn(8, generator=g), 3, 4, 8))
    par, top = torch.cat([t[0] for t in trees]), torch.cat([t[1] for t in trees])
    mask, pos, ri, nt, ns = build_tree(par, top, torch.tensor([5, 9]), 4, 3, 8)
    for b, (p, t, _) in enumerate(trees):
        m1, pos1, ri1, nt1, ns1 = build_tree(p, t, torch.tensor([[5, 9][b]]), 4, 3, 8)
        assert torch.equal(mask[b], m1[0]) and torch.equal(pos[b], pos1[0])
        assert torch.equal(nt[b], nt1[0]) and torch.equal(ns[b], ns1[0])
        assert ri[b].tolist() == list(range(8 * b, 8 * b + 8))


@pytest.mark.parametrize("steps,topk,n_draft", [(3, 1, 4), (3, 4, 8)])
def test_sglang_verify_greedy_stand_in_equals_speculate_accept(steps, topk, n_draft):
    from speculate import Speculator
    spec = Speculator(SimpleNamespace(device=torch.device("cpu")), StubDraft(), steps, topk, n_draft)
    for seed in range(20):
        stub = StubDraft(seed=seed)
        g = torch.Generator().manual_seed(seed)
        last_logits, last_feat = torch.randn(24, generator=g) * 3, torch.randn(8, generator=g)
        ref = speculate_tree(stub, last_logits, last_feat, 7, steps, topk, n_draft)
        # the SGLang side's tree of the same draft outputs (equal to ref: the test above)
        par, top, _ = sglang_draft_loop(stub, last_logits, last_feat, steps, topk, n_draft)
        _, _, ri, nt, ns = build_tree(par, top, torch.tensor([3]), topk, steps, n_draft)
        # the target's argmax after every node: along a random path it agrees with the draft
        # for a random number of steps, elsewhere it is random
        target_predict = torch.randint(0, 40, (n_draft,), generator=g)
        node, kids = 0, spec.children(ref)
        for _ in range(int(torch.randint(0, steps + 1, (), generator=g))):
            if not kids[node]:
                break
            child = kids[node][int(torch.randint(len(kids[node]), (), generator=g))]
            target_predict[node] = ref.tokens[child]
            node = child
        logits = F.one_hot(target_predict, 40).float()
        path, bonus = spec.accept_greedy(ref, logits)
        predicts = torch.zeros(n_draft, dtype=torch.int32)
        accept_index = torch.full((1, steps + 1), -1, dtype=torch.int32)
        accept_num = torch.empty(1, dtype=torch.int32)
        ops.verify_tree_greedy(predicts=predicts, accept_index=accept_index,
                               accept_token_num=accept_num,
                               candidates=torch.tensor([ref.tokens]), retrive_index=ri,
                               retrive_next_token=nt, retrive_next_sibling=ns,
                               target_predict=target_predict[None])
        assert accept_index[0].tolist() == path + [-1] * (steps + 1 - len(path))
        assert int(accept_num[0]) == len(path) - 1
        emitted = [ref.tokens[r] for r in path[1:]] + [bonus]
        assert [int(predicts[r]) for r in path] == emitted


# ----------------------------------------------------------------------------------------------
# Attention: extend (prefill / verify / draft extend) and decode against SDPA

def paged_cache(g, slots=64, hkv=2, d=8):
    k = torch.randn(slots, hkv, d, generator=g)
    v = torch.randn(slots, hkv, d, generator=g)
    return k, v


def sdpa(q, k, v, mask, scale):
    """Reference: q [T, Hq, D], k/v [S, Hkv, D] in logical order, mask [T, S] (True = visible)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("tree", [False, True])
def test_sglang_extend_attention_stand_in_equals_sdpa(tree):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 4, 2, 8
    k_buf, v_buf = paged_cache(g, hkv=hkv, d=d)
    slots = torch.randperm(64, generator=g)          # scattered cache slots
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 0])
    pre, ext = [5, 9], [4, 4]                        # cached prefix, new tokens
    used = 0
    for r, n in zip(req_pool_indices.tolist(), [p + e for p, e in zip(pre, ext)]):
        req_to_token[r, :n] = slots[used:used + n].int()
        used += n
    T = sum(ext)
    q = torch.randn(T, hq, d, generator=g)
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)
    tree_mask = None
    if tree:   # a QLEN_ONLY tree mask per request: root, ancestors, self
        blocks = [torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]),
                  torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]])]
        tree_mask = torch.stack(blocks).bool().flatten()
    o = torch.empty_like(q)
    scale = d ** -0.5
    ops.extend_attention(q, k, v, o, k_buf, v_buf, 1.0, 1.0, req_to_token, req_pool_indices,
                         torch.tensor([p + e for p, e in zip(pre, ext)]), torch.tensor(ext),
                         torch.tensor([0, ext[0]]), max(ext), scale, 0.0, False, 0, None, None,
                         tree_mask, True)
    start = 0
    for b, (r, p, e) in enumerate(zip(req_pool_indices.tolist(), pre, ext)):
        locs = req_to_token[r, :p].long()
        keys = torch.cat([k_buf[locs], k[start:start + e]])
        vals = torch.cat([v_buf[locs], v[start:start + e]])
        block = tree_mask.view(2, 4, 4)[b] if tree else torch.ones(e, e, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(e, p, dtype=torch.bool), block], 1)
        ref = sdpa(q[start:start + e], keys, vals, mask, scale)
        torch.testing.assert_close(o[start:start + e], ref, atol=1e-5, rtol=1e-5)
        start += e


def test_sglang_decode_attention_stand_in_writes_cache_and_equals_sdpa():
    g = torch.Generator().manual_seed(1)
    hq, hkv, d = 6, 3, 8
    k_buf, v_buf = paged_cache(g, hkv=hkv, d=d)
    k0, v0 = k_buf.clone(), v_buf.clone()
    req_to_token = torch.randperm(64, generator=g)[:48].int().view(3, 16)
    req_pool_indices, seq_lens = torch.tensor([1, 2]), torch.tensor([7, 12])
    loc = torch.stack([req_to_token[1, 6], req_to_token[2, 11]]).long()  # each request's newest slot
    q = torch.randn(2, hq, d, generator=g)
    k_new, v_new = torch.randn(2, hkv, d, generator=g), torch.randn(2, hkv, d, generator=g)
    out = torch.empty_like(q)
    ops.decode_attention(q, k_buf, v_buf, 1.0, 1.0, out, k_new, v_new, loc,
                         torch.zeros(2, hq, 8, d + 1), req_to_token, req_pool_indices, seq_lens,
                         0.3, 0.0, False, 0, None, None)
    k0[loc], v0[loc] = k_new, v_new                  # the kernel writes the new rows itself
    assert torch.equal(k_buf, k0) and torch.equal(v_buf, v0)
    for b, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        locs = req_to_token[r, :n].long()
        ref = sdpa(q[b:b + 1], k0[locs], v0[locs], torch.ones(1, n, dtype=torch.bool), 0.3)
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Cache bookkeeping against element-by-element loops

def test_sglang_req_to_token_and_extend_locs_stand_ins():
    g = torch.Generator().manual_seed(2)
    rpi, start, end = torch.tensor([3, 0, 2]), torch.tensor([4, 0, 7]), torch.tensor([6, 5, 10])
    out_cache_loc = torch.randint(0, 1000, (10,), generator=g)
    table = torch.full((4, 16), -1, dtype=torch.int32)
    ops.assign_req_to_token_pool(rpi, table, start, end, out_cache_loc, 16)
    ref, j = torch.full((4, 16), -1, dtype=torch.int32), 0
    for i in range(3):
        for pos in range(int(start[i]), int(end[i])):
            ref[rpi[i], pos] = out_cache_loc[j]
            j += 1
    assert torch.equal(table, ref)
    back = torch.empty(10, dtype=torch.int64)         # the inverse gather reads the same slots back
    ops.assign_extend_cache_locs(rpi, table, start, end, back, 16)
    assert torch.equal(back, out_cache_loc)


def test_sglang_draft_cache_locs_and_metadata_stand_ins():
    topk, steps, pool_len = 2, 3, 24
    table = torch.arange(3 * pool_len, dtype=torch.int32).view(3, pool_len) * 7
    rpi, seq = torch.tensor([2, 0]), torch.tensor([5, 9])
    out = torch.empty(2 * topk * steps, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous(rpi, table, seq, out, pool_len, topk, steps)
    ref = [int(table[rpi[i], seq[i] + c]) for i in range(2) for c in range(topk * steps)]
    assert out.tolist() == ref
    meta = ops.build_draft_decode_metadata(table, rpi, seq, topk, steps, pool_len)
    assert meta.shape == (2 * topk, pool_len) and meta.dtype == table.dtype
    for b in range(2):
        for t in range(topk):
            row, r, s = meta[b * topk + t], int(rpi[b]), int(seq[b])
            for c in range(s):                        # the committed prefix
                assert row[c] == table[r, c]
            for j in range(steps):                    # branch t's own draft slots
                assert row[s + j] == table[r, s + t * steps + j]


def test_sglang_bonus_and_accept_loc_stand_ins():
    accept_tokens = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]])
    accept_lens = torch.tensor([1, 4, 2])
    bonus = torch.empty(3, dtype=torch.int64)
    ops.fill_bonus_tokens(accept_tokens, accept_lens, bonus, 4)
    assert bonus.tolist() == [11, 24, 32]
    accept_index = torch.tensor([[0, -1, -1], [4, 5, 7], [8, 10, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 112)
    out = torch.full((9,), -7, dtype=torch.int64)
    ops.fill_accept_out_cache_loc(accept_index, out_cache_loc, out)   # SGLang's 3-argument call
    assert out.tolist() == [100, 104, 105, 107, 108, 110, -7, -7, -7]


def test_sglang_copy_kv_cache_stand_in_moves_raw_slots():
    g = torch.Generator().manual_seed(3)
    bufs = [torch.randn(10, 2, 4, generator=g), torch.randn(10, 3, generator=g).double()]
    ref = [b.clone() for b in bufs]
    src, tgt = torch.tensor([1, 2, 8]), torch.tensor([2, 5, 0])   # 2 is read before it is written
    for r in ref:
        r[tgt] = r[src].clone()
    ops.copy_all_layer_kv_cache(torch.tensor([b.data_ptr() for b in bufs]),
                                torch.tensor([b.stride(0) * b.element_size() for b in bufs]),
                                tgt, src)
    assert all(torch.equal(b, r) for b, r in zip(bufs, ref))


# ----------------------------------------------------------------------------------------------
# The package: dispatcher registration and the names-only fallbacks

def test_sglang_spec_stand_in_package_registers_the_attention_ops():
    code = (
        "import torch, sgl_kernel\n"
        "assert not hasattr(torch.ops.sgl_kernel, 'convert_weight_packed')\n"
        "from sgl_kernel import verify_tree_greedy_cpu, rotate_input_ids_cpu\n"
        "q = torch.randn(1, 2, 4); kb = torch.zeros(4, 1, 4); vb = torch.zeros(4, 1, 4)\n"
        "o = torch.empty_like(q); rt = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)\n"
        "k = torch.randn(1, 1, 4); v = torch.randn(1, 1, 4)\n"
        "torch.ops.sgl_kernel.decode_attention_cpu(q, kb, vb, 1.0, 1.0, o, k, v,\n"
        "    torch.tensor([2]), torch.zeros(1, 2, 8, 5), rt, torch.tensor([0]), torch.tensor([1]),\n"
        "    0.5, 0.0, False, 0, None, None)\n"
        "assert torch.equal(kb[2], k[0]) and torch.allclose(o[0], v[0].expand(2, 4))\n"
        "try:\n"
        "    rotate_input_ids_cpu()\n"
        "except RuntimeError as e:\n"
        "    assert 'does not have' in str(e)\n"
        "else:\n"
        "    raise SystemExit('a missing kernel did not raise')\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=SPEC_SHIMS, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
