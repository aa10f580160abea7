"""Checkpoint I/O: fold a Hugging Face model directory into a new one, streaming.

The analysis runs on the meta device (no weights in memory). The fold then
streams tensor by tensor: tensors that do not change are copied byte for
byte, centered ones are loaded one at a time, centered in float64 and written
back in their own dtype. Peak memory is a few of the largest tensors (pickle
weights, read only with ``--allow-pickle``, are loaded whole).

The output is written into a temporary directory beside OUT_DIR, checked
there, and renamed into place only when the check passes, so OUT_DIR never
holds a partial or unchecked fold; the input directory is only ever read.
Reading, containing and publishing directories is ``model_dir``'s job.
"""

from __future__ import annotations

import errno
import functools
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
from .analysis import analyze
from .analysis.driver import norm_module_paths
from .errors import CheckFailed, CheckpointError, EnjoylnError, first_line
from .store.plan_cache import cached_plan
from .store.sources import source_of
from .store.model_dir import ModelDir, load_dtype, meta_model, open_model_dir
from .store.files import check_links, copy_extras
from .store.formats import (CODES as _CODES, DTYPES as _DTYPES, SAFE_INDEX, SAFE_WEIGHTS, load_pickled,
                            read_safetensors_header, TensorInfo)
from .store.hf import check_shapes, checkpoint_key, saved_names
from .store.transaction import check_out_dir, clean_stale, keep_failed as _keep_failed, missing_dirs, publish, remove_dirs, signals_held, temp_dir
from .plan import AFFINE_GAIN, FORMAT_VERSION, NOT_ROTATED, Centering, FoldPlan, RotationSpec, block_lists, format_bytes
from .transform.rotation import apply_rotation
from .transform.steps import InsertCentering, SwapLayerNorms, apply_plan, check_fits
from .transform.tensors import center_, center_all, merge_centerings, tie_groups, ties_lost_on_untie
from .store.stream import StreamedTensors
from .store.tensors import return_freed_memory

if TYPE_CHECKING:
    from .checking.report import CheckReport

__all__ = ["fold_checkpoint", "analyze_checkpoint", "check_checkpoints", "load", "load_plain", "parse_size",
           "FoldResult"]

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes total) as the output is written."""

CHECK_MODES = ("full", "static", "none")
"""full: the static weight check, then a forward comparison; static: weights only; none."""


def analyze_checkpoint(path: str | os.PathLike, *, allow_pickle: bool = False,
                       auxiliary_centering: bool = False, trust_remote_code: bool = False,
                       fuse_affine: bool = False,
                       rotate: RotationSpec | tuple[str, int, bool] | None = None) -> FoldPlan:
    """The fold plan for a model directory, computed on the meta device.

    >>> analyze_checkpoint("path/to/gpt2").summary()  # doctest: +SKIP
    """
    md = open_model_dir(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    model = meta_model(md)
    check_shapes(md, model)
    return _analyze(md, model, auxiliary_centering, fuse_affine, RotationSpec.of(rotate))


def _analyze(md: ModelDir, model: nn.Module, auxiliary_centering: bool, fuse_affine: bool = False,
             rotate: RotationSpec | None = None) -> FoldPlan:
    """The plan for the meta model. The gains a rule depends on (a LayerScale gain the
    centering divides by, a norm's γ that a kept bias is divided by) are read from the
    checkpoint, and where one has a zero entry the analysis runs again knowing it."""
    options = {"auxiliary_centering": auxiliary_centering, "fuse_affine": fuse_affine, "rotate": rotate}
    plan = cached_plan(md, options, lambda: analyze(model, **options))
    names = sorted({c.scale for c in plan.centered if c.scale}
                   | {f"{e.name}.weight" for e in plan.foldable if e.affine == AFFINE_GAIN})
    if not names:
        return plan
    gains = dict(zip(names, _read_tensors(md, model, names)))
    if all(bool(g.ne(0).all()) for g in gains.values()):
        return plan
    return analyze(model, weights=gains, **options)


def _read_tensors(md: ModelDir, model: nn.Module, names: list[str],
                  pickled: dict[str, tuple[str, torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """Small tensors (LayerScale gains) by parameter name, read from the checkpoint."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    saved = saved_names(model)
    if md.pickled and pickled is None:
        pickled = load_pickled(md)
    keys = set(pickled) if pickled is not None else set(md.tensors)
    out = []
    for name in names:
        key = checkpoint_key(name, keys, prefix, saved)
        if key is None:
            raise CheckpointError(f"the checkpoint has no tensor for {name}, which the fold needs")
        out.append(pickled[key][1] if pickled is not None else _stored(md, key))
    return out


def _stored(md: ModelDir, key: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint, as stored."""
    info = md.tensors[key]
    data = torch.empty(info.nbytes, dtype=torch.uint8)
    with open(md.path / info.file, "rb") as f:
        f.seek(info.start)
        f.readinto(memoryview(data.numpy()))
    return data.view(_DTYPES[info.dtype]).reshape(info.shape)


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
    compute: Callable[[], torch.Tensor] | None = None  # or write what this computes when its turn comes


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
    key = lambda name: checkpoint_key(name, keys, prefix, saved)  # noqa: E731
    # Tied names are one tensor, stored once under any of them (BART's encoder and decoder
    # embeddings are model.shared.weight); an untied head is a tensor of its own.
    groups = tie_groups(model, {u.param for u in plan.untied})

    def stored(name: str) -> list[str]:
        """The keys holding ``name``'s tensor: its own, or another tied name's."""
        return list(dict.fromkeys(k for n in groups.get(name, (name,)) if (k := key(n)) is not None))

    extras: dict[str, tuple[str, int | None]] = {}  # new name -> (source key, centering axis)
    gains = [c.scale for c in plan.centered if c.scale]
    gains = dict(zip(gains, _read_tensors(md, model, gains, pickled))) if gains else {}
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
    return shards


def moves_values(plan: FoldPlan) -> bool:
    """Whether a plan computes tensors from other tensors (a fused affine, a rotation), which
    a centering of each tensor on its own cannot do: such folds are computed by
    ``StreamedTensors``, each tensor from the reference tensors it depends on."""
    return bool(plan.fused) or plan.rotation is not None


def final_tensors(md: ModelDir, plan: FoldPlan, meta: nn.Module, *, trust_remote_code: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the folded checkpoint, by key: the model loaded from ``md`` with the plan
    applied in memory (in float64 where it computes), in each key's own dtype.

    A folded norm whose affine moved keeps γ = 1 and β = 0 (or β/γ) on disk, so
    a plain ``from_pretrained`` still gives the original's outputs.

    This holds the whole model; the fold and the static check use ``StreamedTensors``, which
    computes the same tensors one at a time, and the tests hold it to this, bit for bit.
    """
    model = _load_plain(md, trust_remote_code)
    apply_plan(model, plan)
    prefix = getattr(meta, "base_model_prefix", "") or ""
    saved = saved_names(meta)
    keys = set(md.tensors) if not md.pickled else set(load_pickled(md))
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        key = checkpoint_key(name, keys, prefix, saved)
        if key is not None:
            out.setdefault(key, t.detach())
    for u in plan.untied:
        if checkpoint_key(u.param, keys, prefix, saved) is None:
            out[saved.get(u.param, u.param)] = named[u.param].detach()
    for target in ties_lost_on_untie(meta, plan):
        if checkpoint_key(target, keys, prefix, saved) is None and target in named:
            out.setdefault(saved.get(target, target), named[target].detach())
    for e in plan.foldable:
        for leaf, fill in (("weight", 1.0), ("bias", 0.0)):
            key = checkpoint_key(f"{e.name}.{leaf}", keys, prefix, saved)
            if key is not None and key not in out:  # dropped with the affine: 1 and 0 on disk
                info = md.tensors.get(key)
                shape = info.shape if info is not None else tuple(e.normalized_shape)
                dtype = _DTYPES[info.dtype] if info is not None else torch.float32
                out[key] = torch.full(shape, fill, dtype=dtype)
    # stored but not loaded by the model (GPT-2's attn.bias masks): kept as they are, as the
    # tensor-by-tensor fold keeps them
    pickled = load_pickled(md) if md.pickled and keys - out.keys() else None
    for key in sorted(keys - out.keys()):
        out[key] = pickled[key][1] if pickled is not None else _stored(md, key)
    for key, t in out.items():
        info = md.tensors.get(key)
        if info is not None and t.dtype != _DTYPES[info.dtype]:
            out[key] = t.to(_DTYPES[info.dtype])
    return out


def _load_plain(md: ModelDir, trust_remote_code: bool) -> nn.Module:
    try:
        return source_of(md).load(md, trust_remote_code=trust_remote_code, dtype="auto").eval()
    except EnjoylnError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot load {md.path}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None


def _moved_entries(md: ModelDir, tensors: StreamedTensors) -> list[tuple[str, list[Entry]]]:
    """Output shards like the input's, each tensor computed when the writer reaches it (or
    copied, where the fold leaves its bytes as they are)."""
    home: dict[str, str] = ({t.name: t.file for t in md.tensors.values()} if not md.pickled
                            else {k: shard for k, (shard, _) in load_pickled(md).items()})
    shards: list[tuple[str, list[Entry]]] = [(s, []) for s in md.shards]
    by_shard = dict(shards)
    order = sorted(tensors.keys(), key=lambda k: (md.tensors[k].start if k in md.tensors else math.inf, k))
    for key in order:
        out = tensors.outputs[key]
        if out.dtype not in _CODES:
            raise CheckpointError(f"{key} has dtype {out.dtype}, which safetensors cannot store")
        source = tensors.source(key)
        by_shard[home.get(key, md.shards[-1])].append(
            Entry(key, _CODES[out.dtype], out.shape, out.nbytes, source=source,
                  compute=None if source is not None else functools.partial(tensors.get, key)))
    return shards


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


def _fd_path(fd: int) -> str:
    """The file an open descriptor reads, for messages."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "a weight file"


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
            raise CheckpointError(f"{_fd_path(src)} ended early: it changed while it was being read")
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
    out = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _pwrite_all(out, memoryview(struct.pack("<Q", len(blob)) + blob), 0)
        for e in entries:
            if e.source is not None and e.source.file not in fds:
                fds[e.source.file] = os.open(root / e.source.file, os.O_RDONLY)
        raw = [(e, at) for e, at in zip(entries, positions) if e.axis is None and e.tensor is None and e.compute is None]
        cooked = [(e, at) for e, at in zip(entries, positions) if not (e.axis is None and e.tensor is None
                                                                      and e.compute is None)]

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
                    if e.compute is not None:  # computed now, written from its own memory, dropped
                        t = e.compute().contiguous()
                        if t.dtype != _DTYPES[e.dtype] or t.numel() * t.element_size() != e.nbytes:
                            raise AssertionError(f"{e.name} was computed as {t.dtype} {list(t.shape)}")
                        _pwrite_all(out, memoryview(t.view(-1).view(torch.uint8).numpy()) if e.nbytes
                                    else memoryview(b""), at)
                        del t
                        advance(e.nbytes)
                        continue
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


def _packed_span(md: ModelDir, shard: str) -> tuple[int, int]:
    """(start, length) of a shard's tensor data, which validation proved tiles the file."""
    with open(md.path / shard, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    base = 8 + header_len
    return base, (md.path / shard).stat().st_size - base


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
        self.started, self.finished = time.perf_counter(), None
        self.thread = threading.Thread(target=self._run, name="enjoyln-early-copy", daemon=True)
        self.thread.start()

    def seconds_before(self, moment: float) -> float:
        """How long the copy ran before ``moment`` (its own time, not the analysis it overlapped)."""
        end = self.finished if self.finished is not None else time.perf_counter()
        return max(0.0, min(end, moment) - self.started)

    def _run(self) -> None:
        try:
            for shard, (name, base, length) in self.spans.items():
                src = os.open(self.md.path / shard, os.O_RDONLY)
                try:
                    dst = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
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
            self.finished = time.perf_counter()
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
        "format_version": plan.format_version,
        "version": __version__,
        **block_lists(plan),
        "plan": plan.to_dict(),
    }
    if plan.rotation is not None:
        config["enjoyln"]["rotation"] = {"kind": plan.rotation.kind, "seed": plan.rotation.seed,
                                         "keep_mean": plan.rotation.keep_mean,
                                         "plain_loading_exact": plan.rotation.keep_mean}
    return config


def _os_error(exc: OSError, out: Path, tmp: Path | None) -> CheckpointError:
    """One line naming the path at fault: OUT_DIR for anything written there, else the file itself."""
    name = Path(exc.filename) if exc.filename else None
    where = out if name is None or (tmp is not None and (name == tmp or tmp in name.parents)) else name
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
    """Wall time of the whole fold, analysis and check included."""
    stream_seconds: float = 0.0
    """Time spent moving the weights: the copy itself, not the wait for imports or the analysis."""
    report: "CheckReport | None" = None
    """The check that ran before OUT_DIR was published (None with ``check="none"``)."""
    skipped: list[str] = field(default_factory=list)
    """Entries of MODEL_DIR not copied, with the reason (outside it, special files)."""
    cleaned: list[Path] = field(default_factory=list)
    """Temporary directories of killed runs for the same OUT_DIR, removed first."""
    followed: list[str] = field(default_factory=list)
    """Files a model directory needs, copied through links that leave MODEL_DIR (``name -> target``)."""


def fold_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                    max_shard_size: int | None = None, force: bool = False,
                    allow_pickle: bool = False, dry_run: bool = False, auxiliary_centering: bool = False,
                    plan: FoldPlan | None = None, progress: Progress | None = None,
                    check: str = "full", keep_failed: bool = False, trust_remote_code: bool = False,
                    check_options: dict[str, Any] | None = None, fuse_affine: bool = False,
                    rotate: RotationSpec | tuple[str, int, bool] | None = None) -> FoldResult:
    """Fold a Hugging Face model directory into OUT_DIR, streaming tensor by tensor, and check it.

    OUT_DIR gets every file of MODEL_DIR (tokenizer and processor files
    included), the centered weights in their own dtypes, an explicit untied
    head, and an ``enjoyln`` block in config.json. It loads with plain
    ``from_pretrained`` (the LNs are still there and see zero-mean inputs), or
    with ``enjoyln.load`` (the LNs run as RMSNorm).

    The fold is written to a temporary directory and checked there
    (``check``: ``"full"`` proves every weight and then compares outputs,
    ``"static"`` proves the weights only, ``"none"`` skips it); only a
    candidate that passes is renamed to OUT_DIR. A failing one raises
    ``CheckFailed`` and is removed, or kept beside OUT_DIR with
    ``keep_failed``.

    With ``fuse_affine`` the folded norms' affines move into their readers;
    with ``rotate`` (kind, seed, keep_mean) the residual stream is rotated too
    (see ``enjoyln.rotate``). Both compute tensors from other tensors: each is
    computed from the reference tensors it depends on as the writer reaches it
    (``StreamedTensors``), so memory stays a few of the largest tensors.

    >>> fold_checkpoint("gpt2-dir", "gpt2-folded").report.passed  # doctest: +SKIP
    True
    """
    start = time.perf_counter()
    rotate = RotationSpec.of(rotate)
    src, out = Path(model_dir), Path(out_dir)
    if out.is_symlink() or out.name in ("", ".."):
        # publishing renames OUT_DIR itself: a link would be replaced by a directory (its target
        # left stale), and '.' or '..' have no name to put a temporary directory beside
        out = out.resolve()
    if check not in CHECK_MODES:
        raise EnjoylnError(f"unknown check mode {check!r}; use one of {', '.join(CHECK_MODES)}")
    md = open_model_dir(src, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    if max_shard_size is not None and not source_of(md).shards:
        raise CheckpointError(f"{source_of(md).name} loads one weight file, model.safetensors, so this directory "
                              "is not re-sharded; drop --max-shard-size")
    check_out_dir(src, out, force, dry_run=dry_run)
    check_links(md)  # a file a loader reads, outside MODEL_DIR: refused before anything is written
    if check == "full" and not dry_run:
        require_memory(md, (check_options or {}).get("max_memory"))  # say so before anything is written
    cleaned = [] if dry_run else clean_stale(out)
    created = [] if dry_run else missing_dirs(out.parent)  # removed again unless OUT_DIR is published
    done, total, lock = [0], [0], threading.Lock()

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], max(total[0], done[0]))

    tmp: Path | None = None
    early: _EarlyCopy | None = None
    streamed: StreamedTensors | None = None
    try:
        # a plan that moves values rewrites nearly every tensor: nothing to copy ahead
        moving = fuse_affine or rotate is not None or (plan is not None and moves_values(plan))
        spans = _early_spans(md, max_shard_size) if not dry_run and not moving else {}
        if spans:  # copy while the model's code loads and the analysis runs; see _EarlyCopy
            total[0] = sum(length for _, _, length in spans.values())
            with signals_held():  # an interrupt must find tmp and early set, to clean them up
                tmp = temp_dir(out)
                early = _EarlyCopy(md, tmp, spans, advance)
        model = meta_model(md)
        if early is not None and not norm_module_paths(model):
            early.cancel()  # no norm module: almost surely nothing to fold, so stop copying now
            early, spans = None, {}
        if plan is not None:
            check_fits(model, plan)
        check_shapes(md, model)
        if plan is None:
            plan = _analyze(md, model, auxiliary_centering, fuse_affine, rotate)
        if rotate is not None and plan.rotation is None and not dry_run:
            why = plan.note(NOT_ROTATED) or "the plan has no rotation"
            raise EnjoylnError(f"{why}; nothing was written")
        if dry_run or not plan.foldable:
            return FoldResult(plan, None, [], 0, time.perf_counter() - start, cleaned=cleaned)
        prefix = getattr(model, "base_model_prefix", "") or ""
        if moves_values(plan):
            streamed = StreamedTensors(md, plan, model)
            entries = _moved_entries(md, streamed)
        else:
            pickled = load_pickled(md) if md.pickled else None
            entries = _plan_entries(md, plan, prefix, saved_names(model), pickled, model)
        shards = _reshard(entries, max_shard_size)
        bytes_out = sum(e.nbytes for _, es in shards for e in es)
        by_name = {name: shard for shard, (name, _, _) in spans.items()}
        layout = {name: _early_layout(md, by_name.get(name), entries) for name, entries in shards}
        with lock:  # what is left: whole shards written afresh; centered and appended tensors
            total[0] += sum(e.nbytes for name, es in shards for i, e in enumerate(es)
                            if layout[name] is None or i >= layout[name] or e.axis is not None)
        if tmp is None:
            with signals_held():
                tmp = temp_dir(out)
        write_start = time.perf_counter()
        followed: list[str] = []
        skipped = copy_extras(md, tmp, followed)
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
        stream_seconds = time.perf_counter() - write_start
        if streamed is not None:
            streamed.close()
            streamed = None
        if early is not None:
            early.cancel()
            stream_seconds += early.seconds_before(write_start)
        files = [name for name, _ in shards]
        if len(shards) > 1:
            # transformers takes the dtype from here when the config has none: the reference's
            index = {"metadata": {"total_size": bytes_out, "enjoyln": __version__, "dtype": load_dtype(md)[0]},
                     "weight_map": {e.name: name for name, es in shards for e in es}}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for name in files:  # the output must read back, or it is not published
            read_safetensors_header(tmp / name)
        report = None
        if check != "none":
            report = check_checkpoints(src, tmp, mode=check, plan=plan, allow_pickle=allow_pickle,
                                       trust_remote_code=trust_remote_code, **(check_options or {}))
            if not report.passed:
                kept = _keep_failed(tmp, out) if keep_failed else None
                tmp = None if kept else tmp
                where = (f"the candidate is kept in {kept}" if kept
                         else "pass --keep-failed to keep the candidate for inspection")
                raise CheckFailed(f"the folded model failed its check, so {out} was not written; {where}",
                                  report, kept)
        publish(tmp, out)
        tmp, created = None, []
    except OSError as exc:
        raise _os_error(exc, out, tmp) from None
    finally:
        if streamed is not None:
            streamed.close()
        if early is not None:
            early.cancel()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_dirs(created)
    return FoldResult(plan, out, files, bytes_out, time.perf_counter() - start, stream_seconds,
                      report=report, skipped=skipped, cleaned=cleaned, followed=followed)


def _early_spans(md: ModelDir, max_shard_size: int | None) -> dict[str, tuple[str, int, int]]:
    """Input shard -> (output file, data start, data length) for each shard that can be
    copied before the plan is known: safetensors, packed, and not re-sharded."""
    if md.pickled or max_shard_size is not None:
        return {}
    names = [name for name, _ in _reshard([(shard, []) for shard in md.shards], None)]
    return {shard: (name, *_packed_span(md, shard)) for shard, name in zip(md.shards, names)}


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


# --- loading ---------------------------------------------------------------------------------


def load(path: str | os.PathLike, *, allow_pickle: bool = False, trust_remote_code: bool = False,
         max_memory: int | None = None, offload_dir: str | os.PathLike | None = None,
         **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a folded directory and run its recorded LNs as ``enjoyln.RMSNorm``.

    A Hugging Face directory loads with ``from_pretrained`` (``from_pretrained_kwargs`` go
    there); a timm hub-format directory with ``timm.create_model`` (``dtype`` only).

    Auxiliary centerings recorded in the directory are installed again. A
    directory without an ``enjoyln`` block loads as it is. Custom code runs
    only with ``trust_remote_code=True``. With ``max_memory`` (bytes), at
    most that much of the weights stays in memory; accelerate reads the rest
    from the safetensors files (or ``offload_dir``) as each layer runs.

    >>> model = load("gpt2-folded", dtype="bfloat16")  # doctest: +SKIP
    """
    return _load(path, plain=False, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                 max_memory=max_memory, offload_dir=offload_dir, **from_pretrained_kwargs)


def load_plain(path: str | os.PathLike, *, allow_pickle: bool = False, trust_remote_code: bool = False,
               **from_pretrained_kwargs: Any) -> nn.Module:
    """What transformers' own ``from_pretrained`` gives for a directory, with the class chosen as
    ``load`` chooses it (custom code only with ``trust_remote_code``): a folded directory keeps
    its LayerNorms, which see zero-mean inputs.

    >>> model = load_plain("gpt2-folded")  # doctest: +SKIP
    """
    return _load(path, plain=True, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                 **from_pretrained_kwargs)


def _load(path: str | os.PathLike, *, plain: bool, allow_pickle: bool = False, trust_remote_code: bool = False,
          max_memory: int | None = None, offload_dir: str | os.PathLike | None = None,
          **from_pretrained_kwargs: Any) -> nn.Module:
    """``load``, or with ``plain`` what the library's own loader gives (transformers'
    ``from_pretrained``, timm's ``create_model``; the recorded LNs stay LayerNorms): the two ways
    a user may load a folded directory."""
    from .checking.static import recorded_plan

    md = open_model_dir(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    plan = recorded_plan(md)  # a malformed block is refused before the weights load
    if plain:
        plan = None
    try:
        model = source_of(md).load(md, trust_remote_code=trust_remote_code, max_memory=max_memory,
                                   offload_dir=offload_dir, **from_pretrained_kwargs)
    except EnjoylnError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot load {md.path}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    if plan is not None:
        plan.untied = []  # already untied and centered on disk: the centerings and the swap are left
        for step in (InsertCentering(), SwapLayerNorms()):
            step.check(model, plan)
        # non-persistent buffers (sinusoidal tables) are built afresh by the model: center them
        # (and rotate them) again
        center_all(model, [c for c in plan.centered if not c.saved])
        if plan.rotation is not None:
            from .transform.tensors import tensor_at

            with torch.no_grad():
                for rot in plan.rotation.rotated:
                    if not rot.saved:
                        apply_rotation(tensor_at(model, rot.param), rot, plan.rotation)
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



def available_memory() -> int | None:
    """Bytes this process could still allocate: free memory, capped by a cgroup limit; None if unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = int(Path(limit).read_text().split()[0]) - int(Path(usage).read_text().split()[0])
        except (OSError, ValueError, IndexError):  # "max", or no such controller
            continue
        avail = cap if avail is None else min(avail, cap)
    return avail


def built_bytes(md: ModelDir) -> tuple[int, int]:
    """(total, largest) bytes of what loading ``md`` builds: every parameter and buffer of the
    meta model, which knows them all without allocating any. That includes what the model makes
    from its config alone, stored nowhere (GPT-J's sinusoid table grows with n_positions).
    Floating parameters count in the dtype the model loads in; buffers in their own."""
    cached = getattr(md, "_built_bytes", None)
    if cached is not None:
        return cached
    model = meta_model(md)
    name = load_dtype(md)[0]
    dtype = getattr(torch, name, None)
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
    seen: set[int] = set()
    total = largest = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        is_param = isinstance(t, nn.Parameter)
        n = t.numel() * (size if is_param and t.is_floating_point() else t.element_size())
        total, largest = total + n, max(largest, n)
    md._built_bytes = (total, largest)  # type: ignore[attr-defined]  # the meta model takes a while to build
    return total, largest


_WIDER = {"F16": 4, "BF16": 4, "F32": 8}
"""Bytes per element of the truth (the reference in the next wider dtype) for each stored dtype."""


def truth_bytes(md: ModelDir) -> int:
    """The reference's weights in the next wider dtype, which the precision-aware criterion runs
    (float64 for float32, float32 for half precision; nothing for float64)."""
    if md.pickled:  # no header to read dtypes from: take float32, the usual
        return 2 * md.nbytes
    return sum(t.nbytes // _DTYPES[t.dtype].itemsize * _WIDER[t.dtype]
               for t in md.tensors.values() if t.dtype in _WIDER)


def _truth_ratio(md: ModelDir) -> float:
    """How much wider the truth's tensors are than the reference's: 2, or 1 without a truth."""
    dtype = _CODES.get(_dominant_dtype(md))
    return _WIDER[dtype] / _DTYPES[dtype].itemsize if dtype in _WIDER else 1.0


def forward_check_bytes(md: ModelDir) -> int:
    """What the forward comparison needs with both models in memory: both models as loading builds
    them, the reference's truth in the next wider dtype (held with them), and room for activations."""
    n = max(md.nbytes, built_bytes(md)[0])
    truth = truth_bytes(md) * n / max(md.nbytes, 1)  # what the model builds is widened too
    return int(2.1 * n + truth) + (256 << 20)


def _largest_tensor(md: ModelDir) -> int:
    return max(max((t.nbytes for t in md.tensors.values()), default=0), built_bytes(md)[1])


def _activation_bytes(md: ModelDir) -> int:
    """A generous bound on one forward's largest live tensors with one row of the coverage
    batch: the logits over the vocabulary, or a few hidden states."""
    from .checking.forward import MAX_COVER_POSITIONS

    cfg = md.config
    length = min(int(config_value_dict(cfg, "max_position_embeddings", "n_positions") or 512), MAX_COVER_POSITIONS)
    hidden = int(config_value_dict(cfg, "hidden_size", "n_embd", "d_model") or 1024)
    width = max(int(config_value_dict(cfg, "vocab_size") or 0), 4 * hidden)
    return length * width * 4 + (32 << 20)


def config_value_dict(config: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` in a raw config.json, or in one of its sub-configs."""
    for cfg in (config, *(config.get(s) for s in ("text_config", "decoder", "encoder", "vision_config"))):
        if isinstance(cfg, dict):
            for name in names:
                if isinstance(cfg.get(name), (int, float)) and not isinstance(cfg.get(name), bool):
                    return cfg[name]
    return None


MIN_BUDGET = 16 << 20


def bounded_budget(md: ModelDir) -> int | None:
    """None if the forward check fits with both models in memory; else the budget for a check that
    runs them one at a time, offloading weights, within half of what is available."""
    need, have = forward_check_bytes(md), available_memory()
    if have is None or need <= have:
        return None
    return have // 2


def require_memory(md: ModelDir, max_memory: int | None = None) -> None:
    """Refuse, before anything is written, a forward check that cannot run even one model at a time."""
    from .plan import format_bytes

    have = available_memory()
    budget = max_memory if max_memory is not None else bounded_budget(md)
    if budget is None:
        return
    wide = _truth_ratio(md)  # the truth runs too, one model at a time, in a wider dtype
    floor = int(wide * (_largest_tensor(md) + _activation_bytes(md))) + MIN_BUDGET
    if budget < floor or (have is not None and floor > have):
        limit = (f"--max-memory allows {format_bytes(budget)}" if max_memory is not None and budget < floor
                 else f"{format_bytes(have)} is available" if have is None or floor > have
                 else f"the budget is {format_bytes(budget)} (half of the {format_bytes(have)} available)")
        raise CheckpointError(f"the forward check needs at least {format_bytes(floor)} of memory even with one "
                              f"model at a time, but {limit}; pass --static to prove every weight without "
                              "running the model (or --no-check)")


def _dominant_dtype(md: ModelDir) -> torch.dtype:
    by_bytes: dict[str, int] = {}
    for t in md.tensors.values():
        if _DTYPES[t.dtype].is_floating_point:
            by_bytes[t.dtype] = by_bytes.get(t.dtype, 0) + t.nbytes
    return _DTYPES[max(by_bytes, key=by_bytes.get)] if by_bytes else torch.float32


def check_checkpoints(reference_dir: str | os.PathLike, candidate_dir: str | os.PathLike, *,
                      allow_pickle: bool = False, trust_remote_code: bool = False, mode: str = "full",
                      plan: FoldPlan | None = None, progress: Progress | None = None,
                      max_memory: int | None = None, dtype: Any = None, thorough: bool = False,
                      **check_kwargs: Any) -> "CheckReport":
    """Prove CANDIDATE computes what REFERENCE does: every weight, then the outputs.

    ``mode="full"`` (the default) first runs the static check (every tensor
    of the candidate is the fold plan applied to the reference; see
    ``enjoyln.checking.static``), then loads both and confirms that their
    outputs agree with ``enjoyln.check``: a few short batches and a greedy
    decode, since the weights are already proven. ``thorough`` adds a batch
    that covers every position and thousands of token ids, as ``"forward"``
    always does (its weights unproven, the outputs are all the proof). ``"static"``
    stops after the weights; ``"forward"`` skips them (for candidates made
    by other tools). The candidate runs both ways a user may load it: through
    ``enjoyln.load`` (its RMSNorms) and through plain ``from_pretrained``
    (transformers' own class); the reference also runs in the next wider dtype,
    the truth of the precision-aware criterion. With ``max_memory`` (bytes), or
    automatically when the models would not fit in memory together, they run
    one at a time with offloaded weights (see ``_bounded_check``).

    The candidate must load in the reference's dtype; ``dtype`` (``"float16"``)
    names another one it is meant to run in, and it is then judged at that
    precision (the half-precision criterion of ``enjoyln.check``).

    >>> check_checkpoints("gpt2-dir", "gpt2-folded").passed  # doctest: +SKIP
    True
    """
    from .checking.forward import ModelSource, check_sources
    from .checking.report import CheckReport
    from .checking.static import StaticReport, code_problems, code_report, load_problems, parse_dtype, static_check

    if mode not in ("full", "static", "forward"):
        raise EnjoylnError(f"unknown check mode {mode!r}; use full, static or forward")
    dtype = parse_dtype(dtype)
    ref_md = open_model_dir(reference_dir, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    cand_md = open_model_dir(candidate_dir, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    if ref_md.architecture != cand_md.architecture:
        raise CheckpointError(f"{reference_dir} is a {ref_md.architecture} but {candidate_dir} is a "
                              f"{cand_md.architecture}")
    if code := code_problems(ref_md, cand_md):  # before anything imports the candidate's code
        report = CheckReport.from_static(code_report(code), forward_skipped=True)
        report.forward_skipped = "the candidate's code is not the reference's, so none of it was run"
        return report
    auto = max_memory is None
    if max_memory is None and mode != "static":
        # the candidate's own config decides what it builds (with --forward-only, whatever it says)
        max_memory = bounded_budget(ref_md)
        max_memory = max_memory if max_memory is not None else bounded_budget(cand_md)
    if mode != "static":
        require_memory(ref_md, max_memory)  # before the weights are read, not after
        require_memory(cand_md, max_memory)
    static = None
    if mode != "forward":
        static = static_check(ref_md, cand_md, plan=plan, progress=progress, dtype=dtype)
        if mode == "static" or not static.passed:
            return CheckReport.from_static(static, forward_skipped=mode != "static")
    elif problems := load_problems(ref_md, cand_md, dtype):  # no weight check, but the same dtype
        report = CheckReport.from_static(StaticReport(passed=False, problems=problems, scope="load settings"),
                                         forward_skipped=True)
        report.forward_skipped = "the candidate does not load as the reference does"
        return report
    if mode == "full" and not thorough:
        check_kwargs = {**check_kwargs, "coverage": False}
    plain_required, caveat, note = _plain_loading(cand_md, verified=mode == "full")
    kwargs = {"allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code}
    if max_memory is None:
        reference, candidate = load(reference_dir, **kwargs), load(candidate_dir, **kwargs)
        ref_src, cand_src = ModelSource.of(reference), ModelSource.of(candidate)
        # the truth and the plain load come from disk, each dropped after its run
        truth = ModelSource(ref_src.dtype, lambda dtype: load(reference_dir, dtype=dtype, **kwargs))
        plain = ModelSource(cand_src.dtype, lambda dtype: _load(candidate_dir, plain=True, dtype=dtype, **kwargs))
        report = check_sources(ref_src, cand_src, truth=truth, **_path_kwargs(plain, plain_required, cand_md),
                               **check_kwargs)
    else:
        report = _bounded_check(ref_md, cand_md, max_memory, kwargs, check_kwargs, plain_required)
        report.memory = (f"{'the two models would not fit in memory side by side, so ' if auto else ''}"
                         f"the models ran one at a time within {format_bytes(max_memory)} "
                         "(weights beyond it read from disk as each layer ran)")
    report.caveat = caveat if plain_required is False else ""
    report.notes += [note] if note else []
    if check_kwargs.get("coverage") is False:
        report.notes.append("the static part proved every weight, so the forward part confirmed it on short "
                            "batches; --thorough also runs a batch over every position and many token ids")
    report.add_static(static)
    return report


def _path_kwargs(plain: Any, required: bool | None, md: ModelDir) -> dict[str, Any]:
    """The candidate's load paths for ``check_sources``: ``enjoyln.load``, and its library's plain
    loader (``from_pretrained``, ``timm.create_model``) unless the two are the same (no ``enjoyln``
    block: ``required`` None)."""
    from .checking.forward import CandidatePath

    others = [] if required is None else [CandidatePath(source_of(md).loader, plain, required)]
    return {"candidate_path": "enjoyln.load", "other_paths": others}


def _plain_loading(md: ModelDir, *, verified: bool) -> tuple[bool | None, str, str]:
    """Whether plain ``from_pretrained`` of the candidate must match the reference: (required,
    the verdict's caveat, a note). None: no ``enjoyln`` block, so ``enjoyln.load`` is plain loading.

    Only a rotation without ``keep_mean`` is inexact under plain loading, and only a block that
    says so twice (the rotation's ``keep_mean`` and ``plain_loading_exact`` both false) is
    believed: a block claiming exactness anywhere gets the plain path held to it. Without the
    static check (``verified`` False) nothing proves the block, so the verdict says what it
    leaves out."""
    from .checking.static import recorded_plan

    plan = recorded_plan(md)
    if plan is None:
        return None, "", "the candidate has no enjoyln block, so enjoyln.load is plain from_pretrained"
    block = md.config["enjoyln"].get("rotation")
    declared = (plan.rotation is not None and not plan.rotation.keep_mean and isinstance(block, dict)
                and block.get("keep_mean") is False and block.get("plain_loading_exact") is False)
    if not declared:
        return True, "", ""
    if verified:
        return False, "", ("plain from_pretrained is reported but not required: the candidate is a rotation "
                           "without keep_mean, which the static check verified, so its LayerNorms do not see "
                           "a zero-mean stream")
    return False, ("judged through enjoyln.load only: the candidate's enjoyln block declares a rotation without "
                   "keep_mean, under which plain from_pretrained is not exact, and --forward-only does not "
                   "verify that declaration; run the full check"), ""


def _bounded_check(ref_md: ModelDir, cand_md: ModelDir, max_memory: int, load_kwargs: dict[str, Any],
                   check_kwargs: dict[str, Any], plain_required: bool | None = True) -> "CheckReport":
    """The forward check holding one model at a time, with at most ``max_memory`` for it.

    accelerate's big-model inference keeps part of the weights in memory and
    reads the rest from the safetensors files as each layer runs. Out of the
    budget come the largest tensor (loaded whole when its layer runs) and one
    forward's activations, both twice as wide for the truth (the reference in
    the next wider dtype); the reference's outputs wait on disk.
    """
    from .checking.forward import ModelSource, check_sources

    if ref_md.pickled or cand_md.pickled:
        raise CheckpointError("a check within a memory budget reads weights from safetensors files; convert "
                              "pickle weights first, or pass --static")
    if not source_of(ref_md).bounded_loading:
        raise CheckpointError(f"{source_of(ref_md).name} loads a model whole, so the check cannot run within a "
                              "memory budget; pass --static to prove every weight without running the model")
    return_freed_memory()
    overhead = _largest_tensor(ref_md) + _activation_bytes(ref_md)

    def source(md: ModelDir, offload: Path, plain: bool = False) -> ModelSource:
        # the dtype a plain from_pretrained loads it in, which the static check compared
        own = getattr(torch, load_dtype(md)[0], None)
        own = own if isinstance(own, torch.dtype) and own.is_floating_point else _dominant_dtype(md)

        def get(dtype: torch.dtype) -> nn.Module:
            wide = dtype.itemsize / own.itemsize  # the truth: wider tensors, less room
            weights = max(max_memory - int(max(wide, 1.0) * overhead), 0)
            kwargs = dict(dtype=dtype, max_memory=weights, offload_dir=offload / str(dtype), **load_kwargs)
            return _load(md.path, plain=True, **kwargs) if plain else load(md.path, **kwargs)
        return ModelSource(own, get)

    with tempfile.TemporaryDirectory(prefix="enjoyln-offload-") as off:
        ref_src = source(ref_md, Path(off) / "reference")
        paths = _path_kwargs(source(cand_md, Path(off) / "plain", plain=True), plain_required, cand_md)
        return check_sources(ref_src, source(cand_md, Path(off) / "candidate"), truth=ref_src,
                             spill=True, max_rows=1, **paths, **check_kwargs)
