"""What a fold plan makes of a model directory: the plan for it (with the gains it depends on,
read from the checkpoint), the output tensors as entries the writer produces one at a time,
and the whole folded checkpoint in memory, which the tests hold the streamed fold to."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CheckpointError, EnjoylnError, first_line
from ..plan import Centering, FoldPlan
from ..transform.steps import apply_plan
from ..transform.tensors import merge_centerings, tie_groups, ties_lost_on_untie
from ..store.formats import CODES, DTYPES, SAFE_WEIGHTS, TensorInfo, parse_json_file, widened
from ..store.checkpoint import Checkpoint
from .planning import read_tensors
from .stream import StreamedTensors
from ..store.tensors import TensorReader


@dataclass
class Entry:
    """One output tensor and how to produce its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source: TensorInfo | None = None  # copy these bytes ...
    axis: int | None = None  # ... after centering along this axis
    groups: int = 1  # ... in this many blocks
    tensor: torch.Tensor | None = None  # or write this (pickle input)
    blocks: tuple[int, ...] | None = None  # ... only these of the blocks
    scale: torch.Tensor | None = None  # ... for this LayerScale gain
    compute: Callable[[], torch.Tensor] | None = None  # or write what this computes when its turn comes


def plan_entries(ck: Checkpoint, plan: FoldPlan) -> list[tuple[str, list[Entry]]]:
    """Output shards like the input's, each with its entries in input order."""
    saved, model = ck.saved, ck.meta
    pickled = ck.pickled_tensors if ck.pickled else None
    if pickled is not None:
        shards: list[tuple[str, list[Entry]]] = [(s, []) for s in ck.shards]
        home = {s: es for s, es in shards}
        for name, (shard, t) in pickled.items():
            if t.dtype not in CODES:
                raise CheckpointError(f"{name} has dtype {t.dtype}, which safetensors cannot store")
            home[shard].append(Entry(name, CODES[t.dtype], tuple(t.shape),
                                     t.numel() * t.element_size(), tensor=t))
    else:
        shards = [(s, [Entry(t.name, t.dtype, t.shape, t.nbytes, source=t)
                       for t in sorted(ck.tensors.values(), key=lambda t: t.start) if t.file == s])
                  for s in ck.shards]
    by_key = {e.name: e for _, es in shards for e in es}
    key = ck.key
    # Tied names are one tensor, stored once under any of them (BART's encoder and decoder
    # embeddings are model.shared.weight); an untied head is a tensor of its own.
    groups = tie_groups(model, {u.param for u in plan.untied})

    def stored(name: str) -> list[str]:
        """The keys holding ``name``'s tensor: its own, or another tied name's."""
        return list(dict.fromkeys(k for n in groups.get(name, (name,)) if (k := key(n)) is not None))

    extras: dict[str, tuple[str, int | None]] = {}  # new name -> (source key, centering axis)
    gains = [c.scale for c in plan.centered if c.scale]
    gains = dict(zip(gains, read_tensors(ck, gains))) if gains else {}
    planned: dict[tuple[str, ...], list[Centering]] = {}  # each tensor once, with all its centerings
    for c in plan.centered:
        if c.saved:  # a non-persistent buffer is not in the checkpoint: enjoyln.load centers it
            planned.setdefault(groups.get(c.param, (c.param,)), []).append(c)
    for names, cs in planned.items():
        merged = merge_centerings(cs)
        if len(merged) > 1:
            raise CheckpointError(f"the plan centers {names[0]} in {len(merged)} different ways, which a "
                                  "stored tensor cannot take; analyze this model again")
        c = merged[0]
        found = stored(c.param)
        for k in found:
            e = by_key[k]
            e.axis, e.groups, e.blocks, e.scale = c.axis, c.groups, c.blocks, gains.get(c.scale)
        head = next((k for u in plan.untied if u.tied_to in names and (k := key(u.param)) is not None), None)
        if not found and head is not None:
            # Only the tied head was saved: it supplies the embedding too, centered.
            extras[saved.get(c.param, c.param)] = (head, c.axis)
        elif not found:
            raise CheckpointError(f"the checkpoint has no tensor for {c.param}, which the fold centers")
    for u in plan.untied:
        if key(u.param) is None:
            src = next(iter(stored(u.tied_to)), None)
            if src is None:
                raise CheckpointError(f"the checkpoint has neither {u.param} nor {u.tied_to}")
            extras[saved.get(u.param, u.param)] = (src, None)  # the head keeps the original values
    copies: dict[str, Entry] = {}  # new name -> the entry whose output it repeats
    for target, source in ties_lost_on_untie(model, plan).items():
        src = next(iter(stored(source)), None)
        if key(target) is None and src is not None:
            copies[saved.get(target, target)] = by_key[src]
    for new, (src_key, axis) in extras.items():
        src = by_key[src_key]
        for _, entries in shards:
            if src in entries:
                entries.append(Entry(new, src.dtype, src.shape, src.nbytes, source=src.source,
                                     axis=axis, tensor=src.tensor))
                break
    for new, src in copies.items():  # centered (or not) exactly as the tensor it is tied to
        for _, entries in shards:
            if src in entries:
                entries.append(Entry(new, src.dtype, src.shape, src.nbytes, source=src.source, axis=src.axis,
                                     groups=src.groups, tensor=src.tensor, blocks=src.blocks, scale=src.scale))
                break
    loads = getattr(torch, ck.load_dtype[0], None)
    for _, entries in shards:
        for e in entries:
            if e.axis is not None and isinstance(loads, torch.dtype):
                e.dtype = CODES[widened(DTYPES[e.dtype], loads)]
                e.nbytes = math.prod(e.shape) * DTYPES[e.dtype].itemsize
    return shards


def final_tensors(ck: Checkpoint, plan: FoldPlan) -> dict[str, torch.Tensor]:
    """Every tensor of the folded checkpoint, by key: the model loaded from ``md`` with the plan
    applied in memory (in float64 where it computes), in each key's own dtype.

    A folded norm whose affine moved keeps γ = 1 and β = 0 (or β/γ) on disk, so
    a plain ``from_pretrained`` still gives the original's outputs.

    This holds the whole model; the fold and the static check use ``StreamedTensors``, which
    computes the same tensors one at a time, and the tests hold it to this, bit for bit.
    """
    model = _load_plain(ck)
    apply_plan(model, plan)
    meta, saved, keys = ck.meta, ck.saved, ck.keys
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        key = ck.key(name)
        if key is not None:
            out.setdefault(key, t.detach())
    for u in plan.untied:
        if ck.key(u.param) is None:
            out[saved.get(u.param, u.param)] = named[u.param].detach()
    for target in ties_lost_on_untie(meta, plan):
        if ck.key(target) is None and target in named:
            out.setdefault(saved.get(target, target), named[target].detach())
    for e in plan.foldable:
        for leaf, fill in (("weight", 1.0), ("bias", 0.0)):
            key = ck.key(f"{e.name}.{leaf}")
            if key is not None and key not in out:  # dropped with the affine: 1 and 0 on disk
                info = ck.tensors.get(key)
                shape = info.shape if info is not None else tuple(e.normalized_shape)
                dtype = DTYPES[info.dtype] if info is not None else torch.float32
                out[key] = torch.full(shape, fill, dtype=dtype)
    # stored but not loaded by the model (GPT-2's attn.bias masks): kept as they are, as the
    # tensor-by-tensor fold keeps them
    pickled = ck.pickled_tensors if ck.pickled and keys - out.keys() else None
    reader = TensorReader(ck)
    try:
        for key in sorted(keys - out.keys()):
            out[key] = pickled[key][1] if pickled is not None else reader.read(key)
    finally:
        reader.close()
    for key, t in out.items():
        info = ck.tensors.get(key)
        if info is not None and t.dtype != DTYPES[info.dtype]:
            out[key] = t.to(DTYPES[info.dtype])
    return out


def _load_plain(ck: Checkpoint) -> nn.Module:
    try:
        return ck.library.load(ck, trust_remote_code=ck.trust_remote_code, dtype="auto").eval()
    except EnjoylnError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot load {ck.path}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None


def moved_entries(ck: Checkpoint, tensors: StreamedTensors) -> list[tuple[str, list[Entry]]]:
    """Output shards like the input's, each tensor computed when the writer reaches it (or
    copied, where the fold leaves its bytes as they are)."""
    home: dict[str, str] = ({t.name: t.file for t in ck.tensors.values()} if not ck.pickled
                            else {k: shard for k, (shard, _) in ck.pickled_tensors.items()})
    shards: list[tuple[str, list[Entry]]] = [(s, []) for s in ck.shards]
    by_shard = dict(shards)
    order = sorted(tensors.keys(), key=lambda k: (ck.tensors[k].start if k in ck.tensors else math.inf, k))
    for key in order:
        out = tensors.outputs[key]
        if out.dtype not in CODES:
            raise CheckpointError(f"{key} has dtype {out.dtype}, which safetensors cannot store")
        source = tensors.source(key)
        by_shard[home.get(key, ck.shards[-1])].append(
            Entry(key, CODES[out.dtype], out.shape, out.nbytes, source=source,
                  compute=None if source is not None else functools.partial(tensors.get, key)))
    return shards


def reshard(shards: list[tuple[str, list[Entry]]], max_bytes: int | None, *, indexed: bool = False,
            single_name: str = SAFE_WEIGHTS) -> list[tuple[str, list[Entry]]]:
    """Keep the input's shards (renamed to .safetensors), or pack up to ``max_bytes`` each. A
    lone shard named by an index (``indexed``) keeps its name and, in the caller, its index: the
    index can carry the dtype the model loads in."""
    if max_bytes is None:
        if len(shards) == 1 and not indexed:
            return [(single_name, shards[0][1])]
        n = len(shards)
        return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors" if name.endswith(".bin") else name, es)
                for i, (name, es) in enumerate(shards)]
    packed: list[list[Entry]] = [[]]
    size = 0
    for _, entries in shards:
        for e in entries:
            if packed[-1] and size + e.nbytes > max_bytes:
                packed.append([])
                size = 0
            packed[-1].append(e)
            size += e.nbytes
    if len(packed) == 1:
        return [(single_name, packed[0])]
    n = len(packed)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", es) for i, es in enumerate(packed)]


def index_metadata(ck: Checkpoint, total_size: int) -> dict[str, Any]:
    """The metadata of the index a fold of ``md`` writes: the input index's, as it was, with the
    new total size; for an input without one, the dtype it loads in, which transformers reads
    from there when config.json names none."""
    if ck.index is not None:
        metadata = parse_json_file(ck.index, "a weight index").get("metadata")
        if isinstance(metadata, dict):
            return {**metadata, "total_size": total_size}
    return {"total_size": total_size, "dtype": ck.load_dtype[0]}
