"""The fold plan: what the analysis decided, as plain serialisable data.

A plan is the only thing that flows from analysis to rewrite, so it can be
saved, reviewed, edited and applied later (``fold(model, plan=plan)``), and it
is what a converted checkpoint records in its ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Centering:
    """A parameter to center: ``p -= p.mean(axis, keepdim=True)``.

    With ``groups > 1`` (for a GroupNorm), the axis is split into that many
    equal blocks and each block is centered on its own.
    """

    param: str
    axis: int
    groups: int = 1


@dataclass(frozen=True)
class Untie:
    """A tied parameter name that gets its own copy before centering."""

    param: str
    tied_to: str
    nbytes: int


@dataclass(frozen=True)
class AuxCentering:
    """An explicit ``x - x.mean(-1)`` inserted at a module's output or input."""

    module: str
    where: str  # "output" or "input"

    def describe(self) -> str:
        return f"an auxiliary centering at the {self.where} of {self.module}"


@dataclass
class LayerNormEntry:
    """One LayerNorm: an ``nn.LayerNorm`` module or a functional call."""

    name: str
    kind: str  # "module" or "functional"
    foldable: bool
    reason: str = ""
    centered: list[Centering] = field(default_factory=list)
    normalized_shape: tuple[int, ...] = ()
    eps: float = 1e-5
    norm: str = "layer_norm"  # or "group_norm"
    groups: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["normalized_shape"] = list(self.normalized_shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerNormEntry":
        return cls(
            name=d["name"],
            kind=d["kind"],
            foldable=bool(d["foldable"]),
            reason=d.get("reason", ""),
            centered=[Centering(**c) for c in d.get("centered", [])],
            normalized_shape=tuple(d.get("normalized_shape", ())),
            eps=float(d.get("eps", 1e-5)),
            norm=d.get("norm", "layer_norm"),
            groups=int(d.get("groups", 1)),
        )


@dataclass
class FoldPlan:
    """Which LayerNorms fold, and what must be centered and untied for them.

    >>> plan = FoldPlan("Toy", [LayerNormEntry("ln", "module", True)])
    >>> FoldPlan.from_json(plan.to_json()) == plan
    True
    """

    model: str
    layer_norms: list[LayerNormEntry] = field(default_factory=list)
    untied: list[Untie] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    auxiliary: list[AuxCentering] = field(default_factory=list)
    """Centerings inserted to make more LNs foldable (``auxiliary_centering=True``)."""
    norm_modules: list[str] = field(default_factory=list)
    """Every LayerNorm and GroupNorm module of the analysed model, to recognise it again."""

    @property
    def foldable(self) -> list[LayerNormEntry]:
        return [e for e in self.layer_norms if e.foldable]

    @property
    def centered(self) -> list[Centering]:
        """Every parameter to center, once, in a stable order."""
        seen: dict[Centering, None] = {}
        for entry in self.foldable:
            for c in entry.centered:
                seen.setdefault(c, None)
        return list(seen)

    @property
    def untie_bytes(self) -> int:
        return sum(u.nbytes for u in self.untied)

    def __getitem__(self, name: str) -> LayerNormEntry:
        for entry in self.layer_norms:
            if entry.name == name:
                return entry
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "layer_norms": [e.to_dict() for e in self.layer_norms],
            "untied": [asdict(u) for u in self.untied],
            "notes": list(self.notes),
            "auxiliary": [asdict(a) for a in self.auxiliary],
            "norm_modules": list(self.norm_modules),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FoldPlan":
        version = d.get("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            from .errors import PlanError

            raise PlanError(
                f"this plan has format version {version}; this enjoyln reads up to "
                f"{FORMAT_VERSION}, so upgrade enjoyln"
            )
        return cls(
            model=d["model"],
            layer_norms=[LayerNormEntry.from_dict(e) for e in d.get("layer_norms", [])],
            untied=[Untie(**u) for u in d.get("untied", [])],
            notes=list(d.get("notes", [])),
            auxiliary=[AuxCentering(**a) for a in d.get("auxiliary", [])],
            norm_modules=list(d.get("norm_modules", [])),
        )

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    @classmethod
    def from_json(cls, text: str) -> "FoldPlan":
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """A readable multi-line report of the plan."""
        n, k = len(self.layer_norms), len(self.foldable)
        if n == 0:
            return f"{self.model}: no LayerNorm found, nothing to fold."
        lines = [f"{self.model}: {k} of {n} LayerNorms foldable"]
        for e in self.layer_norms:
            mark = "fold" if e.foldable else "keep"
            kind = f" (GroupNorm, {e.groups} groups)" if e.norm == "group_norm" else ""
            lines.append(f"  [{mark}] {e.name}{kind}" + ("" if e.foldable else f": {e.reason}"))
        centered = self.centered
        if centered:
            lines.append(f"Center {len(centered)} parameters:")
            lines += [f"  {c.param} (axis {c.axis}" + (f", in {c.groups} groups)" if c.groups > 1 else ")")
                      for c in centered]
        for u in self.untied:
            lines.append(f"Untie {u.param} from {u.tied_to}: +{format_bytes(u.nbytes)}")
        for a in self.auxiliary:
            lines.append(f"Insert {a.describe()}")
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)


def block_lists(plan: FoldPlan) -> dict[str, list[Any]]:
    """The lists a folded checkpoint's ``enjoyln`` block carries beside the full plan, for
    readers that do not parse it: derived from the plan, so the static check can confirm them."""
    return {"rmsnorm": [e.name for e in plan.foldable],
            "centered": [{"param": c.param, "axis": c.axis, "groups": c.groups} for c in plan.centered],
            "untied": [u.param for u in plan.untied],
            "auxiliary_centering": [{"module": a.module, "where": a.where} for a in plan.auxiliary]}


def format_bytes(n: float) -> str:
    """512 B, 32.0 KiB, 3.0 GiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
