"""A target whose greedy output depends on the last THREE tokens, and a draft built by hand to
predict it with every part of the draft doing necessary work. Both are fixed, seeded, and built
in milliseconds (no training), so tests can say exactly what a correct decoder must accept.

Target (a 4-layer Llama; layers 1-3 are identities, zeroed o_proj / down_proj):
    x_{t+1} = F[x_{t-2}, x_{t-1}, x_t]        F: a random table with values in the draft vocab S
  Layer 0 has two RoPE attention heads that look exactly 1 and 2 positions back and copy those
  tokens' one-hots into their own slots of the residual stream; its MLP is a lookup table with one
  gated neuron per (class of x_{t-2}, x_{t-1}, x_t), the class being one bit of x_{t-2} (which
  half of the vocabulary it is in: a full V^3 table would make every forward 5x slower). So the
  target needs its grandparent: a tree verify mask or position
  that is wrong anywhere from depth 2 on changes its output.

Draft row p (features of x_p from the target, token x_{p+1}) predicts x_{p+2} = F[x_{p-1}, x_p,
x_{p+1}], and each argument arrives by a different road:
    x_{p+1}  the token input e, read by an attention head that looks at its own row (offset 0)
    x_p      the feature g: fc copies it out of the target's hidden state (extend rows); at a
             draft step g is the parent's h2, whose MLP moved the parent's token there
    x_{p-1}  an attention head at RoPE offset 1 reads the previous row's g (the parent row in a
             tree, the last committed row at the first draft step)
  and a second offset-1 head reads the previous row's token, which must agree with g (the lookup
  neurons need both): a wrong parent state or a wrong row in the cache breaks the lookup.
  So the draft's token input, d2t (S is not a prefix of the vocabulary), fc, the h2 feedback, the
  KV cache, the tree mask and the positions all decide the drafted tokens.

A share `err` of the draft's table entries is wrong on purpose (the right token ranks second), so
chains are rejected now and then, the tree's second branches win, and tree >= chain is a claim.

Slots of the 64-wide residual stream (both models):
    [0, 12)  the row's token (target: x_t; draft g: x_p)       12  a constant 1
    [16, 28) target: x_{t-1}; draft: A = own token x_{p+1}
    [28, 40) target: x_{t-2}; draft: C = x_{p-1}
    [40, 52) O: the output one-hot (what lm_head reads)
    [52, 64) draft: B' = previous row's token (= x_p)
"""
import torch
import torch.nn.functional as F

V, H, HD = 12, 64, 16
S = [0, 1, 2, 4, 5, 6, 7, 9, 10, 11]   # the draft vocabulary: not a prefix, so d2t matters
CONST = 12
TOK, A, C, O, B2 = 0, 16, 28, 40, 52
ALPHA = 20.0      # lookup-neuron sharpness: silu(+-ALPHA/2) is ~ALPHA/2 or ~0
GAMMA = 20.0      # "linear" neurons: silu(GAMMA) = GAMMA to 4e-8
SCORE = 160.0     # |a|^2 of the RoPE attention heads: the wanted offset wins by >= 20 logits


NEURONS = 2 * V * V   # lookup neurons: (class of x_{t-2}, x_{t-1}, x_t)


def make_table(seed, err):
    """The rule as compact tables [2, V, V] indexed by (class of x_{t-2}, x_{t-1}, x_t), where
    the class of a token is whether it is in a random half of the vocabulary: the target's table,
    the draft's first / second / third choices, which entries the draft gets wrong, and the class
    of each token. Expanded to [V, V, V] (by the real x_{t-2}) by `full`."""
    g = torch.Generator().manual_seed(seed)
    Sx = torch.tensor(S)
    cls = torch.zeros(V, dtype=torch.long)
    cls[torch.randperm(V, generator=g)[:V // 2]] = 1
    table = Sx[torch.randint(0, len(S), (2, V, V), generator=g)]
    wrong = torch.rand(2, V, V, generator=g) < err
    # draft's preference order for every entry: first, second and third token (distinct, in S)
    order = torch.stack([Sx[torch.randperm(len(S), generator=g)[:3]] for _ in range(NEURONS)])
    order = order.view(2, V, V, 3)
    first = torch.where(wrong, torch.where(order[..., 0] == table, order[..., 1], order[..., 0]),
                        table)
    second = torch.where(wrong, table, torch.where(order[..., 0] == table, order[..., 1],
                                                   order[..., 0]))
    third = order[..., 2]
    third = torch.where((third == first) | (third == second), order[..., 1], third)
    return table, first, second, third, wrong, cls


def full(compact, cls):
    """[2, V, V] by class -> [V, V, V] by token: F[a, b, c] = compact[cls[a], b, c]."""
    return compact[cls]


def offset_head(rotary_fn, offset):
    """(q, k) per-head vectors [HD] whose RoPE dot product is largest when the query sits
    `offset` positions after the key: q = R(-offset) a, k = a, so q_m . k_n = sum_i |a_i|^2
    cos(theta_i (m - n - offset)). Each of the HD/2 frequency pairs gets the same weight."""
    a = torch.zeros(HD)
    a[:HD // 2] = (SCORE * HD ** 0.5 / (HD // 2)) ** 0.5   # the score is divided by sqrt(HD)
    cos, sin = rotary_fn(torch.tensor([[-offset]]))
    x = a[None, None, None]                                  # [1, 1, 1, HD]
    rot = torch.cat((-x[..., HD // 2:], x[..., :HD // 2]), -1)
    q = x * cos[:, None] + rot * sin[:, None]
    return q.flatten(), a


def make_target(seed=0, layers=4, beta=5.0, noise=0.0):
    """The lookup target (see the module docstring), float32, eval mode. `beta` scales the logit
    of the table's token (5: greedy margins ~18; small: a soft distribution for sampling tests);
    `noise` adds random lm_head weights on the other slots, so no two logits tie."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tables = make_table(seed, 0.0)
    table, cls = tables[0], tables[-1]
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=NEURONS, num_hidden_layers=layers,
                      num_attention_heads=H // HD, num_key_value_heads=H // HD, head_dim=HD,
                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    t = LlamaForCausalLM(cfg).float().eval().requires_grad_(False)
    rot = t.model.rotary_emb
    rotary_fn = lambda pos: rot(torch.zeros(1, 1, HD), pos)
    sd = {k: torch.zeros_like(v) for k, v in t.state_dict().items() if "norm" not in k
          and "rotary" not in k}
    eye = torch.eye(V)
    E = torch.zeros(V, H)
    E[:, TOK:TOK + V] = eye
    E[:, CONST] = 1.0
    sd["model.embed_tokens.weight"] = E
    s_in = (H / 2) ** 0.5                    # input_layernorm scale: token + constant, rms sqrt(2/H)
    L0 = "model.layers.0."
    q, k = sd[L0 + "self_attn.q_proj.weight"], sd[L0 + "self_attn.k_proj.weight"]
    v, o = sd[L0 + "self_attn.v_proj.weight"], sd[L0 + "self_attn.o_proj.weight"]
    for head, (off, slot) in enumerate([(1, A), (2, C)]):
        qv, kv = offset_head(rotary_fn, off)
        q[head * HD:(head + 1) * HD, CONST] = qv / s_in
        k[head * HD:(head + 1) * HD, CONST] = kv / s_in
        v[head * HD:head * HD + V, TOK:TOK + V] = eye / s_in
        o[slot:slot + V, head * HD:head * HD + V] = eye
    # MLP: one neuron per (class of x_{t-2}, x_{t-1}, x_t); post-attention rms = sqrt(4/H)
    s_mlp = (H / 4) ** 0.5
    gate, up = sd[L0 + "mlp.gate_proj.weight"], sd[L0 + "mlp.up_proj.weight"]
    down = sd[L0 + "mlp.down_proj.weight"]
    n = torch.arange(NEURONS)
    i, j, kk = n // (V * V), (n // V) % V, n % V
    gate[n[:, None], C + torch.arange(V)] = (cls[None] == i[:, None]) * ALPHA / s_mlp
    gate[n, A + j] = ALPHA / s_mlp
    gate[n, TOK + kk] = ALPHA / s_mlp
    gate[n, CONST] = -2.5 * ALPHA / s_mlp
    up[:, CONST] = 1.0 / s_mlp
    down[O + table.flatten(), n] = 1.0 / F.silu(torch.tensor(ALPHA / 2)).item()
    W = torch.zeros(V, H)
    W[torch.arange(V), O + torch.arange(V)] = beta
    if noise:
        W[:, :O] = noise * torch.randn(V, O, generator=torch.Generator().manual_seed(seed + 1))
    sd["lm_head.weight"] = W
    t.load_state_dict(sd, strict=False)
    t.table = full(table, cls)
    return t


def write_lookup_mlp(mlp, s, cls, first, second, third, K=1.0, c_units=1.0):
    """The lookup MLP on an input of RMS 1/s (s divides every weight that reads it): NEURONS
    lookup neurons fire on (class of x_{t-2} in slot C, x_{t-1} in B', x_t in A) and write the
    (first, second, third) choices into O; the linear neurons then move K A into the token slot
    and clear A, C, B' and O. c_units: how many units C holds (2 in the three-layer draft)."""
    silu = lambda x: F.silu(torch.tensor(x)).item()
    n = torch.arange(NEURONS)
    i, j, k = n // (V * V), (n // V) % V, n % V
    mlp.gate_proj.weight[n[:, None], C + torch.arange(V)] = \
        (cls[None] == i[:, None]) * ALPHA / s / c_units
    mlp.gate_proj.weight[n, TOK + j] = ALPHA / s
    mlp.gate_proj.weight[n, B2 + j] = ALPHA / s
    mlp.gate_proj.weight[n, A + k] = ALPHA / s
    mlp.gate_proj.weight[n, CONST] = -3.5 * ALPHA / s
    mlp.up_proj.weight[:NEURONS, CONST] = 1.0 / s
    # the output: a unit vector over (first, second, third) choices
    w = torch.tensor([1.0, 0.8, 0.4])
    w = K * w / w.norm() / silu(ALPHA / 2)
    for c, tok in enumerate((first, second, third)):
        mlp.down_proj.weight[O + tok.flatten(), n] += w[c]
    # linear neurons (gate = GAMMA on the constant): token slot <- K A; clear A, C, B', O
    lin = NEURONS + torch.arange(V)
    for b, (dst, plus, minus) in enumerate([(TOK, A, TOK), (A, None, A), (C, None, C),
                                            (B2, None, B2), (O, None, O)]):
        rows = lin + b * V
        mlp.gate_proj.weight[rows, CONST] = GAMMA / s
        if plus is not None:
            mlp.up_proj.weight[rows, plus + torch.arange(V)] = K
        mlp.up_proj.weight[rows, minus + torch.arange(V)] -= 1.0
        mlp.down_proj.weight[dst + torch.arange(V), rows] = 1.0 / (s * silu(GAMMA))


def make_draft(target, seed=0, err=0.1, head=5.0):
    """The hand-built draft for `make_target(seed)` (see the module docstring). `head` scales its
    logits: 5 gives near-certain guesses, ~1 a spread distribution (sampling tests)."""
    from model import Eagle3Draft
    from draft_config import config_from_target
    _, first, second, third, wrong, cls = make_table(seed, err)
    cfg = config_from_target(target.config, len(S))
    cfg.intermediate_size = NEURONS + 5 * V
    d = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    d.set_vocab(torch.tensor(S))
    rotary_fn = lambda pos: d.rotary(pos, torch.float32)
    eye = torch.eye(V)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.zero_() if p.dim() == 2 else p.fill_(1.0)
        # fc: aux = [layer 0 | layer 1 | layer 2] outputs; take the token and O slots of block 0
        d.fc.weight[TOK:TOK + V, TOK:TOK + V] = eye
        d.fc.weight[O:O + V, O:O + V] = eye
        d.fc.weight[CONST, CONST] = 1.0
        # attention input x = [input_layernorm(e) (H) | hidden_norm(g) (H)]
        s_e, s_g = (H / 2) ** 0.5, (H / 3) ** 0.5     # e: token + const; g: token + const + O
        at = d.midlayer.self_attn
        heads = [(0, A, TOK), (1, C, H + TOK), (1, B2, TOK)]   # (offset, out slot, value source)
        for h, (off, slot, src) in enumerate(heads):
            qv, kv = offset_head(rotary_fn, off)
            at.q_proj.weight[h * HD:(h + 1) * HD, CONST] = qv / s_e
            at.k_proj.weight[h * HD:(h + 1) * HD, CONST] = kv / s_e
            at.v_proj.weight[h * HD:h * HD + V, src:src + V] = eye / (s_e if src < H else s_g)
            at.o_proj.weight[slot:slot + V, h * HD:h * HD + V] = eye
        # MLP on post_attention_layernorm(h1), h1 = g + attn = 6 unit one-hots -> rms sqrt(6/H)
        s = (H / 6) ** 0.5
        write_lookup_mlp(d.midlayer.mlp, s, cls, first, second, third)
        # lm_head over the draft vocab reads O
        d.lm_head.weight[torch.arange(len(S)), O + torch.tensor(S)] = head
    d.wrong, d.first = full(wrong, cls), full(first, cls)
    return d.eval()


# The lookup draft in every layout model.py reads (draft_config.py): tests/lookup_fixture.py's target
# (the next token a table of the last three) made 8 layers deep (layers 1-7 identities, so every
# aux layer holds layer 0's output), and its hand-built draft rebuilt in each layout, one option
# at a time and all together. Every variant computes the same function as the default-layout
# draft (speculate.py: 72 drafts accepted in 29 rounds on lookup_prompts(3, seed=1), for each),
# and each option does necessary work. Measured with speculate.py on a draft built with the option
# and then run without it: ignoring fc_norm or input_norm 13 accepted in 80 rounds, norm_output
# 45 in 49, attention of layers 1-2 made flat 3 in 90; and with SGLang's worker serving the draft
# with the key deleted from its config.json: 49 rounds (norm_output), 42 (fc_norm), 42
# (norm_before_fc) instead of 29, so this test fails on an engine that ignores an option.

def make_layout_draft(target, aux, fc_norm=False, norm_before_fc=False, norm_output=False,
                      layers=1, seed=0, err=0.1, head=5.0):
    """make_draft's draft for make_target(seed, layers=8) in another layout (aux: the captured
    layers; with layers 1-7 identities every aux layer holds layer 0's output).
    - fc_norm / norm_before_fc: norm weights with a random factor per (aux chunk, slot group)
      in [e^-1.5, e^1.5]; fc divides them out (every chunk is 5 unit one-hots: a known RMS).
      fc reads the token from chunk 0, the constant from chunk n//2 and O from the last chunk.
    - norm_output: the last MLP writes h2 = 2 (token + constant + O), norm.weight = sqrt(3/H),
      so norm(h2) = h2 / 2 is the feature the next step needs (carrying h2 breaks the lookup).
    - layers=3: the gathering is split over the layers, each reading the rows before it from
      its own KV cache: layer 0 puts its own token in A and the previous row's g token (x_{p-1})
      in C; layer 1 the previous row's A (x_p) in B'; layer 2 the previous row's B' (x_{p-1})
      in C again (C then holds 2 on x_{p-1}); layer 2's MLP is the lookup."""
    import dataclasses
    from model import Eagle3Draft
    from draft_config import config_from_target
    N = NEURONS
    K = 2.0 if norm_output else 1.0
    _, first, second, third, wrong, cls = make_table(seed, err)
    cfg = config_from_target(target.config, len(S), aux_layer_ids=aux)
    cfg = dataclasses.replace(cfg, fc_norm=fc_norm, norm_before_fc=norm_before_fc,
                              norm_output=norm_output, num_hidden_layers=layers,
                              intermediate_size=N + 6 * V)
    d = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    d.set_vocab(torch.tensor(S))
    rotary_fn = lambda pos: d.rotary(pos, torch.float32)
    eye, n = torch.eye(V), len(aux)
    g = torch.Generator().manual_seed(seed + 7)
    groups = [(TOK, V), (CONST, 1), (A, V), (C, V), (O, V)]   # the target's layer-0 output
    silu = lambda x: F.silu(torch.tensor(x)).item()
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.zero_() if p.dim() == 2 else p.fill_(1.0)
        m = torch.ones(n, len(groups))       # what the norms multiply each slot group by
        if norm_before_fc:                   # one RMSNorm over the concatenation (rms sqrt(5/H))
            w = torch.empty(n, len(groups)).uniform_(-1.5, 1.5, generator=g).exp()
            for i in range(n):
                for j, (s0, wd) in enumerate(groups):
                    d.input_norm.weight[i * H + s0:i * H + s0 + wd] = w[i, j]
            m = m * w / (5 / H) ** 0.5
        if fc_norm:                          # then one per chunk
            w = torch.empty(n, len(groups)).uniform_(-1.5, 1.5, generator=g).exp()
            for i in range(n):
                rms = (m[i] ** 2).sum().div(H).sqrt()
                for j, (s0, wd) in enumerate(groups):
                    d.fc_norm[i].weight[s0:s0 + wd] = w[i, j]
                m[i] = m[i] * w[i] / rms
        for (slot, wd, j), chunk in zip([(TOK, V, 0), (CONST, 1, 1), (O, V, 4)],
                                        [0, n // 2, n - 1]):
            d.fc.weight[slot:slot + wd, chunk * H + slot:chunk * H + slot + wd] = \
                torch.eye(wd) / m[chunk, j]
        lay = d.decoder_layers()
        s_e, s_g = (H / 2) ** 0.5, (H / 3) ** 0.5     # e: token + const; g: token + const + O

        def head_into(layer, h, off, slot, src, s_qk, s_v):
            at = layer.self_attn
            qv, kv = offset_head(rotary_fn, off)
            at.q_proj.weight[h * HD:(h + 1) * HD, CONST] = qv / s_qk
            at.k_proj.weight[h * HD:(h + 1) * HD, CONST] = kv / s_qk
            at.v_proj.weight[h * HD:h * HD + V, src:src + V] = eye / s_v
            at.o_proj.weight[slot:slot + V, h * HD:h * HD + V] = eye
        if layers == 1:   # lookup_fixture.make_draft's three heads
            for h, (off, slot, src) in enumerate([(0, A, TOK), (1, C, H + TOK), (1, B2, TOK)]):
                head_into(lay[0], h, off, slot, src, s_e, s_e if src < H else s_g)
            units_sq, c_units = 6.0, 1.0
        else:
            assert layers == 3
            for h, (off, slot, src) in enumerate([(0, A, TOK), (1, C, H + TOK)]):
                head_into(lay[0], h, off, slot, src, s_e, s_e if src < H else s_g)
            head_into(lay[1], 0, 1, B2, A, (H / 5) ** 0.5, (H / 5) ** 0.5)    # h0: 5 units
            head_into(lay[2], 0, 1, C, B2, (H / 6) ** 0.5, (H / 6) ** 0.5)    # h1: 6 units
            units_sq, c_units = 9.0, 2.0
        # the lookup MLP (last layer) on post_attention_layernorm(h1): rms sqrt(units_sq / H)
        s = (H / units_sq) ** 0.5
        mlp = lay[-1].mlp
        write_lookup_mlp(mlp, s, cls, first, second, third, K, c_units)
        if K != 1:
            row = N + 5 * V
            mlp.gate_proj.weight[row, CONST] = GAMMA / s
            mlp.up_proj.weight[row, CONST] = K - 1
            mlp.down_proj.weight[CONST, row] = 1.0 / (s * silu(GAMMA))
            d.norm.weight.fill_((3 / H) ** 0.5)
        d.lm_head.weight[torch.arange(len(S)), O + torch.tensor(S)] = head
    return d.eval()


AUX3, AUX5 = [0, 3, 6], [0, 1, 3, 4, 6]
LAYOUTS = {   # name -> (aux layers, make_layout_draft options)
    "fc_norm": (AUX3, dict(fc_norm=True)),
    "norm_before_fc": (AUX3, dict(norm_before_fc=True)),
    "norm_output": (AUX3, dict(norm_output=True)),
    "three_layers": (AUX3, dict(layers=3)),
    "five_aux": (AUX5, {}),
    "every_option": (AUX5, dict(fc_norm=True, norm_before_fc=True, norm_output=True, layers=3)),
}


def lookup_pair(seed=0, err=0.1):
    t = make_target(seed)
    return t, make_draft(t, seed, err)


def lookup_prompts(n, seed, lo=4, hi=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def save_lookup(root, seed=0, err=0.1):
    """The pair on disk, as a user's target (with a word-level tokenizer: token i is the word
    't<i>', so the prompt text 't3 t1 t4' is the ids [3, 1, 4]) and a draft directory."""
    import os
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast
    t, d = lookup_pair(seed, err)
    tdir, ddir = os.path.join(str(root), "target"), os.path.join(str(root), "draft")
    t.save_pretrained(tdir)
    tk = Tokenizer(WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0").save_pretrained(tdir)
    d.save_pretrained(ddir, dtype=torch.float32)
    return tdir, ddir


def chain_replay(table, seq, start, max_new, steps):
    """Greedy chain decoding replayed in plain Python from the draft's own table: `seq` is the
    prompt plus the target's greedy continuation (at least `steps` tokens past max_new), the
    first root sits at index `start`. Returns the accepted drafts of every round, which is what
    a correct speculate.py must report for this draft."""
    accepted, r, out = [], start, 1
    while out < max_new:
        ctx, a = seq[r - 2:r + 1], 0
        for i in range(steps):
            guess = int(table[ctx[-3], ctx[-2], ctx[-1]])
            if guess != seq[r + 1 + i]:
                break
            a += 1
            ctx = ctx + [guess]
        accepted.append(a)
        r, out = r + a + 1, out + a + 1
    return accepted
