"""How a new draft's weights start, before training (train.py calls these; the math of a step is
ttt.py): fc scaled to the captured features (--fc-init rms), lm_head from the target's read-out
(--lm-head-init target, --freeze-lm-head) and the decoder layer from one of the target's layers
(--layer-init-from)."""
import sys

import torch
import torch.distributed as dist

from common import UserError


@torch.no_grad()
def init_fc_for_features(module, hidden, seed):
    """--fc-init rms (model.fc_weight_for_features): measure the captured layers' scale on the
    hidden states of a few sequences (the median row RMS of each layer: the first row of a
    sequence, an attention sink, can be 100x the rest) and redraw fc for it. Done after
    sharding: every rank draws the same full matrix from a seeded generator and keeps its shard,
    so N processes start where one does. The RMS is of the features as fc sees them: after the
    layout's norm_before_fc / fc_norm (model.py), here at their fresh weights of one, so as plain
    x / rms(x) (the weights are DTensor shards by now). Returns the RMS [n], one per layer."""
    from model import fc_weight_for_features
    cfg = module.draft.config
    unit = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    aux = torch.cat([a for a, _ in hidden]).float()
    if cfg.norm_before_fc:
        aux = unit(aux)
    aux = aux.view(aux.shape[0], len(cfg.aux_layer_ids), -1)
    if cfg.fc_norm:
        aux = unit(aux)
    rms = aux.pow(2).mean(-1).sqrt().median(0).values
    if not bool(torch.isfinite(rms).all()) or not bool((rms > 0).all()):
        raise UserError(f"--fc-init rms: the target's hidden states of the first training "
                        f"sequences have RMS {rms.tolist()} (not finite or zero); check the data, "
                        f"or use --fc-init normal")
    w = module.draft.fc.weight
    full = fc_weight_for_features(w.shape[0], w.shape[1] // len(rms), rms,
                                  torch.Generator().manual_seed(seed)).to(w.dtype)
    if hasattr(w, "device_mesh"):    # an FSDP2 DTensor: keep this rank's shard
        from torch.distributed.tensor import distribute_tensor
        full = distribute_tensor(full.to(w.device_mesh.device_type), w.device_mesh, w.placements)
    w.copy_(full)
    return rms


@torch.no_grad()
def init_lm_head(draft, target, args):
    """--lm-head-init target: lm_head starts as the target's own read-out restricted to the draft
    vocabulary (row i = the target's row for draft id i); the target's lm_head reads its final-
    normed state as the draft's reads its own. --freeze-lm-head then keeps it fixed (before FSDP
    wraps the module, so the optimizer never sees it)."""
    if args.lm_head_init == "target":
        w = target.get_output_embeddings().weight
        if w.shape[1] != draft.lm_head.weight.shape[1]:
            raise UserError(f"--lm-head-init target: the target's lm_head is {w.shape[1]} wide, "
                            f"the draft's {draft.lm_head.weight.shape[1]}")
        draft.lm_head.weight.copy_(w[draft.draft_ids].float())
    if args.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)


def init_layer_from_target(draft, args, seqs):
    """--layer-init-from L: the draft's decoder layer starts as the target's layer L wherever the
    two read the same thing. The draft's attention reads [input_layernorm(e), hidden_norm(g)]
    (2H wide); the target's reads input_layernorm(x) (H). So q/k/v's second half of columns (the
    feature half) and hidden_norm take the target's q/k/v and input_layernorm; the token half
    keeps its random start. post_attention_layernorm and the MLP's gate/up are copied whole.
    Scale: the target's layer maps x -> x + a(norm x) + m(norm(x + a)); both branches read
    normed inputs, so with o_proj and down_proj multiplied by c it maps x/r -> layer(x)/r for
    c = 1/r. The target's stream enters layer L at RMS r (29.5 in SmolLM2's last layer), the
    draft's g at ~1 (--fc-init rms), so c = 1/r, r measured on the first data sequences (median
    per-row RMS; row 0, the attention sink, is skipped): the layer's updates keep their size
    relative to the stream they add to. A trained layer instead of a random one is the lever
    (issue 23: learn more per FLOP early); head shapes and RoPE come from the target's config.
    Measured (results/RUNS.md, session 41): -0.169 held-out accept length at 740k tokens against
    a random start; the copied matrices are ~3x larger and Muon's fixed-size steps move them
    slowly. Not in the recipe."""
    if args.layer_init_from is None or args.resume:   # a resumed run loads its own weights
        return None
    from common import load_target
    model, _ = load_target(args.target, "float32", "cpu", args.trust_remote_code)  # once, whole
    layers = model.get_decoder().layers
    L = args.layer_init_from
    if not -len(layers) <= L < len(layers):
        raise UserError(f"--layer-init-from {L}: the target has {len(layers)} decoder layers "
                        f"(expected 0..{len(layers) - 1}, or negative from the end)")
    L %= len(layers)
    rows = []
    with torch.no_grad():
        for q in seqs[:8]:
            ids = torch.tensor(q["input_ids"][:256])[None]
            x = model(ids, output_hidden_states=True).hidden_states[L][0, 1:]   # input of layer L
            rows.append(x.float().pow(2).mean(-1).sqrt())
    r = float(torch.cat(rows).median())
    src, dst = layers[L], draft.midlayer
    H = draft.config.hidden_size
    pairs = [(dst.self_attn.o_proj.weight, src.self_attn.o_proj.weight, 1 / r),
             (dst.post_attention_layernorm.weight, src.post_attention_layernorm.weight, 1.0),
             (dst.hidden_norm.weight, src.input_layernorm.weight, 1.0),
             (dst.mlp.gate_proj.weight, src.mlp.gate_proj.weight, 1.0),
             (dst.mlp.up_proj.weight, src.mlp.up_proj.weight, 1.0),
             (dst.mlp.down_proj.weight, src.mlp.down_proj.weight, 1 / r)]
    pairs += [(getattr(dst.self_attn, n).weight[:, H:], getattr(src.self_attn, n).weight, 1.0)
              for n in ("q_proj", "k_proj", "v_proj")]
    for d, w, _ in pairs:
        if d.shape != w.shape:
            raise UserError(f"--layer-init-from {L}: the draft's layer has {tuple(d.shape)} "
                            f"where the target's has {tuple(w.shape)}; it needs the target's "
                            f"hidden, head and MLP sizes")
    with torch.no_grad():
        for d, w, c in pairs:
            d.copy_(w.float() * c)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"decoder layer initialised from the target's layer {L} (its input RMS {r:.4g}: "
              f"o_proj and down_proj x {1 / r:.4g})", file=sys.stderr)
    return r
