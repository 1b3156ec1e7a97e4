"""sglang_engine.py against the pinned sglang==0.5.23 wheel's source, read without importing it
(tests/wheel_source.py): every module and name it imports exists; every call it makes to an
imported SGLang function or class fits the signature (keywords exist, required keyword-only
arguments are passed, no more positionals than parameters); every attribute it reads on SGLang
objects is defined; every server flag and ServerArgs field it passes exists; and the behaviours its
comments rely on are still in the source. The drafts model.py writes are checked against both
engines' loaders in tests/test_engine_checkpoints.py.

Skipped, with the reason, only when the wheel can be neither found in the cache nor downloaded.
Drift in any of this fails the test: update sglang_engine.py (and the pin) together.
"""
import ast
import os
import re

import pytest
import torch

from conftest import ROOT
from wheel_source import (SGLANG, Source, check_call, class_attrs, fetch_wheel, find_class,
                          find_method, signature, top_level_names)


@pytest.fixture(scope="module")
def sgl():
    return Source(fetch_wheel(*SGLANG))


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
