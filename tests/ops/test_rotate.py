"""The structured rotation kernel: every width gets an orthogonal Q that keeps the ones vector where
asked, written as the factors say, with bits that depend on neither the layout, the thread count,
nor the instruction set the kernel is compiled for."""

import hashlib
import math

import pytest
import torch

from enjoyln.ops import cpu
from enjoyln.ops import rotate as R
from enjoyln.ops.center import CODES
from enjoyln.transform.rotation import hadamard_matrix

pytestmark = pytest.mark.skipif(R.library() is None, reason=f"no C kernel here: {R.library.error}")

INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    return t.contiguous().view(-1).view(INT[t.element_size()])


def test_every_width_from_64_to_16384_gets_an_orthogonal_structured_rotation():
    gen = torch.Generator().manual_seed(0)
    for n in range(64, 16385, 64):
        keep_mean = n % 128 == 64  # both kinds, alternately
        table = R.structured(n, 0, keep_mean)
        assert table.k * table.m == n and table.m % 2 == 1 and table.k & (table.k - 1) == 0
        x = torch.cat(
            [
                torch.ones(1, n, dtype=torch.float64),
                torch.randn(3, n, generator=gen, dtype=torch.float64),
            ]
        )
        y = R.rotate_(x.clone(), 1, table)
        # Q orthogonal <=> it keeps every inner product: the Gram matrix of random vectors, within
        # float64 rounding
        assert float((y @ y.T - x @ x.T).abs().max()) < 1e-12 * n, n
        ones = float((y[0] - 1).abs().max())
        assert ones < 1e-12 if keep_mean else ones > 0.1, n
    R.structured.cache_clear()


@pytest.mark.parametrize("n", [1, 2, 3, 12, 96, 130, 320])
@pytest.mark.parametrize("keep_mean", [True, False])
def test_q_is_signs_times_hadamard_kron_block_then_the_reflection(n, keep_mean):
    table = R.structured(n, 5, keep_mean)
    q = R.rotate_(torch.eye(n, dtype=torch.float64), 1, table)  # row i: e_i Q
    dense = table.pre[:, None] * torch.kron(
        hadamard_matrix(table.k) * math.sqrt(table.k), table.block
    )
    if table.w is not None:
        dense = dense - 2 * torch.outer(dense @ table.w, table.w)
    assert torch.allclose(q, dense, rtol=0, atol=1e-14)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-14)
    if keep_mean:
        assert torch.allclose(q.sum(0), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-14)
    if n > 1 or not keep_mean:  # the one rotation of width 1 that keeps the mean is 1
        assert not torch.equal(
            q, R.rotate_(torch.eye(n, dtype=torch.float64), 1, R.structured(n, 6, keep_mean))
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_bits_are_the_same_along_any_axis_and_for_any_thread_count(dtype):
    gen = torch.Generator().manual_seed(1)
    n = 96
    table = R.structured(n, 0, True)
    x = torch.randn(33, n, 5, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = R.rotate_(x.clone(), 1, table)
        torch.set_num_threads(3)
        three = R.rotate_(x.clone(), 1, table)
    finally:
        torch.set_num_threads(threads)
    rows = R.rotate_(x.permute(0, 2, 1).contiguous(), 2, table).permute(0, 2, 1)
    first = R.rotate_(x.permute(1, 0, 2).contiguous(), 0, table).permute(1, 0, 2)
    strided = x.clone().permute(0, 2, 1)  # not contiguous: rotated through a copy of its own dtype
    R.rotate_(strided, 2, table)
    for other in (three, rows, first, strided.permute(0, 2, 1)):
        assert torch.equal(bits(other), bits(one))
    # and each vector is x Q rounded once from float64
    wide = R.rotate_(x.double().clone(), 1, table)
    assert torch.equal(bits(one), bits(wide.to(dtype)))


def test_a_block_of_an_axis_is_rotated_and_the_rest_left_alone():
    table = R.structured(24, 0, True)
    x = torch.randn(3, 40, 2)
    y = R.rotate_(x.clone(), 1, table, start=10)
    assert torch.equal(y[:, :10], x[:, :10]) and torch.equal(y[:, 34:], x[:, 34:])
    assert torch.equal(y[:, 10:34], R.rotate_(x[:, 10:34].contiguous(), 1, table))
    with pytest.raises(ValueError, match="do not fit"):
        R.rotate_(x, 1, table, start=20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_gain_scaled_on_the_way_gives_the_bits_of_scaling_then_rotating(dtype):
    """The fused gain: each product rounded to the dtype as ``scale_inputs_`` stores it, then
    rotated; along rows, along strided columns (a tile of four items and a ragged one: 37
    columns), in one pass."""
    from enjoyln.plan import Fused
    from enjoyln.transform.tensors import scale_inputs_

    gen = torch.Generator().manual_seed(4)
    table = R.structured(96, 0, True)
    gamma = torch.rand(96, generator=gen, dtype=torch.float64) + 0.5
    for axis, shape in ((1, (9, 96)), (0, (96, 37))):
        x = torch.randn(shape, generator=gen).to(dtype)
        apart = x.clone()
        scale_inputs_(apart, Fused("w", axis, 0, 96), gamma)
        R.rotate_(apart, axis, table)
        fused = R.rotate_(x.clone(), axis, table, scale=gamma)
        assert torch.equal(bits(fused), bits(apart)), axis
        assert not torch.equal(bits(fused), bits(R.rotate_(x.clone(), axis, table)))
    with pytest.raises(ValueError, match="scale of shape"):
        R.rotate_(x, 0, table, scale=gamma[:5])


def test_rotated_equal_tells_the_rotation_from_a_changed_element():
    table = R.structured(1600, 0, True)
    x = torch.randn(7, 1600).to(torch.bfloat16)
    y = R.rotate_(x.clone(), 1, table)
    assert R.rotated_equal(x.data_ptr(), y.data_ptr(), x.dtype, x.shape, 1, table)
    changed = y.clone()
    bits(changed)[5 * 1600 + 1599] ^= 1  # one bit of one element
    assert not R.rotated_equal(x.data_ptr(), changed.data_ptr(), x.dtype, x.shape, 1, table)
    t = torch.randn(1600, 9)
    u = R.rotate_(t.clone(), 0, table)
    assert R.rotated_equal(t.data_ptr(), u.data_ptr(), t.dtype, t.shape, 0, table)
    assert not R.rotated_equal(t.data_ptr(), t.data_ptr(), t.dtype, t.shape, 0, table)


def _digest(lib, n, dtype):
    """sha256 of a fixed input rotated by ``lib``'s kernel: rows and strided columns."""
    table = R.structured(n, 0, True)
    x = (torch.arange(5 * n, dtype=torch.float64).reshape(5, n).sin() * 3).to(dtype)
    out = []
    for axis, t in ((1, x.clone()), (0, x.T.contiguous())):
        outer, inner = (5, 1) if axis == 1 else (1, 5)
        rc = lib.enjoyln_rotate_into(
            t.data_ptr(),
            t.data_ptr(),
            None,
            CODES[dtype],
            outer,
            n * inner,
            n,
            inner,
            table.k,
            table.m,
            table.pre.data_ptr(),
            table.block.data_ptr(),
            table.w.data_ptr(),
            2,
        )
        assert rc == 0
        out.append(bytes(bits(t if axis == 1 else t.T.contiguous()).numpy()))
    assert out[0] == out[1]
    return hashlib.sha256(out[0]).hexdigest()[:16]


def test_the_bits_do_not_depend_on_the_instruction_set():
    """Built for plain x86-64 (SSE2) without vectorizing, and for this machine, the kernel gives the
    same bits: vectorizing across vectors reorders no sum. Pinned too: a change of them is a new
    version."""
    portable = [f for f in R.FLAGS if f != "-march=native"] + ["-fno-tree-vectorize", "-O1"]
    other = cpu.compile_library(R.SOURCE, portable)
    lib = R.library()
    R.declare(other)
    for n, dtype in PINNED:
        assert _digest(other, n, dtype) == _digest(lib, n, dtype), n
    assert {key: _digest(lib, *key) for key in PINNED} == PINNED


PINNED = {
    (96, torch.float32): "1aee4465ae9e8d8f",
    (2048, torch.float32): "198065267b3485cf",
    (4544, torch.bfloat16): "c964e19b9ab5c9a2",
    (1600, torch.float16): "0196e53b39a844fb",
    (96, torch.float64): "7e3b363a5118fa16",
    (4544, torch.float64): "3c40734c9fb9d4cc",
    (14848, torch.float64): "0bde573e45fada16",
}
"""Digests of the version-2 rotation of a fixed input (float64 ones show every bit of the
arithmetic)."""


def _fma(x, y, z):
    """fma(x, y, z) correctly rounded, from exact rationals."""
    from fractions import Fraction

    return float(Fraction(x) * Fraction(y) + Fraction(z))


def test_dot_vectors_sums_in_order_whatever_the_layout_and_threads():
    """W β for a fused bias: x[0] β[0], then one fma per entry in order, in float64; the same bits
    from rows or strided columns, a block of a wider axis, one thread or two, and every dtype read
    as stored."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 300, generator=g)
    beta = torch.randn(300, dtype=torch.float64, generator=g)
    got = R.dot_vectors(w, 1, beta)
    for row in (0, 17, 36):
        x, acc = w[row].double().tolist(), None
        for i, xi in enumerate(x):
            acc = xi * beta[0].item() if i == 0 else _fma(xi, beta[i].item(), acc)
        assert got[row].item() == acc
    assert torch.equal(R.dot_vectors(w.t().contiguous(), 0, beta), got)
    assert torch.equal(R.dot_vectors(w.t(), 0, beta), got)  # a strided view, copied
    wide = torch.cat([torch.randn(37, 5, generator=g), w, torch.randn(37, 9, generator=g)], 1)
    assert torch.equal(R.dot_vectors(wide, 1, beta, start=5), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        big = torch.randn(300, 1200, generator=g)
        one = R.dot_vectors(big, 0, beta)
        torch.set_num_threads(2)
        assert torch.equal(R.dot_vectors(big, 0, beta), one)
    finally:
        torch.set_num_threads(threads)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        low = w.to(dtype)
        assert torch.allclose(R.dot_vectors(low, 1, beta), low.double() @ beta, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="do not fit"):
        R.dot_vectors(w, 1, beta, start=1)
