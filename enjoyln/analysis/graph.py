"""The captured graph, indexed for the analysis passes: op names, shapes and arguments, and the maps
from nodes back to the model (parameters, module paths, output names, explicit centerings)."""

from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import Any, Collection, Iterable, Iterator, Mapping

import torch
from torch import fx

from .capture import Capture
from ..errors import AnalysisError, EnjoylnError, first_line
from ..plan import Centering

LN_OPS = {"layer_norm", "native_layer_norm"}
GN_OPS = {"group_norm", "native_group_norm", "instance_norm"}
# What a user's torch.fx.GraphModule may call a LayerNorm
FUNCTIONAL_LN = {
    torch.nn.functional.layer_norm,
    torch.layer_norm,
    torch.ops.aten.layer_norm.default,
    torch.ops.aten.layer_norm,
}
# Ops that read only the shape, dtype or device of a tensor, never its values.
META_OPS = {
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "size",
    "stride",
    "_assert_tensor_metadata",
    "_assert_scalar",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "rand_like",
    "randn_like",
    "randint_like",
    "_local_scalar_dense",
}
# Ops that read their first argument's values and only the shape or dtype of the second.
TEMPLATE_OPS = {"expand_as", "view_as", "reshape_as", "type_as"}
# Ops that return their input's values unchanged (a cast keeping the dtype).
_COPY_OPS = {"_to_copy", "to", "alias", "clone", "detach", "contiguous", "lift_fresh_copy"}
# Ops through which a weight is still "the parameter", only transposed or cast.
PARAM_VIEW_OPS = {
    "_to_copy",
    "to",
    "detach",
    "alias",
    "contiguous",
    "t",
    "transpose",
    "permute",
    "numpy_T",
}


SERVED_OUTPUTS = {"loss", "past_key_values"}


def served(name: str, names: Iterable[str]) -> bool:
    """Whether output ``name``, one of a model's outputs ``names``, is what the model serves: where
    it has logits, its logits (``logits_per_image`` too), embeddings (CLIP's ``image_embeds``),
    loss and cache; else every output. The hidden states of a tower or a stack beside logits are
    not served.

    >>> served("image_hidden_states", ["logits", "image_hidden_states"]), served("last_hidden_state", ["last_hidden_state"])
    (False, True)
    """  # noqa: E501
    if not any(n.startswith("logits") for n in names):
        return True
    head = name.split(".")[0]
    return (
        head.startswith("logits")
        or head.endswith("embeds")
        or head in SERVED_OUTPUTS
        or name.startswith("buffer:")
    )


"""Outputs a model with logits serves besides its logits and embeddings: what training and
generation read."""


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


SYMBOLIC_BASE = 1 << 40
"""Far above any real width, so that a symbolic size never equals a feature axis's static one."""


def _stand_in(expr: Any) -> int | None:
    """A symbolic size as one integer: its expression with each symbol replaced by a large number of
    its own (``u0`` by one, ``4*u0`` by four times that). Products and equalities of sizes then
    hold as they hold for every value of the symbols, except by a coincidence of the stand-ins,
    which are far apart."""
    import zlib

    try:
        values = {
            sym: SYMBOLIC_BASE + 2 * zlib.crc32(str(sym).encode()) + 1 for sym in expr.free_symbols
        }
        out = expr.xreplace(values)
        # a bare symbol comes back as a Python int, an expression as a sympy Integer
        return int(out) if isinstance(out, int) or getattr(out, "is_Integer", False) else None
    except (AttributeError, TypeError, ValueError):
        return None


def _static(size: Any) -> int | None:
    """A size as an int: a symbolic one (a data-dependent batch, as ``x[mask]`` makes) as its
    stand-in, or None; never ``int()``, which raises on a data-dependent size."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    if node is None or not hasattr(node, "maybe_as_int"):
        return None
    value = node.maybe_as_int()
    return value if value is not None else _stand_in(getattr(node, "expr", None))


def shape(node: Any) -> tuple[int, ...] | None:
    """The shape of a node's tensor value, symbolic sizes as stand-ins; None if it has none."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    dims = tuple(_static(s) for s in val.shape)
    return None if None in dims else dims


def rank(node: Any) -> int | None:
    """The number of dimensions of a node's tensor value, symbolic sizes included (Idefics3's
    images, chosen by a mask, are a data-dependent batch); None if it is not a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """A call's argument by position or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def reads_value(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` reads ``node``'s values, not just its shape, dtype or device."""
    name = op_name(user)
    if name in META_OPS and name != "_local_scalar_dense":  # .item() reads the value
        return False
    if name in TEMPLATE_OPS:
        return bool(user.args) and user.args[0] is node
    return True


def permutation(node: fx.Node, ndim: int) -> list[int]:
    """The axes a permute, transpose, t, numpy_T, swapaxes or movedim takes: output axis i is input
    axis p[i]."""
    name, perm = op_name(node), list(range(ndim))
    if name == "numpy_T":
        return perm[::-1]
    if name == "permute":
        return [norm_dim(d, ndim) for d in node.args[1]]
    if name == "movedim":
        src, dst = (
            [norm_dim(x, ndim) for x in (d if isinstance(d, (list, tuple)) else [d])]
            for d in node.args[1:3]
        )
        perm = [p for p in perm if p not in src]
        for s, d in sorted(zip(src, dst), key=lambda x: x[1]):
            perm.insert(d, s)
    elif ndim >= 2:
        a, b = (
            (0, 1) if name == "t" else (norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim))
        )
        perm[a], perm[b] = perm[b], perm[a]
    return perm


def live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose values reach an output or a mutation through value reads; the rest are dead,
    or read only for their shape (``x.size()``, ``expand_as``'s template)."""
    live: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        schema = getattr(node.target, "_schema", None)
        if (
            node.op == "output"
            or (schema is not None and schema.is_mutable)
            or any(u in live and reads_value(u, node) for u in node.users)
        ):
            live.add(node)
    return live


class GraphIndex:
    """One captured graph and the maps from its nodes back to the model."""

    def __init__(self, cap: Capture, weights: Mapping[str, torch.Tensor] | None = None):
        self.cap = cap
        self.weights = dict(
            weights or {}
        )  # values of parameters the model holds on the meta device
        self.graph = cap.graph
        self.placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        self.placeholder_of: dict[
            str, fx.Node
        ] = {}  # every name of a parameter (tied aliases too) -> its placeholder
        for name, fqn in cap.placeholder_fqn.items():
            node = self.placeholders[name]
            for alias in cap.aliases.get(fqn, (fqn,)):
                if node.users or alias not in self.placeholder_of:
                    self.placeholder_of[alias] = node
        # for a fold or rotation keeping only what the model serves exact: the outputs not served
        # a norm's change reaches
        self.free_outputs = False
        self.changed_outputs: dict[fx.Node, list[str]] = {}
        self.buffers = {
            name: fqn
            for name, fqn in cap.program.graph_signature.inputs_to_buffers.items()
            if name in cap.constants
        }  # placeholder name -> a non-persistent buffer (not saved)
        self.live = live_nodes(self.graph)
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.centers = (
            self._find_centerings()
        )  # explicit ``x - x.mean(axis, keepdim=True)``: sub -> mean
        self.output_names = (
            self._output_names()
        )  # position in the output node's arguments -> its name
        self.at: fx.Node | None = (
            None  # the node a pass is looking at, to name it if the analysis fails
        )

    @contextmanager
    def reporting(self) -> Iterator[None]:
        """Turn any failure inside into an AnalysisError naming the op and its module."""
        try:
            yield
        except EnjoylnError:
            raise
        except Exception as exc:
            first = first_line(exc, "")
            what = (
                f"at {self.describe(self.at)}" if self.at is not None else "before reaching any op"
            )
            raise AnalysisError(
                f"enjoyln could not analyse {type(self.cap.model).__name__} {what}: "
                f"{type(exc).__name__}: {first}"
            ) from exc

    # -- naming ------------------------------------------------------------------------

    def label(self, node: fx.Node) -> str:
        """The module path of a node, or its name at the top level."""
        return self.cap.module_path(node) or node.name

    def describe(self, node: fx.Node) -> str:
        if node.op == "placeholder":
            fqn = self.cap.placeholder_fqn.get(node.name)
            return f"the parameter {fqn}" if fqn else f"the model input `{node.name}`"
        if op_name(node) in LN_OPS:
            return f"the LayerNorm {self.label(node)}"
        return f"{op_name(node)} {self.cap.where(node)}"

    def _output_names(self) -> dict[int, str]:
        from torch.export.graph_signature import OutputKind

        names, k = {}, 0
        for i, spec in enumerate(self.cap.program.graph_signature.output_specs):
            if spec.kind == OutputKind.USER_OUTPUT:
                names[i] = self.cap.output_names[k] if k < len(self.cap.output_names) else str(k)
                k += 1
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                names[i] = f"buffer:{spec.target}"
        return names

    def served(self, name: str) -> bool:
        """Whether output ``name`` is what the model serves (``served``)."""
        return served(name, self.output_names.values())

    def only_unserved(self, node: fx.Node) -> list[str] | None:
        """The outputs ``node``'s values reach if a fold or rotation keeping what is served may
        change them all (each is an output not served, as BLIP-2's pooled image token, a second call
        of the tower's post-norm); None if it reaches anything else."""
        names: list[str] = []
        todo, seen = [node], {node}
        while todo:
            value = todo.pop()
            for user in value.users:
                if user in seen or user not in self.live or not reads_value(user, value):
                    continue
                if user.op == "output":
                    outs = (
                        user.args[0] if isinstance(user.args[0], (list, tuple)) else [user.args[0]]
                    )
                    found = [
                        self.output_names.get(i, str(i)) for i, o in enumerate(outs) if o is value
                    ]
                    if any(self.served(n) for n in found):
                        return None
                    names += [n for n in found if n not in names]
                    continue
                if (
                    getattr(user.target, "_schema", None) is not None
                    and user.target._schema.is_mutable
                ):
                    return None  # a write to a buffer or an input: served
                seen.add(user)
                todo.append(user)
        return names or None

    def writes_back(self, index: int, out: fx.Node) -> bool:
        """Whether output ``index`` stores a buffer's own value back, unchanged (CTRL's
        ``pos_encoding.to(dtype)``)."""
        target = self.output_names.get(index, "").removeprefix("buffer:")
        node = out
        while node.op == "call_function" and op_name(node) in _COPY_OPS and node.args:
            before = node.args[0]
            if (
                not isinstance(before, fx.Node)
                or shape(before) != shape(node)
                or (before.meta["val"].dtype != node.meta["val"].dtype)
            ):
                return False
            node = before
        fqn = self.cap.placeholder_fqn.get(node.name) or self.buffers.get(node.name)
        return node.op == "placeholder" and fqn == target and index in self.output_names

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
        return fqn, tuple(perm[p] for p in permutation(node, len(perm)))

    def value(self, fqn: str) -> torch.Tensor | None:
        """The values of a parameter or buffer, or None where they are not known (meta)."""
        t = self.weights.get(fqn)
        if t is None:
            path, _, leaf = fqn.rpartition(".")
            t = getattr(self.cap.submodule(path), leaf, None)
        return t if isinstance(t, torch.Tensor) and t.device.type != "meta" else None

    def centering(self, user: fx.Node, fqn: str, axis: int) -> Centering:
        """The centering of ``fqn`` along ``axis``, under the name ``user`` reads it by."""
        return Centering(self.cap.use_alias(user, fqn) or fqn, axis)

    def role(self, params: tuple[Centering, ...]) -> frozenset:
        """What a centering does, whatever names it goes by: tensor, axis, groups, blocks, gain."""
        name = lambda p: getattr(self.placeholder_of.get(p), "name", p)  # noqa: E731
        return frozenset(
            (name(c.param), c.axis, c.groups, c.blocks, c.scale and name(c.scale)) for c in params
        )

    def tied_apart(self, alias: str | None, aliases: Collection[str]) -> bool:
        """Whether ``alias`` names the tensor ``aliases`` name on another module, which untying
        gives its own copy (one module under two names is one module)."""
        owner = lambda name: id(self.cap.submodule(name.rpartition(".")[0]))  # noqa: E731
        return (
            alias is not None
            and alias not in aliases
            and owner(alias) not in {owner(a) for a in aliases}
        )

    def nbytes(self, node: fx.Node) -> int:
        val = node.meta.get("val")
        return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0

    def readers(self, node: fx.Node) -> list[fx.Node]:
        """The ops that read a parameter, looking through transposes and casts."""
        return [
            r
            for u in node.users
            for r in (self.readers(u) if op_name(u) in PARAM_VIEW_OPS else [u])
        ]

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
