"""Memory: sizes as the command line writes them, what this process may still allocate, and what
loading a model directory builds (its tensors, the next wider dtype of the truth, both models of
the forward check side by side)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .formats import CODES, DTYPES
from .model_dir import ModelDir, load_dtype, meta_model


def parse_size(text: str | int | None) -> int | None:
    """'500MB', '2GB', '1.5GiB' or a byte count, as bytes."""
    if text is None:
        return None
    if isinstance(text, int):
        if text <= 0:
            raise CheckpointError(f"cannot use the size {text}; it must be positive")
        return text
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6,
             "GB": 10**9, "B": 1}
    size = None
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                size = int(float(s[: -len(unit)]) * mult)
            except (ValueError, OverflowError):
                pass
            break
    else:
        size = int(s) if s.isdigit() else None
    if size is None or size <= 0:
        raise CheckpointError(f"cannot use the size {text!r}; write a positive size such as 500MB or 2GB")
    return size


def available_memory() -> int | None:
    """Bytes this process could still allocate: free memory, capped by a cgroup limit; None if unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = int(Path(limit).read_text().split()[0]) - int(Path(usage).read_text().split()[0])
        except (OSError, ValueError, IndexError):  # "max", or no such controller
            continue
        avail = cap if avail is None else min(avail, cap)
    return avail


def built_bytes(md: ModelDir) -> tuple[int, int]:
    """(total, largest) bytes of what loading ``md`` builds: every parameter and buffer of the
    meta model, which knows them all without allocating any. That includes what the model makes
    from its config alone, stored nowhere (GPT-J's sinusoid table grows with n_positions).
    Floating parameters count in the dtype the model loads in; buffers in their own."""
    cached = getattr(md, "_built_bytes", None)
    if cached is not None:
        return cached
    model = meta_model(md)
    name = load_dtype(md)[0]
    dtype = getattr(torch, name, None)
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
    seen: set[int] = set()
    total = largest = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        is_param = isinstance(t, nn.Parameter)
        n = t.numel() * (size if is_param and t.is_floating_point() else t.element_size())
        total, largest = total + n, max(largest, n)
    md._built_bytes = (total, largest)  # type: ignore[attr-defined]  # the meta model takes a while to build
    return total, largest


_WIDER = {"F16": 4, "BF16": 4, "F32": 8}
"""Bytes per element of the truth (the reference in the next wider dtype) for each stored dtype."""


def truth_bytes(md: ModelDir) -> int:
    """The reference's weights in the next wider dtype, which the precision-aware criterion runs
    (float64 for float32, float32 for half precision; nothing for float64)."""
    if md.pickled:  # no header to read dtypes from: take float32, the usual
        return 2 * md.nbytes
    return sum(t.nbytes // DTYPES[t.dtype].itemsize * _WIDER[t.dtype]
               for t in md.tensors.values() if t.dtype in _WIDER)


def truth_ratio(md: ModelDir) -> float:
    """How much wider the truth's tensors are than the reference's: 2, or 1 without a truth."""
    dtype = CODES.get(dominant_dtype(md))
    return _WIDER[dtype] / DTYPES[dtype].itemsize if dtype in _WIDER else 1.0


def forward_check_bytes(md: ModelDir) -> int:
    """What the forward comparison needs with both models in memory: both models as loading builds
    them, the reference's truth in the next wider dtype (held with them), and room for activations."""
    n = max(md.nbytes, built_bytes(md)[0])
    truth = truth_bytes(md) * n / max(md.nbytes, 1)  # what the model builds is widened too
    return int(2.1 * n + truth) + (256 << 20)


def dominant_dtype(md: ModelDir) -> torch.dtype:
    """The floating dtype that holds most of ``md``'s stored bytes (float32 if none)."""
    by_bytes: dict[str, int] = {}
    for t in md.tensors.values():
        if DTYPES[t.dtype].is_floating_point:
            by_bytes[t.dtype] = by_bytes.get(t.dtype, 0) + t.nbytes
    return DTYPES[max(by_bytes, key=by_bytes.get)] if by_bytes else torch.float32


def config_value_dict(config: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` in a raw config.json, or in one of its sub-configs."""
    for cfg in (config, *(config.get(s) for s in ("text_config", "decoder", "encoder", "vision_config"))):
        if isinstance(cfg, dict):
            for name in names:
                if isinstance(cfg.get(name), (int, float)) and not isinstance(cfg.get(name), bool):
                    return cfg[name]
    return None
