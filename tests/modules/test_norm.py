import pytest
import torch
from torch import nn

from enjoyln import RMSNorm
from enjoyln.ops import rms_norm
from enjoyln.ops.reference import rms_norm_reference


def test_constructor_mirrors_layer_norm():
    rms, ln = RMSNorm(16, eps=1e-6), nn.LayerNorm(16, eps=1e-6)
    assert rms.state_dict().keys() == ln.state_dict().keys()
    assert rms.normalized_shape == ln.normalized_shape == (16,)
    assert RMSNorm((4, 4), bias=False).bias is None
    no_affine = RMSNorm(8, elementwise_affine=False)
    # weightless: a buffer of ones that quantization tools can read, not in the state dict
    # (test_quantization.py)
    assert torch.equal(no_affine.weight, torch.ones(8)) and no_affine.bias is None
    assert list(no_affine.parameters()) == [] and no_affine.state_dict() == {}
    assert RMSNorm(8, dtype=torch.bfloat16).weight.dtype == torch.bfloat16


def test_from_layer_norm_shares_parameters():
    ln = nn.LayerNorm(8, eps=1e-12, bias=False)
    rms = RMSNorm.from_layer_norm(ln)
    assert rms.weight is ln.weight and rms.bias is None and rms.eps == 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_equals_layer_norm_on_zero_mean_input(dtype):
    x = torch.randn(4, 7, 24, dtype=torch.float64)
    x = (x - x.mean(-1, keepdim=True)).to(dtype)
    ln = nn.LayerNorm(24, dtype=dtype)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(24) + 0.5)
        ln.bias.copy_(torch.randn(24))
    rms = RMSNorm.from_layer_norm(ln)
    y = rms(x)
    assert y.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    torch.testing.assert_close(y, ln(x), atol=tol, rtol=tol)


def test_reference_formula():
    x = torch.randn(3, 10)
    w, b = torch.rand(10), torch.randn(10)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w + b
    torch.testing.assert_close(rms_norm_reference(x, (10,), w, b), expected)
    torch.testing.assert_close(rms_norm(x, (10,), w, b), expected)


def test_backward_matches_reference():
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    w = torch.rand(10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: rms_norm(x, (10,), w, b), (x, w, b))
