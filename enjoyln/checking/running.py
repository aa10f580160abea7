"""Running a model as the checks do: inputs cast to its dtype, one call under a seeded RNG, outputs
named."""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..analysis.inputs import Inputs
from ..errors import CaptureError, EnjoylnError, first_line


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
    return {
        name: t
        for key, value in items
        for name, t in flatten_outputs(value, f"{prefix}.{key}" if prefix else str(key)).items()
    }


def _map(inputs: Inputs, f: Callable[[Any], Any]) -> Inputs:
    return Inputs(tuple(f(a) for a in inputs.args), {k: f(v) for k, v in inputs.kwargs.items()})


def cast_inputs(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    """Floating inputs in ``dtype`` (pixel values, audio features); token ids stay."""
    return _map(
        inputs,
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
    )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's RNG seeded for one model call and restored after it: a model whose eval forward draws
    random numbers (ViTMAE's masking) must draw the same ones in every run."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def check_device(device: str) -> None:
    """Refuse, in one line, a device this machine does not have (``"cuda"`` without a GPU).

    >>> check_device("cpu")
    """
    where = None
    with contextlib.suppress(RuntimeError, TypeError):
        where = torch.device(device)
    if where is None or where.type not in ("cpu", "cuda"):
        raise EnjoylnError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise EnjoylnError(f"device {device}, but CUDA is not available here")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise EnjoylnError(
            f"device {device}, but there are {torch.cuda.device_count()} CUDA devices"
        )


def model_device(model: nn.Module) -> torch.device:
    """Where the model's weights are (the CPU for weights offloaded to disk, on the meta device)."""
    return next(
        (p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu")
    )


def run_model(model: nn.Module, inputs: Inputs, seed: int) -> dict[str, torch.Tensor]:
    """The model's outputs on ``inputs``, under torch's RNG seeded with ``seed``; a model on a GPU
    gets its inputs there, and its outputs come back to the CPU, where they are compared."""
    device = model_device(model)
    try:
        if device.type != "cpu":  # the check makes its inputs on the CPU
            inputs = _map(inputs, lambda x: x.to(device) if isinstance(x, torch.Tensor) else x)
        with torch.no_grad(), seeded(seed):
            out = flatten_outputs(inputs.call(model))
        return out if device.type == "cpu" else {k: v.cpu() for k, v in out.items()}
    except Exception as exc:  # the model's own error, on inputs enjoyln made or was given
        raise CaptureError(
            f"running {type(model).__name__} on the check inputs failed: "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from exc


def seed_missing(model: nn.Module, names: list[str], seed: int = 0) -> nn.Module:
    """Give the parameters ``names`` (which no checkpoint holds, so every load draws them at random)
    the same seeded values in every model the check loads.

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> a = seed_missing(net, ["0.bias"])[0].bias.clone()
    >>> torch.equal(a, seed_missing(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0.bias"])[0].bias)
    True
    """
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02) or 0.02)
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
    with torch.no_grad():
        for name in names:
            path, _, leaf = name.rpartition(".")
            owner = model.get_submodule(path)
            t = getattr(owner, leaf)
            if t.device.type == "meta":  # offloaded: it is read from disk, where it is not
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            values = (
                torch.randn(t.shape, generator=gen) * std
            )  # float32: the same values in a wider truth
            if isinstance(owner, norms) and leaf == "weight":
                values += 1
            t.copy_(values.to(t.dtype))
    return model
