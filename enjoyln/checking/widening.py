"""Running a model in a wider dtype without converting it whole (the truth of the precision-aware
criterion, at the memory of one layer): each module's weights are widened into reused scratch memory
when its forward starts and put back when it ends. Exact, but only where every weight is read by its
owner's forward; otherwise ``NotWidened`` and the caller converts the model whole
(docs/checking.md)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

CHUNK = 1 << 20
"""Elements of the smallest scratch chunk."""


class NotWidened(RuntimeError):
    """The model reads a weight outside its owner's forward: convert it whole instead."""


class _Scratch:
    """Stack-ordered scratch memory in chunks, taken by a module's forward and given back when it
    ends: chunks are allocated (and first touched) once, by the largest module, and reused by
    every one after it."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.chunks: list[torch.Tensor] = []
        self.top = (0, 0)  # (chunk, element offset)

    def take(self, n: int) -> torch.Tensor:
        i, at = self.top
        while i < len(self.chunks) and at + n > self.chunks[i].numel():
            i, at = i + 1, 0
        if i == len(self.chunks):
            if self.top == (0, 0):  # nothing in use: one chunk for the largest module so far
                self.chunks.clear()
                i = 0
            self.chunks.append(torch.empty(max(n, CHUNK), dtype=self.dtype))
        self.top = (i, at + -(-n // 8) * 8)  # 64-byte aligned for the next one
        return self.chunks[i][at : at + n]


def _own_tensors(module: nn.Module) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    for table in (module._parameters, module._buffers):
        for name, t in table.items():
            if t is not None and t.is_floating_point():
                yield table, name, t


def _copies_of_views(out: Any, storages: set[int]) -> Any:
    """``out`` with every tensor that lives in the scratch memory replaced by a copy."""
    if isinstance(out, torch.Tensor):
        try:
            inside = out.untyped_storage().data_ptr() in storages
        except (
            RuntimeError,
            NotImplementedError,
        ):  # no storage of its own (sparse, nested): not a view
            inside = False
        return out.clone() if inside else out
    if isinstance(out, dict):  # transformers' ModelOutput included: changed in place
        for key, value in list(out.items()):
            new = _copies_of_views(value, storages)
            if new is not value:
                out[key] = new
        return out
    if isinstance(out, (tuple, list)):
        items = [_copies_of_views(v, storages) for v in out]
        if all(a is b for a, b in zip(items, out)):
            return out
        return type(out)(items) if not hasattr(out, "_fields") else type(out)(*items)
    return out


@contextlib.contextmanager
def widened(model: nn.Module, dtype: torch.dtype) -> Iterator[_Scratch]:
    """Within the block, calling ``model`` computes in ``dtype`` as ``model.to(dtype)`` would, one
    module's weights converted at a time; ``NotWidened`` (on leaving) if a weight was not read by
    its owner's forward.

    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> with widened(net, torch.float64):
    ...     y = net(torch.randn(2, 4, dtype=torch.float64))
    >>> y.dtype, net[0].weight.dtype
    (torch.float64, torch.float32)
    """
    scratch = _Scratch(dtype)
    swapped: list[
        tuple[dict[str, Any], str, Any, Any]
    ] = []  # what to put back (and a parameter's data), in order
    frames: list[tuple[int, tuple[int, int]]] = []
    converted: set[int] = set()
    owned = {id(t) for m in model.modules() for _, _, t in _own_tensors(m) if t.dtype != dtype}

    def restore(depth: int) -> None:
        while len(swapped) > depth:
            table, name, original, data = swapped.pop()
            if data is not None:  # a parameter: the object back in its place (accelerate's hook
                original.data = data  # puts a new one there), holding its own data again
            table[name] = original

    def pre(module: nn.Module, args: Any) -> None:
        frames.append((len(swapped), scratch.top))
        for table, name, t in list(_own_tensors(module)):
            if t.dtype == dtype:  # already wide: widened by an enclosing forward that owns it too
                continue
            if t.device.type == "meta":
                # offloaded: accelerate's hook loads it next, cast to the dtype it finds here
                wide = torch.empty(t.shape, dtype=dtype, device="meta")
            else:
                wide = scratch.take(t.numel()).view(t.shape).copy_(t.detach())
            converted.add(id(t))
            swapped.append((table, name, t, t.data if isinstance(t, nn.Parameter) else None))
            if isinstance(t, nn.Parameter):
                t.data = wide
            else:
                table[name] = wide

    def post(module: nn.Module, args: Any, output: Any) -> Any:
        depth, top = frames.pop()
        output = _copies_of_views(output, {c.untyped_storage().data_ptr() for c in scratch.chunks})
        restore(depth)
        scratch.top = top
        return output

    handles = [
        h
        for m in model.modules()
        for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))
    ]
    try:
        yield scratch
    finally:
        for h in handles:
            h.remove()
        restore(0)
    if owned - converted:
        raise NotWidened(
            f"{len(owned - converted)} weights of {type(model).__name__} were not read by their "
            "owner's forward"
        )
