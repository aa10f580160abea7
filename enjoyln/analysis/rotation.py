"""Rotating the residual stream: computational invariance, proved on the graph.

A weightless RMSNorm commutes with any orthogonal ``Q``: ``RMSNorm(x Q) =
RMSNorm(x) Q``, because ``‖x Q‖ = ‖x‖``. So once every norm on the residual
stream is folded and its affine fused into its readers (``enjoyln.affine``),
the whole stream can be expressed in a rotated basis without changing what
the model computes:

- every source that writes the stream (embedding rows, positional tables,
  output projections and their biases) gets ``Q`` on its output axis;
- every linear layer that reads a norm's output gets ``Q`` on its input axis
  (``W x`` = ``(W Q)(Qᵀ x)``), and a bias the norm kept (β/γ) is rotated too.

The proof is the soundness pass of the centering (``soundness.Spread``) with
stricter sinks: a rotated value may reach only residual sums (all of whose
terms are rotated), ops that move or scale whole rows, and the inputs of
those weightless norms; anything else (an unfolded LayerNorm, a model output,
a nonlinearity) refuses the rotation, with the reason.

``Q`` keeps the all-ones vector fixed by default (``keep_mean``), so a
zero-mean stream stays zero-mean: the rotated checkpoint then still gives
the original's outputs when loaded with plain LayerNorms.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import fx

from .graph import LN_OPS, GraphIndex, op_name, shape
from ..plan import AFFINE_FUSED, AFFINE_GAIN, FoldPlan, LayerNormEntry, Rotated, Rotation
from .rules import MAP, SCALE, SUM, Refusal, Source, carry, kind_of, source_of
from .soundness import Flags, Hits, Shift, Spread

KINDS = ("hadamard", "random")
MAX_BLOCK = 64
"""Widths 2^k * m with m up to this get a Kronecker product of a Hadamard matrix and a
random m x m block; wider odd factors fall back to a random orthogonal matrix."""


def _random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(n, dtype=torch.float64))).contiguous()


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


def rotation_matrix(n: int, kind: str = "hadamard", seed: int = 0, keep_mean: bool = True) -> torch.Tensor:
    """An orthogonal ``n x n`` matrix in float64, the same for the same arguments on any machine.

    ``hadamard``: a randomized Hadamard transform (random signs, then Sylvester's
    Hadamard matrix), as in QuaRot; a width ``2^k m`` that is not a power of two
    uses the Kronecker product with a random orthogonal ``m x m`` block (or, for
    ``m > 64``, a random orthogonal matrix). ``random``: a Haar-random orthogonal
    matrix. With ``keep_mean``, ``Q 1 = 1``.

    >>> q = rotation_matrix(8)
    >>> bool(torch.allclose(q @ q.T, torch.eye(8, dtype=torch.float64))), bool(torch.allclose(q.sum(1), torch.ones(8, dtype=torch.float64)))
    (True, True)
    """
    return _rotation_matrix(int(n), kind, int(seed), bool(keep_mean)).clone()  # the cached one stays unchanged


@functools.lru_cache(maxsize=8)
def _rotation_matrix(n: int, kind: str, seed: int, keep_mean: bool) -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"unknown rotation kind {kind!r}; use one of {', '.join(KINDS)}")
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + n)
    if kind == "random":
        q = _random_orthogonal(n, gen)
    else:
        k = n & -n  # the largest power of two dividing n
        m = n // k
        if m > MAX_BLOCK:
            q = _random_orthogonal(n, gen)
        else:
            q = hadamard_matrix(k) if m == 1 else torch.kron(hadamard_matrix(k), _random_orthogonal(m, gen))
            signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
            q = signs[:, None] * q
    return _fix_ones(q) if keep_mean else q


SLAB_ELEMENTS = 1 << 22
"""Elements of a tensor ``rotate_`` widens to float64 at a time (32 MiB, twice: the slab and its product)."""

SLAB_ALIGN = 960
"""Vectors in a slab are a multiple of this (lcm(64, 15)). BLAS computes a product's rows in
tiles of a few rows, and a row outside a full tile goes through another kernel, with another
order of the sums (MKL here: tiles of 4; other libraries use 2 to 24): slabs that start on a
tile boundary give every row the bits one whole product gives it."""


def rotate_(t: torch.Tensor, axis: int, q: torch.Tensor, start: int = 0, *,
            slab: int = SLAB_ELEMENTS) -> torch.Tensor:
    """``t ×_axis Q`` in place, in float64, on entries ``start .. start + n`` of ``axis``:
    every vector along that axis becomes ``v Q``. Works on slabs of about ``slab`` elements
    (at least ``SLAB_ALIGN`` vectors) along another axis, so the float64 copies are never the
    whole tensor, and the bits are those of one product over the whole tensor."""
    if t.device.type == "meta":
        return t
    axis = axis % t.dim()
    n = q.shape[0]
    block = t.narrow(axis, start, n)
    if t.dim() == 1:
        slabs = [block]
    else:
        other = 0 if axis != 0 else 1
        per = max(block.numel() // max(block.shape[other], 1), 1)  # elements per index of the other axis
        count = max(1, slab // per) // SLAB_ALIGN * SLAB_ALIGN or SLAB_ALIGN
        slabs = block.split(count, other)
    qq = q.to(t.device)
    for piece in slabs:
        wide = piece.detach().to(torch.float64).movedim(axis, -1)
        piece.copy_((wide @ qq).movedim(-1, axis))
    return t


# --- the proof ------------------------------------------------------------------------------


class RotationSpread(Spread):
    """Follows a rotation of the stream sources forward; flags whatever it would change."""

    def __init__(self, g: GraphIndex, entries: dict[fx.Node, LayerNormEntry], keep_mean: bool):
        super().__init__(g)
        self.entries = entries  # LN call -> its plan entry
        self.keep_mean = keep_mean
        self.absorbed: set[fx.Node] = set()
        self.means = {m for m in g.centers.values()}

    def sink(self, node: fx.Node, hits: Hits, keys: frozenset[str], groups: int) -> Flags | None:
        g, name = self.g, op_name(node)
        if node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            changed = dict(hits)
            return [(changed[o].keys, f"the model output `{g.output_names.get(i, str(i))}`")
                    for i, o in enumerate(outs) if o in changed]
        if name in LN_OPS:
            e = self.entries.get(node)
            dims = shape(node.args[0])
            if e is None or not e.foldable:
                return [(keys, f"{g.describe(node)}, which does not fold")]
            if e.affine not in (AFFINE_FUSED, AFFINE_GAIN):
                return [(keys, f"{g.describe(node)}, whose affine stays ({e.affine_reason or 'not fused'})")]
            if any(i is not node.args[0] for i, _ in hits) or dims is None or hits[0][1].axis != len(dims) - 1:
                return [(keys, f"{g.describe(node)} along an axis it does not normalize")]
            self.absorbed.add(node)
            return []
        if node in self.means:
            # mean(x Q) = mean(x) when Q fixes the all-ones vector: the centering's mean is unchanged
            if self.keep_mean and all(s.axis == g.center_axis(sub) for sub, m in g.centers.items()
                                      if m is node for _, s in hits):
                return []
            return [(keys, f"{g.describe(node)}, which averages the features (rotate with keep_mean)")]
        kind = kind_of(node)
        where = g.where(node)
        if kind == SUM:
            changed = {i for i, _ in hits}
            operands = list(node.args[0]) if op_name(node) in ("cat", "concat", "concatenate", "stack") \
                else list(node.args[:2])
            axis = hits[0][1].axis
            for operand in operands:
                if isinstance(operand, fx.Node) and operand not in changed:
                    out_axis = carry(node, hits[0][0], axis, where)
                    if self.keep_mean and not isinstance(out_axis, Refusal) and _constant_along(operand, node, out_axis):
                        continue  # a per-row constant c·1 is rotated onto itself
                    return [(keys, f"{g.describe(node)}, which adds {g.describe(operand)}, not rotated")]
                if not isinstance(operand, fx.Node) and operand and not self.keep_mean:
                    return [(keys, f"{g.describe(node)}, which adds the constant {operand}")]
            return None
        if kind == MAP:
            stream, s = hits[0]
            if len(hits) != 1 or stream is not node.args[0]:
                return [(keys, f"the input of {g.describe(node)}")]
            new = carry(node, stream, s.axis, where)
            return [(keys, f"{g.describe(node)}, which {new}")] if isinstance(new, Refusal) else None
        if kind == SCALE:
            return None  # carry_shift accepts per-row factors only
        return [(keys, f"{g.describe(node)}")]


def _constant_along(operand: fx.Node, out: fx.Node, axis: int) -> bool:
    dims, out_dims = shape(operand), shape(out)
    if dims is None or out_dims is None:
        return False
    pos = axis - (len(out_dims) - len(dims))
    return pos < 0 or dims[pos] == 1


def plan_rotation(g: GraphIndex, plan: FoldPlan, sources: dict[str, Source], needs: dict[str, set[str]],
                  calls: dict[str, list[fx.Node]], kind: str, seed: int, keep_mean: bool) -> Rotation | str:
    """The tensors to rotate, or why the stream cannot be rotated."""
    folded = [e for e in plan.layer_norms if e.foldable]
    if not folded:
        return "no LayerNorm folds, so there is no weightless stream to rotate"
    keys = set().union(*(needs.get(e.name, set()) for e in folded))
    entries = {ln: e for e in plan.layer_norms for ln in calls.get(e.name, [])}
    rotated: dict[tuple, Rotated] = {}

    untied = {u.param for u in plan.untied}

    def add(r: Rotated) -> None:
        """Once per tensor, axis and block: tied names are one tensor, unless the plan unties them."""
        ph = g.placeholder_of.get(r.param)
        tensor = r.param if r.param in untied or ph is None else ph.name
        rotated.setdefault((tensor, r.axis, r.start), r)

    changed: dict[fx.Node, Shift] = {}
    seeds: set[fx.Node] = set()
    for key in sorted(keys):
        src = sources[key]
        if not src.params:
            return f"the stream starts at {src.label}, which has no weights to rotate"
        if src.groups != 1 or src.chain or any(c.scale or c.blocks or c.groups != 1 for c in src.params):
            return f"the stream is written by {src.label} through a LayerScale gain or in blocks, which a rotation does not commute with"
        changed[src.node] = Shift(src.axis, frozenset({key}))
        seeds.add(src.node)
        for c in src.params:
            add(Rotated(c.param, c.axis, c.saved))
    spread = RotationSpread(g, entries, keep_mean)
    # other reads of a rotated weight: another call of the same layer, or a norm's reader
    # rotated the same way, are fine; anything else sees the rotation
    readers = {}
    for e in folded:
        for ln in calls.get(e.name, []):
            for f in e.fused:
                readers.setdefault(f.weight, set()).add((f.axis, f.start))
    seed_roles = {g.role(sources[k].params) for k in keys}
    for r in list(rotated.values()):
        param, axis = r.param, r.axis
        ph = g.placeholder_of.get(param)
        if ph is None or ph in seeds:
            continue
        for user in g.readers(ph):
            if user in seeds or user not in g.live:
                continue
            src = source_of(g, user)
            if isinstance(src, Source) and g.role(src.params) in seed_roles:
                changed[user] = Shift(src.axis, frozenset({f"{param}@{user.name}"}))
                continue
            alias = g.cap.use_alias(user, g.cap.placeholder_fqn[ph.name]) or param
            if (axis, 0) in readers.get(alias, set()):
                continue  # a tied head read as the rotated norm's reader: rotated alike
            return f"{param} is rotated for the stream, but {g.describe(user)} also reads it"
    spread.spread(changed)
    if spread.bad:
        return next(iter(spread.bad.values()))
    widths: set[int] = set()
    for ln in spread.absorbed:
        e = entries[ln]
        width = shape(ln.args[0])[-1]
        widths.add(width)
        for f in e.fused:
            if f.offset != 0 or f.length != width:
                return f"{f.weight} reads only part of {e.name}'s output, which a rotation mixes"
            add(Rotated(f.weight, f.axis, start=f.start, length=f.length))
        if e.affine == AFFINE_GAIN and getattr(g.cap.model.get_submodule(e.name), "bias", None) is not None:
            add(Rotated(f"{e.name}.bias", 0))
    if not spread.absorbed:
        return "no folded norm reads the stream"
    return Rotation(kind, seed, keep_mean, sorted(rotated.values(), key=lambda r: (r.param, r.axis, r.start)))


# --- applying it -------------------------------------------------------------------------------


def apply_rotation(t: torch.Tensor, rot: Rotated, r: Rotation) -> torch.Tensor:
    """One tensor of a plan's rotation, in place; the width is what its block holds."""
    n = _width(t, rot)
    return rotate_(t, rot.axis, rotation_matrix(n, r.kind, r.seed, r.keep_mean), rot.start)


def _width(t: torch.Tensor, rot: Rotated) -> int:
    return rot.length if rot.length else t.shape[rot.axis] - rot.start
