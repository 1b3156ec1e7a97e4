"""
Training-time test (TTT): the math of one EAGLE-3 training step, for a batch of sequences with
the target's hidden states. train.py runs it (data, FSDP2, checkpoints); this file is only math.

For one sequence x_0 .. x_{T-1} with target features h_t (three target layers, concatenated):

  row t at TTT step j  =  feature g_j[t], token x_{t+j+1}, RoPE position t + j
      g_0[t] = fc(h_t)                      g_j[t] = h2_{j-1}[t]  (the previous step's pre-norm out;
                                            norm(h2_{j-1}[t]) with norm_output, model.py layouts)
  it predicts x_{t+j+2}, supervised by the target's distribution at position t+j+1:
      p_j[t] = softmax(target_lm_head(final_{t+j+1}) restricted to the draft vocab)
  and it attends to the step-0 keys of rows 0..t (causal) plus its OWN keys of steps 1..j, which is
  exactly what the draft's KV cache holds when it drafts j tokens past row t at decode time.

  loss = sum_j 0.8**j * mean over valid rows of  -sum_v p_j[t, v] log q_j[t, v]
  valid_j[t]: x_{t+j+2} is a loss token (assistant; any real token with train.py
              --loss-positions all) and argmax of the target at t+j+1 is in the draft vocab
              (the draft could never propose it otherwise)
  acc_j: share of valid rows where argmax q_j == argmax p_j
  simulated accept length of a chain of k drafts: 1 + sum_{m<k} prod_{i<=m} acc_i
  replayed accept length: greedy chain decoding (3 drafts) replayed over the rows, see
                          replay_decoding; the closer predictor of what speculate.py measures
"""
import torch
import torch.nn as nn

LOSS_DECAY = 0.8   # weight of TTT step j is 0.8**j


# ----------------------------------------------------------------------------------------------
# The target's side of the loss: its next-token distribution from the stored final hidden state

@torch.no_grad()
def target_side(final, lm_w_draft, need=None, in_vocab=None, lm_w=None, t2d=None, chunk=1024):
    """final [B, T, Ht] (post-final-norm) -> the target's next-token distribution at every
    position, over the draft vocabulary (softmax restricted to it and renormalised) as probs
    [B*T, Vd] fp32, its argmax [B*T] as a draft id, and in_vocab [B, T]: is the target's argmax
    over the FULL vocabulary inside the draft vocabulary.

    The soft labels need only the draft vocabulary's rows of lm_head (lm_w_draft [Vd, Ht]); the
    full [V, Ht] product is needed once per sequence, for the one bit in_vocab. Pass in_vocab
    (remembered from an earlier epoch) and it is skipped: for an 8k draft vocabulary of a 49k
    target that is 6x less vocabulary work per row. Only rows in `need` [B, T] (default all) are
    computed, the rest left zero/False: prompt rows and padding never reach the loss. Chunked so
    no [rows, V] logits exist for the whole batch at once."""
    B, T, Ht = final.shape
    flat = final.reshape(-1, Ht)
    rows = (torch.arange(B * T, device=final.device) if need is None
            else need.reshape(-1).nonzero().squeeze(1))
    probs = torch.zeros(B * T, lm_w_draft.shape[0], device=final.device)
    inv = torch.zeros(B * T, dtype=torch.bool, device=final.device)
    for i in range(0, rows.numel(), chunk):
        r = rows[i:i + chunk]
        x = flat[r].to(lm_w_draft.dtype)
        probs[r] = torch.softmax((x @ lm_w_draft.T).float(), -1)
        if in_vocab is None:
            inv[r] = t2d[(x @ lm_w.T).argmax(-1)]                # [rows, V]: the costly product
    if in_vocab is not None:
        return probs, probs.argmax(-1), in_vocab if need is None else in_vocab & need
    return probs, probs.argmax(-1), inv.view(B, T)


def top_k_labels(probs, k):
    """train.py --distill-topk K: the target's distribution cut to its K most likely draft tokens,
    renormalised. K = 1 is the hard label (one-hot argmax): all a greedy chain is judged on;
    the full soft label also teaches the order of the runners-up, which tree drafting uses.
    Rows that are all zero (never needed) stay zero."""
    top = probs.topk(k, -1)
    cut = torch.zeros_like(probs).scatter_(-1, top.indices, top.values)
    return cut / cut.sum(-1, keepdim=True).clamp_min(1e-30)


def noisy_features(aux, n_layers, std, gen):
    """train.py --feature-noise STD: aux [B, T, n*Ht] + N(0, (STD * rms)^2), rms the row's RMS in
    each captured layer, so the same STD means as much to a layer of RMS 3 as to one of RMS 24.
    At decode time the draft's features come from the target on text it has not seen; noise is
    the cheap stand-in for that shift (EAGLE's uniform feature noise, scaled per layer)."""
    B, T, A = aux.shape
    x = aux.view(B, T, n_layers, A // n_layers)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    eps = torch.randn(x.shape, generator=gen, device="cpu").to(aux.device)
    return (x + std * rms * eps).view(B, T, A)


def shift_left(x, k, fill=0):
    """x[:, t] <- x[:, t + k], the last k entries filled: row t looks k positions ahead."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], 1)


def valid_rows(mask, in_vocab, J):
    """valid[j][b, t] = x_{t+j+2} is a loss token and the target's argmax at t+j+1 is in the
    draft vocabulary: the loss mask shifts left by one more each step."""
    return torch.stack([shift_left(mask, j + 2, False) & shift_left(in_vocab, j + 1, False)
                        for j in range(J)])


# ----------------------------------------------------------------------------------------------
# Training-time test

def repeat_kv(x, n):
    """[B, nkv, T, hd] -> [B, nkv*n, T, hd]; head h reads kv head h // n (as SDPA's enable_gqa)."""
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def ttt_attention(q, k0, v0, ks, vs):
    """TTT attention for one step j = len(ks).
    q [B, nh, T, hd]: this step's queries; k0, v0 [B, nh, T, hd]: step-0 keys/values of all rows;
    ks, vs: lists of j tensors [B, nh, T, hd], row t's own keys/values at steps 1..j.
    Row t attends to k0[0..t] (causal) and to ks[i][t] for every i: the scores against the cached
    steps are diagonals (row t with its own row t), so each costs one dot product per row instead
    of a [T, T] matrix. Concatenated with the causal scores, one softmax over T + j keys."""
    T = q.shape[2]
    q = q * q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ k0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))   # [B, nh, T, T]
    sd = [(q * k).sum(-1, keepdim=True) for k in ks]                       # j x [B, nh, T, 1]
    p = torch.softmax(torch.cat([s0] + sd, -1), -1, dtype=torch.float32).to(v0.dtype)
    out = p[..., :T] @ v0
    for i, v in enumerate(vs):
        out = out + p[..., T + i:T + i + 1] * v
    return out


def ttt_unroll(draft, ids, aux, J):
    """Run J TTT steps over a batch; yields h2 [B, T, H] of each step (pre-norm: logits are
    lm_head(norm(h2)), computed by the caller for the rows it needs).
    Step j: token x_{t+j+1}, position t+j, feature fuse(aux) at j = 0, else the previous step's
    carried feature (h2, or norm(h2) with norm_output). With several decoder layers each layer
    keeps its own step-0 keys and own-row keys of steps 1..j, as each has its own KV cache."""
    B, T = ids.shape
    layers = draft.decoder_layers()
    pos = torch.arange(T, device=ids.device)[None].expand(B, T)
    g = draft.fuse(aux)
    kv0 = [None] * len(layers)               # per layer: (k0, v0)
    ks, vs = [[] for _ in layers], [[] for _ in layers]
    for j in range(J):
        e = draft.embed_tokens(shift_left(ids, j + 1)).to(g.dtype)
        cos, sin = draft.rotary(pos + j, g.dtype)
        h = g
        for l, layer in enumerate(layers):
            attn = layer.self_attn
            rep = attn.nh // attn.nkv
            q, k, v = attn.project(layer.attn_input(e, h), cos, sin)
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
            if j == 0:
                kv0[l] = (k, v)
            else:
                ks[l].append(k)
                vs[l].append(v)
            o = ttt_attention(q, *kv0[l], ks[l], vs[l])
            o = attn.o_proj(o.transpose(1, 2).reshape(B, T, attn.nh * attn.hd))
            h = layer.finish(h, o)
        yield h
        g = draft.carry(h)


class TTTLoss(nn.Module):
    """The unit FSDP2 shards: its forward is one TTT unroll and its loss, so FSDP's hooks gather
    the draft's parameters around exactly this computation and reduce-scatter its gradients."""

    def __init__(self, draft, ttt_length, accept_weight=0.0, chain_rows=False, decay=LOSS_DECAY):
        super().__init__()
        self.draft, self.J, self.accept_weight = draft, ttt_length, accept_weight
        self.decay = decay      # step j weighs decay**j (train.py --ttt-decay)
        # chain_rows (train.py --ttt-loss-rows chain, GRIFFIN-style): step j's loss only on rows
        # whose steps 0..j-1 were right, the only rows where a greedy chain ever uses step j.
        # Still divided by all valid rows, so a step weighs as much as the chains that reach it.
        # The statistics (and so acc_j and the replayed accept length) stay over all valid rows.
        self.chain_rows = chain_rows

    def forward(self, ids, aux, targ_p, targ_argmax, valid, denom, scale):
        """targ_p [B*T, Vd], targ_argmax [B*T]: the target at every position (target_side);
        valid [J, B, T]; denom [J]: valid rows per step over the GLOBAL batch, so the loss is the
        same however the batch is split over ranks; scale: world size (FSDP averages gradients).
        Only valid rows go through lm_head and the softmax: prompt rows, padding and the tail of
        the unroll cost no vocabulary-sized work. Returns the loss, per-step sums [3, J] (soft CE,
        correct, valid rows) and correct [J, B*T]: which rows' argmax matched at each step."""
        B, T = ids.shape
        loss = 0.0
        stats = torch.zeros(3, self.J, device=ids.device)   # ce sum, correct, valid rows
        correct = torch.zeros(self.J, B * T, dtype=torch.bool, device=ids.device)
        for j, h2 in enumerate(ttt_unroll(self.draft, ids, aux, self.J)):
            rows = valid[j].reshape(-1).nonzero().squeeze(1)           # flat b*T + t
            lg = self.draft.lm_head(self.draft.norm(h2.reshape(B * T, -1)[rows])).float()
            p = targ_p[rows + j + 1]                                  # the target at t+j+1
            # soft cross-entropy -sum p log softmax(lg) = logsumexp(lg) - p.lg, since sum p = 1
            ce = torch.logsumexp(lg, -1) - (p * lg).sum(-1)            # [rows]
            ce_sum = ce.sum()
            obj = ce
            if self.accept_weight:
                # sum_x min(p, q) is the chance that a sampled draft token is accepted (it is
                # 1 - TV(p, q)); -log of it aims at acceptance directly, not at all of p
                acc = torch.minimum(p, torch.softmax(lg, -1)).sum(-1).clamp_min(1e-6)
                obj = obj + self.accept_weight * -torch.log(acc)
            if self.chain_rows and j > 0:          # rows whose steps 0..j-1 all matched
                obj = obj * correct[:j, rows].all(0)
            obj = obj.sum()
            loss = loss + self.decay ** j * obj / denom[j].clamp_min(1) * scale
            ok = lg.argmax(-1) == targ_argmax[rows + j + 1]
            correct[j, rows] = ok
            stats[0, j] = ce_sum.detach()
            stats[1, j] = ok.sum()
            stats[2, j] = rows.numel()
        return loss, stats, correct


def replay_decoding(correct, mask, k=3):
    """Replay greedy chain decoding with k drafts per round over each sequence's assistant turns,
    from which draft steps were right at which row: a round at row t (root x_{t+1} committed)
    accepts the leading correct steps, a, and commits a + 1 tokens (the bonus), so the next round
    starts at row t + a + 1. A turn's first round starts at the row whose token is the turn's
    first token (the target's prefill produced it). With target-greedy data this is what
    speculate.py measures. The product formula assumes rounds start at random rows; real rounds
    start right after a miss, where the next token is often hard too, so it reads high.
    correct [J, B*T] bool, mask [B, T] loss mask -> tensor [tokens committed, rounds]."""
    B, T = mask.shape
    k = min(k, correct.shape[0])
    lead = correct[:k].long().cumprod(0).sum(0).view(B, T).tolist()
    m = mask.tolist()
    tokens = rounds = 0
    for b in range(B):
        t = 0
        while t + 2 < T:
            if m[b][t + 1] and m[b][t + 2]:   # an assistant token to guess after the root
                a = lead[b][t]
                tokens, rounds = tokens + a + 1, rounds + 1
                t += a + 1
            else:
                t += 1
    return torch.tensor([float(tokens), float(rounds)])


def metrics(stats, replay):
    """Loss, accuracy per step and the simulated accept lengths from summed statistics."""
    ce, correct, n = stats.tolist()
    J = len(n)
    acc = [c / max(m, 1) for c, m in zip(correct, n)]
    loss_j = [c / max(m, 1) for c, m in zip(ce, n)]

    def accept(k):   # 1 + sum_{m<k} prod_{i<=m} acc_i
        tot, prod = 1.0, 1.0
        for a in acc[:k]:
            prod *= a
            tot += prod
        return tot
    return {"loss": sum(LOSS_DECAY ** j * loss_j[j] for j in range(J)), "loss_j": loss_j,
            "acc_j": acc, "accept_len_3": accept(3), "accept_len_full": accept(J),
            "replay_accept_3": replay[0].item() / max(replay[1].item(), 1), "rows": n[0]}
