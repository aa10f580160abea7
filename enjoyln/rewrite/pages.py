"""The output's page-cache pages made while the analysis runs, for a plan that rewrites most of the
weights (docs/performance.md).

Writing a new file costs the kernel a page of its cache per 4 KiB; on a virtual machine it can
cost the host a fault as well. The analysis keeps one core busy and leaves the other idle, so the
pages are made there, ahead of the writer, which then computes straight into them through a
mapping (a mapping's own page faults would make them in large folios: see
``writer.WRITE_STEP``). Linux only (/dev/zero and sendfile); elsewhere nothing is made ahead.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from ..store.memory import available_memory
from ..store.tensors import Mapped

CHUNK = 64 << 20
"""Bytes made per step: the thread stops between two steps when asked."""

SHARE = 4
"""At most 1/SHARE of the memory still available is made ahead: the pages are dirty until the
writer's bytes replace them, and written back as zeros if the kernel needs the room first."""


class EarlyPages:
    """Makes the pages of ``files`` (path, size), from the start of each, on a thread of its own,
    up to ``budget`` bytes in all, until ``finish``, by writing zeros (``_zeros``); a file it
    touched is left at its size with how many bytes it made (``made``), and the writer opens it
    without truncating. Any failure (no room) just stops it: the writer meets the cause and reports
    it.

    >>> pages = EarlyPages([(Path("out/model.safetensors"), 1 << 30)], 1 << 30)  # doctest: +SKIP
    >>> pages.finish()  # doctest: +SKIP
    {PosixPath('out/model.safetensors'): 1073741824}
    """

    def __init__(self, files: list[tuple[Path, int]], budget: int) -> None:
        self.files, self.budget = files, budget
        self.made: dict[Path, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="enjoyln-early-pages", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, files: list[tuple[Path, int]]) -> "EarlyPages | None":
        """Started with a budget of its share of the memory available; None where pages cannot be
        made ahead (no mapping, memory unknown) or nothing is to be written."""
        avail = available_memory()
        if not files or avail is None or not Mapped.available():
            return None
        return cls(files, min(sum(size for _, size in files), avail // SHARE))

    def _run(self) -> None:
        left = self.budget
        with contextlib.suppress(OSError), open("/dev/zero", "rb", buffering=0) as zeros:
            for path, size in self.files:
                if self.stop.is_set() or left <= 0:
                    return
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    os.ftruncate(fd, size)
                    self.made[path] = 0
                    while self.made[path] < min(size, left) and not self.stop.is_set():
                        end = min(self.made[path] + CHUNK, size)
                        _zeros(fd, zeros.fileno(), self.made[path], end)
                        self.made[path] = end
                    left -= self.made[path]
                finally:
                    os.close(fd)

    def finish(self) -> dict[Path, int]:
        """Stop making pages; each file touched, with how many bytes from its start it made."""
        self.stop.set()
        self.thread.join()
        return self.made


def _zeros(fd: int, zeros: int, at: int, end: int) -> None:
    """Zeros into ``fd`` from ``at`` to ``end``, copied from /dev/zero by the kernel, which writes
    them a pipe's worth at a time (small folios, as ``WRITE_STEP`` asks) in one call that does not
    hold the interpreter's lock: a loop of writes would wait for it at every step while the
    analysis holds it (5 ms at a time)."""
    os.lseek(fd, at, os.SEEK_SET)
    while at < end:
        n = os.sendfile(fd, zeros, None, end - at)
        if n <= 0:
            raise OSError(f"/dev/zero gave {n} bytes")
        at += n
