"""Pass 1: the forward zero-mean dataflow (the paper's Algorithm 1).

Each tensor of the graph is either "zero-mean along axis ``a`` once these
sources are centered" (``Zero``) or "not zero-mean, because ..." (``NotZero``).
Sources are general linear layers and parameters used as data (``rules.
source_of``); the ops that carry the property are the ``rules``. An LN output
is not zero-mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from .graph import GN_OPS, LN_OPS, GraphIndex, op_name, shape
from .plan import AuxCentering, Centering
from .rules import MAP, META_OPS, SCALE, SUM, Refusal, Source, carry, kind_of, param_source, per_row, source_of


@dataclass(frozen=True)
class Zero:
    """Zero-mean along ``axis`` once ``sources`` are centered (none: already)."""

    axis: int
    sources: frozenset[str]
    whole: bool = False
    """Part of the zero mean comes from an explicit centering of the whole axis,
    which does not make each group of a GroupNorm zero-mean."""


@dataclass(frozen=True)
class NotZero:
    """Not zero-mean; ``why`` completes the sentence "its input ..."."""

    why: str


State = Zero | NotZero


def ln_label(g: GraphIndex, node: fx.Node) -> str:
    """An LN call as a user would name it: its module's path, or the functional call."""
    module = g.cap.module_of(node)
    path = g.module_path(node)
    if isinstance(module, nn.LayerNorm) and path:
        return path
    return f"the functional layer_norm `{node.name}` {g.where(node)}"


class Dataflow:
    """The zero-mean state of every node, and the sources they need centered."""

    def __init__(self, g: GraphIndex, aux: dict[fx.Node, AuxCentering] | None = None):
        self.g = g
        self.aux = aux or {}
        self.sources: dict[str, Source] = {}
        self.states: dict[fx.Node, Any] = {}

    def run(self) -> None:
        for node in self.g.graph.nodes:
            state = self.transfer(node)
            if op_name(node) == "native_layer_norm":
                state = (state, NotZero("includes LayerNorm statistics"), NotZero("includes LayerNorm statistics"))
            self.states[node] = state

    def grouped(self, key: str, groups: int) -> str:
        """The key of ``key``'s source centered in ``groups`` blocks (for a GroupNorm)."""
        if groups == 1:
            return key
        src = self.sources[key]
        new = f"{key}#g{groups}"
        if new not in self.sources:
            params = tuple(Centering(c.param, c.axis, groups) for c in src.params)
            self.sources[new] = Source(new, f"{src.label} (in {groups} groups)", src.node, src.axis, params, groups)
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
            src = Source(f"aux:{point.module}:{point.where}", point.describe(), node, len(shape(node)) - 1, ())
            self.sources[src.key] = src
            return Zero(src.axis, frozenset({src.key}), whole=True)
        if node.op == "placeholder":
            return self._placeholder(node)
        if node.op != "call_function":
            return None
        if node in g.centers:
            return Zero(g.center_axis(node), frozenset(), whole=True)
        if name in LN_OPS:
            return NotZero(f"includes the output of {ln_label(g, node)}, which is not zero-mean")
        if name in GN_OPS:
            return NotZero(f"includes the output of the {name.replace('_', ' ')} {g.label(node)}, "
                           "which is not zero-mean")
        if name in META_OPS:
            return None
        src = source_of(g, node)
        if isinstance(src, Source):
            return self._add(src)
        if isinstance(src, Refusal):
            return NotZero(str(src))
        kind = kind_of(node)
        if kind == MAP:
            return self._transfer_map(node)
        if kind == SUM:
            return self._transfer_sum(node)
        if kind == SCALE:
            return self._transfer_scale(node)
        return NotZero(f"includes the output of {name} {g.where(node)}, which is not zero-mean")

    def _placeholder(self, node: fx.Node) -> State:
        cap = self.g.cap
        src = param_source(self.g, node)
        if src is not None:
            return self._add(src)
        if node.name in cap.constants:
            return NotZero(f"includes the constant {cap.constants[node.name]}, which is "
                           "not saved with the model and so cannot be centered")
        if node.name in cap.placeholder_fqn:
            return NotZero(f"includes the scalar parameter {cap.placeholder_fqn[node.name]}")
        return NotZero(f"includes the model input `{node.name}`, which is not zero-mean")

    def _transfer_map(self, node: fx.Node) -> Any:
        name, x = op_name(node), node.args[0]
        state = self.states.get(x) if isinstance(x, fx.Node) else None
        if name == "getitem" and isinstance(state, tuple):  # a native_layer_norm's (out, mean, rstd)
            return state[node.args[1]] if node.args[1] < len(state) else None
        if not isinstance(state, Zero):
            return state if isinstance(state, NotZero) else NotZero(
                f"includes the output of {name} {self.g.where(node)}, which is not zero-mean")
        new = carry(node, x, state.axis, self.g.where(node))
        return NotZero(new) if isinstance(new, Refusal) else Zero(new, state.sources, state.whole)

    def _transfer_sum(self, node: fx.Node) -> State:
        where = self.g.where(node)
        axes, sources, whole = set(), set(), False
        for operand in operands(node):
            if not isinstance(operand, fx.Node):
                if operand:
                    return NotZero(f"has the constant {operand} added {where}")
                continue
            state = self.states.get(operand)
            if not isinstance(state, Zero):
                return state if isinstance(state, NotZero) else NotZero(
                    f"includes {self.g.describe(operand)}, which is not zero-mean")
            new = carry(node, operand, state.axis, where)
            if isinstance(new, Refusal):
                return NotZero(new)
            axes.add(new)
            sources |= state.sources
            whole |= state.whole
        if len(axes) != 1:
            return NotZero(f"adds tensors whose feature axes do not line up {where}")
        return Zero(axes.pop(), frozenset(sources), whole)

    def _transfer_scale(self, node: fx.Node) -> State:
        a, b = node.args[0], node.args[1]
        candidates = [(a, b)] if op_name(node) == "div" else [(a, b), (b, a)]
        first_bad: NotZero | None = None
        for stream, factor in candidates:
            state = self.states.get(stream) if isinstance(stream, fx.Node) else None
            if isinstance(state, NotZero):
                first_bad = first_bad or state
                continue
            if not isinstance(state, Zero):
                continue
            new = carry(node, stream, state.axis, self.g.where(node))
            if isinstance(new, Refusal):
                return NotZero(new)
            if per_row(factor, node, new):
                return Zero(new, state.sources, state.whole)
        if first_bad is not None and not all(isinstance(self.states.get(x), Zero)
                                             for x in (a, b) if isinstance(x, fx.Node)):
            return first_bad
        return NotZero(f"is multiplied by a per-feature tensor {self.g.where(node)}; a per-feature "
                       "scale (such as LayerScale) does not keep a zero mean")


def operands(node: fx.Node) -> list[Any]:
    """The tensors a SUM op combines."""
    if op_name(node) in ("cat", "concat", "concatenate", "stack"):
        return list(node.args[0])
    return [a for a in node.args[:2]]
