"""``enjoyln.RMSNorm``: the module that replaces a foldable ``nn.LayerNorm``."""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch import nn

from . import ops


class RMSNorm(nn.Module):
    """RMSNorm with LayerNorm's gain, bias and epsilon.

    The constructor mirrors ``nn.LayerNorm``, and the parameters keep the names
    ``weight`` and ``bias``, so a state dict moves between the two unchanged.

    >>> ln = torch.nn.LayerNorm(8, eps=1e-12)
    >>> rms = RMSNorm.from_layer_norm(ln)
    >>> rms.weight is ln.weight, rms.eps
    (True, 1e-12)
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        self.normalized_shape = tuple(int(s) for s in normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm) -> "RMSNorm":
        """An RMSNorm sharing ``ln``'s parameter objects, epsilon and shape."""
        rms = cls.__new__(cls)
        nn.Module.__init__(rms)
        rms.normalized_shape = tuple(ln.normalized_shape)
        rms.eps = float(ln.eps)
        rms.elementwise_affine = ln.elementwise_affine
        rms.register_parameter("weight", ln.weight)
        rms.register_parameter("bias", ln.bias)
        rms.train(ln.training)
        return rms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")
