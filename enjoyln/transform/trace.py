"""What the rewrite steps mean for a checkpoint: each step's in-place changes recorded on tensor names
alone, as operations on *slots* (a tensor with every name that shares it), each with what it reads (a
``Ref`` to another slot's version, or a ``Product`` ``W β``); ``rewrite.stream`` replays the record.

>>> t = Tracer.of(torch.nn.Linear(2, 2).to("meta"), lambda name: name)
>>> t.slot("weight").ops.append(Op("fill", fill=1.0)); [s.names for s in t.slots]
[['weight'], ['bias']]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Union

import torch
from torch import nn

from ..errors import PlanError
from ..plan import Centering, Fused, Rotated, Rotation


@dataclass(frozen=True)
class Ref:
    """Slot ``slot`` as it is after the first ``version`` of its operations."""

    slot: int
    version: int


@dataclass(frozen=True, eq=False)
class Product:
    """``W β`` over the block of W that reads a norm, as ``fuse_`` adds it to W's bias: W as
    ``weight`` says, β the norm's bias read by ``beta``. One per fusion (compared by identity)."""

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
    """One tensor of the loaded model: its names, its dtype and shape as loaded, where its first
    value comes from (a checkpoint key, or another slot's value for an untied copy) and the
    operations the steps apply to it."""

    index: int
    names: list[str]
    dtype: torch.dtype
    shape: tuple[int, ...]
    base: str | Ref | None = None
    ops: list[Op] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def checkpoint_source(names: Iterable[str], key: Callable[[str], str | None]) -> str | None:
    """The checkpoint key a tensor known by ``names`` (in ``named_parameters`` order: a tie's
    source first) loads from: the first name the checkpoint has."""
    return next((k for name in names if (k := key(name)) is not None), None)


@dataclass
class Tracer:
    """The record the steps write into: every slot, the name -> slot binding (an untied name
    gets a slot of its own), and the names a step drops from the model (a fused norm's γ and β)."""

    slots: list[Slot]
    binding: dict[str, int]
    model: nn.Module
    dropped: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, model: nn.Module, key: Callable[[str], str | None]) -> "Tracer":
        """A slot for each tensor of ``model`` (a meta model as ``from_pretrained`` builds it), its base
        the checkpoint key ``key`` finds for it (none for a non-persistent buffer)."""
        persistent = set(model.state_dict(keep_vars=True))
        slots: list[Slot] = []
        by_id: dict[int, int] = {}
        binding: dict[str, int] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            if id(t) not in by_id:
                by_id[id(t)] = len(slots)
                slots.append(Slot(len(slots), [], t.dtype, tuple(t.shape)))
            binding[name] = by_id[id(t)]
            slots[by_id[id(t)]].names.append(name)
        for s in slots:
            s.base = checkpoint_source([n for n in s.names if n in persistent], key)
        return cls(slots, binding, model)

    def slot(self, name: str) -> Slot:
        if name not in self.binding:
            raise PlanError(f"the plan names {name}, which this model does not have")
        return self.slots[self.binding[name]]

    def has(self, name: str) -> bool:
        return name in self.binding

    def now(self, s: Slot) -> Ref:
        """The slot as it is at this point of the steps."""
        return Ref(s.index, len(s.ops))

    def copy(self, name: str, of: Slot) -> Slot:
        """``name`` given a slot of its own: a copy of ``of`` as it is now."""
        copy = Slot(len(self.slots), [name], of.dtype, of.shape, base=self.now(of))
        self.slots.append(copy)
        self.binding[name] = copy.index
        return copy

    def names(self) -> list[str]:
        """The model's parameter and buffer names after the steps, in ``named_parameters`` (with
        duplicates) then ``named_buffers`` order; the names a step dropped are gone."""
        m = self.model
        return [n for n in dict.fromkeys([*(n for n, _ in m.named_parameters(remove_duplicate=False)),
                                          *(n for n, _ in m.named_buffers())]) if n not in self.dropped]
