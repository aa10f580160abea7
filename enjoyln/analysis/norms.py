"""Which modules are layer norms enjoyln can replace: decided from the captured graph of each
module's body (``NormModules``), and where a model's norm modules are (``norm_module_paths``)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile
from typing import Any

import torch
from torch import fx, nn

from ..modules.norm import GroupRMSNorm, RMSNorm
from .graph import LN_OPS, META_OPS, GraphIndex, arg, op_name, permutation, reads_value, shape


# Ops a norm module may wrap its layer norm in: casts and layout moves, undone again
_CASTS = {"_to_copy", "to"}
_MOVES = {"permute", "transpose"}
_COPIES = {"contiguous", "clone", "alias", "detach"}


@dataclass(frozen=True)
class NormForm:
    """What a module's captured body does around its one layer norm (see ``LayerNormEntry``)."""

    dim: int = -1
    upcast: bool = False
    then: tuple[str, ...] = ()


def _dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


class NormModules:
    """Which modules are layer norms enjoyln can replace, whatever the class: a body that is one
    layer norm of the input over the module's own ``weight`` and ``bias``, maybe upcast and back,
    moved channels-last and back, or followed by child modules (``LayerNormAct2d``'s activation).
    Anything else is refused with what it is."""

    def __init__(self, g: GraphIndex):
        self.g = g
        self.cap = g.cap
        self._found: dict[str, NormForm | str] = {}
        self._by_path: dict[str, list[fx.Node]] | None = None

    def _scope(self, path: str) -> list[fx.Node]:
        """The live value-computing calls in ``path`` and its children, in graph order."""
        if self._by_path is None:
            self._by_path = {}
            for n in self.g.graph.nodes:
                if n.op == "call_function" and n in self.g.live and op_name(n) not in META_OPS:
                    self._by_path.setdefault(self.cap.module_path(n), []).append(n)
        found = [n for p, nodes in self._by_path.items() if within_scope(p, path) for n in nodes]
        return sorted(found, key=self.g.order.__getitem__)

    def form(self, node: fx.Node) -> NormForm | str | None:
        """The form of the module whose layer norm ``node`` is, or why it cannot be replaced; None
        at the top level."""
        path = self.cap.module_path(node)
        if not path:
            return None
        if path not in self._found:
            self._found[path] = self._recognise(path)
        return self._found[path]

    def _recognise(self, path: str) -> NormForm | str:
        from ..modules.centering import CENTERING_MARK

        g, cap = self.g, self.cap
        module = cap.submodule(path)
        if module is None:
            return "is not a module of the model"
        if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
            return NormForm()
        extra = [
            k
            for k, v in [*module._parameters.items(), *module._buffers.items()]
            if v is not None and k not in ("weight", "bias")
        ]
        if extra:
            return f"holds {path}.{extra[0]}, which an RMSNorm has no place for"
        # an inserted centering (a hook of enjoyln's own) is not part of the body: the swap keeps it
        hooked = (
            {n for sub, mean in g.centers.items() for n in (sub, mean)}
            if getattr(module, CENTERING_MARK, None)
            else set()
        )
        body = [n for n in self._scope(path) if n not in hooked]
        done: set[fx.Node] = set()
        forms, results = set(), set()
        for ln in (n for n in body if op_name(n) in LN_OPS and cap.module_path(n) == path):
            found = self._call(path, module, ln, body, hooked, done)
            if isinstance(found, str):
                return found
            forms.add(found[0])
            results |= found[1]
        rest = [n for n in body if n not in done]
        if rest:
            inside = cap.module_path(rest[0])
            return (
                f"also computes {op_name(rest[0])}"
                + (f" in {inside}" if inside != path else "")
                + " besides its layer norm"
            )
        members = set(body)
        for n in body:  # what the module returns: the layer norm's output only
            if n not in results and any(u not in members for u in self._readers(n, hooked)):
                return f"returns the value of {op_name(n)} besides its layer norm's output"
        if len(forms) != 1:
            return "normalizes differently on different calls"
        return forms.pop()

    def _readers(self, node: fx.Node, hooked: set[fx.Node]) -> list[fx.Node]:
        return [
            u for u in node.users if u in self.g.live and u not in hooked and reads_value(u, node)
        ]

    def _own(self, n: Any, path: str) -> bool:
        return (
            isinstance(n, fx.Node) and n.op == "call_function" and self.cap.module_path(n) == path
        )

    def _inside(self, n: Any, path: str, hooked: set[fx.Node]) -> bool:
        return (
            isinstance(n, fx.Node)
            and n.op == "call_function"
            and n not in hooked
            and within_scope(self.cap.module_path(n), path)
        )

    def _call(
        self,
        path: str,
        module: nn.Module,
        ln: fx.Node,
        body: list[fx.Node],
        hooked: set[fx.Node],
        done: set[fx.Node],
    ) -> tuple[NormForm, set[fx.Node]] | str:
        """One call of the module: its form, and the nodes others may read: the one the call
        returns, and copies of its input that change nothing (``x.to(torch.float32)`` of a
        float32 ``x`` is ``x``)."""
        done.add(ln)
        entry = self._input(path, ln, hooked, done)
        if isinstance(entry, str):
            return entry
        pre, in_dtype, perm, upcast = entry
        rank, axis = len(perm), perm[-1]
        if len(tuple(arg(ln, 1, "normalized_shape", ()))) > 1 and perm != list(range(rank)):
            return "normalizes over several axes of a permuted input"
        for index, leaf in ((2, "weight"), (3, "bias")):
            why = self._own_param(path, module, arg(ln, index, leaf), leaf, done)
            if why:
                return why
        out = self._output(path, ln, hooked, perm, done)
        if isinstance(out, str):
            return out
        y, out_dtype, perm = out
        # an upcasting norm must cast back; any other cast must change nothing
        if out_dtype != in_dtype and (upcast or out_dtype != _dtype(ln)):
            return (
                f"returns {str(out_dtype).replace('torch.', '')} for an input of "
                f"{str(in_dtype).replace('torch.', '')}"
            )
        if perm != list(range(rank)):
            return "permutes its input and does not permute it back"
        children = self._children(path, y, body, hooked, done)
        if isinstance(children, str):
            return children
        then, y = children
        # ``to`` and ``contiguous`` return their input itself when they change nothing
        same = takewhile(
            lambda n: op_name(n) in _CASTS | {"contiguous"} and _dtype(n) == in_dtype, reversed(pre)
        )
        return NormForm(-1 if axis == rank - 1 else axis, upcast, tuple(then)), {y, *same}

    def _input(
        self, path: str, ln: fx.Node, hooked: set[fx.Node], done: set[fx.Node]
    ) -> tuple[list[fx.Node], torch.dtype, list[int], bool] | str:
        """The casts and moves between the module's input and ``ln``, the input's dtype, the
        permutation (``perm[i]``:
        the input axis that axis i of the layer norm's input holds), and whether the input is upcast
        to float32."""
        pre, x = [], ln.args[0]
        while self._own(x, path) and op_name(x) in _CASTS | _MOVES | _COPIES and x not in hooked:
            pre.append(x)
            x = x.args[0]
        if self._inside(x, path, hooked):
            return f"computes {op_name(x)} {self.cap.where(x)} before its layer norm"
        dims, in_dtype = shape(x), _dtype(x)
        if dims is None or in_dtype is None:
            return "has an input whose shape enjoyln cannot see"
        rank, perm, upcast = len(dims), list(range(len(dims))), False
        for n in reversed(pre):
            done.add(n)
            if op_name(n) in _MOVES:
                perm = [perm[i] for i in permutation(n, rank)]
            elif op_name(n) in _CASTS:
                if _dtype(n) == torch.float32:
                    upcast = True
                elif _dtype(n) != _dtype(n.args[0]):
                    return f"casts its input to {str(_dtype(n)).replace('torch.', '')}"
        return pre, in_dtype, perm, upcast

    def _output(
        self, path: str, ln: fx.Node, hooked: set[fx.Node], perm: list[int], done: set[fx.Node]
    ) -> tuple[fx.Node, torch.dtype | None, list[int]] | str:
        """The layer norm's output through the casts and moves after it: (the last, its dtype, the
        permutation)."""
        y = ln
        if op_name(ln) == "native_layer_norm":
            outs = self._readers(ln, hooked)
            if len(outs) != 1 or op_name(outs[0]) != "getitem" or outs[0].args[1] != 0:
                return "uses the mean or deviation its layer norm computes"
            y = outs[0]
            done.add(y)
        out_dtype = _dtype(y)
        while True:
            users = self._readers(y, hooked)
            if (
                len(users) != 1
                or not self._own(users[0], path)
                or op_name(users[0]) not in _CASTS | _MOVES | _COPIES
            ):
                return y, out_dtype, perm
            y = users[0]
            done.add(y)
            if op_name(y) in _MOVES:
                perm = [perm[i] for i in permutation(y, len(perm))]
            elif op_name(y) in _CASTS:
                out_dtype = _dtype(y)

    def _children(
        self, path: str, y: fx.Node, body: list[fx.Node], hooked: set[fx.Node], done: set[fx.Node]
    ) -> tuple[list[str], fx.Node] | str:
        """The child modules the output goes through, in order, and what the last one returns."""
        cap, then = self.cap, []
        while True:
            users = self._readers(y, hooked)
            kids = [u for u in users if self._inside(u, path, hooked)]
            if not kids:
                return then, y
            if len(kids) != len(users):
                return (
                    f"passes its layer norm's output to {cap.module_path(kids[0])} and returns "
                    "it too"
                )
            if any(cap.module_path(u) == path for u in kids):
                return f"computes {op_name(kids[0])} after its layer norm"
            names = {cap.module_path(u)[len(path) + 1 :].split(".")[0] for u in kids}
            child = names.pop()
            if names or child in then:
                return "passes its layer norm's output to more than one child module"
            scope = f"{path}.{child}"
            nodes = {n for n in body if within_scope(cap.module_path(n), scope)}
            feeds = {
                i
                for n in nodes
                for i in n.all_input_nodes
                if i not in nodes
                and reads_value(n, i)
                and not (
                    i.op == "placeholder"
                    and (i.name in cap.placeholder_fqn or i.name in cap.constants)
                )
            }
            if feeds != {y}:
                return f"calls {scope} on more than its layer norm's output"
            outs = [n for n in nodes if any(u not in nodes for u in self._readers(n, hooked))]
            if len(outs) != 1:
                return f"uses more than one result of {scope}"
            then.append(child)
            done.update(nodes)
            y = outs[0]

    def _own_param(
        self, path: str, module: nn.Module, value: Any, leaf: str, done: set[fx.Node]
    ) -> str:
        """'' if the ``leaf`` argument is the module's own (both None, or its parameter, maybe
        upcast); else why not."""
        mine = getattr(module, leaf, None)
        if value is None:
            return (
                f"leaves its {leaf} {path}.{leaf} unused" if isinstance(mine, torch.Tensor) else ""
            )
        chain = []
        while self._own(value, path) and op_name(value) in _CASTS | _COPIES:
            if op_name(value) in _CASTS and _dtype(value) not in (
                torch.float32,
                _dtype(value.args[0]),
            ):
                return f"casts its {leaf} to {str(_dtype(value)).replace('torch.', '')}"
            chain.append(value)
            value = value.args[0]
        fqn = self.cap.placeholder_fqn.get(value.name) if isinstance(value, fx.Node) else None
        own = fqn is not None and f"{path}.{leaf}" in self.cap.aliases.get(fqn, (fqn,))
        if not own or not isinstance(mine, torch.Tensor):
            what = self.g.describe(value) if isinstance(value, fx.Node) else repr(value)
            return f"normalizes with {what} as its {leaf}, not its own {leaf}"
        done.update(chain)
        return ""


def norm_module_paths(
    model: nn.Module, also: set[type] | frozenset[type] = frozenset()
) -> list[str]:
    """Paths of the model's LayerNorm and GroupNorm modules, folded or not, and of every module
    whose class is in ``also`` (norm modules of other classes, which only the analysis
    recognises)."""
    kinds = (nn.LayerNorm, nn.GroupNorm, RMSNorm, GroupRMSNorm)
    return sorted(
        name
        for name, m in model.named_modules()
        if name and (isinstance(m, kinds) or type(m) in also)
    )


def within_scope(path: str, scope: str) -> bool:
    """Whether module path ``path`` is ``scope`` or inside it (every path is inside the top
    level)."""
    return scope == "" or path == scope or path.startswith(scope + ".")
