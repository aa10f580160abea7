"""The options of a fold and of a check, built where a call enters enjoyln: a misspelt one fails there.

>>> FoldOptions.of(check="static", fuse_affine=True).check.mode
'static'
>>> CheckOptions.of(batchs=3)
Traceback (most recent call last):
enjoyln.errors.EnjoylnError: unknown option batchs; the options are batches, batch_size, seq_len, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import EnjoylnError
from .plan import FoldPlan, RotationSpec

ACCESS = ("allow_pickle", "trust_remote_code", "model_class")


def _built(cls: type, given: dict[str, Any], **more: Any) -> Any:
    """``cls`` from ``given``: the ``Access`` fields among them go to its ``access``."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in ("access", *more)]
    base = given.pop("access", None) or Access()
    access = {k: given.pop(k) for k in ACCESS if k in given}
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise EnjoylnError(f"unknown option {', '.join(unknown)}; the options are "
                           f"{', '.join(names + list(ACCESS))}")
    return cls(**given, **more, access=dataclasses.replace(base, **access))


@dataclass(frozen=True)
class Access:
    """How a model directory may be opened: pickle weights, its own code, another model class."""

    allow_pickle: bool = False
    trust_remote_code: bool = False
    model_class: str | None = None


@dataclass(frozen=True)
class CheckOptions:
    """What ``enjoyln check`` (and ``fold``'s check) runs; the fields are its options (docs/checking.md)."""

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
    """With mode ``forward``: the most token ids the token sweep runs (None: ``checking.sweep.SWEEP_TOKENS``)."""
    access: Access = field(default_factory=Access)

    @classmethod
    def of(cls, options: "CheckOptions | None" = None, **values: Any) -> "CheckOptions":
        return _built(cls, {**(vars(options) if options is not None else {}), **values})


@dataclass(frozen=True)
class FoldOptions:
    """What ``enjoyln fold`` (``fold_checkpoint``) does: the plan, the output and its check."""

    auxiliary_centering: bool = False
    fuse_affine: bool = False
    rotate: RotationSpec | None = None
    plan: FoldPlan | None = None
    max_shard_size: int | None = None
    dtype: str | None = None  # store the fold in this dtype (its check then judges it at that precision)
    force: bool = False
    dry_run: bool = False
    keep_failed: bool = False
    allow_missing: bool = False
    """Fold even where the weights lack parameters the model class builds (random on every load)."""
    check: CheckOptions = field(default_factory=CheckOptions)
    access: Access = field(default_factory=Access)

    @classmethod
    def of(cls, options: "FoldOptions | None" = None, **values: Any) -> "FoldOptions":
        """``check`` may be a mode name and ``check_options`` a dict, as ``fold_checkpoint`` takes them."""
        base = dict(vars(options)) if options is not None else {}
        check = values.pop("check", base.pop("check", None))
        if isinstance(check, str):
            check = CheckOptions(mode=check)
        check = CheckOptions.of(check, **(values.pop("check_options", None) or {}))
        if check.mode not in ("full", "static", "none"):
            raise EnjoylnError(f"unknown check mode {check.mode!r}; use one of full, static, none")
        values["rotate"] = RotationSpec.of(values.get("rotate", base.get("rotate")))
        return _built(cls, {**base, **values}, check=check)

    @property
    def checking(self) -> CheckOptions:
        """The fold's own check, its directories opened as the fold opened them, at the fold's dtype."""
        return dataclasses.replace(self.check, access=self.access, dtype=self.dtype or self.check.dtype)
