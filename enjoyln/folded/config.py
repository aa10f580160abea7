"""config.json as a fold writes it, with its ``enjoyln`` block."""

from __future__ import annotations

import json
from typing import Any

from .._version import __version__
from ..plan import FoldPlan, block_lists
from ..store.checkpoint import Checkpoint


def output_config(
    checkpoint: Checkpoint, plan: FoldPlan, dtype: str | None = None
) -> dict[str, Any]:
    """The input's config.json with the ``enjoyln`` block, and the dtype it loads in where it names
    none (transformers would otherwise take the first tensor's, which an untied head or
    re-sharding changes), or ``dtype``, the one the fold is stored in."""
    config = json.loads(json.dumps(checkpoint.config))
    if (
        checkpoint.source == "transformers"
        and checkpoint.architecture != config["architectures"][0]
    ):
        config["architectures"] = [
            checkpoint.architecture
        ]  # --model-class: the fold is a checkpoint of that class
    if checkpoint.source == "transformers" and (
        dtype is not None or (config.get("dtype") is None and config.get("torch_dtype") is None)
    ):
        config.pop("torch_dtype", None)
        config["dtype"] = dtype or checkpoint.load_dtype[0]
    if plan.untied:
        config["tie_word_embeddings"] = False
        for sub in ("text_config", "decoder"):
            if isinstance(config.get(sub), dict) and "tie_word_embeddings" in config[sub]:
                config[sub]["tie_word_embeddings"] = False
    config["enjoyln"] = {
        "format_version": plan.format_version,
        "version": __version__,
        **block_lists(plan),
        "plan": plan.to_dict(),
    }
    for i, r in enumerate(plan.rotations):
        block = {
            "kind": r.kind,
            "seed": r.seed,
            "keep_mean": r.keep_mean,
            "plain_loading_exact": r.keep_mean,
        }
        if i == 0:
            config["enjoyln"]["rotation"] = block
        else:  # the further streams' rotations, each with its width
            config["enjoyln"].setdefault("more_rotations", []).append(
                {"stream": r.stream, "width": r.width, **block}
            )
    return config
