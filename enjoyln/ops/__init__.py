"""Raw RMSNorm kernels, kept apart from the ``nn.Module`` that uses them: ``rms_norm`` picks the fused C
kernel on CPU, ``F.rms_norm`` or the Triton kernel on CUDA, else the reference; where autograd or a tracer
must see the call it is the CompositeImplicitAutograd op ``torch.ops.enjoyln.rms_norm`` (docs/performance.md)."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from . import cpu, cuda
from .reference import rms_norm_reference

__all__ = ["rms_norm", "add_rms_norm", "backend", "status", "opaque"]


def backend(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> str:
    """Which implementation ``rms_norm`` uses: 'cpu' or 'reference'; on CUDA, ``cuda.choose``'s path.

    >>> backend(torch.randn(2, 8, dtype=torch.float64))
    'reference'
    """
    if x.is_cuda:
        if cuda.supports(x, weight, bias):
            return cuda.choose(x, weight, bias)
        return "triton" if cuda.kernels() is not None else "reference"  # as _forward does
    return "cpu" if cpu.supports(x.contiguous(), weight, bias) else "reference"  # contiguous: as _forward


def status() -> dict[str, str]:
    """What each device runs, and why (``enjoyln bench``, ``enjoyln env``).

    >>> sorted(status())
    ['cpu', 'cuda']
    """
    return {"cpu": cpu.status(), "cuda": cuda.status()}


def _forward(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
             eps: float) -> Tensor:
    """Whatever the hot paths turned away (strided, mixed dtypes, meta, float64), and the kernel op's forward."""
    n = math.prod(normalized_shape)
    if x.is_cuda and n and cuda.supports(x, weight, bias):
        return cuda.rms_norm_cuda(x, normalized_shape, weight, bias, eps)
    if x.is_cuda and n and (kernels := cuda.kernels()) is not None:
        flat = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731
        return kernels.rms_norm_triton(x.reshape(-1, n), flat(weight), flat(bias), eps).view(x.shape)
    if x.device.type == "cpu" and not x.is_contiguous():
        x = x.contiguous()
    if cpu.supports(x, weight, bias):
        return cpu.rms_norm_cpu(x, n, weight, bias, eps)
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)


# --- the ops: enjoyln::rms_norm (what graphs show) and enjoyln::rms_norm_kernel (what runs) ---------


@torch.library.custom_op("enjoyln::rms_norm_kernel", mutates_args=())
def _rms_norm_kernel(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                     bias: Optional[Tensor], eps: float) -> Tensor:
    return _forward(x, normalized_shape, weight, bias, eps)


@_rms_norm_kernel.register_fake
def _(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, normalized_shape, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.normalized_shape, ctx.eps, ctx.has_bias = list(normalized_shape), eps, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


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

_library = torch.library.Library("enjoyln", "FRAGMENT")  # kept alive: the op lives as long as it
_library.define("rms_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> Tensor")
_opaque = False


def _composite(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
               eps: float) -> Tensor:
    """``enjoyln::rms_norm``: the kernel op on plain tensors (eager calls), the math when traced
    through (FakeTensor, FunctionalTensor, DTensor); inside ``opaque()`` a trace keeps the kernel op."""
    if _opaque or all(_plain(t, False) for t in (x, weight, bias)):
        return torch.ops.enjoyln.rms_norm_kernel(x, normalized_shape, weight, bias, eps)
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)


_library.impl("rms_norm", _composite, "CompositeImplicitAutograd")


@contextlib.contextmanager
def opaque() -> Iterator[None]:
    """Inside this block ``enjoyln::rms_norm`` decomposes to one opaque ``enjoyln::rms_norm_kernel`` node, for
    exporters that decompose every composite op they do not know (``run_decompositions()``, some ONNX ones).

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
    return t is None or ((type(t) is Tensor or type(t) is torch.nn.Parameter) and not (grad and t.requires_grad))


def _hot(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """``not _needs_op(...)``, inline (no ``_plain`` calls): at small shapes a call costs LayerNorm-sized time."""
    if type(x) is not Tensor or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return False
    for t in (weight, bias):
        if t is not None and ((type(t) is not Tensor and type(t) is not torch.nn.Parameter)
                              or (grad and t.requires_grad)):
            return False
    return True


def _needs_op(*tensors: Tensor | None) -> bool:
    """True when the call must be visible to autograd or to a tracer."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    grad = torch.is_grad_enabled()
    # a gradient, or a tensor subclass (functional tensors under export, DTensor, ...)
    return any(t is not None and (not _plain(t, grad) or isinstance(t, torch._subclasses.FakeTensor)
                                  or t.device.type == "meta") for t in tensors)


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
    if _hot(x, weight, bias):  # the inference hot path: a few attribute reads, then C or one kernel launch
        if cpu.supports(x, weight, bias):
            return cpu.rms_norm_cpu(x, normalized_shape[-1] if len(normalized_shape) == 1 else
                                    math.prod(normalized_shape), weight, bias, float(eps))
        if cuda.supports(x, weight, bias):
            return cuda.rms_norm_cuda(x, normalized_shape, weight, bias, float(eps))
    shape = [int(s) for s in normalized_shape]
    if _needs_op(x, weight, bias):
        return torch.ops.enjoyln.rms_norm(x, shape, weight, bias, float(eps))
    return _forward(x, shape, weight, bias, float(eps))


def add_rms_norm(x: Tensor, residual: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
                 bias: Tensor | None = None, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` and ``rms_norm(s)``; one fused kernel on CUDA. Returns ``(s, normed)``.

    >>> s, y = add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), (4,), eps=0.0)
    >>> s[0, 0].item(), y[0, 0].item()
    (2.0, 1.0)
    """
    if (_hot(x, weight, bias) and cuda.supports(x, weight, bias) and type(residual) is Tensor
            and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
            and _plain(residual, torch.is_grad_enabled()) and residual.get_device() == x.get_device()):
        return cuda.add_rms_norm_cuda(x, residual, normalized_shape, weight, bias, float(eps))
    s = x + residual
    return s, rms_norm(s, normalized_shape, weight, bias, eps)
