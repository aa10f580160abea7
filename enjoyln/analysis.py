"""Analysis: which LayerNorms fold, and what must be centered for them.

Three steps over the traced graph (the README's "How it decides"):

1. Classify every node: a *source* (a general linear layer or a
   parameter whose output CBWC can make zero-mean), a *map*, *sum* or *scale*
   op that carries the zero-mean property along a tracked feature axis, a
   LayerNorm, an explicit centering, or *other*.
2. The forward zero-mean dataflow (the paper's Algorithm 1): each tensor is
   either "zero-mean along axis a once these sources are centered" or "not
   zero-mean, because ...". An LN whose input is the former is a candidate.
3. The soundness check: centering a source shifts every value computed
   from it by a per-row constant. That shift must reach nothing but LN inputs,
   which ignore it. Sources whose shift escapes anywhere else are dropped with
   the LNs that need them, until nothing changes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import fx, nn

from .capture import Capture, ExampleInputs, capture
from .errors import CaptureError
from .plan import AuxCentering, Centering, FoldPlan, LayerNormEntry, Untie

# --- op tables ----------------------------------------------------------------------

IDENTITY_OPS = {
    "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy", "to",
    "type_as", "positive", "neg", "dropout", "feature_dropout", "alpha_dropout",
    "feature_alpha_dropout", "native_dropout", "flip",
}
RESHAPE_OPS = {"view", "reshape", "_unsafe_view", "view_as", "reshape_as", "flatten",
               "unflatten", "squeeze", "unsqueeze"}
SPLIT_OPS = {"split", "split_with_sizes", "chunk", "tensor_split", "unbind",
             "unsafe_split", "unsafe_split_with_sizes"}
MAP_OPS = IDENTITY_OPS | RESHAPE_OPS | SPLIT_OPS | {
    "expand", "expand_as", "permute", "transpose", "t", "numpy_T", "swapaxes", "movedim", "slice",
    "select", "narrow", "index", "index_select", "sum", "mean", "constant_pad_nd",
    "repeat", "getitem", "mul.Scalar", "div.Scalar",
}
SUM_OPS = {"add", "sub", "rsub", "cat", "concat", "concatenate", "stack"}
SCALE_OPS = {"mul", "div"}
SOURCE_OPS = {"linear", "addmm", "mm", "matmul", "embedding", "convolution", "conv1d",
              "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
LN_OPS = {"layer_norm", "native_layer_norm"}
GN_OPS = {"group_norm", "native_group_norm", "instance_norm"}
# Ops that read only the shape, dtype or device of a tensor, never its values.
META_OPS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
            "_assert_tensor_metadata", "_assert_scalar", "empty_like", "zeros_like",
            "ones_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full",
            "rand_like", "randn_like", "randint_like", "_local_scalar_dense"}
CAST_OPS = {"_to_copy", "to", "type_as"}
# What a user's torch.fx.GraphModule may call a LayerNorm
FUNCTIONAL_LN = {torch.nn.functional.layer_norm, torch.layer_norm,
                 torch.ops.aten.layer_norm.default, torch.ops.aten.layer_norm}


def _lossy_cast(src: fx.Node, node: fx.Node) -> str:
    """'' for a cast that keeps every value (same or wider float); else what it does."""
    a, b = src.meta.get("val"), node.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dtype == b.dtype:
        return ""
    if not b.dtype.is_floating_point:
        return f"cast to {str(b.dtype).replace('torch.', '')}"
    wider = torch.promote_types(a.dtype, b.dtype) == b.dtype
    return "" if wider else f"rounded to {str(b.dtype).replace('torch.', '')}"


# Ops through which a weight is still "the parameter", only transposed or cast.
PARAM_VIEW_OPS = {"_to_copy", "to", "detach", "alias", "contiguous", "t", "transpose",
                  "permute", "numpy_T"}
DROPOUT_OPS = {"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
               "native_dropout"}


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


def _key(node: fx.Node) -> str:
    """op name, with the overload where it changes the meaning (mul.Scalar)."""
    name = op_name(node)
    overload = getattr(node.target, "_overloadname", "")
    return f"{name}.{overload}" if overload == "Scalar" and name in SCALE_OPS else name


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in val.shape)
    except (TypeError, ValueError):  # unbacked symbolic sizes
        return None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _reshape_axis(in_shape: tuple[int, ...], axis: int, out_shape: tuple[int, ...]) -> int | None:
    """Where a contiguous reshape moves ``axis``, if it keeps it whole.

    The feature coordinate of element ``i`` is ``(i // inner) % d``; a reshape
    keeps it iff some output axis has the same size ``d`` and the same product
    of sizes to its right.
    """
    d, inner = in_shape[axis], math.prod(in_shape[axis + 1:])
    for j, size in enumerate(out_shape):
        if size == d and math.prod(out_shape[j + 1:]) == inner:
            return j
    return None


# --- node states ---------------------------------------------------------------------


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


@dataclass(frozen=True)
class Source:
    """A value that CBWC makes zero-mean: a linear layer's output or a parameter."""

    key: str
    label: str
    node: fx.Node
    axis: int
    params: tuple[Centering, ...]
    groups: int = 1
    """The shift its centering causes is constant within each of this many blocks."""


class Refusal(str):
    """A phrase saying why an op does not carry the zero-mean property."""


# --- the analysis ----------------------------------------------------------------------


class Analysis:
    """Runs the dataflow and the soundness check over one captured graph."""

    def __init__(self, cap: Capture, aux: dict[fx.Node, AuxCentering] | None = None):
        self.cap = cap
        self.aux = aux or {}
        self.graph = cap.graph
        self.placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        self.placeholder_of: dict[str, fx.Node] = {}
        for name, fqn in cap.placeholder_fqn.items():
            node = self.placeholders[name]
            for alias in cap.aliases.get(fqn, (fqn,)):
                if node.users or alias not in self.placeholder_of:
                    self.placeholder_of[alias] = node
        self.sources: dict[str, Source] = {}
        self.states: dict[fx.Node, Any] = {}
        self.last_bad: dict[str, str] = {}  # source -> what its centering would change, last pass
        self.centers = self._find_centerings()
        self.output_names = self._output_names()

    # -- helpers ------------------------------------------------------------------

    def where(self, node: fx.Node) -> str:
        return self.cap.where(node)

    def describe(self, node: fx.Node) -> str:
        if node.op == "placeholder":
            fqn = self.cap.placeholder_fqn.get(node.name)
            return f"the parameter {fqn}" if fqn else f"the model input `{node.name}`"
        if op_name(node) in LN_OPS:
            return f"the LayerNorm {self.cap.module_path(node) or node.name}"
        return f"{op_name(node)} {self.where(node)}"

    def _output_names(self) -> dict[int, str]:
        from torch.export.graph_signature import OutputKind

        names, k = {}, 0
        for i, spec in enumerate(self.cap.program.graph_signature.output_specs):
            if spec.kind == OutputKind.USER_OUTPUT:
                names[i] = self.cap.output_names[k] if k < len(self.cap.output_names) else str(k)
                k += 1
        return names

    def _param(self, node: Any) -> tuple[str, tuple[int, ...]] | None:
        """(parameter name, permutation) if ``node`` is a parameter, maybe transposed."""
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            fqn = self.cap.placeholder_fqn.get(node.name)
            shape = _shape(node)
            return (fqn, tuple(range(len(shape)))) if fqn and shape is not None else None
        name = op_name(node)
        if name not in PARAM_VIEW_OPS:
            return None
        inner = self._param(node.args[0])
        if inner is None or name in ("_to_copy", "to", "detach", "alias", "contiguous"):
            return inner
        fqn, perm = inner
        if name == "numpy_T":
            return fqn, perm[::-1]
        if name == "permute":
            return fqn, tuple(perm[_norm_dim(d, len(perm))] for d in node.args[1])
        if name == "t" and len(perm) < 2:
            return inner
        a, b = (0, 1) if name == "t" else (_norm_dim(node.args[1], len(perm)), _norm_dim(node.args[2], len(perm)))
        perm = list(perm)
        perm[a], perm[b] = perm[b], perm[a]
        return fqn, tuple(perm)

    def _role(self, params: tuple[Centering, ...]) -> frozenset:
        """What a centering does, whatever names it goes by: tensor, axis, groups."""
        return frozenset((getattr(self.placeholder_of.get(c.param), "name", c.param), c.axis, c.groups)
                         for c in params)

    def _owner_module(self, fqn: str) -> nn.Module | None:
        try:
            return self.cap.model.get_submodule(fqn.rpartition(".")[0])
        except AttributeError:
            return None

    def _readers(self, node: fx.Node) -> list[fx.Node]:
        """The ops that read a parameter, looking through transposes and casts."""
        out = []
        for user in node.users:
            if op_name(user) in PARAM_VIEW_OPS:
                out += self._readers(user)
            else:
                out.append(user)
        return out

    def _centering(self, user: fx.Node, fqn: str, axis: int) -> Centering:
        return Centering(self.cap.use_alias(user, fqn) or fqn, axis)

    def _find_centerings(self) -> dict[fx.Node, fx.Node]:
        """Explicit ``x - x.mean(axis, keepdim=True)``: sub node -> its mean node."""
        found = {}
        for node in self.graph.nodes:
            if op_name(node) != "sub" or len(node.args) < 2:
                continue
            x, m = node.args[0], node.args[1]
            if not (isinstance(m, fx.Node) and op_name(m) == "mean" and m.args[0] is x):
                continue
            shape = _shape(x)
            dims = _arg(m, 1, "dim")
            keep = _arg(m, 2, "keepdim", False)
            plain = _arg(node, 2, "alpha", 1) == 1 and len(m.args) <= 3 and not m.kwargs.get("dtype")
            if shape and keep and plain and isinstance(dims, (list, tuple)) and len(dims) == 1:
                found[node] = m
        return found

    def center_axis(self, sub: fx.Node) -> int:
        mean = self.centers[sub]
        return _norm_dim(_arg(mean, 1, "dim")[0], len(_shape(sub.args[0])))

    # -- op semantics shared by both passes ------------------------------------------

    def carry(self, node: fx.Node, src: fx.Node, axis: int) -> int | Refusal:
        """Where ``src``'s feature axis lands in ``node``'s output, for the ops
        that keep a per-row shift a per-row shift."""
        name, key = op_name(node), _key(node)
        in_shape, out_shape = _shape(src), _shape(node)
        where = self.where(node)
        if name == "getitem":
            return axis
        if in_shape is None or (out_shape is None and name not in SPLIT_OPS):
            return Refusal(f"passes through {name} {where}, whose shapes are unknown")
        ndim = len(in_shape)
        if name in DROPOUT_OPS:
            p, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
            if train and p:
                return Refusal(
                    f"passes through dropout in training mode {where}; call model.eval() first")
            return axis
        if name in CAST_OPS:
            why = _lossy_cast(src, node)
            return Refusal(f"is {why} {where}, which does not commute with centering") if why else axis
        if name in IDENTITY_OPS or key in ("mul.Scalar", "div.Scalar"):
            return axis
        if name in RESHAPE_OPS:
            new = _reshape_axis(in_shape, axis, out_shape)
            return new if new is not None else Refusal(
                f"is reshaped {where} in a way that splits or merges the feature axis")
        if name in ("expand", "expand_as", "repeat"):
            new = axis + len(out_shape) - ndim
            ok = out_shape[new] == in_shape[axis]
            return new if ok else Refusal(f"is repeated along the feature axis {where}")
        if name in ("permute", "transpose", "t", "numpy_T", "swapaxes", "movedim"):
            perm = list(range(ndim))
            if name == "numpy_T":
                perm = perm[::-1]
            elif name == "permute":
                perm = [_norm_dim(d, ndim) for d in node.args[1]]
            elif name == "movedim":
                src_d = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
                dst_d = node.args[2] if isinstance(node.args[2], (list, tuple)) else [node.args[2]]
                perm = [p for p in range(ndim) if p not in [_norm_dim(d, ndim) for d in src_d]]
                for s, d in sorted(zip((_norm_dim(d, ndim) for d in src_d), (_norm_dim(d, ndim) for d in dst_d)), key=lambda x: x[1]):
                    perm.insert(d, s)
            elif ndim >= 2:
                a, b = (0, 1) if name == "t" else (_norm_dim(node.args[1], ndim), _norm_dim(node.args[2], ndim))
                perm[a], perm[b] = perm[b], perm[a]
            return perm.index(axis)
        if name in ("slice", "narrow"):
            dim = _norm_dim(_arg(node, 1, "dim", 0), ndim)
            if dim != axis or out_shape[axis] == in_shape[axis]:
                return axis
            return Refusal(f"is cut along the feature axis by {name} {where}")
        if name == "select":
            dim = _norm_dim(_arg(node, 1, "dim"), ndim)
            if dim == axis:
                return Refusal(f"has its feature axis indexed by select {where}")
            return axis - (dim < axis)
        if name == "index_select":
            dim = _norm_dim(_arg(node, 1, "dim"), ndim)
            return axis if dim != axis else Refusal(
                f"has its feature axis indexed by index_select {where}")
        if name == "index":
            indices = list(_arg(node, 1, "indices", []))
            indexed = [i for i, ix in enumerate(indices) if ix is not None]
            if axis == ndim - 1 and all(i < axis for i in indexed) and out_shape[-1] == in_shape[axis]:
                return len(out_shape) - 1
            return Refusal(f"is indexed {where} in a way that enjoyln cannot follow")
        if name in SPLIT_OPS:
            dim = _norm_dim(_arg(node, 2 if name not in ("unbind",) else 1, "dim", 0), ndim)
            if dim == axis:
                return Refusal(f"is split along the feature axis by {name} {where}")
            return axis - (dim < axis) if name == "unbind" else axis
        if name in ("sum", "mean"):
            dims = _arg(node, 1, "dim")
            if not dims:
                return Refusal(f"is reduced over every axis by {name} {where}")
            dims = [_norm_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            if axis in dims:
                return Refusal(f"is reduced over the feature axis by {name} {where}")
            return axis if _arg(node, 2, "keepdim", False) else axis - sum(d < axis for d in dims)
        if name == "constant_pad_nd":
            pad, value = list(node.args[1]), _arg(node, 2, "value", 0)
            padded = {ndim - 1 - i // 2 for i, p in enumerate(pad) if p}
            if axis in padded:
                return Refusal(f"is padded along the feature axis {where}")
            return axis if not padded or value == 0 else Refusal(
                f"is padded with the non-zero value {value} {where}")
        if name in ("cat", "concat", "concatenate"):
            dim = _norm_dim(_arg(node, 1, "dim", 0), ndim)
            return axis if dim != axis else Refusal(
                f"is concatenated along the feature axis {where}")
        if name == "stack":
            dim = _norm_dim(_arg(node, 1, "dim", 0), ndim + 1)
            return axis + (axis >= dim)
        if name in SUM_OPS or name in SCALE_OPS:
            new = axis + len(out_shape) - ndim
            if out_shape[new] != in_shape[axis]:
                return Refusal(f"is broadcast along the feature axis by {name} {where}")
            return new
        return Refusal(f"passes through {name} {where}")

    def per_row(self, factor: Any, out: fx.Node, axis: int) -> bool:
        """True if ``factor`` is constant along output axis ``axis`` (a per-row scale)."""
        if not isinstance(factor, fx.Node):
            return True
        shape, out_shape = _shape(factor), _shape(out)
        if shape is None or out_shape is None:
            return False
        pos = axis - (len(out_shape) - len(shape))
        return pos < 0 or shape[pos] == 1

    # -- pass 1: the forward zero-mean dataflow -----------------------------------------

    def source_of(self, node: fx.Node) -> Source | Refusal | None:
        """The Source a general linear layer's output is, if it is one."""
        name = op_name(node)
        if name not in SOURCE_OPS:
            return None
        out_shape = _shape(node)
        where = self.where(node)
        label = self.cap.module_path(node) or node.name
        weight_idx, bias_idx, w_axis, b_axis, out_axis = {
            "linear": (1, 2, 0, 0, -1),
            "addmm": (2, 0, -1, -1, -1),
            "mm": (1, None, -1, None, -1),
            "matmul": (1, None, -1, None, -1),
            "embedding": (0, None, 1, None, -1),
        }.get(name, (1, 2, 0, 0, None))
        if name.startswith("conv"):
            transposed = (bool(_arg(node, 6, "transposed", False)) if name == "convolution"
                          else "transpose" in name)
            groups = _arg(node, 8 if name == "convolution" else 6, "groups", 1)
            if groups != 1:
                return Refusal(f"includes the output of a grouped or depthwise convolution "
                               f"{where}, which weight centering cannot make zero-mean")
            w_axis = 1 if transposed else 0
        weight = self._param(node.args[weight_idx])
        if weight is None or out_shape is None:
            return Refusal(f"includes the output of {name} {where}, whose weight is not a "
                           "parameter enjoyln can center")
        fqn, perm = weight
        if name in ("mm", "matmul") and len(perm) < 2:
            return Refusal(f"includes the output of {name} {where}, which is not a linear layer")
        if name.startswith("conv"):
            out_axis = len(out_shape) - (len(perm) - 1)
        params = [self._centering(node, fqn, perm[w_axis])]
        bias_node = _arg(node, bias_idx, "bias") if bias_idx is not None else None
        if name == "addmm":
            bias_node = node.args[0]
        if bias_node is not None:
            bias = self._param(bias_node)
            if bias is None:
                return Refusal(f"includes the output of {name} {where}, whose bias is not a "
                               "parameter enjoyln can center")
            bfqn, bperm = bias
            params.append(self._centering(node, bfqn, bperm[-1] if name == "addmm" else bperm[0]))
        return Source(node.name, label, node, _norm_dim(out_axis, len(out_shape)), tuple(params))

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

    def param_source(self, node: fx.Node) -> Source | None:
        fqn = self.cap.placeholder_fqn.get(node.name)
        shape = _shape(node)
        if not fqn or not shape:
            return None
        user = next(iter(node.users), node)
        axis = len(shape) - 1
        return Source(fqn, fqn, node, axis, (self._centering(user, fqn, axis),))

    def transfer(self, node: fx.Node) -> Any:
        """The zero-mean state of ``node``'s output (Algorithm 1's update)."""
        name, key = op_name(node), _key(node)
        where = self.where(node)
        if node in self.aux:
            point = self.aux[node]
            src = Source(f"aux:{point.module}:{point.where}", point.describe(), node,
                         len(_shape(node)) - 1, ())
            self.sources[src.key] = src
            return Zero(src.axis, frozenset({src.key}), whole=True)
        if node.op == "placeholder":
            src = self.param_source(node)
            if src is not None:
                self.sources[src.key] = src
                return Zero(src.axis, frozenset({src.key}))
            if node.name in self.cap.constants:
                return NotZero(f"includes the constant {self.cap.constants[node.name]}, which is "
                               "not saved with the model and so cannot be centered")
            if node.name in self.cap.placeholder_fqn:
                return NotZero(f"includes the scalar parameter {self.cap.placeholder_fqn[node.name]}")
            return NotZero(f"includes the model input `{node.name}`, which is not zero-mean")
        if node.op != "call_function":
            return None
        if node in self.centers:
            return Zero(self.center_axis(node), frozenset(), whole=True)
        if name in LN_OPS:
            return NotZero(f"includes the output of {self.ln_label(node)}, which is not zero-mean")
        if name in GN_OPS:
            path = self.cap.module_path(node) or node.name
            return NotZero(f"includes the output of the {name.replace('_', ' ')} {path}, which is not zero-mean")
        if name in META_OPS:
            return None
        src = self.source_of(node)
        if isinstance(src, Source):
            self.sources[src.key] = src
            return Zero(src.axis, frozenset({src.key}))
        if isinstance(src, Refusal):
            return NotZero(str(src))
        if key in MAP_OPS or name in MAP_OPS:
            arg = node.args[0]
            state = self.states.get(arg) if isinstance(arg, fx.Node) else None
            if name == "getitem":
                state = self.states.get(arg)
                if isinstance(state, tuple):  # a native_layer_norm's (out, mean, rstd)
                    return state[node.args[1]] if node.args[1] < len(state) else None
            if not isinstance(state, Zero):
                return state if isinstance(state, NotZero) else NotZero(
                    f"includes the output of {name} {where}, which is not zero-mean")
            new = self.carry(node, arg, state.axis)
            return NotZero(new) if isinstance(new, Refusal) else Zero(new, state.sources, state.whole)
        if name in SUM_OPS:
            return self._transfer_sum(node)
        if name in SCALE_OPS:
            return self._transfer_scale(node)
        return NotZero(f"includes the output of {name} {where}, which is not zero-mean")

    def _operands(self, node: fx.Node) -> list[Any]:
        if op_name(node) in ("cat", "concat", "concatenate", "stack"):
            return list(node.args[0])
        return [a for a in node.args[:2]]

    def _transfer_sum(self, node: fx.Node) -> State:
        where = self.where(node)
        axes, sources, whole = set(), set(), False
        for operand in self._operands(node):
            if not isinstance(operand, fx.Node):
                if operand:
                    return NotZero(f"has the constant {operand} added {where}")
                continue
            state = self.states.get(operand)
            if not isinstance(state, Zero):
                return state if isinstance(state, NotZero) else NotZero(
                    f"includes {self.describe(operand)}, which is not zero-mean")
            new = self.carry(node, operand, state.axis)
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
            new = self.carry(node, stream, state.axis)
            if isinstance(new, Refusal):
                return NotZero(new)
            if self.per_row(factor, node, new):
                return Zero(new, state.sources, state.whole)
        if first_bad is not None and not all(isinstance(self.states.get(x), Zero) for x in (a, b) if isinstance(x, fx.Node)):
            return first_bad
        return NotZero(f"is multiplied by a per-feature tensor {self.where(node)}; a per-feature "
                       "scale (such as LayerScale) does not keep a zero mean")

    def ln_label(self, node: fx.Node) -> str:
        module = self.cap.module_of(node)
        path = self.cap.module_path(node)
        if isinstance(module, nn.LayerNorm) and path:
            return path
        return f"the functional layer_norm `{node.name}` {self.where(node)}"

    # -- pass 2: soundness ----------------------------------------------------------------

    def ln_sink_ok(self, node: fx.Node, changed_input: fx.Node, axis: int) -> bool:
        """An LN ignores a per-row shift along the one axis it normalizes (its
        output does; the mean a ``native_layer_norm`` also returns does not)."""
        shape = _shape(changed_input)
        norm_shape = list(_arg(node, 1, "normalized_shape", []))
        if op_name(node) == "native_layer_norm" and any(
                u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
            return False
        return (node.args[0] is changed_input and shape is not None
                and axis == len(shape) - 1 and math.prod(norm_shape[:-1]) == 1
                and all(a is not changed_input for a in node.args[1:]))

    def affected(self, active: Iterable[str]) -> tuple[dict[str, str], dict[str, Untie]]:
        """Sources whose centering changes something other than LN inputs.

        Returns (bad source -> reason, untie alias -> Untie) for the set of
        ``active`` sources centered together.
        """
        active = {k: self.sources[k] for k in active}
        bad: dict[str, str] = {}
        untie: dict[str, Untie] = {}
        changed: dict[fx.Node, tuple[int, frozenset[str], int]] = {}  # axis, sources, groups

        def flag(keys: Iterable[str], what: str) -> None:
            for k in keys:
                bad.setdefault(k, what)

        # placeholder name -> {alias: axis} and the sources that center it
        centered: dict[str, dict[str, int]] = {}
        centered_by: dict[str, set[str]] = {}
        grouping: dict[str, dict[int, set[str]]] = {}  # placeholder -> groups -> sources
        for src in active.values():
            prev = changed.get(src.node)
            keys0 = frozenset({src.key}) | (prev[1] if prev else frozenset())
            changed[src.node] = (src.axis, keys0, max(src.groups, prev[2] if prev else 1))
            for c in src.params:
                ph = self.placeholder_of.get(c.param)
                if ph is None:
                    continue
                axes = centered.setdefault(ph.name, {})
                centered_by.setdefault(ph.name, set()).add(src.key)
                grouping.setdefault(ph.name, {}).setdefault(c.groups, set()).add(src.key)
                axes.setdefault(c.param, c.axis)
                if len(set(axes.values())) > 1 or axes[c.param] != c.axis:
                    flag(centered_by[ph.name], f"{c.param} along two different axes")
        for ph_name, by_groups in grouping.items():
            if len(by_groups) > 1:  # centered whole for an LN and in groups for a GroupNorm
                what = f"{self.cap.placeholder_fqn[ph_name]}, which another norm needs centered as a whole"
                flag(set().union(*(keys for g, keys in by_groups.items() if g > 1)), what)
        seeds = set(changed)
        # Other reads of a centered weight: another call of the same module
        # shifts its output the same way, a tied alias gets its own copy, and
        # anything else changes.
        for ph_name, aliases in centered.items():
            ph, keys = self.placeholders[ph_name], centered_by[ph_name]
            if ph in seeds:
                continue  # a parameter used as data: its reads are followed below
            roles = {self._role(active[k].params) for k in keys}
            owners = {id(self._owner_module(a)) for a in aliases}
            for user in self._readers(ph):
                if user in seeds:
                    continue
                src = self.source_of(user)
                if isinstance(src, Source) and self._role(src.params) in roles:
                    changed[user] = (src.axis, frozenset(keys), max(active[k].groups for k in keys))
                    seeds.add(user)
                    continue
                alias = self.cap.use_alias(user, self.cap.placeholder_fqn[ph_name])
                # untying clones the tensor for another module; one module reachable
                # under two names is still one module
                if alias is not None and alias not in aliases and id(self._owner_module(alias)) not in owners:
                    val = ph.meta.get("val")
                    nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
                    untie[alias] = Untie(alias, next(iter(aliases)), nbytes)
                else:
                    flag(keys, f"{self.describe(user)}, which reads the same weight")
        # an explicit centering removes a shift along its own axis, nothing else
        absorbing = {m: sub for sub, m in self.centers.items() if len(m.users) == 1}
        for node in self.graph.nodes:
            hits = [(i, changed[i]) for i in node.all_input_nodes if i in changed]
            if not hits:
                continue
            keys = frozenset().union(*(h[1][1] for h in hits))
            groups = 1
            for _, (_, _, g) in hits:
                groups = _merge_groups(groups, g)
                if groups is None:
                    break
            name = op_name(node)
            if groups is None:
                flag(keys, f"{self.describe(node)}, where shifts of incompatible groupings meet")
                continue
            if node in self.aux:
                # A shift arriving at an inserted centering is removed by it if it
                # passes the op unchanged (an LN ignores it anyway).
                if not (name in LN_OPS and all(self.ln_sink_ok(node, i, ax) for i, (ax, _, _) in hits)) \
                        and not isinstance(self._carry_shift(node, hits), int):
                    flag(keys, f"the input of {self.describe(node)}")
            elif node in seeds:
                flag(keys, f"the input of {self.describe(node)}")
            elif node.op == "output":
                outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
                for i, out in enumerate(outs):
                    if out in changed:
                        label = self.output_names.get(i, str(i))
                        flag(changed[out][1], f"the model output `{label}`")
            elif name in META_OPS:
                pass  # reads no values
            elif (node in self.centers or node in absorbing) and all(
                    ax == self.center_axis(absorbing.get(node, node)) for _, (ax, _, _) in hits):
                if groups != 1:  # x - mean(x) removes a shift shared by all features, not per group
                    flag({k for k in keys if active[k].groups > 1} or keys,
                         f"{self.describe(node)}, which does not remove a per-group shift")
            elif name in LN_OPS:
                if groups != 1:
                    grouped = {k for k in keys if active[k].groups > 1} or keys
                    flag(grouped, f"{self.describe(node)}, which does not ignore a per-group shift")
                elif not all(self.ln_sink_ok(node, i, ax) for i, (ax, _, _) in hits):
                    flag(keys, f"{self.describe(node)} along an axis it does not normalize")
            elif name in GN_OPS:
                why = self.gn_sink_refusal(node, hits, groups)
                if why:
                    flag(keys, why)
            else:
                new = self._carry_shift(node, hits)
                if isinstance(new, int):
                    changed[node] = (new, keys, groups)
                else:
                    flag(keys, new)
        return bad, untie

    def gn_sink_refusal(self, node: fx.Node, hits: list, groups: int) -> str:
        """Why a shift reaching this GroupNorm would change its output ('' if it would not)."""
        shape = _shape(node.args[0])
        g = self.gn_groups(node)
        if any(i is not node.args[0] for i, _ in hits) or shape is None:
            return f"the parameters of {self.describe(node)}"
        if math.prod(shape[2:]) != 1:
            return f"{self.describe(node)}, which averages over {math.prod(shape[2:])} positions too"
        if any(ax != 1 for _, (ax, _, _) in hits) or g % groups:
            return f"{self.describe(node)}, whose groups the shift does not respect"
        return ""

    def gn_groups(self, node: fx.Node) -> int:
        if op_name(node) == "instance_norm":
            return _shape(node.args[0])[1]
        return int(_arg(node, 1, "num_groups", 1))

    def _carry_shift(self, node: fx.Node, hits: list[tuple[fx.Node, tuple[int, Any, int]]]) -> int | str:
        """The axis a per-row shift of ``node``'s inputs lands on in its output,
        or what the shift would change."""
        name = op_name(node)
        what = f"the input of {self.describe(node)}"
        if name in SUM_OPS:
            axes = {self.carry(node, i, ax) for i, (ax, _, _) in hits}
            axis = axes.pop() if len(axes) == 1 else None
            return axis if isinstance(axis, int) and not isinstance(axis, Refusal) else what
        if len(hits) != 1:
            return what
        stream, (axis, _, _) = hits[0]
        if name in SCALE_OPS and _key(node) not in MAP_OPS:
            a, b = node.args[0], node.args[1]
            if stream is b and name == "div":
                return what
            new = self.carry(node, stream, axis)
            factor = b if stream is a else a
            ok = not isinstance(new, Refusal) and self.per_row(factor, node, new)
            return new if ok else what
        if (name in MAP_OPS or _key(node) in MAP_OPS) and stream is node.args[0]:
            new = self.carry(node, stream, axis)
            return what if isinstance(new, Refusal) else new
        return what

    # -- explaining ------------------------------------------------------------------------

    def zero_mean_graph(self, ln: fx.Node, limit: int = 400) -> tuple[dict[str, dict], list[tuple[str, str]]]:
        """The LN's zero-mean graph (Def. 4.2): carrying ops back to the leaves.

        Returns nodes (name -> {label, kind, detail}) and edges (input, user).
        Kinds: ``ln``, ``op`` (carries the zero mean), ``source`` (centered),
        ``zero`` (zero-mean already) and ``blocked`` (where folding fails).
        """
        nodes: dict[str, dict] = {}
        edges: list[tuple[str, str]] = []
        stack = [(ln, None)]
        while stack and len(nodes) < limit:
            node, user = stack.pop()
            if user is not None:
                edges.append((node.name, user))
            if node.name in nodes:
                continue
            state, name = self.states.get(node), op_name(node)
            source = self.sources.get(node.name) or (
                self.sources.get(self.cap.placeholder_fqn.get(node.name, "")))
            if node is ln:
                info = {"label": self.cap.module_path(node) or node.name, "kind": "ln", "detail": ""}
                stack.append((node.args[0], node.name))
            elif isinstance(source, Source) and source.node is node:
                info = {"label": source.label, "kind": "source",
                        "detail": ", ".join(f"{c.param} (axis {c.axis})" for c in source.params)}
            elif node in self.centers:
                info = {"label": f"x - mean(x) {self.where(node)}", "kind": "zero", "detail": ""}
            elif isinstance(state, Zero | NotZero) and (name in MAP_OPS or _key(node) in MAP_OPS
                                                        or name in SUM_OPS or name in SCALE_OPS):
                refused = isinstance(state, NotZero) and not any(
                    isinstance(self.states.get(i), NotZero) for i in node.all_input_nodes)
                info = {"label": f"{name} {self.where(node)}", "kind": "blocked" if refused else "op",
                        "detail": state.why if refused else ""}
                if not refused:
                    for i in node.all_input_nodes:
                        if isinstance(self.states.get(i), Zero | NotZero) and _shape(i):
                            stack.append((i, node.name))
            else:
                why = state.why if isinstance(state, NotZero) else ""
                info = {"label": self.describe(node), "kind": "blocked", "detail": why}
            nodes[node.name] = info
        return nodes, edges

    def entry_name(self, node: fx.Node, functional: dict[fx.Node, str]) -> tuple[str, str]:
        """(plan entry name, kind) of a norm call: its module's path, or the node's
        name in the user's GraphModule; calls of one module share an entry."""
        module, path = self.cap.module_of(node), self.cap.module_path(node)
        if op_name(node) in GN_OPS:
            return path or node.name, "module"
        if isinstance(module, nn.LayerNorm) and path and type(module).forward is nn.LayerNorm.forward:
            return path, "module"
        return functional.get(node) or path or node.name, "functional"

    def ln_nodes(self) -> dict[str, list[fx.Node]]:
        """Plan entry name -> the norm calls it covers."""
        functional = self._functional_names()
        out: dict[str, list[fx.Node]] = {}
        for node in self.graph.nodes:
            if op_name(node) in LN_OPS or op_name(node) in GN_OPS:
                out.setdefault(self.entry_name(node, functional)[0], []).append(node)
        return out

    # -- driver -------------------------------------------------------------------------

    def run(self) -> FoldPlan:
        for node in self.graph.nodes:
            state = self.transfer(node)
            if op_name(node) == "native_layer_norm":
                state = (state, NotZero("includes LayerNorm statistics"), NotZero("includes LayerNorm statistics"))
            self.states[node] = state
        entries, needs, rewritable = self._layer_norms()
        # an LN that cannot be replaced needs no centering: drop it before the
        # soundness pass, so its sources do not count against the others
        for name, e in entries.items():
            if e.foldable and name not in rewritable:
                e.foldable, e.reason = False, rewritable_reason(e)
        active = {name for name, e in entries.items() if e.foldable}
        untie: dict[str, Untie] = {}
        while True:
            keys = set().union(*(needs[n] for n in active)) if active else set()
            bad, untie = self.affected(keys)
            self.last_bad.update(bad)
            dropped = {n for n in active if needs[n] & bad.keys()}
            for n in dropped:
                key = sorted(needs[n] & bad.keys())[0]
                entries[n].foldable = False
                entries[n].reason = (f"folding it needs {self.sources[key].label} centered, "
                                     f"but that would also change {bad[key]}")
            if not dropped:
                break
            active -= dropped
        for name, e in entries.items():
            if e.foldable:
                cs = {c for k in needs[name] for c in self.sources[k].params}
                e.centered = sorted(cs, key=lambda c: (c.param, c.axis))
        plan = FoldPlan(type(self.cap.model).__name__, list(entries.values()),
                        norm_modules=norm_module_paths(self.cap.model))
        plan.untied = sorted(untie.values(), key=lambda u: u.param) if plan.foldable else []
        if self.cap.model.training and any(op_name(n) in DROPOUT_OPS for n in self.graph.nodes):
            plan.notes.append("the model is in training mode, so its dropout blocks folding; "
                              "call model.eval() first")
        return plan

    def _layer_norms(self) -> tuple[dict[str, LayerNormEntry], dict[str, set[str]], set[str]]:
        """One entry per LN module (all its calls) or per functional call."""
        entries: dict[str, LayerNormEntry] = {}
        needs: dict[str, set[str]] = {}
        rewritable: set[str] = set()
        functional = self._functional_names()
        for node in self.graph.nodes:
            if op_name(node) in GN_OPS:
                self._group_norm_entry(node, entries, needs, rewritable)
                continue
            if op_name(node) not in LN_OPS:
                continue
            name, kind = self.entry_name(node, functional)
            if kind == "module" or node in functional:
                rewritable.add(name)
            norm_shape = tuple(int(s) for s in _arg(node, 1, "normalized_shape", ()))
            eps = float(_arg(node, 4, "eps", 1e-5))
            entry = entries.get(name)
            if entry is None:
                entry = entries[name] = LayerNormEntry(name, kind, True, "", [], norm_shape, eps)
                needs[name] = set()
            if not entry.foldable:
                continue
            x = node.args[0]
            state = self.states.get(x)
            shape = _shape(x)
            if isinstance(state, NotZero):
                entry.foldable, entry.reason = False, f"its input {state.why}"
            elif not isinstance(state, Zero) or shape is None:
                entry.foldable, entry.reason = False, "its input cannot be followed through the graph"
            elif math.prod(norm_shape[:-1]) != 1:
                entry.foldable, entry.reason = False, (
                    f"it normalizes over {len(norm_shape)} axes, and weight centering removes "
                    "the mean along one")
            elif state.axis != len(shape) - 1:
                entry.foldable, entry.reason = False, (
                    f"its input is zero-mean along axis {state.axis}, not along the axis it normalizes")
            else:
                needs[name] |= state.sources
        return entries, needs, rewritable

    def _group_norm_entry(self, node: fx.Node, entries: dict[str, LayerNormEntry],
                          needs: dict[str, set[str]], rewritable: set[str]) -> None:
        """GroupNorm (and InstanceNorm) folds with grouped CBWC only where it is exact."""
        module = self.cap.module_of(node)
        name = self.entry_name(node, {})[0]
        x, shape = node.args[0], _shape(node.args[0])
        groups = self.gn_groups(node) if shape else 1
        eps = float(_arg(node, 4 if op_name(node) == "group_norm" else 7, "eps", 1e-5))
        entry = entries.get(name)
        if entry is None:
            entry = entries[name] = LayerNormEntry(name, "module", True, "", [], tuple(shape[1:2]) if shape else (),
                                                   eps, "group_norm", groups)
            needs[name] = set()
        if isinstance(module, nn.GroupNorm) and type(module).forward is nn.GroupNorm.forward:
            rewritable.add(name)
        if not entry.foldable:
            return
        state = self.states.get(x)
        spatial = math.prod(shape[2:]) if shape else 0
        if op_name(node) == "instance_norm" or (shape and shape[1] // groups < 2):
            entry.foldable, entry.reason = False, (
                "each of its groups holds one channel, and centering a single channel would zero it")
        elif not isinstance(module, nn.GroupNorm):
            entry.foldable, entry.reason = False, "it is not an nn.GroupNorm module enjoyln can replace"
        elif spatial != 1:
            entry.foldable, entry.reason = False, (
                f"GroupNorm also averages over the {spatial} positions of each channel; weight centering "
                "can only remove the group mean at each position, which changes GroupNorm's output, so no "
                "change of weights folds it exactly")
        elif isinstance(state, NotZero):
            entry.foldable, entry.reason = False, f"its input {state.why}"
        elif not isinstance(state, Zero) or state.axis != 1:
            entry.foldable, entry.reason = False, "its input is not zero-mean along its channels"
        elif state.whole:
            entry.foldable, entry.reason = False, (
                "its input passes an explicit centering of all channels, which leaves each group's mean")
        else:
            needs[name] |= {self.grouped(k, groups) for k in state.sources}

    def _functional_names(self) -> dict[fx.Node, str]:
        """Functional LN calls in the graph, mapped to the user's GraphModule nodes.

        torch.export keeps the order of calls, so the k-th functional LN in the
        exported graph is the k-th in the user's graph.
        """
        model = self.cap.model
        if not isinstance(model, fx.GraphModule):
            return {}
        theirs = [n for n in model.graph.nodes if n.op == "call_function" and n.target in FUNCTIONAL_LN]
        ours = [n for n in self.graph.nodes if op_name(n) in LN_OPS
                and not isinstance(self.cap.module_of(n), nn.LayerNorm)]
        if len(theirs) != len(ours):
            return {}
        return {o: t.name for o, t in zip(ours, theirs)}


# --- auxiliary centering --------------------------------------------------------------------


def norm_module_paths(model: nn.Module) -> list[str]:
    """Paths of the model's LayerNorm and GroupNorm modules, folded or not."""
    from .norm import GroupRMSNorm, RMSNorm

    kinds = (nn.LayerNorm, nn.GroupNorm, RMSNorm, GroupRMSNorm)
    return sorted(name for name, m in model.named_modules() if name and isinstance(m, kinds))


def _merge_groups(a: int | None, b: int | None) -> int | None:
    """Shifts constant in ``a`` and in ``b`` blocks sum to one constant in the finer,
    if one grouping refines the other."""
    if a is None or b is None:
        return None
    hi, lo = max(a, b), min(a, b)
    return hi if hi % lo == 0 else None


def _within(path: str, scope: str) -> bool:
    return scope == "" or path == scope or path.startswith(scope + ".")


def _candidate_points(analysis: Analysis, plan: FoldPlan) -> dict[fx.Node, tuple[AuxCentering, set[str]]]:
    """Module outputs and inputs on the zero-mean graphs of LNs that do not fold,
    with the names of those LNs each one lies upstream of."""
    cap = analysis.cap
    by_name = {n.name: n for n in analysis.graph.nodes}
    widths = {e.normalized_shape[-1] for e in plan.layer_norms if e.normalized_shape}
    coverage: dict[fx.Node, set[str]] = {}
    for name, calls in analysis.ln_nodes().items():
        if plan[name].foldable:
            continue
        nodes, _ = analysis.zero_mean_graph(calls[0])
        for n in nodes:
            node = by_name.get(n)
            if node is not None and node is not calls[0] and isinstance(analysis.states.get(node), NotZero):
                coverage.setdefault(node, set()).add(name)
    points: dict[fx.Node, tuple[AuxCentering, set[str]]] = {}
    for node, count in coverage.items():
        shape = _shape(node)
        if node.op != "call_function" or not shape or shape[-1] not in widths:
            continue
        path = cap.module_path(node)
        outside = [u for u in node.users if not _within(cap.module_path(u), path)]
        if path and outside:
            escaping = {n for n in analysis.graph.nodes if _within(cap.module_path(n), path)
                        and any(not _within(cap.module_path(u), path) for u in n.users)}
            if escaping == {node}:  # the module returns exactly this tensor
                points[node] = (AuxCentering(path, "output"), count)
                continue
        callees = set()  # for each reader, the outermost module call it sits in that ``node`` does not
        for user in node.users:
            stack = [p for p, _ in (user.meta.get("nn_module_stack") or {}).values()]
            callees.add(next((p for p in stack if p and not _within(path, p)), None))
        if len(callees) == 1 and None not in callees:
            points[node] = (AuxCentering(callees.pop(), "input"), count)
    return points


def auxiliary_plan(cap: Capture, *, max_candidates: int = 6) -> tuple[FoldPlan, dict[fx.Node, AuxCentering]]:
    """Greedily insert centerings that each make more LNs foldable than they cost.

    Each candidate is judged by the full analysis, soundness included, with
    the inserted centering as one more source whose shift must only reach LN
    inputs. Returns the plan with the chosen points, and the points by node.
    """
    base = Analysis(cap)
    plan = base.run()
    strict_count = len(plan.foldable)
    chosen: dict[fx.Node, AuxCentering] = {}
    refused: dict[str, tuple[str, set[str]]] = {}
    while True:
        points = _candidate_points(base, plan)
        ranked = sorted(points.items(), key=lambda kv: -len(kv[1][1]))[:max_candidates]
        best = None
        for node, (point, covered) in ranked:
            if node in chosen:
                continue
            trial = Analysis(cap, {**chosen, node: point})
            trial_plan = trial.run()
            gain = len(trial_plan.foldable) - len(plan.foldable)
            if gain > 1 and (best is None or gain > best[0]):
                best = (gain, node, point, trial, trial_plan)
            if gain <= 1:
                key = f"aux:{point.module}:{point.where}"
                why = trial.last_bad.get(key)
                if why:
                    refused[point.describe()] = (why, covered)
        if best is None:
            break
        gain, node, point, base, plan = best
        chosen[node] = point
    plan.auxiliary = list(chosen.values())
    if chosen:
        plan.notes.append(f"auxiliary centering: {len(chosen)} inserted, "
                          f"{len(plan.foldable) - strict_count} more LNs foldable")
    explained: set[str] = set()
    for what, (why, covered) in refused.items():
        for e in plan.layer_norms:
            if not e.foldable and e.name in covered and e.name not in explained:
                e.reason += f"; {what} would not help, as it would also change {why}"
                explained.add(e.name)
        plan.notes.append(f"{what} was considered but would also change {why}")
    return plan, chosen


def rewritable_reason(entry: LayerNormEntry) -> str:
    return (f"it is a functional layer_norm call in {entry.name}, not a plain nn.LayerNorm; enjoyln "
            "replaces nn.LayerNorm modules, and functional calls only in a torch.fx.GraphModule")


def analyze_capture(cap: Capture) -> FoldPlan:
    """Run the analysis on an already captured graph."""
    return cap.annotate(Analysis(cap).run())


def analyze(model: nn.Module, example_inputs: ExampleInputs = None, *,
            auxiliary_centering: bool = False) -> FoldPlan:
    """Find the foldable LayerNorms of ``model`` and what folding them needs.

    A dry run: the model is traced, never modified. With
    ``auxiliary_centering``, explicit centerings are also placed where each
    makes more LNs foldable than it costs (``plan.auxiliary``).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> analyze(net, torch.randn(2, 8)).foldable[0].name
    '1'
    """
    if not auxiliary_centering:
        return analyze_capture(capture(model, example_inputs))
    return _analyze_with_auxiliary(model, example_inputs)


def _analyze_with_auxiliary(model: nn.Module, example_inputs: ExampleInputs) -> FoldPlan:
    """Choose centerings, then prove the folds again on the model with them in place.

    The first pass proves each inserted centering changes only LN inputs; the
    second, a strict analysis of the model with the centering hooks installed,
    gives the parameters to center and confirms every predicted fold. The
    hooks are removed again before returning.
    """
    from . import centering

    unhooked = capture(model, example_inputs)
    predicted, _ = auxiliary_plan(unhooked)
    if not predicted.auxiliary:
        return predicted
    for a in predicted.auxiliary:
        centering.install(model, a.module, a.where)
    try:
        plan = analyze_capture(capture(model, example_inputs))
    except CaptureError as exc:  # a hook met an output it cannot center
        plan = FoldPlan(predicted.model)
        plan.notes.append(f"auxiliary centering was not applied: {exc}")
    finally:
        for a in predicted.auxiliary:
            centering.remove(model, a.module)
    missing = {e.name for e in predicted.foldable} - {e.name for e in plan.foldable}
    if missing:  # the hooks did not land where the graph said: keep the strict result
        strict = analyze_capture(unhooked)
        strict.notes += plan.notes or ["auxiliary centering was not applied: the re-analysis could not "
                                       f"confirm {sorted(missing)[0]}"]
        return strict
    plan.auxiliary = predicted.auxiliary
    plan.notes = predicted.notes + [n for n in plan.notes if n not in predicted.notes]
    reasons = {e.name: e.reason for e in predicted.layer_norms if not e.foldable}
    for e in plan.layer_norms:
        if not e.foldable and e.name in reasons:
            e.reason = reasons[e.name]
    return plan
