"""A large tensor worked on a piece at a time, so that rotating or checking a model of any size
takes the same memory: the vectors a rotation (or a centering, or a fused product) works along
are independent, and the kernels give each the same bits whatever its layout in memory, so a
piece of whole vectors gets the bits the whole tensor would.

A tensor is seen as ``[outer, n, inner]`` with ``n`` the axis worked along. Along the last axis
(``inner == 1``) a piece is a run of rows, contiguous in the file; along another, a block of
columns of one outer index, gathered into a contiguous buffer (never one column alone: the
centering kernel sums a lone column in another order).

>>> [p.shape for p in pieces((4, 6), 1, 4, piece_bytes=48)]  # rows of the last axis
[(2, 6, 1), (2, 6, 1)]
>>> [p.shape for p in pieces((4, 5), 0, 4, piece_bytes=32)]  # columns: never one alone
[(4, 2), (4, 3)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

WHOLE_BYTES = 64 << 20
"""A tensor up to this size is worked on whole; a larger one in pieces."""

PIECE_BYTES = 64 << 20
"""About the size of a piece."""

ROWS_MAPPED = 512
"""Rows of a block of columns read from a mapping before its pages are dropped: the kernel maps
the pages around each one a read touches (64 KiB by default), so a block of columns read whole
would map most of the tensor."""


def view3(shape: Sequence[int], axis: int) -> tuple[int, int, int]:
    """``shape`` as ``(outer, n, inner)`` around ``axis``."""
    axis = axis % len(shape)
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


@dataclass(frozen=True)
class Piece:
    """Whole vectors of a tensor: ``index`` into its ``[outer, n, inner]`` view (``dims``), the
    piece's own shape (``[rows, n, 1]`` or ``[n, columns]``) and the axis of ``n`` in it."""

    dims: tuple[int, int, int]
    index: tuple
    shape: tuple[int, ...]
    axis: int

    def runs(self, itemsize: int) -> Iterator[tuple[int, int, int]]:
        """(byte offset in the tensor, byte offset in the piece, bytes): its contiguous runs."""
        _, n, inner = self.dims
        first, _, cols = self.index
        if inner == 1:
            yield first.start * n * itemsize, 0, (first.stop - first.start) * n * itemsize
            return
        width = (cols.stop - cols.start) * itemsize
        for i in range(n):
            yield ((first * n + i) * inner + cols.start) * itemsize, i * width, width

    def lies_at(self, itemsize: int) -> int | None:
        """The byte offset in the tensor where the piece lies whole, as its own contiguous tensor
        (a run of rows); None for a block of columns."""
        return next(self.runs(itemsize))[0] if self.dims[2] == 1 else None

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The piece of ``t`` (the whole tensor: a mapped file's), a view in the piece's shape."""
        return t.reshape(self.dims)[self.index].reshape(self.shape)


def pieces(
    shape: Sequence[int], axis: int, itemsize: int, piece_bytes: int | None = None
) -> list[Piece]:
    """The pieces of a tensor of ``shape`` worked along ``axis``, each about ``piece_bytes``
    (``PIECE_BYTES``)."""
    piece_bytes = piece_bytes or PIECE_BYTES
    dims = outer, n, inner = view3(shape, axis)
    every = slice(None)
    if inner == 1:
        rows = max(1, piece_bytes // max(1, n * itemsize))
        return [
            Piece(
                dims,
                (slice(r, min(r + rows, outer)), every, every),
                (min(rows, outer - r), n, 1),
                1,
            )
            for r in range(0, outer, rows)
        ]
    width = max(2, piece_bytes // max(1, n * itemsize))
    starts = list(range(0, inner, width))
    if len(starts) > 1 and inner - starts[-1] < 2:
        starts.pop()  # a lone last column joins the piece before it
    bounds = list(zip(starts, starts[1:] + [inner]))
    return [
        Piece(dims, (o, every, slice(a, b)), (n, b - a), 0) for o in range(outer) for a, b in bounds
    ]


def gather(
    piece: Piece, stored: torch.Tensor, into: torch.Tensor, release: Callable[[], None]
) -> torch.Tensor:
    """``piece`` of ``stored`` (a mapped file's tensor) copied into ``into`` (the piece's shape),
    the mapping's pages dropped (``release``) every ``ROWS_MAPPED`` rows of a block of columns."""
    src = piece.of(stored)
    step = src.shape[0] if piece.axis == 1 else ROWS_MAPPED
    for i in range(0, src.shape[0], step):
        into[i : i + step].copy_(src[i : i + step])
        release()
    return into
