"""The CPU RMSNorm with a gradient as one C++ autograd node: a torch extension
(``rmsnorm_grad.cpp``) built on first use against the running torch into ``$ENJOYLN_CACHE``;
where it cannot be built, ``ops`` takes the Python ``autograd.Function`` instead, with one
warning (docs/performance.md)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from . import cpu

SOURCE = Path(__file__).with_name("rmsnorm_grad.cpp")
# -O1: per call no slower than -O2 (measured within noise of each other), 6 s less CPU time to build
# (33 s)
FLAGS = ["-O1", "-shared", "-fPIC", "-std=c++20", "-w"]


def _flags() -> tuple[list[str], list[str]]:
    """Compile and link flags for the running torch and Python: the paths
    ``torch.utils.cpp_extension`` gives for a CPU extension, named here because importing it
    imports setuptools and costs 0.3 s per process."""
    root = Path(torch.__file__).parent
    includes = [
        root / "include",
        root / "include" / "torch" / "csrc" / "api" / "include",
        sysconfig.get_paths()["include"],
    ]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    lib = root / "lib"
    link = [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    if sys.platform == "darwin":  # Python's symbols come from the interpreter that loads it
        link.append("-Wl,-undefined,dynamic_lookup")
    return [*FLAGS, abi, *(f"-I{d}" for d in includes)], link


def _build() -> ModuleType:
    cxx = cpu.compiler("CXX", ("c++", "g++", "clang++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    flags, link = _flags()
    path = cpu.build_library(
        SOURCE,
        cxx,
        flags,
        link,
        key=f"{torch.__version__} {torch.version.git_version}",
        suffix=sysconfig.get_config_var("EXT_SUFFIX") or ".so",
        timeout=900,
    )
    spec = importlib.util.spec_from_file_location("rmsnorm_grad", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # built against other headers than the torch that loads it
        raise RuntimeError(f"cannot load {path.name}: {exc}") from exc
    module.set_kernels(
        *(_address(cpu.kernel(dtype)) for dtype in cpu.DTYPES)
    )  # f32, bf16, f16, as the C++ reads
    return module


def _address(function: Any) -> int:
    """A ctypes function's address, 0 for None."""
    return (ctypes.cast(function, ctypes.c_void_p).value or 0) if function is not None else 0


library = cpu.Once(_build)
"""The extension, built once per process (``ENJOYLN_DISABLE_CPU_KERNEL``: never); None if it cannot
be."""


def extension() -> ModuleType | None:
    """The built extension, or None after one warning saying why (none when disabled on purpose)."""
    module = library()
    if module is None and not os.environ.get("ENJOYLN_DISABLE_CPU_KERNEL"):
        warnings.warn(
            f"enjoyln: no C++ autograd node for RMSNorm ({library.error}); CPU calls with a "
            "gradient take a slower Python path",
            RuntimeWarning,
            stacklevel=4,
        )
    return module


def status() -> str:
    """What a CPU call that needs a gradient runs (``ops.status``, ``enjoyln env``)."""
    if library() is not None:
        return "one C++ autograd node"
    path = "a Python autograd function" if cpu.library() is not None else "the enjoyln.rms_norm op"
    return f"{path} (no C++ autograd node: {library.error})"
