"""The static check's pairing: for every tensor a candidate stores, the reference tensor it must be
made from, and what the plan does to it on the way (centerings, an untie)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..plan import Centering, FoldPlan
from ..store.checkpoint import Checkpoint
from ..store.hf import random_when_missing
from ..transform.tensors import merge_centerings, tie_groups


@dataclass(frozen=True)
class Pair:
    """One tensor of the candidate (``cand``, its checkpoint key) and the reference's key it is made
    from."""

    cand: str
    ref: str
    centerings: tuple[Centering, ...] = ()
    """What the plan centers it by (merged: one per axis), none for a tensor the plan keeps."""
    untied: bool = False
    """An untied head: a copy of the tensor it was tied to."""


def tensor_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter or persistent buffer name -> all names of the same tensor."""
    by_id: dict[int, list[str]] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for name, t in list(model.named_parameters(remove_duplicate=False)) + [
        (n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent
    ]:
        by_id.setdefault(id(t), []).append(name)
    return {n: tuple(names) for names in by_id.values() for n in names}


def tied_key(checkpoint: Checkpoint, names: dict[str, tuple[str, ...]], name: str) -> str | None:
    """The key of ``checkpoint`` holding ``name``'s tensor: its own, or one of its tied names'
    (``names``)."""
    return next(
        (
            key
            for alias in (name, *names.get(name, ()))
            if (key := checkpoint.key(alias)) is not None
        ),
        None,
    )


def pair_tensors(
    plan: FoldPlan, ref: Checkpoint, cand: Checkpoint
) -> tuple[list[Pair], list[str], list[str]]:
    """(pairs, problems, missing): each tensor the candidate's model loads, then each other it
    stores, paired with the reference's; what cannot be paired; the parameters its model builds
    that neither checkpoint holds (random on every load). The reference's tied names are one
    tensor, centered once, even where the candidate stores them apart."""
    centerings: dict[str, list[Centering]] = {}
    for c in plan.centered:
        if c.saved:  # a non-persistent buffer is not in any checkpoint; load centers it
            centerings.setdefault(c.param, []).append(c)
    untied = {u.param for u in plan.untied}
    groups = tie_groups(ref.meta, untied)
    random, ref_names = random_when_missing(cand.meta), tensor_names(ref.meta)
    pairs, problems, missing = [], [], []
    for name, aliases in tensor_names(cand.meta).items():
        if name != aliases[0]:
            continue  # a tied alias: the same tensor, checked once
        key = next((k for a in aliases if (k := cand.key(a))), None)
        rk = tied_key(ref, ref_names, name)
        if key is None:
            if rk is not None:
                problems.append(
                    f"the candidate has no tensor for {name}; loading it would initialise it at "
                    "random"
                )
            elif name in random:
                missing.append(name)
            continue
        if rk is None:
            problems.append(f"the candidate's {key} has no counterpart in the reference")
            continue
        names = dict.fromkeys((*aliases, *(a for n in aliases for a in groups.get(n, (n,)))))
        cs = tuple(merge_centerings([x for a in names if a in centerings for x in centerings[a]]))
        pairs.append(Pair(key, rk, cs, any(a in untied for a in aliases)))
    for key in sorted(
        cand.keys - {p.cand for p in pairs}
    ):  # stored but not loaded: must still be the reference's
        if key in ref.keys:
            pairs.append(Pair(key, key))
        else:
            problems.append(
                f"the candidate holds {key}, which neither its model nor the reference has"
            )
    problems += [
        f"the candidate lacks the reference's tensor {key}"
        for key in sorted(ref.keys - cand.keys - {p.ref for p in pairs})
    ]
    return pairs, problems, missing


def as_reference_holds(ref: Checkpoint, names: list[str]) -> list[str]:
    """``names`` counted as the reference's model holds them, tied names once: an untie in the
    candidate (a head's bias that followed its decoder) makes two tensors of one, but not one
    more missing parameter."""
    groups = tensor_names(ref.meta)
    return list(dict.fromkeys(groups.get(n, (n,))[0] for n in names))


def still_tied(plan: FoldPlan, cand_model: nn.Module) -> list[str]:
    """A head the plan unties that the candidate's model still ties (to anything: then it follows a
    centering)."""
    names = tensor_names(cand_model)
    return [
        f"the candidate still ties {u.param} to {others[0]}, so centering one changes the other"
        for u in plan.untied
        if (others := [a for a in names.get(u.param, ()) if a != u.param])
    ]
