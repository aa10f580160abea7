"""A mutation (one change to a copy of a fold, with the verdict a sound gate owes it) and
applying it to a directory, safetensors rewrites included."""

from __future__ import annotations

import base64
import json
import math
import os
import random
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .json_edits import respace_json
from .sources import SAFETENSORS_DTYPES, read_header


@dataclass(frozen=True)
class Mutation:
    """One change to a copy of a source's fold, and the verdict a sound gate gives it."""

    source: str
    category: str
    kind: str
    target: str
    ops: tuple[tuple[Any, ...], ...]
    """What to do to the directory: see :func:`apply`."""
    expect: str
    """'fail' (the gate must exit non-zero) or 'pass' (exit 0)."""
    ground: str
    """Why: weights-loaded, config-read, plan-read (the plan enjoyln.load reads), file-read,
    layout, policy; or, for a pass, inert or equivalent (another form of the same fold)."""
    reason: str
    index: int = -1
    seed: int = 0
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for the gate's run alone (``{outside}`` in a value: the
    directory beside the mutant that :func:`apply` writes planted files into)."""
    args: tuple[str, ...] = ()
    """Options added to ``enjoyln check REFERENCE CANDIDATE`` (``--dtype bfloat16``)."""

    def describe(self) -> str:
        extra = f" [check {' '.join(self.args)}]" if self.args else ""
        return f"#{self.index} {self.source}: {self.category}/{self.kind} {self.target}{extra}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("ops")
        for key in (
            "env",
            "args",
        ):  # absent where unused: the other categories' records stay as they were
            if not d[key]:
                d.pop(key)
        return d


def b64(data: bytes) -> str:
    """``data`` as base64 text, as a mutation's ops carry bytes."""
    return base64.b64encode(data).decode()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def apply(mutation: Mutation, directory: str | os.PathLike, outside: str | os.PathLike) -> None:
    """Apply ``mutation`` to ``directory`` (a copy of the source's fold). ``outside`` is a
    directory beside it, for files that links out of ``directory`` point to."""
    root, outside = Path(directory), Path(outside)
    outside.mkdir(parents=True, exist_ok=True)
    for op, *args in mutation.ops:
        if op == "bytes":  # (file, offset, base64): overwrite in place
            with open(root / args[0], "r+b") as f:
                f.seek(args[1])
                f.write(base64.b64decode(args[2]))
        elif op == "write":  # (file, base64): create or replace
            target = root / args[0]
            if target.is_symlink():
                target.unlink()
            _write(target, base64.b64decode(args[1]))
        elif op == "truncate":
            os.truncate(root / args[0], args[1])
        elif op == "append":
            with open(root / args[0], "ab") as f:
                f.write(base64.b64decode(args[1]))
        elif op == "delete":
            target = root / args[0]
            shutil.rmtree(
                target
            ) if target.is_dir() and not target.is_symlink() else target.unlink()
        elif op == "fifo":
            os.mkfifo(root / args[0])
        elif op == "link-out":  # (name, base64): a link to a new file outside the directory
            (outside / args[0].replace("/", "_")).write_bytes(base64.b64decode(args[1]))
            (root / args[0]).symlink_to(outside / args[0].replace("/", "_"))
        elif (
            op == "move-out"
        ):  # (file): the file moved out of the directory, a link left in its place
            target = outside / args[0].replace("/", "_")
            shutil.move(root / args[0], target)
            (root / args[0]).symlink_to(target)
        elif op == "utime":
            os.utime(root / args[0], (args[1], args[1]))
        elif op == "header":  # (file, header JSON): a new safetensors header, the same data
            _rewrite_header(root / args[0], json.loads(args[1]))
        elif op == "reorder":  # (file, seed)
            _reorder(root / args[0], random.Random(args[1]))
        elif op == "reshard":  # (seed,)
            _reshard(root, random.Random(args[0]))
        elif op == "reformat":  # (file, seed)
            path = root / args[0]
            path.write_bytes(
                respace_json(path.read_bytes().decode("utf-8"), random.Random(args[1])).encode(
                    "utf-8"
                )
            )
        elif op == "plant":  # (path under outside, base64): a file beside the directory, not in it
            _write(outside / args[0], base64.b64decode(args[1]))
        elif op == "retype":  # (file, spec JSON): tensors cast, rounded, nudged or dropped
            _retype(root / args[0], json.loads(args[1]))
        elif op in (
            "json-set",
            "json-delete",
        ):  # (file, key path[, value]): one value of a JSON file
            _edit_json_file(root / args[0], args[1], args[2] if op == "json-set" else _DELETE)
        else:
            raise ValueError(f"unknown mutation op {op!r}")


def header_bytes(header: dict[str, Any]) -> bytes:
    """A safetensors header as written before the data: its length, then the JSON."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data stays 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _rewrite_header(file: Path, header: dict[str, Any]) -> None:
    base, _ = read_header(file)
    data = file.read_bytes()[base:]
    file.write_bytes(header_bytes(header) + data)


def _reorder(file: Path, rng: random.Random) -> None:
    """The same tensors and metadata, laid out in another order, the header's keys shuffled."""
    base, header = read_header(file)
    data = file.read_bytes()
    names = [k for k in header if k != "__metadata__"]
    order = names[:]
    while len(order) > 1 and order == names:
        rng.shuffle(order)
    out, chunks, at = {}, [], 0
    for name in order:
        begin, end = header[name]["data_offsets"]
        chunks.append(data[base + begin : base + end])
        out[name] = {**header[name], "data_offsets": [at, at + end - begin]}
        at += end - begin
    keys = list(out) + (["__metadata__"] if "__metadata__" in header else [])
    rng.shuffle(keys)
    shuffled = {k: header["__metadata__"] if k == "__metadata__" else out[k] for k in keys}
    file.write_bytes(header_bytes(shuffled) + b"".join(chunks))


def _reshard(root: Path, rng: random.Random) -> None:
    """model.safetensors split into two shards and an index, as ``save_pretrained`` writes them."""
    file = root / "model.safetensors"
    base, header = read_header(file)
    data = file.read_bytes()
    meta = header.pop("__metadata__", None)
    names = sorted(header)
    cut = rng.randrange(1, len(names))
    weight_map, total = {}, 0
    for i, part in enumerate((names[:cut], names[cut:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        out, chunks, at = ({"__metadata__": meta} if meta is not None else {}), [], 0
        for name in part:
            begin, end = header[name]["data_offsets"]
            chunks.append(data[base + begin : base + end])
            out[name] = {**header[name], "data_offsets": [at, at + end - begin]}
            at += end - begin
            weight_map[name] = shard
        total += at
        (root / shard).write_bytes(header_bytes(out) + b"".join(chunks))
    file.unlink()
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )


_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_NAMES = {v: k for k, v in _FLOATS.items()}


def rounded(x: torch.Tensor, dtype: torch.dtype, mode: str) -> torch.Tensor:
    """``x`` in ``dtype``, rounded to nearest (``"nearest"``, what ``Tensor.to`` does) or in one
    direction (``"up"``, ``"down"``, ``"zero"``): where nearest went the other way, one ulp of
    ``dtype`` further along. Exact where ``dtype`` holds ``x``.

    >>> rounded(torch.tensor([1.00390625]), torch.bfloat16, "up")  # doctest: +SKIP
    tensor([1.0078], dtype=torch.bfloat16)
    """
    y = x.to(dtype)
    if mode == "nearest":
        return y
    wide = y.to(torch.float64)
    exact = x.to(torch.float64)
    if mode == "up":
        wrong, toward = wide < exact, math.inf
    elif mode == "down":
        wrong, toward = wide > exact, -math.inf
    else:
        wrong, toward = wide.abs() > exact.abs(), 0.0
    return torch.where(wrong, torch.nextafter(y, torch.full_like(y, toward)), y)


def _retype(file: Path, spec: dict[str, Any]) -> None:
    """``file``'s tensors rewritten: ``spec["cast"]`` maps a name (or ``"*"``: every other floating
    tensor) to [safetensors dtype, rounding mode]; ``spec["ulp"]`` is [name, flat index, +1 or -1]:
    that element moved one ulp of its (new) dtype; ``spec["drop"]`` names tensors removed, header
    and bytes. The metadata and the header's key order are kept; the data is laid out widest
    dtype first, so every tensor stays aligned to its element size."""
    base, header = read_header(file)
    data = file.read_bytes()
    casts, drop, ulp = spec.get("cast", {}), set(spec.get("drop", ())), spec.get("ulp")
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for name, info in header.items():
        if name == "__metadata__" or name in drop:
            continue
        begin, end = info["data_offsets"]
        raw = data[base + begin : base + end]
        dtype = _FLOATS.get(info["dtype"])
        cast = casts.get(name, casts.get("*"))
        if dtype is None or (cast is None and not (ulp and ulp[0] == name)):
            tensors[name] = (info["dtype"], info["shape"], raw)
            continue
        t = torch.frombuffer(bytearray(raw) or bytearray(dtype.itemsize), dtype=dtype)[
            : len(raw) // dtype.itemsize
        ]
        if cast is not None:
            t = rounded(t, _FLOATS[cast[0]], cast[1])
        if ulp and ulp[0] == name:
            t = t.clone()
            t[ulp[1]] = torch.nextafter(t[ulp[1]], torch.tensor(math.inf * ulp[2], dtype=t.dtype))
        tensors[name] = (
            _NAMES[t.dtype],
            info["shape"],
            t.contiguous().view(torch.uint8).numpy().tobytes(),
        )
    width = {n: SAFETENSORS_DTYPES[d].itemsize for n, (d, _, _) in tensors.items()}
    out, chunks, at = {}, [], 0
    for name in sorted(
        tensors, key=lambda n: -width[n]
    ):  # stable: the file's own order within a width
        d, shape, raw = tensors[name]
        out[name] = {"dtype": d, "shape": shape, "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    keys = [k for k in header if k == "__metadata__" or k in out]
    file.write_bytes(
        header_bytes({k: header[k] if k == "__metadata__" else out[k] for k in keys})
        + b"".join(chunks)
    )


_DELETE = object()


def _edit_json_file(file: Path, path: list[Any], value: Any) -> None:
    """One value of a JSON file set (or, with ``_DELETE``, removed), written as ``_reshard``
    writes the index."""
    obj = json.loads(file.read_text())
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    file.write_text(json.dumps(obj, indent=2) + "\n")
