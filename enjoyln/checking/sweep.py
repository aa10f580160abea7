"""The token sweep of a forward-only check: every token id of the vocabulary run at least once, each
output kept as a linear random sketch (``SKETCH`` columns), which the precision-aware criterion judges
as it judges whole outputs (docs/checking.md)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..analysis.inputs import Inputs, config_value, fill_text_ids, hf_example_inputs, is_hf_model, placeholder_ids

MAX_VOCAB = 262_144
"""The largest vocabulary swept whole; a larger one is reported as the count of ids drawn."""
SKETCH = 16
"""Columns of the sketch each sweep output keeps per row."""
BATCH_BYTES = 256 << 20
"""About the largest float64 output one sweep batch makes (its logits, in the truth)."""
SUFFIX = " (token sweep, sketched)"
"""Appended to the name of each sketched output, judged apart from the whole outputs."""


def token_sweep(model: nn.Module, drawn: set[int], *, seed: int = 0, max_rows: int | None = None) -> list[Inputs]:
    """Batches that together run every token id of ``model``'s vocabulary not in ``drawn`` (none over ``MAX_VOCAB``)."""
    if not is_hf_model(model):
        return []
    config = model.config
    vocab = config_value(config, "vocab_size")
    if not isinstance(vocab, int) or not 0 < vocab <= MAX_VOCAB:
        return []
    gen = torch.Generator().manual_seed(seed + 7919)
    skip = drawn | placeholder_ids(config)  # an image's placeholders are replaced by its features, never read as text
    todo = torch.tensor([i for i in torch.randperm(vocab, generator=gen).tolist() if i not in skip], dtype=torch.long)
    if not len(todo):
        return []
    max_pos = config_value(config, "max_position_embeddings", "n_positions", "max_target_positions")
    length = min(max_pos, 64) if isinstance(max_pos, int) and max_pos > 0 else 64
    width = max(vocab, int(config_value(config, "hidden_size", "n_embd", "d_model") or 0))
    rows = max(1, min(4096, BATCH_BYTES // (8 * width)) // length)
    rows = min(rows, max_rows) if max_rows else rows
    batches = []
    for k, chunk in enumerate(todo.split(rows * length)):
        inputs = hf_example_inputs(model, batch=rows, seq_len=length, seed=seed + 1000 + k)
        if "input_ids" not in inputs:
            return []
        # a short last batch keeps random ids after the swept ones
        inputs["input_ids"] = fill_text_ids(config, inputs["input_ids"], chunk)
        batches.append(Inputs((), inputs))
    return batches


def drawn_ids(batches: list[Inputs]) -> set[int]:
    return {i for b in batches if isinstance(ids := b.kwargs.get("input_ids"), torch.Tensor)
            for i in ids.reshape(-1).tolist()}


def sketched(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each output's sketch, under its name with ``SUFFIX``: floating outputs wider than ``SKETCH`` times a
    fixed random matrix along the last axis, in float64; others as they are."""
    return {name + SUFFIX: t.detach().to(torch.float64) @ _matrix(t.shape[-1])
            if t.is_floating_point() and t.dim() and t.shape[-1] > SKETCH else t for name, t in outputs.items()}


@functools.lru_cache(maxsize=8)
def _matrix(width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(width)
    return torch.randn(width, SKETCH, generator=gen, dtype=torch.float64) / math.sqrt(SKETCH)
