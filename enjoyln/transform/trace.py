"""The rewrite steps recorded on tensor names alone, as operations on *slots* (a tensor with all its
names), each with what it reads; ``folded.stream`` replays the record.

>>> t = Tracer.of(torch.nn.Linear(2, 2).to("meta"), lambda name: name)
>>> t.slot("weight").ops.append(Op("fill", fill=1.0)); [s.names for s in t.slots]
[['weight'], ['bias']]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Union

import torch
from torch import nn

from ..errors import PlanError
from ..plan import Centering, Fused, Rotated, Rotation
from .tensors import tie_groups


@dataclass(frozen=True)
class Ref:
    """Slot ``slot`` as it is after the first ``version`` of its operations."""

    slot: int
    version: int


@dataclass(frozen=True, eq=False)
class Product:
    """``W β`` as ``fuse_`` adds it to W's bias. One per fusion (compared by identity)."""

    weight: Ref
    fused: Fused
    beta: Ref


Read = Union[Ref, Product]


@dataclass
class Op:
    """One in-place change to a slot, as a step makes it."""

    kind: str
    """fill, set_bias, add_product, scale, center or rotate."""
    reads: tuple[Read, ...] = ()
    fill: float = 0.0
    gain: bool = False  # set_bias: β/γ (AFFINE_GAIN) rather than 0
    fused: Fused | None = None
    centering: Centering | None = None
    rotated: Rotated | None = None
    rotation: Rotation | None = None


@dataclass
class Slot:
    """One tensor of the loaded model; its first value from a checkpoint key, or another slot (an
    untied copy)."""

    index: int
    names: list[str]
    dtype: torch.dtype
    shape: tuple[int, ...]
    base: str | Ref | None = None
    ops: list[Op] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Tracer:
    """The record the steps write into: the slots, name -> slot, and the names a step drops (a fused
    norm's γ)."""

    slots: list[Slot]
    binding: dict[str, int]
    model: nn.Module
    dropped: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, model: nn.Module, key: Callable[[str], str | None]) -> "Tracer":
        """A slot for each tensor of the meta ``model``; a non-persistent buffer has no base."""
        persistent = set(model.state_dict(keep_vars=True))
        named = dict(
            [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]
        )
        slots = [
            Slot(i, list(names), named[names[0]].dtype, tuple(named[names[0]].shape))
            for i, names in enumerate(dict.fromkeys(tie_groups(model).values()))
        ]
        for s in slots:  # the key its first persistent name (a tie's source first) loads from
            s.base = next(
                (k for n in s.names if n in persistent and (k := key(n)) is not None), None
            )
        return cls(slots, {n: s.index for s in slots for n in s.names}, model)

    def slot(self, name: str) -> Slot:
        if name not in self.binding:
            raise PlanError(f"the plan names {name}, which this model does not have")
        return self.slots[self.binding[name]]

    def now(self, s: Slot) -> Ref:
        return Ref(s.index, len(s.ops))

    def copy(self, name: str, of: Slot) -> None:
        self.binding[name] = len(self.slots)
        self.slots.append(Slot(len(self.slots), [name], of.dtype, of.shape, base=self.now(of)))

    def names(self) -> list[str]:
        """The model's parameter and buffer names after the steps, in the model's order."""
        m = self.model
        return [
            n
            for n in dict.fromkeys(
                [
                    *(n for n, _ in m.named_parameters(remove_duplicate=False)),
                    *(n for n, _ in m.named_buffers()),
                ]
            )
            if n not in self.dropped
        ]
