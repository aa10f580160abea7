"""The Triton kernels, run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1)."""

import importlib
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before the import
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'enjoyln[triton]')")
kernels = importlib.import_module("enjoyln.ops.triton_kernels")

from enjoyln.ops.reference import rms_norm_reference  # noqa: E402

# N = 1, non-powers of two, a power of two, and rows beyond one block (the looped kernel)
NS = [1, 7, 96, 1000, 1024, 16_384, 16_385, 70_001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulps(a, b, dtype):
    eps = torch.finfo(dtype).eps
    scale = b.float().abs().max().clamp_min(1.0)
    return float((a.float() - b.float()).abs().max() / scale / eps)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_reference(n, dtype, bias):
    rows = 3 if n > 10_000 else 5
    x = (torch.randn(rows, n) * 2 + 0.3).to(dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    y = kernels.rms_norm_triton(x, w, b, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert ulps(y, rms_norm_reference(x, (n,), w, b, 1e-5), dtype) <= 4


@pytest.mark.parametrize("n", [1, 96, 1000, 16_385, 70_001])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_variant_returns_sum_and_norm(n, dtype):
    x, r = torch.randn(3, n).to(dtype), torch.randn(3, n).to(dtype)
    w, b = (torch.rand(n) + 0.5).to(dtype), torch.randn(n).to(dtype)
    s, y = kernels.add_rms_norm_triton(x, r, w, b, 1e-6)
    assert ulps(s, x.float() + r.float(), dtype) <= 1
    assert ulps(y, rms_norm_reference(s, (n,), w, b, 1e-6), dtype) <= 4


def test_no_weight_and_strided_rows():
    x = torch.randn(6, 64)[::2]  # rows with a stride of 128
    y = kernels.rms_norm_triton(x)
    assert ulps(y, rms_norm_reference(x, (64,)), torch.float32) <= 4


def test_launch_config_follows_n():
    assert kernels.launch_config(768) == (1024, 4)
    assert kernels.launch_config(4096) == (4096, 8)
    assert kernels.launch_config(16384) == (16384, 16)
    assert kernels.launch_config(65536) == (16384, 16)  # beyond MAX_FUSED the looped kernel runs
    assert kernels.launch_config(1) == (1, 4)
