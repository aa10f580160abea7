"""What a fold writes for a model directory: its entries, in output shards like the input's, each
saying how its bytes are made (copied, centered where they lie, or computed when the writer
reaches them)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .._version import __version__
from ..errors import CheckpointError
from ..folded.planning import moves_values, read_tensors
from ..folded.pieces import Piece
from ..folded.stream import StreamedTensors
from ..plan import FoldPlan
from ..store.checkpoint import Checkpoint
from ..store.formats import CODES, DTYPES, TensorInfo, parse_json_file
from ..store.locate import SAFE_WEIGHTS
from ..store.tensors import Buffer
from ..transform.tensors import merge_centerings


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
    compute: Callable[[Buffer | None], torch.Tensor] | None = (
        None  # or write what this computes when its turn comes (in the buffer's memory, if it can)
    )
    pieces: Callable[[Sequence[Buffer]], Iterator[tuple[Piece, torch.Tensor]]] | None = (
        None  # or, for a large one, write it a piece at a time
    )
    into_file: Callable[[torch.Tensor], torch.Tensor] | None = (
        None  # or compute it straight into the output file's pages
    )


def fold_entries(
    checkpoint: Checkpoint, plan: FoldPlan, tensors: StreamedTensors
) -> list[tuple[str, list[Entry]]]:
    """Output shards like the input's: each stored tensor in input order, then what the fold adds. A
    plan that only centers copies each tensor's bytes and centers it where it lies (the early
    copy relies on it)."""
    home = (
        {k: shard for k, (shard, _) in checkpoint.pickled_tensors.items()}
        if checkpoint.pickled
        else {t.name: t.file for t in checkpoint.tensors.values()}
    )
    shards: list[tuple[str, list[Entry]]] = [(s, []) for s in checkpoint.shards]
    by_shard = dict(shards)
    stored = [
        k
        for k in (
            home if checkpoint.pickled else sorted(home, key=lambda k: checkpoint.tensors[k].start)
        )
        if k in tensors
    ]
    moves = moves_values(plan)
    make = _computed if moves else functools.partial(_centered, checkpoint)
    for key in stored:
        by_shard[home[key]].append(make(tensors, key))
    added = [k for k in tensors.keys() if k not in home]
    for key in sorted(added) if moves else added:
        # a computed tensor is written last; a copied one beside the bytes it copies
        shard = (
            checkpoint.shards[-1]
            if moves
            else home.get(tensors.centerings(key)[0] or "", checkpoint.shards[-1])
        )
        by_shard[shard].append(make(tensors, key))
    return shards


def _computed(tensors: StreamedTensors, key: str) -> Entry:
    out = tensors.outputs[key]
    if out.dtype not in CODES:
        raise CheckpointError(f"{key} has dtype {out.dtype}, which safetensors cannot store")
    source = tensors.ck.tensors.get(
        out.raw
    )  # None for a computed one (out.raw None) and for pickle input
    return Entry(
        key,
        CODES[out.dtype],
        out.shape,
        out.nbytes,
        source=source,
        compute=None if source is not None else functools.partial(tensors.get, key),
        pieces=functools.partial(tensors.pieces, key)
        if source is None and tensors.in_pieces(key)
        else None,
        into_file=functools.partial(tensors.compute_into, key)
        if source is None and tensors.one_pass(key)
        else None,
    )


def _centered(checkpoint: Checkpoint, tensors: StreamedTensors, key: str) -> Entry:
    base, cs = tensors.centerings(key)
    merged = merge_centerings(cs)
    if len(merged) > 1:
        raise CheckpointError(
            f"the plan centers {key} in {len(merged)} different ways, which a stored tensor "
            "cannot take; analyze this model again"
        )
    info, tensor = (
        checkpoint.tensors.get(base),
        checkpoint.pickled_tensors[base][1] if checkpoint.pickled else None,
    )
    dtype = tensors.outputs[key].dtype if merged else (DTYPES[info.dtype] if info else tensor.dtype)
    if dtype not in CODES:
        raise CheckpointError(f"{key} has dtype {dtype}, which safetensors cannot store")
    shape = tuple(info.shape) if info else tuple(tensor.shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if not merged:
        return Entry(key, CODES[dtype], shape, nbytes, source=info, tensor=tensor)
    c = merged[0]
    scale = read_tensors(checkpoint, [c.scale])[0] if c.scale else None
    return Entry(
        key,
        CODES[dtype],
        shape,
        nbytes,
        source=info,
        axis=c.axis,
        groups=c.groups,
        tensor=tensor,
        blocks=c.blocks,
        scale=scale,
    )


CASTABLE = ("F64", "F32", "F16", "BF16")  # what --dtype rounds; integers and float8 stay as stored


def cast_entries(
    checkpoint: Checkpoint, shards: list[tuple[str, list[Entry]]], dtype: str
) -> list[tuple[str, list[Entry]]]:
    """Every floating entry stored in ``dtype``: a centered one is cast, then centered in float64
    and rounded once (as ``enjoyln.fold`` of the model loaded in ``dtype``); a computed one
    rounded from its result; a copied one read and rounded. The check's rule for a cast copy
    accepts exactly these."""
    target = getattr(torch, dtype)

    def cast(e: Entry) -> Entry:
        if e.dtype not in CASTABLE or e.dtype == CODES[target]:
            return e
        nbytes = math.prod(e.shape) * target.itemsize
        scale = (
            e.scale.to(target) if e.scale is not None else None
        )  # the gain as the cast model holds it
        compute = e.compute
        if compute is not None:
            compute = functools.partial(_rounded, compute, target)
        elif e.axis is None and e.tensor is None:
            compute = functools.partial(
                _rounded, functools.partial(_read, checkpoint, e.source.name), target
            )
        return dataclasses.replace(
            e,
            dtype=CODES[target],
            nbytes=nbytes,
            scale=scale,
            compute=compute,
            pieces=None,
            into_file=None,
        )

    return [(name, [cast(e) for e in entries]) for name, entries in shards]


def _read(checkpoint: Checkpoint, name: str, into: Buffer | None = None) -> torch.Tensor:
    return read_tensors(checkpoint, [name])[0]


def _rounded(
    compute: Callable[[Buffer | None], torch.Tensor], dtype: torch.dtype, into: Buffer | None
) -> torch.Tensor:
    return compute(into).to(dtype)


def reshard(
    shards: list[tuple[str, list[Entry]]], max_bytes: int | None, *, indexed: bool = False
) -> list[tuple[str, list[Entry]]]:
    """Keep the input's shards (renamed to .safetensors), or pack up to ``max_bytes`` each. A lone
    shard named by an index (``indexed``) keeps it: the index can carry the dtype the model loads
    in."""
    if max_bytes is not None:
        packed: list[list[Entry]] = [[]]
        size = 0
        for _, entries in shards:
            for e in entries:
                if packed[-1] and size + e.nbytes > max_bytes:
                    packed.append([])
                    size = 0
                packed[-1].append(e)
                size += e.nbytes
        shards = [("", es) for es in packed]  # unnamed: numbered below
    if len(shards) == 1 and (max_bytes is not None or not indexed):
        return [(SAFE_WEIGHTS, shards[0][1])]
    n = len(shards)
    return [
        (
            f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            if not name or name.endswith(".bin")
            else name,
            es,
        )
        for i, (name, es) in enumerate(shards)
    ]


def index_metadata(checkpoint: Checkpoint, shards: list[tuple[str, list[Entry]]]) -> dict[str, Any]:
    """The input index's metadata with the output's sizes and the load dtype (transformers may read
    it here)."""
    metadata: dict[str, Any] = {}
    if checkpoint.index is not None:
        found = parse_json_file(checkpoint.index, "a weight index").get("metadata")
        metadata = dict(found) if isinstance(found, dict) else {}
    metadata["total_size"] = sum(e.nbytes for _, es in shards for e in es)
    if "total_parameters" in metadata:
        metadata["total_parameters"] = sum(math.prod(e.shape) for _, es in shards for e in es)
    metadata["enjoyln"] = __version__
    metadata.setdefault("dtype", checkpoint.load_dtype[0])
    return metadata
