"""How a command ends when it fails: one line on stderr (and, with ``--json``, one JSON document on
stdout) and an exit code, never a traceback: 2 for bad input, 1 for a check that failed, 130
for Ctrl-C and 143 for SIGTERM.

``friendly`` wraps each command; ``usage_error`` words click's own errors (an unknown option, a
missing argument) the same way, for ``app.Group``.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Any, Callable

import typer

try:  # typer vendors click since 0.2x: its usage errors are these
    from typer._click import exceptions as click_errors
except ImportError:  # an older typer, on click itself
    from click import exceptions as click_errors  # type: ignore[no-redef]

UsageError, NoArgsIsHelpError = click_errors.UsageError, click_errors.NoArgsIsHelpError

from ..errors import EnjoylnError, Interrupted, first_line
from . import render
from .render import one_line

def _tolerant_streams() -> None:
    """Text no stream can encode (a non-ASCII path on an ASCII stdout) is written escaped, not
    raised: a print after OUT_DIR is published must not turn a success into a failure."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def fail(message: str, code: int, *, as_json: bool, payload: dict[str, Any] | None = None) -> None:
    """Report a failure: the line on stderr, and with ``as_json`` one JSON document on stdout
    (``{"error": ..., "exit_code": ...}`` and what the command had to say), unless the command
    already printed its document."""
    render.err.print(one_line(message), markup=False, emoji=False, highlight=False)
    if as_json and not render.state.printed_json:
        render.print_json({"error": one_line(message.removeprefix("error: ")), "exit_code": code, **(payload or {})})


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Any failure becomes one line on stderr (and with ``--json`` one JSON document on stdout) and
    an exit code, never a traceback (unless ``--verbose`` or ENJOYLN_DEBUG asks for one, for an
    error that is not bad input). Reads ``as_json``, ``quiet`` and ``verbose`` from the command's
    options, for the rest of the command."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        render.state.begin(as_json=as_json, quiet=bool(kwargs.get("quiet")), verbose=bool(kwargs.get("verbose")))
        try:
            _tolerant_streams()
            return fn(*args, **kwargs)
        except EnjoylnError as exc:
            fail(f"error: {exc}", exc.exit_code, as_json=as_json, payload=getattr(exc, "payload", None))
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            fail(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), 2, as_json=as_json)
            raise typer.Exit(2) from None
        except Interrupted as exc:
            fail(exc.message, exc.exit_code, as_json=as_json)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:  # Ctrl-C where the command line's own handlers are not installed
            fail("interrupted", 130, as_json=as_json)
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug or an unforeseen input: still one line, and how to see more
            if os.environ.get("ENJOYLN_DEBUG") or render.state.verbose:
                raise
            first = first_line(exc, "")
            fail(f"error: {type(exc).__name__}: {first} (pass --verbose or set ENJOYLN_DEBUG=1 for the traceback)",
                 2, as_json=as_json)
            raise typer.Exit(2) from None
        finally:
            render.state.end()

    return wrapper


def usage_error(exc: UsageError, args: list[str]) -> int:
    """click's usage error (an unknown option, a missing argument, a bad value) as one line:
    ``error: no such option: --foo (see enjoyln fold --help)``; exit code 2."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    message = re.sub(r"\s*\(Possible options: ([^)]*)\)", r"; did you mean \1?", message)
    message = message[:1].lower() + message[1:]
    where = exc.ctx.command_path if exc.ctx is not None else "enjoyln"
    fail(f"error: {message} (see {where} --help)", exc.exit_code, as_json="--json" in args)
    return exc.exit_code
