"""A model directory's files as their loaders read them: safetensors headers (validated as strictly
as the format requires) and JSON files (strict UTF-8, bounded in size and depth)."""

from __future__ import annotations

import json
import os
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .locate import JSON_LIMIT


def input_file(path: Path) -> Path:
    """``path`` if it is a regular file (through symlinks); else a clear error naming it."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:
            raise CheckpointError(f"{path} is a symlink loop") from None
        except OSError:
            raise CheckpointError(
                f"{path} is a dangling symlink (it points to {os.readlink(path)})"
            ) from None
    if not path.exists():
        raise CheckpointError(f"{path.parent} has no {path.name}")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file")
    return path


DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}
CODES = {v: k for k, v in DTYPES.items() if v is not None}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes sit in a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def widened(stored: torch.dtype, loads: torch.dtype) -> torch.dtype:
    """The dtype a fold stores a changed tensor in: its own, or the wider dtype the model loads it
    in (a centered float16 table rounded after centering keeps a mean of an ulp in float32)."""
    wider = (
        stored.is_floating_point and loads.is_floating_point and loads.itemsize > stored.itemsize
    )
    return loads if wider else stored


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the header names {key} twice")
        seen[key] = value
    return seen


def read_safetensors_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header: byte counts match dtypes and shapes, and the tensors
    tile the data exactly (an overlap would come out of a fold as two independent copies of the
    same bytes)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ValueError("shorter than a header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise ValueError("header length beyond the end of the file")
            if header_len > 100 << 20:
                raise ValueError("header larger than 100 MiB")
            # safetensors parses the header as UTF-8 (serde_json): Python's json.loads of bytes
            # would also take a byte-order mark or UTF-16, and vouch for a file nothing loads
            header = json.loads(
                f.read(header_len).decode("utf-8"), object_pairs_hook=_no_duplicates
            )
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        base = 8 + header_len
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("__metadata__ must map strings to strings")
        tensors = {}
        for name, info in header.items():
            offsets, shape = info["data_offsets"], info["shape"]
            # safetensors itself refuses 0.0, "12" or true where it expects an unsigned integer;
            # int() would take them, and vouch for a file nothing can load
            if not (
                isinstance(offsets, list)
                and len(offsets) == 2
                and isinstance(shape, list)
                and all(type(v) is int for v in offsets + shape)
            ):
                raise ValueError(f"{name}'s data_offsets and shape must be lists of integers")
            start, end = offsets
            shape = tuple(shape)
            if DTYPES.get(info["dtype"]) is None:
                raise ValueError(f"{name} has the unknown dtype {info['dtype']!r}")
            if start < 0 or end < start:
                raise ValueError(f"{name}'s data offsets [{start}, {end}] are out of order")
            if any(s < 0 for s in shape):
                raise ValueError(f"{name} has a negative size in its shape {list(shape)}")
            if end - start != math.prod(shape) * DTYPES[info["dtype"]].itemsize:
                raise ValueError(
                    f"{name} holds {end - start} bytes, not what its dtype and shape need"
                )
            tensors[name] = TensorInfo(
                name, info["dtype"], shape, file.name, base + start, base + end
            )
        pos, last = base, None
        for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
            if t.start < pos:
                raise ValueError(
                    f"{t.name} overlaps {last} (bytes {t.start - base}-{pos - base} of the data)"
                )
            if t.start > pos:
                where = f"after {last}" if last else "before the first tensor"
                raise ValueError(
                    f"{t.start - pos} bytes {where} belong to no tensor (a gap before {t.name})"
                )
            pos, last = t.end, t.name
        if pos > size:
            raise ValueError("truncated: tensor data runs past the end of the file")
        if pos < size:
            raise ValueError(f"{size - pos} bytes after the last tensor belong to no tensor")
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not a valid safetensors file ({exc})") from None
    except RecursionError:
        raise CheckpointError(
            f"{file} is not a valid safetensors file (its header is nested too deeply)"
        ) from None
    return tensors, metadata


JSON_DEPTH = 64
"""Real configs stay under 10; deeper ones would exhaust Python's recursion in transformers' config
code."""


def _depth_exceeds(data: Any, limit: int) -> bool:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack += [
                (v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)
            ]
    return False


def loader_text(raw: bytes) -> str:
    """A JSON file's bytes as transformers reads them: strict UTF-8, a byte-order mark kept (and
    refused)."""
    return raw.decode("utf-8")


def parse_json_file(path: Path, what: str) -> Any:
    """A JSON file's value, read only if it is at most ``JSON_LIMIT`` bytes."""
    try:
        size = input_file(path).stat().st_size
        if size > JSON_LIMIT:
            raise CheckpointError(
                f"{path} holds {size:,} bytes, more than the {JSON_LIMIT >> 20} MiB enjoyln "
                f"reads for {what}"
            )
        with open(path, "rb") as f:
            raw = f.read(JSON_LIMIT + 1)  # the file may have grown since
        if len(raw) > JSON_LIMIT:
            raise CheckpointError(
                f"{path} grew past {JSON_LIMIT >> 20} MiB while it was being read"
            )
        data = json.loads(loader_text(raw))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc.__class__.__name__}: {exc})"
        ) from None
    if _depth_exceeds(data, JSON_DEPTH):
        raise CheckpointError(
            f"{path} is nested more than {JSON_DEPTH} levels deep, too deep to be {what}"
        )
    return data


def json_or_none(path: Path, what: str) -> Any:
    """A JSON file's value, or None where it is not JSON; a file too large to read is still
    refused."""
    try:
        return parse_json_file(path, what)
    except CheckpointError:
        if path.stat().st_size > JSON_LIMIT:
            raise
        return None


def read_json(path: Path, what: str) -> dict[str, Any]:
    data = parse_json_file(path, what)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object ({what})")
    return data
