"""Equivalence check: does a converted model compute what the original did?

In float32 the criterion is ``max|ref - cand| <= rtol * max|ref|`` for every
output on every batch. In float16 and bfloat16 rounding the centered weights
costs about an ulp, so the criterion is relative to the original's own
rounding: the candidate's deviation from a float32 copy of the
reference may be at most ``half_factor`` times the half-precision reference's
own deviation from it.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import CaptureError
from .inputs import (ExampleInputs, Inputs, as_inputs, hf_example_inputs, is_causal_lm, is_hf_model,
                     wants_no_cache)

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"{verdict}: {len(self.outputs)} outputs over {self.batches} batches ({self.dtype}); "
                 f"max abs diff {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}",
                 f"  criterion: {self.criterion}"]
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


def check(reference: nn.Module, candidate: nn.Module, example_inputs: ExampleInputs = None, *,
          batches: int = 3, seed: int = 0, batch_size: int = 2, seq_len: int = 16,
          rtol: float = 1e-5, half_factor: float = 2.0, generate_tokens: int = 8,
          fp32_reference: nn.Module | None = None) -> CheckReport:
    """Compare ``candidate`` with ``reference`` on seeded input batches.

    Hugging Face models get synthesized inputs; other models need
    ``example_inputs`` (the first batch; later ones are random alike). Causal
    LMs are also decoded greedily for ``generate_tokens`` tokens.

    >>> import copy, torch, enjoyln
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> folded = enjoyln.fold(copy.deepcopy(net), torch.randn(2, 8))
    >>> check(net, folded, torch.randn(2, 8)).passed
    True
    """
    dtype, cand_dtype = _dtype(reference), _dtype(candidate)
    half = dtype in HALF or cand_dtype in HALF
    baseline = reference  # the half-precision model whose own rounding sets the bar
    if half and dtype not in HALF:
        # an fp32 original against a half-precision candidate: the original is the
        # truth, and the original rounded to the candidate's dtype is the baseline
        fp32_reference, baseline, dtype = reference, copy.deepcopy(reference).to(cand_dtype), cand_dtype
    elif half and fp32_reference is None:
        fp32_reference = copy.deepcopy(reference).float()
    all_inputs = input_batches(reference, example_inputs, batches=batches, seed=seed,
                               batch_size=batch_size, seq_len=seq_len)
    worst: dict[str, OutputCheck] = {}
    for inputs in all_inputs:
        ref, cand = _run(baseline, _to(inputs, dtype)), _run(candidate, _to(inputs, cand_dtype))
        ref32 = _run(fp32_reference, _to(inputs, torch.float32)) if half else {}
        for name, r in ref.items():
            c = cand.get(name)
            if c is None or c.shape != r.shape:
                worst[name] = OutputCheck(name, float("inf"), float("inf"), False)
                continue
            rd, cd = r.detach().double(), c.detach().double()
            diff = float((rd - cd).abs().max()) if r.numel() else 0.0
            scale = float(rd.abs().max()) if r.numel() else 0.0
            rel = diff / scale if scale else (0.0 if diff == 0 else float("inf"))
            out = OutputCheck(name, diff, rel, False)
            if not r.is_floating_point():
                out.passed = bool(torch.equal(r, c))
            elif half and name in ref32:
                truth = ref32[name].double()
                out.reference_error = float((rd - truth).abs().max())
                out.candidate_error = float((cd - truth).abs().max())
                floor = torch.finfo(dtype).eps * float(truth.abs().max())
                out.passed = out.candidate_error <= half_factor * max(out.reference_error, floor)
            else:
                out.passed = diff <= rtol * scale
            prev = worst.get(name)
            if prev is None or (prev.passed and not out.passed) or (prev.passed == out.passed and out.max_abs_diff > prev.max_abs_diff):
                worst[name] = out
    outputs = list(worst.values())
    generation = None
    if generate_tokens > 0 and is_causal_lm(reference):
        prompt = next((b.kwargs.get("input_ids") for b in all_inputs if "input_ids" in b.kwargs), None)
        if prompt is not None:
            ref_tokens = _generate(baseline, prompt[:, :8], generate_tokens)
            cand_tokens = _generate(candidate, prompt[:, :8], generate_tokens)
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
        outputs=outputs, batches=len(all_inputs), dtype=str(dtype).replace("torch.", ""),
        criterion=criterion, generation=generation,
    )
