"""RMSNorm on CUDA: which implementation runs, decided once per process from what was measured
(docs/performance.md: ``F.rms_norm`` without a bias, the Triton kernel through the cached launcher with a
bias or residual or from 32 MiB), and the call's hot path. ``ENJOYLN_CUDA_PATH`` (or ``force``) pins one."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import rms_norm_reference

LARGE = 32 << 20  # bytes of input from which the Triton kernel runs whatever the affine
PATHS = ("triton", "triton-jit", "native", "reference")  # ``auto``, or nothing: the policy


@dataclass
class _State:
    """What this process has, found once on the first CUDA call."""
    triton: Any = None  # the triton_kernels module, or None
    triton_reason: str = ""
    native: bool = False
    native_reason: str = ""
    forced: str | None = None
    notes: list[str] = field(default_factory=list)


_state: _State | None = None


def _native_fused() -> str:
    """'' where ``F.rms_norm`` runs torch's fused CUDA kernel, else why not."""
    if not hasattr(F, "rms_norm"):
        return f"torch {torch.__version__} has no F.rms_norm"
    with contextlib.suppress(RuntimeError):  # no such op in this torch
        if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA"):
            return ""
    return f"torch {torch.__version__}'s F.rms_norm has no fused CUDA kernel"


def _import_kernels() -> tuple[Any, str]:
    try:
        from . import triton_kernels
    except ImportError as exc:  # triton missing, or a build that cannot load
        return None, f"no Triton ({exc}; pip install 'enjoyln[triton]')"
    return triton_kernels, ""


def _setup(forced: str | None = None) -> _State:
    global _state
    st = _State(native_reason=_native_fused())
    st.native = not st.native_reason
    st.triton, st.triton_reason = _import_kernels()
    wanted = forced if forced is not None else os.environ.get("ENJOYLN_CUDA_PATH", "auto")
    if wanted not in ("auto", "") and wanted not in PATHS:
        st.notes.append(f"ENJOYLN_CUDA_PATH={wanted} is not one of auto, {', '.join(PATHS)}: ignored")
    elif wanted.startswith("triton") and st.triton is None:
        st.notes.append(f"{wanted} was asked for, but there is {st.triton_reason}: ignored")
    elif wanted in PATHS:
        st.forced = wanted
    _state = st
    return st


def kernels() -> Any:
    """The Triton kernels module where Triton imports, else None (found once per process)."""
    return (_state if _state is not None else _setup()).triton


def force(path: str | None) -> None:
    """Pin the path every CUDA call takes (``None`` or ``"auto"``: the policy again).

    >>> force("triton-jit")  # doctest: +SKIP
    """
    if path not in (None, "auto", *PATHS):
        raise ValueError(f"unknown CUDA path {path!r}; one of auto, {', '.join(PATHS)}")
    st = _setup(path or "auto")
    if path not in (None, "auto") and st.forced != path:
        raise RuntimeError("; ".join(st.notes))


def supports(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether the hot path takes these tensors: contiguous, ``x`` on CUDA and not empty, all one dtype and device."""
    if not x.is_cuda or not x.is_contiguous() or x.numel() == 0:
        return False
    for t in (weight, bias):
        if t is not None and (t.dtype != x.dtype or not t.is_contiguous() or t.get_device() != x.get_device()):
            return False
    return True


def choose(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: bool = False) -> str:
    """'native' (F.rms_norm), 'native+bias', 'triton' (cached launcher), 'triton-jit' or 'reference'.

    >>> choose(torch.randn(2048, 768, device="cuda"), None, None)  # doctest: +SKIP
    'native'
    """
    st = _state if _state is not None else _setup()
    if st.forced is not None:
        if st.forced == "native":
            return "native+bias" if bias is not None else "native"
        return st.forced
    large = x.numel() * x.element_size() >= LARGE
    if st.native and bias is None and not residual and not large:
        return "native"
    if st.triton is not None:
        if st.triton.launcher_disabled() is None:
            return "triton"
        if large or not st.native:
            return "triton-jit"
    if st.native:
        return "native+bias" if bias is not None else "native"
    return "reference"


def rms_norm_cuda(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
                  eps: float) -> Tensor:
    path = choose(x, weight, bias)
    if path == "native":
        return F.rms_norm(x, normalized_shape, weight, eps)
    if path == "native+bias":
        return F.rms_norm(x, normalized_shape, weight, eps).add_(bias)  # in place: a fresh tensor
    if path == "reference":
        return rms_norm_reference(x, normalized_shape, weight, bias, eps)
    if len(normalized_shape) == 1:
        return _state.triton.rms_norm_triton(x, weight, bias, eps, cached=path == "triton")
    n = math.prod(normalized_shape)
    y = _state.triton.rms_norm_triton(x.view(-1, n), weight, bias, eps, cached=path == "triton")
    return y.view(x.shape)


def add_rms_norm_cuda(x: Tensor, residual: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
                      bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """``(x + residual, RMSNorm of it)``: one Triton kernel where the policy picks Triton."""
    path = choose(x, weight, bias, residual=True)
    if path in ("triton", "triton-jit") and len(normalized_shape) == 1:
        return _state.triton.add_rms_norm_triton(x, residual, weight, bias, eps, cached=path == "triton")
    s = x + residual
    return s, rms_norm_cuda(s, normalized_shape, weight, bias, eps)


def status() -> str:
    if not torch.cuda.is_available():
        return "not available"
    st = _state if _state is not None else _setup()
    notes = [*st.notes]
    if st.forced is not None:
        text = f"{st.forced} for every call (pinned)"
    elif st.triton is not None:
        version = st.triton.triton.__version__
        off = st.triton.launcher_disabled()
        launcher = "enjoyln's cached launcher" if off is None else "Triton's own launcher"
        if st.native:
            when = "with a bias or a residual add, and from 32 MiB of input" if off is None else "from 32 MiB of input"
            text = f"torch's fused F.rms_norm without a bias; Triton {version} kernel through {launcher} {when}"
            if off is not None:
                text += "; below that, F.rms_norm then the bias add"
        else:
            text = f"Triton {version} kernel through {launcher} ({st.native_reason})"
        if off is not None:
            notes.append(f"the cached launcher is off: {off}")
    elif st.native:
        text = f"torch's fused F.rms_norm, then the bias add where there is one ({st.triton_reason})"
    else:
        text = f"reference PyTorch ({st.triton_reason}; {st.native_reason})"
    return "; ".join([text, *notes])
