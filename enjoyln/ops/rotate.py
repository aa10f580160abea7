"""The structured Hadamard rotation, applied by ``rotate.c`` in O(n log n + n m) per vector, never
as n x n.

For a width ``n = k * m`` (``k`` a power of two, ``m`` odd) ``Q = S (H_k ⊗ B) (I - 2 w wᵀ)``: random
signs, a Walsh–Hadamard transform on the power-of-two part, an ``m x m`` orthogonal block on the odd
part, and, to map the ones vector to itself, a reflection applied as a rank-one update. Every bit of
it comes from arithmetic this package fixes (``rotate.c``), so a rotated checkpoint is recomputed
bit for bit anywhere.

>>> table = structured(12, 0, True)
>>> x = torch.ones(1, 12, dtype=torch.float64)
>>> bool(torch.allclose(rotate_(x, 1, table), torch.ones(1, 12, dtype=torch.float64)))
True
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from . import cpu
from .center import CODES, FLAGS  # noqa: F401 (FLAGS: what rotate.c is built with)

SOURCE = Path(__file__).with_name("rotate.c")
ORTHOGONAL_ULPS = 16
"""A built block's ``BᵀB - I`` must be within this many float64 epsilons times ``m``: checked at
build."""

_has_f16 = False


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (``rotate.c`` compiled with any flags) with its functions' signatures declared."""
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.enjoyln_rotation_tables.argtypes = [i64, i64, ctypes.c_uint64, p, p]
    lib.enjoyln_rotate_into.argtypes = [
        p,
        p,
        p,
        ctypes.c_int,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        p,
        p,
        p,
        ctypes.c_int,
    ]
    lib.enjoyln_rotate_scaled_into.argtypes = [
        p,
        p,
        p,
        ctypes.c_int,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        p,
        p,
        p,
        p,
        ctypes.c_int,
    ]
    lib.enjoyln_dot_vectors.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, p, p, ctypes.c_int]
    lib.enjoyln_rotation_tables.restype = lib.enjoyln_rotate_into.restype = ctypes.c_int
    lib.enjoyln_dot_vectors.restype = ctypes.c_int
    lib.enjoyln_rotate_scaled_into.restype = ctypes.c_int
    return lib


def _build() -> ctypes.CDLL:
    global _has_f16
    lib = declare(cpu.compile_library(SOURCE, FLAGS))
    _has_f16 = bool(lib.enjoyln_rotate_has_f16())
    return lib


library = cpu.Once(_build)
"""``rotate.c`` compiled, once per process; None if it cannot be."""


class RotationUnavailable(RuntimeError):
    """The structured rotation cannot be computed here (no C compiler, or a dtype it does not
    handle)."""


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RotationUnavailable(
            f"the hadamard rotation needs its C kernel, which cannot be built: {library.error}"
        )
    return lib


@dataclass(frozen=True)
class Structured:
    """The factors of one width's ``Q``: ``pre`` (signs / sqrt(k)), ``block`` (``m x m``), ``w`` (or
    None)."""

    n: int
    k: int
    m: int
    pre: torch.Tensor
    block: torch.Tensor
    w: torch.Tensor | None

    def run(
        self,
        src: int,
        dst: int | None,
        cand: int | None,
        dtype: torch.dtype,
        layout: Sequence[int],
        scale: int | None = None,
    ) -> int:
        """``rotate.c`` on the vectors at ``src`` laid out as (outer, outer stride, inner), each
        element first times the float64 at ``scale`` rounded to ``dtype`` where given; its
        result."""
        outer, stride, inner = layout
        w = self.w.data_ptr() if self.w is not None else None
        return _lib().enjoyln_rotate_scaled_into(
            src,
            dst,
            cand,
            CODES[dtype],
            outer,
            stride,
            self.n,
            inner,
            self.k,
            self.m,
            self.pre.data_ptr(),
            self.block.data_ptr(),
            w,
            scale,
            torch.get_num_threads(),
        )


@functools.lru_cache(maxsize=16)
def structured(n: int, seed: int, keep_mean: bool) -> Structured:
    """The rotation of width ``n`` for ``seed``; its block checked orthogonal in float64 as it is
    built."""
    if n < 1:
        raise ValueError(f"cannot rotate a width of {n}")
    k = n & -n  # the largest power of two dividing n
    m = n // k
    signs = torch.empty(n, dtype=torch.float64)
    block = torch.empty(m, m, dtype=torch.float64)
    # a 64-bit seed for every (seed, width), as the dense rotation derives its own
    if _lib().enjoyln_rotation_tables(
        n, m, (int(seed) * 1_000_003 + n) % 2**64, signs.data_ptr(), block.data_ptr()
    ):
        raise MemoryError(f"cannot build the {m} x {m} block of a rotation")
    error = float((block.T @ block - torch.eye(m, dtype=torch.float64)).abs().max())
    if not error <= ORTHOGONAL_ULPS * m * torch.finfo(torch.float64).eps:
        raise ArithmeticError(
            f"the {m} x {m} block of the rotation of width {n} is not orthogonal ({error:.2g})"
        )
    table = Structured(n, k, m, signs * (1 / math.sqrt(k)), block, None)
    if not keep_mean:
        return table
    g = torch.ones(1, n, dtype=torch.float64)
    table.run(g.data_ptr(), g.data_ptr(), None, torch.float64, (1, n, 1))
    u = g.reshape(-1) - 1
    # fsum is correctly rounded: the norm's bits do not depend on how a machine would sum
    norm = math.sqrt(math.fsum(x * x for x in u.tolist()))
    return table if norm == 0 else Structured(n, k, m, table.pre, block, u / norm)


def _layout(shape: Sequence[int], axis: int, start: int) -> tuple[tuple[int, int, int], int]:
    """(outer, outer stride, inner) of the vectors along ``axis``, and the element offset of entry
    ``start``."""
    inner = math.prod(shape[axis + 1 :])
    return (math.prod(shape[:axis]), shape[axis] * inner, inner), start * inner


def usable(dtype: torch.dtype) -> bool:
    """Whether the kernel handles ``dtype`` (it is built if need be)."""
    _lib()
    return dtype in CODES and (dtype != torch.float16 or _has_f16)


def rotate_(
    t: torch.Tensor, axis: int, table: Structured, start: int = 0, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``t ×_axis Q`` in place on entries ``start .. start + n`` of ``axis``; a view, a strided or a
    GPU tensor is rotated in a contiguous CPU copy of its own dtype (never widened whole to
    float64). With ``scale`` (``n`` values), the entries are first multiplied by it, each product
    rounded to ``t``'s dtype:
    the bits of that product stored into ``t``, then rotated, in one pass."""
    if t.device.type == "meta" or t.numel() == 0:
        return t
    axis = axis % t.dim()
    if start < 0 or start + table.n > t.shape[axis]:
        raise ValueError(
            f"entries {start} to {start + table.n} do not fit an axis of {t.shape[axis]}"
        )
    work = t if t.device.type == "cpu" and t.is_contiguous() else t.detach().to("cpu").contiguous()
    address = work.data_ptr()
    _run_at(table, (address, address, None), work.dtype, work.shape, axis, start, scale)
    if work is not t:
        with torch.no_grad():
            t.copy_(work)
    return t


def rotate_from(
    src: int, out: torch.Tensor, axis: int, table: Structured, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``out`` := the contiguous tensor at address ``src`` (``out``'s dtype and shape) rotated along
    the whole of ``axis``, read once, with ``scale`` as ``rotate_`` takes it: the bits ``rotate_``
    gives a copy of it, without the copy (``src`` may be a mapped file)."""
    if table.n != out.shape[axis]:  # entries left out would be left unwritten
        raise ValueError(f"a rotation of width {table.n} for an axis of {out.shape[axis]}")
    if out.numel():
        _run_at(table, (src, out.data_ptr(), None), out.dtype, out.shape, axis, 0, scale)
    return out


def rotated_equal(
    src: int,
    cand: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    axis: int,
    table: Structured,
    start: int = 0,
    scale: torch.Tensor | None = None,
) -> bool:
    """Whether ``cand`` holds ``rotate_`` of the tensor at ``src`` (``dtype``, ``shape``,
    contiguous, ``scale`` as ``rotate_`` takes it; entries outside the rotated block not
    compared), bit for bit, read once and nothing written."""
    return _run_at(table, (src, None, cand), dtype, shape, axis, start, scale) == 0


def _run_at(
    table: Structured,
    addresses: tuple[int, int | None, int | None],
    dtype: torch.dtype,
    shape: Sequence[int],
    axis: int,
    start: int,
    scale: torch.Tensor | None,
) -> int:
    """The kernel on the block of a contiguous tensor at ``addresses`` (source, destination,
    candidate); what it returns (0: every vector equal to the candidate's)."""
    if not usable(dtype):
        raise RotationUnavailable(f"cannot rotate a tensor of dtype {dtype}")
    if scale is not None and scale.shape != (table.n,):
        raise ValueError(f"a scale of shape {list(scale.shape)} for a rotation of width {table.n}")
    factors = None if scale is None else scale.detach().to("cpu", torch.float64).contiguous()
    axis = axis % len(shape)
    layout, at = _layout(shape, axis, start)
    offset = at * dtype.itemsize
    src, dst, cand = (None if a is None else a + offset for a in addresses)
    result = table.run(
        src, dst, cand, dtype, layout, None if factors is None else factors.data_ptr()
    )
    if result < 0:
        raise MemoryError("the rotation kernel could not allocate its buffers")
    return result


def dot_vectors(t: torch.Tensor, axis: int, beta: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``t``'s entries ``start .. start + len(beta)`` of ``axis`` times ``beta``, summed along it,
    in float64 in a fixed order (``rotate.c``'s ``enjoyln_dot_vectors``): the same bits whatever
    the machine, the thread count or ``t``'s layout in memory, where a BLAS product's depend on
    them. The shape is ``t``'s without ``axis``; ``t`` is read in its own dtype, never widened
    whole.

    >>> w = torch.arange(6.0).reshape(2, 3)
    >>> dot_vectors(w, 1, torch.ones(3, dtype=torch.float64)).tolist()
    [3.0, 12.0]
    """
    axis = axis % t.dim()
    n = beta.numel()
    if start < 0 or start + n > t.shape[axis]:
        raise ValueError(f"entries {start} to {start + n} do not fit an axis of {t.shape[axis]}")
    out_shape = [d for i, d in enumerate(t.shape) if i != axis]
    out = torch.empty(out_shape, dtype=torch.float64)
    if t.numel() == 0 or n == 0:
        return out.zero_()
    if not usable(t.dtype):
        raise RotationUnavailable(f"cannot read a tensor of dtype {t.dtype}")
    work = t.detach()
    work = work if work.device.type == "cpu" and work.is_contiguous() else work.cpu().contiguous()
    factors = beta.detach().to("cpu", torch.float64).contiguous()
    (outer, stride, inner), at = _layout(work.shape, axis, start)
    if (
        _lib().enjoyln_dot_vectors(
            work.data_ptr() + at * work.element_size(),
            CODES[work.dtype],
            outer,
            stride,
            n,
            inner,
            factors.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        < 0
    ):
        raise RotationUnavailable(f"cannot read a tensor of dtype {work.dtype}")
    return out
