"""Raw RMSNorm kernels, kept apart from the ``nn.Module`` that uses them.

``rms_norm`` is the single entry point; it picks an implementation for the
tensor's device. Today that is the reference implementation everywhere.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .reference import rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference"]


def rms_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """RMSNorm with gain and bias, the drop-in for ``F.layer_norm`` on zero-mean input.

    >>> import torch
    >>> x = torch.randn(2, 8)
    >>> x = x - x.mean(-1, keepdim=True)
    >>> torch.allclose(rms_norm(x, (8,)), torch.nn.functional.layer_norm(x, (8,)), atol=1e-6)
    True
    """
    return rms_norm_reference(x, normalized_shape, weight, bias, eps)
