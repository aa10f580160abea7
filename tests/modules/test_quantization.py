"""Weightless norms for quantization tools: the weight of ones they read and fuse, and the guide's
example (docs/quantization.md), run with llmcompressor where it is installed."""

import copy
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import enjoyln
from conftest import assert_same_outputs
from enjoyln import ops
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.testing import perturb, tiny_model
from enjoyln.options import FoldOptions

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "quantization.md"


def opt():
    return perturb(tiny_model("opt", hidden_size=128, word_embed_proj_dim=128, ffn_dim=256), seed=1)


def weightless(model):
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, enjoyln.RMSNorm) and not m.elementwise_affine
    }


def readers(model, plan, name):
    entry = plan[name]
    return [model.get_submodule(f.weight.rpartition(".")[0]) for f in entry.fused]


def fuse_norm_linears(norm, linears):
    """What llmcompressor's ``fuse_norm_linears`` does (0.14): each reader's columns times the
    norm's gain, in float64, cast back; then the gain set to ones, written in place."""
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(
                (linear.weight.to(torch.float64) * norm.weight.to(torch.float64)).to(
                    linear.weight.dtype
                )
            )
        norm.weight.copy_(torch.ones_like(norm.weight))


def test_weightless_norms_have_a_weight_of_ones_outside_the_state_dict():
    model = enjoyln.rotate(opt())
    norms = weightless(model)
    assert len(norms) == 5
    state = model.state_dict()
    for name, norm in norms.items():
        assert norm.weight.shape == (128,) and norm.weight.dtype == torch.float32
        assert torch.equal(norm.weight, torch.ones(128)) and not isinstance(
            norm.weight, nn.Parameter
        )
        assert f"{name}.weight" not in state
    model.load_state_dict(state)  # strict: the state dict is what it was
    model.to(torch.float64)
    assert all(n.weight.dtype == torch.float64 for n in norms.values())


def test_fusing_the_gain_into_the_readers_leaves_the_outputs_unchanged():
    model = opt()
    plan = enjoyln.analyze(model, rotate=("hadamard", 0, True), fuse_affine=True)
    rotated = enjoyln.rotate(copy.deepcopy(model), plan=plan)
    fused = copy.deepcopy(rotated)
    before = {n: p.detach().clone() for n, p in fused.named_parameters()}
    for name, norm in weightless(fused).items():
        fuse_norm_linears(norm, [r for r in readers(fused, plan, name) if isinstance(r, nn.Linear)])
    assert all(
        torch.equal(p, before[n]) for n, p in fused.named_parameters()
    )  # times ones: the same bits
    inputs = hf_example_inputs(model, seed=3)
    assert_same_outputs(model, fused, inputs)
    assert_same_outputs(rotated, fused, inputs, rtol=1e-6)


def test_a_tool_that_rescales_a_norm_gain_is_honoured():
    """AWQ and SmoothQuant divide a norm's gain by per-channel scales and multiply the readers'
    columns by them; the norm must run with the gain the tool wrote, whichever way it writes it."""
    model = opt()
    plan = enjoyln.analyze(model, rotate=("hadamard", 0, True), fuse_affine=True)
    rotated = enjoyln.rotate(copy.deepcopy(model), plan=plan)
    name = "model.decoder.layers.0.self_attn_layer_norm"
    scales = torch.rand(128, generator=torch.Generator().manual_seed(0)) * 1.5 + 0.5
    for write in ("in place", "data"):
        scaled = copy.deepcopy(rotated)
        norm = scaled.get_submodule(name)
        with torch.no_grad():
            if write == "in place":
                norm.weight.div_(scales)
            else:
                norm.weight.data = norm.weight / scales
            for linear in readers(scaled, plan, name):
                linear.weight.mul_(scales)
        assert_same_outputs(rotated, scaled, hf_example_inputs(model, seed=4))


def test_untouched_ones_run_the_weightless_kernel_bit_for_bit():
    """Multiplying by ones can round differently where a norm keeps a bias (the fused kernels use
    a multiply-add): ones nobody wrote must not reach the kernel."""
    torch.manual_seed(0)
    norm = enjoyln.RMSNorm(512, elementwise_affine=False)
    norm.bias = nn.Parameter(torch.randn(512))
    x = torch.randn(64, 512)
    with torch.no_grad():
        plain = ops.rms_norm(x, (512,), None, norm.bias, norm.eps)
        assert torch.equal(norm(x), plain)
        norm.to(torch.float64).to(torch.float32)  # moved and cast back: still the ones as made
        assert torch.equal(norm(x), plain)
        twin = copy.deepcopy(norm)  # a copy runs with its weight: the same values, up to rounding
        torch.testing.assert_close(twin(x), plain)
        norm.weight.fill_(2.0)
        torch.testing.assert_close(
            norm(x), 2 * ops.rms_norm(x, (512,), None, None, norm.eps) + norm.bias
        )


def test_folded_checkpoint_loads_weightless_norms_with_ones(tmp_path):
    model = opt()
    model.save_pretrained(tmp_path / "opt")
    enjoyln.fold_checkpoint(
        tmp_path / "opt",
        tmp_path / "rot",
        FoldOptions.of(rotate=("hadamard", 0, True), check="static"),
    )
    loaded = enjoyln.load(tmp_path / "rot")
    norms = weightless(loaded)
    assert len(norms) == 5 and all(torch.equal(n.weight, torch.ones(128)) for n in norms.values())
    assert not any(f"{name}.weight" in loaded.state_dict() for name in norms)
    assert_same_outputs(model, loaded, hf_example_inputs(model, seed=5))


# --- the guide's example, with llmcompressor ------------------------------------------------------


def _llmcompressor():
    if importlib.util.find_spec("llmcompressor") is None:
        pytest.skip(
            "llmcompressor is not installed (not a dependency of enjoyln; docs/quantization.md "
            "says "
            "which versions were measured)"
        )
    try:
        import llmcompressor

        importlib.import_module("llmcompressor.modeling").fuse_norm_linears  # noqa: B018
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason to skip, stated
        pytest.skip(f"llmcompressor does not import here ({type(exc).__name__}: {exc})")
    return llmcompressor


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_guide_example_rotates_loads_and_quantizes(tmp_path, monkeypatch):
    _llmcompressor()
    from enjoyln.cli.app import app

    model = opt()
    model.save_pretrained(tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    (command,) = _blocks("bash")
    args = shlex.split(command)
    assert args[0] == "enjoyln"
    result = CliRunner().invoke(app, args[1:])
    assert result.exit_code == 0, result.output
    namespace = {}
    exec(compile(_blocks("python")[0], str(GUIDE), "exec"), namespace)  # noqa: S102 - our own guide
    quantized = namespace["model"]
    assert len(weightless(quantized)) == 5
    inputs = hf_example_inputs(model, seed=6)
    with torch.no_grad():
        ref, out = model(**inputs).logits, quantized(**inputs).logits
    rel = float((ref - out).abs().max() / ref.abs().max())
    assert 0 < rel < 0.02  # 8-bit weights: close, and not the unquantized model


def test_llmcompressor_fuses_a_weightless_norm_exactly():
    _llmcompressor()
    from llmcompressor.modeling import fuse_norm_linears as real_fuse

    model = opt()
    plan = enjoyln.analyze(model, rotate=("hadamard", 0, True), fuse_affine=True)
    rotated = enjoyln.rotate(copy.deepcopy(model), plan=plan)
    fused = copy.deepcopy(rotated)
    for name, norm in weightless(fused).items():
        real_fuse(norm, [r for r in readers(fused, plan, name) if isinstance(r, nn.Linear)])
    assert_same_outputs(rotated, fused, hf_example_inputs(model, seed=7), rtol=1e-6)


def test_llmcompressor_quantizes_the_plain_loaded_rotation_and_saves_it(tmp_path):
    """The serving path of the guide: plain from_pretrained of a keep-mean rotation, oneshot, and a
    compressed checkpoint that reloads to the same model."""
    _llmcompressor()
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = opt()
    model.save_pretrained(tmp_path / "opt")
    enjoyln.fold_checkpoint(
        tmp_path / "opt",
        tmp_path / "rot",
        FoldOptions.of(rotate=("hadamard", 0, True), check="static"),
    )
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "rot").eval()
    quantized = oneshot(
        model=plain,
        recipe=QuantizationModifier(targets="Linear", scheme="W8A16", ignore=["lm_head"]),
    )
    quantized.save_pretrained(tmp_path / "w8a16", save_compressed=True)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w8a16").eval()
    inputs = hf_example_inputs(model, seed=8)
    with torch.no_grad():
        ref, out, back = (m(**inputs).logits for m in (model, quantized, reloaded))
    assert 0 < float((ref - out).abs().max() / ref.abs().max()) < 0.02
    assert torch.equal(out, back)
