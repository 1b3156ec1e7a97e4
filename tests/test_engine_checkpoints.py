"""The drafts model.py writes, checked against the pinned engines' loaders (sglang==0.5.23's
`LlamaForCausalLMEagle3.load_weights` and vLLM 0.33.0's model_executor/models/llama_eagle3.py),
read from the wheels' source without importing them (tests/wheel_source.py).

1. Checkpoints: every tensor model.py writes reaches a parameter through both engines' weight
   mapping; every config key either reads is written (or listed below with why its default is
   right); aux layer ids mean the same layers in both engines; d2t offsets mean the same ids.
2. Layouts (fc_norm, norm_before_fc, norm_output, num_hidden_layers > 1, more than three aux
   layers): the same for a checkpoint with all of them on, plus the engines' math for each as
   their sources have it (tests/test_layouts.py checks model.py's forward against that math).

Skipped, with the reason, only when a wheel can be neither found in the cache nor downloaded.
"""
import ast
import json
import re

import pytest
import torch

from conftest import make_tiny_target
from wheel_source import SGLANG, VLLM, Source, class_attrs, fetch_wheel, find_class, find_method


@pytest.fixture(scope="module")
def sgl():
    return Source(fetch_wheel(*SGLANG))


@pytest.fixture(scope="module")
def vllm():
    return Source(fetch_wheel(*VLLM))


# ----------------------------------------------------------------------------------------------
# 2. Checkpoints both engines load

def saved_draft(tmp_path_factory, name, aux, **layout):
    """(tensor names, config.json) of what model.py writes for a tiny draft: a reduced vocabulary,
    the captured layers `aux`, and the layout options `layout` (DraftConfig fields)."""
    import dataclasses
    from safetensors import safe_open
    from model import Eagle3Draft
    from draft_config import config_from_target
    target = make_tiny_target(vocab_size=64, hidden_size=32, layers=8)
    cfg = config_from_target(target.config, draft_vocab_size=48, aux_layer_ids=aux)
    cfg = dataclasses.replace(cfg, **layout)
    d = tmp_path_factory.mktemp(name)
    Eagle3Draft(cfg, target.get_input_embeddings().weight).save_pretrained(str(d))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    return names, json.loads((d / "config.json").read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """What model.py writes for a draft with a reduced vocabulary and non-default layers."""
    return saved_draft(tmp_path_factory, "draft", [0, 3, 6])


def literal(tree, fn_name, var):
    """The literal value assigned to `var` inside function `fn_name`."""
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn_name)
    node = next(n for n in ast.walk(fn) if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == var for t in n.targets))
    return ast.literal_eval(node.value)


def require_attrs(src, path, cls_name, attrs):
    cls = find_class(src.tree(path), cls_name)
    assert cls is not None, f"{path}: {cls_name} is gone"
    missing = set(attrs) - class_attrs(cls)
    assert not missing, f"{path}: {cls_name} no longer has {missing}"


def engine_params(cfg):
    """The parameter names an engine's draft model has for a config.json (both engines build the
    same modules: the wheels' sources are checked for each in the tests below): per decoder layer
    its norms, fused qkv and gate_up; fc_norm.{i} / input_norm only with their options."""
    n = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    params = {"lm_head.weight", "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight"}
    params |= {f"model.layers.{i}.{m}.weight" for i in range(cfg["num_hidden_layers"]) for m in [
        "hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj",
        "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]}
    if cfg.get("fc_norm"):
        params |= {f"model.fc_norm.{i}.weight" for i in range(n)}
    if cfg["eagle_config"].get("norm_before_fc"):
        params.add("model.input_norm.weight")
    return params


def test_sglang_loads_every_tensor(sgl, checkpoint):
    names, cfg = checkpoint
    sglang_loaded(sgl, names, engine_params(cfg))


def sglang_loaded(sgl, names, params):
    """Replay LlamaForCausalLMEagle3.load_weights with its own tables read from the source: every
    tensor must land on a parameter, and every parameter but the embedding get one."""
    path = "sglang/srt/models/llama_eagle3.py"
    tree = sgl.tree(path)
    # the modules whose parameters the names below address
    require_attrs(sgl, path, "LlamaForCausalLMEagle3", ["model", "lm_head", "hot_token_id"])
    require_attrs(sgl, path, "LlamaModel", ["embed_tokens", "fc", "layers", "norm"])
    require_attrs(sgl, path, "LlamaDecoderLayer", ["hidden_norm", "mlp"])
    require_attrs(sgl, "sglang/srt/models/llama.py", "LlamaDecoderLayer",
                  ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"])
    require_attrs(sgl, "sglang/srt/models/llama.py", "LlamaAttention", ["qkv_proj", "o_proj"])
    require_attrs(sgl, "sglang/srt/models/llama.py", "LlamaMLP", ["gate_up_proj", "down_proj"])
    if any(".fc_norm." in p for p in params):
        require_attrs(sgl, path, "LlamaModel", ["fc_norm"])
    if "model.input_norm.weight" in params:
        require_attrs(sgl, path, "LlamaModel", ["input_norm"])
    legacy = literal(tree, "load_weights", "legacy_name_map")
    stacked = literal(tree, "load_weights", "stacked_params_mapping")
    src = ast.get_source_segment(sgl.text(path), next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "load_weights"))
    assert '"d2t" in name' in src and '"t2d" in name' in src and "torch.arange" in src
    loaded = set()
    for name in names:
        for old, new in legacy.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name or "t2d" in name:   # d2t -> hot_token_id = d2t + arange; t2d skipped
            loaded.add(name)
            continue
        for param, weight, _ in stacked:
            if weight in name:
                name = name.replace(weight, param)
                break
        full = name if name in params else f"model.{name}"
        assert full in params, f"SGLang would silently drop {name}"
        loaded.add(full)
    # every parameter but the embedding (the target's, swapped in) gets a tensor
    assert params - loaded == {"model.embed_tokens.weight"}, params - loaded


def test_vllm_loads_every_tensor(vllm, checkpoint):
    names, cfg = checkpoint
    vllm_loaded(vllm, names, engine_params(cfg) | {"draft_id_to_target_id"})


def vllm_loaded(vllm, names, params):
    """Replay Eagle3LlamaForCausalLM.load_weights (and LlamaModel's hf_to_vllm_mapper) likewise."""
    path = "vllm/model_executor/models/llama_eagle3.py"
    tree = vllm.tree(path)
    require_attrs(vllm, path, "Eagle3LlamaForCausalLM", ["model", "lm_head", "draft_id_to_target_id"])
    require_attrs(vllm, path, "LlamaModel", ["embed_tokens", "fc", "layers", "norm"])
    require_attrs(vllm, path, "LlamaDecoderLayer", ["hidden_norm"])
    require_attrs(vllm, "vllm/model_executor/models/llama.py", "LlamaDecoderLayer",
                  ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"])
    require_attrs(vllm, "vllm/model_executor/models/llama.py", "LlamaAttention", ["qkv_proj", "o_proj"])
    require_attrs(vllm, "vllm/model_executor/models/llama.py", "LlamaMLP", ["gate_up_proj", "down_proj"])
    # LlamaModel.hf_to_vllm_mapper = WeightsMapper(orig_to_new_substr=..., orig_to_new_stacked=...)
    model_cls = find_class(tree, "LlamaModel")
    mapper = next(n.value for n in model_cls.body if isinstance(n, ast.Assign)
                  and n.targets[0].id == "hf_to_vllm_mapper")
    kw = {k.arg: ast.literal_eval(k.value) for k in mapper.keywords}
    top = find_method(find_class(tree, "Eagle3LlamaForCausalLM"), "load_weights")
    src = ast.get_source_segment(vllm.text(path), top)
    assert 'name.replace("d2t", "draft_id_to_target_id")' in src and '"t2d" in name' in src
    assert 'name = "model." + name' in src
    if any(".fc_norm." in p for p in params):
        require_attrs(vllm, path, "LlamaModel", ["fc_norm"])
    if "model.input_norm.weight" in params:   # else load_weights drops input_norm.* tensors
        require_attrs(vllm, path, "LlamaModel", ["input_norm"])
        assert 'if not self.model.norm_before_fc:\n            orig_to_new_substr["input_norm."] = None' in src
    loaded = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            loaded.add(name.replace("d2t", "draft_id_to_target_id"))
            continue
        if "lm_head" in name:
            loaded.add(name)
            continue
        for old, new in kw["orig_to_new_substr"].items():
            name = name.replace(old, new)
        for old, (new, _) in kw["orig_to_new_stacked"].items():
            if old in name:
                name = name.replace(old, new)
                break
        assert "model." + name in params, f"vLLM would not load {name}"
        loaded.add("model." + name)
    assert params - loaded == {"model.embed_tokens.weight"}, params - loaded
    # d2t means the same in both: target id = draft id + d2t[draft id]
    assert "base + self.draft_id_to_target_id" in vllm.text(path)


def config_reads(src, path):
    """Config keys a model file reads: config.X, self.config.X, getattr(config, "X", ...), and
    eagle_config.get("X", ...)."""
    required, optional, eagle = set(), set(), set()
    for node in ast.walk(src.tree(path)):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "config") or (
                    isinstance(v, ast.Attribute) and v.attr == "config"
                    and isinstance(v.value, ast.Name) and v.value.id == "self"):
                required.add(node.attr)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and \
                len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            obj = ast.unparse(node.args[0])
            if obj in ("config", "self.config"):
                optional.add(node.args[1].value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "get" and ast.unparse(node.func.value) == "eagle_config" and \
                node.args and isinstance(node.args[0], ast.Constant):
            eagle.add(node.args[0].value)
    return required - {"get"}, optional, eagle


# Keys an engine reads that model.py does not write, each with why the engine's default (or the
# transformers LlamaConfig default) is right for this project's drafts. A new key fails the test.
DEFAULTS_OK = {
    "intermediate_size_mlp": "read only when model_type is llama4_text",
    "bias": "fc without bias: default False",
    # layout options (model.py): written only when on (section 3 checks a checkpoint with all)
    "norm_before_fc": "written in eagle_config when on; off: default False",
    "fc_norm": "written when on; off: default", "use_aux_norm": "legacy name of fc_norm: "
                                                                "read by model.py, never written",
    "norm_output": "written when on; off: the pre-norm state feeds the next step (default)",
    "num_aux_hidden_states": "derived by both from eagle_aux_hidden_state_layer_ids (any number)",
    "rope_parameters": "transformers builds it from rope_theta/rope_scaling",
    "logit_scale": "no logit scaling: default 1.0",
    "norm_before_residual": "vLLM only; written when on (model.py applies it; the doctor "
                            "fails such a draft for SGLang); off: residual = g, default False",
    "attention_bias": "written: False",
    "target_layer_count": "vLLM sets it itself from the target",
    "draft_vocab_size": "written", "target_hidden_size": "written",
    "use_aux_hidden_state": "written in eagle_config",
    "eagle_aux_hidden_state_layer_ids": "written in eagle_config (SGLang) and top level (vLLM)",
    "layer_types": "all full attention: default",
    "quantization_config": "not quantized", "hidden_act": "written",
    "draft_model_config": "vLLM's own config objects, not the checkpoint",
    "speculative_config": "vLLM's own config objects", "model_config": "vLLM's own config objects",
    "parallel_drafting": "vLLM's speculative config",
    "rope_scaling": "written (None = plain RoPE)", "rope_theta": "written",
    "max_position_embeddings": "written", "head_dim": "written",
    "mrope_section": "text only: no multimodal RoPE",
    "mrope_interleaved": "text only: no multimodal RoPE",
    "dflash_config": "not a DFlash draft", "target_layer_ids": "not a DFlash/DSpark draft",
    "dspark_target_layer_ids": "not a DSpark draft",
}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_config_keys_both_engines_read(engine, sgl, vllm, checkpoint):
    _, cfg = checkpoint
    src, paths = (sgl, ["sglang/srt/models/llama_eagle3.py"]) if engine == "sglang" else \
        (vllm, ["vllm/model_executor/models/llama_eagle3.py"])
    required, optional, eagle = set(), set(), set()
    for p in paths:
        r, o, e = config_reads(src, p)
        required, optional, eagle = required | r, optional | o, eagle | e
    assert {"hidden_size", "rms_norm_eps", "vocab_size"} <= required   # the parser sees reads
    missing = {k for k in required | optional if k not in cfg and k not in DEFAULTS_OK}
    assert not missing, f"{engine} reads config keys the checkpoint lacks: {missing}"
    missing = {k for k in eagle if k not in cfg["eagle_config"] and k not in DEFAULTS_OK}
    assert not missing, f"{engine} reads eagle_config keys the checkpoint lacks: {missing}"
    assert cfg["tie_word_embeddings"] is False and cfg["draft_vocab_size"] == 48
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1


def test_aux_layers_mean_the_same_layers_in_both_engines(sgl, vllm, checkpoint):
    """Our id i = output of target layer i (transformers hidden_states[i+1]).
    SGLang: target reads eagle_config.eagle_aux_hidden_state_layer_ids and captures the input of
    layer i+1. vLLM 0.33.0: reads a top-level eagle_aux_hidden_state_layer_ids first (else
    eagle_config's, as is) and captures the stream entering layer k (k = idx + 1 after layer idx,
    so its default (2, L//2, L-3) is our default [1, L//2-1, L-4] + 1). One checkpoint: both keys,
    k = i + 1."""
    _, cfg = checkpoint
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]
    aux = sgl.text("sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py")
    assert 'eagle_config[\n                "eagle_aux_hidden_state_layer_ids"\n            ]' in aux
    runner = vllm.text("vllm/v1/worker/gpu_model_runner.py")
    i = runner.index('getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)')
    j = runner.index('eagle_config.get("eagle_aux_hidden_state_layer_ids")')
    assert i < j   # the top-level key wins over eagle_config's
    utils = vllm.text("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py")
    assert 'getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)' in utils
    llama = vllm.text("vllm/model_executor/models/llama.py")
    assert "aux_hidden_states, idx + 1, hidden_states, residual" in llama
    mixin = vllm.text("vllm/model_executor/models/interfaces.py")
    assert "return (2, num_layers // 2, num_layers - 3)" in mixin
    from draft_config import DraftConfig, default_aux_layers
    assert [i + 1 for i in default_aux_layers(30)] == [2, 30 // 2, 30 - 3]
    # a checkpoint whose two keys disagree is refused when read back
    from common import UserError
    bad = dict(cfg, eagle_aux_hidden_state_layer_ids=[0, 3, 6])
    with pytest.raises(UserError, match="name different layers"):
        DraftConfig.from_json(bad)
    assert DraftConfig.from_json(cfg).aux_layer_ids == [0, 3, 6]


def test_d2t_offsets_match_both_engines(sgl, vllm, checkpoint, tmp_path):
    """d2t holds offsets: target id = draft id + d2t. Read from both engines' loaders: SGLang
    turns d2t into hot_token_id = d2t + arange, vLLM maps draft logits to targets = arange + d2t
    (its draft_id_to_target_id); both applied below to the d2t we save."""
    sg = sgl.text("sglang/srt/models/llama_eagle3.py")
    assert 'if "d2t" in name:' in sg
    assert "self.hot_token_id = loaded_weight + torch.arange(loaded_weight.shape[0])" in sg
    vl = vllm.text("vllm/model_executor/models/llama_eagle3.py")
    assert 'name = name.replace("d2t", "draft_id_to_target_id")' in vl
    assert "base = torch.arange(self.config.draft_vocab_size, device=logits.device)" in vl
    assert "targets = base + self.draft_id_to_target_id" in vl
    from safetensors.torch import load_file
    from model import Eagle3Draft
    from draft_config import config_from_target
    target = make_tiny_target(vocab_size=64, hidden_size=32, layers=8)
    cfg = config_from_target(target.config, draft_vocab_size=4)
    draft = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    ids = torch.tensor([3, 10, 11, 60])
    if hasattr(draft, "set_vocab"):
        draft.set_vocab(ids)
    else:
        draft.d2t.copy_(ids - torch.arange(4))
        draft.t2d.zero_()
        draft.t2d[ids] = True
    draft.save_pretrained(str(tmp_path))
    sd = load_file(str(tmp_path / "model.safetensors"))
    loaded_weight = sd["d2t"]
    hot_token_id = loaded_weight + torch.arange(loaded_weight.shape[0])          # SGLang
    targets = torch.arange(cfg.draft_vocab_size) + sd["d2t"]                      # vLLM
    assert torch.equal(hot_token_id, ids) and torch.equal(targets, ids)
    assert sd["t2d"].sum() == 4 and bool(sd["t2d"][ids].all())


# ----------------------------------------------------------------------------------------------
# 3. Layouts (model.py "Layouts"): fc_norm, norm_before_fc, norm_output, num_hidden_layers > 1,
#    more than three aux layers. One checkpoint with all of them on; tests/test_layouts.py checks
#    the draft's forward against a transcription of the engines' forward.

@pytest.fixture(scope="module")
def layout_checkpoint(tmp_path_factory):
    return saved_draft(tmp_path_factory, "layout_draft", [0, 1, 3, 4, 6], fc_norm=True,
                       norm_before_fc=True, norm_output=True, num_hidden_layers=3)


def test_layout_tensors_load_in_both_engines(sgl, vllm, layout_checkpoint):
    names, cfg = layout_checkpoint
    assert {"fc_norm.4.weight", "input_norm.weight", "layers.2.self_attn.q_proj.weight",
            "layers.2.input_layernorm.weight"} <= names
    sglang_loaded(sgl, names, engine_params(cfg))
    vllm_loaded(vllm, names, engine_params(cfg) | {"draft_id_to_target_id"})


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_layout_config_keys_both_engines_read(engine, sgl, vllm, layout_checkpoint):
    """Where each option is read, with the key model.py writes it under."""
    import draft_config
    _, cfg = layout_checkpoint
    src, path = (sgl, "sglang/srt/models/llama_eagle3.py") if engine == "sglang" else \
        (vllm, "vllm/model_executor/models/llama_eagle3.py")
    required, optional, eagle = config_reads(src, path)
    assert {"fc_norm", "norm_output", "norm_before_fc", "num_aux_hidden_states"} <= optional
    assert {"norm_before_fc", "eagle_aux_hidden_state_layer_ids"} <= eagle
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["num_hidden_layers"] == 3
    assert cfg["eagle_config"]["norm_before_fc"] is True and "norm_before_fc" not in cfg
    assert set(draft_config.LAYOUT_FLAGS) <= optional | eagle
    text = src.text(path)
    # eagle_config's norm_before_fc first, then the top level
    assert compact('eagle_config.get("norm_before_fc", getattr(') in compact(text)
    # fc's width: num_aux_hidden_states, else the number of eagle_config layer ids
    assert 'layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")' in text
    assert "len(layer_ids) if layer_ids else 3" in text
    assert "num_aux_hidden_states" not in cfg   # derived by both from the 5 ids
    # every key either engine reads is written or has a stated default
    missing = {k for k in required | optional if k not in cfg and k not in DEFAULTS_OK}
    assert not missing, missing


def compact(text):
    return re.sub(r"\s+", "", text)


def test_layout_math_in_both_engines(sgl, vllm):
    """The semantics model.py implements, as both wheels' sources have them."""
    s = compact(sgl.text("sglang/srt/models/llama_eagle3.py"))
    v = compact(vllm.text("vllm/model_executor/models/llama_eagle3.py"))
    # layer 0 reads 2H ([input_layernorm(embeds), hidden_norm(h)], embedding first), later H
    assert compact("hidden_size = 2 * self.hidden_size if self.is_input_layer else self.hidden_size") in s
    assert compact("qkv_input_size = 2 * self.hidden_size if layer_idx == 0 else self.hidden_size") in v
    assert compact("hidden_states = torch.cat([embeds, hidden_states], dim=-1)") in s
    assert compact("hidden_states = torch.cat([embeds, hidden_states], dim=-1)") in v
    assert compact("for i in range(config.num_hidden_layers)") in s
    assert compact("for layer_idx in range(self.config.num_hidden_layers)") in v
    # a later layer's pre-attention norm (fused residual add): SGLang hidden_norm, vLLM
    # input_layernorm. model.py writes the same tensor under both names.
    assert compact("hidden_states, residual = self.hidden_norm(hidden_states, residual)") in s
    assert compact("hidden_states, residual = self.input_layernorm(hidden_states, residual)") in v
    # before fc: input_norm over the concatenation first, then fc_norm per chunk, then fc
    for t in (s, v):
        a = t.index("input_norm(hidden_states)")                 # self.(model.)input_norm
        b = t.index(".chunk(", a)
        c = t.index("fc_norm,chunks)", b)                          # zip(self.(model.)fc_norm, ..)
        assert t.index("fc(hidden_states)", c) > c
    assert compact("self.fc_input_size = target_hidden_size * self.num_aux_hidden_states") in v
    assert compact("self.hidden_size_in * self.num_aux_hidden_states") in s
    # SGLang applies fc only when the width is not H: one aux layer with Ht == H would skip it
    # (draft_config.check_aux_layers asks for two or more)
    assert compact("if hidden_states.shape[-1] != embeds.shape[-1]:") in s
    # norm_output: the next draft step gets the post-norm state
    assert compact("aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux") in s
    assert compact("aux_output = hidden_states if self.norm_output else hidden_prenorm") in v
    # SGLang's legacy spellings, which model.py reads too
    assert compact('getattr(config, "fc_norm", None) or getattr(config, "use_aux_norm", False)') in s
    legacy = literal(sgl.tree("sglang/srt/models/llama_eagle3.py"), "load_weights", "legacy_name_map")
    import draft_config
    import model
    assert {k.replace(".weight", ""): v.replace(".weight", "")
            for k, v in model.LEGACY_FC_NORM.items()} == {k: v for k, v in legacy.items()
                                                          if k.startswith("aux_norm")}
    # vLLM's norm_before_residual (never read by SGLang): layer 0's residual is hidden_norm(g),
    # model.py's MidLayer.finish
    assert "norm_before_residual" in v and "norm_before_residual" not in s
    assert compact("hidden_states = self.hidden_norm(hidden_states) residual = hidden_states") in v
    assert compact("if self.layer_idx == 0:") in v
    assert draft_config.VLLM_ONLY_FLAGS == ("norm_before_residual",)


def test_layout_aux_layers_captured_in_both_engines(sgl, vllm, layout_checkpoint):
    """Five ids: SGLang captures the input of layer i+1 for every id (a list, any length); vLLM
    reads the top-level list (k = i + 1), any length."""
    _, cfg = layout_checkpoint
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3, 4, 6]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4, 5, 7]
    llama = sgl.text("sglang/srt/models/llama.py")
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in llama
    mixin = vllm.text("vllm/model_executor/models/interfaces.py")
    assert "self.aux_hidden_state_layers = tuple(sorted(set(layers)))" in mixin   # ascending too
    assert "if layer_idx in self.aux_hidden_state_layers" in mixin
