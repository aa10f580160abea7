"""The centering kernel: the C code and its torch twin give the same bits, whatever the
dtype, axis, groups, gain, machine capability or thread count, and the result is centered."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from enjoyln.ops import center as C

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    return t.contiguous().view(-1).view(INT[t.element_size()])


def twin(t, axis, groups=1, scale=None, blocks=None):
    """The torch version of ``center.c``, applied to a copy."""
    x = t.clone()
    axis %= x.dim()
    n = x.shape[axis]
    size = n // groups
    outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1 :])
    gain = None if scale is None else scale.double()
    for b in range(groups) if blocks is None else blocks:
        view = x.view(outer, n, inner)[:, b * size : (b + 1) * size, :]
        view.copy_(
            C.center_reference(view, None if gain is None else gain[b * size : (b + 1) * size])
        )
    return x


needs_kernel = pytest.mark.skipif(C.kernel() is None, reason=f"no C kernel here: {C.status()}")


@needs_kernel
@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 37), min_size=1, max_size=3),
    data=st.data(),
)
def test_the_kernel_and_its_torch_twin_give_the_same_bits(dtype, shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    n = shape[axis]
    groups = data.draw(st.sampled_from([g for g in (1, 2, 3, 4) if n % g == 0]))
    blocks = data.draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(0, groups - 1), min_size=1, max_size=groups, unique=True),
        )
    )
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    scale = (
        (torch.rand(n, generator=gen) + 0.25) * torch.sign(torch.randn(n, generator=gen))
        if data.draw(st.booleans())
        else None
    )
    t = (torch.randn(shape, generator=gen) * 3 + torch.randn((), generator=gen)).to(dtype)
    got = C.center_(t.clone(), axis, groups, scale, blocks)
    assert torch.equal(bits(got), bits(twin(t, axis, groups, scale, blocks)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_the_result_is_centered_in_float64(dtype, axis):
    t = (torch.randn(48, 5, 40) * 0.02 + 0.7).to(dtype)
    exact = t.double() - t.double().mean(axis, keepdim=True)
    got = C.center_(t.clone(), axis)
    tol = torch.finfo(dtype).eps * exact.abs().max()
    assert float((got.double() - exact).abs().max()) <= tol
    assert float(got.double().mean(axis).abs().max()) <= 48 * tol


def test_a_gain_centers_the_scaled_tensor():
    gain = torch.rand(12) + 0.5
    t = torch.randn(12, 30, dtype=torch.float64)
    got = C.center_(t.clone(), 0, scale=gain)
    assert float((gain[:, None].double() * got).mean(0).abs().max()) < 1e-14


@needs_kernel
def test_non_contiguous_views_and_parameters_are_centered_in_place():
    base = torch.randn(6, 16)
    view = base.t()  # not contiguous
    expect = twin(view.contiguous(), 1)
    C.center_(view, 1)
    assert torch.equal(bits(view), bits(expect))
    p = torch.nn.Parameter(torch.randn(8, 4))
    before = p.detach().clone()
    C.center_(p.data, 0)
    assert torch.equal(bits(p.detach()), bits(twin(before, 0)))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(groups=5), "into 5 groups"),
        (dict(groups=2, blocks=[2]), "no block 2"),
        (dict(scale=torch.zeros(8)), "zero entry"),
        (dict(scale=torch.ones(3)), "gain of 3 entries"),
    ],
)
def test_impossible_centerings_are_refused(bad, message):
    with pytest.raises(C.CenteringError, match=message):
        C.center_(torch.randn(8, 4), 0, **bad)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_the_bits_do_not_depend_on_the_thread_count(threads):
    t = torch.randn(700, 800) * 0.02 + 0.01
    expect = C.center_(t.clone(), 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(bits(C.center_(t.clone(), 0)), bits(expect))
        assert torch.equal(bits(C.center_(t.clone(), 1)), bits(twin(t, 1)))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_without_a_compiler_the_torch_twin_gives_the_same_bits(tmp_path):
    """A machine without a C compiler folds with the torch version; a checkpoint it writes
    must be what a machine with the kernel checks."""
    t = torch.randn(64, 96) * 0.02 + 0.003
    torch.save(t, tmp_path / "t.pt")
    code = (
        "import torch, sys; from enjoyln.ops import center as C; t = torch.load(sys.argv[1]); "
        "assert C.kernel() is None, C.status(); torch.save((C.center_(t.clone(), 0), "
        "C.center_(t.clone(), 1)), "
        "sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "t.pt"), str(tmp_path / "out.pt")],
        check=True,
        env={**__import__("os").environ, "ENJOYLN_DISABLE_CPU_KERNEL": "1"},
    )
    a, b = torch.load(tmp_path / "out.pt")
    assert torch.equal(bits(a), bits(C.center_(t.clone(), 0)))
    assert torch.equal(bits(b), bits(C.center_(t.clone(), 1)))


def _misaligned(t, shift):
    """A copy of ``t`` whose data starts ``shift`` bytes past an aligned address, as a tensor in
    a safetensors file may, and the storage that keeps it alive."""
    raw = torch.zeros(t.numel() * t.element_size() + 16, dtype=torch.uint8)
    n = t.numel() * t.element_size()
    raw[shift : shift + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return raw.data_ptr() + shift, raw


@needs_kernel
@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 300), min_size=1, max_size=3).filter(
        lambda s: math.prod(s) <= 40_000
    ),
    shift=st.integers(0, 7),
    data=st.data(),
)
def test_centering_into_and_comparing_give_the_in_place_bits(dtype, shape, shift, data):
    """What the fold writes from a mapped file (``center_into``) and what the static check accepts
    (``centered_equal``) are ``center_``'s bits, at any alignment; one flipped bit anywhere is
    seen."""
    axis = data.draw(st.integers(0, len(shape) - 1))
    n = shape[axis]
    groups = data.draw(st.sampled_from([g for g in (1, 2, 3, 4) if n % g == 0]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    scale = (torch.rand(n, generator=gen) + 0.25) if data.draw(st.booleans()) else None
    t = (torch.randn(shape, generator=gen) * 3 + torch.randn((), generator=gen)).to(dtype)
    expect = C.center_(t.clone(), axis, groups, scale)
    src, keep = _misaligned(t, shift)
    out = torch.empty_like(t)
    assert C.center_into(src, out, axis, groups, scale)
    assert torch.equal(bits(out), bits(expect))
    cand, keep2 = _misaligned(expect, 7 - shift)
    assert C.centered_equal(src, cand, dtype, t.shape, axis, groups, scale) is True
    flip = data.draw(st.integers(0, t.numel() * t.element_size() - 1))
    keep2[7 - shift + flip] ^= 1 << data.draw(st.integers(0, 7))
    assert C.centered_equal(src, cand, dtype, t.shape, axis, groups, scale) is False


@needs_kernel
def test_only_some_blocks_centered_are_copied_around_or_left_to_the_caller():
    t = torch.randn(6, 40)
    expect = C.center_(t.clone(), 1, groups=4, blocks=[1, 3])
    out = torch.empty_like(t)
    assert C.center_into(t.data_ptr(), out, 1, groups=4, blocks=[1, 3])
    assert torch.equal(bits(out), bits(expect))
    assert (
        C.centered_equal(
            t.data_ptr(), expect.data_ptr(), t.dtype, t.shape, 1, groups=4, blocks=[1, 3]
        )
        is None
    )


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("at", [0, 1, (16 << 20) - 1, 16 << 20, (40 << 20) + 5, (48 << 20) - 1])
def test_same_memory_sees_one_changed_byte_anywhere(threads, at):
    a = torch.randint(0, 256, (48 << 20,), dtype=torch.uint8)
    b = a.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert C.same_memory(a.data_ptr(), b.data_ptr(), a.numel()) is True
        b[at] ^= 0x80
        assert C.same_memory(a.data_ptr(), b.data_ptr(), a.numel()) is False
        assert C.same_memory(a.data_ptr(), b.data_ptr(), at) is True  # up to the change
    finally:
        torch.set_num_threads(before)
