"""The RMSNorm kernels: the fused CPU path, dispatch, the custom op and its backward."""

import subprocess
import sys

import pytest
import torch

import enjoyln
from enjoyln import ops
from enjoyln.ops import cpu, rms_norm
from enjoyln.ops.reference import rms_norm_reference

SHAPES = [(1, 1), (3, 7), (5, 768), (2, 3, 1000), (64, 4096)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# a few ulps of the output dtype, relative to the output's scale
TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def close(a, b, dtype):
    scale = b.float().abs().max().clamp_min(1.0)
    assert a.dtype == b.dtype == dtype
    assert float((a.float() - b.float()).abs().max() / scale) <= TOL[dtype]


needs_kernel = pytest.mark.skipif(cpu.library() is None, reason="no C compiler for the CPU kernel")


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_cpu_kernel_matches_reference(shape, dtype, affine):
    n = shape[-1]
    x = (torch.randn(shape) * 3 + 0.5).to(dtype)
    w = (torch.rand(n) + 0.5).to(dtype) if affine in ("both", "weight") else None
    b = torch.randn(n).to(dtype) if affine in ("both", "bias") else None
    assert ops.backend(x, w, b) == "cpu"
    close(
        cpu.rms_norm_cpu(x.contiguous(), n, w, b, 1e-6),
        rms_norm_reference(x, (n,), w, b, 1e-6),
        dtype,
    )
    close(rms_norm(x, (n,), w, b, 1e-6), rms_norm_reference(x, (n,), w, b, 1e-6), dtype)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_threads_agree(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, b = torch.randn(333, 257), torch.rand(257), torch.randn(257)
        assert torch.equal(rms_norm(x, (257,), w, b), cpu.rms_norm_cpu(x, 257, w, b, 1e-5))
        close(rms_norm(x, (257,), w, b), rms_norm_reference(x, (257,), w, b), torch.float32)
    finally:
        torch.set_num_threads(old)


def test_unsupported_inputs_take_the_reference_path():
    x = torch.randn(4, 8, dtype=torch.float64)
    assert ops.backend(x) == "reference"
    assert ops.backend(torch.randn(4, 8), torch.rand(8, dtype=torch.float64)) == "reference"
    t = torch.randn(8, 4).t()  # not contiguous: made contiguous, then fused
    close(rms_norm(t, (8,)), rms_norm_reference(t, (8,)), torch.float32)
    y = rms_norm(x, (8,), torch.rand(8, dtype=torch.float64))
    assert y.dtype == torch.float64


def test_multi_axis_normalized_shape():
    x, w, b = torch.randn(2, 3, 4, 5), torch.rand(4, 5), torch.randn(4, 5)
    close(rms_norm(x, (4, 5), w, b), rms_norm_reference(x, (4, 5), w, b), torch.float32)


def test_disabled_kernel_falls_back_and_says_why():
    code = (
        "import os, torch; os.environ['ENJOYLN_DISABLE_CPU_KERNEL'] = '1'\n"
        "from enjoyln import ops\n"
        "print(ops.backend(torch.randn(2, 4))); print(ops.status()['cpu'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines() == [
        "reference",
        "reference PyTorch (no fused kernel: disabled by ENJOYLN_DISABLE_CPU_KERNEL); "
        "with a gradient, the enjoyln.rms_norm op (no C++ autograd node: disabled by "
        "ENJOYLN_DISABLE_CPU_KERNEL)",
    ]


def test_missing_compiler_falls_back(tmp_path):
    code = (
        "import torch\nfrom enjoyln import ops\n"
        "print(ops.backend(torch.randn(2, 4))); print(ops.status()['cpu'])"
    )
    env = {
        "PATH": str(tmp_path),
        "CC": "",
        "ENJOYLN_CACHE": str(tmp_path / "cache"),
        "HOME": str(tmp_path),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert out.splitlines()[0] == "reference" and "no C compiler" in out


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(bias):
    x = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(6, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    fn = (
        (lambda x, w, b: rms_norm(x, (6,), w, b, 1e-5))
        if bias
        else (lambda x, w: rms_norm(x, (6,), w, None, 1e-5))
    )
    assert torch.autograd.gradcheck(fn, inputs)  # one autograd node (C++ where built)
    op = (
        torch.ops.enjoyln.rms_norm
    )  # the op's own backward, which tracers and tensor subclasses get
    assert torch.autograd.gradcheck(lambda x, w, b=None: op(x, [6], w, b, 1e-5), inputs)


def test_backward_in_float32_matches_autograd_of_reference():
    x = torch.randn(4, 33, requires_grad=True)
    w = (torch.rand(33) + 0.5).requires_grad_()
    b = torch.randn(33, requires_grad=True)
    g = torch.randn(4, 33)
    rms_norm(x, (33,), w, b).backward(g)
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    rms_norm_reference(x, (33,), w, b).backward(g)
    for a, t in zip(ours, (x, w, b)):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)


def test_folded_model_trains_like_the_original():
    """Gradients of a folded model equal the original's (centered parameters aside)."""
    from enjoyln.testing import perturb, tiny_model

    model = perturb(tiny_model("gpt2"), seed=3)
    folded = enjoyln.fold(__import__("copy").deepcopy(model))
    ids = torch.randint(0, 128, (2, 9))
    for m in (model, folded):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), q in zip(model.named_parameters(), folded.parameters()):
        if "ln_" in name and name.endswith(("weight", "bias")):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("strict", [False, True])
def test_export_shows_one_custom_op(strict):
    """torch.compile inlines the math for inductor; torch.export, strict or not, must not."""
    rms = enjoyln.RMSNorm(16)
    ep = torch.export.export(rms, (torch.randn(2, 16),), strict=strict)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.enjoyln.rms_norm.default]
    with torch.no_grad():
        out = ep.module()(torch.ones(2, 16))
    close(
        out,
        rms_norm_reference(torch.ones(2, 16), (16,), rms.weight.detach(), rms.bias.detach()),
        torch.float32,
    )


def test_status_names_every_device():
    status = ops.status()
    assert set(status) == {"cpu", "cuda"}
    assert (
        status["cuda"] == "not available"
        or "Triton" in status["cuda"]
        or "reference" in status["cuda"]
    )


def test_paths_name_each_case_and_cuda_s_where_a_gpu_is(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    paths = ops.paths()
    assert set(paths) == {"cpu", "any device"}
    want = "the fused C kernel" if cpu.library() is not None else "reference PyTorch"
    assert paths["cpu"]["bf16/fp16/fp32"] == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ops.paths()["cuda"] == ops.cuda.cases() and len(ops.paths()["cuda"]) == 7


def test_export_keeps_one_node_per_norm_and_decomposes_on_request():
    """torch.export keeps the CompositeImplicitAutograd op as one node per norm; decomposing
    the program turns each into math, or, inside ``ops.opaque()``, into one opaque kernel op
    (what an exporter that decomposes every composite op it does not know gets)."""
    model = torch.nn.Sequential(
        enjoyln.RMSNorm(16),
        torch.nn.Linear(16, 16),
        enjoyln.RMSNorm(16, bias=False),
        torch.nn.GELU(),
        enjoyln.RMSNorm(16, elementwise_affine=False),
    ).eval()
    with torch.no_grad():
        model[0].bias.normal_()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = model(x)
    ep = torch.export.export(model, (x,), strict=False)

    def count(program, op):
        return sum(n.op == "call_function" and n.target == op for n in program.graph.nodes)

    assert count(ep, torch.ops.enjoyln.rms_norm.default) == 3
    with ops.opaque():
        kept = ep.run_decompositions()
    assert count(kept, torch.ops.enjoyln.rms_norm_kernel.default) == 3
    assert count(kept, torch.ops.enjoyln.rms_norm.default) == 0
    math_only = ep.run_decompositions()
    assert not any("enjoyln" in str(n.target) for n in math_only.graph.nodes)
    assert any(n.target == torch.ops.aten.rsqrt.default for n in math_only.graph.nodes)
    with torch.no_grad():
        for program in (ep, kept, math_only):
            torch.testing.assert_close(program.module()(x), want, rtol=1e-6, atol=1e-6)


def test_the_op_runs_the_kernel_on_plain_tensors_and_the_math_on_subclasses(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    ran = []
    real = ops._forward
    monkeypatch.setattr(ops, "_forward", lambda *a: ran.append(a[0].shape) or real(*a))
    x, w, b = torch.randn(3, 8), torch.rand(8), torch.randn(8)
    y = torch.ops.enjoyln.rms_norm(x, [8], w, b, 1e-5)
    assert ran == [(3, 8)]  # the kernel op
    close(y, rms_norm_reference(x, (8,), w, b), torch.float32)
    with FakeTensorMode() as mode:  # a tracer's tensors: the math, whose shape and dtype come out
        y = torch.ops.enjoyln.rms_norm(mode.from_tensor(x), [8], mode.from_tensor(w), None, 1e-5)
    assert y.shape == (3, 8) and y.dtype == torch.float32 and ran == [(3, 8)]


def test_gpt2_with_rms_norms_exports_one_node_per_norm():
    from enjoyln.testing import perturb, tiny_model

    model = perturb(tiny_model("gpt2"), seed=4).eval()
    for name, ln in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]:
        parent, _, attr = name.rpartition(".")  # the swap a fold makes, without its analysis
        setattr(model.get_submodule(parent), attr, enjoyln.RMSNorm.from_layer_norm(ln))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ep = torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.enjoyln.rms_norm.default) == 5  # ln_1, ln_2 of two blocks, ln_f
    assert not any("rsqrt" in str(t) or "rms_norm_kernel" in str(t) for t in targets)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_costs_one_autograd_node_and_keeps_the_kernel_s_output(dtype):
    """With parameters that require grad, the call is the fused kernel as one autograd node (not the
    op's dispatch; C++'s where the extension builds, else a Python Function): the same output
    bits as without a gradient, and gradients as the float64 reference's."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 40, generator=gen) * 2 + 0.3).to(dtype)
    w = torch.nn.Parameter((torch.rand(40, generator=gen) + 0.5).to(dtype))
    b = torch.nn.Parameter(torch.randn(40, generator=gen).to(dtype))
    y = rms_norm(x, (40,), w, b)
    assert y.grad_fn.name() == (
        "torch::autograd::CppNode<EnjoylnRMSNorm>"
        if ops.grad.library() is not None
        else "_FusedBackward"
    )
    with torch.no_grad():
        assert torch.equal(y, rms_norm(x, (40,), w, b))
    g = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(g)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    rms_norm_reference(xd, (40,), wd, bd).backward(g.double())
    assert w.grad.dtype == b.grad.dtype == dtype
    for got, want in ((w.grad, wd.grad), (b.grad, bd.grad)):
        torch.testing.assert_close(
            got.double(), want, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4 * float(want.abs().max())
        )
    xg = x.clone().requires_grad_()
    rms_norm(xg, (40,), w.detach(), None).backward(g)  # the input's gradient, the parameters frozen
    xd.grad = None
    rms_norm_reference(xd, (40,), wd.detach(), None).backward(g.double())
    torch.testing.assert_close(xg.grad.double(), xd.grad, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4)


def test_a_gradient_under_a_tracer_or_a_transform_still_takes_the_op():
    x, w = torch.randn(2, 8), torch.nn.Parameter(torch.rand(8))
    seen = []
    torch.func.vmap(lambda t: seen.append(ops._mode(t, w, None)) or t)(x)
    assert seen == [ops.OP]  # functorch's wrappers: the op, never the kernel's Function


def test_the_cuda_route_for_a_gradient_is_exact():
    """On CUDA a call that needs a gradient is F.rms_norm then the bias add, torch's autograd
    throughout; float64 stays float64 (here on CPU tensors: the same ops)."""
    x = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: ops.cuda.rms_norm_autograd(x, (6,), w, b, 1e-5), (x, w, b)
    )
    torch.testing.assert_close(
        ops.cuda.rms_norm_autograd(x, (6,), w, b, 1e-5),
        rms_norm_reference(x, (6,), w, b),
        rtol=1e-15,
        atol=1e-15,
    )


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("weight_shape,bias_shape", [((4,), None), ((8,), (16,)), ((2, 4), None)])
def test_shapes_that_disagree_with_normalized_shape_are_refused_not_read_past(
    grad, weight_shape, bias_shape
):
    x = torch.randn(3, 8)
    weight = torch.randn(weight_shape).requires_grad_(grad)
    bias = None if bias_shape is None else torch.randn(bias_shape)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.rms_norm(x, (8,), weight, bias)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.enjoyln.rms_norm(x, [8], weight, bias, 1e-5)
