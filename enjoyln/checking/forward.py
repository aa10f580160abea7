"""Equivalence check: does a converted model compute what the original did?

The default criterion is precision-aware: the tolerance comes from the
reference's own rounding on the same inputs. The reference also runs in the
next wider dtype (float32 -> float64, float16/bfloat16 -> float32), the
"truth"; an output passes if ``max|cand - truth| <= factor * max(max|ref -
truth|, eps * max|truth|)``, each over every batch: the candidate may be at
most ``factor`` (4, see ``FACTOR``) times as far from the exact result as the
reference itself is. A float64 reference
has no wider dtype, so it is judged with a fixed ``max|ref - cand| <= 1e-10
* max|ref|``. An explicit ``rtol`` replaces all of this with the fixed
criterion ``max|ref - cand| <= rtol * max|ref|``.

Non-finite values are judged before any tolerance: where the reference is
finite the candidate must be finite, and where the reference is NaN or ±Inf
the candidate must hold the same value (NaN for NaN, the same infinity).

Every model call (the reference, its truth, each load path of the candidate,
greedy generation) runs under the same seeded RNG state, forked so that the
caller's is untouched: a model whose eval forward draws random numbers
(ViTMAE's patch masking) then draws the same ones in each run.

The models run one after another: the reference's outputs are stored (in
memory, or on disk for a check within a memory budget), the reference is
dropped, and the candidate is compared against them chunk by chunk. So only
one model needs to be in memory at a time.

The report is in ``checking.report``, greedy generation in ``checking.generation``, and a
model is called (seeded, its outputs named) by ``checking.running``.
"""

from __future__ import annotations

import copy
import gc
import inspect
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..analysis.inputs import (ExampleInputs, Inputs, as_inputs, config_value, described_inputs, hf_example_inputs,
                               inputs_like,
                               is_causal_lm, is_hf_model, wants_no_cache)
from ..errors import CaptureError, EnjoylnError
from .generation import generate_greedy, generation_lengths, generation_settings, judge_generation, settings_problems
from .report import CheckReport, Coverage, GenerationCheck, OutputCheck, worse
from .running import cast_inputs, run_model
from .sweep import drawn_ids, sketched, token_sweep
from .widening import NotWidened, widened

HALF = (torch.float16, torch.bfloat16)
WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}
"""The dtype the truth runs in, for a reference in each dtype."""
FACTOR = 4.0
"""How many times the reference's own rounding error the candidate may be from the truth.

A correct conversion computes the same function in another order, and its
float32 error is of the same size as the original's, but the maximum of an
error field is one sample of its tail: measured on random GPT-2- and
OPT-shaped models (2-12 layers), a correct fold, fused affine or rotation was
0.6 to 1.75 times as far from float64 as the original, and up to 3.2 times on
small OPTs with planted outlier features, whose errors are heavy-tailed.
Any real change of the outputs is orders of magnitude beyond this."""
FLOAT64_RTOL = 1e-10
"""The fixed criterion for a float64 reference, which has no wider dtype to measure its rounding against."""
FALLBACK_RTOL = 1e-5
"""The fixed criterion when the reference cannot run in the wider dtype."""
FLOOR_EPS = 1.0
"""The reference's own error is taken to be at least this many epsilons of the output's scale, so
that an output the reference computes exactly (a copy, a sum of integers) still allows the
candidate a rounding."""


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def input_batches(model: nn.Module, example_inputs: ExampleInputs = None, *, batches: int = 3,
                  seed: int = 0, batch_size: int = 2, seq_len: int = 16) -> list[Inputs]:
    """Seeded input batches: synthesized from the model's configuration (Hugging Face, timm, open_clip),
    else like the examples."""
    if example_inputs is None:
        if is_hf_model(model):
            return [Inputs((), hf_example_inputs(model, batch=batch_size, seq_len=seq_len, seed=seed + i))
                    for i in range(batches)]
        described = [described_inputs(model, batch=batch_size, seed=seed + i) for i in range(batches)]
        if described[0] is None:
            raise CaptureError(f"{type(model).__name__} is not a Hugging Face model and records no input size "
                               "(timm's pretrained_cfg, open_clip's image_size or context_length); pass "
                               "example_inputs to check it")
        return described
    first = as_inputs(example_inputs)
    if is_hf_model(model) and wants_no_cache(model):
        first.kwargs.setdefault("use_cache", False)
    return [first] + [inputs_like(first, seed + i) for i in range(1, batches)]


MAX_COVER_POSITIONS = 2048
"""Longest sequence the coverage batch feeds; longer position tables are covered by the static check."""
COVER_TOKENS = 4096
"""Most tokens in the coverage batch, spread over up to four rows of distinct ids."""


def coverage_batch(model: nn.Module, *, seed: int = 0, length: int | None = None,
                   max_rows: int = 4) -> tuple[Inputs, Coverage] | None:
    """One batch that reaches every position the config allows, with as many distinct token ids
    as fit, or None for a model without token inputs.

    A few random tokens reach a few percent of a position table and a fraction
    of a percent of the embedding rows; a gate must see the rest.
    """
    if not is_hf_model(model):
        return None
    config, params = model.config, inspect.signature(model.forward).parameters
    vocab = config_value(config, "vocab_size")
    max_pos = config_value(config, "max_position_embeddings", "n_positions", "max_target_positions")
    max_pos = max_pos if isinstance(max_pos, int) and max_pos > 0 else None
    if "input_ids" not in params or not isinstance(vocab, int) or vocab <= 0:
        return None
    length = length or min(max_pos or MAX_COVER_POSITIONS, MAX_COVER_POSITIONS)
    rows = max(1, min(max_rows, COVER_TOKENS // length, -(-min(vocab, COVER_TOKENS) // length)))
    inputs = hf_example_inputs(model, batch=rows, seq_len=length, seed=seed)
    if "input_ids" not in inputs:
        return None
    gen = torch.Generator().manual_seed(seed)
    shape = inputs["input_ids"].shape
    count = shape[0] * shape[1]
    ids = torch.cat([torch.randperm(vocab, generator=gen) for _ in range(-(-count // vocab))])[:count]
    inputs["input_ids"] = ids.view(shape).to(inputs["input_ids"].device)
    types = getattr(config, "type_vocab_size", None)
    if "token_type_ids" in params and isinstance(types, int) and types > 1:
        inputs["token_type_ids"] = torch.randint(0, types, shape, generator=gen).to(ids.device)
    return Inputs((), inputs), Coverage(shape[1], max_pos, int(ids.unique().numel()), vocab)


@dataclass
class ModelSource:
    """A model for the check, produced on demand so that it need not stay in memory.

    ``get(dtype)`` returns the model in ``dtype`` (loading it, or converting a
    copy); the check drops it before asking for the next one.
    """

    dtype: torch.dtype
    get: Callable[[torch.dtype], nn.Module]
    held: bool = False
    """``get(dtype)`` returns a model the caller holds anyway: nothing to collect after it."""
    owned: bool = False
    """The model ``get`` returns is the check's own: after its runs in its own dtype, the
    truth may be made by widening it in place, instead of a second copy or a second load."""
    widens: bool = False
    """The truth may be its model run widened one module at a time (``checking.widening``), but
    where that cannot be vouched for, it comes from ``get`` in the wider dtype (a model whose
    weights are read from disk as each layer runs, which a whole conversion would load)."""

    @classmethod
    def of(cls, model: nn.Module) -> "ModelSource":
        own = _dtype(model)
        return cls(own, lambda dtype: model if dtype == own else copy.deepcopy(model).to(dtype), held=True)

    @classmethod
    def given(cls, model: nn.Module) -> "ModelSource":
        """A model handed over to the check (the caller keeps no reference): ``get`` returns it
        once, and it is freed after its runs."""
        own, box = _dtype(model), [model]

        def get(dtype: torch.dtype) -> nn.Module:
            given = box.pop()
            # as loaded when asked for its own dtype: .to() would also cast the modules a loader
            # keeps in float32 (transformers' _keep_in_fp32_modules) in a half-precision model
            return given if dtype == own else given.to(dtype)
        return cls(own, get, owned=True)

    def drop(self, dtype: torch.dtype) -> None:
        """After the model from ``get(dtype)`` is deleted: free it now, before the next one loads
        (a loaded model holds reference cycles; a full collection is slow, so only then)."""
        if not (self.held and dtype == self.dtype):
            gc.collect()


@dataclass
class CandidatePath:
    """Another way of loading the candidate, compared like the first (a checkpoint's plain
    ``from_pretrained`` beside ``enjoyln.load``)."""

    name: str
    source: ModelSource
    required: bool = True
    """False: reported, but not part of the verdict (the caller says why in the caveat)."""
    batches: int | None = None
    """Run on the first this many batches only (None: all): enough to confirm a load path that
    differs from an already-compared one only in how it is loaded."""


class _Outputs:
    """Every output of one model on every batch, kept in memory or written to a directory."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.meta: dict[tuple[int, str], tuple[torch.dtype, torch.Size, Path]] = {}
        if directory is not None:
            directory.mkdir()

    def put(self, batch: int, outputs: dict[str, torch.Tensor]) -> None:
        for name, t in outputs.items():
            t = t.detach().contiguous()
            if self.directory is None:
                self.tensors[batch, name] = t
                continue
            file = self.directory / f"{len(self.meta)}.bin"
            with open(file, "wb") as f:
                f.write(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
            self.meta[batch, name] = (t.dtype, t.shape, file)

    def has(self, batch: int, name: str) -> bool:
        return (batch, name) in (self.tensors if self.directory is None else self.meta)

    def names(self, batch: int) -> list[str]:
        return [n for b, n in (self.tensors.keys() if self.directory is None else self.meta.keys()) if b == batch]

    def shape(self, batch: int, name: str) -> torch.Size:
        return self.tensors[batch, name].shape if self.directory is None else self.meta[batch, name][1]

    def chunks(self, batch: int, name: str, size: int) -> Iterator[torch.Tensor]:
        """The output flattened, ``size`` elements at a time."""
        if self.directory is None:
            yield from self.tensors[batch, name].view(-1).split(size)
            return
        dtype, shape, file = self.meta[batch, name]
        step = size * dtype.itemsize
        with open(file, "rb") as f:
            while chunk := f.read(step):
                yield torch.frombuffer(bytearray(chunk), dtype=dtype)


_CHUNK = 1 << 22


@dataclass
class _Criterion:
    kind: str  # "precision" or "rtol"
    factor: float = FACTOR
    rtol: float = 0.0
    dtype: torch.dtype = torch.float32
    """The judged dtype, whose epsilon floors the reference's own error."""

    def describe(self, truth: torch.dtype | None, why: str = "") -> str:
        if self.kind == "precision":
            t = str(truth).replace("torch.", "")
            return (f"precision-aware: max|candidate - {t} original| <= {self.factor:g} x "
                    f"max(max|original - {t} original|, eps x max|{t} original|) "
                    "for each output")
        return f"fixed: max|original - candidate| <= {self.rtol:g} x max|original| for each output{why}"


@dataclass
class _Stats:
    """What one output's comparison measured, over the batches seen so far."""

    floating: bool = True
    mismatch: bool = False
    """A missing output, another shape, or (integers) another value."""
    nonfinite: int = 0
    diff: float = 0.0
    scale: float = 0.0
    ref_err: float = 0.0
    cand_err: float = 0.0
    t_scale: float = 0.0
    truth: bool = False

    def merge(self, other: "_Stats") -> "_Stats":
        return _Stats(self.floating and other.floating, self.mismatch or other.mismatch,
                      self.nonfinite + other.nonfinite, worse(self.diff, other.diff),
                      worse(self.scale, other.scale), worse(self.ref_err, other.ref_err),
                      worse(self.cand_err, other.cand_err), worse(self.t_scale, other.t_scale),
                      self.truth and other.truth)


def _measure(name: str, base: _Outputs, truth: _Outputs | None, batch: int,
             cand: torch.Tensor | None) -> _Stats:
    """One output of one batch, compared chunk by chunk (so a vocabulary-wide logit tensor is
    never held three times over in float64).

    Non-finite values are counted apart: where the reference is finite the candidate must be,
    and where it is not, the candidate must hold the same value. Differences are measured over
    the finite elements. A truth that is not finite where the reference is (a float64 overflow)
    is replaced there by the reference, which only tightens the bound."""
    if cand is None or cand.shape != base.shape(batch, name):
        return _Stats(mismatch=True)
    flat = cand.detach().contiguous().view(-1).split(_CHUNK)
    use_truth = truth is not None and truth.has(batch, name) and truth.shape(batch, name) == cand.shape
    t_chunks = truth.chunks(batch, name, _CHUNK) if use_truth else None
    st = _Stats(floating=cand.is_floating_point(), truth=use_truth)
    zero = torch.zeros((), dtype=torch.float64)
    for r, c in zip(base.chunks(batch, name, _CHUNK), flat):
        if not st.floating:
            st.mismatch = st.mismatch or not bool(torch.equal(r, c))
            continue
        if not r.numel():
            continue
        rd, cd = r.double(), c.double()
        r_ok, c_ok = torch.isfinite(rd), torch.isfinite(cd)
        same = (torch.isnan(rd) & torch.isnan(cd)) | (rd == cd)
        st.nonfinite += int(((r_ok & ~c_ok) | (~r_ok & ~same)).sum())
        both = r_ok & c_ok
        st.diff = worse(st.diff, float(torch.where(both, rd - cd, zero).abs().max()))
        st.scale = worse(st.scale, float(torch.where(r_ok, rd, zero).abs().max()))
        if t_chunks is not None:
            td = next(t_chunks).double()
            td = torch.where(torch.isfinite(td) | ~r_ok, td, rd)
            st.ref_err = worse(st.ref_err, float(torch.where(r_ok, rd - td, zero).abs().max()))
            st.cand_err = worse(st.cand_err, float(torch.where(both, cd - td, zero).abs().max()))
            st.t_scale = worse(st.t_scale, float(torch.where(r_ok, td, zero).abs().max()))
    return st


def _judge(name: str, st: _Stats, crit: _Criterion) -> OutputCheck:
    """The verdict on one output, over every batch: no non-finite mismatch, then the criterion."""
    diff = math.inf if st.mismatch or st.nonfinite else st.diff
    rel = diff / st.scale if st.scale else (0.0 if diff == 0 else math.inf)
    out = OutputCheck(name, diff, rel, False, nonfinite=st.nonfinite, scale=st.scale)
    if st.mismatch or not st.floating:
        out.passed = not st.mismatch
        out.tolerance = 0.0
        return out
    if crit.kind == "precision" and st.truth:
        out.reference_error, out.candidate_error = st.ref_err, (math.inf if st.nonfinite else st.cand_err)
        out.allowed = crit.factor * max(st.ref_err, FLOOR_EPS * torch.finfo(crit.dtype).eps * st.t_scale)
        measured = out.candidate_error
        out.tolerance = out.allowed + st.ref_err
    else:
        out.allowed = crit.rtol * st.scale
        measured = diff
        out.tolerance = out.allowed
    out.passed = not st.nonfinite and measured <= out.allowed
    out.margin = (out.allowed / measured if measured else None) if math.isfinite(measured) else 0.0
    return out


def check(reference: nn.Module, candidate: nn.Module, example_inputs: ExampleInputs = None, *,
          batches: int = 3, seed: int = 0, batch_size: int = 2, seq_len: int = 16,
          rtol: float | None = None, factor: float = FACTOR, generate_tokens: int = 8,
          fp32_reference: nn.Module | None = None) -> CheckReport:
    """Compare ``candidate`` with ``reference`` on seeded input batches.

    Hugging Face models get synthesized inputs, the first batch covering
    every position the config allows; other models need ``example_inputs``
    (the first batch; later ones are random alike). Causal LMs are also
    decoded greedily for ``generate_tokens`` tokens. Without ``rtol`` the
    tolerance is the reference's own rounding (a copy of it runs in the next
    wider dtype); with it, the fixed ``max|ref - cand| <= rtol * max|ref|``.

    >>> import copy, torch, enjoyln
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> folded = enjoyln.fold(copy.deepcopy(net), torch.randn(2, 8))
    >>> check(net, folded, torch.randn(2, 8)).passed
    True
    """
    return check_sources(ModelSource.of(reference), ModelSource.of(candidate), example_inputs,
                         batches=batches, seed=seed, batch_size=batch_size, seq_len=seq_len, rtol=rtol,
                         factor=factor, generate_tokens=generate_tokens,
                         truth=ModelSource.of(fp32_reference) if fp32_reference is not None else None)


def check_sources(reference: ModelSource, candidate: ModelSource, example_inputs: ExampleInputs = None, *,
                  batches: int = 3, seed: int = 0, batch_size: int = 2, seq_len: int = 16,
                  rtol: float | None = None, factor: float = FACTOR, generate_tokens: int = 8,
                  truth: ModelSource | None = None, spill: bool = False,
                  max_rows: int = 4, candidate_path: str = "",
                  other_paths: Sequence[CandidatePath] = (), coverage: bool = True,
                  sweep: bool = False) -> CheckReport:
    """``check``, with models produced one at a time: the reference (in the dtype that sets
    the bar), its truth in the next wider dtype (from ``truth``, the reference loaded another
    way, or the reference itself), then the candidate and any other load path of it
    (``other_paths``, compared output by output; greedy generation runs on the first).

    With ``spill``, the stored outputs go to a temporary directory instead of
    memory, and ``max_rows`` bounds the rows of the coverage batch, so that a
    check within a memory budget holds one model and one batch's outputs.
    Without ``coverage`` the first batch is a short one like the others: for a
    candidate whose every weight is already proven, the forward part only
    confirms that the proven plan computes the same function. With ``sweep``
    (and ``coverage``), further batches run every token id the others missed,
    their outputs kept as sketches (``checking.sweep``), on the first load path.
    """
    half = reference.dtype in HALF or candidate.dtype in HALF
    base_dtype, truth = reference.dtype, truth or reference
    if half and reference.dtype not in HALF:
        # an fp32 original against a half-precision candidate: the original is the
        # truth, and the original rounded to the candidate's dtype is the baseline
        base_dtype = candidate.dtype
    truth_dtype = WIDER.get(base_dtype)
    if rtol is not None:
        crit, why = _Criterion("rtol", rtol=rtol), " (--rtol given)"
    elif truth_dtype is None:
        crit, why = _Criterion("rtol", rtol=FLOAT64_RTOL), f" ({base_dtype} has no wider dtype to measure its rounding)"
    else:
        crit, why = _Criterion("precision", factor=factor, dtype=base_dtype), ""
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="enjoyln-check-") if spill else _nothing() as spill_dir:
        base = _Outputs(Path(spill_dir) / "base" if spill else None)
        model = reference.get(base_dtype)
        all_inputs = input_batches(model, example_inputs, batches=batches, seed=seed,
                                   batch_size=batch_size, seq_len=seq_len)
        first, covered = ((None, None) if example_inputs is not None or not coverage
                          else _covering(model, base_dtype, seed, max_rows))
        if first is not None:
            all_inputs[0] = first
        main = len(all_inputs)
        if sweep and first is not None:
            all_inputs += token_sweep(model, drawn_ids(all_inputs), seed=seed, max_rows=max_rows if spill else None)
        if covered is not None:  # what every batch draws, not the coverage batch alone
            covered.distinct_ids = len(drawn_ids(all_inputs))

        def outputs(model: nn.Module, i: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
            out = run_model(model, cast_inputs(all_inputs[i], dtype), seed + i)
            return sketched(out) if i >= main else out
        causal = generate_tokens > 0 and is_causal_lm(model)
        prompt_len, new_tokens = generation_lengths(model, generate_tokens) if causal else (0, 0)
        prompt = next((b.kwargs.get("input_ids") for b in all_inputs if "input_ids" in b.kwargs), None)
        prompt = prompt[:, :prompt_len] if new_tokens and prompt is not None else None
        for i in range(len(all_inputs)):
            base.put(i, outputs(model, i, base_dtype))
        ref_gen = generate_greedy(model, prompt, new_tokens, seed) if prompt is not None else None
        ref_settings = generation_settings(model)
        # the original's own weights widened: its truth without a second load or copy
        widen = (crit.kind == "precision" and (reference.owned or reference.held or reference.widens)
                 and base_dtype == reference.dtype)
        if not widen:
            del model
            reference.drop(base_dtype)

        truth_out = None
        if crit.kind == "precision":
            truth_out = _Outputs(Path(spill_dir) / "truth" if spill else None)
            try:
                if widen:
                    _widened_runs(model, reference, truth, truth_dtype, len(all_inputs), outputs, truth_out)
                else:
                    _runs(truth.get(truth_dtype), truth_dtype, len(all_inputs), outputs, truth_out)
            except EnjoylnError as exc:
                if half:
                    raise
                # some models cannot run in float64 (a hard-coded float32 cast meeting float64 weights)
                wide = str(truth_dtype).replace("torch.", "")
                crit, truth_out = _Criterion("rtol", rtol=FALLBACK_RTOL), None
                why = f" (the original cannot run in {wide}, see the note)"
                notes.append(f"the precision-aware criterion runs the original in {wide}, which failed: {exc}")
            model = None
            truth.drop(truth_dtype)

        stats: dict[tuple[int, str], _Stats] = {}
        paths = [CandidatePath(candidate_path, candidate)] + list(other_paths)
        cand_gen = None
        settings: dict[str, list[str]] = {}  # a difference, and the load paths that show it
        for n, path in enumerate(paths):
            model = path.source.get(path.source.dtype)
            for problem in settings_problems(ref_settings, generation_settings(model)):
                settings.setdefault(problem, []).append(path.name)
            # the sweep runs on the first path: another loads the same embedding rows
            for i in range(min(path.batches or len(all_inputs), len(all_inputs) if n == 0 else main)):
                cand = outputs(model, i, path.source.dtype)
                for name in base.names(i):
                    st = _measure(name, base, truth_out, i, cand.get(name))
                    stats[n, name] = stats[n, name].merge(st) if (n, name) in stats else st
                del cand
            if n == 0 and prompt is not None:
                cand_gen = generate_greedy(model, prompt, new_tokens, seed)
            del model
            path.source.drop(path.source.dtype)

    outputs = []
    for (n, name), st in stats.items():
        out = _judge(name, st, crit)
        out.path, out.required = paths[n].name, paths[n].required
        outputs.append(out)
    generation = None
    if ref_gen is not None and cand_gen is not None:
        logits = next((o for o in outputs if o.name == "logits" and o.path == candidate_path), None)
        tol = logits.tolerance if logits is not None and logits.passed else None
        ok, ties, problem = judge_generation(ref_gen, cand_gen, tol)
        generation = GenerationCheck(ok, new_tokens, ref_gen[0], cand_gen[0], required=not half,
                                     prompt_tokens=prompt_len, identical=ref_gen[0] == cand_gen[0],
                                     tolerance=tol, near_ties=ties, problem=problem)
    judged = [o for o in outputs if o.required]
    passed = bool(judged) and all(o.passed for o in judged)
    if generation is not None and generation.required:
        passed = passed and generation.passed
    passed = passed and not settings
    settings_lines = [f"generation settings{' (' + ' and '.join(where) + ')' if any(where) else ''}: {problem}"
                      for problem, where in settings.items()]
    margins = [o.margin for o in judged if o.margin is not None]
    max_abs = max_rel = 0.0
    for o in judged or outputs:  # a path reported but not required has its own lines
        max_abs, max_rel = worse(max_abs, o.max_abs_diff), worse(max_rel, o.max_rel_diff)
    return CheckReport(
        passed=passed, max_abs_diff=max_abs, max_rel_diff=max_rel,
        outputs=outputs, batches=len(all_inputs), dtype=str(base_dtype).replace("torch.", ""),
        criterion=crit.describe(truth_dtype, why), generation=generation, coverage=covered,
        criterion_kind=crit.kind,
        truth_dtype=str(truth_dtype).replace("torch.", "") if crit.kind == "precision" else "",
        margin=min(margins) if margins else None,
        paths=[p.name for p in paths if p.name], notes=notes, generation_settings=settings_lines,
    )


Run = Callable[[nn.Module, int, torch.dtype], dict[str, torch.Tensor]]
"""A model's outputs on batch ``i`` in a dtype, as the check keeps them."""


def _runs(model: nn.Module, dtype: torch.dtype, batches: int, run: Run, out: _Outputs) -> None:
    for i in range(batches):
        out.put(i, run(model, i, dtype))


def _widened_runs(model: nn.Module, reference: ModelSource, truth: ModelSource, dtype: torch.dtype,
                  batches: int, run: Run, out: _Outputs) -> None:
    """The truth's runs on the original's own weights, widened one module at a time (no copy of
    the model: see ``checking.widening``), or, where the model reads a weight outside its
    owner's forward, widened whole: in place if the check owns the model, else as a copy."""
    try:
        with widened(model, dtype):
            _runs(model, dtype, batches, run, out)
        return
    except (EnjoylnError, NotWidened):
        pass
    _runs(model.to(dtype) if reference.owned else truth.get(dtype), dtype, batches, run, out)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _covering(model: nn.Module, dtype: torch.dtype, seed: int,
              max_rows: int = 4) -> tuple[Inputs | None, Coverage | None]:
    """The coverage batch at the longest length the model accepts.

    Some models cannot take their nominal maximum (RoBERTa's positions start
    after the padding index, so 512 allows 510 tokens), so shorter lengths
    are tried before giving up on full coverage.
    """
    found = coverage_batch(model, seed=seed, max_rows=max_rows)
    if found is None:
        return None, None
    inputs, coverage = found
    length = coverage.positions
    for attempt in (length, length - 1, length - 2, length // 2, length // 4):
        if attempt < 1:
            break
        if attempt != length:
            inputs, coverage = coverage_batch(model, seed=seed, length=attempt, max_rows=max_rows)
        try:
            with torch.no_grad():
                run_model(model, cast_inputs(inputs, dtype), seed)
            return inputs, coverage
        except CaptureError:
            continue
    return None, None
