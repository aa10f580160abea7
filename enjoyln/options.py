"""The options of a fold and of a check, typed, built once where a call enters enjoyln (the
command line, or a Python entry point) and handed on whole: a misspelt option fails there, in
one line, not deep inside.

>>> FoldOptions.of(check="static", fuse_affine=True).check.mode
'static'
>>> CheckOptions.of(batchs=3)
Traceback (most recent call last):
enjoyln.errors.EnjoylnError: unknown option batchs; the options are batches, batch_size, seq_len, seed, rtol, dtype, thorough, max_memory, device, mode, allow_pickle, trust_remote_code, model_class
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
    """How a model directory may be opened: pickle weights (read with ``weights_only``), the
    directory's own code, and the model class to build instead of the one config.json names."""

    allow_pickle: bool = False
    trust_remote_code: bool = False
    model_class: str | None = None


@dataclass(frozen=True)
class CheckOptions:
    """What ``enjoyln check`` (and the check inside ``fold``) runs.

    ``mode`` is ``"full"`` (every weight, then a forward comparison), ``"static"`` (weights only)
    or ``"forward"`` (outputs only, for candidates other tools made); ``batches`` (None: 2 short
    ones after the weight check, 3 with ``thorough`` or ``"forward"``), their ``batch_size``,
    ``seq_len`` and first ``seed``; ``rtol`` a fixed tolerance instead of the precision-aware one;
    ``dtype`` the dtype the candidate is meant to load in; ``thorough`` adds a batch over every
    position; ``max_memory`` (bytes) runs the models one at a time within that much; ``device``
    (``"cpu"``, ``"cuda"``, ``"cuda:1"``) is where the forward part runs."""

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
    access: Access = field(default_factory=Access)

    @classmethod
    def of(cls, options: "CheckOptions | None" = None, **values: Any) -> "CheckOptions":
        """``options`` with ``values`` set, refused in one line for a name that is no option."""
        return _built(cls, {**_fields(options), **values})


@dataclass(frozen=True)
class FoldOptions:
    """What ``enjoyln fold`` (``fold_checkpoint``) does: the plan (computed with
    ``auxiliary_centering``, ``fuse_affine`` and ``rotate``, or given as ``plan``), the output
    (``max_shard_size`` in bytes, ``force`` to replace an earlier output, ``dry_run`` to write
    nothing, ``keep_failed`` to keep a candidate that fails), and its check (``check``; mode
    ``"none"`` publishes unchecked)."""

    auxiliary_centering: bool = False
    fuse_affine: bool = False
    rotate: RotationSpec | None = None
    plan: FoldPlan | None = None
    max_shard_size: int | None = None
    force: bool = False
    dry_run: bool = False
    keep_failed: bool = False
    check: CheckOptions = field(default_factory=CheckOptions)
    access: Access = field(default_factory=Access)

    @classmethod
    def of(cls, options: "FoldOptions | None" = None, **values: Any) -> "FoldOptions":
        """``options`` with ``values`` set; ``check`` may be a mode name (``"static"``) and
        ``check_options`` a dict of ``CheckOptions`` values, as ``fold_checkpoint`` takes them."""
        base = _fields(options)
        check = values.pop("check", base.pop("check", None))
        extra = values.pop("check_options", None) or {}
        if isinstance(check, str):
            check = CheckOptions.of(mode=check)
        check = CheckOptions.of(check, **extra)
        if check.mode not in ("full", "static", "none"):
            raise EnjoylnError(f"unknown check mode {check.mode!r}; use one of full, static, none")
        values["rotate"] = RotationSpec.of(values.get("rotate", base.get("rotate")))
        return _built(cls, {**base, **values}, check=check)

    @property
    def checking(self) -> CheckOptions:
        """The options of the fold's own check: its directories opened as the fold opened them."""
        return dataclasses.replace(self.check, access=self.access)


def _fields(options: Any) -> dict[str, Any]:
    """An options object's fields, shallow (nested options stay objects)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)} if options is not None else {}
