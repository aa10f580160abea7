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
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..analysis.inputs import (ExampleInputs, Inputs, as_inputs, config_value, described_inputs, hf_example_inputs,
                               inputs_like,
                               is_causal_lm, is_hf_model, wants_no_cache)
from ..errors import CaptureError, EnjoylnError, first_line

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


def _worse(a: float, b: float) -> float:
    """``max`` that a NaN cannot lower: Python's ``max(0.0, nan)`` is 0.0."""
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return max(a, b)


@dataclass
class OutputCheck:
    """One named output, worst case over all batches."""

    name: str
    max_abs_diff: float
    """max|candidate - reference|; infinite where a non-finite value differs."""
    max_rel_diff: float
    passed: bool
    reference_error: float | None = None
    """Precision-aware criterion: max|reference - truth|, the reference's own rounding."""
    candidate_error: float | None = None
    """Precision-aware criterion: max|candidate - truth|."""
    allowed: float | None = None
    """The bound the judged quantity had to meet (candidate_error, or max_abs_diff with rtol)."""
    margin: float | None = None
    """allowed / the judged quantity (above 1 passes); None where the two agree exactly."""
    nonfinite: int = 0
    """Elements where the candidate is NaN or ±Inf and the reference is not, or holds another
    non-finite value than the reference's."""
    path: str = ""
    """How the candidate was loaded ("enjoyln.load", "from_pretrained"); empty for models given in memory."""
    required: bool = True
    """False where this path is reported but not part of the verdict (see CheckReport.caveat)."""
    tolerance: float | None = None
    """The largest max|candidate - reference| the criterion allows; bounds a greedy flip's near-tie."""
    scale: float = 0.0
    """max|reference| over the finite elements (what max_rel_diff divides by)."""

    @property
    def label(self) -> str:
        return f"{self.name} ({self.path})" if self.path else self.name


@dataclass
class NearTie:
    """A greedy token that differs where the reference's top choices were within the tolerance."""

    row: int
    step: int
    reference_token: int
    candidate_token: int
    reference_margin: float
    """the reference's score of its token minus that of the candidate's token, in the scores
    generate() chose by (after the generation config's logits processors)"""
    deviation: float
    """max|candidate - reference| over the raw step logits up to this step"""
    candidate_margin: float = 0.0
    """the candidate's score of its token minus that of the reference's token, likewise"""


@dataclass
class GenerationCheck:
    """Greedy decoding from the same prompts.

    Tokens must be identical, except that a row may flip at a genuine near-tie:
    up to and including the first differing step the candidate's raw step
    logits (computed on the same prefix) are within the criterion's tolerance
    of the reference's, and at that step, in the scores generate() chose by
    (after the logits processors of each model's generation config), each
    model's margin between the two tokens is at most twice that tolerance. The
    tokens after a flip are not compared."""

    passed: bool
    new_tokens: int
    reference: list[list[int]] = field(default_factory=list)
    candidate: list[list[int]] = field(default_factory=list)
    required: bool = True
    """False in half precision, where a near-tie may flip a token legitimately."""
    prompt_tokens: int = 0
    identical: bool = True
    tolerance: float | None = None
    near_ties: list[NearTie] = field(default_factory=list)
    problem: str = ""


@dataclass
class Coverage:
    """What the forward comparison's inputs reached."""

    positions: int = 0
    """Positions 0 .. positions-1 of the longest sequence fed."""
    max_positions: int | None = None
    """What the config allows (None: not a sequence model, or no limit)."""
    distinct_ids: int = 0
    vocab_size: int | None = None

    def describe(self) -> str:
        parts = []
        if self.positions:
            allowed = f" of {self.max_positions}" if self.max_positions else ""
            parts.append(f"positions 0-{self.positions - 1}{allowed}")
        if self.distinct_ids:
            vocab = f" of {self.vocab_size}" if self.vocab_size else ""
            parts.append(f"{self.distinct_ids} distinct token ids{vocab}")
        return ", ".join(parts)


@dataclass
class CheckReport:
    """The outcome of ``check``; ``passed`` is the verdict."""

    passed: bool
    max_abs_diff: float
    max_rel_diff: float
    outputs: list[OutputCheck]
    batches: int
    dtype: str
    criterion: str
    generation: GenerationCheck | None = None
    coverage: Coverage | None = None
    static: Any = None
    """The static weight check (``enjoyln.checking.static.StaticReport``), when it ran."""
    forward_skipped: str = ""
    """Why the forward comparison did not run, if it did not."""
    memory: str = ""
    """How the models were held, when not both in memory (a check within a budget)."""
    criterion_kind: str = ""
    """"precision" (tolerance from the reference's own rounding) or "rtol" (a fixed relative one)."""
    truth_dtype: str = ""
    """The dtype the reference's truth ran in, for the precision-aware criterion."""
    margin: float | None = None
    """The smallest margin of the outputs in the verdict (allowed / measured; above 1 passes)."""
    paths: list[str] = field(default_factory=list)
    """How the candidate was loaded and run (both load paths of a checkpoint)."""
    caveat: str = ""
    """What the verdict does not cover, shown with it (a load path the candidate declares inexact)."""
    notes: list[str] = field(default_factory=list)
    generation_settings: list[str] = field(default_factory=list)
    """How the generation settings a loader gave the candidate differ from the reference's (each
    one fails the check: generate() applies them)."""

    @classmethod
    def from_static(cls, static: Any, *, forward_skipped: bool) -> "CheckReport":
        why = "the weights already differ" if forward_skipped else "static check only"
        return cls(passed=static.passed, max_abs_diff=0.0, max_rel_diff=0.0, outputs=[], batches=0,
                   dtype="", criterion="", static=static, forward_skipped=why)

    def add_static(self, static: Any) -> None:
        if static is not None:
            self.static = static
            self.passed = self.passed and static.passed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"{verdict}" + (f" ({self.caveat})" if self.caveat else "")]
        if self.static is not None:
            lines += [f"  {line}" for line in self.static.summary().splitlines()]
        if self.forward_skipped:
            lines.append(f"  forward comparison not run: {self.forward_skipped}")
            return "\n".join(lines)
        covered = f"; inputs cover {self.coverage.describe()}" if self.coverage and self.coverage.describe() else ""
        paths = f" through {' and '.join(self.paths)}" if self.paths else ""
        lines += [f"  forward: {len(self.outputs)} outputs over {self.batches} batches ({self.dtype}){paths}; "
                  f"max abs diff {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}{covered}",
                  f"  criterion: {self.criterion}"
                  + (f"; margin {self.margin:.3g}x" if self.margin is not None else "")]
        if self.memory:
            lines.append(f"  memory: {self.memory}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        for o in self.outputs:
            extra = ""
            if o.candidate_error is not None:
                extra = (f"; vs {self.truth_dtype or 'truth'}: candidate {o.candidate_error:.3g}, "
                         f"original {o.reference_error:.3g}")
            if o.allowed is not None:
                extra += f", allowed {o.allowed:.3g}"
            if o.margin is not None:
                extra += f" (margin {o.margin:.3g}x)"
            if o.nonfinite:
                extra += f"; {o.nonfinite} elements NaN or Inf where the original is not (or another non-finite value)"
            state = ("ok" if o.passed else "FAIL") if o.required else ("differs" if not o.passed else "ok") + ", not required"
            lines.append(f"  [{state}] {o.label}: abs {o.max_abs_diff:.3g}, rel {o.max_rel_diff:.3g}{extra}")
        for problem in self.generation_settings:
            lines.append(f"  [FAIL] {problem}")
        g = self.generation
        if g is not None:
            state = "identical" if g.identical else "same up to near-ties" if g.passed else "DIFFERENT"
            note = "" if g.required else " (informational in half precision)"
            lines.append(f"  greedy generation of {g.new_tokens} tokens after {g.prompt_tokens}: {state}{note}")
            for t in g.near_ties:
                lines.append(f"    row {t.row} step {t.step}: token {t.candidate_token} for {t.reference_token}, "
                             f"margins {t.reference_margin:.3g} (original) and {t.candidate_margin:.3g} "
                             f"(candidate) in the scores generate() used, step logits within "
                             f"{t.deviation:.3g} of the original's (tolerance {g.tolerance:.3g})")
            if g.problem:
                lines.append(f"    {g.problem}")
        return "\n".join(lines)


def flatten_outputs(out: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Name every tensor in a (nested) model output: ``logits``, ``0.1`` and so on."""
    if isinstance(out, torch.Tensor):
        return {prefix or "output": out}
    if isinstance(out, dict):  # includes transformers' ModelOutput
        items = list(out.items())
    elif isinstance(out, (tuple, list)):
        items = list(enumerate(out))
    else:
        return {}
    flat: dict[str, torch.Tensor] = {}
    for key, value in items:
        flat.update(flatten_outputs(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


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


def _to(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    """Floating inputs in ``dtype`` (pixel values, audio features); token ids stay."""
    cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    return Inputs(tuple(cast(a) for a in inputs.args), {k: cast(v) for k, v in inputs.kwargs.items()})


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch's RNG seeded for one model call and restored after it: a model whose eval forward
    draws random numbers (ViTMAE's and PatchTST's random masking) must draw the same ones in
    the reference, its truth and every candidate run, or a correct candidate (even an exact
    copy) differs from it; the caller's RNG is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def _run(model: nn.Module, inputs: Inputs, seed: int) -> dict[str, torch.Tensor]:
    """The model's outputs on ``inputs``, under torch's RNG seeded with ``seed``."""
    try:
        with torch.no_grad(), _seeded(seed):
            return flatten_outputs(inputs.call(model))
    except Exception as exc:  # the model's own error, on inputs enjoyln made or was given
        first = first_line(exc)
        raise CaptureError(f"running {type(model).__name__} on the check inputs failed: "
                           f"{type(exc).__name__}: {first}") from exc


PROMPT_TOKENS = 8
"""Longest prompt the generation check feeds (fewer where the context is short)."""


def generation_lengths(model: nn.Module, new_tokens: int) -> tuple[int, int]:
    """(prompt tokens, new tokens) that fit the model's context: a model with 12 positions
    cannot take an 8-token prompt and 8 more. (0, 0): no room to generate."""
    limit = config_value(getattr(model, "config", None), "max_position_embeddings", "n_positions",
                         "max_target_positions")
    if not isinstance(limit, int) or limit <= 0:
        return PROMPT_TOKENS, new_tokens
    prompt = min(PROMPT_TOKENS, max(1, limit - new_tokens))
    new = min(new_tokens, limit - prompt)
    return (prompt, new) if new > 0 else (0, 0)


Generated = tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]
"""Greedy generation: the new tokens of each row, then per step (batch x vocab each) the raw
logits and the scores generate() chose by, after the generation config's logits processors."""


def _generate(model: nn.Module, prompt: torch.Tensor, n: int, seed: int) -> Generated:
    """Greedy tokens, with the raw logits and the processed scores of every step (torch's RNG
    seeded with ``seed``, as in ``_run``)."""
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]
    try:
        with torch.no_grad(), _seeded(seed):
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                                 pad_token_id=pad, output_logits=True, output_scores=True,
                                 return_dict_in_generate=True)
    except Exception as exc:  # the model's own error, on a prompt enjoyln made
        first = first_line(exc)
        raise CaptureError(f"greedy generation with {type(model).__name__} failed: "
                           f"{type(exc).__name__}: {first}") from exc
    return (out.sequences[:, prompt.shape[1]:].tolist(), [t.detach().clone() for t in out.logits],
            [t.detach().clone() for t in (out.scores or ())])


def _margin(scores: list[torch.Tensor], step: int, row: int, mine: int, other: int) -> float:
    """A model's score of its own token minus that of the other model's token (inf: no such score)."""
    if step >= len(scores) or max(mine, other) >= scores[step].shape[-1]:
        return math.inf
    r = scores[step][row].double()
    return float(r[mine] - r[other])


def _judge_generation(ref: Generated, cand: Generated,
                      tolerance: float | None) -> tuple[bool, list[NearTie], str]:
    """Identical tokens pass; a row whose tokens first differ at a step passes only if the
    candidate's raw step logits up to there, on the same prefix, are within ``tolerance`` of the
    reference's, and at that step each model's margin between the two tokens, in the scores
    generate() chose by, is at most twice ``tolerance``: a genuine near-tie. The raw logits
    alone do not do: generate() chooses by the scores after the generation config's logits
    processors (suppressed tokens, a repetition penalty), so equal logits can give tokens that
    differ by a wide margin. The rest of a row that flipped (a different prefix) is not compared."""
    (ref_tokens, ref_logits, ref_scores), (cand_tokens, cand_logits, cand_scores) = ref, cand
    ties: list[NearTie] = []
    if len(ref_tokens) != len(cand_tokens):
        return False, ties, f"{len(cand_tokens)} rows generated for {len(ref_tokens)}"
    for row, (a, b) in enumerate(zip(ref_tokens, cand_tokens)):
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None and len(a) == len(b):
            continue
        if step is None or step >= len(ref_logits) or step >= len(cand_logits):
            return False, ties, f"row {row}: {len(b)} tokens generated for {len(a)}"
        dev = 0.0
        for s in range(step + 1):
            r, c = ref_logits[s][row].double(), cand_logits[s][row].double()
            if r.shape != c.shape or not bool(torch.isfinite(c).all()) or not bool(torch.isfinite(r).all()):
                dev = math.inf
                break
            dev = _worse(dev, float((r - c).abs().max()))
        theirs = _margin(ref_scores, step, row, a[step], b[step])
        ours = _margin(cand_scores, step, row, b[step], a[step])
        flip = (f"row {row} step {step}: token {b[step]} for {a[step]}, margins {theirs:.3g} (original) and "
                f"{ours:.3g} (candidate) in the scores generate() used")
        if tolerance is None:
            return False, ties, f"{flip}; not a near-tie: the original has no finite tolerance for its logits"
        if not dev <= tolerance:
            return False, ties, (f"{flip}; not a near-tie: the step logits are {dev:.3g} from the original's, "
                                 f"more than the tolerance {tolerance:.3g}")
        if not (theirs <= 2 * tolerance and ours <= 2 * tolerance):
            return False, ties, (f"{flip}; not a near-tie: a margin is more than twice the tolerance "
                                 f"{tolerance:.3g} (the generation settings differ, or the scores do)")
        ties.append(NearTie(row, step, a[step], b[step], theirs, dev, ours))
    return True, ties, ""


def _generation_settings(model: nn.Module) -> dict[str, Any] | None:
    """The generation settings generate() starts from, as the loader gave them to the model
    (generation_config.json, or what transformers builds from config.json without one)."""
    config = getattr(model, "generation_config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    settings = config.to_dict()
    settings.pop("transformers_version", None)  # the running transformers' version, on both sides
    return settings


def _settings_problems(ref: dict[str, Any] | None, cand: dict[str, Any] | None) -> list[str]:
    from .compare import same_json

    if ref is None or cand is None:
        return [] if ref is cand else [f"the candidate has {'none' if cand is None else 'some'}, the original "
                                       f"{'none' if ref is None else 'some'}"]
    return [f"{key} is {cand.get(key)!r}, the original's {ref.get(key)!r}"
            for key in sorted(ref.keys() | cand.keys()) if not same_json(ref.get(key), cand.get(key))]


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

    @classmethod
    def of(cls, model: nn.Module) -> "ModelSource":
        own = _dtype(model)
        return cls(own, lambda dtype: model if dtype == own else copy.deepcopy(model).to(dtype), held=True)

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
                      self.nonfinite + other.nonfinite, _worse(self.diff, other.diff),
                      _worse(self.scale, other.scale), _worse(self.ref_err, other.ref_err),
                      _worse(self.cand_err, other.cand_err), _worse(self.t_scale, other.t_scale),
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
        st.diff = _worse(st.diff, float(torch.where(both, rd - cd, zero).abs().max()))
        st.scale = _worse(st.scale, float(torch.where(r_ok, rd, zero).abs().max()))
        if t_chunks is not None:
            td = next(t_chunks).double()
            td = torch.where(torch.isfinite(td) | ~r_ok, td, rd)
            st.ref_err = _worse(st.ref_err, float(torch.where(r_ok, rd - td, zero).abs().max()))
            st.cand_err = _worse(st.cand_err, float(torch.where(both, cd - td, zero).abs().max()))
            st.t_scale = _worse(st.t_scale, float(torch.where(r_ok, td, zero).abs().max()))
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
                  other_paths: Sequence[CandidatePath] = (), coverage: bool = True) -> CheckReport:
    """``check``, with models produced one at a time: the reference (in the dtype that sets
    the bar), its truth in the next wider dtype (from ``truth``, the reference loaded another
    way, or the reference itself), then the candidate and any other load path of it
    (``other_paths``, compared output by output; greedy generation runs on the first).

    With ``spill``, the stored outputs go to a temporary directory instead of
    memory, and ``max_rows`` bounds the rows of the coverage batch, so that a
    check within a memory budget holds one model and one batch's outputs.
    Without ``coverage`` the first batch is a short one like the others: for a
    candidate whose every weight is already proven, the forward part only
    confirms that the proven plan computes the same function.
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
        causal = generate_tokens > 0 and is_causal_lm(model)
        prompt_len, new_tokens = generation_lengths(model, generate_tokens) if causal else (0, 0)
        prompt = next((b.kwargs.get("input_ids") for b in all_inputs if "input_ids" in b.kwargs), None)
        prompt = prompt[:, :prompt_len] if new_tokens and prompt is not None else None
        for i, inputs in enumerate(all_inputs):
            base.put(i, _run(model, _to(inputs, base_dtype), seed + i))
        ref_gen = _generate(model, prompt, new_tokens, seed) if prompt is not None else None
        ref_settings = _generation_settings(model)
        del model
        reference.drop(base_dtype)

        truth_out = None
        if crit.kind == "precision":
            truth_out = _Outputs(Path(spill_dir) / "truth" if spill else None)
            try:
                model = truth.get(truth_dtype)
                for i, inputs in enumerate(all_inputs):
                    truth_out.put(i, _run(model, _to(inputs, truth_dtype), seed + i))
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
            for problem in _settings_problems(ref_settings, _generation_settings(model)):
                settings.setdefault(problem, []).append(path.name)
            for i, inputs in enumerate(all_inputs):
                cand = _run(model, _to(inputs, path.source.dtype), seed + i)
                for name in base.names(i):
                    st = _measure(name, base, truth_out, i, cand.get(name))
                    stats[n, name] = stats[n, name].merge(st) if (n, name) in stats else st
                del cand
            if n == 0 and prompt is not None:
                cand_gen = _generate(model, prompt, new_tokens, seed)
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
        ok, ties, problem = _judge_generation(ref_gen, cand_gen, tol)
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
        max_abs, max_rel = _worse(max_abs, o.max_abs_diff), _worse(max_rel, o.max_rel_diff)
    return CheckReport(
        passed=passed, max_abs_diff=max_abs, max_rel_diff=max_rel,
        outputs=outputs, batches=len(all_inputs), dtype=str(base_dtype).replace("torch.", ""),
        criterion=crit.describe(truth_dtype, why), generation=generation, coverage=covered,
        criterion_kind=crit.kind,
        truth_dtype=str(truth_dtype).replace("torch.", "") if crit.kind == "precision" else "",
        margin=min(margins) if margins else None,
        paths=[p.name for p in paths if p.name], notes=notes, generation_settings=settings_lines,
    )


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
                _run(model, _to(inputs, dtype), seed)
            return inputs, coverage
        except CaptureError:
            continue
    return None, None
