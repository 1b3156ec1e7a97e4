"""Pure-torch versions of the eleven sgl_kernel CPU ops SGLang 0.5.23's EAGLE path calls on a CPU
through the `intel_amx` attention backend (../README.md). Test-only: slow Python loops that follow
the semantics of sgl-kernel's `csrc/cpu/spec.cpp`, `extend.cpp` and `decode.cpp` (and their CUDA /
Triton twins), written for readability and checked against independent references in
tests/test_sglang_spec_kernels.py. No SGLang code is replaced; this file imports nothing from SGLang.

Conventions SGLang uses at every call site:
  req_to_token   [max_reqs, pool_len] int32: KV-cache slot of each request's token positions
  out_cache_loc  slots handed out this step, packed request after request
  "offset"       request i's block in a packed tensor starts at the exclusive prefix sum of the
                 lengths (end - start) of requests 0..i-1
"""
import ctypes

import torch


def _offsets(lengths):
    """Exclusive prefix sum: where each request's block starts in a packed tensor."""
    out, run = [], 0
    for n in lengths:
        out.append(run)
        run += n
    return out


# ----------------------------------------------------------------------------------------------
# Cache bookkeeping

def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                             out_cache_loc, pool_len=None):
    """req_to_token[rpi[i], start[i]:end[i]] = the i-th block of out_cache_loc."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    for i, (r, s, e, off) in enumerate(zip(req_pool_indices.tolist(), starts, ends,
                                           _offsets([e - s for s, e in zip(starts, ends)]))):
        req_to_token[r, s:e] = out_cache_loc[off:off + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset,
                             out_cache_loc, pool_len=None):
    """The inverse gather: the i-th block of out_cache_loc = req_to_token[rpi[i], start:end]."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    for r, s, e, off in zip(req_pool_indices.tolist(), starts, ends,
                            _offsets([e - s for s, e in zip(starts, ends)])):
        out_cache_loc[off:off + e - s] = req_to_token[r, s:e].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                       pool_len, topk, num_cols):
    """Each request's topk * num_cols draft slots, which follow its committed tokens."""
    n = topk * num_cols
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[r, s:s + n].to(out_cache_loc.dtype)


def build_draft_decode_metadata(req_to_token, req_pool_indices, seq_lens, topk, num_steps,
                                pool_len):
    """A req_to_token table for the draft's decode steps, one row per (request b, branch t), row
    b*topk + t: the request's committed prefix [:seq_len], then branch t's `num_steps` slots,
    which sit at seq_len + t*num_steps .. (the layout assign_draft_cache_locs_contiguous hands
    out). Step j of the draft loop reads the first seq_len + j + 1 entries of each row."""
    bs = req_pool_indices.numel()
    out = torch.zeros(bs * topk, pool_len, dtype=req_to_token.dtype, device=req_to_token.device)
    for b, (r, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for t in range(topk):
            row = out[b * topk + t]
            row[:sl] = req_to_token[r, :sl]
            row[sl:sl + num_steps] = req_to_token[r, sl + t * num_steps:sl + (t + 1) * num_steps]
    return out


def fill_bonus_tokens(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus[i] = request i's last accepted token (accept_lens counts the bonus token itself)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def fill_accept_out_cache_loc(accept_index, out_cache_loc, accept_out_cache_loc, size=None):
    """The slots of the accepted tokens (accept_index entries > -1, in order), packed at the front
    of accept_out_cache_loc. SGLang's CPU branch passes three arguments, the Triton one four."""
    idx = accept_index.reshape(-1)
    idx = idx[idx > -1].long()
    accept_out_cache_loc[:idx.numel()] = out_cache_loc[idx].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc, src_loc):
    """Per KV buffer i (base address data_ptrs[i], strides[i] bytes per slot), copy slot src[j]
    to slot tgt[j] for all j. The kernel takes raw addresses, so this copies bytes through
    ctypes. All sources are read before any target is written, as the parallel kernel does."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


# ----------------------------------------------------------------------------------------------
# The draft tree and its greedy verification

def build_tree_kernel_efficient(parent_list, selected_index, verified_seq_len, tree_mask,
                                positions, retrive_index, retrive_next_token,
                                retrive_next_sibling, topk, depth, draft_token_num,
                                tree_mask_mode):
    """Turn the draft loop's output into the tree the target verifies, per request b with
    n = draft_token_num nodes (node 0 = the root, the last verified token; node i >= 1 = the
    i-th selected candidate, `selected_index` sorted ascending, so parents come first):
      parent of node i: the root when sel[i-1] // topk == 0 (a depth-1 candidate), else the node
        whose candidate index equals parent_list[b, sel[i-1] // topk];
      retrive_index[b] = b*n + arange(n); children linked by head insertion from i = n-1 down to
        1, so retrive_next_token[p] is p's lowest-numbered child and retrive_next_sibling runs up;
      tree_mask (QLEN_ONLY, the CPU mode: [bs, n, n] flattened) row i = the root, i's ancestors
        and i itself; positions = seq_len + depth."""
    if tree_mask_mode != 1:
        raise NotImplementedError(f"tree_mask_mode {tree_mask_mode}: the CPU path uses QLEN_ONLY (1)")
    n = draft_token_num
    mask = tree_mask.view(-1, n, n)
    for b, sl in enumerate(verified_seq_len.tolist()):
        sel = selected_index[b].tolist()
        plist = parent_list[b].tolist()
        parent = [-1] * n
        for i in range(1, n):
            p = sel[i - 1] // topk
            parent[i] = 0 if p == 0 else sel.index(plist[p]) + 1
        nxt, sib = [-1] * n, [-1] * n
        for i in range(n - 1, 0, -1):
            sib[i], nxt[parent[i]] = nxt[parent[i]], i
        retrive_index[b] = torch.arange(b * n, (b + 1) * n)
        retrive_next_token[b] = torch.tensor(nxt)
        retrive_next_sibling[b] = torch.tensor(sib)
        mask[b] = False
        for i in range(n):
            mask[b, i, 0] = True
            j, d = i, 0
            while j > 0:
                mask[b, i, j] = True
                j, d = parent[j], d + 1
            positions[b * n + i] = sl + d


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy acceptance per request: from the root, among the current node's children (first
    child, then its siblings) take the one whose token equals the target's argmax at the current
    node; stop when none does or accept_index is full. accept_index[b] lists the accepted nodes'
    flat indices (root first), accept_token_num[b] the accepted drafts, and predicts[flat] the
    target's token after each accepted node: the next accepted token, and the bonus token last."""
    tp = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, accept_index.shape[1]):
            cur = int(retrive_next_token[b, cur])
            while cur != -1 and int(candidates[b, cur]) != int(tp[last]):
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
            predicts[last] = tp[last]
            accepted += 1
            last = int(retrive_index[b, cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = tp[last]


# ----------------------------------------------------------------------------------------------
# Attention over the paged KV cache (q [tokens, Hq, D], buffers [slots, Hkv, D], GQA)

def _attend(q, k, v, sm_scale, logit_cap, mask):
    """softmax(q k^T * scale [capped], masked) v for one request; q [T, Hq, D], k/v [S, Hkv, D],
    mask [T, S] bool (True = visible). In float32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), k) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v)


def _unsupported(k_scale, v_scale, is_cross, window, sinks):
    if is_cross or window > 0 or sinks is not None or k_scale != 1.0 or v_scale != 1.0:
        raise NotImplementedError("this test stand-in covers causal self-attention without "
                                  "sliding window, sinks or KV scales")


def extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale,
                     req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
                     max_len_extend, sm_scale, logit_cap, is_cross_attn, sliding_window_size,
                     encoder_lens, sinks, tree_mask, is_causal):
    """Prefill, target verify and draft extend. Request b extends ext = extend_seq_lens[b] tokens
    (rows extend_start_loc[b] ..) on top of pre = seq_lens[b] - ext cached ones: its keys are the
    cache rows req_to_token[rpi[b], :pre], then the new k rows. The prefix is always visible;
    within the extend block, the tree mask (tree_mask.view(-1, ext, ext)[b]) when given, else a
    lower triangle (is_causal), else everything."""
    _unsupported(k_scale, v_scale, is_cross_attn, sliding_window_size, sinks)
    for b, (r, sl, ext, st) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                             extend_seq_lens.tolist(), extend_start_loc.tolist())):
        if ext == 0:
            continue
        pre = sl - ext
        locs = req_to_token[r, :pre].long()
        k = torch.cat([k_buffer[locs], k_extend[st:st + ext].to(k_buffer.dtype)])
        v = torch.cat([v_buffer[locs], v_extend[st:st + ext].to(v_buffer.dtype)])
        if tree_mask is not None:
            block = tree_mask.view(-1, ext, ext)[b].bool()
        elif is_causal:
            block = torch.ones(ext, ext, dtype=torch.bool).tril()
        else:
            block = torch.ones(ext, ext, dtype=torch.bool)
        mask = torch.cat([torch.ones(ext, pre, dtype=torch.bool), block], dim=1)
        out = _attend(q_extend[st:st + ext], k, v, sm_scale, logit_cap, mask)
        o_extend[st:st + ext] = out.to(o_extend.dtype)


def decode_attention(q, k_buffer, v_buffer, k_scale, v_scale, output, k, v, loc, attn_logits,
                     req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attn,
                     sliding_window_size, encoder_lens, sinks):
    """One query row per sequence (the target's plain decode, each draft decode step). Writes the
    new k/v into the cache itself (k_buffer[loc] = k; the intel_amx backend skips set_kv_buffer
    for a non-FP8 cache), then attends over req_to_token[rpi[b], :seq_lens[b]]. attn_logits is
    the real kernel's scratch space (split-KV partial sums), unused here."""
    _unsupported(k_scale, v_scale, is_cross_attn, sliding_window_size, sinks)
    if k is not None:
        k_buffer[loc.long()] = k.to(k_buffer.dtype)
        v_buffer[loc.long()] = v.to(v_buffer.dtype)
    for b, (r, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        locs = req_to_token[r, :sl].long()
        out = _attend(q[b:b + 1], k_buffer[locs], v_buffer[locs], sm_scale, logit_cap,
                      torch.ones(1, sl, dtype=torch.bool))
        output[b:b + 1] = out.to(output.dtype)
