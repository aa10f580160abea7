"""Raw RMSNorm kernels, kept apart from the ``nn.Module`` that uses them: ``rms_norm`` picks the
fused C kernel on CPU, ``F.rms_norm`` or the Triton kernel on CUDA, else the reference; where
autograd or a tracer must see the call it is the CompositeImplicitAutograd op
``torch.ops.enjoyln.rms_norm`` (docs/performance.md)."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from . import cpu, cuda, grad
from .reference import rms_norm_reference

__all__ = ["rms_norm", "add_rms_norm", "backend", "status", "paths", "opaque"]


def backend(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> str:
    """Which implementation ``rms_norm`` uses: 'cpu' or 'reference'; on CUDA, ``cuda.choose``'s
    path.

    >>> backend(torch.randn(2, 8, dtype=torch.float64))
    'reference'
    """
    if x.is_cuda:
        return cuda.backend(x, weight, bias)
    return (
        "cpu" if cpu.supports(x.contiguous(), weight, bias) else "reference"
    )  # contiguous: as _forward


def status() -> dict[str, str]:
    """What each device runs, and why (``enjoyln bench``, ``enjoyln env``).

    >>> sorted(status())
    ['cpu', 'cuda']
    """
    return {"cpu": f"{cpu.status()}; with a gradient, {grad.status()}", "cuda": cuda.status()}


def paths() -> dict[str, dict[str, str]]:
    """Which implementation each kind of call takes, by device ('cuda' where a GPU is at hand), and
    under a tracer on any device (``enjoyln env``).

    >>> sorted(paths())  # doctest: +SKIP
    ['any device', 'cpu']
    """
    fused = cpu.library() is not None
    kernel = "the fused C kernel" if fused else "reference PyTorch"
    if grad.library() is not None:
        with_grad = "the same forward and the op's backward as one C++ autograd node"
    else:
        with_grad = (
            "the fused C kernel and its backward in a Python autograd function; float64 or mixed "
            "dtypes through the enjoyln.rms_norm op"
            if fused
            else "reference PyTorch through the enjoyln.rms_norm op"
        )
    out = {
        "cpu": {
            "bf16/fp16/fp32": kernel,
            "float64, or mixed dtypes": "reference PyTorch",
            "a gradient needed": with_grad,
        }
    }
    if torch.cuda.is_available():
        out["cuda"] = cuda.cases()
    out["any device"] = {
        "torch.compile": "the math in plain PyTorch, which inductor fuses",
        "torch.export": "one enjoyln.rms_norm node per norm",
    }
    return out


def _forward(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor:
    """Whatever the hot paths turned away (strided, mixed dtypes, meta, float64), and the kernel
    op's forward."""
    if (
        x.device.type != "meta"
    ):  # real tensors only: a traced shape compared here would be specialised
        _agree(x, normalized_shape, weight, bias)
    if x.is_cuda:
        return cuda.rms_norm_any(x, normalized_shape, weight, bias, eps)
    n = math.prod(normalized_shape)
    if x.device.type == "cpu" and not x.is_contiguous():
        x = x.contiguous()
    if cpu.supports(x, weight, bias):
        return cpu.rms_norm_cpu(x, n, weight, bias, eps)
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)


# --- the ops: enjoyln::rms_norm (what graphs show) and enjoyln::rms_norm_kernel (what runs)
# ---------


# Sequence[int], not list[int]: torch 2.6's schema inference knows only typing's generics
@torch.library.custom_op("enjoyln::rms_norm_kernel", mutates_args=())
def _rms_norm_kernel(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
) -> Tensor:
    return _forward(x, normalized_shape, weight, bias, eps)


@_rms_norm_kernel.register_fake
def _(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _save(
    ctx,
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,  # noqa: ANN001
    eps: float,
) -> None:
    ctx.save_for_backward(x, weight)
    ctx.normalized_shape, ctx.eps, ctx.has_bias = normalized_shape, eps, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    _save(ctx, *inputs)


def _backward(ctx, grad: Tensor):  # noqa: ANN001, ANN201
    """d/dx of x·r·w + b with r = (mean(x²) + eps)^-½, in float32 (or wider)."""
    x, weight = ctx.saved_tensors
    dims = tuple(range(-len(ctx.normalized_shape), 0))
    lead = tuple(range(x.dim() - len(ctx.normalized_shape)))
    wide = torch.promote_types(x.dtype, torch.float32)
    xf, g = x.to(wide), grad.to(wide)
    r = torch.rsqrt(xf.square().mean(dims, keepdim=True) + ctx.eps)
    gw = g * weight.to(wide) if weight is not None else g
    dx = r * (gw - xf * r.square() * (xf * gw).mean(dims, keepdim=True))
    dw = (g * xf * r).sum(lead).to(weight.dtype) if weight is not None else None
    db = g.sum(lead).to(ctx.bias_dtype) if ctx.has_bias else None
    return dx.to(x.dtype), None, dw, db, None


_rms_norm_kernel.register_autograd(_backward, setup_context=_setup)


class _Fused(torch.autograd.Function):
    """The fused C kernel with the op's backward, as one Python autograd node: where the C++ node
    (``grad.py``) cannot be built, for plain CPU tensors that need a gradient outside any tracer,
    where the op's dispatch would cost several LayerNorm calls (docs/performance.md)."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        normalized_shape: Sequence[int],
        weight: Tensor | None,  # noqa: ANN001
        bias: Tensor | None,
        eps: float,
    ) -> Tensor:
        # ctx set up here, not in ``setup_context``: with one, every apply binds its arguments
        # through
        # inspect.signature, which costs more than the rest of the call
        _save(ctx, x, normalized_shape, weight, bias, eps)
        n = normalized_shape[0] if len(normalized_shape) == 1 else math.prod(normalized_shape)
        return cpu.rms_norm_cpu(x, n, weight, bias, eps)

    backward = staticmethod(_backward)


# Function.apply less its Python wrapper, which maps a pytree over the arguments for functorch on
# every call
# (a third of the call): only called where no functorch transform is active (``_mode``)
_fused = super(torch.autograd.Function, _Fused).apply


def _fused_or_none(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor | None:
    """Without the C++ node: the Python Function where the fused kernel applies, else None (the
    op)."""
    return _fused(x, normalized_shape, weight, bias, eps) if cpu.supports(x, weight, bias) else None


_grad: Callable[..., Tensor | None] | None = None
"""What a plain CPU call that needs a gradient runs: the C++ node's ``rms_norm``, else
``_fused_or_none``."""


def _first_grad() -> Callable[..., Tensor | None]:
    global _grad
    ext = grad.extension()
    _grad = ext.rms_norm if ext is not None else _fused_or_none
    return _grad


_library = torch.library.Library("enjoyln", "FRAGMENT")  # kept alive: the op lives as long as it
_library.define(
    "rms_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> "
    "Tensor"
)
_opaque = False


def _composite(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor:
    """``enjoyln::rms_norm``: the kernel op on plain tensors (eager calls), the math when traced
    through (FakeTensor, FunctionalTensor, DTensor); inside ``opaque()`` a trace keeps the kernel
    op."""
    if _opaque or all(_plain(t, False) for t in (x, weight, bias)):
        return torch.ops.enjoyln.rms_norm_kernel(x, normalized_shape, weight, bias, eps)
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)


_library.impl("rms_norm", _composite, "CompositeImplicitAutograd")


@contextlib.contextmanager
def opaque() -> Iterator[None]:
    """Inside this block ``enjoyln::rms_norm`` decomposes to one opaque ``enjoyln::rms_norm_kernel``
    node, for exporters that decompose every composite op they do not know
    (``run_decompositions()``, some ONNX ones).

    >>> ep = torch.export.export(enjoyln.fold(model), inputs)   # doctest: +SKIP
    >>> with opaque():                                           # doctest: +SKIP
    ...     ep = ep.run_decompositions()  # one enjoyln.rms_norm_kernel per norm
    """
    global _opaque
    before, _opaque = _opaque, True
    try:
        yield
    finally:
        _opaque = before


def _plain(t: Tensor | None, grad: bool) -> bool:
    """A plain tensor (not a subclass) that autograd need not see."""
    return t is None or (
        (type(t) is Tensor or type(t) is torch.nn.Parameter) and not (grad and t.requires_grad)
    )


HOT, GRAD, OP = (
    0,
    1,
    2,
)  # what a call needs: nothing seen; autograd alone; a tracer or a subclass (the op)


def _mode(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> int:
    """HOT, GRAD or OP for this call, inline (no ``_plain`` calls): at small shapes a call costs
    LayerNorm-sized time. GRAD needs no functorch transform active: ``_fused`` skips functorch's
    handling."""
    if type(x) is not Tensor or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return OP
    grad = torch.is_grad_enabled()
    need = grad and x.requires_grad
    for t in (weight, bias):
        if t is not None:
            if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
                return OP
            need = need or (grad and t.requires_grad)
    if not need:
        return HOT
    return OP if torch._C._are_functorch_transforms_active() else GRAD


def _needs_op(*tensors: Tensor | None) -> bool:
    """True when the call must be visible to autograd or to a tracer."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    grad = torch.is_grad_enabled()
    # a gradient, or a tensor subclass (functional tensors under export, DTensor, ...)
    return any(
        t is not None
        and (
            not _plain(t, grad)
            or isinstance(t, torch._subclasses.FakeTensor)
            or t.device.type == "meta"
        )
        for t in tensors
    )


def _agree(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None
) -> None:
    """Refuses, as ``F.layer_norm`` does, shapes that do not match ``normalized_shape``."""
    if len(normalized_shape) == 1:  # the common case first, in the cheapest reads: host time counts
        n = normalized_shape[0]
        if (
            x.shape[-1] == n
            and (weight is None or (weight.numel() == n and weight.dim() == 1))
            and (bias is None or (bias.numel() == n and bias.dim() == 1))
        ):
            return
    shape = tuple(normalized_shape)
    if (
        x.shape[x.dim() - len(shape) :] != shape
        or (weight is not None and weight.shape != shape)
        or (bias is not None and bias.shape != shape)
    ):
        raise RuntimeError(
            f"rms_norm: normalized_shape {list(shape)} does not match the input {list(x.shape)}, "
            f"weight {None if weight is None else list(weight.shape)} or bias "
            f"{None if bias is None else list(bias.shape)}"
        )


def rms_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """RMSNorm with gain and bias, the drop-in for ``F.layer_norm`` on zero-mean input.

    >>> import torch
    >>> x = torch.randn(2, 8)
    >>> x = x - x.mean(-1, keepdim=True)
    >>> torch.allclose(rms_norm(x, (8,)), torch.nn.functional.layer_norm(x, (8,)), atol=1e-6)
    True
    """
    mode = _mode(x, weight, bias)
    # the kernels below read raw pointers: a weight of the wrong length would be read past its end
    if mode != OP:
        _agree(x, normalized_shape, weight, bias)
    if mode == HOT:  # the inference hot path: a few attribute reads, then C or one kernel launch
        if cpu.supports(x, weight, bias):
            return cpu.rms_norm_cpu(
                x,
                normalized_shape[-1] if len(normalized_shape) == 1 else math.prod(normalized_shape),
                weight,
                bias,
                float(eps),
            )
        if cuda.supports(x, weight, bias):
            return cuda.rms_norm_cuda(x, normalized_shape, weight, bias, float(eps))
    elif mode == GRAD:  # a gradient: one autograd node, not the op's Python dispatch
        if x.is_cpu:
            y = (_grad or _first_grad())(x, normalized_shape, weight, bias, float(eps))
            if y is not None:
                return y
        elif cuda.supports(x, weight, bias):
            return cuda.rms_norm_autograd(x, normalized_shape, weight, bias, float(eps))
    shape = [int(s) for s in normalized_shape]
    if _needs_op(x, weight, bias):
        return torch.ops.enjoyln.rms_norm(x, shape, weight, bias, float(eps))
    return _forward(x, shape, weight, bias, float(eps))


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` and ``rms_norm(s)``; one fused kernel on CUDA. Returns ``(s, normed)``.

    >>> s, y = add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), (4,), eps=0.0)
    >>> s[0, 0].item(), y[0, 0].item()
    (2.0, 1.0)
    """
    if (
        _mode(x, weight, bias) == HOT
        and cuda.supports(x, weight, bias)
        and type(residual) is Tensor
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and residual.is_contiguous()
        and _plain(residual, torch.is_grad_enabled())
        and residual.get_device() == x.get_device()
    ):
        return cuda.add_rms_norm_cuda(x, residual, normalized_shape, weight, bias, float(eps))
    s = x + residual
    return s, rms_norm(s, normalized_shape, weight, bias, eps)
