"""Simulated int quantization, to measure what a fold or a rotation does for a quantizer.

Weights per output channel, round-to-nearest or GPTQ; inputs per token, round-to-nearest at run
time (dynamic); symmetric grids. The values are rounded in floating point ("fake" quantization), so
the error is the quantizer's alone and any model runs as it is.

>>> import torch
>>> quantize_rows(torch.tensor([[3.0, -1.4, 0.6]]), 3).tolist()  # 3 bits: -3..3 times max/3
[[3.0, -1.0, 1.0]]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from . import max_relative_diff

OUTLIERS = (3, 200)
"""Features to plant outliers in: trained models carry a few features tens of times larger than
the rest in their residual stream."""

Readers = Callable[[nn.Module], list[nn.Module]]
"""The layers of a model to quantize, in the order the model runs them."""


def quantize_rows(x: torch.Tensor, bits: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric round-to-nearest with one scale per row (per token, or per output channel):
    ``max|row|`` maps to ``2^(bits-1) - 1``, unless ``scale`` (one per row) is given."""
    top = 2 ** (bits - 1) - 1
    if scale is None:
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
    return (x / scale).round().clamp(-top, top) * scale


def weight_rows(module: nn.Module) -> torch.Tensor:
    """The weight as ``[out, in]``: an ``nn.Linear``'s as it is, a transformers ``Conv1D``'s
    (stored ``[in, out]``) transposed."""
    w = module.weight
    return w.T if type(module).__name__ == "Conv1D" else w


def set_weight_rows(module: nn.Module, rows: torch.Tensor) -> None:
    """Give ``module`` a weight of its own from ``[out, in]`` rows (a tied weight is untied)."""
    w = rows.T if type(module).__name__ == "Conv1D" else rows
    module.weight = nn.Parameter(w.to(module.weight.dtype).contiguous(), requires_grad=False)


def _quantize_input(module: nn.Module, args: tuple) -> tuple:
    return (quantize_rows(args[0], 8), *args[1:])


def input_stats(model: nn.Module, readers: Readers, inputs: dict[str, Any]) -> tuple[float, float]:
    """Mean over tokens and layers of the readers' inputs' ``max|x| / rms(x)``, and of their int8
    per-token relative error."""
    ratios, errors = [], []

    def record(module: nn.Module, args: tuple) -> None:
        x = args[0].detach().double().reshape(-1, args[0].shape[-1])
        ratios.append(float((x.abs().amax(-1) / x.square().mean(-1).sqrt()).mean()))
        errors.append(float(((x - quantize_rows(x, 8)).norm(dim=-1) / x.norm(dim=-1)).mean()))

    handles = [m.register_forward_pre_hook(record) for m in readers(model)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return sum(ratios) / len(ratios), sum(errors) / len(errors)


def gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, block: int = 16) -> torch.Tensor:
    """``w`` (``[out, in]``) quantized per output channel by GPTQ (Frantar, Ashkboos, Hoefler and
    Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
    ICLR 2023, Algorithm 1): columns in their given order (the paper's; no reordering by the
    Hessian's diagonal), each rounded to the round-to-nearest grid of its row and its error spread
    over the columns not yet rounded through the Cholesky factor of the inverse of ``hessian``
    (``XᵀX`` of the layer's inputs, damped by 1% of its mean diagonal), the updates to the later
    columns batched ``block`` columns at a time (the paper's lazy batches of 128; smaller ones do
    fewer operations on a CPU, and only the float rounding differs)."""
    h = hessian.to(torch.float64).clone()
    dead = h.diagonal() == 0  # an input that is always zero: its column cannot matter
    h[dead, dead] = 1.0
    h.diagonal().add_(0.01 * h.diagonal().mean())
    # R, the upper Cholesky factor of H⁻¹ (row i: how column i's error moves the later columns),
    # without forming H⁻¹: with J the reversal, U = J chol(J H J) J is upper and H = U Uᵀ, so
    # H⁻¹ = (U⁻¹)ᵀ U⁻¹ and R = U⁻¹
    u = torch.linalg.cholesky(h.flip(0, 1)).flip(0, 1)
    eye = torch.eye(len(h), dtype=torch.float64)
    hinv = torch.linalg.solve_triangular(u, eye, upper=True).to(torch.float32)
    # columns as contiguous rows, in float32 as the paper's implementation runs
    cols = w.detach().T.to(torch.float32).clone()
    cols[dead] = 0.0
    top = 2 ** (bits - 1) - 1
    scale = cols.abs().amax(0).clamp_min(1e-12) / top  # per output channel, fixed before rounding
    q = torch.empty_like(cols)
    for start in range(0, len(cols), block):
        end = min(start + block, len(cols))
        errors = torch.empty_like(cols[start:end])
        for i in range(start, end):
            q[i] = (cols[i] / scale).round_().clamp_(-top, top).mul_(scale)
            err = errors[i - start]
            torch.sub(cols[i], q[i], out=err).div_(hinv[i, i])
            cols[i + 1 : end].addr_(hinv[i, i + 1 : end], err, alpha=-1.0)
        cols[end:].addmm_(hinv[start:end, end:].T, errors, alpha=-1.0)  # the block's, at once
    return q.T.to(w.dtype)


class _Stop(Exception):
    """Raised by a hook to end a calibration pass once the inputs it needs are seen."""


def _next_inputs(model: nn.Module, pending: list[nn.Module], inputs: dict) -> dict:
    """Run ``model`` until the first pending layer and the others that read the same tensor have
    been reached: those layers, each with its input as ``[tokens, in]``."""
    seen: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple) -> None:
        if seen and all(args[0] is not x for x in seen.values()):
            raise _Stop
        seen[module] = args[0]

    handles = [m.register_forward_pre_hook(record) for m in pending]
    try:
        with torch.no_grad():
            model(**inputs)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return {m: x.detach().reshape(-1, x.shape[-1]) for m, x in seen.items()}


def _gptq_group(model: nn.Module, pending: list[nn.Module], calibration: dict, bits: int) -> list:
    """GPTQ on the first pending layers the model reaches, those reading one input, which share
    its Hessian: one run on their rows stacked. Returns them."""
    group = _next_inputs(model, pending, calibration)
    if not group:
        raise ValueError("the calibration inputs reach none of the layers left to quantize")
    x = next(iter(group.values())).double()
    rows = [weight_rows(m) for m in group]
    for m, w in zip(group, gptq(torch.cat(rows), x.T @ x, bits).split([len(r) for r in rows])):
        set_weight_rows(m, w)
    return list(group)


def quantized(
    model: nn.Module,
    readers: Readers,
    weight_bits: int = 8,
    calibration: dict[str, Any] | None = None,
) -> nn.Module:
    """A copy of ``model`` whose ``readers`` take their inputs in int8 per token and their weights
    in ``weight_bits`` per output channel: round-to-nearest, or with ``calibration`` (inputs to the
    model) GPTQ, layer by layer in the order the model runs them, each from the inputs it receives
    with the layers before it already quantized (as the paper's implementation does)."""
    q = copy.deepcopy(model)
    pending = readers(q)
    with torch.no_grad():
        while pending:
            if calibration is None:
                group = pending
                for m in group:
                    set_weight_rows(m, quantize_rows(weight_rows(m), weight_bits))
            else:
                group = _gptq_group(q, pending, calibration, weight_bits)
            for m in group:
                m.register_forward_pre_hook(_quantize_input)
            pending = [m for m in pending if m not in group]
    return q


def relative_error(
    reference: nn.Module | torch.Tensor,
    models: Iterable[nn.Module],
    inputs: dict,
    *,
    worst: bool = False,
) -> list[float]:
    """Each model's logits' relative error against ``reference``'s (a model, or its logits) on
    ``inputs``: in the Frobenius norm, or with ``worst`` ``max|a - b| / max|a|``."""
    with torch.no_grad():
        a = reference(**inputs).logits if isinstance(reference, nn.Module) else reference
        if worst:
            return [max_relative_diff(a, m(**inputs).logits) for m in models]
        a = a.double()
        return [float((m(**inputs).logits.double() - a).norm() / a.norm()) for m in models]
