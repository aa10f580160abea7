"""The reference RMSNorm (plain PyTorch, at least fp32 accumulation), which every fast kernel is
tested against."""

from __future__ import annotations

from typing import Sequence

import torch


def rms_norm_reference(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight + bias`` over the trailing dims."""
    dims = tuple(range(-len(normalized_shape), 0))
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)
