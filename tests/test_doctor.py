"""The draft doctor (doctor.py, `python model.py DRAFT --doctor [--target T]`): good drafts (this
project's, speculators' own, either layout) pass; each public root cause of "accept length ~1 when
served", injected into a good checkpoint, fails with one line naming the field."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, make_tiny_target
from runscript import run_script
import doctor
import layouts
from model import Eagle3Draft
from draft_config import config_from_target

FIX = os.path.join(ROOT, "tests", "fixtures", "speculators")


def run(path, target=None, prompts=None, tcfg=None, max_new_tokens=12):
    lines = []
    return doctor.run(path, target, tcfg, prompts, out=lines.append, max_new_tokens=max_new_tokens)


def fails(rep):
    return [(f, m) for s, f, m in rep.lines if s == "FAIL"]


def prompts(n=2, V=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def target():
    t = make_tiny_target()
    with torch.no_grad():
        t.lm_head.weight.mul_(20)      # greedy ties far above fp32 noise
    return t


def project_draft(path, target, **layout):
    cfg = config_from_target(target.config, 48)
    for k, v in layout.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    d.set_vocab(torch.randperm(64)[:48].sort().values)
    d.save_pretrained(str(path), dtype=torch.float32)
    return str(path)


def inject(src, dst, config=None, tensors=None):
    """A copy of draft `src` with config.json edited by config(d) and the tensors by tensors(sd)."""
    dst = str(dst)
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        d = json.load(f)
    if config:
        config(d)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(d, f)
    if tensors:
        sd = load_file(os.path.join(dst, "model.safetensors"))
        tensors(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(dst, "model.safetensors"))
    return dst


# ---- good drafts pass -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["eagle3", "eagle3_norms", "eagle3_fc_norm", "eagle3_residual"])
def test_speculators_drafts_pass(name, target):
    rep = run(os.path.join(FIX, name), target, prompts())
    assert not fails(rep), fails(rep)
    got = {f for s, f, _ in rep.lines if s == "PASS"}
    # the measured checks ran, and the output was the target's own
    assert {"lossless (this project's positions)", "lossless (one-later decode positions)",
            "aux layers (vllm 0.33.0)", "embed_tokens.weight", "rope_theta"} <= got
    assert any(f == "accept length (one-later decode positions)" for s, f, _ in rep.lines)


@pytest.mark.parametrize("layout", [{}, {"fc_norm": True, "norm_output": True},
                                    {"norm_before_fc": True, "num_hidden_layers": 2}])
def test_project_drafts_pass_in_both_layouts(tmp_path, target, layout):
    path = project_draft(tmp_path / "d", target, **layout)
    rep = run(path, target, prompts())
    assert not fails(rep), fails(rep)
    spec = str(tmp_path / "spec")
    layouts.export(path, "speculators", spec, embed=target.get_input_embeddings().weight.detach())
    rep = run(spec, target, prompts())
    assert not fails(rep), fails(rep)


def test_norm_before_residual_is_vllm_only(tmp_path, target):
    """speculators' default norm_before_residual=true: vLLM reads it (passes); the same draft in
    SGLang's layout is one SGLang 0.5.23 serves wrong (it never reads the flag): one FAIL, by name."""
    sg = str(tmp_path / "sg")
    layouts.export(os.path.join(FIX, "eagle3_residual"), "sglang", sg)
    rep = run(sg, target, prompts())
    assert [f for f, _ in fails(rep)] == ["norm_before_residual (sglang 0.5.23)"], fails(rep)
    assert any(s == "PASS" and f == "norm_before_residual (vllm 0.33.0)" for s, f, _ in rep.lines)


def test_static_only_skips_never_passes(tmp_path, target):
    rep = run(project_draft(tmp_path / "d", target))
    skipped = {f for s, f, _ in rep.lines if s == "SKIP"}
    assert {"measured checks", "hidden_size / vocab_size", "aux layers: range"} <= skipped
    assert not fails(rep)


# ---- each root cause, injected, fails by name ----------------------------------------------

def del_key(*path):
    def edit(d):
        for p in path[:-1]:
            d = d[p]
        del d[path[-1]]
    return edit


def set_key(value, *path):
    def edit(d):
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value
    return edit


def absolute_d2t(sd):
    sd["d2t"] = sd["d2t"] + torch.arange(sd["d2t"].numel())   # ids where offsets belong


def nan_head(sd):
    sd["lm_head.weight"][0, 0] = float("nan")


SGLANG_FAULTS = {
    # name: (layout options of the good draft, config edit, tensor edit, field named in a FAIL)
    "vllm aux copy missing (vLLM reads eagle_config ids as input-of-layer ids)":
        ({}, del_key("eagle_aux_hidden_state_layer_ids"), None, "aux layers (vllm 0.33.0)"),
    "off-by-one export of the vLLM ids":
        ({}, set_key([1, 3, 4], "eagle_aux_hidden_state_layer_ids"), None, "config.json"),
    "aux layers out of order": ({}, lambda d: (set_key([3, 1, 4], "eagle_config",
                                                       "eagle_aux_hidden_state_layer_ids")(d),
                                               set_key([4, 2, 5], "eagle_aux_hidden_state_layer_ids")(d)),
                                None, "aux layers: order"),
    "aux layer beyond the target": ({}, lambda d: (set_key([1, 3, 7], "eagle_config",
                                                           "eagle_aux_hidden_state_layer_ids")(d),
                                                   set_key([2, 4, 8], "eagle_aux_hidden_state_layer_ids")(d)),
                                    None, "aux layers: range"),
    "norm_before_fc dropped (SGLang PR 32334)":
        ({"norm_before_fc": True}, set_key(False, "eagle_config", "norm_before_fc"), None,
         "norm_before_fc vs tensors"),
    "fc_norm under its legacy name (vLLM does not read use_aux_norm)":
        ({"fc_norm": True}, lambda d: d.update(use_aux_norm=True, fc_norm=False), None,
         "fc_norm (vllm 0.33.0)"),
    "d2t missing": ({}, None, lambda sd: sd.pop("d2t"), "d2t"),
    "d2t holding absolute ids": ({}, None, absolute_d2t, "t2d agrees with d2t"),
    "EAGLE class on an EAGLE-3 draft (SGLang PR 21272)":
        ({}, set_key(["LlamaForCausalLMEagle"], "architectures"), None, "architectures"),
    "EAGLE-2 (no aux states)": ({}, set_key(False, "eagle_config", "use_aux_hidden_state"), None,
                                "eagle_config.use_aux_hidden_state"),
    "rope_theta not the target's": ({}, set_key(500000.0, "rope_theta"), None, "rope_theta"),
    "partial_rotary_factor (speculators issue 613)":
        ({}, set_key(0.5, "partial_rotary_factor"), None, "partial_rotary_factor"),
    "max_position_embeddings too small": ({}, set_key(64, "max_position_embeddings"), None,
                                          "max_position_embeddings"),
    "tie_word_embeddings": ({}, set_key(True, "tie_word_embeddings"), None, "tie_word_embeddings"),
    "NaN weights": ({}, None, nan_head, "weights finite"),
    "dtype declared wrong": ({}, set_key("bfloat16", "torch_dtype"), None, "dtype"),
    "missing tensor": ({}, None, lambda sd: sd.pop("midlayer.hidden_norm.weight"), "tensors"),
}


@pytest.mark.parametrize("name", list(SGLANG_FAULTS))
def test_sglang_layout_fault_caught(tmp_path, target, name):
    layout, cedit, tedit, field = SGLANG_FAULTS[name]
    good = project_draft(tmp_path / "good", target, **layout)
    assert not fails(run(good, target))
    bad = inject(good, tmp_path / "bad", cedit, tedit)
    got = fails(run(bad, target))
    assert any(field in f for f, _ in got), got
    for f, m in got:   # one line each, naming what was expected
        assert "\n" not in m and any(w in m for w in ("expected", "implements only",
                                                      "unknown key", "must be")), (f, m)


SPECULATORS_FAULTS = {
    "norm_before_residual absent (vLLM reads it as true)":
        (del_key("norm_before_residual"), None, "norm_before_residual (vllm 0.33.0)"),
    "speculators_model_type eagle": (set_key("eagle", "speculators_model_type"), None,
                                     "speculators_model_type"),
    "no embed_tokens.weight (speculators loads it uninitialised)":
        (None, lambda sd: sd.pop("embed_tokens.weight"), "embed_tokens.weight (speculators 0.9.0)"),
    "embedding not the target's": (None, lambda sd: sd["embed_tokens.weight"].mul_(1.01),
                                   "embed_tokens.weight"),
    "partial rotary in the layer config (speculators issue 613)":
        (set_key(0.5, "transformer_layer_config", "partial_rotary_factor"), None,
         "partial_rotary_factor"),
    "NaN lm_head (verifier weights never loaded)": (None, nan_head, "weights finite"),
}


@pytest.mark.parametrize("name", list(SPECULATORS_FAULTS))
def test_speculators_layout_fault_caught(tmp_path, target, name):
    cedit, tedit, field = SPECULATORS_FAULTS[name]
    bad = inject(os.path.join(FIX, "eagle3"), tmp_path / "bad", cedit, tedit)
    got = fails(run(bad, target))
    assert any(field in f for f, _ in got), got


def test_other_target_caught(tmp_path, target):
    other = make_tiny_target(vocab_size=80, hidden_size=32, layers=8)
    got = fails(run(project_draft(tmp_path / "d", target), other))
    assert any(f == "vocab_size" for f, _ in got), got


def test_run_files_caught(tmp_path, target):
    """A train.py checkpoint names its data; the data's manifest names the layers training used."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"aux_layer_ids": [1, 3, 4]}))
    good = project_draft(tmp_path / "good", target)
    torch.save({"args": {"data": str(data)}}, os.path.join(good, "trainer_state.pt"))
    rep = run(good, target)
    assert ("PASS", "aux layers vs training data") in [(s, f) for s, f, _ in rep.lines]
    (data / "manifest.json").write_text(json.dumps({"aux_layer_ids": [2, 4, 5]}))
    assert any(f == "aux layers vs training data" for f, _ in fails(run(good, target)))


# ---- measured: the card's training-time estimate against decoding --------------------------

def test_measured_against_card(tmp_path):
    """A hand-built draft that agrees with its target (tests/test_speculate.py bigram_pair) passes
    against a card claiming a high accept length; the same draft exported with its lm_head rows
    shuffled (names and shapes intact: invisible to the static checks) fails against it."""
    from test_speculate import bigram_pair
    t, d = bigram_pair()
    path = str(tmp_path / "good")
    d.save_pretrained(path, dtype=torch.float32)
    # what a training run of this draft might have measured on held-out data (not derived from
    # the decode below); the doctor passes a draft keeping at least half of it
    card = {"held_out": {"replay_accept_3": 1.6, "acc_j": [0.5, 0.4, 0.3]}}
    with open(os.path.join(path, "training.json"), "w") as f:
        json.dump(card, f)
    ps = prompts(2, V=32, seed=1)
    rep = run(path, t, ps, max_new_tokens=32)
    assert not fails(rep), fails(rep)
    assert ("PASS", "accept length vs training") in [(s, f) for s, f, _ in rep.lines]

    def shuffle(sd):
        g = torch.Generator().manual_seed(0)
        sd["lm_head.weight"] = sd["lm_head.weight"][torch.randperm(sd["lm_head.weight"].shape[0],
                                                                   generator=g)]
    bad = inject(path, tmp_path / "bad", None, shuffle)
    got = dict(fails(run(bad, t, ps, max_new_tokens=32)))
    assert "accept length vs training" in got and "step-0 agreement vs training" in got, got
    assert "lossless (this project's positions)" not in got      # still lossless, only slow


def test_cli_exit_codes(tmp_path, target):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [os.path.join(ROOT, "model.py")]
    r = run_script(cmd + [os.path.join(FIX, "eagle3"), "--doctor"], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("OK: 0 of")
    bad = inject(os.path.join(FIX, "eagle3"), tmp_path / "bad", del_key("norm_before_residual"))
    r = run_script(cmd + [bad, "--doctor"], env=env)
    assert r.returncode == 1
    assert any(ln.startswith("FAIL  config.json") and "norm_before_residual" in ln
               for ln in r.stdout.splitlines())


def test_original_eagle_config_without_layer_ids(tmp_path, target):
    """The original EAGLE-3 release configs name no captured layers: each engine then uses its own
    default layers. Loading says which field is missing; the doctor fails it by name."""
    from common import UserError
    from draft_config import read_config
    bad = inject(project_draft(tmp_path / "d", target), tmp_path / "bad",
                 lambda d: (d.pop("eagle_config"), d.pop("eagle_aux_hidden_state_layer_ids")))
    with pytest.raises(UserError, match=r"no eagle_config.eagle_aux_hidden_state_layer_ids; "
                                        r"expected the captured target layers"):
        read_config(bad)
    rep = run(bad, target, prompts())
    assert any("eagle_aux_hidden_state_layer_ids" in f + m for f, m in fails(rep)), rep.lines


def test_speculators_trained_default_draft_passes():
    """A draft speculators' own trainer wrote with its defaults (tests/fixtures/speculators/
    trained_defaults: sliding window, norm_before_residual, ...) passes, measured against the
    target it was trained on; the window is said on its own line."""
    t = make_tiny_target(vocab_size=49152, layers=8, eos_token_id=2)
    rep = run(os.path.join(FIX, "trained_defaults"), t, prompts(V=49152), max_new_tokens=16)
    assert not fails(rep), fails(rep)
    got = {f: (s, m) for s, f, m in rep.lines}
    assert got["lossless (this project's positions)"][0] == "PASS"
    assert got["sliding_window"][0] == "INFO" and "--speculative-draft-window-size 2048" in \
        got["sliding_window"][1]
