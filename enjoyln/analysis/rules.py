"""Op rules: which ops keep a property shared by every feature (a zero mean, a per-row shift), and
where the feature axis goes. One rule serves the dataflow, the soundness pass and the rotation
proof; docs/contributing.md ("Adding an op rule") says how to write one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from .graph import arg, norm_dim, op_key, op_name, permutation, shape

MAP, SUM, SCALE = "map", "sum", "scale"

SOURCE_OPS = {
    "linear",
    "addmm",
    "mm",
    "matmul",
    "embedding",
    "convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
}
DROPOUT_OPS = {
    "dropout",
    "feature_dropout",
    "alpha_dropout",
    "feature_alpha_dropout",
    "native_dropout",
}
CAST_OPS = {"_to_copy", "to", "type_as"}
CAT_OPS = {"cat", "concat", "concatenate"}
SPLIT_OPS = {
    "split",
    "split_with_sizes",
    "chunk",
    "tensor_split",
    "unbind",
    "unsafe_split",
    "unsafe_split_with_sizes",
}


class Refusal(str):
    """A phrase saying why an op does not keep the property, completing "its input ..."."""


@dataclass(frozen=True)
class Op:
    """One op seen by a rule: ``src``'s feature axis ``axis`` entering ``node``."""

    node: fx.Node
    src: fx.Node
    axis: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...] | None
    where: str

    @property
    def ndim(self) -> int:
        return len(self.in_shape)


CarryFn = Callable[[Op], "int | Refusal"]


@dataclass(frozen=True)
class Rule:
    kind: str
    carry: CarryFn


RULES: dict[str, Rule] = {}  # op key (``op_key``) -> its rule


def rule(*keys: str, kind: str = MAP) -> Callable[[CarryFn], CarryFn]:
    """Register ``fn`` as the rule of the ops ``keys``."""

    def register(fn: CarryFn) -> CarryFn:
        for k in keys:
            RULES[k] = Rule(kind, fn)
        return fn

    return register


def rule_of(node: fx.Node) -> Rule | None:
    return (
        RULES.get(op_key(node)) or RULES.get(op_name(node)) if node.op == "call_function" else None
    )


def kind_of(node: fx.Node) -> str | None:
    """MAP, SUM, SCALE, or None for an op that keeps nothing."""
    r = rule_of(node)
    return r.kind if r else None


def carry(node: fx.Node, src: fx.Node, axis: int, where: str) -> int | Refusal:
    """Where ``src``'s feature axis ``axis`` lands in ``node``'s output if ``node`` keeps the
    property; else why."""
    name = op_name(node)
    if name == "getitem":
        return axis
    r = rule_of(node)
    if r is None:
        return Refusal(f"passes through {name} {where}")
    in_shape, out_shape = shape(src), shape(node)
    if in_shape is None or (out_shape is None and name not in SPLIT_OPS):
        return Refusal(f"passes through {name} {where}, whose shapes are unknown")
    return r.carry(Op(node, src, axis, in_shape, out_shape, where))


def per_row(factor: Any, out: fx.Node, axis: int) -> bool:
    """True if ``factor`` is constant along output axis ``axis`` (a per-row scale)."""
    if not isinstance(factor, fx.Node):
        return True
    dims, out_dims = shape(factor), shape(out)
    if dims is None or out_dims is None:
        return False
    pos = axis - (len(out_dims) - len(dims))
    return pos < 0 or dims[pos] == 1


# --- the rules ---------------------------------------------------------------------------


@rule(
    "getitem",
    "clone",
    "contiguous",
    "alias",
    "detach",
    "lift_fresh_copy",
    "positive",
    "neg",
    "mul.Scalar",
    "div.Scalar",
)
def _identity(op: Op) -> int | Refusal:
    return op.axis


def _dims(op: Op, index: int, name: str, default: Any = ()) -> list[int]:
    dims = arg(op.node, index, name, default)
    return [norm_dim(d, op.ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]


@rule("flip", "roll")
def _reorder(op: Op) -> int | Refusal:
    """Reversing or rolling positions treats every feature alike; doing it to the
    features themselves reorders them, which per-feature gains and blocks cannot follow."""
    name = op_name(op.node)
    dims = _dims(op, 1 if name == "flip" else 2, "dims")
    if op.axis in dims or (name == "roll" and not dims):
        return Refusal(
            f"is {'flipped' if name == 'flip' else 'rolled'} along the feature axis {op.where}"
        )
    return op.axis


_SPATIAL = {  # op -> how many trailing axes it works over, the same way for every channel
    **{f"upsample_nearest{k}d": k for k in (1, 2, 3)},
    **{f"_upsample_nearest_exact{k}d": k for k in (1, 2, 3)},
    "upsample_linear1d": 1,
    "upsample_bilinear2d": 2,
    "_upsample_bilinear2d_aa": 2,
    "upsample_bicubic2d": 2,
    "_upsample_bicubic2d_aa": 2,
    "upsample_trilinear3d": 3,
    "_adaptive_avg_pool2d": 2,
    "_adaptive_avg_pool3d": 3,
    **{f"avg_pool{k}d": k for k in (1, 2, 3)},
    **{f"adaptive_avg_pool{k}d": k for k in (1, 2, 3)},
    **{f"reflection_pad{k}d": k for k in (1, 2, 3)},
    **{f"replication_pad{k}d": k for k in (1, 2, 3)},
}


@rule(*_SPATIAL)
def _spatial(op: Op) -> int | Refusal:
    """Resampling, average pooling, padding: a linear map of the trailing axes, alike for every
    feature."""
    name = op_name(op.node)
    if op.axis >= op.ndim - _SPATIAL[name]:
        what = "pooled" if "pool" in name else "padded" if "pad" in name else "resampled"
        return Refusal(f"is {what} along the feature axis by {name} {op.where}")
    return op.axis


@rule(*DROPOUT_OPS)
def _dropout(op: Op) -> int | Refusal:
    p, train = arg(op.node, 1, "p", 0.5), arg(op.node, 2, "train", True)
    if train and p:
        return Refusal(
            f"passes through dropout in training mode {op.where}; call model.eval() first"
        )
    return op.axis


@rule(*CAST_OPS)
def _cast(op: Op) -> int | Refusal:
    """A cast to the same or a wider float keeps every value; any other does not."""
    a, b = op.src.meta.get("val"), op.node.meta.get("val")
    if (
        not isinstance(a, torch.Tensor)
        or not isinstance(b, torch.Tensor)
        or a.dtype == b.dtype
        or (b.dtype.is_floating_point and torch.promote_types(a.dtype, b.dtype) == b.dtype)
    ):
        return op.axis
    what = (
        f"{'rounded' if b.dtype.is_floating_point else 'cast'} to "
        f"{str(b.dtype).replace('torch.', '')}"
    )
    return Refusal(f"is {what} {op.where}, which does not commute with centering")


RESHAPE_OPS = {
    "view",
    "reshape",
    "_unsafe_view",
    "view_as",
    "reshape_as",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
}


@rule(*RESHAPE_OPS)
def _reshape(op: Op) -> int | Refusal:
    """A reshape keeps the feature axis whole if some output axis has its size and the same size to
    its right."""
    d, inner = op.in_shape[op.axis], math.prod(op.in_shape[op.axis + 1 :])
    for j, size in enumerate(op.out_shape):
        if size == d and math.prod(op.out_shape[j + 1 :]) == inner:
            return j
    return Refusal(f"is reshaped {op.where} in a way that splits or merges the feature axis")


@rule("permute", "transpose", "t", "numpy_T", "swapaxes", "movedim")
def _permute(op: Op) -> int | Refusal:
    return permutation(op.node, op.ndim).index(op.axis)


def constant_along(node: Any, axis: int) -> bool:
    """Whether an (index) tensor is the same along ``axis``: broadcast or repeated from size 1."""
    dims = shape(node)
    if dims is None or not 0 <= axis < len(dims):
        return False
    if dims[axis] == 1:
        return True
    name = op_name(node)
    inner = node.args[0] if node.op == "call_function" and node.args else None
    in_dims = shape(inner)
    if in_dims is None:
        return False
    if name in ("clone", "contiguous", "_to_copy", "to", "alias", "detach"):
        return constant_along(inner, axis)
    if name in ("expand", "expand_as", "repeat"):
        pos = axis - (len(dims) - len(in_dims))
        return pos < 0 or in_dims[pos] == 1 or (name != "repeat" and constant_along(inner, pos))
    return False


@rule("index")
def _index(op: Op) -> int | Refusal:
    indexed = [i for i, ix in enumerate(arg(op.node, 1, "indices", [])) if ix is not None]
    if (
        op.axis == op.ndim - 1
        and all(i < op.axis for i in indexed)
        and op.out_shape[-1] == op.in_shape[op.axis]
    ):
        return len(op.out_shape) - 1
    return Refusal(f"is indexed {op.where} in a way that enjoyln cannot follow")


# op -> (where its dim or dims argument is, its default, what it does to the feature axis if among
# them)
_ALONG = {
    **dict.fromkeys(("slice", "narrow"), (1, 0, "is cut along the feature axis by {}")),
    **dict.fromkeys(
        ("select", "index_select", "gather"), (1, None, "has its feature axis indexed by {}")
    ),
    **dict.fromkeys(SPLIT_OPS, (2, 0, "is split along the feature axis by {}")),
    "unbind": (1, 0, "is split along the feature axis by {}"),
    **dict.fromkeys(("sum", "mean"), (1, (), "is reduced over the feature axis by {}")),
    **dict.fromkeys(CAT_OPS, (1, 0, "is concatenated along the feature axis")),
}


@rule(*(k for k in _ALONG if k not in CAT_OPS))
def _along(op: Op) -> int | Refusal:
    """Cutting, indexing, splitting, reducing or concatenating along other axes treats every feature
    alike."""
    name = op_name(op.node)
    if name in ("sum", "mean") and not arg(op.node, 1, "dim"):
        return Refusal(f"is reduced over every axis by {name} {op.where}")
    index, default, what = _ALONG[name]
    dims = _dims(op, index, "dim", default)
    if op.axis in dims and not (
        name in ("slice", "narrow") and op.out_shape[op.axis] == op.in_shape[op.axis]
    ):
        return Refusal(f"{what.format(name)} {op.where}")
    if name == "gather" and (
        op.out_shape[op.axis] != op.in_shape[op.axis]
        or not constant_along(op.node.args[2], op.axis)
    ):
        return Refusal(f"is gathered {op.where} with indices that differ between features")
    drops = name in ("select", "unbind") or (
        name in ("sum", "mean") and not arg(op.node, 2, "keepdim", False)
    )
    return op.axis - sum(d < op.axis for d in dims) if drops else op.axis


rule(*CAT_OPS, kind=SUM)(_along)


@rule("constant_pad_nd", "pad")
def _pad(op: Op) -> int | Refusal:
    pad, value = (
        list(op.node.args[1]),
        arg(op.node, 3 if op_name(op.node) == "pad" else 2, "value", 0) or 0,
    )
    padded = {op.ndim - 1 - i // 2 for i, p in enumerate(pad) if p}
    if op.axis in padded:
        return Refusal(f"is padded along the feature axis {op.where}")
    return (
        op.axis
        if not padded or value == 0
        else Refusal(f"is padded with the non-zero value {value} {op.where}")
    )


@rule("stack", kind=SUM)
def _stack(op: Op) -> int | Refusal:
    dim = norm_dim(arg(op.node, 1, "dim", 0), op.ndim + 1)
    return op.axis + (op.axis >= dim)


@rule("expand", "expand_as", "repeat", "tile")
def _broadcast(op: Op) -> int | Refusal:
    """New axes come first; the feature axis keeps its place from the right, and must keep its
    size."""
    new, name = op.axis + len(op.out_shape) - op.ndim, op_name(op.node)
    if op.out_shape[new] == op.in_shape[op.axis]:
        return new
    if name in ("expand", "expand_as", "repeat", "tile"):
        return Refusal(f"is repeated along the feature axis {op.where}")
    return Refusal(f"is broadcast along the feature axis by {name} {op.where}")


rule("add", "sub", "rsub", kind=SUM)(_broadcast)
rule("mul", "div", kind=SCALE)(_broadcast)


# --- splitting the feature axis into blocks (per-head norms) ------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where the blocks of a split feature axis went: ``(..., H, D)`` from ``size`` features leaves
    ``size / D`` ``groups``; ``axes``: (tensor axis, length, stride in blocks); ``offset``: the
    first block still in view."""

    groups: int
    size: int
    axes: tuple[tuple[int, int, int], ...]
    offset: int = 0

    def visible(self) -> frozenset[int]:
        """The blocks this tensor still holds."""
        blocks = {self.offset}
        for _, length, stride in self.axes:
            blocks = {b + i * stride for b in blocks for i in range(length)}
        return frozenset(blocks)


def split_axis(node: fx.Node, src: fx.Node, axis: int) -> tuple[int, Layout] | None:
    """(new feature axis, layout) if ``node`` reshapes ``src``'s ``axis`` into several, the last (a
    block) now it."""
    if op_name(node) not in RESHAPE_OPS:
        return None
    in_shape, out_shape = shape(src), shape(node)
    n, inner, outer = in_shape[axis], math.prod(in_shape[axis + 1 :]), math.prod(in_shape[:axis])
    for q in reversed(range(len(out_shape))):
        if out_shape[q] == 1 or math.prod(out_shape[q + 1 :]) != inner:
            continue
        p, size = q, out_shape[q]
        while size < n and p > 0:
            p -= 1
            size *= out_shape[p]
        if size != n or p == q or math.prod(out_shape[:p]) != outer:
            return None
        axes, stride = [], 1
        for r in range(q - 1, p - 1, -1):
            if out_shape[r] > 1:
                axes.append((r, out_shape[r], stride))
            stride *= out_shape[r]
        return q, Layout(n // out_shape[q], n, tuple(reversed(axes)))
    return None


def carry_layout(node: fx.Node, src: fx.Node, layout: Layout | None, where: str) -> Layout | None:
    """The layout after ``node``: selecting along a block axis narrows the blocks in view; None once
    mixed."""
    if layout is None:
        return None
    name = op_name(node)
    axes, offset = [], layout.offset
    out_shape = shape(node)
    for a, length, stride in layout.axes:
        if (
            name in ("select", "slice", "narrow")
            and norm_dim(arg(node, 1, "dim", 0), len(shape(src))) == a
        ):
            if name == "select":
                index = arg(node, 2, "index")
                offset += (index + length if index < 0 else index) * stride
                continue
            start = arg(node, 2, "start", 0) or 0
            start = max(0, start + length if start < 0 else start)
            if (name == "slice" and arg(node, 4, "step", 1) != 1) or out_shape is None:
                return None
            offset += min(start, length) * stride
            moved, new_length = a, out_shape[a]
        else:
            moved = carry(node, src, a, where)
            if isinstance(moved, Refusal) or out_shape is None or out_shape[moved] != length:
                return None
            new_length = length
        if new_length > 1:
            axes.append((moved, new_length, stride))
    return Layout(layout.groups, layout.size, tuple(axes), offset)


def carry_all(
    node: fx.Node, facts: list[tuple[fx.Node, int, Layout | None]], where: str
) -> tuple[int, Layout | None] | Refusal:
    """Where the feature axes of ``facts`` (input, axis, layout) land in ``node``'s output if all in
    one place, with the layout of the blocks (None unless all agree); else why not. The dataflow
    and the shift passes share it."""
    moved = [carry(node, src, axis, where) for src, axis, _ in facts]
    refused = next((m for m in moved if isinstance(m, Refusal)), None)
    if refused is not None or len(set(moved)) != 1:
        return refused or Refusal(f"adds tensors whose feature axes do not line up {where}")
    layouts = {carry_layout(node, src, layout, where) for src, _, layout in facts}
    return moved[0], layouts.pop() if len(layouts) == 1 else None
