"""Reading the pinned engine wheels' source without installing them: the wheels (pip download
--no-deps, cached in ~/.cache/eagle3/wheels or $EAGLE3_CACHE/wheels) opened as zip files and their
Python parsed with ast. Shared by tests/test_sglang_contract.py (sglang_engine.py against SGLang)
and tests/test_engine_checkpoints.py (the drafts model.py writes against both engines' loaders)."""
import ast
import glob
import os
import subprocess
import sys
import zipfile

import pytest

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
