"""The options of a fold and of a check, built where a call enters enjoyln: a misspelt one fails
there. Each is the one way into its call (``fold_checkpoint``, ``check_checkpoints``, ``check``),
and each field has one home: ``--rtol`` is ``CheckOptions.rtol``, in a fold too
(``FoldOptions.check``).

>>> FoldOptions.of(check="static", fuse_affine=True).check.mode
'static'
>>> CheckOptions(batchs=3)
Traceback (most recent call last):
enjoyln.errors.EnjoylnError: unknown option batchs; the options are batches, batch_size, seq_len, ...
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from .errors import EnjoylnError
from .plan import SERVED, FoldPlan, RotationSpec, check_exact

ACCESS = ("allow_pickle", "trust_remote_code", "model_class")


T = TypeVar("T")


def _unknown(cls: type, given: Any, extra: tuple[str, ...] = ()) -> None:
    """One line naming what ``cls`` does not take, and what it does."""
    names = [f.name for f in dataclasses.fields(cls)] + list(extra)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise EnjoylnError(
            f"unknown option {', '.join(unknown)}; the options are {', '.join(names)}"
        )


def _strict(cls: type[T]) -> type[T]:
    """An unknown field is refused in one line (``EnjoylnError``), not with the ``TypeError`` of
    ``__init__``: a misspelt option reads the same from Python and from the command line."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **values: Any) -> None:
        _unknown(cls, values)
        init(self, *args, **values)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def _built(cls: type, given: dict[str, Any], **more: Any) -> Any:
    """``cls`` from ``given``: the ``Access`` fields among them go to its ``access``."""
    _unknown(cls, set(given) - set(more), ACCESS)
    base = given.pop("access", None) or Access()
    access = {k: given.pop(k) for k in ACCESS if k in given}
    return cls(**given, **more, access=dataclasses.replace(base, **access))


@_strict
@dataclass(frozen=True)
class Access:
    """How a model directory may be opened: pickle weights, its own code, another model class."""

    allow_pickle: bool = False
    trust_remote_code: bool = False
    model_class: str | None = None


@_strict
@dataclass(frozen=True)
class CheckOptions:
    """What ``enjoyln check`` (and ``fold``'s check, and ``enjoyln.check`` on models in memory)
    runs; the fields are its options (docs/checking.md). A field left None is decided by the
    check: on directories, by its mode (a full check, once every weight is proven, only
    confirms)."""

    batches: int | None = None
    batch_size: int = 2
    seq_len: int = 16
    seed: int = 0
    rtol: float | None = None
    dtype: str | None = None
    thorough: bool = False
    max_memory: int | None = None
    device: str = "cpu"
    mode: str = "full"
    sweep_tokens: int | None = None
    """With mode ``forward``: the most token ids the token sweep runs (None:
    ``checking.sweep.SWEEP_TOKENS``)."""
    factor: float | None = None
    """How many times the reference's own rounding the candidate may be off (None:
    ``measuring.FACTOR``)."""
    generate_tokens: int | None = None
    """Tokens decoded greedily by a causal LM (None: 8, or 4 where a full check only confirms)."""
    coverage: bool | None = None
    """Whether the first batch covers every position (None: unless a full check only confirms)."""
    sweep: bool | None = None
    """Whether to run the token sweep (None: in mode ``forward``)."""
    spill: bool = False
    """Keep the outputs on disk rather than in memory (set within a memory budget)."""
    max_rows: int = 4
    """The most rows of a sweep batch."""
    skip: tuple[str, ...] = ()
    """Outputs the candidate's plan lets its rotation change (a tower's hidden states), not
    compared; set by the checkpoint check from that plan, and never honoured for what the model
    serves."""
    access: Access = field(default_factory=Access)

    @classmethod
    def of(cls, options: "CheckOptions | None" = None, **values: Any) -> "CheckOptions":
        return _built(cls, {**(vars(options) if options is not None else {}), **values})


@_strict
@dataclass(frozen=True)
class FoldOptions:
    """What ``enjoyln fold`` (``fold_checkpoint``) does: the plan, the output and its check."""

    auxiliary_centering: bool = False
    fuse_affine: bool = False
    rotate: RotationSpec | None = None
    exact_outputs: str = SERVED
    """The outputs the fold keeps exact: ``"served"`` (logits, so generation) or ``"all"``; a
    rotation keeps ``rotate``'s."""
    plan: FoldPlan | None = None
    max_shard_size: int | None = None
    dtype: str | None = (
        None  # store the fold in this dtype (its check then judges it at that precision)
    )
    force: bool = False
    dry_run: bool = False
    keep_failed: bool = False
    allow_missing: bool = False
    """Fold even where the weights lack parameters the model class builds (random on every load)."""
    check: CheckOptions = field(default_factory=CheckOptions)
    access: Access = field(default_factory=Access)

    @classmethod
    def of(cls, options: "FoldOptions | None" = None, **values: Any) -> "FoldOptions":
        """``check`` may be a mode name and ``check_options`` a dict, as ``fold_checkpoint`` takes
        them."""
        base = dict(vars(options)) if options is not None else {}
        check = values.pop("check", base.pop("check", None))
        if isinstance(check, str):
            check = CheckOptions(mode=check)
        check = CheckOptions.of(check, **(values.pop("check_options", None) or {}))
        if check.mode not in ("full", "static", "none"):
            raise EnjoylnError(f"unknown check mode {check.mode!r}; use one of full, static, none")
        values["rotate"] = RotationSpec.of(values.get("rotate", base.get("rotate")))
        check_exact(values.get("exact_outputs", base.get("exact_outputs", SERVED)))
        return _built(cls, {**base, **values}, check=check)

    @property
    def checking(self) -> CheckOptions:
        """The fold's own check, its directories opened as the fold opened them, at the fold's
        dtype."""
        return dataclasses.replace(
            self.check, access=self.access, dtype=self.dtype or self.check.dtype
        )
