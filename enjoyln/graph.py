"""The captured graph, indexed for the analysis passes.

Reading nodes (op names, shapes, arguments) and tying them back to the
model: which placeholder holds which parameter under which names, where a
node sits, what the model's outputs are called, and where the model centers
explicitly. Nothing here decides what folds; ``rules``, ``dataflow`` and
``soundness`` do.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

from .capture import Capture
from .plan import Centering

LN_OPS = {"layer_norm", "native_layer_norm"}
GN_OPS = {"group_norm", "native_group_norm", "instance_norm"}
# What a user's torch.fx.GraphModule may call a LayerNorm
FUNCTIONAL_LN = {torch.nn.functional.layer_norm, torch.layer_norm,
                 torch.ops.aten.layer_norm.default, torch.ops.aten.layer_norm}
# Ops through which a weight is still "the parameter", only transposed or cast.
PARAM_VIEW_OPS = {"_to_copy", "to", "detach", "alias", "contiguous", "t", "transpose",
                  "permute", "numpy_T"}


def op_name(node: fx.Node) -> str:
    """The ATen packet name of a call ('add', 'linear'), or 'getitem'."""
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return "getitem"
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(node.target, "__name__", str(node.target))


def op_key(node: fx.Node) -> str:
    """op name, with the overload where it changes the meaning (mul.Scalar)."""
    name = op_name(node)
    overload = getattr(node.target, "_overloadname", "")
    return f"{name}.{overload}" if overload == "Scalar" and name in ("mul", "div") else name


def shape(node: Any) -> tuple[int, ...] | None:
    """The static shape of a node's tensor value; None if it has none or a size is symbolic."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in val.shape)
    except (TypeError, ValueError):  # unbacked symbolic sizes
        return None


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """A call's argument by position or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


class GraphIndex:
    """One captured graph and the maps from its nodes back to the model."""

    def __init__(self, cap: Capture):
        self.cap = cap
        self.graph = cap.graph
        self.placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        self.placeholder_of: dict[str, fx.Node] = {}
        """Every name of a parameter (tied aliases too) -> its placeholder."""
        for name, fqn in cap.placeholder_fqn.items():
            node = self.placeholders[name]
            for alias in cap.aliases.get(fqn, (fqn,)):
                if node.users or alias not in self.placeholder_of:
                    self.placeholder_of[alias] = node
        self.centers = self._find_centerings()
        """Explicit ``x - x.mean(axis, keepdim=True)``: sub node -> its mean node."""
        self.output_names = self._output_names()
        """Position in the output node's arguments -> the user-facing output name."""

    # -- naming ------------------------------------------------------------------------

    def where(self, node: fx.Node) -> str:
        return self.cap.where(node)

    def module_path(self, node: fx.Node) -> str:
        return self.cap.module_path(node)

    def label(self, node: fx.Node) -> str:
        """The module path of a node, or its name at the top level."""
        return self.cap.module_path(node) or node.name

    def describe(self, node: fx.Node) -> str:
        if node.op == "placeholder":
            fqn = self.cap.placeholder_fqn.get(node.name)
            return f"the parameter {fqn}" if fqn else f"the model input `{node.name}`"
        if op_name(node) in LN_OPS:
            return f"the LayerNorm {self.label(node)}"
        return f"{op_name(node)} {self.where(node)}"

    def _output_names(self) -> dict[int, str]:
        from torch.export.graph_signature import OutputKind

        names, k = {}, 0
        for i, spec in enumerate(self.cap.program.graph_signature.output_specs):
            if spec.kind == OutputKind.USER_OUTPUT:
                names[i] = self.cap.output_names[k] if k < len(self.cap.output_names) else str(k)
                k += 1
        return names

    # -- parameters ----------------------------------------------------------------------

    def param(self, node: Any) -> tuple[str, tuple[int, ...]] | None:
        """(parameter name, permutation) if ``node`` is a parameter, maybe transposed."""
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            fqn = self.cap.placeholder_fqn.get(node.name)
            dims = shape(node)
            return (fqn, tuple(range(len(dims)))) if fqn and dims is not None else None
        name = op_name(node)
        if name not in PARAM_VIEW_OPS:
            return None
        inner = self.param(node.args[0])
        if inner is None or name in ("_to_copy", "to", "detach", "alias", "contiguous"):
            return inner
        fqn, perm = inner
        if name == "numpy_T":
            return fqn, perm[::-1]
        if name == "permute":
            return fqn, tuple(perm[norm_dim(d, len(perm))] for d in node.args[1])
        if name == "t" and len(perm) < 2:
            return inner
        a, b = (0, 1) if name == "t" else (norm_dim(node.args[1], len(perm)), norm_dim(node.args[2], len(perm)))
        perm = list(perm)
        perm[a], perm[b] = perm[b], perm[a]
        return fqn, tuple(perm)

    def centering(self, user: fx.Node, fqn: str, axis: int) -> Centering:
        """The centering of ``fqn`` along ``axis``, under the name ``user`` reads it by."""
        return Centering(self.cap.use_alias(user, fqn) or fqn, axis)

    def role(self, params: tuple[Centering, ...]) -> frozenset:
        """What a centering does, whatever names it goes by: tensor, axis, groups."""
        return frozenset((getattr(self.placeholder_of.get(c.param), "name", c.param), c.axis, c.groups)
                         for c in params)

    def owner_module(self, fqn: str) -> nn.Module | None:
        try:
            return self.cap.model.get_submodule(fqn.rpartition(".")[0])
        except AttributeError:
            return None

    def readers(self, node: fx.Node) -> list[fx.Node]:
        """The ops that read a parameter, looking through transposes and casts."""
        out = []
        for user in node.users:
            if op_name(user) in PARAM_VIEW_OPS:
                out += self.readers(user)
            else:
                out.append(user)
        return out

    # -- explicit centerings ------------------------------------------------------------------

    def _find_centerings(self) -> dict[fx.Node, fx.Node]:
        found = {}
        for node in self.graph.nodes:
            if op_name(node) != "sub" or len(node.args) < 2:
                continue
            x, m = node.args[0], node.args[1]
            if not (isinstance(m, fx.Node) and op_name(m) == "mean" and m.args[0] is x):
                continue
            dims = arg(m, 1, "dim")
            keep = arg(m, 2, "keepdim", False)
            plain = arg(node, 2, "alpha", 1) == 1 and len(m.args) <= 3 and not m.kwargs.get("dtype")
            if shape(x) and keep and plain and isinstance(dims, (list, tuple)) and len(dims) == 1:
                found[node] = m
        return found

    def center_axis(self, sub: fx.Node) -> int:
        """The axis an explicit centering removes the mean along."""
        mean = self.centers[sub]
        return norm_dim(arg(mean, 1, "dim")[0], len(shape(sub.args[0])))
