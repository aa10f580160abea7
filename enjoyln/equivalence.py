"""Equivalence check: does a converted model compute what the original did?

In float32 the criterion is ``max|ref - cand| <= rtol * max|ref|`` for every
output on every batch. In float16 and bfloat16 rounding the centered weights
costs about an ulp, so the criterion is relative to the original's own
rounding: the candidate's deviation from a float32 copy of the
reference may be at most ``half_factor`` times the half-precision reference's
own deviation from it.

The models run one after another: the reference's outputs are stored (in
memory, or on disk for a check within a memory budget), the reference is
dropped, and the candidate is compared against them chunk by chunk. So only
one model needs to be in memory at a time.
"""

from __future__ import annotations

import copy
import gc
import inspect
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .inputs import (ExampleInputs, Inputs, as_inputs, config_value, hf_example_inputs, is_causal_lm,
                     is_hf_model, wants_no_cache)
from .errors import CaptureError

HALF = (torch.float16, torch.bfloat16)


@dataclass
class OutputCheck:
    """One named output, worst case over all batches."""

    name: str
    max_abs_diff: float
    max_rel_diff: float
    passed: bool
    reference_error: float | None = None
    """Half precision only: max|reference - float32 reference|."""
    candidate_error: float | None = None
    """Half precision only: max|candidate - float32 reference|."""


@dataclass
class GenerationCheck:
    """Greedy decoding from the same prompts."""

    passed: bool
    new_tokens: int
    reference: list[list[int]] = field(default_factory=list)
    candidate: list[list[int]] = field(default_factory=list)
    required: bool = True
    """False in half precision, where a near-tie may flip a token legitimately."""


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
    """The static weight check (``enjoyln.static_check.StaticReport``), when it ran."""
    forward_skipped: str = ""
    """Why the forward comparison did not run, if it did not."""
    memory: str = ""
    """How the models were held, when not both in memory (a check within a budget)."""

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
        lines = [f"{verdict}"]
        if self.static is not None:
            lines += [f"  {line}" for line in self.static.summary().splitlines()]
        if self.forward_skipped:
            lines.append(f"  forward comparison not run: {self.forward_skipped}")
            return "\n".join(lines)
        covered = f"; inputs cover {self.coverage.describe()}" if self.coverage and self.coverage.describe() else ""
        lines += [f"  forward: {len(self.outputs)} outputs over {self.batches} batches ({self.dtype}); "
                  f"max abs diff {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}{covered}",
                  f"  criterion: {self.criterion}"]
        if self.memory:
            lines.append(f"  memory: {self.memory}")
        for o in self.outputs:
            extra = ""
            if o.candidate_error is not None:
                extra = f", vs fp32: candidate {o.candidate_error:.3g}, original {o.reference_error:.3g}"
            lines.append(f"  [{'ok' if o.passed else 'FAIL'}] {o.name}: abs {o.max_abs_diff:.3g}, "
                         f"rel {o.max_rel_diff:.3g}{extra}")
        g = self.generation
        if g is not None:
            state = "identical" if g.passed else "DIFFERENT"
            note = "" if g.required else " (informational in half precision)"
            lines.append(f"  greedy generation of {g.new_tokens} tokens: {state}{note}")
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


def _inputs_like(inputs: Inputs, seed: int) -> Inputs:
    """Fresh random inputs with the shapes, dtypes and integer ranges of ``inputs``."""
    gen = torch.Generator().manual_seed(seed)

    def fresh(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dtype == torch.bool:
            return x
        if x.is_floating_point():
            return torch.randn(x.shape, generator=gen).to(x.dtype).to(x.device)
        lo, hi = int(x.min()), int(x.max())
        return torch.randint(lo, hi + 1, x.shape, generator=gen).to(x.dtype).to(x.device)

    return Inputs(tuple(fresh(a) for a in inputs.args), {k: fresh(v) for k, v in inputs.kwargs.items()})


def input_batches(model: nn.Module, example_inputs: ExampleInputs = None, *, batches: int = 3,
                  seed: int = 0, batch_size: int = 2, seq_len: int = 16) -> list[Inputs]:
    """Seeded input batches: synthesized for Hugging Face models, else like the examples."""
    if example_inputs is None:
        if not is_hf_model(model):
            raise CaptureError(f"{type(model).__name__} is not a Hugging Face model; pass "
                               "example_inputs to check it")
        return [Inputs((), hf_example_inputs(model, batch=batch_size, seq_len=seq_len, seed=seed + i))
                for i in range(batches)]
    first = as_inputs(example_inputs)
    if is_hf_model(model) and wants_no_cache(model):
        first.kwargs.setdefault("use_cache", False)
    return [first] + [_inputs_like(first, seed + i) for i in range(1, batches)]


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


def _run(model: nn.Module, inputs: Inputs) -> dict[str, torch.Tensor]:
    try:
        with torch.no_grad():
            return flatten_outputs(inputs.call(model))
    except Exception as exc:  # the model's own error, on inputs enjoyln made or was given
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CaptureError(f"running {type(model).__name__} on the check inputs failed: "
                           f"{type(exc).__name__}: {first}") from exc


def _generate(model: nn.Module, prompt: torch.Tensor, n: int) -> list[list[int]]:
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                             pad_token_id=pad)
    return out[:, prompt.shape[1]:].tolist()


@dataclass
class ModelSource:
    """A model for the check, produced on demand so that it need not stay in memory.

    ``get(dtype)`` returns the model in ``dtype`` (loading it, or converting a
    copy); the check drops it before asking for the next one.
    """

    dtype: torch.dtype
    get: Callable[[torch.dtype], nn.Module]

    @classmethod
    def of(cls, model: nn.Module) -> "ModelSource":
        own = _dtype(model)
        return cls(own, lambda dtype: model if dtype == own else copy.deepcopy(model).to(dtype))


class _Outputs:
    """Every output of one model on every batch, kept in memory or written to a directory."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.meta: dict[tuple[int, str], tuple[torch.dtype, torch.Size, Path]] = {}

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


def _compare(name: str, base: _Outputs, truth: _Outputs | None, batch: int, cand: torch.Tensor,
             rtol: float, half_factor: float, dtype: torch.dtype) -> OutputCheck:
    """One output of one batch, compared chunk by chunk (so a vocabulary-wide logit tensor is
    never held three times over in float64)."""
    if cand is None or cand.shape != base.shape(batch, name):
        return OutputCheck(name, float("inf"), float("inf"), False)
    flat = cand.detach().contiguous().view(-1).split(_CHUNK)
    t_chunks = truth.chunks(batch, name, _CHUNK) if truth is not None and (batch, name) in (
        truth.tensors if truth.directory is None else truth.meta) else None
    diff = scale = ref_err = cand_err = t_scale = 0.0
    exact, floating = True, cand.is_floating_point()
    for r, c in zip(base.chunks(batch, name, _CHUNK), flat):
        if not floating:
            exact = exact and bool(torch.equal(r, c))
            continue
        rd, cd = r.double(), c.double()
        diff = max(diff, float((rd - cd).abs().max()) if rd.numel() else 0.0)
        scale = max(scale, float(rd.abs().max()) if rd.numel() else 0.0)
        if t_chunks is not None:
            td = next(t_chunks).double()
            ref_err = max(ref_err, float((rd - td).abs().max()) if td.numel() else 0.0)
            cand_err = max(cand_err, float((cd - td).abs().max()) if td.numel() else 0.0)
            t_scale = max(t_scale, float(td.abs().max()) if td.numel() else 0.0)
    rel = diff / scale if scale else (0.0 if diff == 0 else float("inf"))
    out = OutputCheck(name, diff, rel, False)
    if not floating:
        out.passed = exact
    elif t_chunks is not None:
        out.reference_error, out.candidate_error = ref_err, cand_err
        floor = torch.finfo(dtype).eps * t_scale
        out.passed = cand_err <= half_factor * max(ref_err, floor)
    else:
        out.passed = diff <= rtol * scale
    return out


def check(reference: nn.Module, candidate: nn.Module, example_inputs: ExampleInputs = None, *,
          batches: int = 3, seed: int = 0, batch_size: int = 2, seq_len: int = 16,
          rtol: float = 1e-5, half_factor: float = 2.0, generate_tokens: int = 8,
          fp32_reference: nn.Module | None = None) -> CheckReport:
    """Compare ``candidate`` with ``reference`` on seeded input batches.

    Hugging Face models get synthesized inputs, the first batch covering
    every position the config allows; other models need ``example_inputs``
    (the first batch; later ones are random alike). Causal LMs are also
    decoded greedily for ``generate_tokens`` tokens.

    >>> import copy, torch, enjoyln
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> folded = enjoyln.fold(copy.deepcopy(net), torch.randn(2, 8))
    >>> check(net, folded, torch.randn(2, 8)).passed
    True
    """
    return check_sources(ModelSource.of(reference), ModelSource.of(candidate), example_inputs,
                         batches=batches, seed=seed, batch_size=batch_size, seq_len=seq_len, rtol=rtol,
                         half_factor=half_factor, generate_tokens=generate_tokens,
                         fp32_reference=ModelSource.of(fp32_reference) if fp32_reference is not None else None)


def check_sources(reference: ModelSource, candidate: ModelSource, example_inputs: ExampleInputs = None, *,
                  batches: int = 3, seed: int = 0, batch_size: int = 2, seq_len: int = 16,
                  rtol: float = 1e-5, half_factor: float = 2.0, generate_tokens: int = 8,
                  fp32_reference: ModelSource | None = None, spill: bool = False,
                  max_rows: int = 4) -> CheckReport:
    """``check``, with models produced one at a time: the reference (in the dtype that sets
    the bar), a float32 truth in half precision, then the candidate.

    With ``spill``, the stored outputs go to a temporary directory instead of
    memory, and ``max_rows`` bounds the rows of the coverage batch, so that a
    check within a memory budget holds one model and one batch's outputs.
    """
    half = reference.dtype in HALF or candidate.dtype in HALF
    base_dtype, truth = reference.dtype, None
    if half and reference.dtype not in HALF:
        # an fp32 original against a half-precision candidate: the original is the
        # truth, and the original rounded to the candidate's dtype is the baseline
        base_dtype, truth = candidate.dtype, reference
    elif half:
        truth = fp32_reference or reference
    with tempfile.TemporaryDirectory(prefix="enjoyln-check-") if spill else _nothing() as spill_dir:
        base = _Outputs(Path(spill_dir) / "base" if spill else None)
        truth_out = _Outputs(Path(spill_dir) / "truth" if spill else None) if truth is not None else None
        for store in (base, truth_out):
            if store is not None and store.directory is not None:
                store.directory.mkdir()

        model = reference.get(base_dtype)
        all_inputs = input_batches(model, example_inputs, batches=batches, seed=seed,
                                   batch_size=batch_size, seq_len=seq_len)
        first, coverage = ((None, None) if example_inputs is not None
                           else _covering(model, base_dtype, seed, max_rows))
        if first is not None:
            all_inputs[0] = first
        causal = generate_tokens > 0 and is_causal_lm(model)
        prompt = next((b.kwargs.get("input_ids") for b in all_inputs if "input_ids" in b.kwargs), None)
        prompt = prompt[:, :8] if causal and prompt is not None else None
        for i, inputs in enumerate(all_inputs):
            base.put(i, _run(model, _to(inputs, base_dtype)))
        ref_tokens = _generate(model, prompt, generate_tokens) if prompt is not None else None
        del model
        gc.collect()
        if truth is not None:
            model = truth.get(torch.float32)
            for i, inputs in enumerate(all_inputs):
                truth_out.put(i, _run(model, _to(inputs, torch.float32)))
            del model
            gc.collect()

        model = candidate.get(candidate.dtype)
        worst: dict[str, OutputCheck] = {}
        for i, inputs in enumerate(all_inputs):
            cand = _run(model, _to(inputs, candidate.dtype))
            for name in base.names(i):
                out = _compare(name, base, truth_out, i, cand.get(name), rtol, half_factor, base_dtype)
                prev = worst.get(name)
                if prev is None or (prev.passed and not out.passed) or (
                        prev.passed == out.passed and out.max_abs_diff > prev.max_abs_diff):
                    worst[name] = out
            del cand
        cand_tokens = _generate(model, prompt, generate_tokens) if prompt is not None else None
        del model
        gc.collect()

    outputs = list(worst.values())
    generation = None
    if ref_tokens is not None:
        generation = GenerationCheck(ref_tokens == cand_tokens, generate_tokens,
                                     ref_tokens, cand_tokens, required=not half)
    passed = bool(outputs) and all(o.passed for o in outputs)
    if generation is not None and generation.required:
        passed = passed and generation.passed
    criterion = (f"max|candidate - fp32 original| <= {half_factor} x max|original - fp32 original|"
                 if half else f"max|original - candidate| <= {rtol:g} x max|original|")
    return CheckReport(
        passed=passed,
        max_abs_diff=max((o.max_abs_diff for o in outputs), default=0.0),
        max_rel_diff=max((o.max_rel_diff for o in outputs), default=0.0),
        outputs=outputs, batches=len(all_inputs), dtype=str(base_dtype).replace("torch.", ""),
        criterion=criterion, generation=generation, coverage=coverage,
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
                _run(model, _to(inputs, dtype))
            return inputs, coverage
        except CaptureError:
            continue
    return None, None
