"""Fusing the affine: move a folded norm's γ and β into the linear layers that read it
(``W (γ ⊙ r + β) + c = (W diag γ) r + (W β + c)``), leaving a weightless RMSNorm;
docs/how-it-works.md."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import fx

from .graph import GraphIndex, arg, norm_dim, op_name, reads_value, shape
from ..plan import AFFINE_FUSED, AFFINE_GAIN, AFFINE_KEPT, Fused, LayerNormEntry, Untie
from .rules import CAST_OPS, CAT_OPS, DROPOUT_OPS, RESHAPE_OPS, SPLIT_OPS, Refusal, carry
from .sources import LINEAR_LAYOUTS, other_reads

# ops that only move values around, so every element still carries its own feature's γ and β; a
# mean over other axes than the features too (the mean of γ ⊙ r + β is γ ⊙ mean(r) + β; a sum would
# scale β), which ``carry`` refuses over the features
MOVES = (
    {
        "mean",
        "getitem",
        "clone",
        "contiguous",
        "alias",
        "detach",
        "lift_fresh_copy",
        "permute",
        "transpose",
        "t",
        "numpy_T",
        "swapaxes",
        "movedim",
        "select",
        "slice",
        "narrow",
        "index",
        "index_select",
        "gather",
        "expand",
        "expand_as",
        "repeat",
        "flip",
        "roll",
    }
    | DROPOUT_OPS
    | CAST_OPS
    | RESHAPE_OPS
    | SPLIT_OPS
)

Segments = tuple[tuple[int, int, int], ...]
"""Blocks of the feature axis that hold the norm's output: (start, length, offset in the norm)."""


@dataclass(frozen=True)
class Trace:
    """The norm's output as it reaches a value: its feature axis, and where along it."""

    axis: int
    segments: Segments


def linear_reader(
    g: GraphIndex, node: fx.Node, value: fx.Node, trace: Trace
) -> list[Fused] | str | None:
    """The Fused entries if ``node`` is a linear layer reading ``value`` as input, why not if it
    reads it otherwise."""
    name = op_name(node)
    if name not in ("linear", "addmm", "mm", "matmul"):
        return None
    w_index, b_index, w_axis = LINEAR_LAYOUTS[name][:3]
    x, w, in_pos = (
        node.args[1 if name == "addmm" else 0],
        node.args[w_index],
        1 if w_axis == 0 else 0,
    )
    b = arg(node, b_index, "bias") if b_index is not None else None
    if name == "addmm" and (arg(node, 3, "beta", 1) != 1 or arg(node, 4, "alpha", 1) != 1):
        return f"is read by {g.describe(node)}, which scales its product or its bias"
    where = g.describe(node)
    if x is not value:
        return f"is read by {where} as its weight or bias"
    dims, wdims = shape(x), shape(w)
    if dims is None or wdims is None or len(wdims) != 2 or trace.axis != len(dims) - 1:
        return f"is read by {where} along an axis it does not contract"
    weight = g.param(w)
    if weight is None:
        return f"is read by {where}, whose weight is not a parameter"
    bias = None
    if b is not None:
        found = g.param(b)
        if found is None:
            return f"is read by {where}, whose bias is not a parameter"
        bias = g.cap.use_alias(node, found[0]) or found[0]
    fqn, perm = weight
    alias = g.cap.use_alias(node, fqn) or fqn
    return [
        Fused(alias, perm[in_pos], start, length, offset, bias)
        for start, length, offset in trace.segments
    ]


def _merged(node: fx.Node, src: fx.Node, trace: Trace) -> Trace | None:
    """``trace`` after a reshape that lays ``k`` consecutive rows of features side by side (a merger
    of 4 tokens, a pixel shuffle): reshapes are row-major, so feature ``i`` of row ``t`` lands at
    ``(t % k) d + i``, and the norm's blocks repeat ``k`` times. None for any other reshape."""
    dims, out = shape(src), shape(node)
    if dims is None or out is None or not dims or not out or trace.axis != len(dims) - 1:
        return None
    d, wide = dims[-1], out[-1]
    if not isinstance(d, int) or not isinstance(wide, int) or wide <= d or wide % d:
        return None
    return Trace(
        len(out) - 1,
        tuple((s + j * d, n, o) for j in range(wide // d) for s, n, o in trace.segments),
    )


def _move(node: fx.Node, src: fx.Node, trace: Trace, where: str) -> Trace | Refusal:
    """``trace`` after an op that moves values: the feature axis carried, or cut."""
    name = op_name(node)
    if name in RESHAPE_OPS and (merged := _merged(node, src, trace)) is not None:
        return merged
    if (
        name in ("slice", "narrow")
        and norm_dim(arg(node, 1, "dim", 0), len(shape(src))) == trace.axis
    ):
        start = arg(node, 2, "start", 0) or 0
        start = max(0, start + shape(src)[trace.axis] if start < 0 else start)
        length = shape(node)[trace.axis]
        if name == "slice" and arg(node, 4, "step", 1) != 1:
            return Refusal(f"is cut with a step along its features by {name} {where}")
        kept = tuple(
            (
                max(s, start) - start,
                min(s + n, start + length) - max(s, start),
                o + max(s, start) - s,
            )
            for s, n, o in trace.segments
            if min(s + n, start + length) > max(s, start)
        )
        return Trace(trace.axis, kept)
    new = carry(node, src, trace.axis, where)
    return new if isinstance(new, Refusal) else replace(trace, axis=new)


def _cat(node: fx.Node, traces: dict[fx.Node, Trace], where: str) -> Trace | Refusal:
    """A cat along the features moves the norm's blocks; along another axis only the norm's output
    may be in it."""
    parts = list(node.args[0])
    dims = shape(node)
    if dims is None:
        return Refusal(f"passes through {op_name(node)} {where}, whose shapes are unknown")
    dim = norm_dim(arg(node, 1, "dim", 0), len(dims))
    axes = {traces[p].axis for p in parts if p in traces}
    if len(axes) != 1:
        return Refusal(f"is concatenated {where} with its features on different axes")
    axis = axes.pop()
    if dim != axis:
        if any(p not in traces for p in parts) or len({traces[p].segments for p in parts}) != 1:
            return Refusal(f"is concatenated {where} with other values")
        return traces[parts[0]]
    segments, at = [], 0
    for p in parts:
        if p in traces:
            segments += [(s + at, n, o) for s, n, o in traces[p].segments]
        at += shape(p)[dim]
    return Trace(axis, tuple(segments))


Readers = dict[fx.Node, list[Fused]]
"""The linear layers that read a norm's output, each with the blocks of its input that do."""


def trace_readers(g: GraphIndex, ln: fx.Node) -> Readers | str:
    """The linear layers that read one norm call's output (with the blocks of their input), or why
    its affine stays."""
    dims = shape(ln.args[0])
    if dims is None:
        return "its input's shape is not known"
    outs = (
        [u for u in ln.users if op_name(u) == "getitem" and u.args[1] == 0]
        if op_name(ln) == "native_layer_norm"
        else [ln]
    )
    traces = {out: Trace(len(dims) - 1, ((0, dims[-1], 0),)) for out in outs}
    readers: Readers = {}
    for node in g.graph.nodes:
        g.at = node
        hits = [i for i in node.all_input_nodes if i in traces and reads_value(node, i)]
        if not hits or node not in g.live:
            continue  # nothing of the norm's output, or nothing the model computes
        if node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            names = [g.output_names.get(i, str(i)) for i, o in enumerate(outs) if o in hits]
            if g.free_outputs and names and not any(g.served(n) for n in names):
                g.changed_outputs.setdefault(ln, []).extend(
                    names
                )  # a hidden state the contract lets change
                continue
            return f"its output is the model output `{names[0] if names else '?'}`"
        where, name = g.cap.where(node), op_name(node)
        if len(hits) == 1:
            found = linear_reader(g, node, hits[0], traces[hits[0]])
            if isinstance(found, str):
                return f"its output {found}"
            if found is not None:
                readers[node] = [f for f in found if f.length > 0]
                continue
        if name in CAT_OPS:
            new = _cat(node, traces, where)
        elif name in MOVES and len(hits) == 1 and node.args and node.args[0] is hits[0]:
            new = _move(node, hits[0], traces[hits[0]], where)
        elif g.free_outputs and (unserved := g.only_unserved(node)) is not None:
            # whatever it computes, only outputs the contract lets change read it
            g.changed_outputs.setdefault(ln, []).extend(unserved)
            continue
        else:
            return f"its output reaches {g.describe(node)}"
        if isinstance(new, Refusal):
            return f"its output {new}"
        traces[node] = new
    return readers


def plan_fusion(
    g: GraphIndex,
    entries: list[LayerNormEntry],
    calls: dict[str, list[fx.Node]],
    *,
    unfolded: bool = False,
) -> list[Untie]:
    """Decide, for every folded norm (``unfolded``: every norm that stays a LayerNorm, for a
    rotation), where its γ and β go (``entry.affine`` and ``entry.fused``); return the weights
    that must be untied for it. A weight takes a norm's affine only if every value read of it is
    one of that norm's readers (a tied alias of another module gets a copy)."""
    found: dict[str, tuple[list[Fused], Readers]] = {}
    for e in entries:
        if e.foldable == unfolded or e.norm != "layer_norm":
            continue
        if e.kind != "module":
            e.affine, e.affine_reason = (
                AFFINE_KEPT,
                "it is a functional layer_norm, whose affine enjoyln keeps",
            )
            continue
        elsewhere = _affine_read_elsewhere(g, e.name, calls.get(e.name, []))
        if elsewhere:
            e.affine, e.affine_reason = AFFINE_KEPT, elsewhere
            continue
        fused: list[Fused] = []
        readers: Readers = {}
        for ln in calls.get(e.name, []):
            result = trace_readers(g, ln)
            if isinstance(result, str):
                e.affine, e.affine_reason = AFFINE_KEPT, result
                break
            for node, parts in result.items():
                # a layer read twice (another call, or another path to it) takes the affine once
                fused += [f for f in parts if f not in fused]
                readers.setdefault(node, [])
                readers[node] += [f for f in parts if f not in readers[node]]
        else:
            found[e.name] = (fused, readers)
    untie: dict[str, Untie] = {}
    while blocked := _shared(g, found, untie) or _mismatched(g, found):
        for name, why in blocked.items():
            entry = next(e for e in entries if e.name == name)
            entry.affine, entry.affine_reason = AFFINE_KEPT, why
            found.pop(name)
    for e in entries:
        if e.name not in found:
            continue
        e.fused = sorted(found[e.name][0], key=lambda f: (f.weight, f.start))
        no_bias = sorted({f.weight for f in e.fused if f.bias is None})
        if getattr(g.cap.model.get_submodule(e.name), "bias", None) is None or not no_bias:
            e.affine = AFFINE_FUSED
        else:
            values = g.value(f"{e.name}.weight")  # None without a gain
            if values is not None and not bool(values.ne(0).all()):
                why = (
                    f"its gain has a zero entry, so β cannot stay as β/γ, and {no_bias[0]} has "
                    "no bias to take it"
                )
                e.affine, e.affine_reason, e.fused = AFFINE_KEPT, why, []
            else:
                e.affine, e.affine_reason = AFFINE_GAIN, f"{no_bias[0]} has no bias to take it"
    return sorted(untie.values(), key=lambda u: u.param)


def _affine_read_elsewhere(g: GraphIndex, name: str, calls: list[fx.Node]) -> str | None:
    """Why a norm's γ or β cannot become 1 and 0: something else reads it (another norm sharing it,
    the model)."""
    for leaf, what in (("weight", "gain"), ("bias", "bias")):
        ph = g.placeholder_of.get(f"{name}.{leaf}")
        for user, _ in other_reads(g, ph, calls) if ph is not None else []:
            return f"its {what} {name}.{leaf} is also read by {g.describe(user)}"
    return None


def _mismatched(g: GraphIndex, found: dict[str, tuple[list[Fused], Readers]]) -> dict[str, str]:
    """Norms whose readers share a weight or a bias but read different things with it: fusing
    scales each block of a weight once and adds ``W β`` to each bias once."""
    reads: dict[fx.Node, set[tuple[str, Fused]]] = {}
    for name, (_, readers) in found.items():
        for node, parts in readers.items():
            reads.setdefault(node, set()).update((name, f) for f in parts)
    by_weight: dict[fx.Node, dict[frozenset, fx.Node]] = {}
    by_bias: dict[fx.Node, set[fx.Node]] = {}
    for node, parts in reads.items():
        for _, f in parts:
            ph = g.placeholder_of.get(f.weight)
            if ph is None:
                continue
            by_weight.setdefault(ph, {}).setdefault(frozenset(parts), node)
            if f.bias in g.placeholder_of:
                by_bias.setdefault(g.placeholder_of[f.bias], set()).add(ph)
    blocked: dict[str, str] = {}
    for ph, kinds in by_weight.items():
        if len(kinds) > 1:
            first, second = list(kinds.values())[:2]
            why = (
                f"{g.cap.placeholder_fqn[ph.name]} is read by {g.describe(first)} and "
                f"{g.describe(second)}, "
                "which read different values with it"
            )
            blocked.update(
                {name: why for parts in kinds for name, _ in parts if name not in blocked}
            )
    for bph, weights in by_bias.items():
        if len(weights) > 1:
            why = (
                f"{g.cap.placeholder_fqn[bph.name]} is the bias of more than one weight that "
                "reads it"
            )
            blocked.update(
                {
                    name: why
                    for ph in weights
                    for parts in by_weight[ph]
                    for name, _ in parts
                    if name not in blocked
                }
            )
    return blocked


def _shared(
    g: GraphIndex, found: dict[str, tuple[list[Fused], Readers]], untie: dict[str, Untie]
) -> dict[str, str]:
    """Norms whose readers' weights are read elsewhere (and cannot be untied), or by two norms on
    the same block."""
    blocked: dict[str, str] = {}
    owners: dict[fx.Node, set[str]] = {}  # placeholder -> norms fusing into it
    for name, (fused, _) in found.items():
        for f in fused:
            ph = g.placeholder_of.get(f.weight)
            if ph is not None:
                owners.setdefault(ph, set()).add(name)
    for ph, norms in owners.items():
        ours = set().union(*(found[n][1] for n in norms))
        mine = [(n, f) for n in norms for f in found[n][0] if g.placeholder_of.get(f.weight) is ph]
        for a, (who, f) in enumerate(mine):
            for who2, f2 in mine[a + 1 :]:
                overlap = f.start < f2.start + f2.length and f2.start < f.start + f.length
                if who != who2 and f.axis == f2.axis and overlap:
                    blocked.setdefault(
                        who, f"{g.cap.placeholder_fqn[ph.name]} also takes the affine of {who2}"
                    )
        for bias in {f.bias for _, f in mine if f.bias}:
            bph = g.placeholder_of.get(bias)
            for user, _ in other_reads(g, bph, ours) if bph is not None else []:
                blocked.update(
                    {
                        who: f"{bias} is also read by {g.describe(user)}"
                        for who in norms
                        if who not in blocked
                    }
                )
        aliases = {f.weight for _, f in mine}
        for user, alias in other_reads(g, ph, ours):
            if g.tied_apart(alias, aliases):
                for a in aliases:  # the norm's reader gets its own copy
                    untie[a] = Untie(a, alias, g.nbytes(ph))
                continue
            blocked.update(
                {
                    who: f"{sorted(aliases)[0]} is also read by {g.describe(user)}"
                    for who in norms
                    if who not in blocked
                }
            )
    return blocked
