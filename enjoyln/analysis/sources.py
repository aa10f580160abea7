"""Sources: the values column-based weight centering makes zero-mean (a linear layer's output, a
parameter used as data), and who else reads their parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Container, Iterator

from torch import fx

from .graph import GraphIndex, arg, norm_dim, op_name, rank, shape
from .rules import MAP, SOURCE_OPS, Refusal, kind_of
from ..plan import Centering


@dataclass(frozen=True)
class Source:
    """A value that CBWC makes zero-mean: a linear layer's output or a parameter."""

    key: str
    label: str
    node: fx.Node
    axis: int
    params: tuple[Centering, ...]
    groups: int = 1  # the shift its centering causes is constant within each of this many blocks
    chain: tuple[fx.Node, ...] = ()
    """For a LayerScale source (``node`` is ``γ ⊙ y``): the nodes from the layer to ``y``, whose
    values centering changes by more than a per-row constant."""

    @property
    def plain(self) -> bool:
        """Weights centered whole, for the value itself: not in blocks, not for a LayerScale."""
        return (
            self.groups == 1
            and not self.chain
            and bool(self.params)
            and not any(c.scale or c.blocks for c in self.params)
        )


# op -> (weight arg, bias arg, weight's output-feature axis, bias's, output's feature axis)
LINEAR_LAYOUTS = {
    "linear": (1, 2, 0, 0, -1),
    "addmm": (2, 0, -1, -1, -1),
    "mm": (1, None, -1, None, -1),
    "matmul": (1, None, -1, None, -1),
    "embedding": (0, None, 1, None, -1),
}


def source_of(g: GraphIndex, node: fx.Node) -> Source | Refusal | None:
    """The Source a general linear layer's output is, if it is one."""
    name = op_name(node)
    if name not in SOURCE_OPS:
        return None
    dims = rank(node)
    where = g.cap.where(node)
    weight_idx, bias_idx, w_axis, b_axis, out_axis = LINEAR_LAYOUTS.get(name, (1, 2, 0, 0, None))
    if name.startswith("conv"):
        transposed = (
            bool(arg(node, 6, "transposed", False))
            if name == "convolution"
            else "transpose" in name
        )
        groups = arg(node, 8 if name == "convolution" else 6, "groups", 1)
        if groups != 1:
            return Refusal(
                f"includes the output of a grouped or depthwise convolution "
                f"{where}, which weight centering cannot make zero-mean"
            )
        w_axis = 1 if transposed else 0
    weight = g.param(node.args[weight_idx])
    if weight is None or dims is None:
        return Refusal(
            f"includes the output of {name} {where}, whose weight is not a parameter enjoyln can "
            "center"
        )
    fqn, perm = weight
    if name in ("mm", "matmul") and len(perm) < 2:
        return Refusal(f"includes the output of {name} {where}, which is not a linear layer")
    if name.startswith("conv"):
        out_axis = dims - (len(perm) - 1)
    params = [g.centering(node, fqn, perm[w_axis])]
    bias_node = arg(node, bias_idx, "bias") if bias_idx is not None else None
    if bias_node is not None:
        bias = g.param(bias_node)
        if bias is None:
            return Refusal(
                f"includes the output of {name} {where}, whose bias is not a parameter enjoyln can "
                "center"
            )
        params.append(g.centering(node, bias[0], bias[1][b_axis]))
    return Source(node.name, g.label(node), node, norm_dim(out_axis, dims), tuple(params))


def other_reads(
    g: GraphIndex, ph: fx.Node, skip: Container[fx.Node], roles: Container[frozenset] = ()
) -> Iterator[tuple[fx.Node, Source | str | None]]:
    """The live readers of parameter ``ph`` outside ``skip``, each with the Source it is if that
    centers as one of ``roles`` (another call of the same layer), else the name it reads ``ph``
    by (None if not known)."""
    for user in g.readers(ph):
        if user in skip or user not in g.live:
            continue
        g.at = user
        src = source_of(g, user) if roles else None
        if isinstance(src, Source) and g.role(src.params) in roles:
            yield user, src
        else:
            yield user, g.cap.use_alias(user, g.cap.placeholder_fqn[ph.name])


# reshapes through which a gain is still its parameter: they keep the entries' order
GAIN_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten"}


def per_feature_param(g: GraphIndex, factor: Any, out: fx.Node, axis: int) -> str | None:
    """The parameter ``factor`` is if it is a gain along ``axis`` of ``out``, maybe reshaped to
    broadcast (``gamma.view(1, -1, 1, 1)``, metaformer's ``scale.view(C, 1, 1)``); else None."""
    dims, out_dims = shape(factor), shape(out)
    base = factor
    while isinstance(base, fx.Node) and op_name(base) in GAIN_VIEWS and base.args:
        base = base.args[0]
    param = g.param(base)
    if param is None or dims is None or out_dims is None:
        return None
    pos = axis - (len(out_dims) - len(dims))
    return param[0] if 0 <= pos and dims[pos] == out_dims[axis] == math.prod(dims) else None


LINEAR_SUMS = {
    "add",
    "sub",
}  # SUM ops whose output a LayerScale may scale: linear in their operands


def linear_reads(user: fx.Node) -> list[fx.Node]:
    """The inputs ``user`` is linear in, feature by feature: a MAP op's first argument, an add's
    operands."""
    kind = kind_of(user)
    if kind == MAP:
        return [user.args[0]] if user.args and isinstance(user.args[0], fx.Node) else []
    if op_name(user) in LINEAR_SUMS:
        return [a for a in user.args[:2] if isinstance(a, fx.Node)]
    return []


def linear_terms(
    stream: fx.Node, leaves: set[fx.Node]
) -> tuple[list[fx.Node], tuple[fx.Node, ...]] | None:
    """(the leaves reached, the nodes between, in graph order) if ``stream`` is a linear combination
    of ``leaves`` through MAP ops, adds and subs only; None if anything else enters it."""
    order = {n: i for i, n in enumerate(stream.graph.nodes)}
    reached, inner, stack = [], set(), [stream]
    while stack:
        node = stack.pop()
        if node in leaves:
            if node not in reached:
                reached.append(node)
            continue
        if node in inner:
            continue
        reads = linear_reads(node)
        if not reads or (op_name(node) in LINEAR_SUMS and len(reads) != len(node.args[:2])):
            return None
        inner.add(node)
        stack.extend(reads)
    return sorted(reached, key=order.__getitem__), tuple(sorted(inner, key=order.__getitem__))


def param_source(g: GraphIndex, node: fx.Node, axis: int | None = None) -> Source | None:
    """A parameter used as data (a positional table, a cls token), centered along its last axis or
    ``axis``; a non-persistent buffer (a sinusoidal table) too, marked as not saved."""
    fqn = g.cap.placeholder_fqn.get(node.name) or g.buffers.get(node.name)
    dims = shape(node)
    if not fqn or not dims or not node.meta["val"].is_floating_point():
        return None
    user = next(iter(node.users), node)
    axis = len(dims) - 1 if axis is None else axis
    centering = replace(g.centering(user, fqn, axis), saved=node.name not in g.buffers)
    return Source(fqn, fqn, node, axis, (centering,))
