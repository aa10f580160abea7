"""How the Triton RMSNorm kernels are launched: block sizes and warps by row length.

Kept apart from ``triton_kernels.py`` so it imports without Triton: the
ahead-of-time compile test lists the variants at collection time, and must not
import Triton there (the interpreter tests need it imported with
``TRITON_INTERPRET=1`` first).
"""

from __future__ import annotations

MAX_FUSED = 16384
"""Longest row kept in registers by the one-block kernel; longer rows take the looped one.
Held in registers, a row of 32768 spills to local memory on sm_80 and sm_90 with 16 or
32 warps (tests/ops/test_triton_aot.py)."""

LOOPED_CONFIG = (2048, 8)
"""(block, warps) of the two-pass kernel. 4096 with 8 or 16 warps spilled 4-12 bytes in fp16
under the --regAllocOptLevel=2 that Triton 3.9 passes to ptxas, at 40-64 registers."""


def launch_config(n: int) -> tuple[int, int]:
    """(block size, warps) of the one-block kernel for rows of ``n`` elements.

    >>> launch_config(768)
    (1024, 4)
    """
    block = min(1 << max(n - 1, 0).bit_length(), MAX_FUSED)  # next power of two
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps
