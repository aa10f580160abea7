"""Triton RMSNorm kernels for CUDA, forward and fused with a residual add: three kernels with one
signature, chosen by row length in ``triton_launch.py`` (docs/performance.md); fp32 accumulation,
tested on CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import functools
import operator

import torch
import triton
import triton.language as tl

from .triton_cached import CachedLauncher
from .triton_launch import LaunchConfig, launch_config

RUNTIME_ARGS = (
    13  # X, R, S, W, B, Y, four strides, M, N, eps: the arguments before the constexpr flags
)


@triton.jit
def _load_input(X, R, S, off_x, off_r, off_s, mask, HAS_RES: tl.constexpr, KEEP: tl.constexpr):
    """The values to normalise, in fp32: ``x``, or ``x + residual`` stored to S and read
    back in S's dtype, exactly as the unfused ``norm(x + residual)`` would see it. ``KEEP``:
    the caller reads these again (the looped kernel's first pass), so the cache keeps them."""
    if KEEP:
        if HAS_RES:
            x = tl.load(X + off_x, mask=mask, other=0.0, eviction_policy="evict_first").to(
                tl.float32
            )
            x += tl.load(R + off_r, mask=mask, other=0.0, eviction_policy="evict_first").to(
                tl.float32
            )
            tl.store(S + off_s, x.to(S.dtype.element_ty), mask=mask)
            x = tl.load(S + off_s, mask=mask, other=0.0, eviction_policy="evict_last").to(
                tl.float32
            )
        else:
            x = tl.load(X + off_x, mask=mask, other=0.0, eviction_policy="evict_last").to(
                tl.float32
            )
    else:
        x = tl.load(X + off_x, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(R + off_r, mask=mask, other=0.0).to(tl.float32)
            tl.store(S + off_s, x.to(S.dtype.element_ty), mask=mask)
            x = tl.load(S + off_s, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _affine(y, W, B, cols, mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """``y * w + b`` in fp32; γ and β are read by every row, so the cache keeps them."""
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return y


@triton.jit(do_not_specialize=["M"])
def _rms_norm_rows(
    X,
    R,
    S,
    W,
    B,
    Y,
    stride_x,
    stride_r,
    stride_s,
    stride_y,
    M,
    N,
    eps,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r2, c2 = rows[:, None], cols[None, :]
    x = _load_input(
        X, R, S, r2 * stride_x + c2, r2 * stride_r + c2, r2 * stride_s + c2, mask, HAS_RES, False
    )
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None]
    # γ and β loaded as rows of their own, then broadcast: a [1, BLOCK] load would get a
    # layout of its own and cost two conversions through shared memory (ttgir, bf16)
    if HAS_W:
        y = (
            y
            * tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(
                tl.float32
            )[None, :]
        )
    if HAS_B:
        y = (
            y
            + tl.load(B + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(
                tl.float32
            )[None, :]
        )
    tl.store(Y + r2 * stride_y + c2, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_row(
    X,
    R,
    S,
    W,
    B,
    Y,
    stride_x,
    stride_r,
    stride_s,
    stride_y,
    M,
    N,
    eps,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = _load_input(
        X,
        R,
        S,
        row * stride_x + cols,
        row * stride_r + cols,
        row * stride_s + cols,
        mask,
        HAS_RES,
        False,
    )
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = _affine(x * rstd, W, B, cols, mask, HAS_W, HAS_B)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_looped(
    X,
    R,
    S,
    W,
    B,
    Y,
    stride_x,
    stride_r,
    stride_s,
    stride_y,
    M,
    N,
    eps,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = _load_input(
            X,
            R,
            S,
            row * stride_x + cols,
            row * stride_r + cols,
            row * stride_s + cols,
            mask,
            HAS_RES,
            True,
        )
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    src = S + row * stride_s if HAS_RES else X + row * stride_x
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(src + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        y = _affine(x * rstd, W, B, cols, mask, HAS_W, HAS_B)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


KERNELS = {"rows": _rms_norm_rows, "row": _rms_norm_row, "looped": _rms_norm_looped}
LAUNCHERS = {name: CachedLauncher(kernel, RUNTIME_ARGS) for name, kernel in KERNELS.items()}


def launcher_disabled() -> str | None:
    """Why the cached launcher is off in this process (Triton's own launches instead), or None."""
    return next(
        (launcher.disabled for launcher in LAUNCHERS.values() if launcher.disabled is not None),
        None,
    )


def _rows_of(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``t`` as rows of ``n`` with unit column stride, and the row stride; a copy only if unevenly
    strided."""
    if t.is_contiguous():
        return t, n
    if t.dim() != 2:
        t = t.reshape(-1, n)  # a view where the leading dims collapse, else a copy
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


def _rows_and_outputs(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[tuple[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, int, torch.Tensor]]:
    """(x as rows, its row stride, y) and (the residual as rows, its stride, the sum S), each made
    contiguous only where its rows are not evenly strided."""
    n = x.shape[-1]
    if x.is_contiguous():
        x2, sx, y = x, n, torch.empty_like(x)
    else:
        x2, sx = _rows_of(x, n)
        y = torch.empty_like(x2, memory_format=torch.contiguous_format)
    if residual is None:  # R and S are never read: any valid pointer
        return (x2, sx, y), (x2, sx, y)
    r2, sr = (residual, n) if residual.is_contiguous() else _rows_of(residual, n)
    return (x2, sx, y), (r2, sr, torch.empty_like(y))


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    cached: bool = True,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalise the last axis of ``x`` (plus ``residual``); ``(y, sum or None)`` shaped as ``x``.
    ``config`` forces a kernel and its launch (tests); ``cached=False`` takes Triton's own
    launcher."""
    n = x.shape[-1]
    (x2, sx, y), (r2, sr, s) = _rows_and_outputs(x, residual)
    rows = x2.numel() // n if n else 0
    if rows:
        cfg = config or launch_config(n)
        grid, device = -(-rows // cfg.rows), x2.get_device()
        args = (
            x2,
            r2,
            s,
            weight,
            bias,
            y,
            sx,
            sr,
            n,
            n,
            rows,
            n,
            eps,
            residual is not None,
            weight is not None,
            bias is not None,
            cfg.block,
            cfg.rows,
        )
        ptrs = functools.reduce(
            operator.or_, (t.data_ptr() for t in (x2, r2, y, s, weight, bias) if t is not None)
        )
        # The key must tell apart every specialisation Triton's launcher makes: each pointer's
        # dtype and 16-byte alignment (only aligned ones are cached), each integer's class (the
        # values themselves: n, the strides; M is never specialised, only 32- or 64-bit)
        if (
            cached
            and config is None
            and not ptrs & 15
            and rows < 2**31
            and sx < 2**31
            and sr < 2**31
        ):
            key = (
                n,
                sx,
                sr,
                x2.dtype,
                r2.dtype,
                weight.dtype if weight is not None else None,
                bias.dtype if bias is not None else None,
                residual is not None,
                device,
            )
            LAUNCHERS[cfg.kernel](
                key, grid, args, cfg.warps, device, (y, s) if residual is not None else (y,)
            )
        else:
            LAUNCHERS[cfg.kernel].jit(grid, args, cfg.warps, device)
    if y.shape != x.shape:
        y = y.view(x.shape)
        s = s.view(x.shape)
    return y, (s if residual is not None else None)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    cached: bool = True,
) -> torch.Tensor:
    """RMSNorm over the last axis of ``x``.

    >>> y = rms_norm_triton(torch.randn(2048, 768, device="cuda"))  # doctest: +SKIP
    """
    return _launch(x, None, weight, bias, eps, cached=cached)[0]


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    cached: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to the input dtype) and ``RMSNorm(s)`` in one pass; ``(s,
    normed)``.

    >>> s, y = add_rms_norm_triton(x, residual, weight, bias)  # doctest: +SKIP
    """
    y, s = _launch(x, residual, weight, bias, eps, cached=cached)
    return s, y
