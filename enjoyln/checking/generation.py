"""Greedy generation for the forward check: decoding, flips judged as near-ties, and the generation
settings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..analysis.inputs import config_value
from ..errors import CaptureError, first_line
from .report import NearTie, worse
from .running import model_device, seeded


PROMPT_TOKENS = 8
"""Longest prompt the generation check feeds (fewer where the context is short)."""


def generation_lengths(model: nn.Module, new_tokens: int) -> tuple[int, int]:
    """(prompt tokens, new tokens) that fit the model's context; (0, 0): no room to generate."""
    limit = config_value(
        getattr(model, "config", None),
        "max_position_embeddings",
        "n_positions",
        "max_target_positions",
    )
    if not isinstance(limit, int) or limit <= 0:
        return PROMPT_TOKENS, new_tokens
    prompt = min(PROMPT_TOKENS, max(1, limit - new_tokens))
    new = min(new_tokens, limit - prompt)
    return (prompt, new) if new > 0 else (0, 0)


TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache"})
"""A batch's inputs that ``generate`` makes itself, or that belong to the text alone."""


def prompt_of(batch: dict[str, Any], length: int) -> dict[str, Any] | None:
    """The prompt greedy decoding starts from: the first ``length`` tokens of a text batch; a batch
    with images or audio (and what the model reads beside them) whole, as its placeholder tokens
    must each meet an image feature. None for a batch without tokens.

    >>> ids = torch.arange(12).view(2, 6)
    >>> prompt_of({"input_ids": ids, "use_cache": False}, 4)["input_ids"].shape
    torch.Size([2, 4])
    >>> sorted(prompt_of({"input_ids": ids, "pixel_values": torch.zeros(2, 3)}, 4))
    ['input_ids', 'pixel_values']
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return None
    more = {k: v for k, v in batch.items() if k not in TEXT_INPUTS}
    return {"input_ids": ids, **more} if more else {"input_ids": ids[:, :length]}


Generated = tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]
"""The new tokens of each row, then per step the raw logits and the scores generate() chose by."""


def generate_greedy(model: nn.Module, prompt: dict[str, Any], n: int, seed: int) -> Generated:
    """Greedy tokens from ``prompt`` (``prompt_of``), with every step's raw logits and processed
    scores (seeded as in ``run_model``)."""
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]
    device = model_device(model)
    given = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in prompt.items()}
    ids = given["input_ids"]
    try:
        with torch.no_grad(), seeded(seed):
            out = model.generate(
                **given,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad,
                output_logits=True,
                output_scores=True,
                return_dict_in_generate=True,
            )
    except Exception as exc:  # the model's own error, on a prompt enjoyln made
        raise CaptureError(
            f"greedy generation with {type(model).__name__} failed: "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from exc
    return (
        out.sequences[:, ids.shape[1] :].tolist(),
        [t.detach().cpu().clone() for t in out.logits],
        [t.detach().cpu().clone() for t in (out.scores or ())],
    )


def _margin(scores: list[torch.Tensor], step: int, row: int, mine: int, other: int) -> float:
    if step >= len(scores) or max(mine, other) >= scores[step].shape[-1]:
        return math.inf
    r = scores[step][row].double()
    return float(r[mine] - r[other])


def judge_generation(
    ref: Generated, cand: Generated, tolerance: float | None
) -> tuple[bool, list[NearTie], str]:
    """Identical tokens pass; a row whose tokens differ passes only at a genuine near-tie
    (docs/checking.md)."""
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
        for s in range(step + 1):  # a NaN or Inf on either side makes it infinite (``worse``)
            r, c = ref_logits[s][row].double(), cand_logits[s][row].double()
            dev = worse(dev, float((r - c).abs().max()) if r.shape == c.shape else math.inf)
        theirs = _margin(ref_scores, step, row, a[step], b[step])
        ours = _margin(cand_scores, step, row, b[step], a[step])
        flip = (
            f"row {row} step {step}: token {b[step]} for {a[step]}, margins {theirs:.3g} "
            "(original) and "
            f"{ours:.3g} (candidate) in the scores generate() used"
        )
        if tolerance is None:
            return (
                False,
                ties,
                f"{flip}; not a near-tie: the original has no finite tolerance for its logits",
            )
        if not dev <= tolerance:
            return (
                False,
                ties,
                (
                    f"{flip}; not a near-tie: the step logits are {dev:.3g} from the original's, "
                    f"more than the tolerance {tolerance:.3g}"
                ),
            )
        if not (theirs <= 2 * tolerance and ours <= 2 * tolerance):
            return (
                False,
                ties,
                (
                    f"{flip}; not a near-tie: a margin is more than twice the tolerance "
                    f"{tolerance:.3g} (the generation settings differ, or the scores do)"
                ),
            )
        ties.append(NearTie(row, step, a[step], b[step], theirs, dev, ours))
    return True, ties, ""


def generation_settings(model: nn.Module) -> dict[str, Any] | None:
    """The generation settings generate() starts from, as the loader gave them to the model."""
    config = getattr(model, "generation_config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    # without the running transformers' version, the same on both sides
    return {key: value for key, value in config.to_dict().items() if key != "transformers_version"}


def settings_problems(ref: dict[str, Any] | None, cand: dict[str, Any] | None) -> list[str]:
    from .compare import same_json

    if ref is None or cand is None:
        return (
            []
            if ref is cand
            else [
                f"the candidate has {'none' if cand is None else 'some'}, the original "
                f"{'none' if ref is None else 'some'}"
            ]
        )
    return [
        f"{key} is {cand.get(key)!r}, the original's {ref.get(key)!r}"
        for key in sorted(ref.keys() | cand.keys())
        if not same_json(ref.get(key), cand.get(key))
    ]
