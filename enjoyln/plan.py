"""The fold plan: the analysis's decisions as plain data, recorded in a folded checkpoint's
``config.json``."""

from __future__ import annotations

import json
from dataclasses import (
    MISSING as _REQUIRED,
)  # a field without a default (plan.MISSING is a note kind)
from dataclasses import Field, dataclass, field, fields, is_dataclass
from functools import cache
from typing import Any, get_args, get_origin, get_type_hints

from .errors import PlanError
from .units import format_bytes

FORMAT_VERSION = 6
"""The newest format read; a plan is written in the oldest that holds it: old readers refuse only
what they misread."""


class Fields:
    """A plan's JSON object read field by field, a ``ValueError`` naming the field at fault.

    >>> Fields({"axis": "1"}, "c").read("axis", int)
    Traceback (most recent call last):
    ValueError: c.axis is '1', not an integer
    """

    _KINDS = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true or false",
        list: "a list",
    }

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where} is {_short(data)}, not an object")
        self.data, self.where = data, where

    def _get(self, key: str, kind: type, default: Any) -> Any:
        if key not in self.data or (self.data[key] is None and default is not _REQUIRED):
            if default is _REQUIRED:
                raise ValueError(f"{self.where} has no {key}")
            return default
        value = self.data[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(
            value, (int, float) if kind is float else kind
        ):
            raise ValueError(f"{self.where}.{key} is {_short(value)}, not {self._KINDS[kind]}")
        return value

    def read(self, key: str, hint: Any, default: Any = _REQUIRED) -> Any:
        """``key`` as the type ``hint`` says: a plain value, a list or tuple of them or of plan
        records, or ``Rotation | None`` (a missing or empty one None); ``default`` left out where
        ``key`` is required."""
        if type(None) in get_args(hint):
            hint = get_args(hint)[0]
        if is_dataclass(hint):
            value = self.data.get(key)
            return hint.from_dict(Fields(value, f"{self.where}.{key}")) if value else None
        if get_origin(hint) is None:
            value = self._get(key, hint, default)
            return float(value) if hint is float else value
        sequence, kind = get_origin(hint), get_args(hint)[0]
        if is_dataclass(kind):
            return sequence(
                kind.from_dict(Fields(v, f"{self.where}.{key}[{i}]"))
                for i, v in enumerate(self._get(key, list, []))
            )
        values = self._get(key, list, None)
        if values is None:
            return default
        one = Fields({str(i): v for i, v in enumerate(values)}, f"{self.where}.{key}")
        values = [
            one._get(str(i), str if issubclass(kind, str) else kind, _REQUIRED)
            for i in range(len(values))
        ]
        return sequence(
            values if kind in (str, int) else map(kind.read, values)
        )  # a Note: its ``read``


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _default(f: Field) -> Any:
    return f.default if f.default_factory is _REQUIRED else f.default_factory()


_hints = cache(get_type_hints)  # of a record class, evaluated once


def _data(value: Any) -> Any:
    """``value`` as JSON data: a record as its ``to_dict``, a sequence as a list, a ``Note`` as a
    plain string."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_data(v) for v in value]
    return str(value) if isinstance(value, str) else value


class Record:
    """A plan dataclass as a JSON object: its fields in order, read back by their types
    (``Fields.read``). ``_sparse`` names newer fields left out at their defaults, so older
    readers read the same."""

    _sparse: tuple[str, ...] = ()
    _where = "record"  # the name a ``ValueError`` gives a bad object passed to ``from_dict``

    def to_dict(self) -> dict[str, Any]:
        data = (
            (f, _data(getattr(self, f.name))) for f in fields(self)
        )  # each value converted once
        return {
            f.name: value
            for f, value in data
            if f.name not in self._sparse or value != _data(_default(f))
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Fields) -> Any:
        f = d if isinstance(d, Fields) else Fields(d, cls._where)
        return cls(
            **{x.name: f.read(x.name, _hints(cls)[x.name], _default(x)) for x in fields(cls)}
        )


@dataclass(frozen=True)
class Centering(Record):
    """A parameter to center: ``p -= p.mean(axis, keepdim=True)``; with ``groups > 1`` each of that
    many blocks of the axis on its own (``blocks``: only those), with ``scale`` (a LayerScale gain
    γ) ``p -= mean(γ·p) / γ``."""

    param: str
    axis: int
    groups: int = 1
    blocks: tuple[int, ...] | None = None  # only these of the ``groups`` blocks; None: all
    scale: str | None = None  # the parameter holding γ, indexed like ``axis``; not changed
    saved: bool = (
        True  # False for a non-persistent buffer, not stored: ``enjoyln.load`` centers it again
    )
    _sparse = ("blocks", "scale", "saved")
    _where = "centering"

    def describe(self) -> str:
        """``lin.weight (axis 0, in 4 groups)``."""
        more = []
        if self.groups > 1:
            more.append(f"in {self.groups} groups")
            if self.blocks is not None:  # None: every block, nothing more to say
                shown = ", ".join(map(str, self.blocks[:6]))
                more[-1] += f", blocks {shown}" + (", ..." if len(self.blocks) > 6 else "")
        if self.scale:
            more.append(f"scaled by {self.scale}")
        if not self.saved:
            more.append("a buffer, centered again on load")
        return f"{self.param} (axis {self.axis}" + "".join(f", {m}" for m in more) + ")"


@dataclass(frozen=True)
class Untie(Record):
    """A tied parameter name that gets its own copy before centering."""

    param: str
    tied_to: str
    nbytes: int


@dataclass(frozen=True)
class AuxCentering(Record):
    """An explicit ``x - x.mean(-1)`` inserted at a module's output or input."""

    module: str
    where: str  # "output" or "input"

    def describe(self) -> str:
        return f"an auxiliary centering at the {self.where} of {self.module}"


@dataclass(frozen=True)
class Fused(Record):
    """Part of a folded norm's affine moved into a linear layer that reads it: entries ``start ..
    start + length`` of ``weight``'s input axis read the norm's features from ``offset``; they are
    multiplied by γ, and ``bias`` gains ``W β``."""

    weight: str
    axis: int
    start: int
    length: int
    offset: int = 0
    bias: str | None = None

    def describe(self) -> str:
        cols = (
            ""
            if self.start == 0 and self.offset == 0
            else f", entries {self.start}-{self.start + self.length - 1}"
        )
        return f"{self.weight} (input axis {self.axis}{cols})" + (
            f", {self.bias}" if self.bias else ""
        )


AFFINE_FUSED, AFFINE_GAIN, AFFINE_KEPT = "fused", "gain fused", "kept"
"""With ``fuse_affine``, γ and β: both moved (a weightless norm), γ moved and β kept as β/γ, or both
kept."""


SERVED, ALL_OUTPUTS = "served", "all"
"""The outputs a fold or rotation keeps exact: what a model serves (its logits, and so its
generation; every output of a model without logits), or every output, the hidden states of its
towers included."""


def check_exact(value: str) -> str:
    """``value`` if it names the outputs to keep exact, else a ``PlanError``.

    >>> check_exact("served")
    'served'
    """
    if value not in (SERVED, ALL_OUTPUTS):
        raise PlanError(f"exact_outputs is {value!r}; use {SERVED!r} or {ALL_OUTPUTS!r}")
    return value


@dataclass(frozen=True)
class Rotated(Record):
    """A tensor multiplied by the rotation ``Q`` along ``axis``: ``t ×_axis Q``."""

    param: str
    axis: int
    saved: bool = True  # False for a non-persistent buffer: ``enjoyln.load`` rotates it again
    start: int = 0  # the rotated block of ``axis`` (a reader of several concatenated norms) ...
    length: int = 0  # ... and its length (0: to the end of the axis)


@dataclass
class Rotation(Record):
    """An orthogonal ``Q`` on the residual stream, rebuilt from ``kind``, ``seed`` and the width."""

    kind: str
    seed: int
    keep_mean: bool
    rotated: list[Rotated] = field(default_factory=list)
    version: int = (
        1  # how ``Q`` is built and applied: 1 dense, 2 and 3 structured (``ROTATION_VERSIONS``)
    )
    stream: str = (
        ""  # the stream rotated, where a plan rotates several: the modules its norms share ...
    )
    width: int = 0  # ... and its width
    _sparse = ("version", "stream", "width")
    _where = "rotation"

    def describe(self) -> str:
        """``the residual stream of model.vision_tower (width 1152, hadamard, seed 7, keeping the
        mean)``."""
        where = f" of {self.stream or 'the model'} (width {self.width}, " if self.width else " ("
        return (
            f"the residual stream{where}{self.kind}, seed {self.seed}, "
            f"{'keeping the mean' if self.keep_mean else 'not keeping the mean'})"
        )


ROTATION_VERSIONS = {"hadamard": 3, "random": 1}
"""The version a new rotation of each kind gets. A hadamard ``Q`` of version 1 is a dense matrix (a
Kronecker product with a LAPACK block, or Haar-random where the odd part of the width is over 64)
applied by BLAS; of version 2 it is structured (``ops/rotate.c``) for every width; version 3 is
version 2's ``Q`` with each fused bias's ``W β`` summed in a fixed order
(``ops.rotate.dot_vectors``) instead of by BLAS, whose order, and so whose bits, depend on the
machine. Checkpoints keep the version they were made with."""


@dataclass(frozen=True)
class RotationSpec:
    """What a rotation of the residual streams is asked to be: the kind of ``Q``, its seed, whether
    it keeps the mean, the version of its algorithm (0: the newest for the kind,
    ``ROTATION_VERSIONS``), and the outputs it keeps exact (``SERVED`` or ``ALL_OUTPUTS``).

    >>> RotationSpec.of(("random", 3, False))
    RotationSpec(kind='random', seed=3, keep_mean=False, version=0, exact_outputs='served')
    """

    kind: str = "hadamard"
    seed: int = 0
    keep_mean: bool = True
    version: int = 0
    exact_outputs: str = SERVED

    @property
    def algorithm(self) -> int:
        """The version this rotation is made with."""
        return self.version or ROTATION_VERSIONS.get(self.kind, 1)

    @classmethod
    def of(cls, value: "RotationSpec | tuple[str, int, bool] | None") -> "RotationSpec | None":
        if value is None or isinstance(value, RotationSpec):
            return value
        kind, seed, keep_mean = value
        return cls(str(kind), checked_seed(seed), bool(keep_mean))


MAX_SEED = 2**64 - 1
"""A rotation's seed is 64 bits: each seed from 0 to this gives its own ``Q``, and one outside
would give the same ``Q`` as one inside while the config records it as given."""


def checked_seed(seed: int) -> int:
    """``seed`` as an int, refused outside 0 .. ``MAX_SEED``."""
    if not 0 <= int(seed) <= MAX_SEED:
        raise PlanError(f"the rotation's seed must be from 0 to 2**64 - 1, got {seed}")
    return int(seed)


TRAINING_MODE, NOT_ROTATED, MISSING = "training mode", "not rotated", "missing parameters"
"""Kinds of notes code acts on: ``fold`` warns of the first, ``rotate`` raises the second; the third
for reading."""
STREAM_NOT_ROTATED = "stream not rotated"
"""The second's kind where a model has several residual streams (a vision tower's, the language
model's)."""
_NOTE_TEXTS = {
    TRAINING_MODE: "the model is in training mode, so its dropout blocks folding; call "
    "model.eval() first",
    NOT_ROTATED: "the residual stream cannot be rotated: {}",
    STREAM_NOT_ROTATED: "the residual stream of {} (width {}) cannot be rotated: {}",
    MISSING: "the checkpoint lacks {} that {} builds ({}): transformers initialises {} at random "
    "on every "
    "load, so outputs that read {} differ from load to load; --model-class can name a class "
    "that matches the weights",
}


class Note(str):
    """A plan's note: plain text (in JSON) with a ``kind`` that code tests instead of the words.

    >>> note = Note.of(NOT_ROTATED, "no LayerNorm folds")
    >>> note, note.kind
    ('the residual stream cannot be rotated: no LayerNorm folds', 'not rotated')
    """

    kind: str

    def __new__(cls, text: str, kind: str = "") -> "Note":
        note = super().__new__(cls, text)
        note.kind = kind
        return note

    @classmethod
    def of(cls, kind: str, *args: Any) -> "Note":
        return cls(_NOTE_TEXTS[kind].format(*args), kind)

    @classmethod
    def read(cls, text: str) -> "Note":
        """A note read back from JSON: its kind recovered from the fixed start of ``Note.of``'s
        texts."""
        for kind, template in _NOTE_TEXTS.items():
            if text.startswith(template.split("{}")[0]):
                return cls(text, kind)
        return cls(text)


@dataclass
class LayerNormEntry(Record):
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
    affine: str = ""  # with ``fuse_affine``: AFFINE_FUSED, AFFINE_GAIN or AFFINE_KEPT
    affine_reason: str = ""  # why the affine (AFFINE_KEPT) or β (AFFINE_GAIN) stayed
    fused: list[Fused] = field(default_factory=list)
    dim: int = (
        -1
    )  # the axis normalized: -1, or 1 for a channels-first norm (timm's ``LayerNorm2d``)
    # computes in float32, cast back to the input's dtype (timm's ``LayerNormFp32``, OLMo)
    upcast: bool = False
    then: tuple[
        str, ...
    ] = ()  # children applied to the output (timm's ``LayerNormAct2d``), kept after the RMSNorm
    _sparse = (
        "affine",
        "affine_reason",
        "fused",
        "dim",
        "upcast",
        "then",
    )  # newer fields, written only when used
    _where = "layer_norm"

    @property
    def form(self) -> tuple[int, bool, tuple[str, ...]]:
        return self.dim, self.upcast, tuple(self.then)

    @property
    def plain_form(self) -> bool:
        return self.form == (-1, False, ())

    @property
    def weightless(self) -> bool:
        return self.foldable and self.affine == AFFINE_FUSED


@dataclass
class FoldPlan(Record):
    """Which LayerNorms fold, and what must be centered and untied for them.

    >>> plan = FoldPlan("Toy", [LayerNormEntry("ln", "module", True)])
    >>> FoldPlan.from_json(plan.to_json()) == plan
    True
    """

    model: str
    layer_norms: list[LayerNormEntry] = field(default_factory=list)
    untied: list[Untie] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)  # plain strings are accepted too
    auxiliary: list[AuxCentering] = field(default_factory=list)  # ``auxiliary_centering=True``
    norm_modules: list[str] = field(
        default_factory=list
    )  # every LN and GroupNorm, to recognise the model again
    rotation: Rotation | None = None  # the first stream rotated ...
    more_rotations: list[Rotation] = field(
        default_factory=list
    )  # ... and the others, each with its own Q
    exact_outputs: str = SERVED  # SERVED or ALL_OUTPUTS: the outputs the fold and rotation keep
    changed_outputs: list[str] = field(
        default_factory=list
    )  # outputs the fold or rotation changes (a tower's hidden states)
    _sparse = ("rotation", "more_rotations", "exact_outputs", "changed_outputs")
    _where = "plan"

    @property
    def fixed_order_products(self) -> bool:
        """Whether a fused bias's ``W β`` is summed in enjoyln's fixed order (a hadamard rotation
        of version 3 or later), not by BLAS."""
        r = self.rotation
        return r is not None and r.kind == "hadamard" and r.version >= 3

    @property
    def rotations(self) -> list[Rotation]:
        """Every stream's rotation."""
        return ([self.rotation] if self.rotation is not None else []) + list(self.more_rotations)

    @property
    def changes(self) -> bool:
        """Whether the plan changes the model: a norm folds, or a stream rotates (a tower whose
        norms stay)."""
        return bool(self.foldable or self.rotation is not None)

    @property
    def affine_moved(self) -> list[LayerNormEntry]:
        """The norms whose γ and β move into their readers: folded ones, and norms that stay
        LayerNorms on a rotated stream (a rotation that keeps the mean commutes with a weightless
        LayerNorm)."""
        return [e for e in self.layer_norms if e.affine in (AFFINE_FUSED, AFFINE_GAIN)]

    def not_rotated(self) -> str:
        """Why no stream is rotated: the plan's notes that say so."""
        return (
            "; ".join(
                n for n in self.notes if getattr(n, "kind", "") in (NOT_ROTATED, STREAM_NOT_ROTATED)
            )
            or "the plan has no rotation"
        )

    @property
    def foldable(self) -> list[LayerNormEntry]:
        return [e for e in self.layer_norms if e.foldable]

    @property
    def centered(self) -> list[Centering]:
        """Every parameter to center, once, in a stable order."""
        return list(dict.fromkeys(c for e in self.foldable for c in e.centered))

    @property
    def fused(self) -> list[Fused]:
        return [f for e in self.affine_moved for f in e.fused]

    @property
    def format_version(self) -> int:
        """The oldest plan format that holds this plan: 2 once a norm is not a plain LayerNorm, 3
        with a rotation of version 2 (which an older reader would apply as a dense one), 4 with
        several streams rotated, an unfolded norm's affine moved, or outputs a rotation changes
        (which an older reader would miss), 5 with a rotation of version 3 (whose fused biases an
        older reader would recompute by BLAS), 6 with outputs changed (which an older reader's
        analysis, folding only where every output stays exact, would not confirm)."""
        if self.changed_outputs:
            return 6
        if self.fixed_order_products:
            return 5
        if (
            self.more_rotations
            or self.changed_outputs
            or self.exact_outputs != SERVED
            or any(not e.foldable for e in self.affine_moved)
        ):
            return 4
        if self.rotation is not None and self.rotation.version >= 2:
            return 3
        return 2 if any(not e.plain_form for e in self.layer_norms) else 1

    @property
    def untie_bytes(self) -> int:
        return sum(u.nbytes for u in self.untied)

    def note(self, kind: str) -> Note | None:
        return next((n for n in self.notes if getattr(n, "kind", "") == kind), None)

    def __getitem__(self, name: str) -> LayerNormEntry:
        return {e.name: e for e in reversed(self.layer_norms)}[
            name
        ]  # KeyError(name); the first of a name

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": self.format_version, **super().to_dict()}  # notes: plain strings

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Fields) -> "FoldPlan":
        """``ValueError`` naming the field at fault, ``PlanError`` for a plan a newer enjoyln
        wrote."""
        version = Fields(d, "plan").read("format_version", int, FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise PlanError(
                f"this plan has format version {version}; this enjoyln reads up to "
                f"{FORMAT_VERSION}, so upgrade enjoyln"
            )
        return super().from_dict(d)

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
            lines += [f"  {c.describe()}" for c in centered]
        lines += [
            f"Untie {u.param} from {u.tied_to}: +{format_bytes(u.nbytes)}" for u in self.untied
        ]
        lines += [f"Insert {a.describe()}" for a in self.auxiliary]
        for e in (e for e in self.layer_norms if e.foldable or e in self.affine_moved):
            if e.affine == AFFINE_KEPT:
                lines.append(f"Keep the affine of {e.name}: {e.affine_reason}")
            elif e.affine:
                what = (
                    "γ and β"
                    if e.affine == AFFINE_FUSED
                    else f"γ (β stays, as β/γ: {e.affine_reason})"
                )
                into = ", ".join(f.describe() for f in e.fused) or "nothing to move"
                lines.append(f"Fuse {what} of {e.name} into {into}")
        lines += [f"Rotate {r.describe()}: {len(r.rotated)} tensors" for r in self.rotations]
        if self.changed_outputs:
            lines.append(
                f"Outputs the model does not serve that change: {', '.join(self.changed_outputs)}"
            )
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)


def block_lists(plan: FoldPlan) -> dict[str, list[Any]]:
    """The lists a folded checkpoint's ``enjoyln`` block carries beside the plan, for readers that
    do not parse it; derived from the plan, so the static check can confirm them."""
    return {
        "rmsnorm": [e.name for e in plan.foldable],
        "centered": [c.to_dict() for c in plan.centered],
        "center_on_load": [c.param for c in plan.centered if not c.saved],
        "untied": [u.param for u in plan.untied],
        "auxiliary_centering": [a.to_dict() for a in plan.auxiliary],
    }
