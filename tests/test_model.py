"""The draft head: SGLang's checkpoint contract, round trip, and the one-step math."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from conftest import make_tiny_target
from common import UserError
from model import Eagle3Draft, fc_weight_for_features, load_draft_for
from draft_config import check_fits, config_from_target, default_aux_layers, read_config

# The names and shapes SGLang's LlamaForCausalLMEagle3.load_weights expects (reference §1).
# SGLang ignores unknown names and leaves missing ones random, so this list is the contract.
def expected_tensors(H, Ht, nh, nkv, hd, I, V, Vd):
    return {
        "fc.weight": [H, 3 * Ht],
        "midlayer.hidden_norm.weight": [H],
        "midlayer.input_layernorm.weight": [H],
        "midlayer.self_attn.q_proj.weight": [nh * hd, 2 * H],
        "midlayer.self_attn.k_proj.weight": [nkv * hd, 2 * H],
        "midlayer.self_attn.v_proj.weight": [nkv * hd, 2 * H],
        "midlayer.self_attn.o_proj.weight": [H, nh * hd],
        "midlayer.post_attention_layernorm.weight": [H],
        "midlayer.mlp.gate_proj.weight": [I, H],
        "midlayer.mlp.up_proj.weight": [I, H],
        "midlayer.mlp.down_proj.weight": [H, I],
        "norm.weight": [H],
        "lm_head.weight": [Vd, H],
        "d2t": [Vd],
        "t2d": [V],
    }


SGLANG_CONFIG_KEYS = ["architectures", "model_type", "hidden_size", "intermediate_size",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                      "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size",
                      "draft_vocab_size", "num_hidden_layers", "tie_word_embeddings",
                      "target_hidden_size", "eagle_config", "hidden_act", "torch_dtype"]


def fresh_draft(target, Vd=40, seed=0):
    torch.manual_seed(seed)
    cfg = config_from_target(target.config, draft_vocab_size=Vd)
    d = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    ids = torch.randperm(target.config.vocab_size)[:Vd].sort().values
    d.set_vocab(ids)
    return d, ids


def test_default_layers_and_config_from_target():
    t = make_tiny_target(layers=8, hidden_size=32, heads=4, kv_heads=2, rope_theta=5e5, max_positions=777)
    cfg = config_from_target(t.config, draft_vocab_size=40)
    assert cfg.aux_layer_ids == [1, 3, 4] == default_aux_layers(8)
    assert default_aux_layers(30) == [1, 14, 26]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None and cfg.max_position_embeddings == 777
    assert cfg.intermediate_size == t.config.intermediate_size
    assert cfg.rms_norm_eps == t.config.rms_norm_eps


def test_default_aux_layers_are_distinct_for_small_targets():
    # [1, L//2-1, L-4] is kept wherever it is already three distinct layers (L >= 7: the
    # 30-layer default target's shipped draft reads [1, 14, 26]); below that it would repeat a
    # layer (L = 6: [1, 2, 2]), so the lowest, middle and highest usable layers are taken
    for L in range(4, 130):
        ids = default_aux_layers(L)
        assert ids == sorted(set(ids)) and len(ids) == 3 and 0 <= ids[0] and ids[2] <= L - 2, L
        if L >= 7:
            assert ids == [1, L // 2 - 1, L - 4]
    assert [default_aux_layers(L) for L in (4, 5, 6)] == [[0, 1, 2], [0, 1, 3], [0, 2, 4]]
    for L in (1, 2, 3):   # only L-1 usable layers (the last is seen final-normed): too few
        with pytest.raises(UserError, match="at least 4 layers"):
            default_aux_layers(L)
        with pytest.raises(UserError, match="at least 4 layers"):
            config_from_target(make_tiny_target(layers=L).config, 40)


def test_model_cli_dry_run_and_draft_config(tmp_path, capsys):
    import model
    t = make_tiny_target(layers=6)
    t.save_pretrained(tmp_path / "t")
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"intermediate_size": 48, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 1e6}))
    model.main(["--target", str(tmp_path / "t"), "--draft-vocab-size", "40", "--dry-run",
                "--draft-config", str(p)])
    out = capsys.readouterr().out
    cfg = json.loads(out[:out.rindex("}") + 1])
    assert (cfg["intermediate_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (48, 2, 16)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert not os.path.exists(tmp_path / "out")
    model.main(["--target", str(tmp_path / "t"), "--draft-vocab-size", "40", "--out",
                str(tmp_path / "out"), "--draft-config", str(p)])
    d = read_config(str(tmp_path / "out"))
    assert (d.intermediate_size, d.num_key_value_heads, d.rope_theta) == (48, 1, 1e6)
    load_draft_for(str(tmp_path / "out"), t)   # loads strictly against the target
    p.write_text(json.dumps({"vocab_size": 5}))
    with pytest.raises(UserError, match="vocab_size is 5"):
        model.main(["--target", str(tmp_path / "t"), "--dry-run", "--draft-config", str(p)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sglang_checkpoint_contract(tmp_path, dtype):
    t = make_tiny_target(vocab_size=64, hidden_size=32, heads=4, kv_heads=2)
    d, ids = fresh_draft(t, Vd=40)
    d.save_pretrained(tmp_path, dtype=dtype)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    want = expected_tensors(H=32, Ht=32, nh=4, nkv=2, hd=8, I=64, V=64, Vd=40)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert set(got) == set(want), "tensor names must be exactly SGLang's (no embed when H == Ht)"
    for k, shape in want.items():
        assert list(got[k].shape) == shape, k
        if k == "d2t":
            assert got[k].dtype == torch.int64
        elif k == "t2d":
            assert got[k].dtype == torch.bool
        else:
            assert got[k].dtype == dtype, k
    # d2t holds offsets: target id of draft id i is i + d2t[i] (SGLang: hot_token_id = d2t + arange)
    assert torch.equal(got["d2t"] + torch.arange(40), ids)
    assert torch.equal(got["t2d"].nonzero().flatten(), ids)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for k in SGLANG_CONFIG_KEYS:
        assert k in cfg, k
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 64
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                   "use_aux_hidden_state": True}
    assert cfg["max_position_embeddings"] == t.config.max_position_embeddings
    assert cfg["torch_dtype"] == str(dtype).replace("torch.", "")


def test_round_trip_identical_outputs(tmp_path):
    t = make_tiny_target()
    d, _ = fresh_draft(t)
    d.save_pretrained(tmp_path, dtype=torch.float32)
    d2 = load_draft_for(str(tmp_path), t)
    for (k, a), (k2, b) in zip(d.state_dict().items(), d2.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    aux = torch.randn(1, 5, 96)
    ids = torch.randint(0, 64, (1, 5))
    pos = torch.arange(5)[None]
    with torch.no_grad():
        a = d(ids, d.fuse(aux), pos)
        b = d2(ids, d2.fuse(aux), pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_one_step_math_matches_reference_formula():
    """h2 = g + attn(cat(norm(e), norm(g))) + mlp(...); logits = lm_head(norm(h2)); embedding first."""
    t = make_tiny_target()
    d, _ = fresh_draft(t)
    T = 4
    aux = torch.randn(1, T, 96)
    ids = torch.randint(0, 64, (1, T))
    pos = torch.arange(T)[None]
    with torch.no_grad():
        logits, h2 = d(ids, d.fuse(aux), pos)
        m = d.midlayer
        g = aux @ d.fc.weight.T
        e = d.embed_tokens(ids)
        rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = torch.cat([rms(e, m.input_layernorm.weight), rms(g, m.hidden_norm.weight)], -1)
        a = m.self_attn
        q = (x @ a.q_proj.weight.T).view(1, T, 4, 8).transpose(1, 2)
        k = (x @ a.k_proj.weight.T).view(1, T, 2, 8).transpose(1, 2)
        v = (x @ a.v_proj.weight.T).view(1, T, 2, 8).transpose(1, 2)
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        ang = pos[0, :, None].float() * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        rot = lambda z: torch.cat([-z[..., 4:], z[..., :4]], -1)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        att = (q @ k.transpose(-1, -2)) / 8 ** 0.5
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(1, T, 32) @ a.o_proj.weight.T
        h1 = g + o
        mm = m.mlp
        y = rms(h1, m.post_attention_layernorm.weight)
        ref_h2 = h1 + (torch.nn.functional.silu(y @ mm.gate_proj.weight.T) * (y @ mm.up_proj.weight.T)) @ mm.down_proj.weight.T
        ref_logits = rms(ref_h2, d.norm.weight) @ d.lm_head.weight.T
    torch.testing.assert_close(h2, ref_h2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_cached_decoding_equals_full_forward():
    """Row-by-row with the KV cache gives the same outputs as one causal pass."""
    t = make_tiny_target()
    d, _ = fresh_draft(t)
    T = 7
    aux, ids, pos = torch.randn(1, T, 96), torch.randint(0, 64, (1, T)), torch.arange(T)[None]
    with torch.no_grad():
        full, fh = d(ids, d.fuse(aux), pos)
        cache = d.new_cache(capacity=2)   # forces the buffer to grow
        outs = [d(ids[:, :3], d.fuse(aux[:, :3]), pos[:, :3], cache)[0]]
        for i in range(3, T):
            outs.append(d(ids[:, i:i + 1], d.fuse(aux[:, i:i + 1]), pos[:, i:i + 1], cache)[0])
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_fit_checks_name_the_problem():
    t = make_tiny_target(layers=8)
    cfg = config_from_target(t.config, 40)
    check_fits(cfg, t.config)
    other = make_tiny_target(hidden_size=48, heads=4)
    with pytest.raises(UserError, match="hidden_size"):
        check_fits(cfg, other.config)
    with pytest.raises(UserError, match="vocab_size"):
        check_fits(cfg, make_tiny_target(vocab_size=80).config)
    with pytest.raises(UserError, match="layer"):
        check_fits(config_from_target(t.config, 40, [1, 3, 7]), t.config)  # 7 = L-1 is post-norm


def test_loading_refuses_renamed_or_missing_tensors(tmp_path):
    from safetensors.torch import load_file, save_file
    t = make_tiny_target()
    d, _ = fresh_draft(t)
    d.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["layers.0.mlp.up_proj.weight"] = sd.pop("midlayer.mlp.up_proj.weight")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="tensor names"):
        load_draft_for(str(tmp_path), t)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="unreadable"):
        load_draft_for(str(tmp_path), t)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(UserError, match="not valid JSON"):
        read_config(str(tmp_path))
    with pytest.raises(UserError, match="no such directory"):
        read_config(str(tmp_path / "nope"))


def test_fc_init_for_features_balances_layers():
    """fc_weight_for_features (train.py --fc-init rms): g = fc(aux) starts at RMS ~1 with each
    captured layer contributing a third of the variance, however different the layers' scales
    (the default std-0.02 init lets the deepest, largest layer dominate g, and makes g ~50x the
    attention branch on SmolLM2)."""
    torch.manual_seed(0)
    H, Ht = 64, 256
    rms = torch.tensor([2.7, 6.2, 22.9])
    aux = torch.randn(4096, 3, Ht) * rms[None, :, None]           # blocks of those RMS
    W = fc_weight_for_features(H, Ht, rms, torch.Generator().manual_seed(0))
    assert W.shape == (H, 3 * Ht)
    g = aux.reshape(4096, -1) @ W.T
    assert abs(g.pow(2).mean().sqrt().item() - 1.0) < 0.1
    for i in range(3):
        assert abs((aux[:, i] @ W[:, i * Ht:(i + 1) * Ht].T).pow(2).mean().item() - 1 / 3) < 0.05
    # the plain init, for contrast: the deepest layer carries nearly all of g
    Wf = torch.randn(H, 3 * Ht) * 0.02
    share = [(aux[:, i] @ Wf[:, i * Ht:(i + 1) * Ht].T).pow(2).mean().item() for i in range(3)]
    assert share[2] / sum(share) > 0.9
