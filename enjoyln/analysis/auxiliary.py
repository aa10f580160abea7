"""Auxiliary centering: explicit ``x - x.mean(-1)`` inserted where each makes more LNs foldable,
each judged by the full analysis and confirmed by analysing again with the hooks in place."""

from __future__ import annotations

import functools

from torch import fx, nn

from ..errors import CaptureError
from ..modules import centering
from ..plan import SERVED, AuxCentering, FoldPlan, Note, RotationSpec
from .capture import Capture, capture
from .dataflow import NotZero
from .driver import Analysis, Weights, analyze_capture
from .norms import within_scope
from .graph import shape
from .inputs import ExampleInputs


def _candidate_points(
    analysis: Analysis, plan: FoldPlan
) -> dict[fx.Node, tuple[AuxCentering, set[str]]]:
    """Module outputs and inputs on the zero-mean graphs of LNs that do not fold, each with those
    LNs' names."""
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
            if (
                node is not None
                and node is not calls[0]
                and isinstance(analysis.states.get(node), NotZero)
            ):
                coverage.setdefault(node, set()).add(name)
    points: dict[fx.Node, tuple[AuxCentering, set[str]]] = {}
    for node, count in coverage.items():
        analysis.index.at = node
        dims = shape(node)
        if node.op != "call_function" or not dims or dims[-1] not in widths:
            continue
        path = cap.module_path(node)
        outside = [u for u in node.users if not within_scope(cap.module_path(u), path)]
        if path and outside:
            escaping = {
                n
                for n in analysis.graph.nodes
                if within_scope(cap.module_path(n), path)
                and any(not within_scope(cap.module_path(u), path) for u in n.users)
            }
            if escaping == {node}:  # the module returns exactly this tensor
                points[node] = (AuxCentering(path, "output"), count)
                continue
        callees = (
            set()
        )  # for each reader, the outermost module call it sits in that ``node`` does not
        for user in node.users:
            stack = [p for p, _ in (user.meta.get("nn_module_stack") or {}).values()]
            callees.add(next((p for p in stack if p and not within_scope(path, p)), None))
        if len(callees) == 1 and None not in callees:
            points[node] = (AuxCentering(callees.pop(), "input"), count)
    return points


def auxiliary_plan(
    cap: Capture, *, max_candidates: int = 6, weights: Weights = None, exact_outputs: str = SERVED
) -> tuple[FoldPlan, dict[fx.Node, AuxCentering]]:
    """Greedily insert centerings that each make more LNs foldable than they cost: the plan, the
    points by node."""
    base = Analysis(cap, weights=weights, exact_outputs=exact_outputs)
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
            trial = Analysis(
                cap, {**chosen, node: point}, weights=weights, exact_outputs=exact_outputs
            )
            trial_plan = trial.run()
            gain = len(trial_plan.foldable) - len(plan.foldable)
            if gain > 1 and (best is None or gain > best[0]):
                best = (gain, node, point, trial, trial_plan)
            why = trial.last_bad.get(f"aux:{point.module}:{point.where}") if gain <= 1 else None
            if why:
                refused[point.describe()] = (why, covered)
        if best is None:
            break
        gain, node, point, base, plan = best
        chosen[node] = point
    plan.auxiliary = list(chosen.values())
    if chosen:
        plan.notes.append(
            Note(
                f"auxiliary centering: {len(chosen)} inserted, "
                f"{len(plan.foldable) - strict_count} more LNs foldable"
            )
        )
    explained: set[str] = set()
    for what, (why, covered) in refused.items():
        for e in plan.layer_norms:
            if not e.foldable and e.name in covered and e.name not in explained:
                e.reason += f"; {what} would not help, as it would also change {why}"
                explained.add(e.name)
        plan.notes.append(Note(f"{what} was considered but would also change {why}"))
    return plan, chosen


def analyze_with_auxiliary(
    model: nn.Module,
    example_inputs: ExampleInputs,
    weights: Weights,
    fuse_affine: bool = False,
    rotate: RotationSpec | None = None,
    exact_outputs: str = SERVED,
) -> FoldPlan:
    """Choose centerings, then prove the folds again on the model with the centering hooks in place
    (removed again before returning): the second, strict analysis gives the parameters to center."""
    unhooked = capture(model, example_inputs)
    predicted, _ = auxiliary_plan(unhooked, weights=weights, exact_outputs=exact_outputs)
    predicted.exact_outputs = exact_outputs
    again = functools.partial(
        analyze_capture,
        weights=weights,
        fuse_affine=fuse_affine,
        rotate=rotate,
        exact_outputs=exact_outputs,
    )
    if not predicted.auxiliary:
        if fuse_affine or rotate:
            plan = again(unhooked, fuse_affine=True)
            plan.notes = predicted.notes
            return plan
        return predicted
    for a in predicted.auxiliary:
        centering.install(model, a.module, a.where)
    try:
        plan = again(capture(model, example_inputs))
    except CaptureError as exc:  # a hook met an output it cannot center
        plan = FoldPlan(predicted.model)
        plan.notes.append(Note(f"auxiliary centering was not applied: {exc}"))
    finally:
        for a in predicted.auxiliary:
            centering.remove(model, a.module)
    missing = {e.name for e in predicted.foldable} - {e.name for e in plan.foldable}
    if missing:  # the hooks did not land where the graph said: keep the strict result
        strict = again(unhooked)
        strict.notes += plan.notes or [
            Note(
                "auxiliary centering was not applied: the re-analysis could not "
                f"confirm {sorted(missing)[0]}"
            )
        ]
        return strict
    plan.auxiliary = predicted.auxiliary
    plan.notes = predicted.notes + [n for n in plan.notes if n not in predicted.notes]
    reasons = {e.name: e.reason for e in predicted.layer_norms if not e.foldable}
    for e in plan.layer_norms:
        if not e.foldable and e.name in reasons:
            e.reason = reasons[e.name]
    return plan
