"""Chameleon-Megatron: megatron.training, megatron.elastic and chameleon_ext.

`megatron` is a namespace package shared with the installed megatron-core (megatron.core), so it
has no __init__.py here. The csrc extension (chameleon_ext.comm._C) is optional: when it cannot be
built, the pure-torch paths are used.
"""

import os
import sys

from setuptools import find_namespace_packages, setup


# ---- the csrc extension (chameleon_ext.comm._C) -----------------------------------------------------
# C++ always; C++ + CUDA where torch is a CUDA build, nvcc is found (torch's CUDA_HOME) and a GPU
# is visible at build time (or FORCE_CUDA=1). CHAMELEON_NO_EXT=1 skips it. A failing build never
# fails the install: one warning line, and chameleon_ext.comm.packed uses its pure-torch fallback.
def _warn(msg: str) -> None:
    print(f"WARNING: chameleon_ext.comm._C: {msg}", file=sys.stderr, flush=True)


def _short(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]


def _remove_stale_extension() -> None:
    """An editable install builds chameleon_ext.comm._C in place; when it is not (re)built, an older
    copy left there must not be imported instead."""
    import glob

    here = os.path.dirname(os.path.abspath(__file__))
    for path in glob.glob(os.path.join(here, "chameleon_ext", "comm", "_C.*")):
        if path.endswith((".so", ".pyd", ".dylib")):
            os.remove(path)
            print(f"chameleon_ext.comm._C: removed the stale in-place build {path}", flush=True)


def _extension_kwargs() -> dict:
    if os.environ.get("CHAMELEON_NO_EXT", "") == "1":
        print("chameleon_ext.comm._C: CHAMELEON_NO_EXT=1, not building the csrc extension", flush=True)
        _remove_stale_extension()
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # torch missing at build time: install without the extension
        _warn(f"torch is not importable at build time ({exc}); installing without it")
        _remove_stale_extension()
        return {}

    with_cuda = (cpp_extension.CUDA_HOME is not None and torch.version.cuda is not None
                 and (torch.cuda.is_available() or os.environ.get("FORCE_CUDA", "") == "1"))
    cxx_flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
    sources = ["csrc/comm.cpp"]
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            "chameleon_ext.comm._C", sources + ["csrc/comm_cuda.cu"],
            define_macros=[("CHAMELEON_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]})
    else:
        ext = cpp_extension.CppExtension("chameleon_ext.comm._C", sources,
                                         extra_compile_args={"cxx": cxx_flags})
    ext.optional = True  # setuptools then skips copying a missing output instead of failing

    class OptionalBuildExt(cpp_extension.BuildExtension):
        """torch's BuildExtension, but a failure is one warning line instead of a failed install."""

        def _failed(self, exc):
            _warn(f"build failed ({_short(exc)}); installing without it (pure-torch fallback)")
            _remove_stale_extension()

        def run(self):
            try:
                super().run()
            except Exception as exc:
                self._failed(exc)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                self._failed(exc)

        def get_outputs(self):  # only what was really built (an editable wheel lists these)
            return [p for p in super().get_outputs() if os.path.exists(p)]

    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExt}}


setup(
    name="chameleon-megatron",
    version="0.1.0",
    description="Fault-tolerant Megatron-style GPT training with adaptive recovery",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.training*", "megatron.elastic*",
                                              "chameleon_ext*"]),
    install_requires=["torch==2.13.0", "megatron-core==0.16.1", "numpy", "tqdm", "tensorboard"],
    extras_require={"dev": ["pytest", "pytest-timeout"]},
    entry_points={"console_scripts": ["chameleon-launch = chameleon_ext.control.launcher:main",
                                      "chameleon-plan = chameleon_ext.planning.cli:main"]},
    **_extension_kwargs(),
)
