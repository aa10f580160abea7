"""Running a model as the checks do: floating inputs cast to its dtype, one call under a seeded
RNG, and every tensor of its output named."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ..analysis.inputs import Inputs
from ..errors import CaptureError, first_line


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


def cast_inputs(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    """Floating inputs in ``dtype`` (pixel values, audio features); token ids stay."""
    cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    return Inputs(tuple(cast(a) for a in inputs.args), {k: cast(v) for k, v in inputs.kwargs.items()})


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's RNG seeded for one model call and restored after it: a model whose eval forward
    draws random numbers (ViTMAE's and PatchTST's random masking) must draw the same ones in
    the reference, its truth and every candidate run, or a correct candidate (even an exact
    copy) differs from it; the caller's RNG is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def run_model(model: nn.Module, inputs: Inputs, seed: int) -> dict[str, torch.Tensor]:
    """The model's outputs on ``inputs``, under torch's RNG seeded with ``seed``."""
    try:
        with torch.no_grad(), seeded(seed):
            return flatten_outputs(inputs.call(model))
    except Exception as exc:  # the model's own error, on inputs enjoyln made or was given
        first = first_line(exc)
        raise CaptureError(f"running {type(model).__name__} on the check inputs failed: "
                           f"{type(exc).__name__}: {first}") from exc
