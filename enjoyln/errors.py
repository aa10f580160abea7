"""Errors that enjoyln raises for bad input.

Every one carries a single-line message meant for the user; the CLI prints it
as is and exits non-zero, so messages must name the cause and, where there is
one, the fix.
"""

from __future__ import annotations


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
