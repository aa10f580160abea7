"""Pass 1: the forward zero-mean dataflow (the paper's Algorithm 1): each tensor is zero-mean along
an axis once some sources are centered (``Zero``), or not, and why (``NotZero``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import fx

from .graph import GN_OPS, LN_OPS, META_OPS, GraphIndex, op_name, reads_value, shape
from ..plan import AuxCentering
from .rules import (
    CAT_OPS,
    MAP,
    SCALE,
    SUM,
    Layout,
    Refusal,
    carry,
    carry_all,
    kind_of,
    per_row,
    split_axis,
)
from .sources import Source, linear_terms, param_source, per_feature_param, source_of


@dataclass(frozen=True)
class Zero:
    """Zero-mean along ``axis`` once ``sources`` are centered (none: already)."""

    axis: int
    sources: frozenset[str]
    # part of the zero mean comes from an explicit centering of the whole axis (not per group)
    whole: bool = False
    layout: Layout | None = (
        None  # where the blocks went, if the feature axis was split (per-head norms)
    )


@dataclass(frozen=True)
class NotZero:
    """Not zero-mean; ``why`` completes the sentence "its input ..."."""

    why: str


State = Zero | NotZero


class Dataflow:
    """The zero-mean state of every node, and the sources they need centered."""

    def __init__(self, g: GraphIndex, aux: dict[fx.Node, AuxCentering] | None = None):
        self.g = g
        self.aux = aux or {}
        self.sources: dict[str, Source] = {}
        self.states: dict[fx.Node, Any] = {}
        self.param_axes: dict[
            fx.Node, int
        ] = {}  # parameters used as data whose feature axis is not their last

    def run(self) -> None:
        self._pass()
        axes = self._feature_axes()
        if axes:  # once more, with those tables centered along the axis the graph gives them
            self.param_axes = axes
            self.sources.clear()
            self.states.clear()
            self._pass()

    def _pass(self) -> None:
        for node in self.g.graph.nodes:
            self.g.at = node
            state = self.transfer(node)
            if op_name(node) == "native_layer_norm":
                state = (
                    state,
                    NotZero("includes LayerNorm statistics"),
                    NotZero("includes LayerNorm statistics"),
                )
            self.states[node] = state

    def grouped(self, key: str, groups: int, blocks: tuple[int, ...] | None = None) -> str:
        """The key of ``key``'s source centered in ``groups`` blocks (GroupNorm, per-head norm), or
        only ``blocks``."""
        if groups == 1:
            return key
        src = self.sources[key]
        new = f"{key}#g{groups}" + (":" + ",".join(map(str, blocks)) if blocks is not None else "")
        if new not in self.sources:
            params = tuple(replace(c, groups=groups, blocks=blocks) for c in src.params)
            some = f", {len(blocks)} of them" if blocks is not None else ""
            self.sources[new] = replace(
                src,
                key=new,
                label=f"{src.label} (in {groups} groups{some})",
                params=params,
                groups=groups,
            )
        return new

    def _add(self, src: Source) -> Zero:
        self.sources[src.key] = src
        return Zero(src.axis, frozenset({src.key}))

    def transfer(self, node: fx.Node) -> Any:
        """The zero-mean state of ``node``'s output (Algorithm 1's update)."""
        g = self.g
        name = op_name(node)
        if node in self.aux:
            point = self.aux[node]
            src = Source(
                f"aux:{point.module}:{point.where}",
                point.describe(),
                node,
                len(shape(node)) - 1,
                (),
            )
            return replace(self._add(src), whole=True)
        if node.op == "placeholder":
            return self._placeholder(node)
        if node.op != "call_function":
            return None
        if node in g.centers:
            return Zero(g.center_axis(node), frozenset(), whole=True)
        if name in LN_OPS:
            label = (
                g.cap.module_path(node)
                or f"the functional layer_norm `{node.name}` {g.cap.where(node)}"
            )
            return NotZero(f"includes the output of {label}, which is not zero-mean")
        if name in GN_OPS:
            return NotZero(
                f"includes the output of the {name.replace('_', ' ')} {g.label(node)}, "
                "which is not zero-mean"
            )
        if name in META_OPS:
            return None
        src = source_of(g, node)
        if isinstance(src, Source):
            return self._add(src)
        if isinstance(src, Refusal):
            return NotZero(str(src))
        by_kind = {MAP: self._transfer_map, SUM: self._transfer_sum, SCALE: self._transfer_scale}
        if kind_of(node) in by_kind:
            return by_kind[kind_of(node)](node)
        return NotZero(f"includes the output of {name} {g.cap.where(node)}, which is not zero-mean")

    def _placeholder(self, node: fx.Node) -> State:
        cap = self.g.cap
        src = param_source(self.g, node, self.param_axes.get(node))
        if src is not None:
            return self._add(src)
        if node.name in cap.constants:
            return NotZero(
                f"includes the constant {cap.constants[node.name]}, which is "
                "not saved with the model and so cannot be centered"
            )
        if node.name in cap.placeholder_fqn:
            return NotZero(f"includes the scalar parameter {cap.placeholder_fqn[node.name]}")
        return NotZero(f"includes the model input `{node.name}`, which is not zero-mean")

    def _feature_axes(self) -> dict[fx.Node, int]:
        """The feature axis of each parameter used as data where it is not its last: a table added
        to the stream (``conv(x) + pos``, ``pos`` (1, C, H, W)) takes the stream's; a guess,
        which the next pass proves."""
        g = self.g
        tables: set[fx.Node] = set()  # values computed from parameters only
        for node in g.graph.nodes:
            if node.op == "placeholder":
                src = self.sources.get(
                    g.cap.placeholder_fqn.get(node.name) or g.buffers.get(node.name, "")
                )
                if src is not None and src.node is node:
                    tables.add(node)
            elif (
                node.op == "call_function"
                and kind_of(node) in (MAP, SUM)
                and node.all_input_nodes
                and all(i in tables for i in node.all_input_nodes if reads_value(node, i))
            ):
                tables.add(node)
        wanted: dict[fx.Node, int] = {}
        clash: set[fx.Node] = set()

        def want(user: fx.Node, value: fx.Node, axis: int) -> None:
            """``value``, read by ``user``, must hold its feature axis where ``user``'s output has
            it."""
            dims = shape(value)
            if dims is None:
                return
            where = g.cap.where(user)
            fits = [a for a in range(len(dims)) if carry(user, value, a, where) == axis]
            if len(fits) > 1:
                fits = [a for a in fits if dims[a] == shape(user)[axis]]
            if len(fits) != 1:
                return
            if value.op == "placeholder":
                if wanted.setdefault(value, fits[0]) != fits[0]:
                    clash.add(value)
            else:  # a MAP op's input, a SUM's operands that are tables
                for operand in value.args[:1] if kind_of(value) == MAP else operands(value):
                    if isinstance(operand, fx.Node) and operand in tables:
                        want(value, operand, fits[0])

        for node in g.graph.nodes:
            if kind_of(node) != SUM or node in tables:
                continue
            parts = [o for o in operands(node) if isinstance(o, fx.Node)]
            mine = [o for o in parts if o in tables]
            axes = {
                carry(node, o, self.states[o].axis, g.cap.where(node))
                for o in parts
                if o not in mine and isinstance(self.states.get(o), Zero)
            }
            if (
                mine and len(axes) == 1 and isinstance(axis := axes.pop(), int)
            ):  # a Refusal is a str
                for o in mine:
                    want(node, o, axis)
        return {p: a for p, a in wanted.items() if p not in clash and a != len(shape(p)) - 1}

    def _transfer_map(self, node: fx.Node) -> Any:
        name, x = op_name(node), node.args[0]
        state = self.states.get(x) if isinstance(x, fx.Node) else None
        if name == "getitem" and isinstance(
            state, tuple
        ):  # a native_layer_norm's (out, mean, rstd)
            return state[node.args[1]] if node.args[1] < len(state) else None
        if not isinstance(state, Zero):
            return (
                state
                if isinstance(state, NotZero)
                else NotZero(
                    f"includes the output of {name} {self.g.cap.where(node)}, which is not "
                    "zero-mean"
                )
            )
        where = self.g.cap.where(node)
        moved = carry_all(node, [(x, state.axis, state.layout)], where)
        if isinstance(moved, Refusal):
            return self._split(node, x, state) or NotZero(moved)
        new, layout = moved
        if layout is None or layout.visible() == state.layout.visible():
            return Zero(new, state.sources, state.whole, layout)
        # only some blocks are left: only they need centering
        blocks = tuple(sorted(layout.visible()))
        if any(self.sources[k].groups != layout.groups for k in state.sources):
            return NotZero(f"is split into blocks {where} in a way enjoyln cannot follow")
        keys = frozenset(
            self.grouped(k.partition("#")[0], layout.groups, blocks) for k in state.sources
        )
        return Zero(new, keys, state.whole, layout)

    def _split(self, node: fx.Node, x: fx.Node, state: Zero) -> State | None:
        """A reshape splitting the feature axis into blocks (``(..., H, D)``), zero-mean once each
        is centered."""
        found = split_axis(node, x, state.axis)
        if (
            found is None
            or state.whole
            or state.layout is not None
            or not all(self.sources[k].plain for k in state.sources)
        ):
            return None
        axis, layout = found
        return Zero(
            axis, frozenset(self.grouped(k, layout.groups) for k in state.sources), False, layout
        )

    def _transfer_sum(self, node: fx.Node) -> State:
        where = self.g.cap.where(node)
        facts, sources, whole = [], set(), False
        for operand in operands(node):
            if not isinstance(operand, fx.Node):
                if operand:
                    return NotZero(f"has the constant {operand} added {where}")
                continue
            state = self.states.get(operand)
            if not isinstance(state, Zero):
                return (
                    state
                    if isinstance(state, NotZero)
                    else NotZero(f"includes {self.g.describe(operand)}, which is not zero-mean")
                )
            if isinstance(refused := carry(node, operand, state.axis, where), Refusal):
                return NotZero(refused)  # before a later operand's reason
            facts.append((operand, state.axis, state.layout))
            sources |= state.sources
            whole |= state.whole
        moved = carry_all(node, facts, where)
        return (
            NotZero(moved)
            if isinstance(moved, Refusal)
            else Zero(moved[0], frozenset(sources), whole, moved[1])
        )

    def _transfer_scale(self, node: fx.Node) -> State:
        a, b = node.args[0], node.args[1]
        candidates = [(a, b)] if op_name(node) == "div" else [(a, b), (b, a)]
        first_bad: NotZero | None = None
        for stream, factor in candidates:
            state = self.states.get(stream) if isinstance(stream, fx.Node) else None
            if not isinstance(state, Zero):
                first_bad = first_bad or (state if isinstance(state, NotZero) else None)
                continue
            moved = carry_all(node, [(stream, state.axis, state.layout)], self.g.cap.where(node))
            if isinstance(moved, Refusal):
                return NotZero(moved)
            if per_row(factor, node, moved[0]):
                return Zero(moved[0], state.sources, state.whole, moved[1])
            scaled = self._layer_scale(node, stream, factor, state, moved[0])
            if scaled is not None:
                return scaled
        # the operand with the output's shape is the stream; the other one scales it
        stream_ok = any(
            isinstance(self.states.get(x), Zero) and shape(x) == shape(node)
            for x in (a, b)
            if isinstance(x, fx.Node)
        )
        if first_bad is not None and not stream_ok:
            return first_bad
        return NotZero(
            f"is multiplied by a per-feature tensor {self.g.cap.where(node)}; a per-feature scale "
            "keeps a zero mean only as a LayerScale: a parameter right after one layer"
        )

    def _layer_scale(
        self, node: fx.Node, stream: fx.Node, factor: Any, state: Zero, axis: int
    ) -> State | None:
        """``γ ⊙ y``, ``γ`` a per-feature parameter (LayerScale), ``y`` a linear combination of
        layers' outputs (timm's ParallelScalingBlock): zero-mean once each layer is centered for
        ``γ``; else None."""
        g = self.g
        fqn = per_feature_param(g, factor, node, axis)
        if fqn is None or not state.sources or state.whole:
            return None
        by_node = {self.sources[k].node: k for k in state.sources}
        if len(by_node) != len(state.sources) or not all(
            self.sources[k].plain for k in state.sources
        ):
            return None
        found = linear_terms(stream, set(by_node))
        if found is None or len(found[0]) != len(by_node):
            return None
        leaves, inner = found
        gain = g.value(fqn)
        if gain is not None and not bool(gain.ne(0).all()):
            labels = " and ".join(self.sources[by_node[leaf]].label for leaf in leaves)
            return NotZero(
                f"is multiplied by the LayerScale gain {fqn} {g.cap.where(node)}, which has a zero "
                f"entry, so no centering of {labels} makes the product zero-mean"
            )
        name = g.cap.use_alias(node, fqn) or fqn
        keys = []
        for leaf in leaves:
            src = self.sources[by_node[leaf]]
            params = tuple(replace(c, scale=name) for c in src.params)
            keys.append(f"{src.key}*{fqn}")
            self.sources[keys[-1]] = Source(
                keys[-1],
                f"{src.label} (for the LayerScale {fqn})",
                node,
                axis,
                params,
                chain=(leaf, *inner),
            )
        return Zero(axis, frozenset(keys))


def operands(node: fx.Node) -> list[Any]:
    """The tensors a SUM op combines."""
    if op_name(node) in CAT_OPS | {"stack"}:
        return list(node.args[0])
    return [a for a in node.args[:2]]
