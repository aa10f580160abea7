"""Reading a checkpoint's tensors one at a time: ``read`` into memory of its own, ``mapped``
read-only from the file, no copy, for the C kernels that compare and center
(docs/performance.md)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from ..errors import CheckpointError
from .checkpoint import Checkpoint
from .formats import DTYPES, TensorInfo

READ_AHEAD = 512 << 20
"""The largest job (in bytes) read while the one before it is still in use."""

J = TypeVar("J")
R = TypeVar("R")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # no mmap here (Windows): every tensor is read instead
        return None


_LIBC = _libc() if hasattr(mmap, "MAP_SHARED") else None
_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_WRITE = 23


class Mapped(contextlib.AbstractContextManager):
    """One tensor's bytes mapped from its file (the page cache's own pages) until ``close``; a file
    truncated meanwhile ends the process with SIGBUS, as for every loader that maps
    safetensors."""

    def __init__(self, fd: int, start: int, nbytes: int, *, writable: bool = False) -> None:
        page = mmap.ALLOCATIONGRANULARITY
        self._base = start - start % page
        self._length = start + nbytes - self._base
        self.nbytes = nbytes
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        addr = _LIBC.mmap(None, self._length, prot, mmap.MAP_SHARED, fd, self._base)
        if addr in (None, _FAILED):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._addr = addr
        self.address = addr + start - self._base
        if (
            writable
        ):  # every page made writable in one call, not one fault each (Linux 5.14+), and its
            # blocks reserved: a full disk is an error here, not a SIGBUS later; an older kernel
            # says EINVAL
            if _LIBC.madvise(addr, self._length, _MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                self.close()
                raise OSError(err, os.strerror(err))
        elif hasattr(mmap, "MADV_SEQUENTIAL"):  # read front to back, once: read ahead, drop behind
            _LIBC.madvise(addr, self._length, mmap.MADV_SEQUENTIAL)

    @classmethod
    def available(cls) -> bool:
        return _LIBC is not None

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes as a tensor, valid until ``close``: drop it first."""
        raw = (ctypes.c_char * self.nbytes).from_address(self.address)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)

    def release(self) -> None:
        """Drop the pages read so far from the process (not from the page cache): a large tensor
        read a piece at a time then holds one piece, not all it has read."""
        if self._addr is not None and hasattr(mmap, "MADV_DONTNEED"):
            _LIBC.madvise(self._addr, self._length, mmap.MADV_DONTNEED)

    def close(self) -> None:
        if self._addr is not None:
            _LIBC.munmap(self._addr, self._length)
            self._addr = None

    def __exit__(self, *exc: object) -> None:
        self.close()


class Buffer:
    """A reusable buffer: fresh memory costs a page fault per page on first touch."""

    def __init__(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)

    def bytes(self, nbytes: int) -> torch.Tensor:
        if self.data.numel() < nbytes:
            self.data = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.data = torch.empty(nbytes, dtype=torch.uint8)
        return self.data[:nbytes]


class TensorReader:
    """The tensors of one model directory by checkpoint key.

    >>> reader = TensorReader(open_checkpoint("gpt2"))  # doctest: +SKIP
    >>> reader.read("wte.weight").shape  # doctest: +SKIP
    torch.Size([50257, 768])
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.ck = checkpoint
        self.pickled = (
            {k: t for k, (_, t) in checkpoint.pickled_tensors.items()}
            if checkpoint.pickled
            else None
        )
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def dtype(self, key: str) -> torch.dtype:
        return (
            self.pickled[key].dtype
            if self.pickled is not None
            else DTYPES[self.ck.tensors[key].dtype]
        )

    def shape(self, key: str) -> tuple[int, ...]:
        return (
            tuple(self.pickled[key].shape)
            if self.pickled is not None
            else self.ck.tensors[key].shape
        )

    def nbytes(self, key: str) -> int:
        return math.prod(self.shape(key)) * self.dtype(key).itemsize

    def offset(self, key: str) -> tuple[str, int]:
        """Where the tensor sits (file, byte): reading in this order reads each file front to
        back."""
        if self.pickled is not None:
            return "", 0
        info = self.ck.tensors[key]
        return info.file, info.start

    def _fd(self, info: TensorInfo) -> int:
        with self._lock:  # the read-ahead thread and the caller may open a file at once
            if info.file not in self._fds:
                self._fds[info.file] = os.open(self.ck.path / info.file, os.O_RDONLY)
            return self._fds[info.file]

    def read(self, key: str, into: Buffer | None = None) -> torch.Tensor:
        """The tensor as stored, in memory of its own (``into``'s, until its next use) the caller
        may change."""
        if self.pickled is not None:
            return self.pickled[key].clone()
        info = self.ck.tensors[key]
        dtype = DTYPES[info.dtype]
        if not info.nbytes:
            return torch.empty(info.shape, dtype=dtype)
        data = (
            into.bytes(info.nbytes)
            if into is not None
            else torch.empty(info.nbytes, dtype=torch.uint8)
        )
        view, got, fd = memoryview(data.numpy()), 0, self._fd(info)
        while got < info.nbytes:
            n = os.preadv(fd, [view[got:]], info.start + got)
            if not n:
                raise CheckpointError(f"{self.ck.path / info.file} ended early")
            got += n
        with self._lock:
            self.bytes_read += info.nbytes
        return data.view(dtype).view(info.shape)

    def mappable(self, key: str) -> bool:
        return _LIBC is not None and self.pickled is None and self.ck.tensors[key].nbytes > 0

    def mapped(self, key: str) -> Mapped:
        """The tensor's bytes mapped read-only (check ``mappable`` first); the caller closes it."""
        info = self.ck.tensors[key]
        fd = self._fd(info)
        if os.fstat(fd).st_size < info.start + info.nbytes:
            raise CheckpointError(
                f"{self.ck.path / info.file} ended early: it changed while it was being read"
            )
        m = Mapped(fd, info.start, info.nbytes)
        with self._lock:
            self.bytes_read += info.nbytes
        return m

    def prefetch(self, key: str) -> None:
        """Ask the kernel to start reading the tensor into the page cache now."""
        if self.pickled is None and hasattr(os, "posix_fadvise"):
            info = self.ck.tensors[key]
            try:
                os.posix_fadvise(self._fd(info), info.start, info.nbytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_ahead(
    jobs: Iterable[J], load: Callable[[J], R], size: Callable[[J], int]
) -> Iterator[tuple[J, R]]:
    """``(job, load(job))`` in order; the next job's ``load`` (if at most ``READ_AHEAD``) runs in a
    thread while the caller works on this one (``preadv`` releases the GIL). A load's exception
    is raised in order."""
    jobs = list(jobs)
    # leaving the block (GeneratorExit too) waits for a running read: files are never closed under
    # it
    with ThreadPoolExecutor(1, thread_name_prefix="enjoyln-read-ahead") as pool:
        ahead: Future | None = None
        for i, job in enumerate(jobs):
            value = ahead.result() if ahead is not None else load(job)
            nxt = jobs[i + 1] if i + 1 < len(jobs) else None
            ahead = pool.submit(load, nxt) if nxt is not None and size(nxt) <= READ_AHEAD else None
            yield job, value
            del value


def return_freed_memory() -> None:
    """Make glibc hand large freed blocks back at once: offloaded layers load and free the same
    large tensors over and over, which with glibc's adaptive threshold fragment the heap (near
    twice the budget)."""
    mallopt = getattr(_LIBC, "mallopt", None)  # glibc's and musl's; none on Windows
    if mallopt is not None:
        mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
