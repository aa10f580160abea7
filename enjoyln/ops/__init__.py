"""Raw RMSNorm kernels, kept apart from the ``nn.Module`` that uses them.

``rms_norm`` is the single entry point. It picks an implementation by device:

- CUDA with Triton installed: the Triton kernel (``triton_kernels.py``);
- CPU, float32/bfloat16/float16, contiguous: the fused C kernel (``cpu.py``);
- anything else: the reference implementation (``reference.py``).

``backend(x)`` names the one a tensor would use. Under torch.export, the ONNX
export, ``torch.jit`` tracing or when a gradient is needed, the call goes
through the custom op ``torch.ops.enjoyln.rms_norm``, so graphs show one
RMSNorm node and autograd uses the backward below. Under ``torch.compile`` it
is the reference math instead, which inductor fuses with the residual add and
the casts around it; an opaque op would be a separate kernel call there.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import cpu
from .reference import rms_norm_reference

__all__ = ["rms_norm", "add_rms_norm", "backend", "status"]


def _triton_ok(x: Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> str:
    """Which implementation ``rms_norm`` uses for these tensors: 'triton', 'cpu' or 'reference'."""
    if _triton_ok(x):
        return "triton"
    if x.device.type == "cpu" and not x.is_contiguous():
        x = x.contiguous()  # as rms_norm does before choosing
    if cpu.supports(x, weight, bias):
        return "cpu"
    return "reference"


def status() -> dict[str, str]:
    """What each device would run, and why, for ``enjoyln bench`` and bug reports."""
    cuda = "not available"
    if torch.cuda.is_available():
        try:
            import triton

            cuda = f"Triton {triton.__version__} kernel"
        except ImportError:
            cuda = "reference PyTorch (install triton for the fused kernel)"
    return {"cpu": cpu.status(), "cuda": cuda}


def _forward(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
             eps: float) -> Tensor:
    n = math.prod(normalized_shape)
    if _triton_ok(x):
        from .triton_kernels import rms_norm_triton

        flat = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731
        return rms_norm_triton(x.reshape(-1, n), flat(weight), flat(bias), eps).view(x.shape)
    if x.device.type == "cpu" and not x.is_contiguous():
        x = x.contiguous()
    if cpu.supports(x, weight, bias):
        return cpu.rms_norm_cpu(x, n, weight, bias, eps)
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)


@torch.library.custom_op("enjoyln::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                 bias: Optional[Tensor], eps: float) -> Tensor:
    return _forward(x, normalized_shape, weight, bias, eps)


@_rms_norm_op.register_fake
def _(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor],
      eps: float) -> Tensor:
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


_rms_norm_op.register_autograd(_backward, setup_context=_setup)


def _needs_op(*tensors: Tensor | None) -> bool:
    """True when the call must be visible to autograd or to a tracer."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    for t in tensors:
        if t is None:
            continue
        if t.requires_grad and torch.is_grad_enabled():
            return True
        if isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta":
            return True
        if type(t) is not Tensor and not isinstance(t, torch.nn.Parameter):
            return True  # a tensor subclass (functional tensors under export, DTensor, ...)
    return False


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
    if _plain_cpu(x, weight, bias):  # the inference hot path: a few attribute reads, then C
        return cpu.rms_norm_cpu(x, normalized_shape[-1] if len(normalized_shape) == 1 else
                                math.prod(normalized_shape), weight, bias, float(eps))
    shape = [int(s) for s in normalized_shape]
    if _compiling_not_exporting():
        return rms_norm_reference(x, shape, weight, bias, float(eps))
    if _needs_op(x, weight, bias):
        return torch.ops.enjoyln.rms_norm(x, shape, weight, bias, float(eps))
    return _forward(x, shape, weight, bias, float(eps))


def _compiling_not_exporting() -> bool:
    """True while dynamo traces for ``torch.compile``, false under ``torch.export``.

    In torch 2.13, ``torch.compile`` sets ``is_dynamo_compiling``; strict export sets
    it as well, but also ``is_exporting``, which non-strict export (and the ONNX
    export, which uses it) sets alone. So exported graphs keep one
    ``enjoyln::rms_norm`` node, and compiled ones see plain math that inductor fuses.
    """
    return torch.compiler.is_dynamo_compiling() and not torch.compiler.is_exporting()


def _plain_cpu(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """True for plain contiguous CPU tensors that need no autograd or tracer and fit the C
    kernel; the same answer as ``not _needs_op(...) and cpu.supports(...)``, only cheaper,
    because a call costs LayerNorm-sized time at small shapes otherwise."""
    if type(x) is not Tensor or not x.is_cpu or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return False
    for t in (weight, bias):
        if t is not None and ((type(t) is not Tensor and type(t) is not torch.nn.Parameter)
                              or (grad and t.requires_grad)):
            return False
    return cpu.supports(x, weight, bias)


def add_rms_norm(x: Tensor, residual: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
                 bias: Tensor | None = None, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` and ``rms_norm(s)``; fused on CUDA. Returns ``(s, normed)``."""
    if (_triton_ok(x) and len(normalized_shape) == 1 and residual.shape == x.shape
            and not _needs_op(x, residual, weight, bias)):
        from .triton_kernels import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, bias, eps)
    s = x + residual
    return s, rms_norm(s, normalized_shape, weight, bias, eps)
