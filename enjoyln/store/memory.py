"""Memory: what this process may still allocate, and what loading a model directory builds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .formats import CODES, DTYPES

if TYPE_CHECKING:
    from .checkpoint import Checkpoint


def available_memory() -> int | None:
    """Bytes this process could still allocate: free memory, capped by a cgroup limit; None if
    unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            cap = int(Path(limit).read_text().split()[0]) - int(Path(usage).read_text().split()[0])
        except (OSError, ValueError, IndexError):  # "max", or no such controller
            continue
        avail = cap if avail is None else min(avail, cap)
    return avail


def built_bytes(model: nn.Module, dtype_name: str) -> tuple[int, int]:
    """(total, largest) bytes of what loading builds, buffers made from its config included (GPT-J's
    sinusoid table); floating parameters in the dtype it loads in, buffers in their own."""
    dtype = getattr(torch, dtype_name, None)
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
    seen: set[int] = set()
    total = largest = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel() * (
            size if isinstance(t, nn.Parameter) and t.is_floating_point() else t.element_size()
        )
        total, largest = total + n, max(largest, n)
    return total, largest


_WIDER = {"F16": 4, "BF16": 4, "F32": 8}
"""Bytes per element of the truth (the reference in the next wider dtype) for each stored dtype."""


def truth_ratio(checkpoint: Checkpoint) -> float:
    """How much wider the truth's tensors are than the reference's: 2, or 1 without a truth."""
    dtype = CODES.get(dominant_dtype(checkpoint))
    return _WIDER[dtype] / DTYPES[dtype].itemsize if dtype in _WIDER else 1.0


def forward_check_bytes(checkpoint: Checkpoint) -> int:
    """What the forward comparison needs: both models, the reference's truth in the next wider
    dtype, activations."""
    n = max(checkpoint.nbytes, checkpoint.built[0])
    if checkpoint.pickled:  # no header to read dtypes from: take float32, the usual
        truth = 2 * checkpoint.nbytes
    else:
        truth = sum(
            t.nbytes // DTYPES[t.dtype].itemsize * _WIDER[t.dtype]
            for t in checkpoint.tensors.values()
            if t.dtype in _WIDER
        )
    truth = truth * n / max(checkpoint.nbytes, 1)  # what the model builds is widened too
    return int(2.1 * n + truth) + (256 << 20)


def dominant_dtype(checkpoint: Checkpoint) -> torch.dtype:
    by_bytes: dict[str, int] = {}
    for t in checkpoint.tensors.values():
        if DTYPES[t.dtype].is_floating_point:
            by_bytes[t.dtype] = by_bytes.get(t.dtype, 0) + t.nbytes
    return DTYPES[max(by_bytes, key=by_bytes.get)] if by_bytes else torch.float32


def config_value_dict(config: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` in a raw config.json, or in one of its sub-configs."""
    for cfg in (
        config,
        *(config.get(s) for s in ("text_config", "decoder", "encoder", "vision_config")),
    ):
        if isinstance(cfg, dict):
            for name in names:
                if isinstance(cfg.get(name), (int, float)) and not isinstance(cfg.get(name), bool):
                    return cfg[name]
    return None
