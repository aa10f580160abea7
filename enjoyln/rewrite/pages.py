"""The output's page-cache pages made while the analysis runs, for a plan that rewrites most of the
weights (docs/performance.md).

Writing a new file costs the kernel a page of its cache per 4 KiB, zeroed before it is written; on
a virtual machine a page the guest freed a while ago can cost the host a fault as well (measured:
several seconds per gigabyte). The analysis keeps one core busy and leaves the other idle, so that
cost is paid there, ahead of the writer, which then writes into pages that already exist.
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
    """Makes the pages of ``files`` (path, size) on a thread of its own, up to ``budget`` bytes,
    until ``finish``; a file it touched is left at its size, which the writer then opens without
    truncating (``prepared``). Any failure (no room, no mapping) just stops it: the writer meets
    the cause itself and reports it.

    >>> pages = EarlyPages([(Path("out/model.safetensors"), 1 << 30)], 1 << 30)  # doctest: +SKIP
    >>> pages.finish()  # doctest: +SKIP
    {PosixPath('out/model.safetensors')}
    """

    def __init__(self, files: list[tuple[Path, int]], budget: int) -> None:
        self.files, self.budget = files, budget
        self.prepared: set[Path] = set()
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
        with contextlib.suppress(OSError):
            for path, size in self.files:
                if self.stop.is_set() or left <= 0:
                    return
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    os.ftruncate(fd, size)
                    self.prepared.add(path)
                    for at in range(0, min(size, left), CHUNK):
                        if self.stop.is_set():
                            return
                        with Mapped(fd, at, min(CHUNK, size - at), writable=True):
                            pass  # mapping it writable made the pages: that is all
                        left -= min(CHUNK, size - at)
                finally:
                    os.close(fd)

    def finish(self) -> set[Path]:
        """Stop making pages; the files touched, each at the size it was given."""
        self.stop.set()
        self.thread.join()
        return self.prepared
