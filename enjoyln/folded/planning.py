"""The plan for a model directory: the analysis of its meta model, with gains read from its
weights."""

from __future__ import annotations

import collections
import contextlib
import copy
import json
from typing import Any, Hashable

import torch

from ..analysis import analyze
from ..errors import CheckpointError, EnjoylnError
from ..plan import AFFINE_GAIN, MISSING, SERVED, FoldPlan, Note, RotationSpec
from ..store.checkpoint import Checkpoint
from ..store.hf import matching_class
from ..store.tensors import TensorReader


def analyze_dir(
    checkpoint: Checkpoint,
    auxiliary_centering: bool,
    fuse_affine: bool = False,
    rotate: RotationSpec | None = None,
    *,
    must_rotate: bool = False,
    exact_outputs: str = SERVED,
) -> FoldPlan:
    """The plan for ``checkpoint``'s meta model, analysed again where a gain it divides by has a
    zero entry; ``must_rotate``: a rotation the meta model already rules out is refused before
    any weight is read."""
    options = {
        "auxiliary_centering": auxiliary_centering,
        "fuse_affine": fuse_affine,
        "rotate": rotate,
        "exact_outputs": exact_outputs,
    }
    plan = remembered_analysis(checkpoint, options)
    if must_rotate and plan.rotation is None:
        raise EnjoylnError(f"{plan.not_rotated()}; nothing was written")
    names = sorted(
        {c.scale for c in plan.centered if c.scale}
        | {f"{e.name}.weight" for e in plan.affine_moved if e.affine == AFFINE_GAIN}
    )
    if names:
        gains = dict(zip(names, read_tensors(checkpoint, names)))
        if not all(bool(g.ne(0).all()) for g in gains.values()):
            plan = analyze(checkpoint.meta, weights=gains, **options)
    if checkpoint.missing:
        plan.notes.append(missing_note(checkpoint.missing, checkpoint.architecture))
    return plan


MEMO_SIZE = 16
_memo: collections.OrderedDict[Hashable, FoldPlan] = collections.OrderedDict()


def remembered_analysis(checkpoint: Checkpoint, options: dict[str, Any]) -> FoldPlan:
    """``analyze(checkpoint.meta, **options)``, traced once per process for what it depends on:
    a fold traces its source, and the check that follows traces the same directory as its
    reference. The key is everything the meta model is built from (the library, the class, the
    config's JSON, each tensor's name, dtype and shape, the default dtype), so two directories
    with the same key give the same trace; a model with custom code is traced every time. Each
    caller gets its own copy, which it may change."""
    key = _identity(checkpoint, options)
    if key is None:
        return analyze(checkpoint.meta, **options)
    if key in _memo:
        _memo.move_to_end(key)
    else:
        _memo[key] = analyze(checkpoint.meta, **options)
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return copy.deepcopy(_memo[key])


def forget_analyses() -> None:
    """Drop every remembered analysis (tests that change the analysis's code in process)."""
    _memo.clear()


def _identity(checkpoint: Checkpoint, options: dict[str, Any]) -> Hashable | None:
    if checkpoint.custom_code:
        return None
    tensors = tuple(sorted((k, t.dtype, tuple(t.shape)) for k, t in checkpoint.tensors.items()))
    return (
        checkpoint.source,
        checkpoint.architecture,
        json.dumps(checkpoint.config, sort_keys=True),
        checkpoint.pickled,
        tensors,
        str(torch.get_default_dtype()),
        tuple(sorted((k, repr(v)) for k, v in options.items())),
    )


def missing_note(names: list[str], architecture: str) -> Note:
    many = len(names) > 1
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return Note.of(
        MISSING,
        f"{len(names)} parameter{'s' if many else ''}",
        architecture,
        shown,
        "them" if many else "it",
        "them" if many else "it",
    )


def refuse_inexact_source(checkpoint: Checkpoint) -> None:
    """A directory rotated without keeping the mean is a model only ``enjoyln.load`` computes: its
    config builds LayerNorms that would not see a zero-mean stream, so neither its analysis nor a
    fold of it stands for that model. Refused before anything is traced or written (a malformed
    block is left to the code that reads it)."""
    try:
        plan = checkpoint.recorded_plan
    except CheckpointError:
        return
    if plan is not None and any(not r.keep_mean for r in plan.rotations):
        raise CheckpointError(
            f"{checkpoint.path} was rotated without keeping the mean, so only enjoyln.load "
            "computes its model (plain from_pretrained, which fold and rotate analyse, does "
            "not); fold or rotate the model it was rotated from, or rotate that with --keep-mean"
        )


def missing_refusal(checkpoint: Checkpoint) -> CheckpointError:
    """A fold that would write a checkpoint whose model draws some parameters at random on every
    load, refused (``--allow-missing`` folds it), naming the class the weights match where there
    is one."""
    names, arch = checkpoint.missing, checkpoint.architecture
    many = len(names) > 1
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    found = matching_class(checkpoint) if checkpoint.source == "transformers" else None
    choose = (
        f"its weights match {found}: pass --model-class {found} to fold that class"
        if found
        else "pass --model-class with a class its weights match"
    )
    return CheckpointError(
        f"{checkpoint.path} lacks {len(names)} parameter{'s' if many else ''} that {arch} builds "
        f"({shown}), which transformers would initialise at random on every load; {choose}, "
        f"or --allow-missing to fold {arch} with {'them' if many else 'it'} random; nothing "
        "was written"
    )


def read_tensors(checkpoint: Checkpoint, names: list[str]) -> list[torch.Tensor]:
    """Small tensors (gains) by parameter name."""
    out = []
    with contextlib.closing(TensorReader(checkpoint)) as reader:
        for name in names:
            key = checkpoint.key(name)
            if key is None:
                raise CheckpointError(
                    f"the checkpoint has no tensor for {name}, which the fold needs"
                )
            out.append(reader.read(key))
    return out


def moves_values(plan: FoldPlan) -> bool:
    """Whether a plan computes tensors from other tensors (a fused affine, a rotation)."""
    return bool(plan.fused) or plan.rotation is not None
