"""Loading a folded sentence-transformers directory: its transformer runs the recorded LNs as
``enjoyln.RMSNorm``, its pooling and normalization as they were.

A sentence-transformers directory keeps the transformer's config.json and weights at its top
level, beside ``modules.json`` and the pooling's folder, so ``enjoyln fold`` folds it like any
model directory and copies the rest. sentence-transformers then builds the pipeline; this only
puts back what the checkpoint cannot hold, as ``enjoyln.load`` does.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from torch import nn

from .errors import CheckpointError, EnjoylnError, first_line
from .store.checkpoint import open_checkpoint
from .transform.steps import reapply_on_load

__all__ = ["load_sentence_transformer"]


def load_sentence_transformer(
    path: str | os.PathLike, *, trust_remote_code: bool = False, **kwargs: Any
) -> Any:
    """A folded sentence-transformers directory as a ``SentenceTransformer``, its recorded LNs
    running as ``enjoyln.RMSNorm``; ``kwargs`` go to ``SentenceTransformer`` (``device=...``).

    >>> model = load_sentence_transformer("all-MiniLM-L6-v2-folded")  # doctest: +SKIP
    >>> model.encode(["a folded sentence"]).shape  # doctest: +SKIP
    (1, 384)
    """
    try:
        st = importlib.import_module("sentence_transformers")
    except Exception as exc:
        raise EnjoylnError(
            f"load_sentence_transformer needs sentence-transformers ({first_line(exc)}); "
            "pip install sentence-transformers"
        ) from None
    checkpoint = open_checkpoint(path, trust_remote_code=trust_remote_code)
    plan = checkpoint.recorded_plan  # a malformed block is refused before anything loads
    try:
        model = st.SentenceTransformer(
            str(checkpoint.path), trust_remote_code=trust_remote_code, **kwargs
        )
    except Exception as exc:
        raise CheckpointError(
            f"sentence-transformers cannot load {checkpoint.path}: {type(exc).__name__}: "
            f"{first_line(exc)}"
        ) from None
    if plan is not None:
        reapply_on_load(_transformer(model, checkpoint.architecture), plan)
    return model.eval()


def _transformer(model: nn.Module, architecture: str) -> nn.Module:
    """The model sentence-transformers built from the directory's top level, which the plan was
    made for: the same class, or the plan's names would not be its names."""
    found = [m.auto_model for m in model if isinstance(getattr(m, "auto_model", None), nn.Module)]
    if len(found) != 1:
        raise CheckpointError(
            f"expected one transformer in the sentence-transformers pipeline, found {len(found)}"
        )
    if type(found[0]).__name__ != architecture:
        raise CheckpointError(
            f"sentence-transformers loads this directory as {type(found[0]).__name__}, but it was "
            f"folded as {architecture}; fold the original with --model-class "
            f"{type(found[0]).__name__}"
        )
    return found[0]
