"""Weight centering at memory speed, in C and in torch, in ``center.c``'s float64 order: the same
bits.

>>> t = torch.tensor([[1., 2.], [3., 6.]])
>>> center_(t, 0)
tensor([[-1., -2.],
        [ 1.,  2.]])
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from . import cpu

SOURCE = Path(__file__).with_name("center.c")
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=gnu11",
    "-ffp-contract=off",
    "-fno-fast-math",
]
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}

_same: Any = None
_has_f16 = False


def _build() -> Any:
    global _same, _has_f16
    lib = cpu.compile_library(SOURCE, FLAGS)
    into, same = lib.enjoyln_center_into, lib.enjoyln_same_bytes
    i64, p = ctypes.c_int64, ctypes.c_void_p
    into.argtypes = [p, p, p, ctypes.c_int, i64, i64, i64, i64, p, ctypes.c_int]
    same.argtypes = [p, p, i64, ctypes.c_int]
    into.restype = same.restype = ctypes.c_int
    _has_f16 = bool(lib.enjoyln_center_has_f16())
    _same = same
    return into


kernel = cpu.Once(_build)
"""The compiled ``enjoyln_center_into``, built once per process; None if it cannot be."""


def status() -> str:
    """'C kernel' or why the torch version is used."""
    return "C kernel" if kernel() is not None else f"torch (no C kernel: {kernel.error})"


class CenteringError(ValueError):
    """The centering asked for cannot be done (a zero gain, groups that do not divide the axis)."""


def _gain(scale: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if scale is None:
        return None
    gain = scale.detach().reshape(-1).to("cpu", torch.float64).contiguous()
    if gain.numel() != n:
        raise CenteringError(f"cannot scale an axis of {n} by a gain of {gain.numel()} entries")
    if not bool(gain.ne(0).all()):
        raise CenteringError(
            "cannot center for a LayerScale gain with a zero entry: "
            "no centering makes the scaled output zero-mean"
        )
    return gain


@dataclass(frozen=True)
class _Layout:
    """A tensor seen as [outer, n, inner], ``n`` the centered axis in blocks of ``size``, ``chosen``
    centered."""

    outer: int
    n: int
    inner: int
    size: int
    chosen: Sequence[int]
    gain: torch.Tensor | None

    @classmethod
    def of(
        cls,
        shape: Sequence[int],
        axis: int,
        groups: int,
        scale: torch.Tensor | None,
        blocks: Sequence[int] | None,
    ) -> "_Layout":
        axis = axis % len(shape)
        n = shape[axis]
        gain = _gain(scale, n)
        if groups < 1 or n % groups:
            raise CenteringError(f"cannot split an axis of {n} into {groups} groups")
        chosen = range(groups) if blocks is None else blocks
        for b in chosen:
            if not 0 <= b < groups:
                raise CenteringError(f"there is no block {b} of {groups}")
        return cls(
            math.prod(shape[:axis]), n, math.prod(shape[axis + 1 :]), n // groups, chosen, gain
        )

    @property
    def everything(self) -> bool:
        return len(set(self.chosen)) * self.size == self.n

    def run(self, src: int, dst: int | None, cand: int | None, dtype: torch.dtype) -> int:
        """``center.c`` over every chosen block; the largest of its results (1: cand differs)."""
        fn, worst, item = kernel(), 0, dtype.itemsize
        for b in self.chosen:
            part = None if self.gain is None else self.gain[b * self.size : (b + 1) * self.size]
            at = b * self.size * self.inner * item
            worst = max(
                worst,
                fn(
                    src + at,
                    None if dst is None else dst + at,
                    None if cand is None else cand + at,
                    CODES[dtype],
                    self.outer,
                    self.n * self.inner,
                    self.size,
                    self.inner,
                    part.data_ptr() if part is not None else None,
                    torch.get_num_threads(),
                ),
            )
        return worst


def _usable(dtype: torch.dtype) -> bool:
    return kernel() is not None and dtype in CODES and (dtype != torch.float16 or _has_f16)


def center_(
    t: torch.Tensor,
    axis: int,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    blocks: Sequence[int] | None = None,
) -> torch.Tensor:
    """Subtract ``t``'s mean along ``axis`` in place, in float64 of a fixed order
    (``transform.tensors.center_``)."""
    if t.device.type == "meta" or t.numel() == 0:
        return t
    if not t.is_floating_point():
        raise CenteringError(f"cannot center a tensor of dtype {t.dtype}")
    layout = _Layout.of(t.shape, axis, groups, scale, blocks)
    # a view, a strided parameter or a GPU tensor is centered in a contiguous CPU copy
    work = t if t.device.type == "cpu" and t.is_contiguous() else t.detach().to("cpu").contiguous()
    if _usable(work.dtype):
        layout.run(work.data_ptr(), work.data_ptr(), None, work.dtype)
    else:
        for b in layout.chosen:
            part = (
                None
                if layout.gain is None
                else layout.gain[b * layout.size : (b + 1) * layout.size]
            )
            block = work.view(layout.outer, layout.n, layout.inner)[
                :, b * layout.size : (b + 1) * layout.size, :
            ]
            block.copy_(center_reference(block, part))
    if work is not t:
        with torch.no_grad():
            t.copy_(work)
    return t


def center_into(
    src: int,
    dst: torch.Tensor,
    axis: int,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    blocks: Sequence[int] | None = None,
) -> bool:
    """``center_`` of the tensor at address ``src`` (``dst``'s dtype and shape, any alignment, read
    only:
    mapped from its file) written into the contiguous CPU ``dst`` in one pass, with the same bits.
    False, with nothing written, where the C kernel cannot do it (then copy and ``center_``)."""
    if not (_usable(dst.dtype) and dst.device.type == "cpu" and dst.is_contiguous()):
        return False
    if dst.numel() == 0:
        return True
    layout = _Layout.of(dst.shape, axis, groups, scale, blocks)
    if not layout.everything:  # the blocks left alone are copied as they are first
        ctypes.memmove(dst.data_ptr(), src, dst.numel() * dst.element_size())
        src = dst.data_ptr()
    layout.run(src, dst.data_ptr(), None, dst.dtype)
    return True


def centered_equal(
    src: int,
    cand: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    axis: int,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    blocks: Sequence[int] | None = None,
) -> bool | None:
    """Whether ``cand`` holds ``center_`` of ``src``, bit for bit, in one pass; None where the C
    kernel cannot tell.

    >>> t = torch.tensor([[1., 2.], [3., 6.]])
    >>> c = center_(t.clone(), 0)
    >>> [centered_equal(t.data_ptr(), x.data_ptr(), t.dtype, t.shape, 0) for x in (c, t)]
    [True, False]
    """
    if not _usable(dtype):
        return None
    if math.prod(shape) == 0:
        return True
    layout = _Layout.of(shape, axis, groups, scale, blocks)
    if not layout.everything:
        return None
    return layout.run(src, None, cand, dtype) == 0


def same_memory(a: int, b: int, nbytes: int) -> bool | None:
    """Whether ``nbytes`` at ``a`` and ``b`` are equal, compared by all torch's threads; None
    without the C kernel."""
    if kernel() is None:
        return None
    return bool(_same(a, b, nbytes, torch.get_num_threads())) if nbytes else True


def center_reference(x: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
    """``center.c``'s arithmetic in torch on [outer, n, inner], centering along ``n``: slow, but the
    same bits."""
    outer, n, inner = x.shape
    wide = x.to(torch.float64)
    if inner == 1:
        rows = wide.reshape(outer, n)
        terms = rows if gain is None else rows * gain
        partial = torch.zeros(outer, 8, dtype=torch.float64)
        for i in range(0, n, 8):
            chunk = terms[:, i : i + 8]
            partial[:, : chunk.shape[1]] += chunk
        p = partial.unbind(1)
        mean = (((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))) / n
        shift = mean[:, None] if gain is None else mean[:, None] / gain
        return (rows - shift).to(x.dtype).reshape(outer, n, 1)
    acc = torch.zeros(outer, inner, dtype=torch.float64)
    for i in range(n):
        acc += wide[:, i] if gain is None else gain[i] * wide[:, i]
    mean = acc / n
    shift = mean[:, None, :] if gain is None else mean[:, None, :] / gain[None, :, None]
    return (wide - shift).to(x.dtype)
