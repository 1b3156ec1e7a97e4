"""Bad input gets one UserError naming the flag or file and what was expected, for the API and the
command lines (in process: argument checks run before any model loads), and the draft's RoPE
follows the target's, scaling included."""
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import bench
import speculate
import train
from common import UserError
from lookup_fixture import lookup_pair, lookup_prompts
from model import Eagle3Draft
from draft_config import config_from_target


# ----------------------------------------------------------------------------------------------
# Speculator (the API bench.py and chat.py use)

@pytest.mark.parametrize("kw,match", [
    ({"temperature": -0.5}, r"--temperature -0.5: expected >= 0"),
    ({"temperature": float("nan")}, r"--temperature nan: expected >= 0"),
    ({"temperature": 1.0, "top_p": 0.0}, r"--top-p 0.0: expected in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, r"--top-p 1.5: expected in \(0, 1\]"),
    ({"steps": 0}, r"--steps 0: expected >= 1"),
    ({"topk": 11}, r"--topk 11: expected 1..10"),
])
def test_speculator_rejects_bad_settings(lookup, kw, match):
    t, d = lookup
    with pytest.raises(UserError, match=match):
        speculate.Speculator(t, d, **kw)


def test_generate_rejects_bad_lengths():
    t, d = lookup_pair()
    spec = speculate.Speculator(t, d, 3, 1)
    p = lookup_prompts(1, seed=0, lo=10, hi=11)[0]
    with pytest.raises(UserError, match=r"--max-new-tokens 0: expected >= 1"):
        spec.generate(p, 0)
    with pytest.raises(UserError, match=r"prompt \(10 tokens\) \+ --max-new-tokens 600 exceeds the "
                                        r"target's max_position_embeddings 512"):
        spec.generate(p, 600)
    d.config.max_position_embeddings = 32      # a draft whose positions end before the target's
    with pytest.raises(UserError, match=r"prompt \(10 tokens\) \+ --max-new-tokens 30 exceeds the "
                                        r"draft's max_position_embeddings 32"):
        spec.generate(p, 30)
    assert len(spec.generate(p, 18)[0]) == 18   # 10 + 18 + 3 + 1 = 32 still fits


# ----------------------------------------------------------------------------------------------
# Command lines

@pytest.mark.parametrize("extra,match", [
    (["--top-p", "0"], r"--top-p 0.0: expected in \(0, 1\]"),
    (["--top-p", "1.01"], r"--top-p 1.01: expected in \(0, 1\]"),
    (["--temperature", "-1"], r"--temperature -1.0: expected >= 0"),
    (["--max-new-tokens", "0"], r"--max-new-tokens 0: expected >= 1"),
    (["--sglang-tree-slots"], r"--sglang-tree-slots: changes tree drafting only \(--topk > 1\)"),
])
def test_speculate_cli_rejects(monkeypatch, tmp_path, extra, match):
    monkeypatch.setattr(sys, "argv", ["speculate.py", "--draft", str(tmp_path), *extra])
    with pytest.raises(UserError, match=match):
        speculate.main()


@pytest.mark.parametrize("extra,match", [
    (["--top-p", "0"], r"--top-p 0.0: expected in \(0, 1\]"),
    (["--top-p", "2"], r"--top-p 2.0: expected in \(0, 1\]"),
    (["--temperature", "-0.1"], r"--temperature -0.1: expected >= 0"),
    (["--max-new-tokens", "0"], r"--max-new-tokens 0: expected >= 1"),
])
def test_bench_cli_rejects(extra, match):
    with pytest.raises(UserError, match=match):
        bench.parse_args(extra)


@pytest.mark.parametrize("extra,match", [
    (["--lr", "0"], r"--lr 0.0: expected > 0"),
    (["--lr=-1e-4"], r"--lr -0.0001: expected > 0"),
    (["--ttt-length", "0"], r"--ttt-length 0: expected >= 1"),
    (["--resume", "--init", "drafts/x"], r"--resume continues a run; --init starts a new one"),
    (["--hidden-dtype", "float64"], r"--hidden-dtype float64: expected float32, bfloat16 or float16"),
])
def test_train_cli_rejects(extra, match):
    with pytest.raises(UserError, match=match):
        train.check_args(train.parse_args(["--data", "d", "--out", "o", *extra]))


# ----------------------------------------------------------------------------------------------
# The draft's vocabulary map, checked when a checkpoint loads

@pytest.mark.parametrize("how,match", [
    ("out of range", r"d2t: expected 10 distinct ascending ids in \[0, 12\)"),
    ("not ascending", r"d2t: expected 10 distinct ascending ids in \[0, 12\)"),
    ("negative", r"d2t: expected 10 distinct ascending ids in \[0, 12\)"),
    ("t2d", r"t2d does not mark exactly the target ids that d2t maps to"),
])
def test_bad_vocab_map_is_refused_at_load(tmp_path, how, match):
    t, d = lookup_pair()
    d.save_pretrained(str(tmp_path), dtype=torch.float32)
    path = str(tmp_path / "model.safetensors")
    sd = load_file(path)
    if how == "out of range":
        sd["d2t"][-1] += 5                       # last id 11 -> 16, past the vocabulary
    elif how == "not ascending":
        sd["d2t"][3], sd["d2t"][4] = sd["d2t"][4] + 1, sd["d2t"][3] - 1   # ids 4, 5 -> 5, 4
    elif how == "negative":
        sd["d2t"][0] = -1
    else:
        sd["t2d"][3] = True                      # 3 is not in the draft vocabulary
    save_file(sd, path)
    with pytest.raises(UserError, match=match):
        Eagle3Draft.from_pretrained(str(tmp_path), embed_weight=t.get_input_embeddings().weight)


# ----------------------------------------------------------------------------------------------
# RoPE scaling: the draft must rotate exactly as the target does

ROPE = [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
]


@pytest.mark.parametrize("rope", ROPE, ids=[r["rope_type"] for r in ROPE])
def test_draft_rope_equals_targets(tmp_path, rope):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rope_parameters=dict(rope))
    target = LlamaForCausalLM(cfg).eval()
    dcfg = config_from_target(target.config, 16)
    assert dcfg.rope_scaling["rope_type"] == rope["rope_type"] and dcfg.rope_theta == rope["rope_theta"]
    draft = Eagle3Draft(dcfg)
    draft.save_pretrained(str(tmp_path), dtype=torch.float32)     # and through config.json
    reloaded = Eagle3Draft.from_pretrained(str(tmp_path), embed_weight=draft.embed_tokens.weight)
    pos = torch.arange(0, 1024, 7)[None]
    x = torch.zeros(1, 1, 16)
    with torch.no_grad():
        want_cos, want_sin = target.model.rotary_emb(x, pos)
    default = Eagle3Draft(config_from_target(LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]})).config, 16))
    plain_cos, _ = default.rotary(pos, torch.float32)
    assert not torch.allclose(plain_cos, want_cos, atol=1e-3)    # the scaling changes the angles
    for m in (draft, reloaded):
        cos, sin = m.rotary(pos, torch.float32)
        torch.testing.assert_close(cos, want_cos, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin, want_sin, rtol=1e-5, atol=1e-5)
