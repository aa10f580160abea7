"""Streaming fuse-affine and rotate: every final tensor computed from the reference tensors it
depends on, bit for bit what the plan applied to the loaded model gives (``final_tensors``)."""

import pytest
import torch

from enjoyln.transform.rotation import rotate_, rotation_matrix
from enjoyln.plan import Fused
from enjoyln.transform.steps import fuse_


def bits(t):
    """A tensor's bytes as integers, so that equal means bit for bit (NaNs and -0.0 included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _old_rotate_(t, axis, q, start=0, *, rows=1 << 16):
    """rotate_ as it was before it worked in bounded slabs (verbatim): the oracle."""
    axis = axis % t.dim()
    n = q.shape[0]
    block = t.narrow(axis, start, n)
    other = 0 if axis != 0 or t.dim() == 1 else 1
    slabs = [block] if t.dim() == 1 else block.split(max(1, rows * n // max(block.numel(), 1) * block.shape[other]) or 1, other)
    for slab in slabs:
        wide = slab.detach().to(torch.float64).movedim(axis, -1)
        slab.copy_((wide @ q).movedim(-1, axis))
    return t


def _old_fuse_(weight, bias, f, gamma, beta):
    """fuse_ as it was before it scaled in slabs (verbatim): the oracle."""
    wide = weight.detach().to(torch.float64)
    block = wide.narrow(f.axis, f.start, f.length)
    seg = slice(f.offset, f.offset + f.length)
    if bias is not None and beta is not None:
        added = torch.tensordot(block, beta[seg].to(torch.float64), dims=([f.axis], [0]))
        bias.copy_(bias.detach().to(torch.float64) + added.reshape(bias.shape))
    if gamma is not None:
        shape = [f.length if d == f.axis else 1 for d in range(wide.dim())]
        block.mul_(gamma[seg].to(torch.float64).reshape(shape))
    weight.copy_(wide)


@pytest.mark.parametrize("shape,axis,start,n", [
    ((2000, 64), 1, 0, 64), ((64, 2100), 0, 0, 64), ((37, 64), 1, 0, 64), ((64, 41), 0, 0, 64), ((3, 64), 1, 0, 64), ((2, 64), 1, 0, 64), ((1, 64), 1, 0, 64),
    ((29, 80), 1, 8, 64), ((5, 7, 64), 2, 0, 64), ((64, 3, 2, 2), 0, 0, 64), ((64,), 0, 0, 64)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slab", [1, 150, 1 << 22])
def test_rotation_in_slabs_gives_the_old_bits(shape, axis, start, n, dtype, slab):
    """Slabs give the bits of one whole product: each starts on a BLAS tile boundary. In float64
    a slab of another height (962 rows) shows a difference, so the test can fail."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = rotation_matrix(n, "random", 3, True)
    expected = _old_rotate_(t.clone(), axis, q, start)
    assert torch.equal(bits(rotate_(t, axis, q, start, slab=slab)), bits(expected))


@pytest.mark.parametrize("shape,f,bias", [
    ((24, 16), Fused("w", 1, 0, 16), True), ((16, 24), Fused("w", 0, 0, 16), True),
    ((24, 32), Fused("w", 1, 8, 16, offset=0), True), ((24, 32), Fused("w", 1, 0, 16, offset=16), False),
    ((5, 16, 3), Fused("w", 1, 0, 16), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fusion_in_slabs_gives_the_old_bits(shape, f, bias, dtype, monkeypatch):
    from enjoyln.transform import steps

    monkeypatch.setattr(steps, "_SCALE_ELEMENTS", 7)  # many slabs
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(shape, generator=gen).to(dtype)
    out = shape[1 - f.axis] if len(shape) == 2 else shape[0] * shape[2]
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    gamma, beta = 1 + 0.3 * torch.randn(32, generator=gen, dtype=torch.float64), torch.randn(32, generator=gen, dtype=torch.float64)
    w2, b2 = w.clone(), b.clone() if bias else None
    _old_fuse_(w2, b2, f, gamma, beta)
    fuse_(w, b, f, gamma, beta)
    assert torch.equal(bits(w), bits(w2))
    if bias:
        assert torch.equal(bits(b), bits(b2))
