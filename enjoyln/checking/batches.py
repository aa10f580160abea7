"""The forward check's inputs: seeded batches, and the coverage batch that reaches every position
the config allows."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..analysis.inputs import (
    ExampleInputs,
    Inputs,
    as_inputs,
    config_value,
    described_inputs,
    fill_text_ids,
    hf_example_inputs,
    inputs_like,
    is_hf_model,
    placeholder_ids,
    wants_no_cache,
)
from ..errors import CaptureError
from .report import Coverage
from .running import cast_inputs, run_model


def input_batches(
    model: nn.Module,
    example_inputs: ExampleInputs = None,
    *,
    batches: int = 3,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 16,
) -> list[Inputs]:
    """Seeded input batches: synthesized from the model's configuration, else like the examples."""
    if example_inputs is None:
        if is_hf_model(model):
            return [
                Inputs(
                    (), hf_example_inputs(model, batch=batch_size, seq_len=seq_len, seed=seed + i)
                )
                for i in range(batches)
            ]
        described = [
            described_inputs(model, batch=batch_size, seed=seed + i) for i in range(batches)
        ]
        if described[0] is None:
            raise CaptureError(
                f"{type(model).__name__} is not a Hugging Face model and records no input size "
                "(timm's pretrained_cfg, open_clip's image_size or context_length); pass "
                "example_inputs to check it"
            )
        return described
    first = as_inputs(example_inputs)
    if is_hf_model(model) and wants_no_cache(model):
        first.kwargs.setdefault("use_cache", False)
    return [first] + [inputs_like(first, seed + i) for i in range(1, batches)]


MAX_COVER_POSITIONS = 2048
"""Longest sequence the coverage batch feeds; longer position tables are covered by the static
check."""
COVER_TOKENS = 4096
"""Most tokens in the coverage batch, spread over up to four rows of distinct ids."""
COVER_BYTES = 1 << 30
"""About the most memory the coverage batch's float64 logits take beyond its first row: with a
vocabulary of 262,144 and 1,024 positions, four rows made 13 GiB of kept outputs, where one row
covers every position."""


def coverage_batch(
    model: nn.Module, *, seed: int = 0, length: int | None = None, max_rows: int = 4
) -> tuple[Inputs, Coverage] | None:
    """One batch that reaches every position the config allows, with as many distinct token ids as
    fit (a few random tokens reach a few percent of a table), or None without token inputs."""
    if not is_hf_model(model):
        return None
    config, params = model.config, inspect.signature(model.forward).parameters
    vocab = config_value(config, "vocab_size")
    max_pos = config_value(config, "max_position_embeddings", "n_positions", "max_target_positions")
    max_pos = max_pos if isinstance(max_pos, int) and max_pos > 0 else None
    if "input_ids" not in params or not isinstance(vocab, int) or vocab <= 0:
        return None
    length = length or min(max_pos or MAX_COVER_POSITIONS, MAX_COVER_POSITIONS)
    rows = max(
        1,
        min(
            max_rows,
            COVER_TOKENS // length,
            -(-min(vocab, COVER_TOKENS) // length),
            COVER_BYTES // (8 * length * vocab),
        ),
    )
    inputs = hf_example_inputs(model, batch=rows, seq_len=length, seed=seed)
    if "input_ids" not in inputs:
        return None
    gen = torch.Generator().manual_seed(seed)
    shape = inputs["input_ids"].shape
    count = shape[0] * shape[1]
    marks = torch.tensor(sorted(placeholder_ids(config)), dtype=torch.long)
    ids = torch.cat(
        [
            perm[~torch.isin(perm, marks)]
            for perm in (
                torch.randperm(vocab, generator=gen) for _ in range(-(-count // vocab) + 1)
            )
        ]
    )[:count]
    # an image's placeholder tokens stay: as many as its features, or the model refuses the batch
    inputs["input_ids"] = fill_text_ids(config, inputs["input_ids"], ids)
    types = getattr(config, "type_vocab_size", None)
    if "token_type_ids" in params and isinstance(types, int) and types > 1:
        inputs["token_type_ids"] = torch.randint(0, types, shape, generator=gen).to(ids.device)
    return Inputs((), inputs), Coverage(shape[1], max_pos, int(ids.unique().numel()), vocab)


def covering(
    model: nn.Module, dtype: torch.dtype, seed: int, max_rows: int = 4
) -> tuple[Inputs | None, Coverage | None]:
    """The coverage batch at the longest length the model accepts (RoBERTa's 512 positions allow 510
    tokens), shorter lengths tried before giving up on full coverage."""
    found = coverage_batch(model, seed=seed, max_rows=max_rows)
    length = found[1].positions if found is not None else 0
    for attempt in (length, length - 1, length - 2, length // 2, length // 4):
        if attempt < 1:
            break
        inputs, coverage = (
            found
            if attempt == length
            else coverage_batch(model, seed=seed, length=attempt, max_rows=max_rows)
        )
        try:
            run_model(model, cast_inputs(inputs, dtype), seed)  # under no_grad
            return inputs, coverage
        except CaptureError:
            continue
    return None, None
