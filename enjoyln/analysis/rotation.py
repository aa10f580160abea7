"""Rotating the residual streams, proved on the graph: a weightless RMSNorm commutes with an
orthogonal ``Q``, and so does a weightless LayerNorm where ``Q`` fixes the all-ones vector; with
the stream's norms' affine fused, a stream rotates wherever the rotation reaches nothing else,
and a linear layer that reads the stream itself (a projector reading a tapped layer of a vision
tower) takes ``Qᵀ`` on its input. A model has one stream per connected set of norm inputs (a
vision tower's, the language model's), each with its own ``Q`` (docs/how-it-works.md; the
matrices are in ``transform.rotation``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Callable

from torch import fx

from .affine import MOVES, Trace, linear_reader
from .dataflow import operands
from .graph import LN_OPS, GraphIndex, arg, norm_dim, op_name, shape
from ..plan import (
    AFFINE_FUSED,
    AFFINE_GAIN,
    NOT_ROTATED,
    SERVED,
    STREAM_NOT_ROTATED,
    FoldPlan,
    Fused,
    LayerNormEntry,
    Note,
    Rotated,
    Rotation,
    RotationSpec,
)
from .rules import CAT_OPS, MAP, RESHAPE_OPS, SCALE, SUM, Refusal, carry, kind_of, per_row
from .sources import Source, other_reads
from .soundness import Flags, Hits, Shift, Spread


class RotationSpread(Spread):
    """Follows a rotation of the stream sources forward; flags whatever it would change."""

    def __init__(
        self,
        g: GraphIndex,
        entries: dict[fx.Node, LayerNormEntry],
        keep_mean: bool,
        exact_outputs: str = SERVED,
        width: int = 0,
    ):
        super().__init__(g)
        self.width = (
            width  # the stream's: a tap that reads another width reads it mixed with something else
        )
        self.entries = entries  # LN call -> its plan entry
        self.keep_mean = keep_mean
        self.absorbed: dict[fx.Node, int] = {}  # a norm the rotation reaches -> its blocks
        self.changed: dict[fx.Node, Shift] = {}
        self.means = set(g.centers.values())
        # a linear layer reading the stream itself -> its input blocks, and the tokens merged in
        # each row of its input
        self.taps: dict[fx.Node, tuple[list[Fused], int]] = {}
        self.outputs: list[
            str
        ] = []  # outputs the rotation changes, which ``exact_outputs`` lets it
        self.free = exact_outputs == SERVED

    def _output(self, hits: Hits, outs: list) -> Flags:
        changed, flags = dict(hits), []
        for i, o in enumerate(outs):
            name = self.g.output_names.get(i, str(i))
            if o not in changed:
                continue
            if self.free and not self.g.served(name):
                self.outputs.append(
                    name
                )  # a hidden state, not served: rotated, as the contract allows
            else:
                flags.append((changed[o].keys, f"the model output `{name}`"))
        return flags

    def _tap(self, node: fx.Node, hits: Hits, keys: frozenset[str]) -> Flags | None:
        """A linear layer reading the stream itself (a tapped layer's reader) takes ``Qᵀ`` on its
        input; None if ``node`` is no linear layer."""
        stream, s = hits[0]
        dims = shape(stream)
        if len(hits) != 1 or dims is None:
            return None
        found = linear_reader(self.g, node, stream, Trace(s.axis, ((0, dims[s.axis], 0),)))
        if found is None:
            return None
        if isinstance(found, str):
            return [(keys, f"{self.g.describe(node)}: the stream {found}")]
        if s.layout is not None or dims[s.axis] != s.groups * self.width:
            return [
                (
                    keys,
                    f"{self.g.describe(node)}, which reads the stream's features mixed with other "
                    "values",
                )
            ]
        self.taps[node] = (found, s.groups)
        return []

    def spread(self, changed: dict[fx.Node, Shift]) -> None:
        self.changed = changed  # where a merge of tokens puts the rotated rows side by side
        super().spread(changed)

    def _concat(self, node: fx.Node, hits: Hits) -> bool:
        """Taps of the stream side by side along the features (several tapped layers read as one
        input): each is rotated by the same ``Q``, so the whole is rotated by ``I_k ⊗ Q``."""
        parts, dims = node.args[0] if node.args else (), shape(node)
        changed = dict(hits)
        if op_name(node) not in CAT_OPS or dims is None or not parts:
            return False
        axis = norm_dim(arg(node, 1, "dim", 0), len(dims))
        if axis != len(dims) - 1 or any(
            p not in changed
            or changed[p].groups != 1
            or changed[p].layout is not None
            or changed[p].axis != axis
            or shape(p)[-1] != self.width
            for p in parts
        ):
            return False
        keys = frozenset().union(*(changed[p].keys for p in parts))
        self.changed[node] = Shift(axis, keys, len(parts))
        return True

    def _merge(self, node: fx.Node, hits: Hits) -> bool:
        """A reshape that lays ``k`` consecutive rows of the stream side by side (a merger of 4
        tokens): row-major, so row ``t``'s features land in block ``t % k`` of the wide row, and the
        rotation goes on block by block (``I_k ⊗ Q``)."""
        stream, s = hits[0]
        dims, out = shape(stream), shape(node)
        if (
            op_name(node) not in RESHAPE_OPS
            or len(hits) != 1
            or node.args[0] is not stream
            or dims is None
            or out is None
            or s.layout is not None
            or s.groups != 1
            or s.axis != len(dims) - 1
            or dims[-1] != self.width
            or not isinstance(out[-1], int)
            or out[-1] <= self.width
            or out[-1] % self.width
        ):
            return False
        self.changed[node] = Shift(len(out) - 1, s.keys, out[-1] // self.width)
        return True

    def sink(self, node: fx.Node, hits: Hits, keys: frozenset[str], groups: int) -> Flags | None:
        g, name = self.g, op_name(node)
        if node.op == "output":
            return self._output(
                hits, node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            )
        if name in LN_OPS:
            e = self.entries.get(node)
            dims = shape(node.args[0])
            # a LayerNorm that stays one commutes with Q where Q fixes the all-ones vector, once its
            # affine moved
            if e is None or not (
                e.foldable or (self.keep_mean and e.affine in (AFFINE_FUSED, AFFINE_GAIN))
            ):
                return [(keys, f"{g.describe(node)}, which does not fold")]
            if e.affine not in (AFFINE_FUSED, AFFINE_GAIN):
                return [
                    (
                        keys,
                        f"{g.describe(node)}, whose affine stays ({e.affine_reason or 'not fused'})",  # noqa: E501
                    )
                ]
            if (
                any(i is not node.args[0] for i, _ in hits)
                or dims is None
                or hits[0][1].axis != len(dims) - 1
            ):
                return [(keys, f"{g.describe(node)} along an axis it does not normalize")]
            self.absorbed[node] = hits[0][1].groups
            return []
        if node in self.means:
            # mean(x Q) = mean(x) when Q fixes the all-ones vector: the centering's mean is
            # unchanged
            if self.keep_mean and all(
                s.axis == g.center_axis(sub)
                for sub, m in g.centers.items()
                if m is node
                for _, s in hits
            ):
                return []
            return [
                (keys, f"{g.describe(node)}, which averages the features (rotate with keep_mean)")
            ]
        tap = self._tap(node, hits, keys)
        if tap is not None:
            return tap
        if self._merge(node, hits) or self._concat(node, hits):
            return []
        kind = kind_of(node)
        where = g.cap.where(node)
        if kind == SUM:
            for operand in operands(node):
                if isinstance(operand, fx.Node) and operand not in dict(hits):
                    out_axis = carry(node, hits[0][0], hits[0][1].axis, where)
                    if (
                        self.keep_mean
                        and not isinstance(out_axis, Refusal)
                        and per_row(operand, node, out_axis)
                    ):
                        continue  # a per-row constant c·1 is rotated onto itself
                    return [
                        (keys, f"{g.describe(node)}, which adds {g.describe(operand)}, not rotated")
                    ]
                if not isinstance(operand, fx.Node) and operand and not self.keep_mean:
                    return [(keys, f"{g.describe(node)}, which adds the constant {operand}")]
            return None
        if kind == MAP:
            stream, s = hits[0]
            if len(hits) != 1 or stream is not node.args[0]:
                return [(keys, f"the input of {g.describe(node)}")]
            new = carry(node, stream, s.axis, where)
            return (
                [(keys, f"{g.describe(node)}, which {new}")] if isinstance(new, Refusal) else None
            )
        if kind == SCALE:
            return None  # carry_shift accepts per-row factors only
        return [(keys, f"{g.describe(node)}")]


PADS = ("constant_pad_nd", "pad")


def _sum_written(g: GraphIndex, calls: list[fx.Node]) -> fx.Node | None:
    """The sum that a norm's output reaches through ops that only move values, or pad them with
    zeros along another axis: there the norm writes the residual stream (a post-LN block, a
    pre-norm at a tower's start), so its gain is part of the stream, not of one layer's input."""
    for ln in calls:
        dims = shape(ln.args[0])
        todo = [
            (out, len(dims) - 1 if dims else -1)
            for out in (
                [u for u in ln.users if op_name(u) == "getitem" and u.args[1] == 0]
                if op_name(ln) == "native_layer_norm"
                else [ln]
            )
        ]
        seen = {node for node, _ in todo}
        while todo:
            value, axis = todo.pop()
            for user in value.users:
                if user in seen or user not in g.live:
                    continue
                if kind_of(user) == SUM:
                    return user
                if op_name(user) in MOVES:
                    seen.add(user)
                    todo.append((user, axis))
                elif op_name(user) in PADS and axis >= 0:
                    # zeros padded along another axis (Mllama's tiles padded to a multiple of 8
                    # patches): the padded rows are new, the norm's rows still reach the sum
                    moved = carry(user, value, axis, g.cap.where(user))
                    if not isinstance(moved, Refusal):
                        seen.add(user)
                        todo.append((user, moved))
    return None


def _kept_affine(g: GraphIndex, e: LayerNormEntry, calls: list[fx.Node]) -> str:
    """Why a folded norm whose affine stays blocks a rotation (which needs every norm on the stream
    weightless)."""
    written = _sum_written(g, calls)
    if written is not None:
        return (
            f"{e.name} writes the residual stream ({g.describe(written)} adds its output to "
            "another value), so "
            "its gain cannot move into the layers that read it, as a rotation needs; post-LN "
            "models such as BERT and MPNet, and towers whose stream starts at a LayerNorm with a "
            "gain such as CLIP's and Mllama's, cannot be rotated"
        )
    return (
        f"{e.name}'s gain cannot move into the layers that read it, as a rotation needs: "
        f"{e.affine_reason}"
    )


@dataclass
class Stream:
    """A residual stream: the norms that read it, the sources that write it (by key), its width and
    a name."""

    name: str
    width: int
    entries: list[LayerNormEntry]
    keys: set[str] = field(default_factory=set)


def find_streams(
    g: GraphIndex,
    plan: FoldPlan,
    sources: dict[str, Source],
    needs: dict[str, set[str]],
    calls: dict[str, list[fx.Node]],
) -> list[Stream]:
    """The residual streams, from the graph alone: norms whose inputs share a writer, or writers
    that share a weight (an embedding two stacks read), are on one stream; in the order of the
    plan's norms."""
    parent: dict[tuple, tuple] = {}

    def root(x: tuple) -> tuple:
        while parent.setdefault(x, x) != x:
            parent[x] = x = parent[parent[x]]
        return x

    entries = [e for e in plan.layer_norms if e.norm == "layer_norm" and needs.get(e.name)]
    for e in entries:
        for key in sorted(needs[e.name]):
            parent[root(("key", key))] = root(("norm", e.name))
            for c in sources[key].params:
                tensor = getattr(g.placeholder_of.get(c.param), "name", c.param)
                parent[root(("tensor", tensor))] = root(("norm", e.name))
    found: dict[tuple, Stream] = {}
    for e in entries:
        stream = found.setdefault(root(("norm", e.name)), Stream("", 0, []))
        stream.entries.append(e)
        stream.keys |= needs[e.name]
    for stream in found.values():
        widths = {
            shape(ln.args[0])[-1]
            for e in stream.entries
            for ln in calls.get(e.name, [])
            if shape(ln.args[0])
        }
        stream.width = widths.pop() if len(widths) == 1 else 0
        names = [e.name.split(".") for e in stream.entries]
        names += [c.param.split(".")[:-1] for k in stream.keys for c in sources[k].params]
        common = names[0]
        for n in names[1:]:
            common = [a for a, b in zip(common, n) if a == b][
                : next((i for i, (a, b) in enumerate(zip(common, n)) if a != b), len(common))
            ]
        stream.name = ".".join(common) or "the model"
    return list(found.values())


def stream_seed(seed: int, stream: str) -> int:
    """The seed of a stream after the first a plan rotates: derived from the user's, the same on
    every machine."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{stream}".encode()).digest()[:4], "little")


@dataclass
class Rotations:
    """What a plan's rotation of every stream comes to: the rotations, the notes on the streams left
    alone, the outputs the rotations change, and the norms that stay LayerNorms on a rotated
    stream."""

    rotations: list[Rotation] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)


def plan_rotations(
    g: GraphIndex,
    plan: FoldPlan,
    sources: dict[str, Source],
    needs: dict[str, set[str]],
    calls: dict[str, list[fx.Node]],
    spec: RotationSpec,
) -> Rotations:
    """Each stream's rotation, its seed the user's for the first stream rotated and derived from it
    (and the stream's name) for the others; a note for each stream that cannot rotate, saying
    why."""
    streams = find_streams(g, plan, sources, needs, calls)
    out = Rotations()
    if not streams:
        why = (
            "no folded norm reads the stream"
            if plan.foldable
            else "no LayerNorm folds, so there is no weightless stream to rotate"
        )
        out.notes.append(Note.of(NOT_ROTATED, why))
        return out
    found = []
    for stream in streams:
        seed = spec.seed if not found else stream_seed(spec.seed, stream.name)
        result = plan_rotation(g, plan, sources, needs, calls, replace(spec, seed=seed), stream)
        if isinstance(result, str):
            out.notes.append(
                Note.of(NOT_ROTATED, result)
                if len(streams) == 1
                else Note.of(STREAM_NOT_ROTATED, stream.name, stream.width, result)
            )
            continue
        rotation, outputs, absorbed = result
        found.append((stream, rotation))
        out.outputs += [o for o in outputs if o not in out.outputs]
        # every norm the rotation reaches that does not fold stays a LayerNorm, weightless: the
        # stream's, and one over merged tokens that reads it (a DeepStack merger's)
        out.kept |= {e.name for e in stream.entries if not e.foldable} | absorbed
    for stream, rotation in found:
        if len(found) > 1:  # several rotated: each says which stream it is
            rotation.stream, rotation.width = stream.name, stream.width
        out.rotations.append(rotation)
    return out


def plan_rotation(
    g: GraphIndex,
    plan: FoldPlan,
    sources: dict[str, Source],
    needs: dict[str, set[str]],
    calls: dict[str, list[fx.Node]],
    spec: RotationSpec,
    stream: Stream,
) -> tuple[Rotation, list[str], set[str]] | str:
    """The tensors to rotate for one stream, the outputs it changes and the norms it reaches that do
    not fold, or why the stream cannot be rotated."""
    if not stream.width:
        return "its norms normalize different widths"
    kept = _kept_affine_reached(g, stream, spec, calls)
    if kept:
        return kept
    entries = {ln: e for e in plan.layer_norms for ln in calls.get(e.name, [])}
    rotated: dict[tuple, Rotated] = {}
    untied = {u.param for u in plan.untied}

    def add(r: Rotated) -> None:
        """Once per tensor, axis and block: tied names are one tensor, unless the plan unties
        them."""
        ph = g.placeholder_of.get(r.param)
        tensor = r.param if r.param in untied or ph is None else ph.name
        rotated.setdefault((tensor, r.axis, r.start), r)

    changed = _seed(g, stream, sources, add)
    if isinstance(changed, str):
        return changed
    spread = RotationSpread(g, entries, spec.keep_mean, spec.exact_outputs, stream.width)
    why = _read_elsewhere(g, stream, sources, rotated, changed)
    if why:
        return why
    spread.spread(changed)
    if spread.bad:
        return f"the rotation would reach {next(iter(spread.bad.values()))}"
    why = _absorbed(g, spread, entries, add) or _tapped(g, spread, add)
    if why:
        return why
    return (
        Rotation(
            spec.kind,
            spec.seed,
            spec.keep_mean,
            sorted(rotated.values(), key=lambda r: (r.param, r.axis, r.start)),
            spec.algorithm,
        ),
        spread.outputs,
        {entries[ln].name for ln in spread.absorbed if not entries[ln].foldable},
    )


def _kept_affine_reached(
    g: GraphIndex, stream: Stream, spec: RotationSpec, calls: dict[str, list[fx.Node]]
) -> str | None:
    """Why not, where a norm the rotation reaches keeps its affine: said first, in the plan's own
    terms."""
    for e in stream.entries:
        if e.affine not in (AFFINE_FUSED, AFFINE_GAIN):
            if not e.foldable and not spec.keep_mean:
                return (
                    f"{e.name} does not fold, and a LayerNorm commutes only with a rotation that "
                    "keeps the "
                    "mean"
                )
            return _kept_affine(g, e, calls.get(e.name, []))
    return None


def _absorbed(
    g: GraphIndex,
    spread: RotationSpread,
    entries: dict[fx.Node, LayerNormEntry],
    add: Callable[[Rotated], None],
) -> str | None:
    """The weights that read each norm the rotation reaches take ``Q``'s transpose (and a fused
    gain's bias is rotated), or why not."""
    for ln, blocks in spread.absorbed.items():
        e = entries[ln]
        width = shape(ln.args[0])[-1]
        for f in e.fused:
            if f.offset != 0 or f.length != width:
                return f"{f.weight} reads only part of {e.name}'s output, which a rotation mixes"
            for b in _blocks(f.start, f.length, blocks):
                add(Rotated(f.weight, f.axis, start=b[0], length=b[1]))
        if (
            e.affine == AFFINE_GAIN
            and getattr(g.cap.model.get_submodule(e.name), "bias", None) is not None
        ):
            add(Rotated(f"{e.name}.bias", 0))
    if not spread.absorbed:
        return "no folded norm reads the stream"
    return None


def _tapped(g: GraphIndex, spread: RotationSpread, add: Callable[[Rotated], None]) -> str | None:
    """The weights that read the stream where it is tapped take ``Q``'s transpose, or why not."""
    for node, (fused, blocks) in spread.taps.items():
        for f in fused:
            ph = g.placeholder_of.get(f.weight)
            user = (
                next((u for u, _ in other_reads(g, ph, set(spread.taps))), None)
                if ph is not None
                else None
            )
            if user is not None:
                return (
                    f"{f.weight} reads the stream at {g.describe(node)}, but "
                    f"{g.describe(user)} "
                    "also reads it"
                )
            for b in _blocks(f.start, f.length, blocks):
                add(Rotated(f.weight, f.axis, start=b[0], length=b[1]))
    return None


def _blocks(start: int, length: int, k: int) -> list[tuple[int, int]]:
    """The ``k`` blocks, each one token's features, of a reader's input that holds ``k`` merged
    tokens: each takes ``Qᵀ`` alone."""
    return [(start + j * (length // k), length // k) for j in range(k)]


def _seed(
    g: GraphIndex, stream: Stream, sources: dict[str, Source], add: Callable[[Rotated], None]
) -> dict[fx.Node, Shift] | str:
    """The stream's sources as the rotation's seeds (their weights rotated by ``add``), or why they
    cannot be."""
    changed: dict[fx.Node, Shift] = {}
    for key in sorted(stream.keys):
        src = sources[key]
        if not src.params:
            return f"the stream starts at {src.label}, which has no weights to rotate"
        if not src.plain or any(c.groups != 1 for c in src.params):
            return (
                f"the stream is written by {src.label} through a LayerScale gain or in blocks, "
                "which a "
                "rotation does not commute with"
            )
        changed[src.node] = Shift(src.axis, frozenset({key}))
        for c in src.params:
            add(Rotated(c.param, c.axis, c.saved))
    return changed


def _read_elsewhere(
    g: GraphIndex,
    stream: Stream,
    sources: dict[str, Source],
    rotated: dict[tuple, Rotated],
    changed: dict[fx.Node, Shift],
) -> str | None:
    """Other reads of a rotated source weight: another call of the same layer (seeded too), or a
    norm's reader rotated the same way (a tied head), are fine; anything else would see the
    rotation."""
    readers = {}
    for f in (f for e in stream.entries for f in e.fused):
        readers.setdefault(f.weight, set()).add((f.axis, f.start))
    seeds = set(changed)
    seed_roles = {g.role(sources[k].params) for k in stream.keys}
    for r in list(rotated.values()):
        param, axis = r.param, r.axis
        ph = g.placeholder_of.get(param)
        if ph is None or ph in seeds:
            continue
        for user, read in other_reads(g, ph, seeds, seed_roles):
            if isinstance(read, Source):
                changed[user] = Shift(read.axis, frozenset({f"{param}@{user.name}"}))
            elif (axis, 0) not in readers.get(
                read or param, set()
            ):  # not a tied head rotated as a norm's reader
                return f"{param} is rotated for the stream, but {g.describe(user)} also reads it"
    return None
