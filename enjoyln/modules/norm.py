"""``enjoyln.RMSNorm``: the module that replaces a foldable ``nn.LayerNorm``."""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch import nn

from .. import ops


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


class GroupRMSNorm(nn.Module):
    """GroupNorm without the centering: each group of channels is divided by its RMS.

    Mirrors ``nn.GroupNorm`` (same ``weight`` and ``bias`` names, per-channel
    affine). Equal to GroupNorm where grouped CBWC has made every group
    zero-mean, which enjoyln only does when GroupNorm sees no spatial extent.

    >>> gn = torch.nn.GroupNorm(2, 8)
    >>> GroupRMSNorm.from_group_norm(gn).weight is gn.weight
    True
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, float(eps), affine
        factory = {"device": device, "dtype": dtype}
        if affine:
            self.weight = nn.Parameter(torch.ones(num_channels, **factory))
            self.bias = nn.Parameter(torch.zeros(num_channels, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def from_group_norm(cls, gn: nn.GroupNorm) -> "GroupRMSNorm":
        """A GroupRMSNorm sharing ``gn``'s parameter objects."""
        rms = cls.__new__(cls)
        nn.Module.__init__(rms)
        rms.num_groups, rms.num_channels, rms.eps, rms.affine = gn.num_groups, gn.num_channels, float(gn.eps), gn.affine
        rms.register_parameter("weight", gn.weight)
        rms.register_parameter("bias", gn.bias)
        rms.train(gn.training)
        return rms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[0], x.shape[1]
        grouped = x.reshape(n, self.num_groups, -1)
        y = ops.rms_norm(grouped, (grouped.shape[-1],), None, None, self.eps).reshape(x.shape)
        if self.weight is not None:
            shape = (1, c) + (1,) * (x.dim() - 2)
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
