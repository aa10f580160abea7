"""Errors for bad input, each one line naming the cause and the fix, which the CLI prints as is."""

from __future__ import annotations

from typing import Any


class EnjoylnError(Exception):
    """Base class: a problem with the user's input, not a bug in enjoyln."""

    exit_code = 2


class CaptureError(EnjoylnError):
    """The model could not be traced, or no example inputs could be built."""


class AnalysisError(EnjoylnError):
    """The traced graph holds something the analysis cannot follow; names the op and its module."""


class PlanError(EnjoylnError):
    """A fold plan does not match the model it is applied to."""


class CheckpointError(EnjoylnError):
    """A model directory is missing, malformed, or cannot be written."""


class CheckFailed(EnjoylnError):
    """A folded checkpoint failed its check, so was not published; ``kept``: where it was kept, or
    None."""

    exit_code = 1

    def __init__(self, message: str, report: Any = None, kept: Any = None) -> None:
        super().__init__(message)
        self.report, self.kept = report, kept


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of ``exc``'s message (or ``default``, or its type), with the next if it ends
    in a colon.

    >>> first_line(ValueError("bad shape\\nin layer 3")), first_line(KeyError())
    ('bad shape', 'KeyError')
    >>> first_line(ValueError("Validation error for field 'n_embd':\\n  '64' is not an int"))
    "Validation error for field 'n_embd': '64' is not an int"
    """
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__ if default is None else default
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised by the CLI's signal handlers so every ``finally`` cleans up; exit
    code 128 + the signal. Not a KeyboardInterrupt: click and typer turn those into a silent exit
    130."""

    def __init__(self, signum: int) -> None:
        import signal

        super().__init__(signum)
        self.exit_code = 128 + signum
        self.message = "terminated" if signum == signal.SIGTERM else "interrupted"
