"""The analysis driver: the dataflow and soundness passes to a fixed point into a plan (which
LayerNorms fold, what to center and untie), then affine fusion and rotation when asked; and each
LN's zero-mean graph."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import fx, nn

from ..plan import SERVED, TRAINING_MODE, AuxCentering, FoldPlan, LayerNormEntry, Note, RotationSpec
from .affine import plan_fusion
from .capture import Capture
from .dataflow import Dataflow, NotZero, Zero
from .graph import FUNCTIONAL_LN, GN_OPS, LN_OPS, GraphIndex, arg, op_name, shape
from .norms import NormForm, NormModules, norm_module_paths
from .rotation import plan_rotations
from .rules import DROPOUT_OPS, kind_of
from .sources import Source
from .soundness import ShiftSoundness, gn_groups

Weights = Mapping[str, torch.Tensor] | None
"""Values of parameters held on the meta device, by name."""


class Analysis:
    """Runs the dataflow and the soundness check over one captured graph."""

    def __init__(
        self,
        cap: Capture,
        aux: dict[fx.Node, AuxCentering] | None = None,
        *,
        weights: Weights = None,
        fuse_affine: bool = False,
        exact_outputs: str = SERVED,
    ):
        self.cap = cap
        self.fuse_affine = fuse_affine
        self.index = GraphIndex(cap, weights)
        self.index.free_outputs = exact_outputs == SERVED
        self.graph = cap.graph
        self.flow = Dataflow(self.index, aux)
        self.sources: dict[str, Source] = self.flow.sources
        self.states: dict[fx.Node, Any] = self.flow.states
        self.soundness = ShiftSoundness(
            self.index, self.sources, self.flow.aux, free=exact_outputs == SERVED
        )
        self.norms = NormModules(self.index)
        self.needs: dict[str, set[str]] = {}  # norm -> the sources it needs centered
        self.active: set[str] = set()  # the norms that fold
        self.last_bad: dict[str, str] = {}  # source -> what its centering would change, last pass
        self.why_not_replaced: dict[
            str, str
        ] = {}  # entry -> why its module is not a norm enjoyln replaces

    # -- explaining ------------------------------------------------------------------------
    def zero_mean_graph(
        self, ln: fx.Node, limit: int = 400
    ) -> tuple[dict[str, dict], list[tuple[str, str]]]:
        """The LN's zero-mean graph (Def. 4.2): nodes (name -> {label, kind, detail}) and edges
        (input, user); kinds: ``ln``, ``op``, ``source``, ``zero`` and ``blocked``."""
        with self.index.reporting():
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
                where = self.cap.where(node)
                if node is ln:
                    info = (self.cap.module_path(node) or node.name, "ln", "")
                    stack.append((node.args[0], node.name))
                elif source is not None:
                    info = (
                        source.label,
                        "source",
                        ", ".join(f"{c.param} (axis {c.axis})" for c in source.params),
                    )
                elif node in self.index.centers:
                    info = (f"x - mean(x) {where}", "zero", "")
                elif isinstance(state, Zero | NotZero) and kind_of(node):
                    refused = isinstance(state, NotZero) and not any(
                        isinstance(self.states.get(i), NotZero) for i in node.all_input_nodes
                    )
                    info = (
                        f"{op_name(node)} {where}",
                        "blocked" if refused else "op",
                        state.why if refused else "",
                    )
                    if not refused:
                        stack += [
                            (i, node.name)
                            for i in node.all_input_nodes
                            if isinstance(self.states.get(i), Zero | NotZero) and shape(i)
                        ]
                else:
                    info = (
                        self.index.describe(node),
                        "blocked",
                        state.why if isinstance(state, NotZero) else "",
                    )
                nodes[node.name] = dict(zip(("label", "kind", "detail"), info))
            return nodes, edges

    def entry_name(self, node: fx.Node, functional: dict[fx.Node, str]) -> tuple[str, str]:
        """(plan entry name, kind) of a norm call: its module's path, or the node's name in the
        user's GraphModule."""
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
            self.flow.run()
            entries, needs, rewritable = self._layer_norms()
            # an LN that cannot be replaced needs no centering: drop it before the soundness pass
            for name, e in entries.items():
                if e.foldable and name not in rewritable:
                    e.foldable, e.reason = (
                        False,
                        rewritable_reason(e, self.why_not_replaced.get(name)),
                    )
            active = {name for name, e in entries.items() if e.foldable}
            while True:
                bad, untie = self.soundness.affected(set().union(*(needs[n] for n in active)))
                self.last_bad.update(bad)
                dropped = {n for n in active if needs[n] & bad.keys()}
                for n in dropped:
                    key = sorted(needs[n] & bad.keys())[0]
                    entries[n].foldable = False
                    entries[n].reason = (
                        f"folding it needs {self.sources[key].label} centered, "
                        f"but that would also change {bad[key]}"
                    )
                if not dropped:
                    break
                active -= dropped
            for name, e in entries.items():
                if e.foldable:
                    cs = {c for k in needs[name] for c in self.sources[k].params}
                    e.centered = sorted(
                        cs, key=lambda c: (c.param, c.axis, c.groups, c.blocks or (), c.scale or "")
                    )
            self.needs = needs
            self.active = active
            model = self.cap.model
            kinds = {
                type(self.cap.module_of(calls[0]))
                for name, calls in self.ln_nodes().items()
                if entries[name].kind == "module" and entries[name].norm == "layer_norm"
            }
            plan = FoldPlan(
                type(model).__name__,
                list(entries.values()),
                norm_modules=norm_module_paths(model, kinds),
            )
            if self.fuse_affine and plan.foldable:
                for u in plan_fusion(self.index, plan.layer_norms, self.ln_nodes()):
                    untie.setdefault(u.param, u)
            plan.untied = sorted(untie.values(), key=lambda u: u.param) if plan.foldable else []
            plan.changed_outputs = self.changed_outputs(plan)
            if self.cap.model.training and any(op_name(n) in DROPOUT_OPS for n in self.graph.nodes):
                plan.notes.append(Note.of(TRAINING_MODE))
            return plan

    def changed_outputs(self, plan: FoldPlan) -> list[str]:
        """The outputs not served that ``plan`` changes, as its contract lets it: by centering the
        sources of the norms that fold, and by moving a norm's affine into its readers."""
        found = self.soundness.unserved
        centering = [
            n
            for k in sorted(set().union(*map(self.needs.get, self.active)))
            for n in found.get(k, [])
        ]
        calls = self.ln_nodes()
        moving = [
            n
            for e in plan.affine_moved
            for ln in calls.get(e.name, [])
            for n in self.index.changed_outputs.get(ln, [])
        ]
        return list(dict.fromkeys(centering + moving))

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
            kept = form if isinstance(form, NormForm) and kind == "module" else NormForm()
            entry = entries.setdefault(
                name,
                LayerNormEntry(
                    name,
                    kind,
                    True,
                    "",
                    [],
                    norm_shape,
                    eps,
                    dim=kept.dim,
                    upcast=kept.upcast,
                    then=kept.then,
                ),
            )
            if (
                node not in self.index.live
            ):  # nobody reads it: nothing a fold could change (BLIP-2's pooling)
                needs.setdefault(name, set())
                continue
            if not entry.foldable:
                continue
            state, dims = self.states.get(node.args[0]), shape(node.args[0])
            if isinstance(state, NotZero):
                why = f"its input {state.why}"
            elif not isinstance(state, Zero) or dims is None:
                why = "its input cannot be followed through the graph"
            elif math.prod(norm_shape[:-1]) != 1:
                why = (
                    f"it normalizes over {len(norm_shape)} axes, and weight centering removes "
                    "the mean along one"
                )
            elif state.axis != len(dims) - 1:
                why = (
                    f"its input is zero-mean along axis {state.axis}, not along the axis it "
                    "normalizes"
                )
            else:
                needs.setdefault(name, set()).update(state.sources)
                continue
            entry.foldable, entry.reason = False, why
        return entries, needs, rewritable

    def _group_norm_entry(
        self,
        node: fx.Node,
        entries: dict[str, LayerNormEntry],
        needs: dict[str, set[str]],
        rewritable: set[str],
    ) -> None:
        """GroupNorm (and InstanceNorm) folds with grouped CBWC only where it is exact."""
        module = self.cap.module_of(node)
        name = self.entry_name(node, {})[0]
        x, dims = node.args[0], shape(node.args[0])
        groups = gn_groups(node) if dims else 1
        eps = float(arg(node, 4 if op_name(node) == "group_norm" else 7, "eps", 1e-5))
        entry = entries.setdefault(
            name,
            LayerNormEntry(
                name,
                "module",
                True,
                "",
                [],
                tuple(dims[1:2]) if dims else (),
                eps,
                "group_norm",
                groups,
            ),
        )
        if isinstance(module, nn.GroupNorm) and type(module).forward is nn.GroupNorm.forward:
            rewritable.add(name)
        if not entry.foldable:
            return
        state = self.states.get(x)
        spatial = math.prod(dims[2:]) if dims else 0
        if op_name(node) == "instance_norm" or (dims and dims[1] // groups < 2):
            why = (
                "each of its groups holds one channel, and centering a single channel would zero it"
            )
        elif not isinstance(module, nn.GroupNorm):
            why = "it is not an nn.GroupNorm module enjoyln can replace"
        elif spatial != 1:
            why = (
                f"GroupNorm also averages over the {spatial} positions of each channel; weight "
                "centering "
                "can only remove the group mean at each position, which changes GroupNorm's "
                "output, so no "
                "change of weights folds it exactly"
            )
        elif isinstance(state, NotZero):
            why = f"its input {state.why}"
        elif not isinstance(state, Zero) or state.axis != 1:
            why = "its input is not zero-mean along its channels"
        elif state.whole:
            why = (
                "its input passes an explicit centering of all channels, which leaves each "
                "group's mean"
            )
        elif any(self.sources[k].groups != 1 for k in state.sources):
            why = "its input is split into blocks of another size before it"
        else:
            needs.setdefault(name, set()).update(
                self.flow.grouped(k, groups) for k in state.sources
            )
            return
        entry.foldable, entry.reason = False, why

    def _functional_names(self) -> dict[fx.Node, str]:
        """Functional LN calls -> the user's GraphModule nodes (the k-th exported is the k-th in the
        user's graph)."""
        model = self.cap.model
        if not isinstance(model, fx.GraphModule):
            return {}
        theirs = [
            n for n in model.graph.nodes if n.op == "call_function" and n.target in FUNCTIONAL_LN
        ]
        ours = [
            n
            for n in self.graph.nodes
            if op_name(n) in LN_OPS and not isinstance(self.norms.form(n), NormForm)
        ]
        if len(theirs) != len(ours):
            return {}
        return {o: t.name for o, t in zip(ours, theirs)}


def rewritable_reason(entry: LayerNormEntry, why: str | None = None) -> str:
    """Why a layer norm call cannot be replaced: its module ``why`` not, or it has none."""
    if why is None:
        return (
            f"it is a functional layer_norm call (`{entry.name}`) at the top level of the model; "
            "enjoyln "
            "replaces norm modules, and functional calls only in a torch.fx.GraphModule"
        )
    return (
        f"enjoyln cannot replace {entry.name} with an RMSNorm: it {why}; it replaces a module only "
        "when "
        "its body is one layer norm of its input over its own weight and bias, and functional "
        "calls "
        "only in a torch.fx.GraphModule"
    )


def analyze_capture(
    cap: Capture,
    *,
    weights: Weights = None,
    fuse_affine: bool = False,
    rotate: RotationSpec | None = None,
    exact_outputs: str = SERVED,
) -> FoldPlan:
    """Run the analysis on an already captured graph, and plan the ``rotate`` asked for. The fold
    keeps ``exact_outputs`` exact (``plan.SERVED`` or ``plan.ALL_OUTPUTS``), the rotation and the
    affines it moves ``rotate``'s."""
    exact = rotate.exact_outputs if rotate is not None else exact_outputs
    analysis = Analysis(
        cap,
        weights=weights,
        fuse_affine=fuse_affine or rotate is not None,
        exact_outputs=exact_outputs,
    )
    analysis.index.free_outputs = exact == SERVED
    plan = analysis.run()
    plan.exact_outputs = exact
    if rotate is not None:  # a rotation of each stream, or a note saying why it cannot be
        _plan_rotations(analysis, plan, rotate)
    if cap.patched:
        plan.notes.append(
            Note(
                "traced with transformers' export patches (transformers.exporters), which compute "
                "the model's attention over images of one size in ops torch.export follows"
            )
        )
    if cap.specialized:
        plan.notes.append(
            Note(
                "the proof covers inputs that take the same data-dependent branches as the "
                "example: " + "; ".join(cap.specialized)
            )
        )
    return plan


def _plan_rotations(analysis: Analysis, plan: FoldPlan, rotate: RotationSpec) -> None:
    """Every stream's rotation into ``plan``. With ``keep_mean`` a LayerNorm that does not fold can
    still be on a rotated stream, its affine moved into its readers; it keeps that only where its
    stream rotates."""
    g, calls = analysis.index, analysis.ln_nodes()
    with g.reporting():
        unties = plan_fusion(g, plan.layer_norms, calls, unfolded=True) if rotate.keep_mean else []
        found = plan_rotations(g, plan, analysis.sources, analysis.needs, calls, rotate)
    for e in plan.layer_norms:
        if not e.foldable and e.name not in found.kept:
            e.affine, e.affine_reason, e.fused = "", "", []
    weights = {f.weight for e in plan.layer_norms if e.name in found.kept for f in e.fused}
    if any(u.param in weights for u in unties):
        plan.untied = sorted(
            {
                u.param: u
                for u in [*plan.untied, *unties]
                if u.param in weights or u in plan.untied
            }.values(),
            key=lambda u: u.param,
        )
    plan.rotation = found.rotations[0] if found.rotations else None
    plan.more_rotations = found.rotations[1:]
    plan.changed_outputs = list(dict.fromkeys(analysis.changed_outputs(plan) + found.outputs))
    plan.notes += found.notes
