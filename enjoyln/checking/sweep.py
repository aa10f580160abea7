"""The token sweep of a forward-only check: the token ids the other batches missed, up to a limit
(every id of a vocabulary within it), each output kept as a linear random sketch (``SKETCH``
columns), which the precision-aware criterion judges as it judges whole outputs
(docs/checking.md)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..analysis.inputs import (
    Inputs,
    config_value,
    fill_text_ids,
    hf_example_inputs,
    is_hf_model,
    placeholder_ids,
)

SWEEP_TOKENS = 8192
"""The most token ids the sweep runs by default beyond those the other batches drew
(``--sweep-tokens``): each costs a row of logits in every model run, so a 262,144-id vocabulary
swept whole took hours on 2 cores."""
SKETCH = 16
"""Columns of the sketch each sweep output keeps per row."""
BATCH_BYTES = 256 << 20
"""About the most memory one sweep batch's float64 outputs and hidden states take (in the truth)."""
BATCH_WORK = 1 << 34
"""About the most multiply-adds one sweep batch costs one model run: its tokens times the model's
parameters."""


def batch_tokens(vocab: int, hidden: int, params: int, length: int) -> int:
    """Tokens in one sweep batch, whole rows of ``length``: its logits and hidden states within
    ``BATCH_BYTES``, its work within ``BATCH_WORK``, so a larger model runs smaller batches."""
    tokens = min(BATCH_BYTES // (8 * (vocab + 16 * hidden)), BATCH_WORK // max(params, 1), 4096)
    return max(1, tokens // length) * length


def sweep_bytes(
    vocab: int, hidden: int, params: int, length: int = 64, rows: int | None = None
) -> int:
    """The memory one sweep batch (of ``rows`` rows, or as many as ``batch_tokens`` gives) keeps
    live: its float64 outputs and hidden states (for the memory pre-check)."""
    tokens = batch_tokens(vocab, hidden, params, length) if rows is None else rows * length
    return tokens * 8 * (vocab + 16 * hidden)


SUFFIX = " (token sweep, sketched)"
"""Appended to the name of each sketched output, judged apart from the whole outputs."""


def token_sweep(
    model: nn.Module,
    drawn: set[int],
    *,
    seed: int = 0,
    max_rows: int | None = None,
    limit: int = SWEEP_TOKENS,
) -> tuple[list[Inputs], int]:
    """(batches that together run the token ids of ``model``'s vocabulary not in ``drawn``, at most
    ``limit`` of them, drawn at random; how many ids neither ran)."""
    config = getattr(model, "config", None)
    vocab = config_value(config, "vocab_size") if is_hf_model(model) else None
    if not isinstance(vocab, int) or vocab <= 0:
        return [], 0
    gen = torch.Generator().manual_seed(seed + 7919)
    skip = drawn | placeholder_ids(
        config
    )  # an image's placeholders are replaced by its features, never read as text
    todo = torch.tensor(
        [i for i in torch.randperm(vocab, generator=gen).tolist() if i not in skip],
        dtype=torch.long,
    )
    left = max(0, len(todo) - limit)
    todo = todo[:limit]
    if not len(todo):
        return [], left
    max_pos = config_value(config, "max_position_embeddings", "n_positions", "max_target_positions")
    length = min(max_pos, 64) if isinstance(max_pos, int) and max_pos > 0 else 64
    hidden = int(config_value(config, "hidden_size", "n_embd", "d_model") or 0)
    params = sum(p.numel() for p in model.parameters())
    rows = batch_tokens(vocab, hidden, params, length) // length
    rows = min(rows, max_rows) if max_rows else rows
    batches = []
    for k, chunk in enumerate(todo.split(rows * length)):
        inputs = hf_example_inputs(
            model, batch=min(rows, -(-len(chunk) // length)), seq_len=length, seed=seed + 1000 + k
        )
        if "input_ids" not in inputs:
            return [], 0
        # a short last batch keeps random ids after the swept ones
        inputs["input_ids"] = fill_text_ids(config, inputs["input_ids"], chunk)
        batches.append(Inputs((), inputs))
    return batches, left


def drawn_ids(batches: list[Inputs]) -> set[int]:
    return {
        i
        for b in batches
        if isinstance(ids := b.kwargs.get("input_ids"), torch.Tensor)
        for i in ids.reshape(-1).tolist()
    }


def sketched(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each output's sketch, under its name with ``SUFFIX``: floating outputs wider than ``SKETCH``
    times a fixed random matrix along the last axis, in float64; others as they are."""
    return {
        name + SUFFIX: t.detach().to(torch.float64) @ _matrix(t.shape[-1])
        if t.is_floating_point() and t.dim() and t.shape[-1] > SKETCH
        else t
        for name, t in outputs.items()
    }


@functools.lru_cache(maxsize=8)
def _matrix(width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(width)
    return torch.randn(width, SKETCH, generator=gen, dtype=torch.float64) / math.sqrt(SKETCH)
