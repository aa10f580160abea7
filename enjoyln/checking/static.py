"""The static check: prove a checkpoint is the fold plan applied to another, weight by weight.

No forward pass and no model in memory: both directories are streamed tensor
by tensor, so it runs at disk speed and fits any size. Every tensor the
candidate's model loads is accounted for:

- an unchanged tensor is byte-identical to the reference's (or equal to it
  cast exactly, for a half-precision candidate of a float32 reference or a
  wider float; no other change of dtype is accepted);
- a centered tensor equals the reference's, centered in float64 and cast to
  its dtype, to within that dtype's rounding;
- an untied head equals the tensor it was tied to;
- the candidate loads in the reference's dtype (config, index metadata or
  first weight), unless the caller names another one (``dtype``), and then
  in that one;
- the candidate's config.json, as parsed JSON values, is the reference's
  with exactly what the confirmed plan writes (the ``enjoyln`` block, an
  untied head); only the writing tool's version in the block is taken on
  trust;
- every other file is what a fold of the reference holds: the same set of
  files, each the reference's by content (JSON by value), whatever its name;
- the recorded plan is what this enjoyln's analysis gives for the config.

Config, files, dtype, code and plan are compared in ``checking.compare``; this
module reads and compares the tensors.

It is not independent of the fold: it reads both directories through ``store/``
(``TensorReader``), plans with the fold's own analysis (``store.expected``), and
computes the tensors it expects with the fold's own tensor math (centering, and
fused and rotated tensors through ``StreamedTensors``, in float64). What it proves
is that the candidate on disk is exactly what this enjoyln's plan and arithmetic
make of the reference; the forward check, which runs both models, is the part that
does not rely on that arithmetic.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CheckpointError, EnjoylnError
from ..ops.center import same_memory
from ..ops.compare import same_bytes
from ..plan import Centering, FoldPlan, RotationSpec
from ..store.block import recorded_plan
from ..store.expected import analyze_dir, moves_values
from ..store.formats import load_pickled
from ..store.hf import check_shapes, checkpoint_key, saved_names
from ..store.model_dir import ModelDir, meta_model
from ..store.stream import StreamedTensors
from ..store.tensors import Buffer, TensorReader, read_ahead
from ..transform.tensors import center_, centered_equal, merge_centerings, tie_groups
from .compare import (code_problems, config_problems, expected_config, file_problems, load_problems, parse_dtype,
                      plan_problems)


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
    """What was checked: every weight and file, or (with ``--forward-only``) the load settings only."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.scope != "static check":
            return "\n".join([f"{verdict}: {self.scope}"] + [f"  [FAIL] {p}" for p in self.problems])
        kinds = (f"{self.computed} recomputed with the fused affine and rotation" if self.computed else
                 f"{self.identical} identical, {self.centered} centered, {self.untied} untied")
        what = f"{self.tensors} tensors verified ({kinds}), {self.bytes_read / 1e6:.1f} MB read in {self.seconds:.2f} s"
        lines = [f"{verdict}: static check, {what}"]
        if self.form:
            lines.append(f"  the candidate is {'the plan applied to the reference' if self.form == 'folded' else 'identical to the reference'}"
                         f" (plan: {self.plan})")
        lines += [f"  [FAIL] {p}" for p in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"  ... and {len(self.problems) - 20} more problems")
        return "\n".join(lines)


def center_as_planned(t: torch.Tensor, cs: list[Centering], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """``t`` centered in place as ``cs`` say (per-head centerings of one weight come as several),
    by the very function the fold uses (float64 arithmetic, one block at a time, so no wide copy
    of the whole tensor). ``read`` gives a LayerScale gain by parameter name."""
    for c in cs:
        center_(t, c.axis, c.groups, scale=read(c.scale) if c.scale else None, blocks=c.blocks)
    return t


_ELEMENTS = 1 << 21


def _close(expected: torch.Tensor, cand: torch.Tensor, scale: Callable[[], float], *,
           exact: bool = True) -> tuple[bool, float]:
    """``expected`` rounded to the candidate's dtype against the candidate; (equal, max abs diff).

    In the reference's own dtype the candidate must be bit for bit what the fold computes: the
    fold and this check run the same float64 code, which gives the same bits on every x86
    capability and thread count, and one ulp of a bfloat16 bias moves the logits by 1e-3. Only a
    candidate in another dtype (``exact`` False, ``--dtype``) may sit one ulp of that dtype off,
    plus float64 noise of the input's scale (``scale()``, the largest magnitude before
    centering): it may have been centered after the cast, which rounds twice. That bound is per
    element, since one relative to the whole tensor's maximum would let a small element move by
    many of its own ulps.
    """
    if expected.shape != cand.shape:
        return False, math.inf
    rounded = expected.to(cand.dtype)
    if same_bytes(rounded, cand):
        return True, 0.0
    if not cand.is_floating_point():
        return False, math.inf
    diff, bound_scale = 0.0, None
    for e, c in zip(expected.reshape(-1).split(_ELEMENTS), cand.reshape(-1).split(_ELEMENTS)):
        if same_bytes(e.to(c.dtype), c):
            continue
        d = c.to(torch.float64).sub_(e.to(torch.float64)).abs_()
        diff = max(diff, float(d.nan_to_num(math.inf).max()))
        if exact:
            continue  # keep reading, to report the largest difference
        bound_scale = scale() if bound_scale is None else bound_scale
        info = torch.finfo(c.dtype)
        bound = e.to(torch.float64).abs_().clamp_min_(info.tiny).mul_(info.eps).add_(1e-12 * bound_scale)
        if not bool(d.le(bound).all()):
            return False, diff
    return not exact, diff


def code_report(problems: list[str]) -> StaticReport:
    """The verdict on a candidate whose remote code is not the reference's: none of it was run."""
    return StaticReport(passed=False, problems=problems,
                        scope="remote code, compared before any of the candidate's code runs (none of it ran)")


def _options(recorded: FoldPlan | None) -> dict[str, Any]:
    """The analysis options a recorded plan was made with."""
    if recorded is None:
        return {"auxiliary_centering": False}
    r = recorded.rotation
    return {"auxiliary_centering": bool(recorded.auxiliary),
            "fuse_affine": any(e.affine for e in recorded.layer_norms),
            "rotate": RotationSpec(r.kind, r.seed, r.keep_mean) if r else None}


def _names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter or persistent buffer name -> all names of the same tensor."""
    by_id: dict[int, list[str]] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for name, t in list(model.named_parameters(remove_duplicate=False)) + [
            (n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent]:
        by_id.setdefault(id(t), []).append(name)
    return {n: tuple(names) for names in by_id.values() for n in names}


def static_check(ref: ModelDir, cand: ModelDir, *, plan: FoldPlan | None = None,
                 progress: Callable[[int, int], None] | None = None, dtype: Any = None) -> StaticReport:
    """Verify, without running either model, that ``cand`` is ``ref`` with its fold plan applied.

    ``plan`` is the plan the fold used, when the caller knows it (the check
    inside ``fold_checkpoint``); otherwise the reference is analysed, and a
    plan recorded in the candidate must agree with that analysis. ``dtype``
    (``"float16"``, ``torch.bfloat16``) accepts a candidate that loads in that
    dtype instead of the reference's, its tensors stored as the reference's
    cast to it.

    >>> static_check(open_model_dir("gpt2"), open_model_dir("gpt2-folded")).passed  # doctest: +SKIP
    True
    """
    start = time.perf_counter()
    dtype = parse_dtype(dtype)
    if code := code_problems(ref, cand):  # before meta_model(cand) imports any of it
        return code_report(code)
    report = StaticReport(passed=False)
    problems = report.problems
    recorded = recorded_plan(cand)
    analysed = plan is not None
    ref_model, cand_model = meta_model(ref), meta_model(cand)
    check_shapes(ref, ref_model)
    check_shapes(cand, cand_model)
    if plan is None:
        try:
            plan = analyze_dir(ref, ref_model, **_options(recorded))
            if recorded is not None and not recorded.auxiliary and plan.to_dict() != recorded.to_dict():
                # --auxiliary-centering that placed none leaves a trace only in the plan's notes
                # and reasons, which the block must still match: the analysis with it may
                other = analyze_dir(ref, ref_model, **{**_options(recorded), "auxiliary_centering": True})
                plan = other if not other.auxiliary and other.to_dict() == recorded.to_dict() else plan
            report.plan, analysed = "analysis", True
        except EnjoylnError as exc:
            if recorded is not None:
                problems.append(f"cannot confirm the recorded plan: the analysis of the reference failed ({exc})")
            plan = FoldPlan(type(ref_model).__name__)
            report.plan = "none (the analysis failed)"
    if recorded is not None:
        problems += plan_problems(recorded, plan)
        # the block must be what the fold writes for the plan this enjoyln confirms: every claim
        # in it (rotation.plain_loading_exact, the lists beside the plan) follows from that plan
        problems += config_problems(expected_config(ref, plan if analysed else recorded, block=True),
                                     cand.config, dtype)
        plan, report.plan = recorded, "recorded, confirmed by the analysis" if not problems else "recorded"
    else:  # judged below against the form the candidate has: the reference, or the plan applied
        as_reference = config_problems(ref.config, cand.config, dtype)
        as_folded = (config_problems(expected_config(ref, plan, block=False), cand.config, dtype)
                     if plan.foldable else as_reference)
    # read before any weight, so a bad file is refused first; reported after the weights
    files = load_problems(ref, cand, dtype) + file_problems(ref, cand)

    ref_names, cand_names = _names(ref_model), _names(cand_model)
    centerings: dict[str, list[Centering]] = {}
    for c in plan.centered:
        if c.saved:  # a non-persistent buffer is not in any checkpoint; load centers it
            centerings.setdefault(c.param, []).append(c)
    untied = {u.param for u in plan.untied}
    ref_groups = tie_groups(ref_model, untied)
    reader_ref, reader_cand = _reader(ref), _reader(cand)
    ref_keys, cand_keys = reader_ref.keys(), reader_cand.keys()
    prefix = getattr(ref_model, "base_model_prefix", "") or ""
    saved_ref, saved_cand = saved_names(ref_model), saved_names(cand_model)

    def ref_key(name: str) -> str | None:
        for alias in (name, *ref_names.get(name, ())):
            key = checkpoint_key(alias, ref_keys, prefix, saved_ref)
            if key is not None:
                return key
        return None

    def read_param(name: str) -> torch.Tensor:
        key = ref_key(name)
        if key is None:
            raise CheckpointError(f"the reference has no tensor for {name}, which the plan's centering reads")
        return reader_ref.read(key)

    # one entry per tensor the candidate's model loads: (candidate key, reference key, centerings)
    todo: dict[str, tuple[str, Centering | None, bool]] = {}
    for name, aliases in cand_names.items():
        if name != aliases[0]:
            continue  # a tied alias: the same tensor, checked once
        ck = next((k for a in aliases if (k := checkpoint_key(a, cand_keys, prefix, saved_cand))), None)
        rk = ref_key(name)
        if ck is None:
            if rk is not None:
                problems.append(f"the candidate has no tensor for {name}; loading it would initialise it at random")
            continue
        if rk is None:
            problems.append(f"the candidate's {ck} has no counterpart in the reference")
            continue
        # the reference's tied names are one tensor, centered once for all of them, even where
        # the candidate stores them apart (an untied config no longer ties BART's shared table)
        names = dict.fromkeys((*aliases, *(a for n in aliases for a in ref_groups.get(n, (n,)))))
        c = merge_centerings([x for a in names if a in centerings for x in centerings[a]]) or None
        todo[ck] = (rk, c, any(a in untied for a in aliases))
    for key in sorted(cand_keys - todo.keys()):  # stored but not loaded: must still be the reference's
        if key in ref_keys:
            todo[key] = (key, None, False)
        else:
            problems.append(f"the candidate holds {key}, which neither its model nor the reference has")
    for key in sorted(ref_keys - cand_keys - {rk for rk, _, _ in todo.values()}):
        problems.append(f"the candidate lacks the reference's tensor {key}")

    # A fused affine or a rotation computes tensors from other tensors: each is recomputed from
    # the reference tensors it depends on, by the code the fold used, when its turn comes.
    expected = (StreamedTensors(ref, plan, ref_model, reader=reader_ref) if moves_values(plan) and not problems
                else None)
    if expected is not None:
        report.form = "folded"
    total = sum(reader_cand.nbytes(k) if cand.tensors else 0 for k in todo)
    not_identical: list[str] = []
    # whatever the plan says it was tied to: a tie to anything means the head follows a centering
    not_folded = [f"the candidate still ties {u.param} to {others[0]}, so centering one changes the other"
                  for u in plan.untied if (others := [a for a in cand_names.get(u.param, ()) if a != u.param])]

    def plan_of(item: tuple[str, tuple[str, list[Centering] | None, bool]]) -> tuple[bool, bool]:
        """(read the reference, read the candidate) for one tensor."""
        ck, (rk, _, _) = item
        comparable = (_cast_allowed(reader_ref.dtype(rk), reader_cand.dtype(ck), dtype)
                      and reader_ref.shape(rk) == reader_cand.shape(ck))
        return comparable and expected is None, comparable and (expected is None or ck in expected)

    # two buffers a side: one holds the tensor being compared, the other the one read ahead
    buffers = [(Buffer(), Buffer()), (Buffer(), Buffer())]

    def load(job: tuple[int, tuple[str, tuple[str, list[Centering] | None, bool]]]):
        i, item = job
        ck, (rk, _, _) = item
        want_ref, want_cand = plan_of(item)
        into_ref, into_cand = buffers[i % 2]
        if not (want_ref and want_cand):
            return (reader_ref.read(rk, into_ref) if want_ref else None,
                    reader_cand.read(ck, into_cand) if want_cand else None)
        cand_read = side.submit(reader_cand.read, ck, into_cand)  # the two files read at once
        return reader_ref.read(rk, into_ref), cand_read.result()

    def size(job: tuple[int, tuple[str, tuple[str, list[Centering] | None, bool]]]) -> int:
        ck, (rk, _, _) = item = job[1]
        want_ref, want_cand = plan_of(item)
        return want_ref * reader_ref.nbytes(rk) + want_cand * reader_cand.nbytes(ck)

    # the candidate's files front to back, each tensor's successor read while it is compared
    order = sorted(todo.items(), key=lambda item: reader_cand.offset(item[0]))
    done = 0
    side = ThreadPoolExecutor(1, thread_name_prefix="enjoyln-read")
    try:
        if expected is None:  # first, everything both files can prove without a copy; the rest is read
            decided = _mapped_verdicts(order, reader_ref, reader_cand, read_param, recorded is None)
            for ck, (identical, folded) in decided.items():
                rk, c, is_untied = todo[ck]
                report.tensors += 1
                report.identical += identical and c is None
                report.centered += bool(c)
                report.untied += is_untied
                if not identical:
                    not_identical.append(f"{ck} differs from the reference's {rk}")
                done += reader_cand.nbytes(ck)
                if progress is not None:
                    progress(done, total)
            order = [item for item in order if item[0] not in decided]
        for (_, (ck, (rk, c, is_untied))), (r, t) in read_ahead(enumerate(order), load, size):
            ref_dtype, cand_dtype = reader_ref.dtype(rk), reader_cand.dtype(ck)
            same_dtype = ref_dtype == cand_dtype
            shape_ok = reader_ref.shape(rk) == reader_cand.shape(ck)
            diff, recast = None, None
            if not _cast_allowed(ref_dtype, cand_dtype, dtype):
                # the reference cast to int8 or float8 compares equal to a candidate that lost
                # almost everything; loaded into the model's dtype, it would run
                recast = f"{ck} is stored as {cand_dtype}, but the reference's {rk} is {ref_dtype}"
                identical = folded = False
            elif not shape_ok:
                identical = folded = False
            elif expected is not None:
                identical = False
                e = expected.get(ck) if t is not None else None
                folded, diff = (_close(e, t, lambda: float(e.abs().max()) if e.numel() else 0.0, exact=same_dtype)
                                if t is not None else (False, None))
                report.computed += folded
                del e
            elif c is None and same_dtype:
                identical = folded = same_bytes(r, t)
            else:
                identical = recorded is None and same_bytes(r.to(cand_dtype), t)
                if c is None:
                    folded = identical or same_bytes(r.to(cand_dtype), t)
                else:
                    largest = float(r.abs().max()) if r.numel() and not same_dtype else 0.0
                    folded, diff = _close(center_as_planned(r, c, read_param), t, lambda: largest,
                                          exact=same_dtype)
            del r, t
            report.tensors += 1
            report.identical += identical and c is None
            report.centered += bool(c) and folded
            report.untied += is_untied and folded
            if not identical:
                not_identical.append(recast or f"{ck} differs from the reference's {rk}")
            if not folded:
                not_folded.append(recast or (
                    f"{ck} has shape {list(reader_cand.shape(ck))}, not {list(reader_ref.shape(rk))}"
                    if not shape_ok else
                    f"{ck} is not what the plan makes of the reference (max abs diff "
                    f"{diff if diff is not None else float('inf'):.3g})" if expected is not None else
                    f"{ck} is not {rk} centered along axis {c[0].axis} (max abs diff {diff:.3g})"
                    if c is not None else f"{ck} differs from the reference's {rk}"))
            done += reader_cand.nbytes(ck) if cand.tensors else 0
            if progress is not None:
                progress(done, total)
    finally:
        side.shutdown()
        if expected is not None:
            expected.close()
        reader_ref.close()
        reader_cand.close()
    # Without a recorded plan the candidate may be the reference itself or the
    # whole plan applied; anything in between is not proven, so it is judged
    # against whichever form it is closer to.
    if expected is None and recorded is None and (not not_identical or len(not_identical) < len(not_folded)):
        report.form = "identical"
        problems += not_identical + (as_reference if recorded is None else [])
    else:
        report.form = "folded"
        problems += not_folded + (as_folded if recorded is None else [])
    problems += files
    report.bytes_read = reader_ref.bytes_read + reader_cand.bytes_read
    report.seconds = time.perf_counter() - start
    report.passed = not problems
    return report


def _mapped_verdicts(order: list[tuple[str, tuple[str, list[Centering] | None, bool]]], ref: TensorReader,
                     cand: TensorReader, read_param: Callable[[str], torch.Tensor],
                     unrecorded: bool) -> dict[str, tuple[bool, bool]]:
    """(identical to the reference, what the plan makes of it) for every tensor that both files
    prove right as they lie, mapped, with no copy: byte for byte, or centered and compared in one
    pass of the C kernel (``centered_equal``), the same arithmetic as the fold's. Only a tensor
    found right is decided here; one that differs, or that these kernels cannot judge (another
    dtype, several centerings, a pickle), is left to the reading path, which says how it differs.
    While one tensor is compared, the kernel reads the next one from disk."""
    decided: dict[str, tuple[bool, bool]] = {}
    eligible = [(ck, rk, c) for ck, (rk, c, _) in order
                if cand.mappable(ck) and ref.mappable(rk) and ref.dtype(rk) == cand.dtype(ck)
                and ref.shape(rk) == cand.shape(ck) and (c is None or len(c) == 1)]
    for i, (ck, rk, c) in enumerate(eligible):
        if i + 1 < len(eligible):
            ref.prefetch(eligible[i + 1][1])
            cand.prefetch(eligible[i + 1][0])
        with contextlib.ExitStack() as mapped:
            try:
                r, t = mapped.enter_context(ref.mapped(rk)), mapped.enter_context(cand.mapped(ck))
            except OSError:  # a file system that cannot map files (FUSE direct I/O): the reading path
                continue
            if c is None:
                same = folded = same_memory(r.address, t.address, r.nbytes)
            else:
                folded = centered_equal(r.address, t.address, ref.dtype(rk), ref.shape(rk), c[0],
                                        read_param(c[0].scale) if c[0].scale else None)
                # is it the reference itself? Asked only without a recorded plan, to judge its form
                same = unrecorded and folded and same_memory(r.address, t.address, r.nbytes)
        if folded:
            decided[ck] = (bool(same), True)
    return decided


def _reader(md: ModelDir) -> TensorReader:
    if not md.pickled:
        return TensorReader(md)
    return TensorReader(md, {k: t for k, (_, t) in load_pickled(md).items()})


def _cast_allowed(ref: torch.dtype, cand: torch.dtype, dtype: str | None = None) -> bool:
    """The changes of dtype a candidate may make: a wider float, which is exact (the model still
    loads in its own dtype, which ``load_problems`` checks), or, when the caller names the dtype
    the candidate is meant to run in (``dtype``), a narrower float of that dtype, judged at that
    precision by the forward check's own criterion."""
    wider = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    narrower = (dtype is not None and cand == getattr(torch, dtype) and ref.is_floating_point
                and ref.itemsize > cand.itemsize and ref in (torch.float32, torch.float64))
    return ref == cand or cand in wider.get(ref, ()) or narrower

