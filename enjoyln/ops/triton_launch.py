"""How the Triton kernels are launched by row length, apart so that it imports without Triton."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

MAX_SHORT = 1024  # longest row the multi-row kernel takes; longer rows get a program each

SHORT_ELEMENTS = (
    4096  # per program of the multi-row kernel: the one-row kernel's at N = 4096, no spill
)

# rows per program at most: more would leave too few programs for the GPU at served batch sizes
MAX_ROWS = 16

# longest row kept in registers by the one-block kernel (a row of 32768 spills on sm_80 and sm_90)
MAX_FUSED = 16384

LOOPED_BLOCK, LOOPED_WARPS = 2048, 8
"""Of the two-pass kernel: 4096 with 8 or 16 warps spilled in fp16 under Triton 3.9's
--regAllocOptLevel=2."""


class LaunchConfig(NamedTuple):
    """One launch: the kernel, its block (columns per row), rows per program and warps."""

    kernel: str  # "rows", "row" or "looped"
    block: int
    rows: int
    warps: int


@lru_cache(maxsize=None)  # on every call's path: a lookup, not a computation
def launch_config(n: int) -> LaunchConfig:
    """The kernel and its launch parameters for rows of ``n`` elements.

    >>> launch_config(768)
    LaunchConfig(kernel='rows', block=1024, rows=4, warps=8)
    >>> launch_config(4096)
    LaunchConfig(kernel='row', block=4096, rows=1, warps=8)
    """
    if n > MAX_FUSED:
        return LaunchConfig("looped", LOOPED_BLOCK, 1, LOOPED_WARPS)
    block = 1 << max(n - 1, 0).bit_length()  # the next power of two
    if n <= MAX_SHORT:
        rows = max(1, min(MAX_ROWS, SHORT_ELEMENTS // block))
        return LaunchConfig("rows", block, rows, 8 if rows * block >= SHORT_ELEMENTS else 4)
    return LaunchConfig("row", block, 1, 16 if block >= 8192 else 8 if block >= 2048 else 4)


def all_configs() -> list[LaunchConfig]:
    """Every configuration ``launch_config`` picks.

    >>> len(all_configs())
    16
    """
    found = {launch_config(1 << k) for k in range(MAX_FUSED.bit_length())}
    found.add(launch_config(MAX_FUSED + 1))
    return sorted(found, key=lambda c: (("rows", "row", "looped").index(c.kernel), c.block))
