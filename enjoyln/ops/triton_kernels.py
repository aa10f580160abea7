"""Triton RMSNorm kernels for CUDA: forward, and forward fused with a residual add.

One program per row. When the row fits in one block (N <= 16384) it is
loaded once, kept in registers, reduced and written: one read, one write.
Larger rows take a two-pass loop: held in registers, a row of 32768 spills to
local memory on sm_80 and sm_90 (``triton_launch.py``; tests/ops/test_triton_aot.py
compiles every variant for both and fails on any spill). Block size and warps
follow N, as in Liger-Kernel and flash-attention's Triton layer norm. Accumulation is fp32;
the output has the input's dtype. Tested on CPU tensors with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import LOOPED_CONFIG, MAX_FUSED, launch_config  # noqa: F401 (launch_config: tests)


@triton.jit
def _load_input(X, R, S, row, stride_x, stride_r, stride_s, cols, mask, HAS_RES: tl.constexpr):
    """The row to normalise, in fp32: ``x``, or ``x + residual`` stored to S and read back
    in S's dtype, exactly as the unfused ``norm(x + residual)`` would see it."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(S + row * stride_s + cols, x.to(S.dtype.element_ty), mask=mask)
        x = tl.load(S + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _rms_norm_row(X, R, S, W, B, Y, stride_x, stride_r, stride_s, stride_y, N, eps,
                  HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = _load_input(X, R, S, row, stride_x, stride_r, stride_s, cols, mask, HAS_RES)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_looped(X, R, S, W, B, Y, stride_x, stride_r, stride_s, stride_y, N, eps,
                     HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = _load_input(X, R, S, row, stride_x, stride_r, stride_s, cols, mask, HAS_RES)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        src = S + row * stride_s if HAS_RES else X + row * stride_x
        y = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32) * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
            bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2)
    r2 = s = None
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        s = torch.empty_like(x2)
    rows = x2.shape[0]
    block, warps = launch_config(n)
    kernel = _rms_norm_row if n <= MAX_FUSED else _rms_norm_looped
    if n > MAX_FUSED:
        block, warps = LOOPED_CONFIG
    if rows:
        kernel[(rows,)](
            x2, r2 if r2 is not None else x2, s if s is not None else y, weight, bias, y,
            x2.stride(0), r2.stride(0) if r2 is not None else 0, s.stride(0) if s is not None else 0,
            y.stride(0), n, eps,
            HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            BLOCK=block, num_warps=warps,
        )
    return y.view(x.shape), (s.view(x.shape) if s is not None else None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last axis of ``x``."""
    return _launch(x, None, weight, bias, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and ``RMSNorm(s)`` in one pass; returns ``(s, normed)``.

    The sum is rounded to the input dtype before it is normalised, exactly as
    the unfused ``norm(x + residual)`` would see it.
    """
    y, s = _launch(x, residual, weight, bias, eps)
    return s, y
