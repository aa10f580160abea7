"""ONNX export: native RMSNorm ops, onnx.checker, and onnxruntime against PyTorch."""

import copy
import sys

import pytest
import torch

import enjoyln
from enjoyln.testing import perturb, tiny_model

for name in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(name, reason=f"{name} is not installed (pip install 'enjoyln[onnx]')")

import onnx  # noqa: E402

from enjoyln.onnx_export import export_onnx  # noqa: E402


@pytest.fixture(scope="module", params=["gpt2", "bert", "vit"])
def folded(request):
    model = perturb(tiny_model(request.param), seed=41)
    return request.param, enjoyln.analyze(model), enjoyln.fold(copy.deepcopy(model))


@pytest.mark.parametrize("opset,op", [(23, "RMSNormalization"), (18, "SimplifiedLayerNormalization")])
def test_one_rms_op_per_folded_ln_and_no_layer_norm_for_them(folded, opset, op, tmp_path):
    arch, plan, model = folded
    report = export_onnx(model, tmp_path / "m.onnx", opset=opset)
    proto = onnx.load(tmp_path / "m.onnx")
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count(op) == len(plan.foldable) == report.rms_norm_nodes
    assert ops.count("LayerNormalization") == len(plan.layer_norms) - len(plan.foldable)
    # no Pow/ReduceMean/Sqrt chain stands in for the norm
    assert "ReduceMean" not in ops and "Sqrt" not in ops
    assert report.checked and report.passed and report.max_rel_diff < 1e-4
    # the LN bias follows the norm as an Add
    norm_outputs = {n.output[0] for n in proto.graph.node if n.op_type == op}
    adds = [n for n in proto.graph.node if n.op_type == "Add" and set(n.input) & norm_outputs]
    assert len(adds) == len(plan.foldable)


def test_rms_norm_without_affine_exports(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), enjoyln.RMSNorm(8, elementwise_affine=False)).eval()
    report = export_onnx(net, tmp_path / "n.onnx", torch.randn(3, 8))
    assert report.rms_norm_nodes == 1 and report.passed


def test_missing_extra_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(enjoyln.EnjoylnError, match=r"pip install 'enjoyln\[onnx\]'"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx", torch.randn(1, 2))


@pytest.mark.parametrize("opset,message", [(17, "opset 17 is too old"), (99, "opset 99 is newer")])
def test_unusable_opset_is_refused_and_leaves_no_file(tmp_path, opset, message):
    with pytest.raises(enjoyln.EnjoylnError, match=message):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx", torch.randn(1, 2), opset=opset)
    assert list(tmp_path.iterdir()) == []


def test_cli_export_folds_then_exports(tmp_path):
    from typer.testing import CliRunner

    from enjoyln.cli import app

    src = tmp_path / "vit"
    perturb(tiny_model("vit"), seed=42).save_pretrained(src)
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(src), str(tmp_path / "v.onnx"), "--opset", "18"])
    assert result.exit_code == 0, result.output
    assert "5 RMSNorm ops, 0 LayerNormalization ops" in result.output and "matches" in result.output
    result = runner.invoke(app, ["export", str(src), str(tmp_path / "v.onnx")])
    assert result.exit_code == 2 and "--force" in result.stderr
