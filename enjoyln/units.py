"""Sizes as the command line writes them and as reports print them."""

from __future__ import annotations

from .errors import CheckpointError


def parse_size(text: str | int | None) -> int | None:
    """'500MB', '2GB', '1.5GiB' or a byte count, as bytes."""
    if text is None:
        return None
    if isinstance(text, int):
        if text <= 0:
            raise CheckpointError(f"cannot use the size {text}; it must be positive")
        return text
    s = text.strip().upper().replace(" ", "")
    units = {
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": 1 << 30,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "B": 1,
    }
    unit = next((u for u in units if s.endswith(u)), None)
    try:
        size = (
            int(float(s[: -len(unit)]) * units[unit])
            if unit
            else int(s)
            if s.isascii() and s.isdigit()
            else None
        )
    except (ValueError, OverflowError):  # not a number, or not a finite one
        size = None
    if size is None or size <= 0:
        raise CheckpointError(
            f"cannot use the size {text!r}; write a positive size such as 500MB or 2GB"
        )
    return size


def format_bytes(n: float) -> str:
    """512 B, 32.0 KiB, 3.0 GiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """A rough duration as a person reads it: under a minute in seconds, else in minutes.

    >>> format_duration(42.4), format_duration(95), format_duration(3 * 3600)
    ('40 s', '2 min', '180 min')
    """
    if seconds < 55:
        return (
            f"{max(5, round(seconds / 5) * 5)} s" if seconds >= 5 else f"{max(1, round(seconds))} s"
        )
    return f"{max(1, round(seconds / 60))} min"
