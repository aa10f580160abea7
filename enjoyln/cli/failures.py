"""How a command fails: one line on stderr (with ``--json`` a JSON document on stdout) and an exit
code (2 bad input, 1 a failed check, 130 Ctrl-C, 143 SIGTERM), never a traceback."""

from __future__ import annotations

import contextlib
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


def fail(message: str, code: int, *, as_json: bool, payload: dict[str, Any] | None = None) -> None:
    """The line on stderr; with ``as_json`` also its JSON document, unless the command printed
    one."""
    render.err.print(one_line(message), markup=False, emoji=False, highlight=False)
    if as_json and not render.state.printed_json:
        doc = {
            "error": one_line(message.removeprefix("error: ")),
            "exit_code": code,
            **(payload or {}),
        }
        doc["exit_code"] = (
            code  # the payload may be a success's document (fold's, with exit_code 0)
        )
        render.print_json(doc)


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Any failure becomes ``fail`` and an exit code; a traceback only where ``--verbose`` or
    ENJOYLN_DEBUG asks."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json, payload = bool(kwargs.get("as_json")), None
        render.state.begin(
            as_json=as_json, quiet=bool(kwargs.get("quiet")), verbose=bool(kwargs.get("verbose"))
        )
        try:
            # unencodable text written escaped: a print after OUT_DIR is published must not turn
            # success into failure
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(AttributeError, ValueError, OSError):
                    stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
            return fn(*args, **kwargs)
        except EnjoylnError as exc:
            message, code, payload = f"error: {exc}", exc.exit_code, getattr(exc, "payload", None)
        except OSError as exc:
            message, code = f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), 2
        except Interrupted as exc:
            message, code = exc.message, exc.exit_code
        except KeyboardInterrupt:  # Ctrl-C where the command line's own handlers are not installed
            message, code = "interrupted", 130
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except (
            Exception
        ) as exc:  # a bug or an unforeseen input: still one line, and how to see more
            if os.environ.get("ENJOYLN_DEBUG") or render.state.verbose:
                raise
            message, code = (
                f"error: {type(exc).__name__}: {first_line(exc, '')} (pass --verbose or set "
                "ENJOYLN_DEBUG=1 for the traceback)",
                2,
            )
        finally:
            render.state.end()
        fail(message, code, as_json=as_json, payload=payload)
        raise typer.Exit(code)

    return wrapper


def usage_error(exc: UsageError, args: list[str]) -> int:
    """click's usage error as one line: ``error: no such option: --foo (see enjoyln fold
    --help)``."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    message = re.sub(r"\s*\(Possible options: ([^)]*)\)", r"; did you mean \1?", message)
    message = message[:1].lower() + message[1:]
    where = exc.ctx.command_path if exc.ctx is not None else "enjoyln"
    fail(f"error: {message} (see {where} --help)", exc.exit_code, as_json="--json" in args)
    return exc.exit_code
