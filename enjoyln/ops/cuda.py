"""RMSNorm on CUDA: which implementation runs, decided once per process from what was measured
(docs/performance.md: ``F.rms_norm`` without a bias, the Triton kernel through the cached launcher
with a bias or residual or from 32 MiB), and the call's hot path. ``ENJOYLN_CUDA_PATH`` (or
``force``) pins one."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import rms_norm_reference

LARGE = 32 << 20  # bytes of input from which the Triton kernel runs whatever the affine
PATHS = ("triton", "triton-jit", "native", "reference")  # ``auto``, or nothing: the policy
KERNEL_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
)  # the Triton kernels accumulate in float32


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
        st.notes.append(
            f"ENJOYLN_CUDA_PATH={wanted} is not one of auto, {', '.join(PATHS)}: ignored"
        )
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
    """Whether the hot path takes these tensors: contiguous, ``x`` on CUDA and not empty, all one
    dtype and device."""
    if not x.is_cuda or not x.is_contiguous() or x.numel() == 0:
        return False
    for t in (weight, bias):
        if t is not None and (
            t.dtype != x.dtype or not t.is_contiguous() or t.get_device() != x.get_device()
        ):
            return False
    return True


def narrow(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> bool:
    """Whether the Triton kernels, which compute in float32, are exact for these dtypes: float32 and
    narrower. A float64 norm must stay float64 (torch's own path), or the check's float64 truth is
    fp32.

    >>> narrow(torch.ones(2, dtype=torch.float64))
    False
    """
    return x.dtype in KERNEL_DTYPES and all(
        t is None or t.dtype in KERNEL_DTYPES for t in (weight, bias)
    )


def choose(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: bool = False) -> str:
    """'native' (F.rms_norm), 'native+bias', 'triton' (cached launcher), 'triton-jit' or
    'reference': a pure function of the process state and the call's dtypes and size, so it is
    decided (and tested) without a GPU.

    >>> choose(torch.randn(2048, 768, device="cuda"), None, None)  # doctest: +SKIP
    'native'
    """
    st = _state if _state is not None else _setup()
    if not narrow(x, weight, bias):  # whatever is pinned: a Triton kernel would compute it in fp32
        return (
            "reference"
            if st.forced == "reference"
            else "native+bias"
            if bias is not None
            else "native"
        )
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


def _lose_triton(exc: Exception) -> None:
    """A Triton kernel failed to compile or launch: no Triton for the rest of the process, said
    once."""
    st = _state
    cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}".rstrip(": ")
    st.triton, st.triton_reason = None, f"the Triton kernel failed ({cause})"
    if st.forced is not None and st.forced.startswith("triton"):
        st.forced = None
    instead = "torch's F.rms_norm" if st.native else "reference PyTorch"
    warnings.warn(
        f"enjoyln: the Triton RMSNorm kernel failed ({cause}); {instead} runs instead for the rest "
        "of this process",
        RuntimeWarning,
        stacklevel=4,
    )


def _triton(name: str, *args: Any, cached: bool) -> Any:
    """``triton_kernels.<name>(*args)``, or None once it failed (then the caller takes a path
    without Triton). Out of memory is not Triton's fault: every path would need the memory, so it
    is raised."""
    try:
        return getattr(_state.triton, name)(*args, cached=cached)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a compiler, driver or resource error of Triton's
        _lose_triton(exc)
        return None


def rms_norm_cuda(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor:
    path = choose(x, weight, bias)
    if path in ("triton", "triton-jit"):
        n = normalized_shape[-1] if len(normalized_shape) == 1 else math.prod(normalized_shape)
        y = _triton(
            "rms_norm_triton",
            x.view(-1, n) if len(normalized_shape) > 1 else x,
            weight,
            bias,
            eps,
            cached=path == "triton",
        )
        if y is not None:
            return y.view(x.shape) if len(normalized_shape) > 1 else y
        path = choose(x, weight, bias)  # Triton is gone: the policy without it
    if path == "native":
        return F.rms_norm(x, normalized_shape, weight, eps)
    if path == "native+bias":
        return F.rms_norm(x, normalized_shape, weight, eps).add_(bias)  # in place: a fresh tensor
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)


def rms_norm_autograd(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor:
    """For a call that needs a gradient: ``F.rms_norm`` then the bias add, whose backward torch's
    autograd computes in C++ (in the input's dtype from float32 up: float64 stays float64)."""
    y = F.rms_norm(x, normalized_shape, weight, eps)
    return y + bias if bias is not None else y


def unfused(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> str:
    """The path of a call the hot path turns away (strided, mixed dtypes): the Triton kernel, which
    reads strided rows and mixed dtypes, where they are float32 or narrower and all on ``x``'s
    GPU; else the reference. Pure, as ``choose`` is.

    >>> unfused(torch.randn(8, 4, dtype=torch.float64, device="cuda").t(), None, None)  # doctest: +SKIP
    'reference'
    """  # noqa: E501
    st = _state if _state is not None else _setup()
    if (
        st.triton is None
        or st.forced not in (None, "triton", "triton-jit")
        or x.numel() == 0
        or not narrow(x, weight, bias)
        or any(t is not None and t.device != x.device for t in (weight, bias))
    ):
        return "reference"
    return st.forced or "triton"


def backend(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> str:
    """The path ``rms_norm_any`` takes for these tensors."""
    return choose(x, weight, bias) if supports(x, weight, bias) else unfused(x, weight, bias)


def rms_norm_any(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor:
    """Any CUDA call, the ones the hot path turns away included: ``rms_norm_cuda`` where the hot
    path takes it, else ``unfused``'s path."""
    if supports(x, weight, bias):
        return rms_norm_cuda(x, normalized_shape, weight, bias, eps)
    path = unfused(x, weight, bias)
    if path != "reference":
        n = math.prod(normalized_shape)
        flat = [t.reshape(-1) if t is not None else None for t in (weight, bias)]
        y = _triton("rms_norm_triton", x.reshape(-1, n), *flat, eps, cached=path == "triton")
        if y is not None:
            return y.view(x.shape)
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)


def add_rms_norm_cuda(
    x: Tensor,
    residual: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """``(x + residual, RMSNorm of it)``: one Triton kernel where the policy picks Triton."""
    path = choose(x, weight, bias, residual=True)
    if path in ("triton", "triton-jit") and len(normalized_shape) == 1:
        out = _triton(
            "add_rms_norm_triton", x, residual, weight, bias, eps, cached=path == "triton"
        )
        if out is not None:
            return out
    s = x + residual
    return s, rms_norm_cuda(s, normalized_shape, weight, bias, eps)


NAMES = {
    "native": "torch's F.rms_norm",
    "native+bias": "torch's F.rms_norm, then the bias add",
    "triton": "enjoyln's Triton kernel, cached launcher",
    "triton-jit": "enjoyln's Triton kernel, Triton's launcher",
    "reference": "reference PyTorch",
}


def cases() -> dict[str, str]:
    """Which path each kind of call on a GPU takes in this process (``enjoyln env``), as ``choose``
    and ``unfused`` decide it for meta tensors of that kind: no GPU needed.

    >>> cases()["float64"]  # doctest: +SKIP
    "torch's F.rms_norm, then the bias add"
    """

    def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    x, w, wide = meta(2048, 768), meta(768), meta(768, dtype=torch.float64)
    picks = {
        "bf16/fp16/fp32, weight only or none": choose(x, w, None),
        "bf16/fp16/fp32, with a bias": choose(x, w, w),
        "the residual add fused (add_rms_norm)": choose(x, w, w, residual=True),
        "32 MiB of input or more": choose(meta(8192, 4096), meta(4096), meta(4096)),
        "float64": choose(meta(2048, 768, dtype=torch.float64), wide, wide),
        "strided rows, or the weight in another dtype": unfused(
            x, meta(768, dtype=torch.float32), None
        ),
    }
    return {
        **{case: NAMES[path] for case, path in picks.items()},
        "a gradient needed": f"{NAMES['native+bias']}, through torch's autograd",
    }


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
            when = (
                "with a bias or a residual add, and from 32 MiB of input"
                if off is None
                else "from 32 MiB of input"
            )
            text = (
                f"torch's fused F.rms_norm without a bias; Triton {version} kernel through "
                f"{launcher} {when}"
            )
            if off is not None:
                text += "; below that, F.rms_norm then the bias add"
        else:
            text = f"Triton {version} kernel through {launcher} ({st.native_reason})"
        if off is not None:
            notes.append(f"the cached launcher is off: {off}")
    elif st.native:
        text = (
            f"torch's fused F.rms_norm, then the bias add where there is one ({st.triton_reason})"
        )
    else:
        text = f"reference PyTorch ({st.triton_reason}; {st.native_reason})"
    return "; ".join([text, *notes])
