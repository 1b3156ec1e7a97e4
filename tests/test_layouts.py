"""Every EAGLE-3 layout SGLang 0.5.23's LlamaForCausalLMEagle3 loads (model.py, "Layouts"):
per-layer fc_norm, norm_before_fc, norm_output, num_hidden_layers > 1, more than three aux layers.

For each: the checkpoint round trip; the draft's forward against an independent transcription of
the engines' forward (from the saved tensors and config.json alone, in the engines' own fused-
residual form); TTT equal to step-by-step cached decoding, and a training step; speculate.py
token-identical to the target's greedy decoding (fp32); train.py end to end with a --draft-config.
A key the project does not apply is an error. The engines' loaders are checked against the pinned
wheels in tests/test_engine_checkpoints.py."""
import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import make_tiny_target
from runscript import run_script
from lookup_fixture import LAYOUTS as LOOKUP_LAYOUTS, lookup_prompts, make_layout_draft
from lookup_fixture import make_target as make_lookup_target
from common import UserError
from model import Eagle3Draft, load_draft_for
from draft_config import config_from_target, read_config
import ttt

V, VD, L = 64, 48, 8
LAYOUTS = {
    "default": {},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "two_layers": {"num_hidden_layers": 2},
    "five_aux": {"aux": [0, 1, 3, 4, 6]},
    "everything": {"fc_norm": True, "norm_before_fc": True, "norm_output": True,
                   "num_hidden_layers": 3, "aux": [0, 2, 3, 5, 6]},
}


def make_draft(layout, seed=0, target=None, scale=0.3):
    """A draft of the layout with weights far from their init (norm weights too), so every
    tensor changes the output."""
    t = target or make_tiny_target(vocab_size=V, layers=L)
    opts = dict(LAYOUTS[layout])
    cfg = config_from_target(t.config, VD, opts.pop("aux", None))
    cfg = dataclasses.replace(cfg, **opts)
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg, t.get_input_embeddings().weight)
    d.set_vocab(torch.randperm(V)[:VD].sort().values)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.requires_grad:
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else scale * torch.randn_like(p))
    return t, d.eval()


def expected_names(cfg):
    layer = ["hidden_norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj", "input_layernorm"]
    names = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    names |= {f"midlayer.{n}.weight" for n in layer}
    names |= {f"layers.{i}.{n}.weight" for i in range(1, cfg["num_hidden_layers"]) for n in layer}
    if cfg.get("fc_norm"):
        names |= {f"fc_norm.{i}.weight" for i in range(len(cfg["eagle_aux_hidden_state_layer_ids"]))}
    if cfg["eagle_config"].get("norm_before_fc"):
        names.add("input_norm.weight")
    return names


# ----------------------------------------------------------------------------------------------
# The engines' forward, written out from the checkpoint (SGLang's LlamaModel.forward and
# LlamaDecoderLayer.forward; vLLM's differs only in which name a later layer's first norm has)

def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def attention(x, sd, p, cfg, pos):
    T = x.shape[0]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1)
    k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda z: torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1)
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    s = (q @ k.transpose(-1, -2)) / hd ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T


def engine_forward(sd, cfg, emb, ids, hidden, pos, engine):
    """ids [T], hidden [T, n*Ht] (target features) or [T, H] (a previous step's output), pos [T].
    Returns (logits [T, Vd], the hidden state the next draft step gets)."""
    H = cfg["hidden_size"]
    n = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    h = hidden
    if h.shape[-1] != H:                                   # target features: through fc
        if cfg["eagle_config"].get("norm_before_fc", False):
            h = rms(h, sd["input_norm.weight"])
        if cfg.get("fc_norm", False):
            h = torch.cat([rms(c, sd[f"fc_norm.{i}.weight"]) for i, c in enumerate(h.chunk(n, -1))], -1)
        h = h @ sd["fc.weight"].T
    e = emb[ids]
    residual = None
    for i in range(cfg["num_hidden_layers"]):
        p = "midlayer." if i == 0 else f"layers.{i}."
        if i == 0:
            residual = h
            x = torch.cat([rms(e, sd[p + "input_layernorm.weight"]), rms(h, sd[p + "hidden_norm.weight"])], -1)
        else:   # SGLang: hidden_norm(h, residual); vLLM: input_layernorm(h, residual)
            residual = h + residual
            x = rms(residual, sd[p + ("hidden_norm" if engine == "sglang" else "input_layernorm") + ".weight"])
        h = attention(x, sd, p, cfg, pos)
        residual = h + residual
        y = rms(residual, sd[p + "post_attention_layernorm.weight"])
        h = (F.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
    out = h + residual
    normed = rms(out, sd["norm.weight"])
    return normed @ sd["lm_head.weight"].T, normed if cfg.get("norm_output", False) else out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_and_forward_equals_engine_math(layout, tmp_path):
    t, d = make_draft(layout)
    d.save_pretrained(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    sd = load_file(tmp_path / "model.safetensors")
    assert set(sd) == expected_names(cfg)
    n = len(d.config.aux_layer_ids)
    assert sd["fc.weight"].shape == (32, n * 32)
    d2 = load_draft_for(str(tmp_path), t)
    assert d2.config == dataclasses.replace(d.config, torch_dtype="float32")
    T = 9
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (T,), generator=g)
    aux = torch.randn(T, n * 32, generator=g) * torch.tensor([1.0, 4, 9, 2, 6][:n]).repeat_interleave(32)
    pos = torch.arange(T)
    emb = t.get_input_embeddings().weight
    with torch.no_grad():
        lg, f = d(ids[None], d.fuse(aux[None]), pos[None])
        lg2, f2 = d2(ids[None], d2.fuse(aux[None]), pos[None])
        assert torch.equal(lg, lg2) and torch.equal(f, f2)
        ids2 = torch.randint(0, V, (T,), generator=g)   # a next step reading the carried state
        nlg, nf = d(ids2[None], f, pos[None] + 1)
        for engine in ("sglang", "vllm"):
            rl, rf = engine_forward(sd, cfg, emb, ids, aux, pos, engine)
            torch.testing.assert_close(lg[0], rl, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(f[0], rf, atol=1e-4, rtol=1e-4)
            rl2, rf2 = engine_forward(sd, cfg, emb, ids2, rf, pos + 1, engine)
            torch.testing.assert_close(nlg[0], rl2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(nf[0], rf2, atol=1e-4, rtol=1e-4)
    if cfg.get("norm_output"):   # the carried state is the normed one: unit RMS times norm.weight
        unit = (f / sd["norm.weight"]).pow(2).mean(-1)
        torch.testing.assert_close(unit, torch.ones_like(unit), atol=1e-3, rtol=1e-3)


def test_each_option_changes_the_draft():
    """No option is a no-op: the same weights with one option off give other outputs."""
    base = make_draft("everything")[1]
    T, g = 6, torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (1, T), generator=g)
    aux = torch.randn(1, T, 5 * 32, generator=g) * 5
    pos = torch.arange(T)[None]
    with torch.no_grad():
        ref = base(ids, base.fuse(aux), pos)
        for k in ("fc_norm", "norm_before_fc", "norm_output"):
            other = Eagle3Draft(dataclasses.replace(base.config, **{k: False}))
            other.load_state_dict(base.state_dict(), strict=False)
            out = other(ids, other.fuse(aux), pos)
            assert not torch.allclose(out[1], ref[1], atol=1e-3), k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ttt_equals_cached_decoding_and_trains(layout):
    """TTT row t at step j == a prefill over rows 0..t into the draft's KV cache(s), then j
    single cached steps feeding the carried state; then one optimizer step moves every tensor."""
    t, d = make_draft(layout)
    n = len(d.config.aux_layer_ids)
    B, T, J = 2, 8, 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, n * 32, generator=g)
    worst = 0.0
    with torch.no_grad():
        h2s = list(ttt.ttt_unroll(d, ids, aux, J))
        logits = [d.lm_head(d.norm(h)) for h in h2s]
        for b in range(B):
            for r in range(T - 1):
                cache = d.new_cache(1, capacity=2)   # grows
                lg, f = d(ids[b:b + 1, 1:r + 2], d.fuse(aux[b:b + 1, :r + 1]), torch.arange(r + 1)[None], cache)
                for j in range(min(J, T - r - 1)):
                    if j > 0:
                        lg, f = d(ids[b:b + 1, r + j + 1:r + j + 2], f[:, -1:], torch.tensor([[r + j]]), cache)
                    worst = max(worst, (logits[j][b, r] - lg[0, -1]).abs().max().item(),
                                (d.carry(h2s[j][b, r]) - f[0, -1]).abs().max().item())
    assert worst < 1e-4, worst
    # one training step: finite loss, a gradient on every trainable tensor, every one moves
    d.train()
    targ_p = torch.softmax(torch.randn(B * T, VD, generator=g) * 3, -1)
    valid = torch.ones(J, B, T, dtype=torch.bool)
    for j in range(J):
        valid[j, :, T - j - 2:] = False
    loss, _, _ = ttt.TTTLoss(d, J)(ids, aux, targ_p, targ_p.argmax(-1), valid,
                                   valid.sum((1, 2)).float(), 1.0)
    assert torch.isfinite(loss)
    loss.backward()
    before = {k: p.detach().clone() for k, p in d.named_parameters() if p.requires_grad}
    torch.optim.SGD([p for p in d.parameters() if p.requires_grad], lr=0.1).step()
    still = [k for k, p in d.named_parameters() if p.requires_grad and torch.equal(p, before[k])]
    assert not still, still


@pytest.mark.parametrize("layout", ["eagle3.1", "two_layers", "five_aux", "everything"])
def test_speculate_lossless(layout):
    from speculate import Speculator, target_generate
    t = make_tiny_target(vocab_size=V, layers=L, seed=2)
    with torch.no_grad():
        t.lm_head.weight.mul_(20)   # logit gaps far above fp32 noise
    _, d = make_draft(layout, target=t, scale=0.1)
    g = torch.Generator().manual_seed(4)
    for steps, topk, ndt in [(3, 1, 4), (4, 4, 8)]:
        spec = Speculator(t, d, steps, topk, ndt, stop_ids=())
        for i in range(3):
            p = torch.randint(0, V, (5 + 3 * i,), generator=g).tolist()
            ref, _ = target_generate(t, p, 16)
            out, _ = spec.generate(p, 16)
            assert out == ref, (layout, steps, topk, i)


def lookup_rounds(target, draft, prompts):
    """Drafts accepted in each round of speculate.py's chain 3/1/4, per prompt; lossless."""
    from speculate import Speculator, target_generate
    spec = Speculator(target, draft, 3, 1, 4, stop_ids=())
    runs = [spec.generate(p, 32) for p in prompts]
    for p, (out, _) in zip(prompts, runs):
        assert out == target_generate(target, p, 32)[0]
    return [s["accepted"] for _, s in runs]


@pytest.fixture(scope="module")
def lookup_base():
    """The lookup target (8 layers deep), prompts, and the default-layout draft's rounds."""
    target = make_lookup_target(0, layers=8)
    prompts = lookup_prompts(3, seed=1)
    base = lookup_rounds(target, make_layout_draft(target, [0, 3, 6]), prompts)
    assert sum(map(sum, base)) >= 2 * sum(map(len, base))            # mostly accepted
    return target, prompts, base


@pytest.mark.parametrize("layout", list(LOOKUP_LAYOUTS))
def test_lookup_draft_in_each_layout_is_accepted_alike(layout, lookup_base):
    """The lookup fixture's hand-built draft, rebuilt in each layout, computes the default
    layout's function, so speculate.py must commit the same tokens in every round as with the
    default-layout draft (72 drafts accepted in 29 rounds), and stay lossless. Each option does
    necessary work there: a draft built with it and run without it accepted 13 in 80 rounds
    (fc_norm or input_norm ignored), 45 in 49 (norm_output ignored), 3 in 90 (layers 1-2 flat)."""
    target, prompts, base = lookup_base
    aux, opts = LOOKUP_LAYOUTS[layout]
    assert lookup_rounds(target, make_layout_draft(target, aux, **opts), prompts) == base


# ----------------------------------------------------------------------------------------------
# Config keys: applied, or refused

def target_dir(tmp_path):
    t = make_tiny_target(vocab_size=V, layers=L)
    t.save_pretrained(tmp_path / "t")
    return str(tmp_path / "t")


def test_model_cli_applies_layout_keys(tmp_path):
    """The issue's case: {"fc_norm": true, "norm_output": true} was written without either."""
    import model
    tdir = target_dir(tmp_path)
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"fc_norm": True, "norm_output": True, "num_hidden_layers": 2,
                             "eagle_config": {"norm_before_fc": True}}))
    model.main(["--target", tdir, "--out", str(tmp_path / "d"), "--draft-config", str(c),
                "--aux-layers", "0", "1", "3", "4", "6", "--draft-vocab-size", "40"])
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["num_hidden_layers"] == 2
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 3, 4, 6],
                                   "use_aux_hidden_state": True, "norm_before_fc": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4, 5, 7]
    assert set(load_file(tmp_path / "d" / "model.safetensors")) == expected_names(cfg)
    d = read_config(str(tmp_path / "d"))
    assert (d.fc_norm, d.norm_output, d.norm_before_fc, d.num_hidden_layers) == (True, True, True, 2)
    # the default layout writes none of the flags: configs of existing drafts are unchanged
    model.main(["--target", tdir, "--out", str(tmp_path / "d0")])
    cfg0 = json.loads((tmp_path / "d0" / "config.json").read_text())
    assert not {"fc_norm", "norm_output"} & set(cfg0) and "norm_before_fc" not in cfg0["eagle_config"]


@pytest.mark.parametrize("keys,msg", [
    ({"foo": 1}, "unknown key 'foo'"),
    ({"norm_before_residual": 1}, "norm_before_residual must be true or false"),
    ({"attention_bias": True}, "attention_bias is True"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings is True"),
    ({"eagle_config": {"extra": 1}}, "unknown eagle_config key 'extra'"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state must be true"),
    ({"fc_norm": "yes"}, "fc_norm must be true or false"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_aux_hidden_states": 5}, "num_aux_hidden_states 5"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 3, 4]}, "top-level eagle_aux_hidden_state_layer_ids"),
    ({"layer_types": ["sliding_attention"]}, "sliding attention with sliding_window None"),
    ({"layer_types": ["full_attention", "sliding_attention"], "num_hidden_layers": 2},
     "expected all full_attention or all sliding_attention"),
])
def test_unapplied_keys_are_one_line_errors(tmp_path, keys, msg):
    import model
    tdir = target_dir(tmp_path)
    c = tmp_path / "c.json"
    c.write_text(json.dumps(keys))
    with pytest.raises(UserError, match=msg) as e:
        model.main(["--target", tdir, "--dry-run", "--draft-config", str(c)])
    assert "\n" not in str(e.value) and str(c) in str(e.value)


def test_saved_config_with_unapplied_key_is_refused(tmp_path):
    t, d = make_draft("eagle3.1")
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, mlp_bias=True)))
    with pytest.raises(UserError, match="mlp_bias"):
        load_draft_for(str(tmp_path), t)
    # SGLang's legacy spelling: use_aux_norm + aux_norm_low/mid/high, read as fc_norm
    from safetensors.torch import save_file
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in dict(cfg, use_aux_norm=True).items() if k != "fc_norm"}))
    sd = load_file(tmp_path / "model.safetensors")
    for i, old in enumerate(["aux_norm_low", "aux_norm_mid", "aux_norm_high"]):
        sd[f"{old}.weight"] = sd.pop(f"fc_norm.{i}.weight")
    save_file(sd, tmp_path / "model.safetensors")
    d2 = load_draft_for(str(tmp_path), t)
    assert d2.config.fc_norm and torch.equal(d2.fc_norm[2].weight, d.fc_norm[2].weight)


def test_later_layer_norm_copies_must_agree(tmp_path):
    """layers.i.input_layernorm (vLLM) must equal layers.i.hidden_norm (SGLang)."""
    from safetensors.torch import save_file
    t, d = make_draft("two_layers")
    d.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["layers.1.input_layernorm.weight"] = sd["layers.1.input_layernorm.weight"] * 2
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="layers.1.input_layernorm.weight .*differs"):
        load_draft_for(str(tmp_path), t)


# ----------------------------------------------------------------------------------------------
# train.py end to end: a layout from --draft-config, five aux layers from the data

def test_train_py_with_every_option(tmp_path):
    from test_train import FP32, build_data, run_train, save_tiny_target
    from safetensors.torch import save_file
    from common import load_target
    from hidden import target_hidden_states
    import rundir
    tdir = save_tiny_target(tmp_path / "t")
    data = build_data(tmp_path / "data", tdir, n=8, hidden=False)
    layers = [0, 1, 3, 4, 6]   # five aux layers: rewrite the data's hidden states for them
    man = json.loads(open(os.path.join(data, "manifest.json")).read())
    seqs = [json.loads(x) for x in open(os.path.join(data, "sequences.jsonl"))]
    target, _ = load_target(tdir)
    hs = target_hidden_states(target, [s["input_ids"] for s in seqs], layers)
    os.makedirs(os.path.join(data, "hidden"), exist_ok=True)
    save_file({**{f"aux.{k}": a.float().contiguous() for k, (a, _) in enumerate(hs)},
               **{f"final.{k}": f.float().contiguous() for k, (_, f) in enumerate(hs)}},
              os.path.join(data, "hidden", "shard-00000.safetensors"))
    man.update(aux_layer_ids=layers, hidden={"dtype": "float32", "shards": [
        {"file": "hidden/shard-00000.safetensors", "start": 0, "end": len(seqs)}]})
    open(os.path.join(data, "manifest.json"), "w").write(json.dumps(man))
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"fc_norm": True, "norm_output": True, "num_hidden_layers": 2,
                             "eagle_config": {"norm_before_fc": True}}))
    out = str(tmp_path / "run")
    p = run_train(["--data", data, "--out", out, "--offline", "--batch-size", "2", "--max-steps", "3",
                   "--ttt-length", "2", "--draft-config", str(c)] + FP32)
    assert "fc initialised for feature RMS" in p.stderr
    ck = rundir.list_checkpoints(out)[-1]
    d = load_draft_for(ck, target)
    assert (d.config.aux_layer_ids, d.config.num_hidden_layers) == (layers, 2)
    assert d.config.fc_norm and d.config.norm_before_fc and d.config.norm_output


def test_bench_py_with_every_option(tmp_path):
    """bench.py (torch backend, fp32) decodes with an all-options draft, chain and tree, every
    output equal to plain decoding's."""
    from transformers import AutoTokenizer
    from common import resolve_target
    from conftest import ROOT
    tok = AutoTokenizer.from_pretrained(resolve_target("default"))
    t = make_tiny_target(vocab_size=len(tok), hidden_size=32, layers=L,
                         eos_token_id=tok.eos_token_id, max_positions=4096)
    t.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    opts = dict(LAYOUTS["everything"])
    cfg = dataclasses.replace(config_from_target(t.config, 256, opts.pop("aux")), **opts)
    torch.manual_seed(0)
    Eagle3Draft(cfg).save_pretrained(str(tmp_path / "draft"))
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a colour."}) + "\n")
    out = tmp_path / "r.json"
    r = run_script(["bench.py", "--target", str(tmp_path / "target"),
                    "--draft", str(tmp_path / "draft"), "--dtype", "float32",
                    "--benchmark-list", f"{prompts}:1", "--config-list", "1,3,1,4", "1,3,4,8",
                    "--max-new-tokens", "8", "--peers", "generate", "--output", str(out)],
                   cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert {e["config"] for e in res} >= {"1,3,1,4", "1,3,4,8"}
    assert all(e["mismatches"] == 0 for e in res), res
