"""Test-only stand-in for the CUDA-only `sglang-kernel` wheel (see ../README.md).

`from sgl_kernel import X_cpu` succeeds so SGLang's modules import; calling X_cpu raises. Any other
name is missing (ImportError), as it would be without the package, so SGLang's feature probes are
not fooled."""


def _missing(name):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} was called: it is a CPU kernel this test stand-in "
                           f"does not have (tests/sglang_cpu_shims/README.md)")
    kernel.__name__ = name
    return kernel


def __getattr__(name):
    if name.endswith("_cpu"):
        return _missing(name)
    raise AttributeError(f"module 'sgl_kernel' (test stand-in) has no attribute {name!r}")
