"""A CPU call with a gradient: one C++ autograd node (the extension ops/grad.py builds), with the
output bits of the call without a gradient and the op's backward; and the Python Function, with
one warning, where it cannot be built."""

import warnings

import pytest
import torch

from enjoyln import ops
from enjoyln.ops import cpu, grad, rms_norm

NODE = "torch::autograd::CppNode<EnjoylnRMSNorm>"
needs_extension = pytest.mark.skipif(
    "grad.library() is None", reason="the C++ autograd node cannot be built here"
)


def _case(dtype, shape=(3, 5, 40), norm=(40,), bias=True, weight_dtype=None, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2 + 0.3).to(dtype)
    if strided:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    wd = weight_dtype or dtype
    w = torch.nn.Parameter((torch.rand(norm, generator=gen) + 0.5).to(wd))
    b = torch.nn.Parameter(torch.randn(norm, generator=gen).to(wd)) if bias else None
    return x, norm, w, b


CASES = {  # what the no-grad path runs: the fused kernel (the first five), else the reference
    "fp32": _case(torch.float32),
    "bf16": _case(torch.bfloat16),
    "fp16": _case(torch.float16),
    "no bias": _case(torch.float32, bias=False),
    "two axes": _case(torch.bfloat16, (2, 3, 4, 5), (4, 5)),
    "strided": _case(torch.float32, strided=True),
    "float64": _case(torch.float64),
    "mixed dtypes": _case(torch.bfloat16, weight_dtype=torch.float32),
}


@needs_extension
def test_a_gradient_is_one_cpp_node_with_the_bits_of_the_call_without():
    for name, (x, norm, w, b) in CASES.items():
        y = rms_norm(x, norm, w, b)
        assert y.grad_fn.name() == NODE, name
        with torch.no_grad():
            assert torch.equal(y, rms_norm(x, norm, w, b)), name
        assert y.dtype == x.dtype and y.shape == x.shape, name


@needs_extension
def test_its_backward_is_the_op_s_to_the_bit():
    """The C++ backward runs the op's backward op for op: the gradients of the Python Function, bit
    for bit."""
    for name in ("fp32", "bf16", "no bias", "two axes"):
        x, norm, w, b = CASES[name]
        x = x.clone().requires_grad_()
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
        grads = []
        for fn in (grad.library().rms_norm, ops._fused):
            params = [t for t in (x, w, b) if t is not None]
            grads.append(torch.autograd.grad(fn(x, norm, w, b, 1e-5), params, g))
        assert all(torch.equal(a, c) for a, c in zip(*grads)), name


@needs_extension
def test_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    for shape in ((5,), (4, 5)):
        w = (torch.rand(shape, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
        b = torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
        assert rms_norm(x, shape, w, b).grad_fn.name() == NODE
        assert torch.autograd.gradcheck(lambda x, w, b: rms_norm(x, shape, w, b, 1e-5), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x, w: rms_norm(x, (4, 5), w, None, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda x: rms_norm(x, (5,), None, None, 1e-5), (x,))


def test_a_failed_build_is_one_line(monkeypatch, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENJOYLN_CACHE", str(tmp_path))
        mp.setenv("CXX", "false")  # a "compiler" that fails at once, saying nothing
        with pytest.raises(RuntimeError, match=r"^false failed: failed$"):
            grad._build()
        mp.setenv("CXX", "")
        mp.setenv("PATH", "")
        with pytest.raises(RuntimeError, match=r"^no C\+\+ compiler found \(set CXX\)$"):
            grad._build()


@pytest.mark.skipif(cpu.library() is None, reason="no C compiler for the CPU kernel")
def test_without_the_extension_the_python_function_runs_after_one_warning(monkeypatch):
    def fail():
        raise RuntimeError("c++ failed: simulated")

    monkeypatch.setattr(grad, "library", cpu.Once(fail))
    monkeypatch.setattr(ops, "_grad", None)
    x, norm, w, b = CASES["fp32"]
    with pytest.warns(
        RuntimeWarning, match=r"no C\+\+ autograd node for RMSNorm \(c\+\+ failed: simulated\)"
    ):
        y = rms_norm(x, norm, w, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next call says nothing
        again = rms_norm(x, norm, w, b)
    assert y.grad_fn.name() == again.grad_fn.name() == "_FusedBackward"
    with torch.no_grad():
        assert torch.equal(y, rms_norm(x, norm, w, b))
    x64, norm, w64, b64 = CASES["float64"]  # no fused kernel: None, so rms_norm goes on to the op
    assert ops._grad is ops._fused_or_none and ops._fused_or_none(x64, norm, w64, b64, 1e-5) is None
    assert ops.status()["cpu"].endswith(
        "with a gradient, a Python autograd function (no C++ autograd node: c++ failed: simulated)"
    )
    assert ops.paths()["cpu"]["a gradient needed"].startswith(
        "the fused C kernel and its backward in a Python"
    )


@needs_extension
def test_status_and_paths_say_a_gradient_takes_the_cpp_node():
    assert ops.status()["cpu"].endswith("; with a gradient, one C++ autograd node")
    assert "one C++ autograd node" in ops.paths()["cpu"]["a gradient needed"]
