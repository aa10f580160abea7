"""Pass 2: soundness. Centering a source shifts every value computed from it by a per-row constant
(``Shift``); ``Spread`` refuses sources whose shift reaches anything but an LN input or a
centering (docs/how-it-works.md)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from functools import reduce
from typing import Iterable

from torch import fx

from .graph import GN_OPS, LN_OPS, GraphIndex, arg, op_name, reads_value, shape
from ..plan import AuxCentering, Untie
from .rules import MAP, SCALE, SUM, Layout, Refusal, carry_all, kind_of, per_row, split_axis
from .sources import Source, linear_reads, other_reads


@dataclass(frozen=True)
class Shift:
    """A value changed by a constant along ``axis`` (within each of ``groups`` blocks) by centering
    ``keys``."""

    axis: int
    keys: frozenset[str]
    groups: int = 1
    layout: Layout | None = None  # where the blocks went, if the feature axis was split


Hits = list[tuple[fx.Node, Shift]]
Flags = list[tuple[Iterable[str], str]]


def merge_groups(a: int | None, b: int | None) -> int | None:
    """Shifts constant in ``a`` and in ``b`` blocks sum to one constant in the finer, if one refines
    the other."""
    if a is None or b is None:
        return None
    hi, lo = max(a, b), min(a, b)
    return hi if hi % lo == 0 else None


def gn_groups(node: fx.Node) -> int:
    if op_name(node) == "instance_norm":
        return shape(node.args[0])[1]
    return int(arg(node, 1, "num_groups", 1))


class Spread:
    """Follows changed values forward from ``seeds`` and collects where they escape; ``sink`` says
    what a reader does with a change: None to carry it on, or the flags it raises (none:
    absorbed)."""

    def __init__(self, g: GraphIndex):
        self.g = g
        self.bad: dict[str, str] = {}

    def flag(self, keys: Iterable[str], what: str) -> None:
        for k in keys:
            self.bad.setdefault(k, what)

    def escape(self, node: fx.Node, keys: frozenset[str], what: str) -> None:
        """The change of ``keys`` reaches ``node``, which alters ``what``."""
        self.flag(keys, what)

    def sink(self, node: fx.Node, hits: Hits, keys: frozenset[str], groups: int) -> Flags | None:
        raise NotImplementedError

    def narrow(self, shift: Shift) -> Shift:
        """``shift`` without the keys whose change lies outside the blocks still in view."""
        return shift

    def spread(self, changed: dict[fx.Node, Shift]) -> None:
        for node in self.g.graph.nodes:
            self.g.at = node
            if node not in self.g.live:
                continue  # its values reach nothing the model computes
            hits = [
                (i, changed[i])
                for i in node.all_input_nodes
                if i in changed and reads_value(node, i)
            ]
            if not hits:
                continue
            keys = frozenset().union(*(s.keys for _, s in hits))
            groups = reduce(merge_groups, (s.groups for _, s in hits), 1)
            if groups is None:
                self.flag(
                    keys, f"{self.g.describe(node)}, where shifts of incompatible groupings meet"
                )
                continue
            flags = self.sink(node, hits, keys, groups)
            if flags is not None:
                for ks, what in flags:
                    self.flag(ks, what)
                continue
            new = carry_shift(self.g, node, hits, keys, groups)
            if isinstance(new, Shift):
                new = self.narrow(new)
                if new.keys:
                    changed[node] = new
            else:
                self.escape(node, keys, new)


def carry_shift(
    g: GraphIndex, node: fx.Node, hits: Hits, keys: frozenset[str], groups: int
) -> Shift | str:
    """The change of ``node``'s output if its inputs' per-row changes stay per-row there; else what
    it alters."""
    what = f"the input of {g.describe(node)}"
    kind, (stream, s) = kind_of(node), hits[0]
    if (
        kind is None
        or (kind != SUM and len(hits) != 1)
        or (kind == MAP and stream is not node.args[0])
    ):
        return what
    if kind == SCALE and stream is node.args[1] and op_name(node) == "div":
        return what
    moved = carry_all(node, [(i, s.axis, s.layout) for i, s in hits], g.cap.where(node))
    if isinstance(moved, Refusal):
        found = split_axis(node, stream, s.axis) if kind == MAP else None
        if found is None or (shape(stream)[s.axis] // s.groups) % shape(node)[found[0]]:
            return what
        # a change constant within blocks, after a reshape splits the feature axis into pieces no
        # larger than one
        return Shift(found[0], keys, 1, found[1])
    if kind == SCALE and not per_row(
        node.args[1] if stream is node.args[0] else node.args[0], node, moved[0]
    ):
        return what
    return Shift(moved[0], keys, groups, moved[1])


class ShiftSoundness(Spread):
    """Which sources' centering changes something other than LN inputs."""

    def __init__(
        self,
        g: GraphIndex,
        sources: dict[str, Source],
        aux: dict[fx.Node, AuxCentering],
        free: bool = False,
    ):
        super().__init__(g)
        self.free = free  # the outputs a model does not serve may change (``plan.SERVED``)
        self.unserved: dict[str, list[str]] = {}  # source -> the outputs not served it changes
        self.sources = sources
        self.aux = aux
        self.active: dict[str, Source] = {}
        self.seeds: set[fx.Node] = set()
        self.absorbing = {m: sub for sub, m in g.centers.items() if len(m.users) == 1}

    def affected(self, active: Iterable[str]) -> tuple[dict[str, str], dict[str, Untie]]:
        """(bad source -> what its centering would change, alias -> Untie) for ``active`` centered
        together."""
        # in a fixed order: a set's order changes with PYTHONHASHSEED, and with it the name an
        # untied head is recorded as tied to, which a check in another process must confirm
        self.active = {k: self.sources[k] for k in sorted(active)}
        self.bad, self.unserved = {}, {}
        changed, untie = self._seed()
        self.spread(changed)
        return self.bad, untie

    def let_change(self, keys: Iterable[str], names: list[str]) -> None:
        """``keys`` change the outputs ``names``, none of them served, as the contract lets them."""
        for k in keys:
            found = self.unserved.setdefault(k, [])
            found += [n for n in names if n not in found]

    def escape(self, node: fx.Node, keys: frozenset[str], what: str) -> None:
        unserved = self.g.only_unserved(node) if self.free else None
        if unserved is None:
            self.flag(keys, what)
        else:  # whatever it computes, only outputs the contract lets change read it
            self.let_change(keys, unserved)

    def _seed(self) -> tuple[dict[fx.Node, Shift], dict[str, Untie]]:
        g, active = self.g, self.active
        changed: dict[fx.Node, Shift] = {}
        untie: dict[str, Untie] = {}
        centered: dict[str, dict[str, int]] = {}  # placeholder name -> {alias: axis}
        grouping: dict[str, dict[tuple, set[str]]] = {}  # placeholder -> (groups, scale) -> sources
        for src in active.values():
            g.at = src.node
            self._check_chain(src)
            prev = changed.get(src.node, Shift(src.axis, frozenset()))
            changed[src.node] = Shift(src.axis, prev.keys | {src.key}, max(src.groups, prev.groups))
            for c in src.params:
                ph = g.placeholder_of.get(c.param)
                if ph is None:
                    continue
                axes = centered.setdefault(ph.name, {})
                grouping.setdefault(ph.name, {}).setdefault((c.groups, c.scale), set()).add(src.key)
                axes.setdefault(c.param, c.axis)
                if len(set(axes.values())) > 1 or axes[c.param] != c.axis:
                    self.flag(
                        set().union(*grouping[ph.name].values()),
                        f"{c.param} along two different axes",
                    )
        for ph_name, by_how in grouping.items():
            if len(by_how) > 1:  # e.g. centered whole for an LN and in groups for a GroupNorm
                plain = by_how.get((1, None))
                what = f"{g.cap.placeholder_fqn[ph_name]}, which another norm needs centered " + (
                    "as a whole" if plain else "another way"
                )
                self.flag(
                    set().union(*(keys for keys in by_how.values() if keys is not plain)), what
                )
        for src in active.values():  # a LayerScale gain is read as it is, never centered
            for c in src.params:
                ph = g.placeholder_of.get(c.scale) if c.scale else None
                if ph is not None and (ph.name in centered or ph in changed):
                    self.flag(
                        {src.key}, f"{c.scale}, which it is centered for, and which is centered too"
                    )
        self.seeds = set(changed)
        inner = {src.chain[0] for src in active.values() if src.chain}
        # other reads of a centered weight: another call of the same module shifts its output the
        # same way, a tied alias gets its own copy, anything else changes
        for ph_name, aliases in centered.items():
            ph, keys = g.placeholders[ph_name], set().union(*grouping[ph_name].values())
            if ph in self.seeds:
                continue  # a parameter used as data: its reads are followed by spread()
            roles = {g.role(active[k].params) for k in keys}
            for user, read in other_reads(g, ph, self.seeds | inner, roles):
                if isinstance(read, Source):
                    changed[user] = Shift(
                        read.axis, frozenset(keys), max(active[k].groups for k in keys)
                    )
                    self.seeds.add(user)
                elif g.tied_apart(read, aliases):
                    untie[read] = Untie(read, next(iter(aliases)), g.nbytes(ph))
                else:
                    self.flag(keys, f"{g.describe(user)}, which reads the same weight")
        return changed, untie

    def _check_chain(self, src: Source) -> None:
        """Centering a layer for its LayerScale changes its output, and the sum it enters, by more
        than a per-row constant: only the product may read them, linearly, on the way the
        analysis followed."""
        g = self.g
        inside = set(src.chain)
        for node in src.chain:
            for user in node.users:
                if user not in g.live or not reads_value(user, node):
                    continue
                ok = (
                    user is src.node
                    and node is src.chain[-1]
                    and sum(a is node for a in user.args) == 1
                ) or (
                    user in inside
                    and node in linear_reads(user)
                    and sum(a is node for a in (*user.args, *user.kwargs.values())) == 1
                )
                if not ok:
                    self.flag(
                        {src.key},
                        f"{g.describe(user)}, which reads the output of "
                        f"{g.label(src.chain[0])} before its LayerScale",
                    )

    def narrow(self, shift: Shift) -> Shift:
        layout = shift.layout
        if layout is None:
            return shift
        view = layout.visible()
        keep = set()
        for k in shift.keys:
            src = self.active[k]
            blocks = src.params[0].blocks if src.params else None
            same_split = src.groups == layout.groups and shape(src.node)[src.axis] == layout.size
            if not same_split or view & set(range(src.groups) if blocks is None else blocks):
                keep.add(k)
        return replace(shift, keys=frozenset(keep)) if len(keep) < len(shift.keys) else shift

    def _grouped(self, keys: frozenset[str]) -> set[str]:
        return {k for k in keys if self.active[k].groups > 1} or set(keys)

    def sink(self, node: fx.Node, hits: Hits, keys: frozenset[str], groups: int) -> Flags | None:
        g, name = self.g, op_name(node)
        # a shift reaching an inserted centering is removed if it passes the op unchanged
        if node in self.aux and (
            (name in LN_OPS and all(ln_sink_ok(node, i, s.axis) for i, s in hits))
            or isinstance(carry_shift(g, node, hits, keys, groups), Shift)
        ):
            return []
        if node in self.aux or node in self.seeds:
            return [(keys, f"the input of {g.describe(node)}")]
        if node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            changed, flags = dict(hits), []
            for i, out in enumerate(outs):
                name = g.output_names.get(i, str(i))
                if out not in changed or g.writes_back(i, out):
                    continue
                if self.free and not g.served(name):
                    self.let_change(changed[out].keys, [name])
                else:
                    flags.append((changed[out].keys, _output_label(name)))
            return flags
        center = self.absorbing.get(node, node)
        if center in g.centers and all(s.axis == g.center_axis(center) for _, s in hits):
            if groups != 1:  # x - mean(x) removes a shift shared by all features, not per group
                return [
                    (
                        self._grouped(keys),
                        f"{g.describe(node)}, which does not remove a per-group shift",
                    )
                ]
            return []
        if name in LN_OPS:
            if groups != 1:
                return [
                    (
                        self._grouped(keys),
                        f"{g.describe(node)}, which does not ignore a per-group shift",
                    )
                ]
            if not all(ln_sink_ok(node, i, s.axis) for i, s in hits):
                return [(keys, f"{g.describe(node)} along an axis it does not normalize")]
            return []
        if name in GN_OPS:
            why = gn_sink_refusal(g, node, hits, groups)
            return [(keys, why)] if why else []
        return None


def _output_label(name: str) -> str:
    if name.startswith("buffer:"):
        return f"the buffer {name.removeprefix('buffer:')}, which the forward overwrites"
    return f"the model output `{name}`"


def ln_sink_ok(node: fx.Node, changed_input: fx.Node, axis: int) -> bool:
    """An LN's output ignores a per-row shift along the one axis it normalizes (the mean it returns
    does not)."""
    dims = shape(changed_input)
    norm_shape = list(arg(node, 1, "normalized_shape", []))
    if op_name(node) == "native_layer_norm" and any(
        u.target is not operator.getitem or u.args[1] != 0 for u in node.users
    ):
        return False
    return (
        node.args[0] is changed_input
        and dims is not None
        and axis == len(dims) - 1
        and math.prod(norm_shape[:-1]) == 1
        and all(a is not changed_input for a in node.args[1:])
    )


def gn_sink_refusal(g: GraphIndex, node: fx.Node, hits: Hits, groups: int) -> str:
    """Why a shift reaching this GroupNorm would change its output ('' if it would not)."""
    dims = shape(node.args[0])
    n = gn_groups(node)
    if any(i is not node.args[0] for i, _ in hits) or dims is None:
        return f"the parameters of {g.describe(node)}"
    if math.prod(dims[2:]) != 1:
        return f"{g.describe(node)}, which averages over {math.prod(dims[2:])} positions too"
    if any(s.axis != 1 for _, s in hits) or n % groups:
        return f"{g.describe(node)}, whose groups the shift does not respect"
    return ""
