"""The seeds' own targets: Kimi-K2-class models (DeepSeek-V3 architecture: MLA + MoE + YaRN, remote
code, a slow Python tokenizer, a thinking chat template).

- The real Kimi-K2-Instruct config.json (tests/fixtures/kimi-k2-instruct, config only, no weights)
  gives a draft in the public Kimi-K2 drafts' shape.
- --trust-remote-code reaches from_pretrained (off by default).
- One end-to-end run on a tiny random Kimi-like target (tests/conftest.py): generate.py (remote
  code, slow tokenizer, per-turn samples of a thinking template, hidden states) -> train.py offline
  and online with 2 FSDP processes -> speculate.py greedy chain and tree in fp32, identical to the
  target -> the checkpoint's SGLang contract.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, save_tiny_kimi_target
from runscript import run_script
from common import UserError

KIMI_CONFIG = os.path.join(ROOT, "tests", "fixtures", "kimi-k2-instruct", "config.json")


def kimi_config():
    """moonshotai/Kimi-K2-Instruct's config.json, read with transformers' own DeepSeek-V3 config
    class (its remote configuration_deepseek.py is that class; the fixture ships no code)."""
    from transformers import DeepseekV3Config
    with open(KIMI_CONFIG) as f:
        d = json.load(f)
    for k in ("auto_map", "quantization_config", "model_type", "architectures"):
        d.pop(k)
    return DeepseekV3Config(**d)


def test_kimi_k2_config_gives_the_public_draft_shape(tmp_path):
    from model import Eagle3Draft
    from draft_config import apply_draft_config, config_from_target, default_aux_layers
    tcfg = kimi_config()
    assert (tcfg.hidden_size, tcfg.num_hidden_layers, tcfg.vocab_size) == (7168, 61, 163840)
    assert tcfg.rope_parameters["rope_type"] == "yarn" and tcfg.rope_parameters["factor"] == 32.0
    cfg = config_from_target(tcfg, 32000)
    # the public Kimi-K2 drafts: 7168 wide, 64 heads, 64 KV heads, head_dim 128, MLP 18432 (the
    # target's dense MLP, not an expert's 2048), plain RoPE theta 1e6, 131072 positions, 32k vocab
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (7168, 64, 64, 128)
    assert cfg.intermediate_size == 18432 and cfg.target_hidden_size == 7168
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 131072
    assert (cfg.vocab_size, cfg.draft_vocab_size) == (163840, 32000)
    assert cfg.aux_layer_ids == default_aux_layers(61) == [1, 29, 57]
    j = cfg.to_sglang_json()
    assert j["architectures"] == ["LlamaForCausalLMEagle3"] and j["num_hidden_layers"] == 1
    # the parameter count on the meta device (no memory): ~1.19B saved (embedding left out)
    with torch.device("meta"):
        sd = Eagle3Draft(cfg).export_state_dict()
    n = sum(v.numel() for v in sd.values() if v.is_floating_point())
    H, I, A, Vd = 7168, 18432, 64 * 128, 32000
    assert n == 3 * H * H + 3 * A * 2 * H + H * A + 3 * H * I + Vd * H + 4 * H == 1_190_948_864
    assert "embed_tokens.weight" not in sd
    # an explicit draft config (SpecForge's --draft-model-config): shape fields are taken ...
    p = tmp_path / "draft.json"
    p.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168,
                             "intermediate_size": 12288, "num_attention_heads": 64,
                             "num_key_value_heads": 64, "head_dim": 128, "rope_theta": 1e6,
                             "rope_scaling": None, "max_position_embeddings": 262144,
                             "num_hidden_layers": 1, "vocab_size": 163840}))
    c2 = apply_draft_config(cfg, str(p))
    assert (c2.intermediate_size, c2.max_position_embeddings) == (12288, 262144)
    assert (c2.vocab_size, c2.draft_vocab_size, c2.aux_layer_ids) == (163840, 32000, [1, 29, 57])
    # ... fields fixed by the target are checked, with a one-line error naming the file
    p.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(UserError, match="hidden_size is 4096"):
        apply_draft_config(cfg, str(p))
    p.write_text(json.dumps({"num_attention_heads": 64, "num_key_value_heads": 48}))
    with pytest.raises(UserError, match="not a multiple"):
        apply_draft_config(cfg, str(p))
    with pytest.raises(UserError, match="no such file"):
        apply_draft_config(cfg, str(tmp_path / "missing.json"))


def test_loaders_pass_trust_remote_code(monkeypatch):
    """common's three loaders hand trust_remote_code to from_pretrained, False unless asked."""
    import transformers
    import common
    seen = []

    class Stop(Exception):
        pass

    def fake(cls_name):
        def from_pretrained(path, **kw):
            seen.append((cls_name, kw.get("trust_remote_code")))
            raise Stop
        return staticmethod(from_pretrained)
    for name in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", fake(name))
    monkeypatch.setattr(common, "resolve_target", lambda t: t)
    for trc in (False, True):
        for fn in (common.load_tokenizer, common.load_config):
            with pytest.raises(Stop):
                fn("some/target", trust_remote_code=trc)
    monkeypatch.setattr(common, "load_tokenizer", lambda t, trc=False: None)
    with pytest.raises(Stop):
        common.load_target("some/target", trust_remote_code=True)
    with pytest.raises(Stop):
        common.load_target("some/target")
    assert seen == [("AutoTokenizer", False), ("AutoConfig", False), ("AutoTokenizer", True),
                    ("AutoConfig", True), ("AutoModelForCausalLM", True),
                    ("AutoModelForCausalLM", False)]


def test_trainer_reads_only_embedding_and_lm_head(tmp_path, monkeypatch):
    """load_target_heads reads the two [V, H] matrices from the safetensors files (a 1T-parameter
    target must not be loaded whole by every trainer process): the same tensors as the loaded
    model's, tied or not, and not fooled by DeepSeek-V3's extra multi-token-prediction embedding."""
    import common
    from conftest import make_tiny_target
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    for tied in (False, True):
        d = tmp_path / f"t{int(tied)}"
        t = make_tiny_target(vocab_size=64)
        t.config.tie_word_embeddings = tied
        if tied:
            t.tie_weights()
        t.save_pretrained(d)
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(64)},
                                unk_token="t0")), unk_token="t0").save_pretrained(d)
        save_file({"model.layers.61.embed_tokens.weight": torch.zeros(64, 32)}, d / "mtp.safetensors")
        ref, _ = common.load_target(str(d))
        monkeypatch.setattr(common, "load_target", lambda *a, **k: pytest.fail("loaded the model"))
        heads, tok = common.load_target_heads(str(d))
        monkeypatch.undo()
        assert torch.equal(heads.get_input_embeddings().weight, ref.get_input_embeddings().weight)
        assert torch.equal(heads.get_output_embeddings().weight, ref.get_output_embeddings().weight)
        assert heads.config.vocab_size == 64 and tok is not None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "train.py"] + args
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_kimi_like_target_end_to_end(tmp_path, monkeypatch):
    import dataset
    import generate
    import speculate
    import rundir
    from common import load_target
    from model import load_draft_for
    from test_model import expected_tensors
    tdir = save_tiny_kimi_target(tmp_path / "kimi")
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"Question {i}: what is the tallest tree?"} for i in range(5)]
    rows.append({"messages": [{"role": "user", "content": "Name a colour."},
                              {"role": "assistant", "content": "old answer"},
                              {"role": "user", "content": "And another one?"}]})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = str(tmp_path / "data")
    gen = ["--target", tdir, "--prompts", str(prompts), "--out", data, "--max-new-tokens", "16",
           "--batch-size", "3", "--dtype", "float32", "--device", "cpu", "--temperature", "0",
           "--draft-vocab-size", "48", "--fill-vocab", "--hidden-states", "--hidden-dtype",
           "float32", "--shard-size", "4"]
    # remote code stays off unless asked: one clear error, nothing written
    with pytest.raises(UserError, match="--trust-remote-code"):
        generate.main(gen)
    assert not os.path.exists(data)
    generate.main(gen + ["--trust-remote-code"])
    manifest, seqs, vocab = dataset.load_dataset_dir(data)
    assert manifest["aux_layer_ids"] == [0, 2, 4]          # L = 6: distinct, not [1, 2, 2]
    # the thinking template drops turn 1's reasoning once turn 2 exists: the two-turn
    # conversation is two samples, each rendered as the model saw it, one turn in each loss
    assert manifest["num_per_turn_conversations"] == 1
    two = [s for s in seqs if s["conversation"] == 5]
    assert [s["turn"] for s in two] == [1, 3] and len(seqs) == 7
    target, tok = load_target(tdir, trust_remote_code=True)
    conv = [json.loads(l) for l in open(os.path.join(data, "conversations.jsonl"))][5]["messages"]
    for s in two:
        ref = tok.apply_chat_template(conv[:s["turn"] + 1], tokenize=False)
        assert s["input_ids"] == tok(ref, add_special_tokens=False)["input_ids"][:len(s["input_ids"])]
        masked = tok.decode([t for t, m in zip(s["input_ids"], s["loss_mask"]) if m])
        m = conv[s["turn"]]    # an answer cut at --max-new-tokens has no end-of-turn in the loss
        want = m["content"].rstrip() if m.get("truncated") else m["content"] + "<|im_end|>"
        assert masked == "<think></think>" + want
    assert "<think>" not in tok.decode(two[1]["input_ids"][:two[1]["loss_mask"].index(1)])

    # train: offline and online, 2 FSDP processes each, fp32
    fp32 = ["--dtype", "float32", "--target-dtype", "float32", "--hidden-dtype", "float32",
            "--no-progress", "--threads", "1", "--trust-remote-code"]
    common = ["--data", data, "--batch-size", "2", "--max-steps", "6", "--lr", "3e-3",
              "--ttt-length", "3", "--eval-every", "6", "--log-every", "2", "--eval-fraction",
              "0.15"] + fp32
    off, on = str(tmp_path / "off"), str(tmp_path / "on")
    torchrun(common + ["--out", off, "--offline"])
    torchrun(common + ["--out", on, "--prefetch", "2"])
    a = torch.load(os.path.join(rundir.list_checkpoints(off)[-1], "trainer_state.pt"),
                   weights_only=False)
    b = torch.load(os.path.join(rundir.list_checkpoints(on)[-1], "trainer_state.pt"),
                   weights_only=False)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:     # the producer's states equal the stored ones: same training
        assert torch.allclose(a["model"][k], b["model"][k], atol=1e-4, rtol=1e-3), k
    p = run_script(["train.py", "--out", str(tmp_path / "x")] + common[:-1] + ["--offline"],
                   cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "--trust-remote-code" in p.stderr.strip().splitlines()[-1]

    # the checkpoint: SGLang's names and shapes, the MLA draft shape, the data's vocab and layers
    ck = rundir.list_checkpoints(off)[-1]
    cfg = json.load(open(os.path.join(ck, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 4, 8)
    assert (cfg["intermediate_size"], cfg["rope_theta"], cfg["rope_scaling"]) == (64, 1e6, None)
    assert cfg["max_position_embeddings"] == 1024 and cfg["draft_vocab_size"] == 48
    from safetensors import safe_open
    with safe_open(os.path.join(ck, "model.safetensors"), "pt") as f:
        got = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t = f.get_tensor("d2t")
    assert got == expected_tensors(H=32, Ht=32, nh=4, nkv=4, hd=8, I=64, V=len(tok), Vd=48)
    assert torch.equal(d2t, vocab["d2t"])

    # speculate.py: greedy chain and tree in fp32, identical to the target's own decoding
    draft = str(tmp_path / "draft")
    os.rename(ck, draft)
    base = ["speculate.py", "--draft", draft, "--target", tdir, "--trust-remote-code", "--prompts",
            str(prompts), "--max-new-tokens", "24", "--dtype", "float32", "--device", "cpu",
            "--check", "--quiet"]
    for extra in (["--steps", "3"], ["--steps", "4", "--topk", "3", "--num-draft-tokens", "8"]):
        out = tmp_path / "r.json"
        monkeypatch.setattr(sys, "argv", base + extra + ["--json", str(out)])
        speculate.main()
        summary = json.loads(out.read_text())["summary"]
        assert summary["mismatches"] == 0 and summary["prompts"] == 6
    assert load_draft_for(draft, target).config.head_dim == 8

    # model.py and bench.py pass the flag on too (bench: up to loading the target, then stopped)
    import bench
    import model
    with pytest.raises(UserError, match="--trust-remote-code"):
        model.main(["--target", tdir, "--dry-run"])
    model.main(["--target", tdir, "--dry-run", "--trust-remote-code", "--draft-vocab-size", "48"])
    seen = []

    class Stop(Exception):
        pass

    def fake_load_target(*a, **kw):
        seen.append(kw.get("trust_remote_code", a[3] if len(a) > 3 else None))
        raise Stop
    import common
    monkeypatch.setattr(common, "load_target", fake_load_target)
    with pytest.raises(Stop):
        bench.main(["--target", tdir, "--draft", draft, "--trust-remote-code", "--benchmark-list",
                    f"{prompts}:2", "--config-list", "1,3,1,4", "--dtype", "float32",
                    "--output", str(tmp_path / "b.json")])
    assert seen == [True]
