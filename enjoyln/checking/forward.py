"""The forward check: does a converted model compute what the original did? The criterion and the
runs one model at a time are described in docs/checking.md."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..analysis.graph import served
from ..analysis.inputs import ExampleInputs, is_causal_lm
from ..errors import EnjoylnError
from ..options import CheckOptions
from ..plan import FoldPlan
from .batches import covering, input_batches
from .generation import (
    generate_greedy,
    generation_lengths,
    prompt_of,
    generation_settings,
    judge_generation,
    settings_problems,
)
from .measuring import FACTOR, Criterion, Outputs, Stats, judge_output, measure
from .report import CheckReport, GenerationCheck, worse
from .running import cast_inputs, run_model
from .sweep import SWEEP_TOKENS, drawn_ids, sketched, token_sweep
from .widening import NotWidened, widened

HALF = (torch.float16, torch.bfloat16)
WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}
"""The dtype the truth runs in, for a reference in each dtype."""
FLOAT64_RTOL = 1e-10
"""The fixed criterion for a float64 reference, which has no wider dtype to measure its rounding
against."""
FALLBACK_RTOL = 1e-5
"""The fixed criterion when the reference cannot run in the wider dtype."""
COLLECT_BYTES = 64 << 20
"""A dropped model at least this large is collected at once: below it, the memory it holds is small
beside the process's own, and a full collection costs more than it frees."""


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@dataclass
class ModelSource:
    """A model for the check, produced on demand (``get(dtype)``: loaded, or a converted copy) so
    that it need not stay in memory; the check drops it before asking for the next one."""

    dtype: torch.dtype
    get: Callable[[torch.dtype], nn.Module]
    held: bool = False
    """``get(dtype)`` returns a model the caller holds anyway: nothing to collect after it."""
    owned: bool = False
    """The model ``get`` returns is the check's own: its truth may widen it in place, not load a
    copy."""
    widens: bool = False
    """The truth may be its model run widened one module at a time (``checking.widening``)."""
    nbytes: int | None = None
    """About the bytes a model from ``get`` holds (None: unknown), to skip collecting after a small
    one."""

    @classmethod
    def of(cls, model: nn.Module) -> "ModelSource":
        own = _dtype(model)
        return cls(
            own, lambda dtype: model if dtype == own else copy.deepcopy(model).to(dtype), held=True
        )

    @classmethod
    def given(cls, model: nn.Module) -> "ModelSource":
        """A model handed over to the check: ``get`` returns it once, and it is freed after its
        runs."""
        own, box = _dtype(model), [model]
        nbytes = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())

        def get(dtype: torch.dtype) -> nn.Module:
            given = box.pop()
            # as loaded when asked for its own dtype: .to() would also cast the modules a loader
            # keeps in float32 (transformers' _keep_in_fp32_modules) in a half-precision model
            return given if dtype == own else given.to(dtype)

        return cls(own, get, owned=True, nbytes=nbytes)

    def drop(self, dtype: torch.dtype) -> None:
        """Free the deleted model from ``get(dtype)`` before the next one loads (it holds reference
        cycles). A full collection walks every object of the process, a second or more in a large
        one, so a model under ``COLLECT_BYTES`` is left to the collector's own schedule."""
        if self.held and dtype == self.dtype:
            return
        if (
            self.nbytes is None
            or self.nbytes * max(dtype.itemsize / self.dtype.itemsize, 1.0) >= COLLECT_BYTES
        ):
            gc.collect()


@dataclass
class CandidatePath:
    """A way of loading the candidate (a checkpoint's plain ``from_pretrained`` beside
    ``enjoyln.load``)."""

    name: str
    source: ModelSource
    required: bool = True
    """False: reported, but not part of the verdict (the caller says why in the caveat)."""
    batches: int | None = None
    """Run on the first this many batches only (None: all), to confirm a path that differs only in
    loading."""


def resolved(options: CheckOptions) -> CheckOptions:
    """``options`` with what it leaves to the check decided as for models in memory: 3 batches, the
    first covering every position, 8 decoded tokens, no token sweep."""
    o = options
    return dataclasses.replace(
        o,
        batches=3 if o.batches is None else o.batches,
        factor=FACTOR if o.factor is None else o.factor,
        generate_tokens=8 if o.generate_tokens is None else o.generate_tokens,
        coverage=True if o.coverage is None else o.coverage,
        sweep=bool(o.sweep),
        sweep_tokens=SWEEP_TOKENS if o.sweep_tokens is None else o.sweep_tokens,
    )


def check(
    reference: nn.Module,
    candidate: nn.Module,
    example_inputs: ExampleInputs = None,
    options: CheckOptions | None = None,
    *,
    fp32_reference: nn.Module | None = None,
    plan: FoldPlan | None = None,
) -> CheckReport:
    """Compare ``candidate`` with ``reference`` on seeded input batches, and greedy decoding for
    causal LMs; ``options``: a ``CheckOptions`` (``CheckOptions(batches=4)``), of which the
    forward fields apply; ``plan``: the plan ``candidate`` was made with, whose changed outputs
    (a tower's hidden states, not served) are not compared.
    >>> import copy, torch, enjoyln
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> folded = enjoyln.fold(copy.deepcopy(net), torch.randn(2, 8))
    >>> check(net, folded, torch.randn(2, 8)).passed
    True
    """
    options = options or CheckOptions()
    if plan is not None:
        options = dataclasses.replace(options, skip=(*options.skip, *plan.changed_outputs))
    return check_sources(
        ModelSource.of(reference),
        [CandidatePath("", ModelSource.of(candidate))],
        example_inputs,
        options,
        truth=ModelSource.of(fp32_reference) if fp32_reference is not None else None,
    )


def check_sources(
    reference: ModelSource,
    candidates: Sequence[CandidatePath],
    example_inputs: ExampleInputs = None,
    options: CheckOptions = CheckOptions(),
    *,
    truth: ModelSource | None = None,
    stage: Callable[[str], None] | None = None,
) -> CheckReport:
    """``check``, with models produced one at a time: the reference, its truth in the next wider
    dtype (``truth``, or the reference itself), then each load path of the candidate (the first
    is judged)."""
    options = resolved(options)
    comparison = _Comparison(
        reference, truth or reference, candidates[0].source, options, stage or (lambda what: None)
    )
    with (
        tempfile.TemporaryDirectory(prefix="enjoyln-check-")
        if options.spill
        else contextlib.nullcontext()
    ) as spill_dir:
        comparison.spill_dir = Path(spill_dir) if spill_dir else None
        comparison.reference_runs(example_inputs)
        comparison.truth_runs()
        comparison.candidate_runs(list(candidates))
    return comparison.report()


class _Comparison:
    """One forward comparison, in the order its models are needed and dropped; then the verdict."""

    def __init__(
        self,
        reference: ModelSource,
        truth: ModelSource,
        candidate: ModelSource,
        options: CheckOptions,
        say: Callable[[str], None],
    ) -> None:
        self.reference, self.truth, self.opts, self.say = reference, truth, options, say
        self.half = reference.dtype in HALF or candidate.dtype in HALF
        # an fp32 original against a half-precision candidate: the original is the truth, and
        # the original rounded to the candidate's dtype is the baseline
        self.base_dtype = (
            candidate.dtype if self.half and reference.dtype not in HALF else reference.dtype
        )
        self.truth_dtype = WIDER.get(self.base_dtype)
        if options.rtol is not None:
            self.crit, self.why = Criterion("rtol", rtol=options.rtol), " (--rtol given)"
        elif self.truth_dtype is None:
            self.crit = Criterion("rtol", rtol=FLOAT64_RTOL)
            self.why = f" ({self.base_dtype} has no wider dtype to measure its rounding)"
        else:
            self.crit, self.why = (
                Criterion("precision", factor=options.factor, dtype=self.base_dtype),
                "",
            )
        self.notes: list[str] = []
        self.spill_dir: Path | None = None
        self.stats: dict[tuple[int, str], Stats] = {}
        self.settings: dict[str, list[str]] = {}  # a difference, and the load paths that show it
        self.ref_gen = self.cand_gen = None
        self.paths: list[CandidatePath] = []
        self.widen: nn.Module | None = None

    def _store(self, name: str) -> Outputs:
        return Outputs(self.spill_dir / name if self.spill_dir is not None else None)

    def outputs(self, model: nn.Module, i: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The model's outputs on batch ``i``, as kept: the sweep's sketched."""
        out = run_model(model, cast_inputs(self.inputs[i], dtype), self.opts.seed + i)
        return sketched(out) if i >= self.main else out

    def reference_runs(self, example_inputs: ExampleInputs) -> None:
        """The reference's outputs (and greedy tokens); kept (``widen``) if its truth widens it,
        else dropped."""
        o, self.base = self.opts, self._store("base")
        model = self.reference.get(self.base_dtype)
        self.inputs = input_batches(
            model,
            example_inputs,
            batches=o.batches,
            seed=o.seed,
            batch_size=o.batch_size,
            seq_len=o.seq_len,
        )
        first, self.covered = (
            (None, None)
            if example_inputs is not None or not o.coverage
            else covering(model, self.base_dtype, o.seed, o.max_rows)
        )
        if first is not None:
            self.inputs[0] = first
        self.main = len(self.inputs)
        left = 0
        if o.sweep and first is not None:
            swept, left = token_sweep(
                model,
                drawn_ids(self.inputs),
                seed=o.seed,
                max_rows=o.max_rows if o.spill else None,
                limit=o.sweep_tokens,
            )
            self.inputs += swept
        if self.covered is not None:  # what every batch draws, not the coverage batch alone
            self.covered.distinct_ids = len(drawn_ids(self.inputs))
            self.covered.sweep_limit = o.sweep_tokens if left else None
        causal = o.generate_tokens > 0 and is_causal_lm(model)
        self.prompt_len, self.new_tokens = (
            generation_lengths(model, o.generate_tokens) if causal else (0, 0)
        )
        batch = next((b.kwargs for b in self.inputs if "input_ids" in b.kwargs), None)
        self.prompt = (
            prompt_of(batch, self.prompt_len) if self.new_tokens and batch is not None else None
        )
        if self.prompt is not None:
            self.prompt_len = self.prompt["input_ids"].shape[1]
        for i in range(len(self.inputs)):
            self.say(f"running the original: batch {i + 1} of {len(self.inputs)}")
            self.base.put(i, self.outputs(model, i, self.base_dtype))
        if self.prompt is not None:
            self.say(f"decoding {self.new_tokens} tokens greedily with the original")
            self.ref_gen = generate_greedy(model, self.prompt, self.new_tokens, o.seed)
        self.ref_settings = generation_settings(model)
        r = self.reference
        # the original's own weights widened: its truth without a second load or copy
        if (
            self.crit.kind == "precision"
            and (r.owned or r.held or r.widens)
            and self.base_dtype == r.dtype
        ):
            self.widen = model
            return
        del model
        r.drop(self.base_dtype)

    def truth_runs(self) -> None:
        """The truth's outputs in the next wider dtype, or, where the original cannot run in it (a
        hard-coded float32 cast meeting float64 weights), the fixed criterion instead."""
        self.truth_out = None
        if self.crit.kind != "precision":
            return
        self.truth_out = self._store("truth")
        wide, n = str(self.truth_dtype).replace("torch.", ""), len(self.inputs)

        def runs(model: nn.Module) -> None:
            for i in range(n):
                self.say(f"running the original in {wide} (its exact result): batch {i + 1} of {n}")
                self.truth_out.put(i, self.outputs(model, i, self.truth_dtype))

        try:
            if self.widen is None:
                runs(self.truth.get(self.truth_dtype))
            else:
                # the original's own weights widened one module at a time (no copy), or, where it
                # reads a
                # weight outside its owner's forward, widened whole: in place if the check owns it
                try:
                    with widened(self.widen, self.truth_dtype):
                        runs(self.widen)
                except (EnjoylnError, NotWidened):
                    runs(
                        self.widen.to(self.truth_dtype)
                        if self.reference.owned
                        else self.truth.get(self.truth_dtype)
                    )
        except EnjoylnError as exc:
            if self.half:
                raise
            self.crit, self.truth_out = Criterion("rtol", rtol=FALLBACK_RTOL), None
            self.why = f" (the original cannot run in {wide}, see the note)"
            self.notes.append(
                f"the precision-aware criterion runs the original in {wide}, which failed: {exc}"
            )
        self.widen = None  # freed before the candidate loads
        self.truth.drop(self.truth_dtype)

    def candidate_runs(self, paths: list[CandidatePath]) -> None:
        """Each load path of the candidate, measured output by output; the sweep runs on the first
        only."""
        self.paths = paths
        for n, path in enumerate(paths):
            model = path.source.get(path.source.dtype)
            for problem in settings_problems(self.ref_settings, generation_settings(model)):
                self.settings.setdefault(problem, []).append(path.name)
            count = min(path.batches or len(self.inputs), len(self.inputs) if n == 0 else self.main)
            for i in range(count):
                self.say(
                    f"running the candidate{' (' + path.name + ')' if path.name else ''}: batch "
                    f"{i + 1} "
                    f"of {count}"
                )
                cand = self.outputs(model, i, path.source.dtype)
                names = self.base.names(i)
                for name in names:
                    # a recorded plan may be forged: what the model serves is compared whatever it
                    # claims
                    if name in self.opts.skip and not served(name, names):
                        continue
                    st = measure(name, self.base, self.truth_out, i, cand.get(name))
                    self.stats[n, name] = (
                        self.stats[n, name].merge(st) if (n, name) in self.stats else st
                    )
                del cand
            if n == 0 and self.prompt is not None:
                self.say(f"decoding {self.new_tokens} tokens greedily with the candidate")
                self.cand_gen = generate_greedy(model, self.prompt, self.new_tokens, self.opts.seed)
            del model
            path.source.drop(path.source.dtype)

    def report(self) -> CheckReport:
        """Every required output within the criterion, the same greedy tokens and generation
        settings."""
        outputs = [
            dataclasses.replace(
                judge_output(name, st, self.crit),
                path=self.paths[n].name,
                required=self.paths[n].required,
            )
            for (n, name), st in self.stats.items()
        ]
        generation = None
        if self.ref_gen is not None and self.cand_gen is not None:
            logits = next(
                (o for o in outputs if o.name == "logits" and o.path == self.paths[0].name), None
            )
            tol = logits.tolerance if logits is not None and logits.passed else None
            ok, ties, problem = judge_generation(self.ref_gen, self.cand_gen, tol)
            generation = GenerationCheck(
                ok,
                self.new_tokens,
                self.ref_gen[0],
                self.cand_gen[0],
                required=not self.half,
                prompt_tokens=self.prompt_len,
                identical=self.ref_gen[0] == self.cand_gen[0],
                tolerance=tol,
                near_ties=ties,
                problem=problem,
            )
        skipped = [
            name
            for name in self.opts.skip
            if name in self.base.names(0) and not served(name, self.base.names(0))
        ]
        if skipped:
            self.notes.append(
                f"not compared: {', '.join(skipped)}, which the plan lets its rotation change (a "
                "tower's hidden states, not what the model serves)"
            )
        judged = [o for o in outputs if o.required]
        passed = (
            bool(judged)
            and all(o.passed for o in judged)
            and not self.settings
            and (generation is None or not generation.required or generation.passed)
        )
        margins = [o.margin for o in judged if o.margin is not None]
        max_abs = max_rel = 0.0
        for o in judged or outputs:  # a path reported but not required has its own lines
            max_abs, max_rel = worse(max_abs, o.max_abs_diff), worse(max_rel, o.max_rel_diff)
        name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
        return CheckReport(
            passed=passed,
            max_abs_diff=max_abs,
            max_rel_diff=max_rel,
            outputs=outputs,
            batches=len(self.inputs),
            dtype=name(self.base_dtype),
            criterion=self.crit.describe(self.truth_dtype, self.why),
            generation=generation,
            coverage=self.covered,
            criterion_kind=self.crit.kind,
            truth_dtype=name(self.truth_dtype) if self.crit.kind == "precision" else "",
            margin=min(margins) if margins else None,
            paths=[p.name for p in self.paths if p.name],
            notes=self.notes,
            factor=self.opts.factor if self.crit.kind == "precision" else None,
            generation_settings=[
                f"generation settings{' (' + ' and '.join(w) + ')' if any(w) else ''}: {problem}"
                for problem, w in self.settings.items()
            ],
        )
