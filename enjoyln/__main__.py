"""Entry point of the ``enjoyln`` command: safe standard streams and signal handlers first, before
torch loads, so that a closed or broken stdout cannot change an exit code, SIGTERM cleans up like
Ctrl-C, and an interrupt gives one line and exit code 130 (143 for SIGTERM)."""

from __future__ import annotations

import gc
import signal
import sys
import warnings

from .cli.streams import guard_streams
from .errors import Interrupted


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the cleanup finish
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise Interrupted(signum)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    print(f"warning: {message}", file=sys.stderr)  # one line, not the source line that raised it


GC_THRESHOLDS = (10_000, 10, 10)
"""A command imports torch and transformers and traces a model: millions of objects that live to
the end. At Python's default thresholds (700, 10, 10) the collector scans all of them again about
seven times (about 1 s of a 9 s ``inspect`` of a tiny model here); at these, not at all, while
short-lived cycles are still collected."""


def main() -> None:
    """Run the command line."""
    gc.set_threshold(*GC_THRESHOLDS)  # a process of its own: no library caller's settings to keep
    guard_streams()
    warnings.showwarning = _show_warning
    signal.signal(signal.SIGTERM, _interrupt)
    if (
        signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    ):  # background jobs ignore it: keep that
        signal.signal(signal.SIGINT, _interrupt)
    try:
        from .cli.app import app

        app()
    except Interrupted as exc:  # before a command's own handler is in place (while typer loads)
        print(exc.message, file=sys.stderr)
        if "--json" in sys.argv[1:]:  # one JSON document on every path
            print(f'{{"error": "{exc.message}", "exit_code": {exc.exit_code}}}')
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
