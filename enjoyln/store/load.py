"""Loading a folded directory: ``load`` with RMSNorm, ``load_plain`` as the library's own loader
gives it."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..errors import CheckpointError, EnjoylnError, first_line
from ..transform.steps import reapply_on_load
from .checkpoint import Checkpoint, open_checkpoint
from .quiet import quiet_libraries

__all__ = ["load", "load_plain"]


def load(
    path: str | os.PathLike | Checkpoint,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    max_memory: int | None = None,
    offload_dir: str | os.PathLike | None = None,
    model_class: str | None = None,
    **from_pretrained_kwargs: Any,
) -> nn.Module:
    """Load a folded directory and run its recorded LNs as ``enjoyln.RMSNorm``
    (``from_pretrained_kwargs`` go to ``from_pretrained``). With ``max_memory`` (bytes), the rest
    of the weights are read from disk as each layer runs.

    >>> model = load("gpt2-folded", dtype="bfloat16")  # doctest: +SKIP
    """
    return _load(
        path,
        False,
        allow_pickle,
        trust_remote_code,
        model_class,
        max_memory=max_memory,
        offload_dir=offload_dir,
        **from_pretrained_kwargs,
    )


def load_plain(
    path: str | os.PathLike | Checkpoint,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    model_class: str | None = None,
    **from_pretrained_kwargs: Any,
) -> nn.Module:
    """What the library's own loader gives for a directory, the class chosen as ``load`` chooses it:
    a folded directory keeps its LayerNorms, which see zero-mean inputs.

    >>> model = load_plain("gpt2-folded")  # doctest: +SKIP
    """
    return _load(path, True, allow_pickle, trust_remote_code, model_class, **from_pretrained_kwargs)


def _load(
    path: str | os.PathLike | Checkpoint,
    plain: bool,
    allow_pickle: bool,
    trust_remote_code: bool,
    model_class: str | None,
    **kwargs: Any,
) -> nn.Module:
    """``load``, or with ``plain`` what the library's own loader gives (the recorded LNs stay
    LayerNorms)."""
    checkpoint = (
        path
        if isinstance(path, Checkpoint)
        else open_checkpoint(
            path,
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
            model_class=model_class,
        )
    )
    plan = checkpoint.recorded_plan  # a malformed block is refused before the weights load
    if plain:
        plan = None
    try:
        with (
            quiet_libraries()
        ):  # as in every other enjoyln call: no "Loading weights" bar, the user's settings back
            model = checkpoint.library.load(
                checkpoint, trust_remote_code=checkpoint.trust_remote_code, **kwargs
            )
    except EnjoylnError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"cannot load {checkpoint.path}: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    if plan is not None:  # the centerings, fusions and rotations are on disk: what they cannot hold
        reapply_on_load(model, plan)
    return model.eval()
