"""Rotations of the residual stream, the same on any machine, and rotating tensors by them: the
structured hadamard ``Q`` of version 2 (``ops/rotate.c``, never a matrix), and the dense matrices
of version 1, kept to recompute checkpoints made with them."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from ..errors import PlanError
from ..ops import rotate as structured_kernel
from ..plan import Fused, Rotated, Rotation

KINDS = ("hadamard", "random")
MAX_BLOCK = 64
"""Version 1: widths 2^k * m with m up to this get a Kronecker product of a Hadamard matrix and a
random m x m block; wider odd factors fall back to a random orthogonal matrix."""


def _random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    signs = torch.sign(torch.diagonal(r)).where(
        torch.diagonal(r) != 0, torch.ones(n, dtype=torch.float64)
    )
    return (q * signs).contiguous()


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order ``n`` (a power of two), scaled to be orthogonal."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _fix_ones(q: torch.Tensor) -> torch.Tensor:
    """``q`` made to map the all-ones vector to itself, by one reflection after it."""
    n = q.shape[0]
    u = torch.full((n,), 1 / math.sqrt(n), dtype=torch.float64)
    w = q @ u
    v = w - u
    norm = float(v.norm())
    if norm < 1e-12:
        return q
    v = v / norm
    return q - 2 * torch.outer(v, v @ q)


def rotation_matrix(
    n: int, kind: str = "hadamard", seed: int = 0, keep_mean: bool = True, version: int = 1
) -> torch.Tensor:
    """An orthogonal ``n x n`` matrix in float64: ``hadamard`` (randomized, as in QuaRot; version 1
    see ``MAX_BLOCK``, version 2 the structured ``Q`` written out, for small widths) or
    ``random`` (Haar-random). With ``keep_mean``, ``Q 1 = 1``.

    >>> q = rotation_matrix(8)
    >>> bool(torch.allclose(q @ q.T, torch.eye(8, dtype=torch.float64)))
    True
    """
    if kind == "hadamard" and version >= 2:
        return structured_kernel.rotate_(
            torch.eye(n, dtype=torch.float64),
            1,
            structured_kernel.structured(int(n), int(seed), bool(keep_mean)),
        )
    return _rotation_matrix(
        int(n), kind, int(seed), bool(keep_mean)
    ).clone()  # the cached one stays unchanged


@functools.lru_cache(maxsize=8)
def _rotation_matrix(n: int, kind: str, seed: int, keep_mean: bool) -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"unknown rotation kind {kind!r}; use one of {', '.join(KINDS)}")
    # a generator seed is 64 bits: any seed works, and those below 2**43 keep their old matrices
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + n) % 2**64)
    if kind == "random":
        q = _random_orthogonal(n, gen)
    else:
        k = n & -n  # the largest power of two dividing n
        m = n // k
        if m > MAX_BLOCK:
            q = _random_orthogonal(n, gen)
        else:
            q = (
                hadamard_matrix(k)
                if m == 1
                else torch.kron(hadamard_matrix(k), _random_orthogonal(m, gen))
            )
            signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
            q = signs[:, None] * q
    return _fix_ones(q) if keep_mean else q


SLAB_ELEMENTS = 1 << 22
"""Elements of a tensor ``rotate_`` widens to float64 at a time (32 MiB, twice: the slab and its
product)."""

SLAB_ALIGN = 960
"""Vectors in a slab are a multiple of this (lcm(64, 15)): BLAS computes a product's rows in tiles
of 2 to 24 rows, and a row outside a full tile goes through another kernel with another order of the
sums, so slabs that start on a tile boundary give every row the bits one whole product gives it."""


def slabs(
    block: torch.Tensor, axis: int, elements: int = SLAB_ELEMENTS, align: int = 1
) -> Sequence[torch.Tensor]:
    """``block`` split along an axis other than ``axis`` into pieces of about ``elements`` (whole
    multiples of ``align`` vectors), so that widening one piece to float64 never widens the whole
    tensor."""
    if block.dim() < 2:
        return [block]
    other = 0 if axis != 0 else 1
    per = max(
        block.numel() // max(block.shape[other], 1), 1
    )  # elements per index of the other axis
    return block.split(max(1, elements // per) // align * align or align, other)


def rotate_(
    t: torch.Tensor, axis: int, q: torch.Tensor, start: int = 0, *, slab: int = SLAB_ELEMENTS
) -> torch.Tensor:
    """``t ×_axis Q`` in place on entries ``start .. start + n`` of ``axis``, in float64 slabs along
    another axis: never a float64 copy of the whole tensor, yet the bits of one product."""
    if t.device.type == "meta":
        return t
    axis = axis % t.dim()
    n = q.shape[0]
    block = t.narrow(axis, start, n)
    qq = q.to(t.device)
    for piece in slabs(block, axis, slab, SLAB_ALIGN):
        wide = piece.detach().to(torch.float64).movedim(axis, -1)
        piece.copy_((wide @ qq).movedim(-1, axis))
    return t


def scaled_in_kernel(t: torch.Tensor, rot: Rotated, r: Rotation, f: Fused) -> bool:
    """Whether a gain scaling ``f``'s block of ``t`` just before this rotation can be applied by the
    rotation kernel on its way (``apply_rotation``'s ``scale``): the structured rotation, of
    exactly that block."""
    axis = rot.axis % t.dim()
    n = rot.length if rot.length else t.shape[axis] - rot.start
    return (
        r.kind == "hadamard"
        and r.version >= 2
        and f.axis % t.dim() == axis
        and f.start == rot.start
        and f.length == n
        and t.device.type == "cpu"
        and structured_kernel.library() is not None
        and structured_kernel.usable(t.dtype)
    )


def apply_rotation(
    t: torch.Tensor, rot: Rotated, r: Rotation, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """One tensor of a plan's rotation, in place, by the algorithm of its version; the width is what
    its block holds. ``scale`` (where ``scaled_in_kernel``): the block is first multiplied by it,
    as ``transform.tensors.scale_inputs_`` does, in the same pass."""
    n = rot.length if rot.length else t.shape[rot.axis] - rot.start
    if r.kind == "hadamard" and r.version >= 2:
        try:
            return structured_kernel.rotate_(
                t, rot.axis, structured_kernel.structured(n, r.seed, r.keep_mean), rot.start, scale
            )
        except structured_kernel.RotationUnavailable as exc:
            raise PlanError(str(exc)) from None
    if scale is not None:
        raise ValueError("only the structured rotation scales on its way")
    return rotate_(t, rot.axis, rotation_matrix(n, r.kind, r.seed, r.keep_mean), rot.start)
