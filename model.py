"""
The EAGLE-3 draft head, state-dict compatible with SGLang's `LlamaForCausalLMEagle3`.

The draft is one Llama decoder layer that reads the target model instead of raw tokens. For a row t
of a sequence it gets two inputs:

    g = fc(concat(h_low, h_mid, h_high))    # three captured target hidden states at position t
    e = embed(x_{t+1})                      # the target's (frozen) embedding of the NEXT token

and runs

    residual = g
    x  = concat(input_layernorm(e), hidden_norm(g))       # 2H wide, embedding first
    h1 = residual + self_attn(x)                           # q/k/v project 2H -> heads
    h2 = h1 + mlp(post_attention_layernorm(h1))
    logits = lm_head(norm(h2))                             # over the reduced draft vocabulary

so row t predicts x_{t+2}. `h2` (before the final norm) is the feature the draft feeds to itself
when it drafts further: the next step replaces g with h2 and e with the embedding of the token it
just proposed. The draft vocabulary is a subset S of the target vocabulary (sorted ascending);
draft id i is target id `i + d2t[i]`, and `t2d[j]` says whether target id j is in S.

Layouts. The above is the default. SGLang 0.5.23's loader (srt/models/llama_eagle3.py) reads four
more options from the draft's config.json, and so does this file, with the same keys, tensors and
math (vLLM 0.33.0 reads the same ones; tests/test_engine_checkpoints.py checks both wheels):

    key (where in config.json)      tensors                   what changes
    fc_norm (top level)             fc_norm.{i}.weight [Ht]   each captured layer RMS-normed before fc
    norm_before_fc (eagle_config)   input_norm.weight [n*Ht]  one RMSNorm over the concatenation first
    norm_output (top level)         -                         the next draft step reads norm(h2), not h2
    num_hidden_layers N > 1         layers.{i}.* (1 <= i < N) layer 0 reads [e, g] (2H) as above;
                                                              layer i reads h = the previous output:
                                                              h + attn(hidden_norm(h)), then its MLP
    n aux ids (eagle_config)        fc.weight [H, n*Ht]       n captured layers instead of three

With both norms, input_norm runs first (as in both engines). A later layer's pre-attention norm is
`hidden_norm` in SGLang and `input_layernorm` in vLLM: the checkpoint holds the same tensor under
both names, so the two engines compute the same draft. Any other key that would change the draft
(attention_bias, tie_word_embeddings, ...) is refused, never ignored. vLLM reads one more,
`norm_before_residual` (top level; speculators' trainer default): layer 0's residual is
hidden_norm(g) instead of g. This file implements it too, but SGLang 0.5.23 never reads it, so a
draft with it on is served right by vLLM only (the doctor fails it for SGLang).

Usage as a script:
    python model.py --target default --out drafts/new [--draft-vocab-size 8192]   # fresh draft
    python model.py drafts/new                                                  # inspect one
    python model.py DRAFT --doctor [--target default]   # train/serve mismatches (doctor.py)
    python model.py DRAFT --export speculators --out DIR --target default   # or --export sglang
                                                # the other public layout (layouts.py), exact
    python model.py --target moonshotai/Kimi-K2-Instruct --trust-remote-code \
        --draft-vocab-size 32000 --dry-run      # the draft's config.json and size, nothing written
"""
import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import UserError, atomic_write, atomic_write_text, run_main
from draft_config import (CONFIG_NAME, apply_draft_config, check_fits, config_from_target,
                          read_config)

WEIGHTS_NAME = "model.safetensors"


# ----------------------------------------------------------------------------------------------
# Building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # computed in fp32 like the target's own norm, then cast back
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables. The inverse frequencies come from transformers' own RoPE initialisers so every
    scaling type the target may use (llama3, yarn, linear, dynamic...) matches the target exactly."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        params = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
        if cfg.rope_scaling:
            params.update(cfg.rope_scaling)
            params["rope_type"] = params.get("rope_type", params.get("type", "default"))
        lcfg = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                           head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                           rope_parameters=params)
        if params["rope_type"] == "default":
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
            scale = 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](lcfg, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale

    def forward(self, position_ids, dtype):
        """position_ids [B, T] -> cos, sin [B, T, head_dim]"""
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, heads, T, hd]; cos/sin [B, T, hd]"""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class KVCache:
    """A growable key/value buffer for one decoder layer. `len` rows are valid; cropping is
    just lowering `len`, so rejecting drafted rows costs nothing."""

    def __init__(self, batch, kv_heads, head_dim, dtype, device, capacity=256):
        self.k = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.len = 0

    def append(self, k, v):
        need = self.len + k.shape[2]
        if need > self.k.shape[2]:  # grow geometrically: amortised O(1) per row
            cap = max(need, 2 * self.k.shape[2])
            grow = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], cap - t.shape[2], t.shape[3])], 2)
            self.k, self.v = grow(self.k), grow(self.v)
        self.k[:, :, self.len:need] = k
        self.v[:, :, self.len:need] = v
        self.len = need
        return self.k[:, :, :need], self.v[:, :, :need]


class LayerCaches:
    """One KVCache per decoder layer (num_hidden_layers > 1). `len`, read or set, is every
    layer's, so callers crop it exactly as they crop a single KVCache."""

    def __init__(self, caches):
        self.layers = caches

    @property
    def len(self):
        return self.layers[0].len

    @len.setter
    def len(self, n):
        for c in self.layers:
            c.len = n


class Attention(nn.Module):
    def __init__(self, cfg, in_features):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(in_features, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(in_features, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_features, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)

    def project(self, x, cos, sin):
        """x [B, T, 2H or H] -> q [B, nh, T, hd], k, v [B, nkv, T, hd], RoPE applied to q and k."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, cache=None, mask=None):
        """Causal attention over (cache rows + these rows), or `mask` [B|1, 1, T, S] (True =
        may attend) when the caller needs another pattern (tree drafting)."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        past = cache.len if cache is not None else 0
        if cache is not None:
            k, v = cache.append(k, v)
        if mask is None and T > 1:
            S = past + T
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(past)[None, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nh != self.nkv)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """Decoder layer `index`. Layer 0 (checkpoint names midlayer.*, SGLang's) reads the token and
    the feature, [input_layernorm(e), hidden_norm(g)] (2H). A later layer (layers.{index}.*) reads
    only the previous layer's output h, as hidden_norm(h) (H); SGLang fuses the residual add into
    that norm, vLLM names the same norm input_layernorm (see Eagle3Draft.export_state_dict)."""

    def __init__(self, cfg, index=0):
        super().__init__()
        H = cfg.hidden_size
        self.first = index == 0
        self.norm_residual = self.first and cfg.norm_before_residual
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        if self.first:
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H if self.first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, e, g):
        if not self.first:
            return self.hidden_norm(g)
        return torch.cat([self.input_layernorm(e), self.hidden_norm(g)], dim=-1)

    def finish(self, g, attn_out):
        """Residual additions after attention; returns h2, the pre-norm output feature. The
        residual of layer 0 is g, or hidden_norm(g) with vLLM's norm_before_residual."""
        h1 = (self.hidden_norm(g) if self.norm_residual else g) + attn_out
        return h1 + self.mlp(self.post_attention_layernorm(h1))

    def forward(self, e, g, cos, sin, cache=None, mask=None):
        return self.finish(g, self.self_attn(self.attn_input(e, g), cos, sin, cache, mask))


def fc_weight_for_features(hidden_size, target_hidden_size, feature_rms, generator=None):
    """A fresh fc weight [H, n*Ht] for features of the given scale: feature_rms [n] is the typical
    per-row RMS of each of the n captured layers (as fc sees them, after any fc_norm /
    norm_before_fc). Block i of the columns gets std 1 / (rms_i sqrt(n Ht)), so each layer adds
    variance 1/n and g = fc(aux) starts at RMS ~1, each layer heard equally.
    Why: targets' residual streams grow with depth (SmolLM2-135M: RMS ~2.7 / 6.2 / 22.9 at layers
    1 / 14 / 26). With a std-0.02 init fc(aux) starts at RMS ~11, 50x the attention branch (~0.2),
    so h2 = g + attn + mlp is at first a linear read-out of the deepest layer and the decoder
    layer's share must grow ~50x before it counts. Only the init changes, not the format."""
    Ht = target_hidden_size
    rms = torch.as_tensor(feature_rms, dtype=torch.float32).tolist()
    w = torch.empty(hidden_size, len(rms) * Ht)
    for i, r in enumerate(rms):
        w[:, i * Ht:(i + 1) * Ht].normal_(0.0, 1.0 / (r * math.sqrt(len(rms) * Ht)),
                                          generator=generator)
    return w


# ----------------------------------------------------------------------------------------------
# The draft model

class Eagle3Draft(nn.Module):
    def __init__(self, cfg, embed_weight=None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        if embed_weight is not None:
            self.set_embedding(embed_weight)
        n, Ht = len(cfg.aux_layer_ids), cfg.target_hidden_size
        # optional norms on the captured features before fc (module docstring: layouts)
        self.input_norm = RMSNorm(n * Ht, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(n)])
                        if cfg.fc_norm else None)
        self.fc = nn.Linear(n * Ht, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        if cfg.num_hidden_layers > 1:   # keys "1".. give the checkpoint names layers.{i}.*
            self.layers = nn.ModuleDict({str(i): MidLayer(cfg, i)
                                         for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        # Identity vocab map until a real one is set (Vd == V), else first Vd ids.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[:cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def set_embedding(self, weight):
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab(self, draft_to_target):
        """draft_to_target: the Vd target ids of the draft vocabulary, sorted ascending."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long)
        Vd, V = self.config.draft_vocab_size, self.config.vocab_size
        check_draft_ids(ids, Vd, V, "draft vocabulary")
        self.d2t.copy_(ids - torch.arange(Vd))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_ids(self):
        """Target id of every draft id: i + d2t[i]."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def decoder_layers(self):
        """Layer 0 (midlayer), then layers 1.. (num_hidden_layers > 1)."""
        return [self.midlayer] + (list(self.layers.values()) if hasattr(self, "layers") else [])

    def fuse(self, aux):
        """aux [B, T, n*Ht] = concat of the n captured target hidden states -> g [B, T, H].
        norm_before_fc normalises the whole concatenation, then fc_norm each layer's slice
        (both engines' order), then fc."""
        x = aux
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            parts = x.chunk(len(self.fc_norm), dim=-1)
            x = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(x)

    def carry(self, h2, normed=None):
        """The feature the next draft step reads: h2, or norm(h2) with norm_output."""
        if not self.config.norm_output:
            return h2
        return self.norm(h2) if normed is None else normed

    def forward(self, input_ids, g, position_ids, cache=None, mask=None):
        """input_ids [B, T] target ids, g [B, T, H] features (fc(aux) or a previous step's carried
        feature), position_ids [B, T]. Returns (draft-vocab logits [B, T, Vd], the feature the next
        step reads [B, T, H]: h2, or norm(h2) with norm_output)."""
        e = self.embed_tokens(input_ids).to(g.dtype)
        cos, sin = self.rotary(position_ids, g.dtype)
        layers = self.decoder_layers()
        caches = (cache.layers if isinstance(cache, LayerCaches) else
                  [None] * len(layers) if cache is None else [cache])   # KVCache: one layer
        assert len(caches) == len(layers), "a multi-layer draft needs new_cache()'s LayerCaches"
        h = g
        for layer, c in zip(layers, caches):
            h = layer(e, h, cos, sin, c, mask)
        hn = self.norm(h)
        return self.lm_head(hn), self.carry(h, hn)

    def new_cache(self, batch=1, capacity=256):
        p = self.lm_head.weight
        make = lambda: KVCache(batch, self.config.num_key_value_heads, self.config.head_dim,
                               p.dtype, p.device, capacity)
        if self.config.num_hidden_layers == 1:
            return make()
        return LayerCaches([make() for _ in range(self.config.num_hidden_layers)])

    # ---- checkpoint format: config.json + model.safetensors, as SGLang loads them ----

    def export_state_dict(self):
        """Exactly the tensors SGLang expects. The embedding is the target's and is left out when
        H == Ht (SGLang substitutes the target's embedding anyway). A later layer's pre-attention
        norm is written twice: hidden_norm (SGLang reads it) and input_layernorm (vLLM reads it)."""
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        if self.config.hidden_size == self.config.target_hidden_size:
            sd.pop("embed_tokens.weight")
        for i in range(1, self.config.num_hidden_layers):
            sd[f"layers.{i}.input_layernorm.weight"] = sd[f"layers.{i}.hidden_norm.weight"].clone()
        return sd

    def save_pretrained(self, out_dir, dtype=None):
        """Write config.json and model.safetensors atomically (temp file + rename for each)."""
        from safetensors.torch import save_file
        os.makedirs(out_dir, exist_ok=True)
        dtype = dtype or self.lm_head.weight.dtype
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
              for k, v in self.export_state_dict().items()}
        cfg = self.config.to_sglang_json()
        cfg["torch_dtype"] = str(dtype).replace("torch.", "")
        atomic_write(os.path.join(out_dir, WEIGHTS_NAME),
                     lambda p: save_file(sd, p, metadata={"format": "pt"}))
        atomic_write_text(os.path.join(out_dir, CONFIG_NAME), json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path, embed_weight=None, dtype=None):
        """Load a draft directory. `embed_weight` (the target's embedding) is needed when the
        checkpoint has none. Any missing or unexpected tensor is an error: SGLang would silently
        leave it random, we refuse."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        cfg = read_config(path)
        wpath = os.path.join(path, WEIGHTS_NAME)
        if not os.path.exists(wpath):
            raise UserError(f"{path}: no {WEIGHTS_NAME}")
        try:
            sd = load_file(wpath)
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{wpath}: unreadable safetensors file ({e})")
        model = cls(cfg)
        from layouts import sglang_tensors
        sd = read_layout_tensors(sglang_tensors(path, sd), cfg, wpath)
        if "embed_tokens.weight" not in sd:
            if embed_weight is None:
                raise UserError(f"{wpath}: has no embed_tokens.weight; pass the target's embedding")
            sd["embed_tokens.weight"] = embed_weight
        want = model.state_dict()
        want = {k: v for k, v in want.items() if not k.startswith("rotary.")}
        missing = sorted(set(want) - set(sd))
        extra = sorted(set(sd) - set(want))
        if missing or extra:
            raise UserError(f"{wpath}: tensor names do not match an EAGLE-3 draft "
                            f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for k, v in sd.items():
            if tuple(v.shape) != tuple(want[k].shape):
                raise UserError(f"{wpath}: {k} has shape {list(v.shape)}, config.json implies "
                                f"{list(want[k].shape)}")
        # the vocabulary map must be one SGLang can use: draft id i -> target id i + d2t[i],
        # distinct, ascending, in range, and t2d marking exactly those ids
        ids = sd["d2t"].long() + torch.arange(cfg.draft_vocab_size)
        check_draft_ids(ids, cfg.draft_vocab_size, cfg.vocab_size, f"{wpath}: d2t")
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        if not torch.equal(sd["t2d"].bool(), t2d):
            raise UserError(f"{wpath}: t2d does not mark exactly the target ids that d2t maps to")
        model.load_state_dict(sd, strict=False)
        if dtype is not None:
            model.to(dtype)
        return model.eval()


# SGLang's legacy names for the fc_norm tensors (its load_weights renames them)
LEGACY_FC_NORM = {"aux_norm_low.weight": "fc_norm.0.weight", "aux_norm_mid.weight": "fc_norm.1.weight",
                  "aux_norm_high.weight": "fc_norm.2.weight"}


def read_layout_tensors(sd, cfg, wpath):
    """The checkpoint's tensors in this module's names: SGLang's legacy fc_norm names renamed,
    and a later layer's vLLM copy of its pre-attention norm (layers.{i}.input_layernorm) dropped
    after checking it equals the hidden_norm SGLang uses (if they differed, the two engines
    would run different drafts). A checkpoint without the copy is SGLang-only, still loaded."""
    sd = {LEGACY_FC_NORM.get(k, k): v for k, v in sd.items()}
    for i in range(1, cfg.num_hidden_layers):
        copy = sd.pop(f"layers.{i}.input_layernorm.weight", None)
        own = sd.get(f"layers.{i}.hidden_norm.weight")
        if copy is not None and own is not None and not torch.equal(copy, own):
            raise UserError(f"{wpath}: layers.{i}.input_layernorm.weight (vLLM reads it) differs "
                            f"from layers.{i}.hidden_norm.weight (SGLang reads it); expected equal")
    return sd


def check_draft_ids(ids, Vd, V, where):
    """The draft vocabulary is Vd distinct target ids, ascending (d2t[i] = ids[i] - i >= 0)."""
    if ids.numel() != Vd or not bool((ids[1:] > ids[:-1]).all()) or ids.min() < 0 or ids.max() >= V:
        raise UserError(f"{where}: expected {Vd} distinct ascending ids in [0, {V})")


def load_draft_for(path, target_model, dtype=None):
    """Load a draft and check it fits the target it will read (hidden size, vocab, layers)."""
    cfg = read_config(path)
    check_fits(cfg, target_model.config, where=os.path.join(path, CONFIG_NAME))
    emb = target_model.get_input_embeddings().weight.detach()
    draft = Eagle3Draft.from_pretrained(path, embed_weight=emb.float(), dtype=dtype)
    return draft.to(emb.device)


# ----------------------------------------------------------------------------------------------
# CLI

def describe(path):
    from safetensors import safe_open
    cfg = read_config(path)
    print(json.dumps(cfg.to_sglang_json(), indent=2))
    total = 0
    with safe_open(os.path.join(path, WEIGHTS_NAME), "pt") as f:
        for k in sorted(f.keys()):
            t = f.get_slice(k)
            shape = t.get_shape()
            total += math.prod(shape)
            print(f"{k:45s} {str(t.get_dtype()):6s} {shape}")
    print(f"total {total:,} elements")


def export_layout(args):
    """--export: the draft in the other public layout (layouts.py), checked to convert back exactly."""
    from layouts import export
    if not args.out:
        raise UserError("--export needs --out DIR")
    verifier = embed = None
    if args.target:   # speculators_config.verifier, and the embedding a speculators file carries
        from common import load_target_heads
        heads, _ = load_target_heads(args.target, args.trust_remote_code)
        tcfg = getattr(heads.config, "text_config", heads.config)
        check_fits(read_config(args.draft), tcfg, f"--target {args.target}")
        verifier = {"name_or_path": args.target,
                    "architectures": getattr(heads.config, "architectures", None) or []}
        embed = heads.get_input_embeddings().weight.detach()
    d_out = export(args.draft, args.export, args.out, verifier, embed)
    print(f"wrote {args.draft} in the {args.export} layout to {args.out}")
    if args.export == "sglang" and d_out.get("norm_before_residual"):
        print(f"note: {args.draft} has norm_before_residual true; SGLang 0.5.23 never reads it, "
              f"so only vLLM serves {args.out} as trained (speculate.py reads it right)")


def average(args):
    """--average: the uniform mean of several checkpoints' weights, written as one draft (LAWA,
    "latest weight averaging"). Late checkpoints of one run sit in one basin, each a noisy sample
    of where the optimizer wanders; their mean lands nearer its centre. That pays only once a run
    stops improving: a run still climbing is best at its last step (results/RUNS.md, session 32:
    every mean lost to it). The checkpoints must be one draft: same config, vocabulary map, tensors."""
    if not args.out:
        raise UserError("--average needs --out DIR")
    if len(args.average) < 2:
        raise UserError("--average needs two or more checkpoint directories")
    cfg0 = read_config(args.average[0])
    embed = torch.zeros(cfg0.vocab_size, cfg0.hidden_size)   # only lets a draft without one load
    total, d2t, first = None, None, None
    for path in args.average:
        cfg = read_config(path)
        if cfg.to_sglang_json() != cfg0.to_sglang_json():
            raise UserError(f"{os.path.join(path, CONFIG_NAME)}: differs from "
                            f"{os.path.join(args.average[0], CONFIG_NAME)}; expected checkpoints of one draft")
        draft = Eagle3Draft.from_pretrained(path, embed_weight=embed)
        first = draft if first is None else first    # the module the mean is written through
        sd = draft.export_state_dict()
        if d2t is not None and not torch.equal(sd["d2t"], d2t):
            raise UserError(f"{path}: its d2t (draft vocabulary) differs from {args.average[0]}'s")
        d2t = sd["d2t"]
        sd = {k: v.double() for k, v in sd.items() if v.is_floating_point()}   # the sum in fp64
        total = sd if total is None else {k: total[k] + v for k, v in sd.items()}
    from safetensors import safe_open
    with safe_open(os.path.join(args.average[0], WEIGHTS_NAME), "pt") as f:   # write the checkpoints'
        dtype = next(t.dtype for t in map(f.get_tensor, f.keys()) if t.is_floating_point())  # dtype
    own = first.state_dict()      # (export_state_dict's vLLM norm copies are not module tensors)
    first.load_state_dict({k: v / len(args.average) for k, v in total.items() if k in own}, strict=False)
    first.save_pretrained(args.out, dtype=dtype)
    print(f"wrote the mean of {len(args.average)} checkpoints to {args.out} ({str(dtype)[6:]})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("draft", nargs="?", help="a saved draft directory to describe")
    ap.add_argument("--target", default=None,
                    help="target model ('default' = SmolLM2-135M, the default when creating)")
    ap.add_argument("--out", help="where to write a fresh (untrained) draft, or the --export")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="rows of lm_head; default the whole target vocabulary")
    ap.add_argument("--aux-layers", type=int, nargs="+", default=None,
                    help="target layers to capture (default 1, L//2-1, L-4; two or more, e.g. five)")
    ap.add_argument("--draft-config", default=None,
                    help="JSON draft config (e.g. a public draft's config.json) whose shape fields "
                         "(heads, head_dim, MLP size, RoPE, max positions) replace the automatic choice")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run Python code shipped with the target (e.g. Kimi-K2's config)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the draft's config.json and parameter count; write nothing")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--doctor", action="store_true",
                    help="check the draft against its engines (and --target): doctor.py")
    ap.add_argument("--export", choices=["sglang", "speculators"],
                    help="write the draft in this layout to --out (layouts.py); exact round trip")
    ap.add_argument("--average", nargs="+", metavar="CKPT",
                    help="write the mean of these checkpoints' weights to --out (e.g. the last "
                         "quarter of a run's checkpoints/step-*)")
    return ap.parse_args(argv)


def create(args):
    """A fresh (untrained) draft for --target, written to --out (or described, --dry-run)."""
    args.target = args.target or "default"
    if not args.out and not args.dry_run:
        raise UserError("give a draft directory to describe, or --out DIR to create a draft")
    from common import load_config, parse_dtype
    # Only the target's config is read: the draft shares the target's embedding, which SGLang
    # substitutes at load time and which is not saved when H == Ht (always, see apply_draft_config).
    tcfg = load_config(args.target, args.trust_remote_code)
    tcfg = getattr(tcfg, "text_config", tcfg)
    V = tcfg.vocab_size
    if args.draft_vocab_size is not None and not 0 < args.draft_vocab_size <= V:
        raise UserError(f"--draft-vocab-size {args.draft_vocab_size}: expected 1..{V}")
    cfg = config_from_target(tcfg, args.draft_vocab_size, args.aux_layers)
    check_fits(cfg, tcfg, "--aux-layers")
    if args.draft_config:
        cfg = apply_draft_config(cfg, args.draft_config)
    with torch.device("meta"):   # shapes only, no memory: the count for --dry-run
        n = sum(p.numel() for p in Eagle3Draft(cfg).export_state_dict().values()
                if p.is_floating_point())
    if args.dry_run:
        print(json.dumps(cfg.to_sglang_json(), indent=2))
        print(f"{n:,} parameters ({n * 2 / 2**30:.2f} GiB in bf16), layers {cfg.aux_layer_ids}, "
              f"draft vocab {cfg.draft_vocab_size}")
        return
    draft = Eagle3Draft(cfg)
    draft.save_pretrained(args.out, dtype=parse_dtype(args.dtype))
    print(f"wrote an untrained draft to {args.out}: {n:,} parameters, layers {cfg.aux_layer_ids}, "
          f"draft vocab {cfg.draft_vocab_size}")


def main(argv=None):
    args = parse_args(argv)
    if args.average:
        if args.draft or args.export or args.doctor:
            raise UserError("--average takes its checkpoints after the flag: "
                            "python model.py --average CKPT CKPT ... --out DIR")
        return average(args)
    if args.draft and args.doctor:
        import doctor
        return doctor.main(args.draft, args.target, args.trust_remote_code)
    if args.draft and args.export:
        return export_layout(args)
    if args.draft:
        return describe(args.draft)
    if args.export or args.doctor:
        raise UserError("--export / --doctor need a draft directory: python model.py DRAFT ...")
    return create(args)


if __name__ == "__main__":
    run_main(main)
