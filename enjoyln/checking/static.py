"""The static check: prove a checkpoint is the fold plan applied to another, tensor by tensor, with
no model in memory (docs/checking.md); config, files, dtype, code and plan are compared in
``checking.compare``."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

from .._version import __version__
from ..errors import CheckpointError, EnjoylnError
from ..plan import ALL_OUTPUTS, SERVED, FoldPlan, RotationSpec
from ..folded.config import output_config
from ..folded.planning import analyze_dir, moves_values
from ..store.hf import check_shapes
from ..store.checkpoint import Checkpoint
from ..folded.stream import StreamedTensors
from ..store.tensors import TensorReader
from .compare import (
    code_problems,
    config_problems,
    file_problems,
    identical_directories,
    load_problems,
    parse_dtype,
    plan_problems,
    same_json,
)
from .pairing import Pair, as_reference_holds, pair_tensors, still_tied, tensor_names, tied_key
from .verify import Difference, Verdicts, Verifier


@dataclass
class StaticReport:
    """What the static check verified, and every problem it found (empty when it passed)."""

    passed: bool
    tensors: int = 0
    identical: int = 0
    centered: int = 0
    untied: int = 0
    computed: int = 0
    """With a fused affine or a rotation: tensors recomputed from the reference, and equal."""
    bytes_read: int = 0
    seconds: float = 0.0
    form: str = ""
    """'folded' (the plan applied) or 'identical' (the candidate is the reference)."""
    plan: str = ""
    """Where the plan came from: 'recorded' (the enjoyln block, confirmed) or 'analysis'."""
    problems: list[str] = field(default_factory=list)
    scope: str = "static check"
    """What was checked: every weight and file, or (with ``--forward-only``) the load settings
    only."""
    byte_identical: bool = False
    missing: list[str] = field(default_factory=list)
    """Parameters the model class builds that neither checkpoint holds (random on every load)."""
    differing: int = 0
    """Tensors that are not what they must be (each has a line in ``problems``)."""
    plan_problems: int = 0
    """How many of the first problems are about the plan the candidate records (not confirmed, or
    its config unlike the one it gives), counted only where the tensors were judged without that
    plan, so that their differences are its symptoms; 0 otherwise."""
    first_differing: str = ""
    """The line of the first of them, in the candidate's file order."""
    first_difference: Difference | None = None
    """Where that one differs, and by how much (None for another dtype or shape)."""
    lacking: list[str] = field(default_factory=list)
    """The same, counted as the reference's model holds them (its tied names once), as the fold
    counts them."""
    swapped: bool = False
    """Failed, with a reference that records a fold by enjoyln and a candidate that records none:
    most likely the two given in the wrong order."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.scope != "static check":
            return "\n".join(
                [f"{verdict}: {self.scope}"] + [f"  [FAIL] {p}" for p in self.problems]
            )
        kinds = (
            f"{self.computed} recomputed with the fused affine and rotation"
            if self.computed
            else f"{self.identical} identical, {self.centered} centered, {self.untied} untied"
        )
        what = (
            f"{self.tensors} tensors verified ({kinds}), {self.bytes_read / 1e6:.1f} MB read "
            "in "
            f"{self.seconds:.2f} s"
        )
        lines = [f"{verdict}: static check, {what}"]
        if self.byte_identical:
            lines.append(
                "  the candidate is byte for byte the reference: every file a loader reads is the "
                "same"
            )
        elif self.form:
            what = (
                "the plan applied to the reference"
                if self.form == "folded"
                else "identical to the reference"
            )
            # a failed check proved nothing about the candidate: say only what it was held to
            lines.append(
                f"  the candidate is {what} (plan: {self.plan})"
                if self.passed
                else f"  compared with {what} (plan: {self.plan})"
            )
        if self.differing:
            lines.append(f"  {self.differing} of {self.tensors} tensors differ")
        lines += [f"  note: {missing_note(self.lacking)}"] if self.lacking else []
        lines += [f"  [FAIL] {p}" for p in self.problems[:20]]
        lines += (
            [f"  ... and {len(self.problems) - 20} more problems"]
            if len(self.problems) > 20
            else []
        )
        return "\n".join(lines)


def missing_note(names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{len(names)} parameter{'s' if len(names) > 1 else ''} of the model class ({shown}) "
        f"{'are' if len(names) > 1 else 'is'} in neither checkpoint, so transformers initialises "
        f"{'them' if len(names) > 1 else 'it'} at random on every load"
    )


CODE_SCOPE = "remote code, compared before any of the candidate's code runs (none of it ran)"


@dataclass
class _Resolved:
    """The plan a candidate is held to, and what its config.json must be under each form."""

    plan: FoldPlan
    source: str
    recorded: FoldPlan | None
    problems: list[str] = field(default_factory=list)
    as_reference: list[str] = field(default_factory=list)
    as_folded: list[str] = field(default_factory=list)
    unconfirmed: bool = False
    """The recorded plan is not what the analysis gives (or the analysis failed)."""


def static_check(
    ref: Checkpoint,
    cand: Checkpoint,
    *,
    progress: Callable[[int, int], None] | None = None,
    dtype: Any = None,
) -> StaticReport:
    """Verify, without running either model, that ``cand`` is ``ref`` with its fold plan applied (a
    recorded plan held to a fresh analysis); ``dtype`` accepts a candidate that loads in that dtype
    instead.
    >>> static_check(open_checkpoint("gpt2"), open_checkpoint("gpt2-folded")).passed  # doctest: +SKIP
    True
    """  # noqa: E501
    start = time.perf_counter()
    dtype = parse_dtype(dtype)
    if identical_directories(ref, cand):
        # the same files load the same, but perhaps not in the dtype the caller says the candidate
        # is for
        problems = load_problems(ref, cand, dtype) if dtype is not None else []
        return StaticReport(
            passed=not problems,
            tensors=len(ref.tensors),
            identical=len(ref.tensors),
            form="identical",
            byte_identical=True,
            problems=problems,
            plan="none needed: every file is the reference's, byte for byte",
            bytes_read=2 * ref.nbytes,
            seconds=time.perf_counter() - start,
        )
    if code := code_problems(ref, cand):  # before cand.meta imports any of it
        return StaticReport(passed=False, problems=code, scope=CODE_SCOPE)
    check_shapes(ref)
    check_shapes(cand)
    resolved = _resolve_plan(ref, cand, dtype)
    # read before any weight, so a bad file is refused first; reported after the weights
    files = load_problems(ref, cand, dtype) + file_problems(ref, cand)
    pairs, unpaired, missing = pair_tensors(resolved.plan, ref, cand)
    resolved.problems += unpaired
    readers = TensorReader(ref), TensorReader(cand)
    try:
        verdicts = _verify(resolved, pairs, (ref, cand), readers, dtype, progress)
        judged = _judge(
            resolved, verdicts, files, moved=moves_values(resolved.plan)
        )  # may read a tensor again
    finally:
        for reader in readers:
            reader.close()
    return dataclasses.replace(
        judged,
        missing=missing,
        lacking=as_reference_holds(ref, missing),
        swapped=not judged.passed and _records_fold(ref) and "enjoyln" not in cand.config,
        bytes_read=sum(r.bytes_read for r in readers),
        seconds=time.perf_counter() - start,
    )


def _records_fold(ck: Checkpoint) -> bool:
    """Whether ``ck`` records a fold's plan (an empty or malformed block records none)."""
    try:
        return ck.recorded_plan is not None
    except CheckpointError:
        return False


def _resolve_plan(ref: Checkpoint, cand: Checkpoint, dtype: str | None) -> _Resolved:
    """The plan the candidate is held to: a recorded one confirmed by this enjoyln's analysis, or
    that analysis."""
    try:
        recorded, problems = cand.recorded_plan, []
    except CheckpointError as exc:  # a block no fold writes: a wrong candidate, judged without it
        recorded, problems = None, [str(exc)]
    if recorded is None:
        return _unrecorded(ref, cand, dtype, problems)
    if "enjoyln" in ref.config and same_json(ref.config["enjoyln"], cand.config["enjoyln"]):
        as_reference = config_problems(ref.config, cand.config, dtype)
        return _Resolved(
            FoldPlan(type(ref.meta).__name__),
            "none: the candidate carries the reference's own "
            "enjoyln block, so it must be a copy of it",
            None,
            [],
            as_reference,
            as_reference,
        )
    return _recorded(ref, cand, recorded, dtype)


def _unrecorded(
    ref: Checkpoint, cand: Checkpoint, dtype: str | None, problems: list[str]
) -> _Resolved:
    """Without a recorded plan the candidate is judged later against the form it has: the reference,
    or the fold."""
    out = _Resolved(FoldPlan(type(ref.meta).__name__), "none (the analysis failed)", None, problems)
    with contextlib.suppress(EnjoylnError):
        out.plan, out.source = _analysis(ref, None), "analysis"
    out.as_reference = config_problems(ref.config, cand.config, dtype)
    # the fold's config.json as transformers saves it: without the enjoyln block
    out.as_folded = (
        config_problems(
            {k: v for k, v in output_config(ref, out.plan).items() if k != "enjoyln"},
            cand.config,
            dtype,
        )
        if out.plan.changes
        else out.as_reference
    )
    return out


def _recorded(
    ref: Checkpoint, cand: Checkpoint, recorded: FoldPlan, dtype: str | None
) -> _Resolved:
    """A recorded plan, confirmed by the analysis, and the block it must be written as. The tensors
    are never judged by a recorded plan it does not confirm, whose centerings may not even
    apply."""
    out = _Resolved(FoldPlan(type(ref.meta).__name__), "recorded", recorded)
    try:
        analysed: FoldPlan | None = _analysis(ref, recorded)
    except EnjoylnError as exc:
        analysed = None
        out.problems.append(
            f"cannot confirm the recorded plan: the analysis of the reference failed ({exc})"
        )
    out.problems += plan_problems(recorded, analysed or out.plan, _unconfirmed_hint(cand))
    out.unconfirmed = bool(out.problems)
    out.problems += config_problems(output_config(ref, analysed or recorded), cand.config, dtype)
    if out.problems:
        out.plan = analysed or out.plan
    else:
        out.plan, out.source = recorded, "recorded, confirmed by the analysis"
    return out


def _unconfirmed_hint(cand: Checkpoint) -> str:
    """What to do about a recorded plan this analysis does not give: another version made it, or
    (made by this one) it was made from another model than the reference, such as a directory
    already folded or rotated (a rotation of a fold records the plan of its own source)."""
    if cand.config["enjoyln"].get("version") != __version__:
        return "fold again with this version"
    return (
        "it was made from another model than this reference (a directory already folded or "
        "rotated, say): check it against that one, or against this one with --forward-only"
    )


def _analysis(ref: Checkpoint, recorded: FoldPlan | None) -> FoldPlan:
    """The analysis with the options the recorded plan was made with."""
    if recorded is None:
        return analyze_dir(ref, auxiliary_centering=False)
    r = (
        recorded.rotation
    )  # the first stream rotated has the user's seed; the others' are derived from it
    options = {
        "auxiliary_centering": bool(recorded.auxiliary),
        "fuse_affine": any(e.affine for e in recorded.layer_norms),
        "rotate": RotationSpec(r.kind, r.seed, r.keep_mean, r.version, recorded.exact_outputs)
        if r
        else None,
        "exact_outputs": recorded.exact_outputs,
    }
    plan = analyze_dir(ref, **options)
    if plan.to_dict() == recorded.to_dict():
        return plan
    return next(
        (p for p in _older_analyses(ref, recorded, options) if p.to_dict() == recorded.to_dict()),
        plan,
    )


def _older_analyses(
    ref: Checkpoint, recorded: FoldPlan, options: dict[str, Any]
) -> Iterator[FoldPlan]:
    """The analyses that may have made ``recorded`` beside the one its options name:
    --auxiliary-centering that placed none, which leaves a trace only in the plan's notes and
    reasons; a fold by an enjoyln before plan format 6, which kept every output exact whatever
    the plan says (its ``exact_outputs`` was the rotation's alone)."""
    if not recorded.auxiliary:
        other = analyze_dir(ref, **{**options, "auxiliary_centering": True})
        if not other.auxiliary:
            yield other
    if recorded.exact_outputs == SERVED:
        for aux in [bool(recorded.auxiliary)] + ([True] if not recorded.auxiliary else []):
            other = analyze_dir(
                ref, **{**options, "auxiliary_centering": aux, "exact_outputs": ALL_OUTPUTS}
            )
            if aux == bool(recorded.auxiliary) or not other.auxiliary:
                yield dataclasses.replace(other, exact_outputs=recorded.exact_outputs)


def _verify(
    resolved: _Resolved,
    pairs: list[Pair],
    checkpoints: tuple[Checkpoint, Checkpoint],
    readers: tuple[TensorReader, TensorReader],
    dtype: str | None,
    progress: Callable[[int, int], None] | None,
) -> Verdicts:
    """Every paired tensor judged; a fused affine's or a rotation's recomputed from the reference by
    the fold's own code (and, for a candidate in another dtype, from the reference cast)."""
    plan, (ref, cand) = resolved.plan, checkpoints
    expected = cast = None
    if moves_values(plan) and not resolved.problems:
        expected = StreamedTensors(ref, plan, reader=readers[0])
        if dtype is not None:
            cast = lambda: StreamedTensors(ref, plan, reader=readers[0], dtype=dtype)  # noqa: E731
    names = tensor_names(ref.meta)

    def read_param(name: str) -> torch.Tensor:  # a LayerScale gain a centering divides by
        key = tied_key(ref, names, name)
        if key is None:
            raise CheckpointError(
                f"the reference has no tensor for {name}, which the plan's centering reads"
            )
        return readers[0].read(key)

    verdicts = Verifier(
        *readers,
        read_param,
        dtype=dtype,
        unrecorded=resolved.recorded is None,
        expected=expected,
        cast_expected=cast,
    ).run(pairs, progress)
    verdicts.not_folded[:0] = still_tied(plan, cand.meta)
    return verdicts


def _judge(resolved: _Resolved, v: Verdicts, files: list[str], *, moved: bool) -> StaticReport:
    """The verdict. Without a recorded plan the candidate may be the reference itself or the whole
    plan applied; anything in between is judged against whichever form it is closer to."""
    unrecorded = resolved.recorded is None
    identical = (
        not moved
        and unrecorded
        and (not v.not_identical or len(v.not_identical) < len(v.not_folded))
    )
    first = (
        (v.first_unlike_reference() if v.first_unlike_reference else None)
        if identical
        else v.first_unlike_fold
    )
    problems = (
        resolved.problems
        + (
            v.not_identical + resolved.as_reference
            if identical
            else v.not_folded + (resolved.as_folded if unrecorded else [])
        )
        + files
    )
    return StaticReport(
        passed=not problems,
        tensors=v.tensors,
        identical=v.identical,
        centered=v.centered,
        untied=v.untied,
        computed=v.computed,
        form="identical" if identical else "folded",
        plan=resolved.source,
        problems=problems,
        differing=v.unlike_reference if identical else v.unlike_fold,
        # the tensors were judged without the recorded plan: an unconfirmed one, or a plan that
        # moves values, which is recomputed only where nothing else is wrong (_verify)
        plan_problems=(
            len(resolved.problems) if resolved.unconfirmed or (moved and resolved.problems) else 0
        ),
        first_differing=first[0] if first else "",
        first_difference=first[1] if first else None,
    )
