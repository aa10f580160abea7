"""torch.compile: folded models compile with fullgraph=True (no graph breaks), give the
eager original's outputs, and inductor fuses the RMSNorm with the ops around it."""

import copy
import re

import pytest
import torch
from conftest import assert_same_outputs

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.testing import perturb, tiny_model

pytestmark = pytest.mark.slow


def run_and_get_code(fn, *args, **kwargs):
    # imported when a test runs: torch._dynamo imports Triton, and the interpreter tests
    # (test_triton.py) need Triton imported with TRITON_INTERPRET=1 first, at collection
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn, *args, **kwargs)


def compiled_code(model, inputs):
    """Compile ``model`` with inductor, no graph breaks allowed; (compiled model, its code)."""
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        _, code = run_and_get_code(compiled, **inputs)
    return compiled, "\n".join(code)


def kernels(code):
    """Names of the kernels inductor generated (C++ on CPU, Triton on CUDA)."""
    return re.findall(r"^(cpp_fused_\w+|triton_\w+) = async_compile", code, re.M)


def test_folded_gpt2_compiles_exact_and_fused():
    original = perturb(tiny_model("gpt2"), seed=11)
    folded = enjoyln.fold(copy.deepcopy(original))
    inputs = hf_example_inputs(original, batch=2, seq_len=16)
    compiled, code = compiled_code(folded, inputs)
    assert_same_outputs(original, compiled, inputs, rtol=1e-5)
    assert "enjoyln" not in code  # no opaque call: the norms are inductor's own kernels
    names = kernels(code)
    norm_kernels = [n for n in names if "rsqrt" in n]
    # ln_1 of the first block, ln_2 and ln_1 in between, ln_f: each reads a residual sum
    # computed in the same kernel
    assert len(norm_kernels) >= 3 and all("add" in n for n in norm_kernels), names
    _, original_code = compiled_code(original, inputs)
    assert len(names) <= len(kernels(original_code)), (names, kernels(original_code))


def test_loaded_checkpoint_compiles_exact(tmp_path):
    import transformers

    perturb(tiny_model("gpt2"), seed=12).save_pretrained(tmp_path / "src")
    enjoyln.fold_checkpoint(tmp_path / "src", tmp_path / "out")
    original = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "src").eval()
    loaded = enjoyln.load(tmp_path / "out")
    assert any(isinstance(m, enjoyln.RMSNorm) for m in loaded.modules())
    inputs = hf_example_inputs(original, batch=1, seq_len=24)
    compiled, _ = compiled_code(loaded, inputs)
    assert_same_outputs(original, compiled, inputs, rtol=1e-5)


class AddNorm(torch.nn.Module):
    """A pre-LN block's seam: the residual sum goes on, and into the norm."""

    def __init__(self, n, dtype):
        super().__init__()
        self.norm = enjoyln.RMSNorm(n, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()

    def forward(self, x, residual):
        s = x + residual
        return s, self.norm(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_casts_and_norm_are_one_kernel(dtype):
    block = AddNorm(96, dtype).eval()
    x, r = torch.randn(4, 7, 96).to(dtype), torch.randn(4, 7, 96).to(dtype)
    with torch.no_grad():
        (s, y), code = run_and_get_code(torch.compile(block, fullgraph=True), x, r)
        s_ref, y_ref = block(x, r)  # eager: the C kernel
    code = "\n".join(code)
    assert "enjoyln" not in code and len(kernels(code)) == 1, kernels(code)
    assert torch.equal(s, s_ref) and y.dtype == dtype
    torch.testing.assert_close(
        y, y_ref, **({} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2})
    )


def test_dynamo_sees_one_op_and_inductor_gets_its_math():
    """The mechanism, with no flag to read: dynamo's graph holds ``enjoyln.rms_norm``, a
    CompositeImplicitAutograd op, which AOTAutograd decomposes before inductor sees it. The same
    holds for a compiled exported program, whose graph holds the op."""
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return compile_fx(gm, example_inputs)

    block = AddNorm(96, torch.float32).eval()
    x, r = torch.randn(4, 7, 96), torch.randn(4, 7, 96)
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(block, backend=backend, fullgraph=True), x, r)
        program = torch.export.export(block, (x, r), strict=False).module()
        (s, y), exported_code = run_and_get_code(torch.compile(program, fullgraph=True), x, r)
    assert graphs[0].count("enjoyln.rms_norm") == 1
    for generated in ("\n".join(code), "\n".join(exported_code)):
        assert "enjoyln" not in generated and len(kernels(generated)) == 1, kernels(generated)
    torch.testing.assert_close(y, block(x, r)[1], rtol=1e-5, atol=1e-6)


def test_compiled_norm_trains():
    """Under compile the norm is plain math, so autograd differentiates it directly."""
    block = AddNorm(32, torch.float32)
    x = torch.randn(3, 32, requires_grad=True)
    torch.compile(block, fullgraph=True)(x, torch.zeros(3, 32))[1].square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    block(x, torch.zeros(3, 32))[1].square().sum().backward()  # eager: the custom op's backward
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-6)


def test_cli_bench_compile_reports_compiled_against_compiled(tmp_path):
    import json

    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    # the shapes of the first test, so inductor's cache may serve its graphs
    perturb(tiny_model("gpt2"), seed=13).save_pretrained(tmp_path / "m")
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(tmp_path / "m"),
            "--no-kernels",
            "--no-e2e",
            "--compile",
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--repeats",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    compiled = json.loads(result.stdout)["compiled"]
    assert compiled["latency"]["repeats"] == 2 and compiled["max_rel_diff"] <= 1e-5
    assert compiled["kernels"][1] <= compiled["kernels"][0]
    assert (
        compiled["norm_kernels"] == [5, 5] and compiled["fused_add_norms"] >= 3
    )  # 2 layers: 2·2 + ln_f
