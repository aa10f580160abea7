"""The streaming writer: safetensors shards written tensor by tensor (unchanged ones copied by the
kernel, centered ones through one reused buffer, computed ones from their own memory), and the early
copy of the input's weight files while the analysis runs."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import CheckpointError
from ..store.checkpoint import Checkpoint
from ..store.formats import DTYPES
from ..store.tensors import Buffer, Mapped, TensorReader
from ..transform.tensors import center_, center_into
from .entries import Entry, reshard


WRITE_STEP = 256 << 10
"""The most one write() carries. The page cache builds a new file's pages in folios as large as
the write asks; a large folio takes a large free block, which on a virtual machine that reports its
free memory to the host is the kind the host took back, so the guest then faults on every page of
it (measured here: 1.6 GB in 0.5 s by writes of 256 KiB, 6-8 s by writes of 64 MiB or by a mapping's
page faults)."""


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view[:WRITE_STEP], offset)
        view, offset = view[n:], offset + n


def _pwrite_runs(fd: int, data: memoryview, at: int, runs: list[tuple[int, int, int]]) -> None:
    for offset, start, nbytes in runs:
        _pwrite_all(fd, data[start : start + nbytes], at + offset)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "a weight file"


def _copy_range(
    src: int,
    dst: int,
    start: int,
    count: int,
    at: int,
    advance: Callable[[int], None],
    stop: threading.Event,
) -> None:
    """``count`` bytes from ``src`` at ``start`` to ``dst`` at ``at``, in the kernel if possible."""
    while count and not stop.is_set():
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
            raise CheckpointError(
                f"{_fd_path(src)} ended early: it changed while it was being read"
            )
        start, at, count = start + n, at + n, count - n
        advance(n)


def _header_json(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    return json.dumps(header, separators=(",", ":")).encode()


@dataclass
class Writing:
    """What every shard the fold writes shares."""

    reader: TensorReader
    metadata: dict[str, str]
    advance: Callable[[int], None]
    buffer: Buffer = field(default_factory=Buffer)
    computed: tuple[Buffer, Buffer] = field(default_factory=lambda: (Buffer(), Buffer()))
    """Memory computed tensors take turns in: fresh pages cost a fault each, written or read."""


def write_shard(file: Path, entries: list[Entry], w: Writing, *, made: int = 0) -> None:
    """Write one safetensors file tensor by tensor (safetensors' own writer needs them all in
    memory). ``made``: ``file`` exists with its first ``made`` bytes' pages in the page cache
    (``EarlyPages``); it is written over, not truncated first, every byte of it rewritten and its
    size set."""
    blob = _header_json(entries, w.metadata)
    header = blob + b" " * (-len(blob) % 8)
    _write_entries(file, "r+b" if made else "w+b", entries, w, header, made=made)


_HEADER_ROOM = 4096
"""Room the early copy leaves for a shard's header to grow; a whole page, so the data keeps its
alignment."""


class EarlyCopy:
    """Copies the input's weight files into the output while the analysis runs (CPU and I/O
    overlap), at the input's offsets plus ``_HEADER_ROOM``; ``finish_shard`` then centers in
    place behind the copy."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        tmp: Path,
        spans: dict[str, tuple[str, int, int]],
        advance: Callable[[int], None],
    ) -> None:
        self.ck, self.tmp, self.spans, self.advance = checkpoint, tmp, spans, advance
        self.reached: dict[
            str, int
        ] = {}  # shard -> output offset its copy has written up to (done: sys.maxsize)
        self.progress = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.started, self.finished = time.perf_counter(), None
        self.thread = threading.Thread(target=self._run, name="enjoyln-early-copy", daemon=True)
        self.thread.start()

    def seconds_before(self, moment: float) -> float:
        end = self.finished if self.finished is not None else time.perf_counter()
        return max(0.0, min(end, moment) - self.started)

    def _reach(self, shard: str, offset: int) -> None:
        with self.progress:
            self.reached[shard] = offset
            self.progress.notify_all()

    def _run(self) -> None:
        try:
            for shard, (name, base, length) in self.spans.items():
                with (
                    open(self.ck.path / shard, "rb", buffering=0) as src,
                    open(self.tmp / name, "wb", buffering=0) as dst,
                ):
                    at = base + _HEADER_ROOM
                    self._reach(shard, at)

                    def step(n: int, shard: str = shard) -> None:
                        self.advance(n)
                        self._reach(shard, self.reached[shard] + n)

                    _copy_range(src.fileno(), dst.fileno(), base, length, at, step, self.stop)
                if self.stop.is_set():
                    return
                self._reach(shard, sys.maxsize)
        except BaseException as exc:  # reported by wait(), in the thread that can act on it
            self.error = exc
        finally:
            with self.progress:
                self.finished = time.perf_counter()
                self.stop.set()
                self.progress.notify_all()

    def wait(self, shard: str, upto: int | None = None) -> None:
        """Block until ``shard`` is copied (or up to output offset ``upto``); raise what the copy
        raised."""

        def ready() -> bool:
            return self.reached.get(shard, -1) >= (sys.maxsize if upto is None else upto)

        with self.progress:
            self.progress.wait_for(lambda: ready() or self.finished is not None)
            if ready():
                return
        if self.error is not None:
            raise self.error
        raise RuntimeError(f"the early copy of {shard} was stopped")

    def cancel(self) -> None:
        self.stop.set()
        self.thread.join()


def finish_shard(
    file: Path, entries: list[Entry], w: Writing, early: EarlyCopy, shard: str
) -> bool:
    """Turn the early copy of the input's ``shard`` into ``file``; False, untouched, if its header
    would not fit. Tensors are centered as soon as the copy is past them. The copy may still be
    writing the shard's tail when this returns."""
    blob = _header_json(entries, w.metadata)
    start = early.spans[shard][1] + _HEADER_ROOM
    if len(blob) > start - 8:
        return False
    sourceless = [e.name for e in entries if e.source is None]
    if sourceless:  # only pickle input lacks a source, and never comes here
        raise AssertionError(sourceless[0])
    early.wait(shard, start)  # the copy has created the file: its truncation is behind us
    # JSON allows trailing spaces; safetensors pads this way too
    header = blob + b" " * (start - 8 - len(blob))
    # the pages are the early copy's
    _write_entries(file, "r+b", entries, w, header, (early, shard), made=sys.maxsize)
    return True


def _write_entries(
    file: Path,
    mode: str,
    entries: list[Entry],
    w: Writing,
    header: bytes,
    early: tuple[EarlyCopy, str] | None = None,
    *,
    made: int = 0,
) -> None:
    """The entries after ``header``: those copied unchanged by the kernel on a second thread while
    this one centers or computes the others; with ``early``, those its copy of the input shard
    put in place are centered there, each once the copy is past it. A tensor is computed straight
    into the file's pages where they exist (the first ``made`` bytes): a mapping would make new
    ones in large folios (see ``WRITE_STEP``)."""
    *positions, end = itertools.accumulate((e.nbytes for e in entries), initial=8 + len(header))
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(file, mode, buffering=0)).fileno()
        fds = {
            f: stack.enter_context(open(w.reader.ck.path / f, "rb", buffering=0)).fileno()
            for f in dict.fromkeys(e.source.file for e in entries if e.source is not None)
        }
        os.ftruncate(
            out, end
        )  # the final size first, so that the two threads below never race on it
        placed = _placed(entries, positions, early)
        copies = [
            (fds[e.source.file], e.source.start, e.nbytes, at)
            for e, at, here in placed
            if not here and e.axis is None and e.tensor is None and e.compute is None
        ]
        computed = 0
        with _copying_alongside(out, copies, w.advance), _WriteBehind(out) as behind:
            for e, at, here in placed:
                if e.axis is None and (here or (e.tensor is None and e.compute is None)):
                    continue  # in place already, or copied alongside
                if here:  # its bytes were counted as the early copy wrote them
                    early[0].wait(early[1], at + e.nbytes)
                    if _center_in_file(out, at, e):
                        continue
                if (
                    e.into_file
                    and not e.pieces
                    and at + e.nbytes <= made
                    and _into_file(out, at, e)
                ):
                    w.advance(e.nbytes)
                    continue
                if e.pieces is not None:  # too large to hold: computed and written by pieces
                    _write_pieces(e, at, w, behind)
                    continue
                if e.compute is not None:  # computed now, written from its own memory, dropped
                    t, computed = _computed(e, w, computed)
                    if e.axis is None and behind.write(t, at):
                        w.advance(e.nbytes)
                        continue
                    behind.wait()
                elif e.tensor is not None:  # pickle input: centered in the buffer, never in place
                    t = w.buffer.bytes(e.nbytes).view(DTYPES[e.dtype]).view(e.shape).copy_(e.tensor)
                else:
                    t = w.reader.read(e.source.name, w.buffer)
                _center_and_write(out, at, t, e)
                del t
                if not here:
                    w.advance(e.nbytes)
        _pwrite_all(out, memoryview(struct.pack("<Q", len(header)) + header), 0)


def _placed(
    entries: list[Entry], positions: list[int], early: tuple[EarlyCopy, str] | None
) -> list[tuple[Entry, int, bool]]:
    """Each entry, its offset, and whether the early copy put its bytes there (judged by the input
    shard, not the output's other name)."""
    return [
        (
            e,
            at,
            early is not None and e.source.start + _HEADER_ROOM == at and e.source.file == early[1],
        )
        for e, at in zip(entries, positions)
    ]


def _write_pieces(e: Entry, at: int, w: Writing, behind: "_WriteBehind") -> None:
    """A tensor too large to hold, computed and written behind a piece at a time."""
    behind.wait()  # the pieces take the two buffers in turn from the first
    for piece, t in e.pieces(w.computed):
        behind.write_runs(t, at, piece.runs(t.element_size()))
    behind.wait()
    w.advance(e.nbytes)


def _computed(e: Entry, w: Writing, turn: int) -> tuple[torch.Tensor, int]:
    """``e`` computed, and the next turn of the writer's two buffers: one is written behind while
    the other fills; a tensor too large to be written behind gets memory freed once written."""
    behind_it = e.nbytes <= WRITE_BEHIND_BYTES
    t = e.compute(w.computed[turn % 2] if behind_it else None).contiguous()
    if t.dtype != DTYPES[e.dtype] or t.numel() * t.element_size() != e.nbytes:
        raise AssertionError(f"{e.name} was computed as {t.dtype} {list(t.shape)}")
    return t, turn + behind_it


def _into_file(out: int, at: int, e: Entry) -> bool:
    """``e`` computed straight into the output file's pages, mapped (no copy into the page cache
    after); False, nothing written, where the file cannot be mapped so."""
    try:
        mapped = Mapped(out, at, e.nbytes, writable=True)
    except OSError:
        return False
    with mapped:
        e.into_file(mapped.tensor(DTYPES[e.dtype], e.shape))
    return True


@contextlib.contextmanager
def _copying_alongside(
    out: int, copies: list[tuple[int, int, int, int]], advance: Callable[[int], None]
) -> Iterator[None]:
    """Kernel copies (source fd, start, count, output offset) into ``out`` on a second thread while
    the block runs."""
    stop = threading.Event()

    def run() -> None:
        for src, start, count, at in copies:
            _copy_range(src, out, start, count, at, advance, stop)

    with ThreadPoolExecutor(1) as pool:
        copying = pool.submit(run)
        try:
            yield
        except BaseException:
            stop.set()
            copying.exception()
            raise
        copying.result()


WRITE_BEHIND_BYTES = 256 << 20
"""A computed tensor up to this size is written on a second thread while the next one is computed
(the page cache can stall a write for as long as the computing takes); a larger one is written in
turn, so that two of them are never in memory at once."""


class _WriteBehind(contextlib.AbstractContextManager):
    """Writes of computed tensors into ``out`` on a thread of their own, one at a time; leaving the
    block waits for the last and raises what it raised."""

    def __init__(self, out: int) -> None:
        self.out, self.pool, self.pending = (
            out,
            ThreadPoolExecutor(1, thread_name_prefix="enjoyln-write"),
            None,
        )

    def write(self, t: torch.Tensor, at: int) -> bool:
        """``t``'s bytes to ``at`` behind the caller's back (``t`` is not changed after); False,
        nothing done, for a tensor over ``WRITE_BEHIND_BYTES``."""
        nbytes = t.numel() * t.element_size()
        if nbytes > WRITE_BEHIND_BYTES:
            return False
        self.wait()
        # the array keeps the tensor alive until its bytes are written
        view = memoryview(t.view(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
        self.pending = self.pool.submit(_pwrite_all, self.out, view, at)
        return True

    def write_runs(self, t: torch.Tensor, at: int, runs: Iterable[tuple[int, int, int]]) -> None:
        """The runs of ``t``'s bytes (offset from ``at``, offset in ``t``, bytes) behind the
        caller's back, as ``write``."""
        self.wait()
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        self.pending = self.pool.submit(_pwrite_runs, self.out, data, at, list(runs))

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait()
            elif self.pending is not None:
                # never leave a write running into a file that is closed next
                self.pending.exception()
        finally:
            self.pool.shutdown()


def _center_and_write(out: int, at: int, t: torch.Tensor, e: Entry) -> None:
    """Write ``t`` at ``at`` in the entry's dtype (a tensor stored narrower than it loads is
    centered in the wider one), centered first if the entry says so."""
    t = t.to(DTYPES[e.dtype])
    view = memoryview(t.view(-1).view(torch.uint8).numpy()) if e.nbytes else memoryview(b"")
    if e.axis is not None:
        center_(t, e.axis, e.groups, e.scale, e.blocks)
    _pwrite_all(out, view, at)


def _center_in_file(out: int, at: int, e: Entry) -> bool:
    """Center the copied tensor where it lies, through a writable mapping (only the page cache's
    pages change: 4 GB/s against 1.5 through a buffer); False where that cannot be done."""
    if not e.nbytes or not Mapped.available():
        return False
    try:
        m = Mapped(out, at, e.nbytes, writable=True)
    except (
        OSError
    ):  # not mappable here, or no room for the blocks (which the plain write then reports)
        return False
    with m:
        t = m.tensor(DTYPES[e.dtype], e.shape)
        done = center_into(t.data_ptr(), t, e.axis, e.groups, e.scale, e.blocks)
        del t  # never used after the mapping goes
    return done


def early_spans(
    checkpoint: Checkpoint, max_shard_size: int | None
) -> dict[str, tuple[str, int, int]]:
    """Input shard -> (output file, data start, data length) for each shard copied before the plan
    is known."""
    if checkpoint.pickled or max_shard_size is not None:
        return {}
    names = [
        name
        for name, _ in reshard(
            [(shard, []) for shard in checkpoint.shards], None, indexed=checkpoint.index is not None
        )
    ]
    spans = {}
    for shard, name in zip(checkpoint.shards, names):
        size = (
            (checkpoint.path / shard).stat().st_size
        )  # validation proved the tensors tile the data up to the end
        start = min((t.start for t in checkpoint.tensors.values() if t.file == shard), default=size)
        spans[shard] = (name, start, size - start)
    return spans


def early_layout(checkpoint: Checkpoint, shard: str | None, entries: list[Entry]) -> int | None:
    """How many leading ``entries`` sit where the early copy of ``shard`` put them (all its
    tensors), or None."""
    if shard is None:
        return None
    inputs = sorted(
        (t for t in checkpoint.tensors.values() if t.file == shard), key=lambda t: (t.start, t.end)
    )
    if len(entries) < len(inputs) or any(
        e.source is not t or e.name != t.name or e.tensor is not None or e.dtype != t.dtype
        for e, t in zip(entries, inputs)
    ):
        return None
    return len(inputs)
