"""Rotating the residual stream, proved on the graph: a weightless RMSNorm commutes with an orthogonal ``Q``, so
with the stream's norms folded and their affine fused, it rotates wherever the rotation reaches nothing else
(docs/how-it-works.md; the matrices are in ``transform.rotation``)."""

from __future__ import annotations

from torch import fx

from .affine import MOVES
from .dataflow import operands
from .graph import LN_OPS, GraphIndex, op_name, shape
from ..plan import AFFINE_FUSED, AFFINE_GAIN, FoldPlan, LayerNormEntry, Rotated, Rotation, RotationSpec
from .rules import MAP, SCALE, SUM, Refusal, Source, carry, kind_of, other_reads, per_row
from .soundness import Flags, Hits, Shift, Spread


class RotationSpread(Spread):
    """Follows a rotation of the stream sources forward; flags whatever it would change."""

    def __init__(self, g: GraphIndex, entries: dict[fx.Node, LayerNormEntry], keep_mean: bool):
        super().__init__(g)
        self.entries = entries  # LN call -> its plan entry
        self.keep_mean = keep_mean
        self.absorbed: set[fx.Node] = set()
        self.means = set(g.centers.values())

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
        where = g.cap.where(node)
        if kind == SUM:
            for operand in operands(node):
                if isinstance(operand, fx.Node) and operand not in dict(hits):
                    out_axis = carry(node, hits[0][0], hits[0][1].axis, where)
                    if self.keep_mean and not isinstance(out_axis, Refusal) and per_row(operand, node, out_axis):
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


def _sum_written(g: GraphIndex, calls: list[fx.Node]) -> fx.Node | None:
    """The sum that a norm's output reaches through ops that only move values: there the norm writes the
    residual stream (a post-LN block), so its gain is part of the stream, not of one layer's input."""
    for ln in calls:
        todo = ([u for u in ln.users if op_name(u) == "getitem" and u.args[1] == 0]
                if op_name(ln) == "native_layer_norm" else [ln])
        seen = set(todo)
        while todo:
            for user in todo.pop().users:
                if user in seen or user not in g.live:
                    continue
                if kind_of(user) == SUM:
                    return user
                if op_name(user) in MOVES:
                    seen.add(user)
                    todo.append(user)
    return None


def _kept_affine(g: GraphIndex, e: LayerNormEntry, calls: list[fx.Node]) -> str:
    """Why a folded norm whose affine stays blocks a rotation (which needs every norm on the stream weightless)."""
    written = _sum_written(g, calls)
    if written is not None:
        return (f"{e.name} writes the residual stream ({g.describe(written)} adds its output to another value), so "
                "its gain cannot move into the layers that read it, as a rotation needs; post-LN models such as "
                "BERT and MPNet cannot be rotated")
    return f"{e.name}'s gain cannot move into the layers that read it, as a rotation needs: {e.affine_reason}"


def plan_rotation(g: GraphIndex, plan: FoldPlan, sources: dict[str, Source], needs: dict[str, set[str]],
                  calls: dict[str, list[fx.Node]], spec: RotationSpec) -> Rotation | str:
    """The tensors to rotate, or why the stream cannot be rotated."""
    folded = [e for e in plan.layer_norms if e.foldable]
    if not folded:
        return "no LayerNorm folds, so there is no weightless stream to rotate"
    for e in folded:  # a norm the rotation reaches whose affine stays: said first, in the plan's own terms
        if e.affine not in (AFFINE_FUSED, AFFINE_GAIN) and needs.get(e.name):
            return _kept_affine(g, e, calls.get(e.name, []))
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
    for key in sorted(keys):
        src = sources[key]
        if not src.params:
            return f"the stream starts at {src.label}, which has no weights to rotate"
        if not src.plain or any(c.groups != 1 for c in src.params):
            return (f"the stream is written by {src.label} through a LayerScale gain or in blocks, which a "
                    "rotation does not commute with")
        changed[src.node] = Shift(src.axis, frozenset({key}))
        for c in src.params:
            add(Rotated(c.param, c.axis, c.saved))
    spread = RotationSpread(g, entries, spec.keep_mean)
    # other reads of a rotated weight: another call of the same layer, or a norm's reader
    # rotated the same way, are fine; anything else sees the rotation
    readers = {}
    for f in (f for e in folded for f in e.fused):
        readers.setdefault(f.weight, set()).add((f.axis, f.start))
    seeds = set(changed)
    seed_roles = {g.role(sources[k].params) for k in keys}
    for r in list(rotated.values()):
        param, axis = r.param, r.axis
        ph = g.placeholder_of.get(param)
        if ph is None or ph in seeds:
            continue
        for user, read in other_reads(g, ph, seeds, seed_roles):
            if isinstance(read, Source):
                changed[user] = Shift(read.axis, frozenset({f"{param}@{user.name}"}))
            elif (axis, 0) not in readers.get(read or param, set()):  # not a tied head rotated as a norm's reader
                return f"{param} is rotated for the stream, but {g.describe(user)} also reads it"
    spread.spread(changed)
    if spread.bad:
        return f"the rotation would reach {next(iter(spread.bad.values()))}"
    for ln in spread.absorbed:
        e = entries[ln]
        width = shape(ln.args[0])[-1]
        for f in e.fused:
            if f.offset != 0 or f.length != width:
                return f"{f.weight} reads only part of {e.name}'s output, which a rotation mixes"
            add(Rotated(f.weight, f.axis, start=f.start, length=f.length))
        if e.affine == AFFINE_GAIN and getattr(g.cap.model.get_submodule(e.name), "bias", None) is not None:
            add(Rotated(f"{e.name}.bias", 0))
    if not spread.absorbed:
        return "no folded norm reads the stream"
    return Rotation(spec.kind, spec.seed, spec.keep_mean,
                    sorted(rotated.values(), key=lambda r: (r.param, r.axis, r.start)), spec.algorithm)
