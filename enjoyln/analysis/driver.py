"""The analysis driver: which LayerNorms fold, and what must be centered for them.

It runs three steps over the traced graph to a fixed point and builds the plan:

1. ``rules``: every op is a *source* (a general linear layer or a parameter
   whose output CBWC can make zero-mean), an op that carries a property
   shared by all features along a tracked feature axis, a LayerNorm, an
   explicit centering, or *other*.
2. ``dataflow``: the forward zero-mean dataflow (the paper's Algorithm 1):
   each tensor is either "zero-mean along axis a once these sources are
   centered" or "not zero-mean, because ...". An LN whose input is the former
   is a candidate.
3. ``soundness``: centering a source shifts every value computed from it by
   a per-row constant. That shift must reach nothing but LN inputs, which
   ignore it. Sources whose shift escapes anywhere else are dropped with the
   LNs that need them, until nothing changes.

With ``fuse_affine`` it also plans where each folded norm's affine moves
(``affine``), and on request the rotation of the residual stream
(``rotation``). It can also give each LN's zero-mean graph, which the
auxiliary placement (``auxiliary``) and the pictures (``explain``) use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import fx, nn

from ..errors import CaptureError
from ..modules.norm import GroupRMSNorm, RMSNorm
from ..plan import NOT_ROTATED, TRAINING_MODE, AuxCentering, FoldPlan, LayerNormEntry, Note, RotationSpec, Untie
from .affine import plan_fusion
from .capture import Capture
from .dataflow import Dataflow, NotZero, Zero
from .graph import FUNCTIONAL_LN, GN_OPS, LN_OPS, META_OPS, GraphIndex, arg, op_name, reads_value, shape
from .rotation import plan_rotation
from .rules import DROPOUT_OPS, Source, kind_of
from .soundness import ShiftSoundness, gn_groups

Weights = Mapping[str, torch.Tensor] | None
"""Values of parameters held on the meta device, by name."""


class Analysis:
    """Runs the dataflow and the soundness check over one captured graph."""

    def __init__(self, cap: Capture, aux: dict[fx.Node, AuxCentering] | None = None, *,
                 weights: Weights = None, fuse_affine: bool = False):
        self.cap = cap
        self.fuse_affine = fuse_affine
        self.aux = aux or {}
        self.index = GraphIndex(cap, weights)
        self.graph = cap.graph
        self.flow = Dataflow(self.index, self.aux)
        self.sources: dict[str, Source] = self.flow.sources
        self.states: dict[fx.Node, Any] = self.flow.states
        self.soundness = ShiftSoundness(self.index, self.sources, self.aux)
        self.norms = NormModules(self.index)
        self.last_bad: dict[str, str] = {}  # source -> what its centering would change, last pass
        self.why_not_replaced: dict[str, str] = {}  # entry -> why its module is not a norm enjoyln replaces

    def where(self, node: fx.Node) -> str:
        return self.index.where(node)

    def describe(self, node: fx.Node) -> str:
        return self.index.describe(node)

    def affected(self, active: set[str]) -> tuple[dict[str, str], dict[str, Untie]]:
        return self.soundness.affected(active)

    # -- explaining ------------------------------------------------------------------------

    def zero_mean_graph(self, ln: fx.Node, limit: int = 400) -> tuple[dict[str, dict], list[tuple[str, str]]]:
        """The LN's zero-mean graph (Def. 4.2): carrying ops back to the leaves.

        Returns nodes (name -> {label, kind, detail}) and edges (input, user).
        Kinds: ``ln``, ``op`` (carries the zero mean), ``source`` (centered),
        ``zero`` (zero-mean already) and ``blocked`` (where folding fails).
        """
        with self.index.reporting():
            return self._zero_mean_graph(ln, limit)

    def _zero_mean_graph(self, ln: fx.Node, limit: int) -> tuple[dict[str, dict], list[tuple[str, str]]]:
        nodes: dict[str, dict] = {}
        edges: list[tuple[str, str]] = []
        by_node = {}  # the plain source of a node, or its LayerScale one
        for s in self.sources.values():
            if "#" not in s.key and (s.node not in by_node or s.chain):
                by_node[s.node] = s
        stack = [(ln, None)]
        while stack and len(nodes) < limit:
            node, user = stack.pop()
            self.index.at = node
            if user is not None:
                edges.append((node.name, user))
            if node.name in nodes:
                continue
            state = self.states.get(node)
            source = by_node.get(node)
            if node is ln:
                info = {"label": self.cap.module_path(node) or node.name, "kind": "ln", "detail": ""}
                stack.append((node.args[0], node.name))
            elif isinstance(source, Source) and source.node is node:
                info = {"label": source.label, "kind": "source",
                        "detail": ", ".join(f"{c.param} (axis {c.axis})" for c in source.params)}
            elif node in self.index.centers:
                info = {"label": f"x - mean(x) {self.where(node)}", "kind": "zero", "detail": ""}
            elif isinstance(state, Zero | NotZero) and kind_of(node):
                refused = isinstance(state, NotZero) and not any(
                    isinstance(self.states.get(i), NotZero) for i in node.all_input_nodes)
                info = {"label": f"{op_name(node)} {self.where(node)}", "kind": "blocked" if refused else "op",
                        "detail": state.why if refused else ""}
                if not refused:
                    for i in node.all_input_nodes:
                        if isinstance(self.states.get(i), Zero | NotZero) and shape(i):
                            stack.append((i, node.name))
            else:
                why = state.why if isinstance(state, NotZero) else ""
                info = {"label": self.describe(node), "kind": "blocked", "detail": why}
            nodes[node.name] = info
        return nodes, edges

    def entry_name(self, node: fx.Node, functional: dict[fx.Node, str]) -> tuple[str, str]:
        """(plan entry name, kind) of a norm call: its module's path, or the node's
        name in the user's GraphModule; calls of one module share an entry."""
        path = self.cap.module_path(node)
        if op_name(node) in GN_OPS:
            return path or node.name, "module"
        if isinstance(self.norms.form(node), NormForm):
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
        """The plan: which LNs fold, what to center and untie. Any failure is an AnalysisError."""
        with self.index.reporting():
            return self._run()

    def _run(self) -> FoldPlan:
        self.flow.run()
        entries, needs, rewritable = self._layer_norms()
        # an LN that cannot be replaced needs no centering: drop it before the
        # soundness pass, so its sources do not count against the others
        for name, e in entries.items():
            if e.foldable and name not in rewritable:
                e.foldable, e.reason = False, rewritable_reason(e, self.why_not_replaced.get(name))
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
                e.centered = sorted(cs, key=lambda c: (c.param, c.axis, c.groups, c.blocks or (), c.scale or ""))
        self.needs = needs
        model = self.cap.model
        kinds = {type(self.cap.module_of(calls[0])) for name, calls in self.ln_nodes().items()
                 if entries[name].kind == "module" and entries[name].norm == "layer_norm"}
        plan = FoldPlan(type(model).__name__, list(entries.values()), norm_modules=norm_module_paths(model, kinds))
        if self.fuse_affine and plan.foldable:
            for u in plan_fusion(self.index, plan.layer_norms, self.ln_nodes()):
                untie.setdefault(u.param, u)
        plan.untied = sorted(untie.values(), key=lambda u: u.param) if plan.foldable else []
        if self.cap.model.training and any(op_name(n) in DROPOUT_OPS for n in self.graph.nodes):
            plan.notes.append(Note.of(TRAINING_MODE))
        return plan

    def rotation(self, plan: FoldPlan, spec: RotationSpec) -> None:
        """Add a rotation of the residual stream to ``plan`` (made by ``run`` with
        ``fuse_affine``), or a note saying why the stream cannot be rotated."""
        with self.index.reporting():
            found = plan_rotation(self.index, plan, self.sources, self.needs, self.ln_nodes(), spec)
        if isinstance(found, str):
            plan.rotation = None
            plan.notes.append(Note.of(NOT_ROTATED, found))
        else:
            plan.rotation = found

    def _layer_norms(self) -> tuple[dict[str, LayerNormEntry], dict[str, set[str]], set[str]]:
        """One entry per LN module (all its calls) or per functional call."""
        entries: dict[str, LayerNormEntry] = {}
        needs: dict[str, set[str]] = {}
        rewritable: set[str] = set()
        functional = self._functional_names()
        for node in self.graph.nodes:
            self.index.at = node
            if op_name(node) in GN_OPS:
                self._group_norm_entry(node, entries, needs, rewritable)
                continue
            if op_name(node) not in LN_OPS:
                continue
            name, kind = self.entry_name(node, functional)
            form = self.norms.form(node)
            if kind == "module" or node in functional:
                rewritable.add(name)
            elif isinstance(form, str):
                self.why_not_replaced.setdefault(name, form)
            norm_shape = tuple(int(s) for s in arg(node, 1, "normalized_shape", ()))
            eps = float(arg(node, 4, "eps", 1e-5))
            entry = entries.get(name)
            if entry is None:
                entry = entries[name] = LayerNormEntry(name, kind, True, "", [], norm_shape, eps)
                if isinstance(form, NormForm) and kind == "module":
                    entry.dim, entry.upcast, entry.then = form.dim, form.upcast, form.then
                needs[name] = set()
            if not entry.foldable:
                continue
            x = node.args[0]
            state = self.states.get(x)
            dims = shape(x)
            if isinstance(state, NotZero):
                entry.foldable, entry.reason = False, f"its input {state.why}"
            elif not isinstance(state, Zero) or dims is None:
                entry.foldable, entry.reason = False, "its input cannot be followed through the graph"
            elif math.prod(norm_shape[:-1]) != 1:
                entry.foldable, entry.reason = False, (
                    f"it normalizes over {len(norm_shape)} axes, and weight centering removes "
                    "the mean along one")
            elif state.axis != len(dims) - 1:
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
        x, dims = node.args[0], shape(node.args[0])
        groups = gn_groups(node) if dims else 1
        eps = float(arg(node, 4 if op_name(node) == "group_norm" else 7, "eps", 1e-5))
        entry = entries.get(name)
        if entry is None:
            entry = entries[name] = LayerNormEntry(name, "module", True, "", [], tuple(dims[1:2]) if dims else (),
                                                   eps, "group_norm", groups)
            needs[name] = set()
        if isinstance(module, nn.GroupNorm) and type(module).forward is nn.GroupNorm.forward:
            rewritable.add(name)
        if not entry.foldable:
            return
        state = self.states.get(x)
        spatial = math.prod(dims[2:]) if dims else 0
        if op_name(node) == "instance_norm" or (dims and dims[1] // groups < 2):
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
        elif any(self.sources[k].groups != 1 for k in state.sources):
            entry.foldable, entry.reason = False, "its input is split into blocks of another size before it"
        else:
            needs[name] |= {self.flow.grouped(k, groups) for k in state.sources}

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
                and not isinstance(self.norms.form(n), NormForm)]
        if len(theirs) != len(ours):
            return {}
        return {o: t.name for o, t in zip(ours, theirs)}


# --- which norm modules can be replaced ---------------------------------------------------

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


def _perm(node: fx.Node, rank: int) -> list[int]:
    """The permutation a permute or transpose applies: output axis i is input axis p[i]."""
    if op_name(node) == "permute":
        return [d % rank for d in node.args[1]]
    p = list(range(rank))
    a, b = node.args[1] % rank, node.args[2] % rank
    p[a], p[b] = p[b], p[a]
    return p


def _dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


class NormModules:
    """Decides, from the captured graph, which modules are layer norms enjoyln can replace.

    A module is one when its body, as captured, is exactly one layer norm of its
    input over its own ``weight`` and ``bias`` (either may be None) on every call:
    optionally with the input cast to float32 and the output cast back (an
    upcasting norm), with the normalized axis moved last and back again (a
    channels-first norm), and with child modules applied to the output in turn
    (``LayerNormAct2d``'s activation). The class does not matter; anything else in
    the body is refused with what it is.
    """

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
        order = self.g.order
        return sorted(found, key=order.__getitem__)

    def form(self, node: fx.Node) -> NormForm | str | None:
        """The form of the module whose layer norm ``node`` is, or why it cannot be
        replaced; None at the top level of the model (no module to replace)."""
        path = self.cap.module_path(node)
        if not path:
            return None
        if path not in self._found:
            self._found[path] = self._recognise(path)
        return self._found[path]

    def _recognise(self, path: str) -> NormForm | str:
        from ..modules.centering import CENTERING_MARK

        g, cap = self.g, self.cap
        try:
            module = cap.model.get_submodule(path)
        except AttributeError:
            return "is not a module of the model"
        if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
            return NormForm()
        extra = [k for k, v in [*module._parameters.items(), *module._buffers.items()]
                 if v is not None and k not in ("weight", "bias")]
        if extra:
            return f"holds {path}.{extra[0]}, which an RMSNorm has no place for"
        # an inserted centering (a hook of enjoyln's own) is not part of the body: the swap keeps it
        hooked = set()
        if getattr(module, CENTERING_MARK, None):
            hooked = {n for sub, mean in g.centers.items() for n in (sub, mean)}
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
            return (f"also computes {op_name(rest[0])}" + (f" in {inside}" if inside != path else "")
                    + " besides its layer norm")
        members = set(body)
        for n in body:  # what the module returns: the layer norm's output only
            if n not in results and any(u not in members for u in self._readers(n, hooked)):
                return f"returns the value of {op_name(n)} besides its layer norm's output"
        if len(forms) != 1:
            return "normalizes differently on different calls"
        return forms.pop()

    def _readers(self, node: fx.Node, hooked: set[fx.Node]) -> list[fx.Node]:
        return [u for u in node.users if u in self.g.live and u not in hooked and reads_value(u, node)]

    def _call(self, path: str, module: nn.Module, ln: fx.Node, body: list[fx.Node], hooked: set[fx.Node],
              done: set[fx.Node]) -> tuple[NormForm, set[fx.Node]] | str:
        """One call of the module: its layer norm ``ln``, what wraps it, and the nodes
        others may read: the one the call returns, and copies of its input that change
        nothing (``x.to(torch.float32)`` of a float32 ``x`` is ``x`` itself, so code
        after the module that holds ``x`` reads the copy in the graph)."""
        cap = self.cap
        own = lambda n: isinstance(n, fx.Node) and n.op == "call_function" and cap.module_path(n) == path  # noqa: E731
        inside = lambda n: (isinstance(n, fx.Node) and n.op == "call_function" and n not in hooked  # noqa: E731
                            and within_scope(cap.module_path(n), path))
        done.add(ln)
        # the input, through casts and moves
        pre, x = [], ln.args[0]
        while own(x) and op_name(x) in _CASTS | _MOVES | _COPIES and x not in hooked:
            pre.append(x)
            x = x.args[0]
        if inside(x):
            return f"computes {op_name(x)} {cap.where(x)} before its layer norm"
        dims, in_dtype = shape(x), _dtype(x)
        if dims is None or in_dtype is None:
            return "has an input whose shape enjoyln cannot see"
        # perm[i]: the axis of the module's input that axis i of the current value holds
        rank, perm, upcast = len(dims), list(range(len(dims))), False
        for n in reversed(pre):
            done.add(n)
            if op_name(n) in _MOVES:
                perm = [perm[i] for i in _perm(n, rank)]
            elif op_name(n) in _CASTS:
                if _dtype(n) == torch.float32:
                    upcast = True
                elif _dtype(n) != _dtype(n.args[0]):
                    return f"casts its input to {str(_dtype(n)).replace('torch.', '')}"
        norm_shape = tuple(arg(ln, 1, "normalized_shape", ()))
        axis = perm[-1]
        if len(norm_shape) > 1 and perm != list(range(rank)):
            return "normalizes over several axes of a permuted input"
        for index, leaf in ((2, "weight"), (3, "bias")):
            why = self._own_param(path, module, arg(ln, index, leaf), leaf, own, done)
            if why:
                return why
        # the output, through the same
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
            if len(users) != 1 or not own(users[0]) or op_name(users[0]) not in _CASTS | _MOVES | _COPIES:
                break
            y = users[0]
            done.add(y)
            if op_name(y) in _MOVES:
                perm = [perm[i] for i in _perm(y, rank)]
            elif op_name(y) in _CASTS:
                out_dtype = _dtype(y)
        # an upcasting norm must cast back; any other cast must change nothing
        if out_dtype != in_dtype and (upcast or out_dtype != _dtype(ln)):
            return (f"returns {str(out_dtype).replace('torch.', '')} for an input of "
                    f"{str(in_dtype).replace('torch.', '')}")
        if perm != list(range(rank)):
            return "permutes its input and does not permute it back"
        # child modules the output goes through, in order
        then: list[str] = []
        while True:
            users = self._readers(y, hooked)
            kids = [u for u in users if inside(u)]
            if not kids:
                break
            if len(kids) != len(users):
                return f"passes its layer norm's output to {cap.module_path(kids[0])} and returns it too"
            if any(cap.module_path(u) == path for u in kids):
                return f"computes {op_name(kids[0])} after its layer norm"
            names = {cap.module_path(u)[len(path) + 1:].split(".")[0] for u in kids}
            child = names.pop()
            if names or child in then:
                return "passes its layer norm's output to more than one child module"
            scope = f"{path}.{child}"
            nodes = {n for n in body if within_scope(cap.module_path(n), scope)}
            feeds = {i for n in nodes for i in n.all_input_nodes if i not in nodes and reads_value(n, i)
                     and not (i.op == "placeholder" and (i.name in cap.placeholder_fqn or i.name in cap.constants))}
            if feeds != {y}:
                return f"calls {scope} on more than its layer norm's output"
            outs = [n for n in nodes if any(u not in nodes for u in self._readers(n, hooked))]
            if len(outs) != 1:
                return f"uses more than one result of {scope}"
            then.append(child)
            done.update(nodes)
            y = outs[0]
        same = set()
        for n in reversed(pre):  # ``to`` and ``contiguous`` return their input itself when they change nothing
            if op_name(n) not in _CASTS | {"contiguous"} or _dtype(n) != in_dtype:
                break
            same.add(n)
        dim = -1 if axis == rank - 1 else axis
        return NormForm(dim, upcast, tuple(then)), {y} | same

    def _own_param(self, path: str, module: nn.Module, value: Any, leaf: str, own: Any,
                   done: set[fx.Node]) -> str:
        """'' if the layer norm's ``leaf`` argument is the module's own (both None, or its
        parameter, maybe cast to float32); else why not."""
        mine = getattr(module, leaf, None)
        if value is None:
            return f"leaves its {leaf} {path}.{leaf} unused" if isinstance(mine, torch.Tensor) else ""
        chain = []
        while own(value) and op_name(value) in _CASTS | _COPIES:
            if op_name(value) in _CASTS and _dtype(value) not in (torch.float32, _dtype(value.args[0])):
                return f"casts its {leaf} to {str(_dtype(value)).replace('torch.', '')}"
            chain.append(value)
            value = value.args[0]
        fqn = self.cap.placeholder_fqn.get(value.name) if isinstance(value, fx.Node) else None
        if fqn is None or f"{path}.{leaf}" not in self.cap.aliases.get(fqn, (fqn,)) or not isinstance(mine, torch.Tensor):
            what = self.g.describe(value) if isinstance(value, fx.Node) else repr(value)
            return f"normalizes with {what} as its {leaf}, not its own {leaf}"
        done.update(chain)
        return ""


# --- norm modules ----------------------------------------------------------------------------


def norm_module_paths(model: nn.Module, also: set[type] | frozenset[type] = frozenset()) -> list[str]:
    """Paths of the model's LayerNorm and GroupNorm modules, folded or not, and of every
    module whose class is in ``also`` (norm modules of other classes, which only the
    analysis recognises)."""
    kinds = (nn.LayerNorm, nn.GroupNorm, RMSNorm, GroupRMSNorm)
    return sorted(name for name, m in model.named_modules()
                  if name and (isinstance(m, kinds) or type(m) in also))


def within_scope(path: str, scope: str) -> bool:
    """Whether module path ``path`` is ``scope`` or inside it (every path is inside the top level)."""
    return scope == "" or path == scope or path.startswith(scope + ".")


def rewritable_reason(entry: LayerNormEntry, why: str | None = None) -> str:
    """Why a layer norm call cannot be replaced: its module ``why`` not, or it has none."""
    if why is None:
        return (f"it is a functional layer_norm call (`{entry.name}`) at the top level of the model; enjoyln "
                "replaces norm modules, and functional calls only in a torch.fx.GraphModule")
    return (f"enjoyln cannot replace {entry.name} with an RMSNorm: it {why}; it replaces a module only when "
            "its body is one layer norm of its input over its own weight and bias, and functional calls "
            "only in a torch.fx.GraphModule")


def analyze_capture(cap: Capture, *, weights: Weights = None, fuse_affine: bool = False,
                    rotate: RotationSpec | None = None) -> FoldPlan:
    """Run the analysis on an already captured graph, and plan the ``rotate`` asked for."""
    analysis = Analysis(cap, weights=weights, fuse_affine=fuse_affine or rotate is not None)
    plan = analysis.run()
    if rotate is not None:
        analysis.rotation(plan, rotate)
    return cap.annotate(plan)
