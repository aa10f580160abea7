"""Checkpoint I/O: fold a Hugging Face model directory into a new one, streaming.

The analysis runs on the meta device (no weights in memory). The fold then
streams tensor by tensor: tensors that do not change are copied byte for
byte, centered ones are loaded one at a time, centered in float64 and written
back in their own dtype. Peak memory is a few of the largest tensors (pickle
weights, read only with ``--allow-pickle``, are loaded whole).

The output is written into a temporary directory beside OUT_DIR and renamed
into place at the end, so an interrupted run never leaves a partial OUT_DIR,
and the input directory is only ever read.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
import shutil
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ._version import __version__
from .analysis import analyze, norm_module_paths
from .errors import CheckpointError, EnjoylnError
from .plan import FORMAT_VERSION, FoldPlan
from .rewrite import InsertCentering, SwapLayerNorms, center_, center_all, check_fits

if TYPE_CHECKING:
    from .check import CheckReport

SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
PT_WEIGHTS, PT_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_WEIGHT_FILES = {SAFE_WEIGHTS, SAFE_INDEX, PT_WEIGHTS, PT_INDEX}

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
}
_CODES = {v: k for k, v in _DTYPES.items() if v is not None}

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes total) as the output is written."""


# --- reading ----------------------------------------------------------------------------


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


@dataclass
class ModelDir:
    """A validated Hugging Face model directory."""

    path: Path
    config: dict[str, Any]
    architecture: str
    shards: list[str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    pickled: bool = False


def read_safetensors_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header: every tensor within the file."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ValueError("shorter than a header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise ValueError("header length beyond the end of the file")
            if header_len > 100 << 20:
                raise ValueError("header larger than 100 MiB")
            header = json.loads(f.read(header_len))
        base = 8 + header_len
        metadata = header.pop("__metadata__", None) or {}
        tensors, end_max = {}, 0
        for name, info in header.items():
            start, end = info["data_offsets"]
            shape = tuple(int(s) for s in info["shape"])
            if info["dtype"] not in _DTYPES or not 0 <= start <= end:
                raise ValueError(f"bad entry for {name}")
            dtype = _DTYPES[info["dtype"]]
            if dtype is None or end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{name} holds {end - start} bytes, not what its dtype and shape need")
            tensors[name] = TensorInfo(name, info["dtype"], shape, file.name, base + start, base + end)
            end_max = max(end_max, end)
        if base + end_max > size:
            raise ValueError("truncated: tensor data runs past the end of the file")
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not a valid safetensors file ({exc})") from None
    return tensors, metadata


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} has no {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object ({what})")
    return data


def _index_shards(index_file: Path) -> list[str]:
    """The shard files a weight index names: plain file names inside the directory."""
    weight_map = _read_json(index_file, "a weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file} has no weight_map")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or shard.startswith("."):
            raise CheckpointError(f"{index_file} names the shard {shard!r}, which is not a file in its directory")
    return shards


def open_model_dir(path: str | os.PathLike, *, allow_pickle: bool = False) -> ModelDir:
    """Validate a model directory: config, architecture and every weight header.

    Nothing is loaded; a corrupt or truncated shard is reported here, before
    any output is written.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    if not any(root.iterdir()):
        raise CheckpointError(f"{root} is empty")
    config = _read_json(root / "config.json", "a model config")
    archs = config.get("architectures") or []
    if not archs or not isinstance(archs, list):
        raise CheckpointError(f"{root / 'config.json'} names no architecture (\"architectures\" is missing)")
    import transformers

    arch = archs[0]
    # dir() lists transformers' lazy names without importing the model's module,
    # which alone can take seconds; meta_model imports it and checks it is a class.
    if not isinstance(arch, str) or arch not in dir(transformers):
        raise _unknown_architecture(arch)
    md = ModelDir(root, config, arch, [])
    if (root / SAFE_INDEX).exists():
        md.shards = _index_shards(root / SAFE_INDEX)
    elif (root / SAFE_WEIGHTS).exists():
        md.shards = [SAFE_WEIGHTS]
    elif (root / PT_INDEX).exists() or (root / PT_WEIGHTS).exists():
        if not allow_pickle:
            raise CheckpointError(f"{root} has only pickle (.bin) weights, which can run code when "
                                  "loaded; pass --allow-pickle to load them with weights_only=True")
        md.pickled = True
        md.shards = _index_shards(root / PT_INDEX) if (root / PT_INDEX).exists() else [PT_WEIGHTS]
    else:
        raise CheckpointError(f"{root} has no weights (model.safetensors or {SAFE_INDEX})")
    for shard in md.shards:
        file = root / shard
        if not file.is_file():
            raise CheckpointError(f"{root} lacks the weight shard {shard} named by its index")
        if not md.pickled:
            tensors, _ = read_safetensors_header(file)
            md.tensors.update(tensors)
    return md


def _unknown_architecture(arch: Any) -> CheckpointError:
    import transformers

    return CheckpointError(f"unknown architecture {arch!r}: transformers {transformers.__version__} "
                           "has no such model class (remote code is not run)")


def meta_model(md: ModelDir) -> nn.Module:
    """The model class of ``md`` built on the meta device: graph and names, no weights."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(md.path, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise CheckpointError(f"cannot read {md.path / 'config.json'}: {str(exc).splitlines()[0]}") from None
    cls = getattr(transformers, md.architecture, None)
    if not isinstance(cls, type):
        raise _unknown_architecture(md.architecture)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:
        raise CheckpointError(f"cannot build {md.architecture} from its config: "
                              f"{str(exc).splitlines()[0]}") from None
    return model.eval()


def analyze_checkpoint(path: str | os.PathLike, *, allow_pickle: bool = False,
                       auxiliary_centering: bool = False) -> FoldPlan:
    """The fold plan for a model directory, computed on the meta device.

    >>> analyze_checkpoint("path/to/gpt2").summary()  # doctest: +SKIP
    """
    md = open_model_dir(path, allow_pickle=allow_pickle)
    model = meta_model(md)
    _check_shapes(md, model)
    return _analyze(md, model, auxiliary_centering)


def _analyze(md: ModelDir, model: nn.Module, auxiliary_centering: bool) -> FoldPlan:
    """The plan for the meta model; LayerScale gains the fold needs are read from the
    checkpoint, and where one has a zero entry the analysis runs again knowing it."""
    plan = analyze(model, auxiliary_centering=auxiliary_centering)
    names = sorted({c.scale for c in plan.centered if c.scale})
    if not names:
        return plan
    gains = dict(zip(names, _read_tensors(md, model, names)))
    if all(bool(g.ne(0).all()) for g in gains.values()):
        return plan
    return analyze(model, auxiliary_centering=auxiliary_centering, weights=gains)


def _read_tensors(md: ModelDir, model: nn.Module, names: list[str],
                  pickled: dict[str, tuple[str, torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """Small tensors (LayerScale gains) by parameter name, read from the checkpoint."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    saved = saved_names(model)
    if md.pickled and pickled is None:
        pickled = _load_pickled(md)
    keys = set(pickled) if pickled is not None else set(md.tensors)
    out = []
    for name in names:
        key = _checkpoint_key(name, keys, prefix, saved)
        if key is None:
            raise CheckpointError(f"the checkpoint has no tensor for {name}, which the fold needs")
        if pickled is not None:
            out.append(pickled[key][1])
            continue
        info = md.tensors[key]
        data = torch.empty(info.nbytes, dtype=torch.uint8)
        with open(md.path / info.file, "rb") as f:
            f.seek(info.start)
            f.readinto(memoryview(data.numpy()))
        out.append(data.view(_DTYPES[info.dtype]).reshape(info.shape))
    return out


# --- planning the output -------------------------------------------------------------------


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


def saved_names(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the key ``save_pretrained`` writes for it.

    transformers 5 renames some weights on save (ViT's ``layers.0.attention.
    k_proj`` is saved as ``encoder.layer.0.attention.attention.key``). Its own
    reverse conversion, run on meta tensors, tells which key holds which
    tensor, matched by identity.
    """
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    try:
        from transformers.modeling_utils import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(named))
    except Exception:  # an older transformers, or a converter that needs real data
        return {}
    by_id = {id(v): k for k, v in reverted.items()}
    return {name: name if name in reverted else by_id.get(id(t), name) for name, t in named.items()}


def _checkpoint_key(name: str, keys: set[str], prefix: str, saved: dict[str, str]) -> str | None:
    """The checkpoint key for a parameter name: as saved, maybe without the base prefix."""
    for base in dict.fromkeys((name, saved.get(name, name))):
        for candidate in (base, base.removeprefix(prefix + ".") if prefix else base,
                          f"{prefix}.{base}" if prefix else base):
            if candidate in keys:
                return candidate
    return None


def _plan_entries(md: ModelDir, plan: FoldPlan, prefix: str, saved: dict[str, str],
                  pickled: dict[str, tuple[str, torch.Tensor]] | None,
                  model: nn.Module) -> list[tuple[str, list[Entry]]]:
    """Output shards like the input's, each with its entries in input order."""
    if pickled is not None:
        shards: list[tuple[str, list[Entry]]] = [(s, []) for s in md.shards]
        home = {s: es for s, es in shards}
        for name, (shard, t) in pickled.items():
            if t.dtype not in _CODES:
                raise CheckpointError(f"{name} has dtype {t.dtype}, which safetensors cannot store")
            home[shard].append(Entry(name, _CODES[t.dtype], tuple(t.shape),
                                     t.numel() * t.element_size(), tensor=t))
    else:
        shards = [(s, [Entry(t.name, t.dtype, t.shape, t.nbytes, source=t)
                       for t in sorted(md.tensors.values(), key=lambda t: t.start) if t.file == s])
                  for s in md.shards]
    by_key = {e.name: e for _, es in shards for e in es}
    keys = set(by_key)
    key = lambda name: _checkpoint_key(name, keys, prefix, saved)  # noqa: E731
    partner = {u.tied_to: u.param for u in plan.untied} | {u.param: u.tied_to for u in plan.untied}
    extras: dict[str, tuple[str, int | None]] = {}  # new name -> (source key, centering axis)
    gains = [c.scale for c in plan.centered if c.scale]
    gains = dict(zip(gains, _read_tensors(md, model, gains, pickled))) if gains else {}
    for c in plan.centered:
        if not c.saved:
            continue  # a non-persistent buffer: not in the checkpoint, enjoyln.load centers it
        k = key(c.param)
        if k is None and c.param not in partner:
            k = _alias_key(model, c.param, key)
        if k is not None:
            e = by_key[k]
            blocks = c.blocks if e.axis is None else _block_union(e.blocks, c.blocks)
            e.axis, e.groups, e.blocks, e.scale = c.axis, c.groups, blocks, gains.get(c.scale)
        elif c.param in partner and key(partner[c.param]) is not None:
            # Only the tied head was saved: it supplies the embedding too, centered.
            extras[saved.get(c.param, c.param)] = (key(partner[c.param]), c.axis)
        else:
            raise CheckpointError(f"the checkpoint has no tensor for {c.param}, which the fold centers")
    for u in plan.untied:
        if key(u.param) is None:
            src = key(u.tied_to)
            if src is None:
                raise CheckpointError(f"the checkpoint has neither {u.param} nor {u.tied_to}")
            extras[saved.get(u.param, u.param)] = (src, None)  # the head keeps the original values
    for new, (src_key, axis) in extras.items():
        src = by_key[src_key]
        for _, entries in shards:
            if src in entries:
                entries.append(Entry(new, src.dtype, src.shape, src.nbytes, source=src.source,
                                     axis=axis, tensor=src.tensor))
                break
    return shards


def _alias_key(model: nn.Module, name: str, key: Callable[[str], str | None]) -> str | None:
    """The checkpoint key of a tensor saved under another of its names (BART's encoder
    and decoder embeddings are ``shared.weight``)."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    tensor = dict(named).get(name)
    return next((key(other) for other, t in named if t is tensor and key(other) is not None), None)


def _block_union(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """One tensor's blocks centered for several norms (q and k of one fused projection):
    the blocks are disjoint and centered each on its own, so one pass does them all."""
    return None if a is None or b is None else tuple(sorted({*a, *b}))


def _reshard(shards: list[tuple[str, list[Entry]]], max_bytes: int | None,
             single_name: str = SAFE_WEIGHTS) -> list[tuple[str, list[Entry]]]:
    """Keep the input's shards (renamed to .safetensors), or pack up to ``max_bytes`` each."""
    if max_bytes is None:
        if len(shards) == 1:
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


# --- writing -------------------------------------------------------------------------------


class _Buffer:
    """One reusable buffer for the tensor being centered.

    Fresh memory costs a page fault per page on first touch; reusing one
    buffer sized for the largest centered tensor avoids that, and bounds the
    memory the fold needs.
    """

    def __init__(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
        if self.data.numel() < nbytes:
            self.data = torch.empty(nbytes, dtype=torch.uint8)
        return self.data[:nbytes].view(dtype).view(shape)


def _pread_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise CheckpointError(f"{name} ended early")
        got += n


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _copy_range(src: int, dst: int, start: int, count: int, at: int, advance: Callable[[int], None],
                stop: threading.Event | None = None) -> None:
    """Copy ``count`` bytes from ``src`` at ``start`` to ``dst`` at ``at``, in the kernel if possible."""
    while count and not (stop is not None and stop.is_set()):
        step = min(count, 64 << 20)
        try:
            n = os.copy_file_range(src, dst, step, start, at)
        except (AttributeError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
                raise
            chunk = os.pread(src, step, start)
            _pwrite_all(dst, memoryview(chunk), at)
            n = len(chunk)
        if n <= 0:
            raise CheckpointError("a weight file ended early")
        start, at, count = start + n, at + n, count - n
        advance(n)


def _header_json(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """A safetensors header for ``entries`` stored back to back, unpadded."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    return json.dumps(header, separators=(",", ":")).encode()


def _write_shard(file: Path, entries: list[Entry], root: Path, metadata: dict[str, str],
                 advance: Callable[[int], None], buffer: _Buffer) -> None:
    """Write one safetensors file tensor by tensor.

    safetensors' own writer needs every tensor of a file in memory at once;
    the header is small JSON with known sizes, so it is written first, and
    every tensor then goes to its own offset. Unchanged tensors are copied
    by the kernel on a second thread while this one centers the others.
    Callers re-read the result's header.
    """
    blob = _header_json(entries, metadata)
    blob += b" " * (-len(blob) % 8)
    base = 8 + len(blob)
    positions, pos = [], base
    for e in entries:
        positions.append(pos)
        pos += e.nbytes
    fds: dict[str, int] = {}
    out = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(out, memoryview(struct.pack("<Q", len(blob)) + blob), 0)
        for e in entries:
            if e.source is not None and e.source.file not in fds:
                fds[e.source.file] = os.open(root / e.source.file, os.O_RDONLY)
        raw = [(e, at) for e, at in zip(entries, positions) if e.axis is None and e.tensor is None]
        cooked = [(e, at) for e, at in zip(entries, positions) if not (e.axis is None and e.tensor is None)]

        stop = threading.Event()

        def copy_raw() -> None:
            for e, at in raw:
                if stop.is_set():
                    return
                _copy_range(fds[e.source.file], out, e.source.start, e.nbytes, at, advance)

        with ThreadPoolExecutor(1) as pool:
            copying = pool.submit(copy_raw)
            try:
                for e, at in cooked:
                    if e.tensor is not None:
                        t = buffer.tensor(e.tensor.dtype, e.shape, e.nbytes)
                        t.copy_(e.tensor)
                    else:
                        t = buffer.tensor(_DTYPES[e.dtype], e.shape, e.nbytes)
                    view = memoryview(t.view(-1).view(torch.uint8).numpy()) if e.nbytes else memoryview(b"")
                    if e.tensor is None:
                        _pread_into(fds[e.source.file], view, e.source.start, str(root / e.source.file))
                    if e.axis is not None:
                        center_(t, e.axis, e.groups, e.scale, e.blocks)
                    _pwrite_all(out, view, at)
                    advance(e.nbytes)
            except BaseException:
                stop.set()  # the first error is the one to report; the copy just stops
                copying.exception()
                raise
            copying.result()
        os.ftruncate(out, pos)
    finally:
        os.close(out)
        for fd in fds.values():
            os.close(fd)


_HEADER_ROOM = 4096
"""Room the early copy leaves in front of a shard's data for its header to grow (the
enjoyln tag, an untied head's entry). A whole page, so the data keeps its alignment."""


def _packed_span(md: ModelDir, shard: str) -> tuple[int, int] | None:
    """(start, length) of a shard's tensor data if its tensors tile it end to end, as
    safetensors writes them; None for anything else, which is then rewritten instead."""
    with open(md.path / shard, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    base = pos = 8 + header_len
    for t in sorted((t for t in md.tensors.values() if t.file == shard), key=lambda t: (t.start, t.end)):
        if t.start != pos:
            return None
        pos = t.end
    return base, pos - base


class _EarlyCopy:
    """Copies the input's weight files into the output directory while the analysis runs.

    The analysis is seconds of CPU work and the copy is seconds of I/O, so
    they overlap. Each copy keeps the input's bytes at the same offsets plus
    ``_HEADER_ROOM``; once the plan is known, ``_finish_shard`` centers the
    planned tensors in place, appends any new ones and writes the header. A
    shard whose layout changes is written afresh instead.
    """

    def __init__(self, md: ModelDir, tmp: Path, spans: dict[str, tuple[str, int, int]],
                 advance: Callable[[int], None]) -> None:
        self.md, self.tmp, self.spans, self.advance = md, tmp, spans, advance
        self.done = {shard: threading.Event() for shard in spans}
        self.copied: set[str] = set()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="enjoyln-early-copy", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for shard, (name, base, length) in self.spans.items():
                src = os.open(self.md.path / shard, os.O_RDONLY)
                try:
                    dst = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        _copy_range(src, dst, base, length, base + _HEADER_ROOM, self.advance, self.stop)
                    finally:
                        os.close(dst)
                finally:
                    os.close(src)
                if self.stop.is_set():
                    return
                self.copied.add(shard)
                self.done[shard].set()
        except BaseException as exc:  # reported by wait(), in the thread that can act on it
            self.error = exc
        finally:
            self.stop.set()
            for event in self.done.values():
                event.set()

    def wait(self, shard: str) -> None:
        """Block until ``shard`` is copied; raise what the copy raised."""
        self.done[shard].wait()
        if self.error is not None:
            raise self.error
        if shard not in self.copied:
            raise RuntimeError(f"the early copy of {shard} was stopped")

    def cancel(self) -> None:
        self.stop.set()
        self.thread.join()


def _finish_shard(file: Path, entries: list[Entry], root: Path, base: int, metadata: dict[str, str],
                  advance: Callable[[int], None], buffer: _Buffer) -> bool:
    """Turn an early copy of a shard into the output shard; False if its header would not fit.

    The first entries are the input's tensors, already in place; centered ones
    are read, centered and written back where they are; entries added by the
    plan (untied heads) are appended after them.
    """
    blob = _header_json(entries, metadata)
    start = base + _HEADER_ROOM
    if len(blob) > start - 8:
        return False
    blob += b" " * (start - 8 - len(blob))  # JSON allows trailing spaces; safetensors pads this way too
    fds: dict[str, int] = {}
    out = os.open(file, os.O_RDWR)
    try:
        at = start
        for e in entries:
            if e.source is None:  # only pickle input lacks a source, and never comes here
                raise AssertionError(e.name)
            if e.source.file not in fds:
                fds[e.source.file] = os.open(root / e.source.file, os.O_RDONLY)
            appended = e.source.start + _HEADER_ROOM != at or e.source.file != file.name
            if e.axis is not None:
                t = buffer.tensor(_DTYPES[e.dtype], e.shape, e.nbytes)
                view = memoryview(t.view(-1).view(torch.uint8).numpy()) if e.nbytes else memoryview(b"")
                _pread_into(fds[e.source.file], view, e.source.start, str(root / e.source.file))
                center_(t, e.axis, e.groups, e.scale, e.blocks)
                _pwrite_all(out, view, at)
                advance(e.nbytes)
            elif appended:
                _copy_range(fds[e.source.file], out, e.source.start, e.nbytes, at, advance)
            at += e.nbytes
        _pwrite_all(out, memoryview(struct.pack("<Q", len(blob)) + blob), 0)
        os.ftruncate(out, at)
    finally:
        os.close(out)
        for fd in fds.values():
            os.close(fd)
    return True


def _output_config(md: ModelDir, plan: FoldPlan) -> dict[str, Any]:
    config = json.loads(json.dumps(md.config))
    if plan.untied:
        config["tie_word_embeddings"] = False
        for sub in ("text_config", "decoder"):
            if isinstance(config.get(sub), dict) and "tie_word_embeddings" in config[sub]:
                config[sub]["tie_word_embeddings"] = False
    config["enjoyln"] = {
        "format_version": FORMAT_VERSION,
        "version": __version__,
        "rmsnorm": [e.name for e in plan.foldable],
        "centered": [c.to_dict() for c in plan.centered],
        "center_on_load": [c.param for c in plan.centered if not c.saved],
        "untied": [u.param for u in plan.untied],
        "auxiliary_centering": [{"module": a.module, "where": a.where} for a in plan.auxiliary],
        "plan": plan.to_dict(),
    }
    return config


def _is_weight_file(name: str) -> bool:
    return fnmatch.fnmatch(name, "*.safetensors") or any(fnmatch.fnmatch(name, p) for p in (
        "pytorch_model*.bin", "*.bin.index.json", "*.safetensors.index.json", "tf_model*.h5",
        "flax_model*.msgpack", "model*.ckpt*", "*.pt", "*.pth"))


def _check_shapes(md: ModelDir, model: nn.Module) -> None:
    """Every saved tensor the model knows has the shape its config implies, so a
    mismatched checkpoint is refused before anything is written."""
    if md.pickled:
        return
    saved = saved_names(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys = set(md.tensors)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = _checkpoint_key(name, keys, prefix, saved)
        if key is not None and tuple(md.tensors[key].shape) != tuple(t.shape):
            raise CheckpointError(f"{key} has shape {list(md.tensors[key].shape)} in the checkpoint but "
                                  f"{list(t.shape)} in the model config.json describes")


def _check_paths(src: Path, out: Path, force: bool) -> None:
    src, out = src.resolve(), out.resolve()
    if out == src or src in out.parents:
        raise CheckpointError(f"OUT_DIR {out} is inside MODEL_DIR {src}; choose a directory elsewhere")
    if out in src.parents:
        raise CheckpointError(f"OUT_DIR {out} contains MODEL_DIR {src}; choose a directory elsewhere")
    if out.exists():
        if not out.is_dir():
            raise CheckpointError(f"OUT_DIR {out} exists and is not a directory")
        if any(out.iterdir()) and not force:
            raise CheckpointError(f"OUT_DIR {out} is not empty; pass --force to replace it")


def _os_error(exc: OSError, where: Path) -> CheckpointError:
    if exc.errno == errno.ENOSPC:
        return CheckpointError(f"disk full while writing {where}; nothing was written")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"permission denied writing {where}; nothing was written")
    return CheckpointError(f"cannot write {where}: {exc.strerror or exc}; nothing was written")


@dataclass
class FoldResult:
    """What ``fold_checkpoint`` did."""

    plan: FoldPlan
    out_dir: Path | None
    files: list[str]
    bytes_written: int
    seconds: float
    """Wall time of the whole fold, analysis included."""
    stream_seconds: float = 0.0
    """Wall time of writing the weights alone."""


def _load_pickled(md: ModelDir) -> dict[str, tuple[str, torch.Tensor]]:
    """Pickle weights, loaded only because the user asked, and only as plain tensors."""
    tensors: dict[str, tuple[str, torch.Tensor]] = {}
    for shard in md.shards:
        try:
            part = torch.load(md.path / shard, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"cannot load {md.path / shard} with weights_only=True: "
                                  f"{(str(exc).splitlines() or [''])[0]}") from None
        tensors.update({k: (shard, v) for k, v in part.items() if isinstance(v, torch.Tensor)})
    return tensors


def fold_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                    max_shard_size: int | None = None, force: bool = False,
                    allow_pickle: bool = False, dry_run: bool = False, auxiliary_centering: bool = False,
                    plan: FoldPlan | None = None, progress: Progress | None = None) -> FoldResult:
    """Fold a Hugging Face model directory into OUT_DIR, streaming tensor by tensor.

    OUT_DIR gets every file of MODEL_DIR (tokenizer and processor files
    included), the centered weights in their own dtypes, an explicit untied
    head, and an ``enjoyln`` block in config.json. It loads with plain
    ``from_pretrained`` (the LNs are still there and see zero-mean inputs), or
    with ``enjoyln.load`` (the LNs run as RMSNorm).

    >>> fold_checkpoint("gpt2-dir", "gpt2-folded")  # doctest: +SKIP
    """
    start = time.perf_counter()
    src, out = Path(model_dir), Path(out_dir)
    md = open_model_dir(src, allow_pickle=allow_pickle)
    _check_paths(src, out, force or dry_run)
    done, total, lock = [0], [0], threading.Lock()

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], max(total[0], done[0]))

    tmp: Path | None = None
    early: _EarlyCopy | None = None
    try:
        spans = _early_spans(md, max_shard_size) if not dry_run else {}
        if spans:  # copy while the model's code loads and the analysis runs; see _EarlyCopy
            tmp = _temp_dir(out)
            total[0] = sum(length for _, _, length in spans.values())
            early = _EarlyCopy(md, tmp, spans, advance)
        stream_start = time.perf_counter()
        model = meta_model(md)
        if early is not None and not norm_module_paths(model):
            early.cancel()  # no norm module: almost surely nothing to fold, so stop copying now
            early, spans = None, {}
        if plan is not None:
            check_fits(model, plan)
        _check_shapes(md, model)
        if plan is None:
            plan = _analyze(md, model, auxiliary_centering)
        if dry_run or not plan.foldable:
            return FoldResult(plan, None, [], 0, time.perf_counter() - start)
        pickled = _load_pickled(md) if md.pickled else None
        prefix = getattr(model, "base_model_prefix", "") or ""
        shards = _reshard(_plan_entries(md, plan, prefix, saved_names(model), pickled, model), max_shard_size)
        bytes_out = sum(e.nbytes for _, es in shards for e in es)
        by_name = {name: shard for shard, (name, _, _) in spans.items()}
        layout = {name: _early_layout(md, by_name.get(name), entries) for name, entries in shards}
        with lock:  # what is left: whole shards written afresh; centered and appended tensors
            total[0] += sum(e.nbytes for name, es in shards for i, e in enumerate(es)
                            if layout[name] is None or i >= layout[name] or e.axis is not None)
        if tmp is None:
            tmp = _temp_dir(out)
            stream_start = time.perf_counter()
        skip = _WEIGHT_FILES | set(md.shards) | {"config.json"}
        for item in md.path.iterdir():
            if item.name in skip or _is_weight_file(item.name):
                continue  # weights in any other format would be stale, uncentered copies
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        (tmp / "config.json").write_text(json.dumps(_output_config(md, plan), indent=2) + "\n")
        metadata = {"format": "pt", "enjoyln": __version__}
        buffer = _Buffer()
        for name, entries in shards:
            if early is not None and name in by_name:
                early.wait(by_name[name])  # never rewrite a file the copy is still writing
            if layout[name] is not None and _finish_shard(tmp / name, entries, md.path,
                                                          spans[by_name[name]][1], metadata, advance, buffer):
                continue
            if layout[name] is not None:  # the header outgrew its room: write the shard afresh
                with lock:
                    total[0] += sum(e.nbytes for e in entries)
            _write_shard(tmp / name, entries, md.path, metadata, advance, buffer)
        if early is not None:
            early.cancel()
        stream_seconds = time.perf_counter() - stream_start
        files = [name for name, _ in shards]
        if len(shards) > 1:
            index = {"metadata": {"total_size": bytes_out, "enjoyln": __version__},
                     "weight_map": {e.name: name for name, es in shards for e in es}}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for name in files:  # the output must read back, or it is not published
            read_safetensors_header(tmp / name)
        _publish(tmp, out)
        tmp = None
    except OSError as exc:
        raise _os_error(exc, out) from None
    finally:
        if early is not None:
            early.cancel()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return FoldResult(plan, out, files, bytes_out, time.perf_counter() - start, stream_seconds)


def _temp_dir(out: Path) -> Path:
    """A fresh directory beside OUT_DIR, renamed into place only when complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.enjoyln-", dir=out.parent))


def _early_spans(md: ModelDir, max_shard_size: int | None) -> dict[str, tuple[str, int, int]]:
    """Input shard -> (output file, data start, data length) for each shard that can be
    copied before the plan is known: safetensors, packed, and not re-sharded."""
    if md.pickled or max_shard_size is not None:
        return {}
    names = [name for name, _ in _reshard([(shard, []) for shard in md.shards], None)]
    spans = {}
    for shard, name in zip(md.shards, names):
        span = _packed_span(md, shard)
        if span is not None:
            spans[shard] = (name, *span)
    return spans


def _early_layout(md: ModelDir, shard: str | None, entries: list[Entry]) -> int | None:
    """How many leading ``entries`` sit where the early copy of ``shard`` put them (all of
    that shard's tensors, in order), or None if the output shard must be written afresh."""
    if shard is None:
        return None
    inputs = sorted((t for t in md.tensors.values() if t.file == shard), key=lambda t: (t.start, t.end))
    if len(entries) < len(inputs) or any(e.source is not t or e.name != t.name or e.tensor is not None
                                         for e, t in zip(entries, inputs)):
        return None
    return len(inputs)


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished temporary directory to ``out``, replacing it if it exists."""
    if out.exists():
        trash = out.with_name(f".{out.name}.enjoyln-old-{os.getpid()}")
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


# --- loading ---------------------------------------------------------------------------------


def load(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a folded directory and run its recorded LNs as ``enjoyln.RMSNorm``.

    Auxiliary centerings recorded in the directory are installed again. A
    directory without an ``enjoyln`` block loads as it is.

    >>> model = load("gpt2-folded", dtype="bfloat16")  # doctest: +SKIP
    """
    md = open_model_dir(path, allow_pickle=bool(from_pretrained_kwargs.pop("allow_pickle", False)))
    import transformers

    cls = getattr(transformers, md.architecture)
    from_pretrained_kwargs.setdefault("trust_remote_code", False)
    if md.pickled:
        from_pretrained_kwargs.setdefault("use_safetensors", False)
    try:
        model = cls.from_pretrained(md.path, **from_pretrained_kwargs)
    except EnjoylnError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot load {md.path}: {type(exc).__name__}: "
                              f"{(str(exc).splitlines() or [''])[0]}") from None
    block = md.config.get("enjoyln")
    if block:
        try:
            plan = FoldPlan.from_dict(block["plan"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the enjoyln block in {md.path / 'config.json'} is malformed "
                                  f"({type(exc).__name__}: {exc})") from None
        plan.untied = []  # already untied and centered on disk: the centerings and the swap are left
        for step in (InsertCentering(), SwapLayerNorms()):
            step.check(model, plan)
        # non-persistent buffers (sinusoidal tables) are built afresh by the model: center them again
        center_all(model, [c for c in plan.centered if not c.saved])
        for step in (InsertCentering(), SwapLayerNorms()):
            step(model, plan)
    return model.eval()


def parse_size(text: str | int | None) -> int | None:
    """'500MB', '2GB', '1.5GiB' or a byte count, as bytes."""
    if text is None:
        return None
    if isinstance(text, int):
        if text <= 0:
            raise CheckpointError(f"cannot use the size {text}; it must be positive")
        return text
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6,
             "GB": 10**9, "B": 1}
    size = None
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                size = int(float(s[: -len(unit)]) * mult)
            except (ValueError, OverflowError):
                pass
            break
    else:
        size = int(s) if s.isdigit() else None
    if size is None or size <= 0:
        raise CheckpointError(f"cannot use the size {text!r}; write a positive size such as 500MB or 2GB")
    return size



def check_checkpoints(reference_dir: str | os.PathLike, candidate_dir: str | os.PathLike, *,
                      allow_pickle: bool = False, **check_kwargs: Any) -> "CheckReport":
    """Load two model directories and compare them with ``enjoyln.check``.

    The candidate loads through ``enjoyln.load``, so a folded directory runs
    with its RMSNorms. A half-precision reference is also loaded in float32,
    as the ground truth of the precision-aware criterion.

    >>> check_checkpoints("gpt2-dir", "gpt2-folded").passed  # doctest: +SKIP
    True
    """
    from .check import HALF, check

    ref_md = open_model_dir(reference_dir, allow_pickle=allow_pickle)
    cand_md = open_model_dir(candidate_dir, allow_pickle=allow_pickle)
    if ref_md.architecture != cand_md.architecture:
        raise CheckpointError(f"{reference_dir} is a {ref_md.architecture} but {candidate_dir} is a "
                              f"{cand_md.architecture}")
    reference = load(reference_dir, allow_pickle=allow_pickle)
    candidate = load(candidate_dir, allow_pickle=allow_pickle)
    dtype = next((p.dtype for p in reference.parameters() if p.is_floating_point()), torch.float32)
    if dtype in HALF:
        check_kwargs.setdefault("fp32_reference",
                                load(reference_dir, allow_pickle=allow_pickle, dtype=torch.float32))
    return check(reference, candidate, **check_kwargs)
