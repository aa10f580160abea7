"""Sizes as the command line reads them and reports print them."""

import pytest

from enjoyln.errors import CheckpointError
from enjoyln.units import format_bytes, parse_size


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(32768) == "32.0 KiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"


@pytest.mark.parametrize(
    "text, size",
    [
        ("500MB", 500_000_000),
        ("2GB", 2_000_000_000),
        ("1.5GiB", 3 << 29),
        ("1 kib", 1024),
        ("4096", 4096),
        (7, 7),
        (None, None),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "abc", "-1MB", "0", "0GB", "1.5", 0, -3])
def test_a_size_that_is_not_one_is_refused_in_one_line(text):
    with pytest.raises(CheckpointError, match="cannot use the size"):
        parse_size(text)
