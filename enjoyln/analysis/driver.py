"""Analysis: which LayerNorms fold, and what must be centered for them.

The driver of three steps over the traced graph (the README's "How it decides"):

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

This module runs them to a fixed point, builds the plan, explains each LN's
zero-mean graph, and places auxiliary centerings.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from torch import fx, nn

from .capture import Capture, ExampleInputs, capture
from .affine import plan_fusion
from .dataflow import Dataflow, NotZero, State, Zero
from ..errors import CaptureError
from .graph import FUNCTIONAL_LN, GN_OPS, LN_OPS, GraphIndex, arg, op_name, shape
from ..plan import NOT_ROTATED, TRAINING_MODE, AuxCentering, FoldPlan, LayerNormEntry, Note, RotationSpec, Untie
from .rules import DROPOUT_OPS, Refusal, Source, kind_of
from .soundness import ShiftSoundness, gn_groups

Weights = Mapping[str, torch.Tensor] | None
"""Values of parameters held on the meta device, by name."""

__all__ = ["analyze", "analyze_capture", "auxiliary_plan", "norm_module_paths", "op_name", "FUNCTIONAL_LN",
           "Analysis", "Zero", "NotZero", "State", "Source", "Refusal"]


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
        self.last_bad: dict[str, str] = {}  # source -> what its centering would change, last pass

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
                e.centered = sorted(cs, key=lambda c: (c.param, c.axis, c.groups, c.blocks or (), c.scale or ""))
        self.needs = needs
        plan = FoldPlan(type(self.cap.model).__name__, list(entries.values()),
                        norm_modules=norm_module_paths(self.cap.model))
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
        from .rotation import plan_rotation

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
            if kind == "module" or node in functional:
                rewritable.add(name)
            norm_shape = tuple(int(s) for s in arg(node, 1, "normalized_shape", ()))
            eps = float(arg(node, 4, "eps", 1e-5))
            entry = entries.get(name)
            if entry is None:
                entry = entries[name] = LayerNormEntry(name, kind, True, "", [], norm_shape, eps)
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
                and not isinstance(self.cap.module_of(n), nn.LayerNorm)]
        if len(theirs) != len(ours):
            return {}
        return {o: t.name for o, t in zip(ours, theirs)}


# --- auxiliary centering --------------------------------------------------------------------


def norm_module_paths(model: nn.Module) -> list[str]:
    """Paths of the model's LayerNorm and GroupNorm modules, folded or not."""
    from ..modules.norm import GroupRMSNorm, RMSNorm

    kinds = (nn.LayerNorm, nn.GroupNorm, RMSNorm, GroupRMSNorm)
    return sorted(name for name, m in model.named_modules() if name and isinstance(m, kinds))


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
        analysis.index.at = node
        dims = shape(node)
        if node.op != "call_function" or not dims or dims[-1] not in widths:
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


def auxiliary_plan(cap: Capture, *, max_candidates: int = 6,
                   weights: Weights = None) -> tuple[FoldPlan, dict[fx.Node, AuxCentering]]:
    """Greedily insert centerings that each make more LNs foldable than they cost.

    Each candidate is judged by the full analysis, soundness included, with
    the inserted centering as one more source whose shift must only reach LN
    inputs. Returns the plan with the chosen points, and the points by node.
    """
    base = Analysis(cap, weights=weights)
    plan = base.run()
    strict_count = len(plan.foldable)
    chosen: dict[fx.Node, AuxCentering] = {}
    refused: dict[str, tuple[str, set[str]]] = {}
    while True:
        with base.index.reporting():
            points = _candidate_points(base, plan)
        ranked = sorted(points.items(), key=lambda kv: -len(kv[1][1]))[:max_candidates]
        best = None
        for node, (point, covered) in ranked:
            if node in chosen:
                continue
            trial = Analysis(cap, {**chosen, node: point}, weights=weights)
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
        plan.notes.append(Note(f"auxiliary centering: {len(chosen)} inserted, "
                               f"{len(plan.foldable) - strict_count} more LNs foldable"))
    explained: set[str] = set()
    for what, (why, covered) in refused.items():
        for e in plan.layer_norms:
            if not e.foldable and e.name in covered and e.name not in explained:
                e.reason += f"; {what} would not help, as it would also change {why}"
                explained.add(e.name)
        plan.notes.append(Note(f"{what} was considered but would also change {why}"))
    return plan, chosen


def rewritable_reason(entry: LayerNormEntry) -> str:
    return (f"it is a functional layer_norm call in {entry.name}, not a plain nn.LayerNorm; enjoyln "
            "replaces nn.LayerNorm modules, and functional calls only in a torch.fx.GraphModule")


def analyze_capture(cap: Capture, *, weights: Weights = None, fuse_affine: bool = False,
                    rotate: RotationSpec | None = None) -> FoldPlan:
    """Run the analysis on an already captured graph, and plan the ``rotate`` asked for."""
    analysis = Analysis(cap, weights=weights, fuse_affine=fuse_affine or rotate is not None)
    plan = analysis.run()
    if rotate is not None:
        analysis.rotation(plan, rotate)
    return cap.annotate(plan)


def analyze(model: nn.Module, example_inputs: ExampleInputs = None, *,
            auxiliary_centering: bool = False, weights: Weights = None, fuse_affine: bool = False,
            rotate: RotationSpec | tuple[str, int, bool] | None = None) -> FoldPlan:
    """Find the foldable LayerNorms of ``model`` and what folding them needs.

    A dry run: the model is traced, never modified. With
    ``auxiliary_centering``, explicit centerings are also placed where each
    makes more LNs foldable than it costs (``plan.auxiliary``). ``weights``
    gives values for parameters the model holds on the meta device, where a
    rule depends on them (a LayerScale gain with a zero entry does not fold).
    With ``fuse_affine``, each folded norm's γ and β are also moved into the
    linear layers that read its output, where that is sound (``enjoyln.affine``).
    With ``rotate`` (a ``RotationSpec``, or (kind, seed, keep_mean)), the plan also rotates the residual
    stream where that is proved exact (``enjoyln.rotation``), or says why not.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> analyze(net, torch.randn(2, 8)).foldable[0].name
    '1'
    """
    rotate = RotationSpec.of(rotate)
    if not auxiliary_centering:
        return analyze_capture(capture(model, example_inputs), weights=weights, fuse_affine=fuse_affine,
                               rotate=rotate)
    return _analyze_with_auxiliary(model, example_inputs, weights, fuse_affine, rotate)


def _analyze_with_auxiliary(model: nn.Module, example_inputs: ExampleInputs, weights: Weights,
                            fuse_affine: bool = False, rotate: RotationSpec | None = None) -> FoldPlan:
    """Choose centerings, then prove the folds again on the model with them in place.

    The first pass proves each inserted centering changes only LN inputs; the
    second, a strict analysis of the model with the centering hooks installed,
    gives the parameters to center and confirms every predicted fold. The
    hooks are removed again before returning.
    """
    from ..modules import centering

    unhooked = capture(model, example_inputs)
    predicted, _ = auxiliary_plan(unhooked, weights=weights)
    if not predicted.auxiliary:
        if fuse_affine or rotate:
            plan = analyze_capture(unhooked, weights=weights, fuse_affine=True, rotate=rotate)
            plan.notes = predicted.notes
            return plan
        return predicted
    for a in predicted.auxiliary:
        centering.install(model, a.module, a.where)
    try:
        plan = analyze_capture(capture(model, example_inputs), weights=weights, fuse_affine=fuse_affine,
                               rotate=rotate)
    except CaptureError as exc:  # a hook met an output it cannot center
        plan = FoldPlan(predicted.model)
        plan.notes.append(Note(f"auxiliary centering was not applied: {exc}"))
    finally:
        for a in predicted.auxiliary:
            centering.remove(model, a.module)
    missing = {e.name for e in predicted.foldable} - {e.name for e in plan.foldable}
    if missing:  # the hooks did not land where the graph said: keep the strict result
        strict = analyze_capture(unhooked, weights=weights, fuse_affine=fuse_affine, rotate=rotate)
        strict.notes += plan.notes or [Note("auxiliary centering was not applied: the re-analysis could not "
                                            f"confirm {sorted(missing)[0]}")]
        return strict
    plan.auxiliary = predicted.auxiliary
    plan.notes = predicted.notes + [n for n in plan.notes if n not in predicted.notes]
    reasons = {e.name: e.reason for e in predicted.layer_norms if not e.foldable}
    for e in plan.layer_norms:
        if not e.foldable and e.name in reasons:
            e.reason = reasons[e.name]
    return plan
