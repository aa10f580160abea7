"""The fused CPU RMSNorm: a C kernel compiled on first use into ``$ENJOYLN_CACHE``
(docs/performance.md)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

SOURCE = Path(__file__).with_name("rmsnorm_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

_kernels: dict[torch.dtype, Any] = {}  # dtype -> ctypes function, filled once the library loads


def cache_dir() -> Path:
    return Path(os.environ.get("ENJOYLN_CACHE", Path.home() / ".cache" / "enjoyln"))


def compiler(env: str = "CC", names: tuple[str, ...] = ("cc", "gcc", "clang")) -> str | None:
    """The compiler ``$env`` names, else the first of ``names`` on the PATH; None if there is
    none."""
    return next((c for c in (os.environ.get(env), *names) if c and shutil.which(c)), None)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """``path`` held by this process alone: processes building the same library (pytest-xdist's
    workers) build it once, the others waiting, then loading what it wrote."""
    if fcntl is None:  # no POSIX locks: each builds, the rename below still atomic
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_library(
    source: Path,
    program: str,
    flags: list[str],
    link: list[str],
    *,
    key: str = "",
    suffix: str = ".so",
    timeout: float = 120,
) -> Path:
    """``source`` compiled by ``program`` (a compiler) into the cache, once per source, program,
    flags, ``key`` and machine; the path of the library."""
    # the headers beside it are part of what it compiles to
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(
        text + " ".join([program, *flags, *link, key, platform.machine(), platform.node()]).encode()
    )
    lib_path = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}{suffix}"
    if lib_path.exists():
        return lib_path
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(lib_path.with_name(lib_path.name + ".lock")):
        if lib_path.exists():  # built by another process while this one waited
            return lib_path
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            out = Path(tmp) / lib_path.name
            try:
                proc = subprocess.run(
                    [program, *flags, str(source), "-o", str(out), *link],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{program} took over {timeout:g} s") from None
            if proc.returncode != 0:
                lines = proc.stderr.strip().splitlines()
                first = next(
                    (line for line in lines if "error" in line), lines[0] if lines else "failed"
                )
                raise RuntimeError(f"{program} failed: {first.strip()}")
            os.replace(out, lib_path)  # atomic: concurrent builds never see half a file
    return lib_path


def compile_library(source: Path, flags: list[str]) -> ctypes.CDLL:
    """``source`` (C) compiled into the cache (once per source, compiler, flags and machine) and
    loaded."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    return ctypes.CDLL(str(build_library(source, cc, flags, ["-lm"])))


class Once:
    """A C library built on first use, once per process (``ENJOYLN_DISABLE_CPU_KERNEL``: never);
    calling it returns the library, or None with ``error`` saying why."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build, self.lock, self.loaded, self.value, self.error = (
            build,
            threading.Lock(),
            False,
            None,
            None,
        )

    def __call__(self) -> Any:
        if self.loaded:
            return self.value
        with self.lock:
            if not self.loaded:
                if os.environ.get("ENJOYLN_DISABLE_CPU_KERNEL"):
                    self.error = "disabled by ENJOYLN_DISABLE_CPU_KERNEL"
                else:
                    try:
                        self.value = self.build()
                    except (
                        OSError,
                        RuntimeError,
                        subprocess.SubprocessError,
                        AttributeError,
                    ) as exc:
                        self.error = str(exc)
                self.loaded = True
        return self.value


def _build() -> ctypes.CDLL:
    lib = compile_library(SOURCE, FLAGS)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    has_f16 = getattr(lib, "enjoyln_has_f16", lambda: 0)()
    kernels = {
        dtype: getattr(lib, f"enjoyln_rms_norm_{name}")
        for dtype, name in DTYPES.items()
        if dtype != torch.float16 or has_f16
    }
    for fn in kernels.values():
        fn.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = None
    _kernels.update(kernels)  # all or none
    return lib


library = Once(_build)
"""The compiled kernel, built once per process; None if it cannot be."""


def kernel(dtype: torch.dtype) -> Any:
    if not library.loaded:
        library()
    return _kernels.get(dtype)


def status() -> str:
    if library() is None:
        return f"reference PyTorch (no fused kernel: {library.error})"
    return f"fused C kernel, {torch.get_num_threads()} threads"


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    # x.is_cpu, not x.device.type: on every call, building a device object costs more than the check
    if not x.is_cpu or not x.is_contiguous() or x.numel() == 0 or kernel(x.dtype) is None:
        return False
    for t in (weight, bias):
        if t is not None and (t.dtype != x.dtype or not t.is_cpu or not t.is_contiguous()):
            return False
    return True


def rms_norm_cpu(
    x: torch.Tensor, n: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Fused forward over rows of ``n`` trailing elements; check ``supports`` first."""
    y = torch.empty_like(x)
    _kernels[x.dtype](
        x.data_ptr(),
        weight.data_ptr() if weight is not None else None,
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        x.numel() // n,
        n,
        eps,
        torch.get_num_threads(),
    )
    return y
