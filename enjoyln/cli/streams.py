"""The command line's standard streams, made safe before anything uses them. A closed descriptor is
opened on /dev/null, so that no file the command opens later takes its number (a weight shard on fd
1 would receive the report). stdout and stderr are rebuilt on writers that never raise: once a write
fails (a full disk, a reader that went away), what follows is dropped, and the exit code stays the
command's own (a check's verdict, a published fold), not that of the failed print."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from typing import Any, TextIO

STANDARD = (0, 1, 2)


def guard_streams() -> None:
    """Open every closed standard descriptor on /dev/null; rebuild ``sys.stdout`` and ``sys.stderr``
    on writers that drop their output, rather than raise, once it cannot be written."""
    for fd in STANDARD:  # in order, so os.open returns the lowest closed one
        try:
            os.fstat(fd)
        except OSError:
            spare = os.open(os.devnull, os.O_RDWR)
            if spare != fd:
                os.dup2(spare, fd)
                os.close(spare)
            os.set_inheritable(
                fd, True
            )  # a child process gets it too, as it would have the closed one
    sys.stdout = _rebuilt(sys.stdout, 1, "stdout")
    sys.stderr = _rebuilt(sys.stderr, 2, "stderr")


def _rebuilt(stream: TextIO | None, fd: int, name: str) -> TextIO:
    """A text stream on ``fd`` like ``stream`` (its encoding, errors and buffering), over a writer
    that cannot fail."""
    settings: dict[str, Any] = {
        "encoding": "utf-8",
        "errors": "backslashreplace",
        "line_buffering": False,
    }
    if isinstance(stream, io.TextIOWrapper):
        settings = {
            "encoding": stream.encoding,
            "errors": stream.errors,
            "line_buffering": stream.line_buffering,
            "write_through": stream.write_through,
        }
        try:
            if stream.fileno() != fd:  # already redirected by the caller (a test runner): leave it
                return stream
        except (OSError, ValueError):  # no descriptor under it (a test runner's capture)
            return stream
        with contextlib.suppress(
            OSError
        ):  # nothing is written yet, or it was ours and never raises
            stream.flush()
    elif stream is not None:  # not a file at all (a test runner's capture): leave it
        return stream
    return io.TextIOWrapper(io.BufferedWriter(_Unfailing(fd, name)), **settings)


class _Unfailing(io.FileIO):
    """A descriptor's writer that, at its first failed write, says why on stderr (but for a reader
    that went away, which ``| head`` does by design) and drops everything after."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__(fd, "w", closefd=False)
        self.stream_name, self.lost = name, False

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.lost:
            return size
        try:
            return super().write(data) or 0
        except OSError as exc:
            self.lost = True
            if self.stream_name != "stderr" and exc.errno != errno.EPIPE:
                reason = exc.strerror or str(exc)
                sys.stderr.write(
                    f"warning: cannot write to {self.stream_name} ({reason}); the rest of "
                    "its output is dropped, and the exit code still gives the result\n"
                )
                sys.stderr.flush()
            return size
