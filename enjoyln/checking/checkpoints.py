"""``check_checkpoints``: the static check of one directory against another, then the forward
comparison through both ways a user may load the candidate, within a memory budget when needed."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CheckpointError, EnjoylnError
from ..options import CheckOptions
from ..units import format_bytes
from ..store.load import load, load_plain
from ..store.memory import (
    available_memory,
    config_value_dict,
    dominant_dtype,
    forward_check_bytes,
    truth_ratio,
)
from ..store.checkpoint import Checkpoint, open_checkpoint
from ..store.quiet import quiet
from ..store.tensors import return_freed_memory
from .compare import code_problems, load_problems, parse_dtype
from .batches import MAX_COVER_POSITIONS
from .forward import CandidatePath, ModelSource, check_sources
from .pairing import as_reference_holds, tensor_names, tied_key
from .sweep import sweep_bytes
from .report import CheckReport
from . import running
from .static import CODE_SCOPE, StaticReport, missing_note, static_check

MIN_BUDGET = 16 << 20
"""Room, beyond the largest tensor and one forward's activations, that a check within a budget
needs."""

CONFIRM_BATCHES = 2
"""Short batches of the forward part after the static proof (without ``--thorough``): it only
confirms."""

CONFIRM_TOKENS = 4
"""New tokens of the greedy decode after the static proof (8 otherwise): each streams every weight
once."""


def bounded_budget(checkpoint: Checkpoint) -> int | None:
    """None if both models fit in memory; else half of what is available, for one at a time."""
    need, have = forward_check_bytes(checkpoint), available_memory()
    return None if have is None or need <= have else have // 2


def require_memory(checkpoint: Checkpoint, max_memory: int | None = None) -> None:
    """Refuse, before anything is written, a forward check that cannot run even one model at a
    time."""
    have = available_memory()
    budget = max_memory if max_memory is not None else bounded_budget(checkpoint)
    if budget is None:
        return
    wide = truth_ratio(checkpoint)  # the truth runs too, one model at a time, in a wider dtype
    floor = int(wide * (_largest_tensor(checkpoint) + _activation_bytes(checkpoint))) + MIN_BUDGET
    if budget < floor or (have is not None and floor > have):
        limit = (
            f"--max-memory allows {format_bytes(budget)}"
            if max_memory is not None and budget < floor
            else f"{format_bytes(have)} is available"
            if floor > have
            else f"the budget is {format_bytes(budget)} (half of the {format_bytes(have)} "
            "available)"
        )
        raise CheckpointError(
            f"the forward check needs at least {format_bytes(floor)} of memory even with one "
            f"model at a time, but {limit}; pass --static to prove every weight without "
            "running the model (or --no-check)"
        )


def _largest_tensor(checkpoint: Checkpoint) -> int:
    return max(max((t.nbytes for t in checkpoint.tensors.values()), default=0), checkpoint.built[1])


def _activation_bytes(checkpoint: Checkpoint) -> int:
    """A generous bound on one forward's largest live tensors with one row of the coverage
    batch: the logits over the vocabulary, or a few hidden states; or one row of the token
    sweep's batch in float64, which is what a forward-only check within a budget runs."""
    cfg = checkpoint.config
    length = min(
        int(config_value_dict(cfg, "max_position_embeddings", "n_positions") or 512),
        MAX_COVER_POSITIONS,
    )
    hidden = int(config_value_dict(cfg, "hidden_size", "n_embd", "d_model") or 1024)
    vocab = int(config_value_dict(cfg, "vocab_size") or 0)
    return max(length * max(vocab, 4 * hidden) * 4, sweep_bytes(vocab, hidden, 1, rows=1)) + (
        32 << 20
    )


@quiet
def check_checkpoints(
    reference: str | os.PathLike | Checkpoint,
    candidate: str | os.PathLike | Checkpoint,
    options: CheckOptions | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    stage: Callable[[str], None] | None = None,
) -> "CheckReport":
    """Prove CANDIDATE computes what REFERENCE does: every weight, then the outputs through both
    load paths (docs/checking.md). Either may be an opened ``Checkpoint``, handed on.
    ``options``: a ``CheckOptions``; ``progress`` hears of the bytes the static part read,
    ``stage`` of each step of the forward part.
    >>> check_checkpoints("gpt2-dir", "gpt2-folded").passed  # doctest: +SKIP
    True
    """
    opts = options if options is not None else CheckOptions()
    if opts.mode not in ("full", "static", "forward"):
        raise EnjoylnError(f"unknown check mode {opts.mode!r}; use full, static or forward")
    opts = dataclasses.replace(opts, dtype=parse_dtype(opts.dtype))
    running.check_device(opts.device)
    opened = dataclasses.asdict(opts.access)
    ref_ck = (
        reference if isinstance(reference, Checkpoint) else open_checkpoint(reference, **opened)
    )
    cand_ck = (
        candidate if isinstance(candidate, Checkpoint) else open_checkpoint(candidate, **opened)
    )
    if ref_ck.architecture != cand_ck.architecture:
        hint = (
            ""
            if opts.access.model_class
            else " (one folded with --model-class is checked with the same --model-class)"
        )
        raise CheckpointError(
            f"{ref_ck.path} is a {ref_ck.architecture} but {cand_ck.path} is a "
            f"{cand_ck.architecture}{hint}"
        )
    if code := code_problems(ref_ck, cand_ck):  # before anything imports the candidate's code
        return _failed(
            CODE_SCOPE, code, "the candidate's code is not the reference's, so none of it was run"
        )
    budget = _budget(ref_ck, cand_ck, opts)
    stage = stage or (lambda what: None)
    if opts.mode != "forward":
        stage("checking every weight")
    static, early = _static_part(ref_ck, cand_ck, opts, progress)
    if early is not None:
        return early
    # the parameters neither directory holds: found by the static pairing, else missing on both
    # sides
    # (a name the candidate unties is still the reference's tensor, which it lacks)
    if static is not None or not cand_ck.missing:
        missing = static.missing if static is not None else []
    else:
        names = tensor_names(ref_ck.meta)
        missing = [n for n in cand_ck.missing if tied_key(ref_ck, names, n) is None]
    try:
        report = _forward_part(ref_ck, cand_ck, opts, budget, missing=missing, stage=stage)
    except _CandidateUnloadable as exc:
        report = _failed(
            "loading the candidate", [str(exc)], "enjoyln.load cannot load the candidate"
        )
    if static is not None:
        report.static, report.passed = static, report.passed and static.passed
    return report


def _budget(ref_ck: Checkpoint, cand_ck: Checkpoint, opts: CheckOptions) -> tuple[int | None, bool]:
    """(the memory the forward part may use, or None for both models in memory; whether that was
    decided here); a part that cannot fit is refused before any weight is read."""
    if opts.mode == "static":
        return None, False
    budget = opts.max_memory if opts.max_memory is not None else bounded_budget(ref_ck)
    budget = budget if budget is not None else bounded_budget(cand_ck)
    require_memory(ref_ck, budget)
    require_memory(cand_ck, budget)
    if budget is not None and opts.device != "cpu":
        raise CheckpointError(
            f"the forward check would run the models one at a time within "
            f"{format_bytes(budget)}, which runs on the CPU only; drop --device {opts.device}, "
            "or pass --static"
        )
    return budget, opts.max_memory is None


def _failed(scope: str, problems: list[str], why: str) -> CheckReport:
    return CheckReport.from_static(StaticReport(passed=False, problems=problems, scope=scope), why)


def _static_part(
    ref_ck: Checkpoint,
    cand_ck: Checkpoint,
    opts: CheckOptions,
    progress: Callable[[int, int], None] | None,
) -> tuple[StaticReport | None, CheckReport | None]:
    """(the static report, or None with --forward-only; the final report if the check ends here)."""
    if (
        opts.mode == "forward"
    ):  # no weight check, but the same dtype, and a block enjoyln.load reads
        try:
            cand_ck.recorded_plan
        except CheckpointError as exc:
            return None, _failed(
                "load settings", [str(exc)], "enjoyln.load cannot read the candidate's block"
            )
        problems = load_problems(ref_ck, cand_ck, opts.dtype)
        return None, (
            _failed("load settings", problems, "the candidate does not load as the reference does")
            if problems
            else None
        )
    static = static_check(ref_ck, cand_ck, progress=progress, dtype=opts.dtype)
    why = (
        "static check only"
        if opts.mode == "static"
        else "the weights already differ"
        if not static.passed
        else "the candidate is byte for byte the reference, so it loads and computes the same: "
        "there is nothing to run"
        if static.byte_identical
        else ""
    )
    return static, CheckReport.from_static(static, why) if why else None


def _forward_part(
    ref_ck: Checkpoint,
    cand_ck: Checkpoint,
    opts: CheckOptions,
    budget: tuple[int | None, bool],
    missing: list[str],
    stage: Callable[[str], None],
) -> CheckReport:
    """The outputs compared, with both models in memory or one at a time within ``budget``. Once
    every weight is proven (full mode, not thorough) it only confirms: short batches and a short
    decode."""
    confirm = opts.mode == "full" and not opts.thorough
    forward = _forward_options(opts, cand_ck, confirm)
    plain_required, caveat, note = _plain_loading(cand_ck, verified=opts.mode == "full")
    max_memory, auto = budget
    stage("loading the original and the candidate")
    bounded = (
        tempfile.TemporaryDirectory(prefix="enjoyln-offload-") if max_memory is not None else None
    )
    with bounded or contextlib.nullcontext():
        if bounded is None:
            ref_src, truth, cand_src, plain = _sources_in_memory(
                ref_ck, cand_ck, opts.device, missing, stage
            )
        else:
            ref_src, truth, cand_src, plain = _bounded_sources(
                ref_ck, cand_ck, max_memory, missing, Path(bounded.name)
            )
            forward = dataclasses.replace(forward, spill=True, max_rows=1)
        # enjoyln.load, and the plain loader unless the two are the same (plain_required None)
        paths = [CandidatePath("enjoyln.load", cand_src)] + (
            []
            if plain_required is None
            else [
                CandidatePath(
                    cand_ck.library.loader, plain, plain_required, batches=1 if confirm else None
                )
            ]
        )
        report = check_sources(ref_src, paths, None, forward, truth=truth, stage=stage)
    if bounded is not None:
        report.memory = (
            f"{'the two models would not fit in memory side by side, so ' if auto else ''}"
            f"the models ran one at a time within {format_bytes(max_memory)} "
            "(weights beyond it read from disk as each layer ran)"
        )
    report.caveat = caveat
    report.notes += [note] if note else []
    _add_notes(report, ref_ck, missing, confirm, plain_required is not None)
    return report


def _forward_options(opts: CheckOptions, cand_ck: Checkpoint, confirm: bool) -> CheckOptions:
    """The forward check's options: short batches and a short decode where it only confirms the
    proven weights, and the outputs the candidate's plan changes left out."""
    return dataclasses.replace(
        opts,
        batches=opts.batches if opts.batches is not None else CONFIRM_BATCHES if confirm else 3,
        coverage=not confirm if opts.coverage is None else opts.coverage,
        generate_tokens=(CONFIRM_TOKENS if confirm else 8)
        if opts.generate_tokens is None
        else opts.generate_tokens,
        sweep=opts.mode == "forward" if opts.sweep is None else opts.sweep,
        skip=_changed_outputs(cand_ck),
    )


def _sources_in_memory(
    ref_ck: Checkpoint,
    cand_ck: Checkpoint,
    device: str,
    missing: list[str],
    stage: Callable[[str], None],
) -> tuple[ModelSource, ModelSource, ModelSource, ModelSource]:
    """The reference, its truth, the candidate and its plain load, each loaded whole. Each model is
    freed after its runs: the reference becomes its own truth (widened in place), and the plain
    load comes from disk after the candidate's runs."""
    on = functools.partial(_on_device, device, stage)
    ref_src = ModelSource.given(on("the original", _load(load, ref_ck, missing)))
    cand_src = ModelSource.given(on("the candidate", _load(load, cand_ck, missing, candidate=True)))
    # a half-precision candidate of a float32 reference: the truth is the reference as stored
    truth = ModelSource(
        ref_src.dtype,
        lambda dtype: on("the original", _load(load, ref_ck, missing, dtype=dtype)),
        nbytes=ref_src.nbytes,
    )
    plain = ModelSource(
        cand_src.dtype,
        lambda dtype: on(
            "the candidate", _load(load_plain, cand_ck, missing, candidate=True, dtype=dtype)
        ),
        nbytes=cand_src.nbytes,
    )
    return ref_src, truth, cand_src, plain


def _add_notes(
    report: CheckReport, ref_ck: Checkpoint, missing: list[str], confirm: bool, plain: bool
) -> None:
    """What the report must say of parameters the weights lack, and of a check that only
    confirmed proven weights."""
    if missing:
        report.notes.append(
            f"{missing_note(as_reference_holds(ref_ck, missing))}; every model this check loaded "
            "got the same seeded values for exactly those, so they were compared like the rest"
        )
    if confirm:
        plain_too = " (plain loading on the first)" if plain else ""
        decoded = (
            report.generation is not None
        )  # the model generates: decided by the model, not its name
        report.notes.append(
            f"the static part proved every weight, so the forward part confirmed it on "
            f"{report.batches} short "
            f"batches{plain_too}{' and a greedy decode' if decoded else ''}; "
            "--thorough also runs a batch over every position and many token ids"
            f"{', and decodes 8 tokens' if decoded else ''}"
        )


def _on_device(device: str, stage: Callable[[str], None], what: str, model: nn.Module) -> nn.Module:
    if device == "cpu":
        return model
    stage(f"moving {what} to {device}")
    return model.to(device)


class _CandidateUnloadable(EnjoylnError):
    """The candidate's own files keep it from loading: a wrong candidate, not bad input."""

    exit_code = 1


def _load(
    loader: Callable[..., nn.Module],
    checkpoint: Checkpoint,
    missing: list[str],
    *,
    candidate: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """A model as ``loader`` gives it, with the parameters no checkpoint holds seeded alike."""
    try:
        return running.seed_missing(loader(checkpoint, **kwargs), missing)
    except EnjoylnError as exc:
        if candidate and not isinstance(exc, _CandidateUnloadable):
            raise _CandidateUnloadable(str(exc)) from None
        raise


def _plain_loading(checkpoint: Checkpoint, *, verified: bool) -> tuple[bool | None, str, str]:
    """(whether plain ``from_pretrained`` must match, the verdict's caveat, a note). Only a rotation
    without ``keep_mean`` is inexact under plain loading, and only a block that says so twice is
    believed."""
    plan = checkpoint.recorded_plan
    if plan is None:
        return (
            None,
            "",
            "the candidate has no enjoyln block, so enjoyln.load is plain from_pretrained",
        )
    block = checkpoint.config["enjoyln"].get("rotation")
    declared = (
        plan.rotation is not None
        and not plan.rotation.keep_mean
        and isinstance(block, dict)
        and block.get("keep_mean") is False
        and block.get("plain_loading_exact") is False
    )
    if not declared:
        return True, "", ""
    if verified:
        return (
            False,
            "",
            (
                "plain from_pretrained is reported but not required: the candidate is a rotation "
                "without keep_mean, which the static check verified, so its LayerNorms do not see "
                "a zero-mean stream"
            ),
        )
    return (
        False,
        (
            "judged through enjoyln.load only: the candidate's enjoyln block declares a rotation "
            "without "
            "keep_mean, under which plain from_pretrained is not exact, and --forward-only does "
            "not "
            "verify that declaration; run the full check"
        ),
        "",
    )


def _bounded_sources(
    ref_ck: Checkpoint, cand_ck: Checkpoint, max_memory: int, missing: list[str], offload: Path
) -> tuple[ModelSource, ...]:
    """(reference, truth, candidate, plain) holding one model at a time within ``max_memory``,
    weights read from disk as each layer runs (accelerate)."""
    if ref_ck.pickled or cand_ck.pickled:
        raise CheckpointError(
            "a check within a memory budget reads weights from safetensors files; convert "
            "pickle weights first, or pass --static"
        )
    if not ref_ck.library.bounded_loading:
        raise CheckpointError(
            f"{ref_ck.library.name} loads a model whole, so the check cannot run within a "
            "memory budget; pass --static to prove every weight without running the model"
        )
    return_freed_memory()
    overhead = _largest_tensor(ref_ck) + _activation_bytes(ref_ck)

    def source(
        checkpoint: Checkpoint, where: str, plain: bool = False, candidate: bool = False
    ) -> ModelSource:
        # the dtype a plain from_pretrained loads it in, which the static check compared
        own = getattr(torch, checkpoint.load_dtype[0], None)
        own = (
            own
            if isinstance(own, torch.dtype) and own.is_floating_point
            else dominant_dtype(checkpoint)
        )

        def get(dtype: torch.dtype) -> nn.Module:
            wide = dtype.itemsize / own.itemsize  # the truth: wider tensors, less room
            weights = max(max_memory - int(max(wide, 1.0) * overhead), 0)
            return _load(
                load_plain if plain else load,
                checkpoint,
                missing,
                candidate=candidate,
                dtype=dtype,
                max_memory=weights,
                offload_dir=offload / where / str(dtype),
            )

        # the truth widens the reference as its layers run: a float64 load of it from disk would
        # read the whole file through a mapping, and write it again, wider, to the offload folder
        return ModelSource(own, get, widens=not plain and not candidate)

    ref_src = source(ref_ck, "reference")
    return (
        ref_src,
        ref_src,
        source(cand_ck, "candidate", candidate=True),
        source(cand_ck, "plain", plain=True, candidate=True),
    )


def _changed_outputs(ck: Checkpoint) -> tuple[str, ...]:
    """The outputs the candidate's recorded plan changes by design (proved by the static check, or,
    with
    --forward-only, read from the block), which the forward check does not compare."""
    try:
        plan = ck.recorded_plan
    except CheckpointError:
        return ()
    return tuple(plan.changed_outputs) if plan is not None else ()
