"""``enjoyln.RMSNorm``: the module that replaces a foldable ``nn.LayerNorm``."""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import torch
from torch import nn

from .. import ops

_UNIT = "_enjoyln_unit"  # on a weightless norm's ones: their (version, data pointer)


def _mark_unit(t: torch.Tensor) -> None:
    setattr(t, _UNIT, (t._version, t.data_ptr()))


def _is_unit(t: torch.Tensor | None) -> bool:
    """``t`` is a weightless norm's ones as made: not written in place (the version), not given
    other data (``.data =`` moves the pointer), not a copy (new storage)."""
    mark = getattr(t, _UNIT, None) if t is not None else None
    return (
        mark is not None
        and not torch.compiler.is_compiling()
        and mark == (t._version, t.data_ptr())
    )


def _sharing(cls: type, module: nn.Module, children: bool = False, **attrs: Any) -> Any:
    """A ``cls`` with ``attrs`` sharing ``module``'s ``weight`` and ``bias`` (or None) and its mode;
    with ``children``, its child modules too, under their names (so their parameters keep
    theirs)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for name, value in attrs.items():
        setattr(new, name, value)
    new.register_parameter("weight", getattr(module, "weight", None))
    new.register_parameter("bias", getattr(module, "bias", None))
    for name, child in module.named_children() if children else ():
        new.add_module(name, child)
    new.train(module.training)
    return new


class RMSNorm(nn.Module):
    """RMSNorm with ``nn.LayerNorm``'s interface. A weightless norm keeps a ``weight`` of ones for
    tools that fold a gain into the next layer (llmcompressor); once one writes to it,
    ``forward`` multiplies by it.

    >>> ln = torch.nn.LayerNorm(8, eps=1e-12)
    >>> rms = RMSNorm.from_layer_norm(ln)
    >>> rms.weight is ln.weight, rms.eps
    (True, 1e-12)
    """

    # class-level defaults: a module turned into an RMSNorm in place (``_become``) has none of its
    # own
    dim: int = -1
    upcast: bool = False
    then: tuple[str, ...] = ()

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        dim: int = -1,
        upcast: bool = False,
    ) -> None:
        super().__init__()
        self.dim, self.upcast = int(dim), bool(upcast)
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        self.normalized_shape = tuple(int(s) for s in normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory))
            self.bias = (
                nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if bias else None
            )
        else:
            self._set_unit_weight(**factory)
            self.register_parameter("bias", None)

    def _set_unit_weight(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        ones = torch.ones(self.normalized_shape, dtype=dtype, device=device)
        _mark_unit(ones)
        self._parameters.pop("weight", None)
        self.register_buffer("weight", ones, persistent=False)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """A weight of None (a weightless norm) becomes a buffer of ones, like the weight it
        replaces."""
        if name == "weight" and param is None and "normalized_shape" in self.__dict__:
            old = self._parameters.get("weight", self._buffers.get("weight"))
            self._buffers.pop("weight", None)
            self._set_unit_weight(
                **({"dtype": old.dtype, "device": old.device} if old is not None else {})
            )
            return
        if name == "weight":
            self._buffers.pop("weight", None)
            self._non_persistent_buffers_set.discard("weight")
        super().register_parameter(name, param)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's own signature
        unit = _is_unit(self._buffers.get("weight"))
        super()._apply(fn, recurse)
        if unit:  # moved or cast as made (or to_empty, which leaves memory unset): the ones again
            with torch.no_grad():
                self._buffers["weight"].fill_(1)
            _mark_unit(self._buffers["weight"])
        return self

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm) -> "RMSNorm":
        return _sharing(
            cls,
            ln,
            normalized_shape=tuple(ln.normalized_shape),
            eps=float(ln.eps),
            elementwise_affine=ln.elementwise_affine,
        )

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        normalized_shape: Sequence[int],
        eps: float,
        *,
        dim: int = -1,
        upcast: bool = False,
        then: Sequence[str] = (),
    ) -> "RMSNorm":
        """An RMSNorm for any module normalizing with its own ``weight`` and ``bias`` (or None),
        sharing them.

        >>> RMSNorm.from_module(torch.nn.LayerNorm(8), (8,), 1e-5, upcast=True).upcast
        True
        """
        return _sharing(
            cls,
            module,
            True,
            normalized_shape=tuple(int(s) for s in normalized_shape),
            eps=float(eps),
            dim=int(dim),
            upcast=bool(upcast),
            then=tuple(then),
            elementwise_affine=getattr(module, "weight", None) is not None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim == -1 and self.elementwise_affine and not self.upcast and not self.then:
            # the common case, read straight from the parameter dict: ``self.weight`` goes through
            # nn.Module.__getattr__, which at small shapes costs a tenth of the call
            p = self._parameters
            return ops.rms_norm(x, self.normalized_shape, p.get("weight"), p.get("bias"), self.eps)
        dtype, moved = x.dtype, self.dim not in (-1, x.dim() - 1)
        if moved:
            x = x.movedim(self.dim, -1)
        weight, bias = self.weight, self.bias
        if not self.elementwise_affine and _is_unit(weight):
            weight = None
        if self.upcast:
            x = x.float()
            weight = weight.float() if weight is not None else None
            bias = bias.float() if bias is not None else None
        y = ops.rms_norm(x, self.normalized_shape, weight, bias, self.eps)
        if self.upcast:
            y = y.to(dtype)
        if moved:
            y = y.movedim(-1, self.dim)
        for name in self.then:
            y = self._modules[name](y)
        return y

    def extra_repr(self) -> str:
        more = (
            (f", dim={self.dim}" if self.dim != -1 else "")
            + (", upcast=True" if self.upcast else "")
            + (f", then={self.then}" if self.then else "")
        )
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}{more}"
        )


class GroupRMSNorm(nn.Module):
    """``nn.GroupNorm`` without the centering: equal to it once grouped CBWC made every group
    zero-mean.

    >>> gn = torch.nn.GroupNorm(2, 8)
    >>> GroupRMSNorm.from_group_norm(gn).weight is gn.weight
    True
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_groups, self.num_channels, self.eps, self.affine = (
            num_groups,
            num_channels,
            float(eps),
            affine,
        )
        factory = {"device": device, "dtype": dtype}
        if affine:
            self.weight = nn.Parameter(torch.ones(num_channels, **factory))
            self.bias = nn.Parameter(torch.zeros(num_channels, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def from_group_norm(cls, gn: nn.GroupNorm) -> "GroupRMSNorm":
        return _sharing(
            cls,
            gn,
            num_groups=gn.num_groups,
            num_channels=gn.num_channels,
            eps=float(gn.eps),
            affine=gn.affine,
        )

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
