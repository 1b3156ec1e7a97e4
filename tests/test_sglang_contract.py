"""The SGLang contract, checked against the pinned wheels' source without importing them.

1. sglang_engine.py against sglang==0.5.23: every module and name it imports exists; every call it
   makes to an imported SGLang function or class fits the signature (keywords exist, required
   keyword-only arguments are passed, no more positionals than parameters); every attribute it
   reads on SGLang objects is defined; every server flag and ServerArgs field it passes exists; and
   the behaviours its comments rely on are still in the source.
2. Checkpoints: every tensor model.py writes reaches a parameter through SGLang's
   `LlamaForCausalLMEagle3.load_weights` mapping and vLLM's (vllm==0.33.0,
   model_executor/models/llama_eagle3.py); every config key either reads is written (or listed
   below with why its default is right); aux layer ids mean the same layers in both engines.
3. Layouts (fc_norm, norm_before_fc, norm_output, num_hidden_layers > 1, more than three aux
   layers): the same for a checkpoint with all of them on, plus the engines' math for each as
   their sources have it (tests/test_layouts.py checks model.py's forward against that math).

The wheels are downloaded once (pip download --no-deps, 39 MB and 336 MB) into the project cache
(~/.cache/eagle3/wheels, or $EAGLE3_CACHE/wheels) and read as zip files, never installed. Skipped, with the reason, only when a wheel can be
neither found there nor downloaded. Drift in any of this fails the test: update sglang_engine.py
(and the pins) together.
"""
import ast
import glob
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch

from conftest import ROOT, make_tiny_target

SGLANG = ("sglang", "0.5.23")
VLLM = ("vllm", "0.33.0")


def wheel_cache():
    from common import cache_dir
    return os.path.join(cache_dir(), "wheels")


def fetch_wheel(name, version):
    """The wheel as a ZipFile: from the cache, else pip download it there."""
    d = wheel_cache()
    hits = glob.glob(os.path.join(d, f"{name}-{version}-*.whl"))
    if not hits:
        os.makedirs(d, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            f"{name}=={version}", "-d", d], capture_output=True, text=True,
                           timeout=900)
        hits = glob.glob(os.path.join(d, f"{name}-{version}-*.whl"))
        if not hits:
            pytest.skip(f"cannot download the {name}=={version} wheel to read its source "
                        f"(pip: {p.stderr.strip()[-200:]})")
    return zipfile.ZipFile(hits[0])


@pytest.fixture(scope="module")
def sgl():
    return Source(fetch_wheel(*SGLANG))


@pytest.fixture(scope="module")
def vllm():
    return Source(fetch_wheel(*VLLM))


class Source:
    """Files of a wheel, parsed on demand."""

    def __init__(self, zf):
        self.zf, self.names, self.trees = zf, set(zf.namelist()), {}

    def text(self, path):
        return self.zf.read(path).decode()

    def tree(self, path):
        if path not in self.trees:
            self.trees[path] = ast.parse(self.text(path))
        return self.trees[path]

    def module_file(self, dotted):
        base = dotted.replace(".", "/")
        for p in (base + ".py", base + "/__init__.py"):
            if p in self.names:
                return p
        return None


def top_level_names(body):
    """Names a module body defines, including inside `if _is_cpu:` / try blocks."""
    out = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.If):
            out |= top_level_names(node.body) | top_level_names(node.orelse)
        elif isinstance(node, ast.Try):
            out |= top_level_names(node.body + node.orelse + node.finalbody)
            for h in node.handlers:
                out |= top_level_names(h.body)
    return out


def find_class(tree, name):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def find_method(cls, name):
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def class_attrs(cls):
    """Names an instance of `cls` has by its own source: methods, class-level names, self.X = ..."""
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def signature(fn, drop_first):
    """(positional names, required positional, keyword-only names, required keyword-only,
    *args?, **kwargs?) of a def."""
    a = fn.args
    pos = [x.arg for x in a.posonlyargs + a.args][1 if drop_first else 0:]
    n_req = len(a.posonlyargs + a.args) - len(a.defaults) - (1 if drop_first else 0)
    kwonly = [x.arg for x in a.kwonlyargs]
    req_kw = [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return pos, pos[:max(n_req, 0)], kwonly, req_kw, a.vararg is not None, a.kwarg is not None


def check_call(call, sig, where):
    pos, req_pos, kwonly, req_kw, varargs, varkw = sig
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return []   # *args / **kw splats: checked elsewhere
    errors = []
    n = len(call.args)
    if n > len(pos) and not varargs:
        errors.append(f"{where}: {n} positional arguments, the signature takes {len(pos)}")
    given = set(pos[:n]) | {k.arg for k in call.keywords}
    for k in call.keywords:
        if k.arg not in pos and k.arg not in kwonly and not varkw:
            errors.append(f"{where}: no parameter {k.arg!r}")
    for r in req_pos + req_kw:
        if r not in given:
            errors.append(f"{where}: required argument {r!r} not passed")
    return errors


def engine_tree():
    return ast.parse(open(os.path.join(ROOT, "sglang_engine.py")).read())


def engine_imports():
    """{local name: (module, name or None for a module)} for every `from sglang... import`."""
    out = {}
    for node in ast.walk(engine_tree()):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            for a in node.names:
                out[a.asname or a.name] = (node.module, a.name)
    return out


# ----------------------------------------------------------------------------------------------
# 1. sglang_engine.py against sglang==0.5.23

def resolve(sgl, module, name):
    """(file, ast node) where `module.name` is defined: a def/class, or a submodule file."""
    path = sgl.module_file(module)
    assert path, f"sglang module {module} is gone"
    sub = sgl.module_file(f"{module}.{name}")
    if sub:
        return sub, sgl.tree(sub)
    tree = sgl.tree(path)
    assert name in top_level_names(tree.body), f"{module} no longer defines {name}"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return path, node
    return path, None   # re-exported or assigned: existence checked, signature not resolvable


def callable_sig(node, method=None):
    """Signature of calling a function node, a class node (its __init__, or its annotated fields
    for dataclass/msgspec-style classes) or Class.method."""
    if isinstance(node, ast.FunctionDef):
        return signature(node, drop_first=False)
    if method is not None:
        fn = find_method(node, method)
        assert fn is not None, f"{node.name}.{method} is gone"
        deco = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        return signature(fn, drop_first="staticmethod" not in deco)
    init = find_method(node, "__init__")
    if init is not None:
        return signature(init, drop_first=True)
    fields = [(n.target.id, n.value is not None) for n in node.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    names, required = [f for f, _ in fields], [f for f, has in fields if not has]
    kw_only = any(k.arg == "kw_only" and getattr(k.value, "value", False) for k in node.keywords)
    if kw_only:   # msgspec.Struct(kw_only=True) / dataclass(kw_only=True): keywords only
        return [], [], names, required, False, False
    return names, required, [], [], False, False


def test_engine_imports_exist(sgl):
    imports = engine_imports()
    assert len(imports) >= 15   # the parser sees them (a refactor to `import sglang.x` would hide them)
    for local, (module, name) in imports.items():
        resolve(sgl, module, name)


def test_engine_calls_fit_signatures(sgl):
    imports = engine_imports()
    errors, checked = [], 0
    for call in ast.walk(engine_tree()):
        if not isinstance(call, ast.Call):
            continue
        f = call.func
        if isinstance(f, ast.Name) and f.id in imports:
            path, node = resolve(sgl, *imports[f.id])
            if node is None or f.id == "ServerArgs":   # ServerArgs: fields checked below
                continue
            errors += check_call(call, callable_sig(node), f"{f.id}()")
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in imports:
            path, node = resolve(sgl, *imports[f.value.id])
            if isinstance(node, ast.Module):     # a submodule: module.function(...)
                fn = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                           and n.name == f.attr), None)
                assert fn is not None, f"{f.value.id}.{f.attr} is gone"
                errors += check_call(call, signature(fn, False), f"{f.value.id}.{f.attr}()")
            else:
                errors += check_call(call, callable_sig(node, f.attr), f"{f.value.id}.{f.attr}()")
        else:
            continue
        checked += 1
    assert checked >= 15 and not errors, errors


# Attributes read on SGLang objects that sglang_engine gets back (not imported by name):
# (file under sglang/srt/, class, attributes). Class-level enum members count as attributes.
ATTRIBUTES = [
    ("model_executor/model_runner.py", "ModelRunner",
     ["model", "model_config", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size",
      "device", "forward", "alloc_memory_pool", "init_attention_backends", "init_cuda_graphs"]),
    ("model_executor/model_runner.py", "ModelRunnerOutput", ["logits_output"]),
    ("layers/logits_processor.py", "LogitsProcessorOutput", ["hidden_states"]),
    ("models/llama.py", "LlamaForCausalLM", ["model", "set_eagle3_layers_to_capture"]),
    ("models/llama.py", "LlamaModel", ["norm", "layers_to_capture"]),
    ("configs/model_config.py", "ModelConfig", ["num_hidden_layers", "from_server_args"]),
    ("managers/schedule_batch.py", "ScheduleBatch",
     ["init_new", "prepare_for_extend", "input_ids", "prefill_input_ids_cpu", "device"]),
    ("managers/schedule_batch.py", "Req",
     ["origin_input_ids", "full_untruncated_fill_ids", "extend_end", "logprob_start_len",
      "get_fill_ids"]),
    ("mem_cache/memory_pool.py", "ReqToTokenPool", ["clear"]),
    ("mem_cache/allocator/base.py", "BaseTokenToKVPoolAllocator", ["clear"]),
    ("server_args.py", "ServerArgs", ["resolve_once"]),
    ("model_executor/forward_batch_info.py", "CaptureHiddenMode", ["FULL"]),
    ("speculative/spec_info.py", "SpeculativeAlgorithm", ["NONE"]),
]


def test_attributes_engine_reads_exist(sgl):
    missing = []
    for path, cls_name, attrs in ATTRIBUTES:
        cls = find_class(sgl.tree("sglang/srt/" + path), cls_name)
        assert cls is not None, f"{path}: class {cls_name} is gone"
        have = class_attrs(cls)
        missing += [f"{cls_name}.{a}" for a in attrs if a not in have]
    assert not missing, missing


# sglang_engine.py's variable names for SGLang objects: every `var.attr` it reads or writes on
# them must exist on the class (found automatically, so a new use is checked without editing here)
ENGINE_VARIABLES = {
    "r": ("model_executor/model_runner.py", "ModelRunner"),
    "batch": ("managers/schedule_batch.py", "ScheduleBatch"),
    "req": ("managers/schedule_batch.py", "Req"),
    "model": ("models/llama.py", "LlamaForCausalLM"),
    "logits_output": ("layers/logits_processor.py", "LogitsProcessorOutput"),
    "server_args": ("server_args.py", "ServerArgs"),
}


def test_attributes_on_engine_variables_exist(sgl):
    used = {}
    for node in ast.walk(engine_tree()):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ENGINE_VARIABLES:
            used.setdefault(node.value.id, set()).add(node.attr)
    assert set(used) == set(ENGINE_VARIABLES), set(ENGINE_VARIABLES) - set(used)
    missing = []
    for var, attrs in used.items():
        path, cls_name = ENGINE_VARIABLES[var]
        have = class_attrs(find_class(sgl.tree("sglang/srt/" + path), cls_name))
        missing += [f"{var}.{a} ({cls_name})" for a in sorted(attrs - have)]
    assert not missing, missing


def test_tree_cache_stand_in_matches_one_batch(sgl):
    """_NoPrefixCache copies one_batch.py's TreeCacheNamespace: same methods, same fields."""
    import sglang_engine
    tree = sgl.tree("sglang/benchmark/one_batch.py")
    ns = find_class(tree, "TreeCacheNamespace")
    theirs = {n.name for n in ns.body if isinstance(n, ast.FunctionDef)}
    ours = {n for n in vars(sglang_engine._NoPrefixCache) if not n.startswith("_")}
    assert theirs == ours, (theirs, ours)
    extend = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "extend")
    call = next(c for c in ast.walk(extend) if isinstance(c, ast.Call)
                and getattr(c.func, "id", None) == "TreeCacheNamespace")
    fields = {k.arg for k in call.keywords}
    stand_in = sglang_engine._NoPrefixCache(1, "cpu", None)
    assert fields == set(vars(stand_in)), (fields, set(vars(stand_in)))


def server_fields(sgl):
    """Every ServerArgs field: annotated names in srt/arg_groups/fields/*.py."""
    out = set()
    for p in sgl.names:
        if p.startswith("sglang/srt/arg_groups/fields/") and p.endswith(".py"):
            for node in ast.walk(sgl.tree(p)):
                if isinstance(node, ast.ClassDef):
                    out |= {n.target.id for n in node.body
                            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return out


def test_server_args_and_flags_exist(sgl):
    fields = server_fields(sgl)
    assert len(fields) > 200
    # ServerArgs(**kw) in runner(): the dict's keys and later kw["..."] assignments
    runner = next(n for n in engine_tree().body if isinstance(n, ast.FunctionDef) and n.name == "runner")
    used = set()
    for node in ast.walk(runner):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
            used |= {k.arg for k in node.keywords}
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            used.add(node.slice.value)
    assert {"model_path", "dtype", "device"} <= used
    assert not used - fields, used - fields
    # command-line flags: the engine's, the CPU tests' and the README's
    flags = set()
    for path in ["sglang_engine.py", "README.md", "tests/test_sglang_cpu.py", ".ci/run"]:
        full = os.path.join(ROOT, path)
        if os.path.exists(full):
            flags |= set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]+)", open(full).read()))
    ours = {"backend", "server-url", "server-args", "server-timeout", "target-backend", "skip-launch-server",
            "config-list", "benchmark-list", "draft", "target", "out", "output", "prompts", "data",
            "hidden-states", "hidden-dtype", "max-new-tokens", "temperature", "no-deps", "port",
            "host", "dtype", "threads"}
    sglang_flags = {f for f in flags if f.replace("-", "_") in fields}
    unknown = {f for f in flags - ours - sglang_flags
               if f.startswith(("speculative", "enable-return", "return-aux", "disable-radix",
                                "device", "max-total", "mem-fraction", "attention-backend",
                                "model-path", "sampling-defaults", "tp-size"))}
    assert not unknown, f"flags SGLang 0.5.23 does not have: {unknown}"
    assert {"model-path", "device", "speculative-algorithm", "speculative-num-steps",
            "speculative-eagle-topk", "speculative-num-draft-tokens",
            "speculative-draft-model-path", "max-total-tokens"} <= sglang_flags


def test_behaviours_the_engine_relies_on(sgl):
    """What sglang_engine.py's comments say SGLang does, still in the source."""
    llama = sgl.text("sglang/srt/models/llama.py")
    # capture = input of layer i+1 = output of layer i; ascending order whatever the given order
    assert "[val + 1 for val in layer_ids]" in llama
    assert "if i in self.layers_to_capture" in llama
    sb = sgl.text("sglang/srt/managers/schedule_batch.py")
    assert "r.get_fill_ids()" in sb and "r.extend_end" in sb
    ob = sgl.text("sglang/benchmark/one_batch.py")
    assert "batch.prefill_input_ids_cpu.to(" in ob and "publish(" in ob
    fb = find_class(sgl.tree("sglang/srt/model_executor/forward_batch_info.py"), "ForwardBatch")
    _, _, kwonly, req_kw, _, _ = signature(find_method(fb, "init_new"), True)
    assert "capture_hidden_mode" in kwonly and req_kw == ["return_hidden_states_before_norm"]
    mr = sgl.text("sglang/srt/model_executor/model_runner.py")
    assert 'assert_published(server_args, role="scheduler")' in mr or "assert_published(" in mr
    # the chat endpoint fills these from generation_config.json unless the request sets them
    serving = sgl.text("sglang/srt/arg_groups/fields/serving.py")
    assert re.search(r"sampling_defaults: A\[.*?\] = \"model\"", serving, re.S)
    req = find_class(sgl.tree("sglang/srt/entrypoints/openai/protocol.py"), "ChatCompletionRequest")
    assert {"messages", "model", "max_tokens", "temperature", "top_p", "top_k", "min_p",
            "repetition_penalty"} <= class_attrs(req)
    gen = find_class(sgl.tree("sglang/srt/managers/io_struct.py"), "GenerateReqInput")
    assert {"input_ids", "sampling_params"} <= class_attrs(gen)
    sp = find_class(sgl.tree("sglang/srt/sampling/sampling_params.py"), "SamplingParams")
    assert {"max_new_tokens", "temperature", "top_p", "stop_token_ids"} <= class_attrs(sp)
    http = sgl.text("sglang/srt/entrypoints/http_server.py")
    assert '@app.get("/health")' in http and '"/v1/chat/completions"' in http
    assert '"/generate"' in http
    # accept length: spec_verify_ct is reported in meta_info
    assert any("spec_verify_ct" in sgl.text(p) for p in sgl.names
               if p.startswith("sglang/srt/managers/") and p.endswith(".py"))
    # the CPU engine imports these *_cpu kernels at import time (tests/sglang_cpu_shims)
    for path, name in [("sglang/srt/mem_cache/allocation.py", "assign_req_to_token_pool_cpu"),
                       ("sglang/kernels/ops/kvcache/cache_move.py", "copy_all_layer_kv_cache_cpu")]:
        assert f"from sgl_kernel import {name}" in sgl.text(path)


def test_layer_ids_must_be_sorted_and_distinct():
    import sglang_engine
    from common import UserError
    assert sglang_engine.check_layer_ids([1, 14, 26], 30) == [1, 14, 26]
    for bad in ([14, 1, 26], [1, 1, 26], [1, 14, 29], [-1, 2, 3]):
        with pytest.raises(UserError, match=r"layer"):
            sglang_engine.check_layer_ids(bad, 30)


# ----------------------------------------------------------------------------------------------
# 2. Checkpoints both engines load

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """What model.py writes for a draft with a reduced vocabulary and non-default layers."""
    from safetensors import safe_open
    from model import Eagle3Draft
    from draft_config import config_from_target
    target = make_tiny_target(vocab_size=64, hidden_size=32, layers=8)
    cfg = config_from_target(target.config, draft_vocab_size=48, aux_layer_ids=[0, 3, 6])
    d = tmp_path_factory.mktemp("draft")
    Eagle3Draft(cfg, target.get_input_embeddings().weight).save_pretrained(str(d))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    return names, json.loads((d / "config.json").read_text())


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
    import dataclasses
    from safetensors import safe_open
    from model import Eagle3Draft
    from draft_config import config_from_target
    target = make_tiny_target(vocab_size=64, hidden_size=32, layers=8)
    cfg = config_from_target(target.config, draft_vocab_size=48, aux_layer_ids=[0, 1, 3, 4, 6])
    cfg = dataclasses.replace(cfg, fc_norm=True, norm_before_fc=True, norm_output=True,
                              num_hidden_layers=3)
    d = tmp_path_factory.mktemp("layout_draft")
    Eagle3Draft(cfg, target.get_input_embeddings().weight).save_pretrained(str(d))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    return names, json.loads((d / "config.json").read_text())


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


# ----------------------------------------------------------------------------------------------
# User errors on the SGLang paths (no SGLang call needed)

def test_sglang_paths_fail_with_one_line_errors(monkeypatch):
    import sglang_engine
    import train
    from common import UserError
    args = train.parse_args(["--data", "d", "--out", "o", "--offline", "--target-backend", "sglang"])
    with pytest.raises(UserError, match="--target-backend"):
        train.check_args(args)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)   # the CPU engine is opt-in
    if not torch.cuda.is_available():   # without sglang, or with it but no GPU: one clear line
        with pytest.raises(UserError, match="--backend sglang needs"):
            sglang_engine.require_sglang()
