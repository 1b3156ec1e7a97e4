"""Test-only stand-in for torchvision in the SGLang CPU environment (see ../README.md).

Every `torchvision.*` module imports and every name in it exists, so import-time references in
SGLang (srt/multimodal/internvl_utils.py) and transformers (image/video processing modules) work;
calling anything raises. No image or video code can run through it: multimodal is out of scope."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0"  # not a real torchvision: version checks for any feature fail


class _Missing:
    """A name that exists for `from torchvision... import X` and attribute chains, and fails on use."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a test stand-in here "
                           f"(tests/sglang_cpu_shims/README.md)")

    def __repr__(self):
        return f"<stand-in {self._name}>"


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates torchvision.<anything> on import."""

    def find_spec(self, name, path, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Missing(f"{__name__}.{attr}")
