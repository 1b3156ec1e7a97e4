"""The speculators 0.9.0 layout (layouts.py): drafts made by speculators' own code
(tests/fixtures/speculators/make_fixture.py, run once in a throwaway virtualenv) load, compute
exactly what speculators' forward computed, decode losslessly with speculate.py, and convert to
SGLang's layout and back bit for bit and field for field; so does a draft this project writes."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, make_tiny_target
from runscript import run_script
from common import UserError
import layouts
from model import Eagle3Draft, load_draft_for
from draft_config import config_from_target, read_config
from speculate import Speculator, target_generate

FIX = os.path.join(ROOT, "tests", "fixtures", "speculators")
GOOD = ["eagle3", "eagle3_norms", "eagle3_fc_norm", "eagle3_residual"]


def fixture(name):
    return os.path.join(FIX, name)


def sharp_target():
    """The fixtures' target (conftest's, seed 0), lm_head scaled so greedy ties are far above
    fp32 noise. The embedding, which the drafts hold a copy of, is unchanged."""
    t = make_tiny_target()
    with torch.no_grad():
        t.lm_head.weight.mul_(20)
    return t


def read_dir(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f), load_file(os.path.join(path, "model.safetensors"))


def assert_same_dir(a, b):
    (ca, ta), (cb, tb) = read_dir(a), read_dir(b)
    assert ca == cb
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("name", GOOD)
def test_fixture_matches_speculators_forward(name):
    """TTT step 0 on speculators' recorded input (its own positions 1..T) gives speculators'
    logits: the conversion read every weight, norm flag, layer and RoPE setting as it meant them."""
    draft = load_draft_for(fixture(name), make_tiny_target(), torch.float32)
    ref = load_file(os.path.join(fixture(name), "reference.safetensors"))
    with torch.no_grad():
        logits, _ = draft(ref["input_ids"], draft.fuse(ref["aux"]), ref["position_ids"])
    assert logits.shape == ref["logits"].shape
    torch.testing.assert_close(logits, ref["logits"], atol=1e-4, rtol=1e-4)
    # and it is not trivially so: a wrong aux-layer reading would feed other features, a
    # dropped norm would change the logits
    cfg = read_config(fixture(name))
    with open(os.path.join(fixture(name), "config.json")) as f:
        k = json.load(f)["eagle_aux_hidden_state_layer_ids"]
    assert cfg.aux_layer_ids == [i - 1 for i in k]        # vLLM's input-of-layer-k -> output of k-1
    if cfg.norm_before_fc or cfg.fc_norm:
        with torch.no_grad():
            bare = draft.fc(ref["aux"])
            wrong, _ = draft(ref["input_ids"], bare, ref["position_ids"])
        assert (wrong - ref["logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["eagle3", "eagle3_norms", "eagle3_residual"])
@pytest.mark.parametrize("steps,topk,ndt", [(3, 1, 4), (3, 4, 8)])
def test_fixture_decodes_losslessly(name, steps, topk, ndt):
    target = sharp_target()
    draft = load_draft_for(fixture(name), target, torch.float32)
    assert torch.equal(draft.embed_tokens.weight, target.model.embed_tokens.weight)
    spec = Speculator(target, draft, steps, topk, ndt)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        prompt = torch.randint(0, 64, (9,), generator=g).tolist()
        out, s = spec.generate(prompt, 24)
        ref, _ = target_generate(target, prompt, 24)
        assert out == ref
        assert s["rounds"] >= 1


def test_norm_before_residual_is_applied():
    """speculators' trainer defaults to norm_before_residual=true (vLLM reads it, SGLang never
    does): read as such, and it matters: layer 0 with the plain residual g misses speculators'
    logits (the forward test above then fails)."""
    assert read_config(fixture("eagle3_residual")).norm_before_residual
    assert not read_config(fixture("eagle3")).norm_before_residual
    draft = load_draft_for(fixture("eagle3_residual"), make_tiny_target(), torch.float32)
    ref = load_file(os.path.join(fixture("eagle3_residual"), "reference.safetensors"))
    draft.midlayer.norm_residual = False
    with torch.no_grad():
        wrong, _ = draft(ref["input_ids"], draft.fuse(ref["aux"]), ref["position_ids"])
    assert (wrong - ref["logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("name", GOOD)
def test_speculators_round_trip_exact(tmp_path, name):
    """speculators -> SGLang -> speculators: the same config.json (every field) and tensors."""
    layouts.export(fixture(name), "sglang", str(tmp_path / "sg"))
    layouts.export(str(tmp_path / "sg"), "speculators", str(tmp_path / "back"))
    assert_same_dir(fixture(name), str(tmp_path / "back"))
    cfg, _ = read_dir(str(tmp_path / "sg"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        k - 1 for k in read_dir(fixture(name))[0]["eagle_aux_hidden_state_layer_ids"]]


def project_draft(tmp_path, **layout):
    t = make_tiny_target()
    n_aux = layout.pop("n_aux", 3)
    ids = [0, 2, 4, 6][:n_aux] if n_aux != 3 else None
    cfg = config_from_target(t.config, 48, ids)
    for k, v in layout.items():
        setattr(cfg, k, v)
    torch.manual_seed(1)
    d = Eagle3Draft(cfg, t.get_input_embeddings().weight)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    d.set_vocab(torch.randperm(64)[:48].sort().values)
    path = str(tmp_path / "draft")
    d.save_pretrained(path, dtype=torch.float32)
    return path, t


@pytest.mark.parametrize("layout", [{}, {"fc_norm": True, "norm_output": True},
                                    {"norm_before_residual": True},
                                    {"norm_before_fc": True, "num_hidden_layers": 2, "n_aux": 4}])
def test_project_round_trip_exact(tmp_path, layout):
    """A draft this project writes -> speculators -> SGLang: the same files; and the speculators
    copy computes the same draft."""
    path, t = project_draft(tmp_path, **dict(layout))
    spec, back = str(tmp_path / "spec"), str(tmp_path / "back")
    emb = t.get_input_embeddings().weight.detach()
    with pytest.raises(UserError, match="embed_tokens.weight"):   # H == Ht: not in the draft
        layouts.export(path, "speculators", spec)
    out = layouts.export(path, "speculators", spec, embed=emb)
    layouts.export(spec, "sglang", back)
    assert_same_dir(path, back)
    assert out["speculators_model_type"] == "eagle3"
    cfg = read_config(path)
    assert out["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cfg.aux_layer_ids]
    # speculators 0.9.0 leaves a missing embedding uninitialised: the export carries the target's
    assert torch.equal(read_dir(spec)[1]["embed_tokens.weight"], emb)
    a, b = load_draft_for(path, t, torch.float32), load_draft_for(spec, t, torch.float32)
    x = torch.randn(1, 5, len(cfg.aux_layer_ids) * 32)
    ids, pos = torch.randint(0, 64, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        assert torch.equal(a(ids, a.fuse(x), pos)[0], b(ids, b.fuse(x), pos)[0])


def test_export_refusals(tmp_path):
    with pytest.raises(UserError, match="source draft"):
        layouts.export(fixture("eagle3"), "sglang", fixture("eagle3"))
    with pytest.raises(UserError, match="expected sglang or speculators"):
        layouts.export(fixture("eagle3"), "vllm", str(tmp_path / "x"))
    # a key the conversion does not understand is refused by name, never carried silently
    bad = tmp_path / "bad"
    bad.mkdir()
    c, _ = read_dir(fixture("eagle3"))
    c["transformer_layer_config"]["rope_parameters"]["partial_rotary_factor"] = 0.5
    (bad / "config.json").write_text(json.dumps(c))
    os.symlink(os.path.join(fixture("eagle3"), "model.safetensors"), bad / "model.safetensors")
    with pytest.raises(UserError, match="partial_rotary_factor"):
        read_config(str(bad))
    c, _ = read_dir(fixture("eagle3"))
    c["mystery_flag"] = True
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(UserError, match="mystery_flag"):
        read_config(str(bad))


def test_cli_export(tmp_path):
    """python model.py DRAFT --export speculators --out DIR, and a bad call's one-line error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = str(tmp_path / "sg")
    r = run_script([os.path.join(ROOT, "model.py"), fixture("eagle3_norms"),
                    "--export", "sglang", "--out", out], env=env)
    assert r.returncode == 0, r.stderr
    assert read_config(out).num_hidden_layers == 2
    r = run_script([os.path.join(ROOT, "model.py"), fixture("eagle3"),
                    "--export", "speculators"], env=env)
    assert r.returncode == 2 and r.stderr.strip() == "error: --export needs --out DIR"


def test_bench_sglang_backend_refuses_speculators_layout(tmp_path):
    """bench.py's SGLang path would hand the draft to SGLang, which has no class for this layout:
    one line saying so and how to convert, before any model is loaded."""
    import bench
    make_tiny_target().save_pretrained(str(tmp_path / "t"))
    with pytest.raises(UserError, match="export sglang"):
        bench.main(["--backend", "sglang", "--target", str(tmp_path / "t"),
                    "--draft", fixture("eagle3"), "--config-list", "1,3,1,4"])


# ---- a draft trained by speculators' own trainer with its defaults ---------------------------

TRAINED = fixture("trained_defaults")


def trained_target():
    """The target that draft was trained on (its README): conftest's tiny target, vocab 49152."""
    return make_tiny_target(vocab_size=49152, layers=8, eos_token_id=2)


def test_trained_default_draft_reads_every_default():
    """speculators' defaults: norm_before_fc, norm_output, norm_before_residual, sliding window
    2048 on layer 0, the target's embedding (frozen)."""
    cfg = read_config(TRAINED)
    assert (cfg.norm_before_fc, cfg.norm_output, cfg.norm_before_residual, cfg.fc_norm) == \
        (True, True, True, False)
    assert cfg.sliding_window == 2048 and cfg.max_context() == cfg.max_position_embeddings == 512
    target = trained_target()
    draft = load_draft_for(TRAINED, target, torch.float32)   # (saved in bf16, as trained)
    assert torch.equal(draft.embed_tokens.weight,
                       target.model.embed_tokens.weight.bfloat16().float())


@pytest.mark.parametrize("steps,topk,ndt", [(3, 1, 4), (3, 4, 8)])
def test_trained_default_draft_decodes_losslessly(steps, topk, ndt):
    target = trained_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(20)    # greedy ties far above fp32 noise
    spec = Speculator(target, load_draft_for(TRAINED, target, torch.float32), steps, topk, ndt)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        prompt = torch.randint(0, 49152, (10,), generator=g).tolist()
        out, s = spec.generate(prompt, 20)
        assert out == target_generate(target, prompt, 20)[0]
        assert s["rounds"] >= 1


def test_sliding_window_caps_the_context(tmp_path):
    """Within its window a sliding-window draft is full attention exactly; past it this project
    does not run it: a one-line error naming the window, never a silently different draft."""
    import shutil
    d = str(tmp_path / "w")
    shutil.copytree(TRAINED, d)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c["transformer_layer_config"]["sliding_window"] = 24
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    target = trained_target()
    spec = Speculator(target, load_draft_for(d, target, torch.float32), 3, 1, 4)
    spec.generate(list(range(5, 15)), 10)                     # 10 + 10 + 4 = 24: inside
    with pytest.raises(UserError, match=r"sliding_window 24"):
        spec.generate(list(range(5, 15)), 11)
    # and the window survives the trip through SGLang's layout and back
    layouts.export(d, "sglang", str(tmp_path / "sg"))
    assert read_config(str(tmp_path / "sg")).sliding_window == 24
    layouts.export(str(tmp_path / "sg"), "speculators", str(tmp_path / "back"))
    assert_same_dir(d, str(tmp_path / "back"))
