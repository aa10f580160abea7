"""ONNX export: native RMSNorm ops, dynamic shapes checked in onnxruntime against PyTorch,
onnxruntime's transformer optimizer, and the fused-affine form."""

import copy
import sys

import numpy as np
import pytest
import torch

import enjoyln
from enjoyln.testing import perturb, tiny_model

for name in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(name, reason=f"{name} is not installed (pip install 'enjoyln[onnx]')")

import onnx  # noqa: E402

from enjoyln.analysis.inputs import Inputs  # noqa: E402
from enjoyln.export.onnx import export_onnx, ort_session, second_shape  # noqa: E402
from enjoyln.export.optimize import RMS_OPS  # noqa: E402
from enjoyln.options import FoldOptions


class Exports:
    """One tiny model: the plan, and three exports (folded fused-affine as is; original and
    folded fused-affine through onnxruntime's optimizer)."""

    def __init__(self, arch, tmp):
        self.arch = arch
        self.original = perturb(tiny_model(arch), seed=41)
        self.plan = enjoyln.analyze(self.original, fuse_affine=True)
        self.folded = enjoyln.fold(copy.deepcopy(self.original), plan=self.plan)
        self.paths = {k: tmp / f"{arch}-{k}.onnx" for k in ("plain", "original_opt", "folded_opt")}
        self.plain = export_onnx(self.folded, self.paths["plain"])
        self.original_opt = export_onnx(self.original, self.paths["original_opt"], optimize=True)
        self.folded_opt = export_onnx(self.folded, self.paths["folded_opt"], optimize=True)


@pytest.fixture(scope="module", params=["gpt2", "bert", "vit"])
def exports(request, tmp_path_factory):
    return Exports(request.param, tmp_path_factory.mktemp(request.param))


TEXT_AXES = {
    "input_ids": ["batch_size", "sequence_length"],
    "attention_mask": ["batch_size", "sequence_length"],
}


def test_dynamic_axes_have_optimums_names(exports):
    inputs = exports.plain.inputs
    if exports.arch == "vit":
        assert inputs == {"pixel_values": ["batch_size", 3, 32, 32]}  # ViT checks its image size
        assert exports.plain.outputs == {"logits": ["batch_size", 5]}
    else:
        assert {k: inputs[k] for k in TEXT_AXES} == TEXT_AXES
        assert ("token_type_ids" in inputs) == (exports.arch == "bert")
        out = "logits" if exports.arch == "gpt2" else "last_hidden_state"
        assert exports.plain.outputs[out][:2] == ["batch_size", "sequence_length"]


@pytest.mark.parametrize("which", ["plain", "original_opt", "folded_opt"])
def test_onnxruntime_matches_pytorch_at_the_traced_and_a_second_shape(exports, which):
    report = getattr(exports, which)
    first, second = report.shapes
    key = "pixel_values" if exports.arch == "vit" else "input_ids"
    assert second[key][0] != first[key][0]  # another batch size
    if exports.arch != "vit":
        assert second[key][1] != first[key][1]  # and another sequence length
    assert report.checked and report.passed
    assert report.max_rel_diff < 1e-4
    if report.optimized:
        assert report.optimized_max_rel_diff < 1e-4


@pytest.mark.parametrize("which", ["plain", "folded_opt"])
def test_the_written_file_runs_at_a_third_shape(exports, which):
    """Independent of the report: run the file on disk at batch 5 (and 7 tokens) against PyTorch."""
    model = exports.folded
    if exports.arch == "vit":
        feed = {"pixel_values": torch.randn(5, 3, 32, 32)}
    else:
        ids = torch.randint(0, model.config.vocab_size, (5, 7))
        mask = torch.ones_like(ids)
        mask[0, 4:] = 0
        feed = {"input_ids": ids, "attention_mask": mask}
        if exports.arch == "bert":
            feed["token_type_ids"] = torch.randint(0, 2, (5, 7))
    session = ort_session(exports.paths[which])
    got = session.run(None, {k: v.numpy() for k, v in feed.items()})[0]
    with torch.no_grad():
        want = model(**feed)[0].numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_optimizer_fuses_rms_forms_where_the_original_has_skip_layer_norm(exports):
    orig, fold = exports.original_opt.optimized_ops, exports.folded_opt.optimized_ops
    count = lambda ops, name: ops.get(name, 0)  # noqa: E731
    assert count(orig, "SkipLayerNormalization") == 4  # 2 layers x 2 residual sums
    assert count(orig, "SkipSimplifiedLayerNormalization") == 0
    # every norm is still one op, in the same family as before, fused with the same Adds
    assert sum(count(fold, o) for o in RMS_OPS) == len(exports.plan.foldable)
    assert count(fold, "SkipSimplifiedLayerNormalization") + count(
        fold, "SkipLayerNormalization"
    ) == count(orig, "SkipLayerNormalization")
    assert count(fold, "SimplifiedLayerNormalization") + count(fold, "LayerNormalization") == count(
        orig, "LayerNormalization"
    )
    if exports.arch == "bert":
        # post-LN: only the embedding LN folds, and it sits after no residual sum
        assert count(fold, "SkipSimplifiedLayerNormalization") == 0
        assert count(fold, "SimplifiedLayerNormalization") == 1
    else:
        assert count(fold, "SkipSimplifiedLayerNormalization") == 4
        assert count(fold, "SkipLayerNormalization") == count(fold, "LayerNormalization") == 0
    assert exports.folded_opt.skip_fused == exports.folded_opt.skip_candidates == 4
    assert exports.folded_opt.notes == []
    # linear biases go into SkipSimplifiedLayerNormalization as into SkipLayerNormalization
    proto = onnx.load(exports.paths["folded_opt"])
    produced = {o: n for n in proto.graph.node for o in n.output}
    constants = {i.name for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization":
            for name in node.input[:2]:
                add = produced.get(name)
                if (
                    add is not None and add.op_type == "Add"
                ):  # a residual sum, not a linear layer's bias
                    parents = {produced[i].op_type for i in add.input if i in produced}
                    assert not ("MatMul" in parents and set(add.input) & constants)
    # so the folded graph has no more Adds than the original's and its norms' kept β
    # (GPT-2's optimizer turns Gemm into MatMul + Add after LayerNorm forms only)
    extra = count(fold, "Add") - count(orig, "Add")
    assert extra == exports.folded_opt.rms_bias_adds if exports.arch != "gpt2" else extra <= 1


def test_fused_affine_norms_export_as_one_op_with_no_add(exports):
    proto = onnx.load(exports.paths["plain"])
    rms = [n for n in proto.graph.node if n.op_type == "RMSNormalization"]
    assert len(rms) == len(exports.plan.foldable) == exports.plain.rms_norm_nodes
    assert not any(
        n.op_type in ("LayerNormalization", "ReduceMean", "Sqrt") and n.name.startswith("node_rms")
        for n in proto.graph.node
    )
    outputs = {n.output[0] for n in rms}
    adds = [n for n in proto.graph.node if n.op_type == "Add" and set(n.input) & outputs]
    weightless = [e for e in exports.plan.foldable if e.weightless]
    assert len(adds) == len(exports.plan.foldable) - len(weightless) == exports.plain.rms_bias_adds
    expected_weightless = {"gpt2": 4, "bert": 0, "vit": 5}[
        exports.arch
    ]  # GPT-2's ln_f keeps β/γ; BERT's
    assert len(weightless) == expected_weightless  # embedding LN feeds the stream
    # a weightless norm's scale is a constant of ones, not a computed tensor
    constants = {i.name: i for i in proto.graph.initializer}
    for node in rms:
        assert node.input[1] in constants


@pytest.mark.parametrize(
    "opset,op", [(23, "RMSNormalization"), (18, "SimplifiedLayerNormalization")]
)
def test_plain_fold_has_one_rms_op_and_a_bias_add_per_folded_ln(opset, op, tmp_path):
    model = perturb(tiny_model("vit"), seed=41)
    plan = enjoyln.analyze(model)
    report = export_onnx(enjoyln.fold(copy.deepcopy(model)), tmp_path / "m.onnx", opset=opset)
    proto = onnx.load(tmp_path / "m.onnx")
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count(op) == len(plan.foldable) == report.rms_norm_nodes == 5
    assert "LayerNormalization" not in ops and "ReduceMean" not in ops and "Sqrt" not in ops
    assert report.passed and report.max_rel_diff < 1e-4
    norm_outputs = {n.output[0] for n in proto.graph.node if n.op_type == op}
    adds = [n for n in proto.graph.node if n.op_type == "Add" and set(n.input) & norm_outputs]
    assert len(adds) == report.rms_bias_adds == 5


def test_rms_norm_without_affine_exports_with_a_dynamic_batch(tmp_path):
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 8), enjoyln.RMSNorm(8, elementwise_affine=False)
    ).eval()
    report = export_onnx(net, tmp_path / "n.onnx", torch.randn(3, 8))
    assert report.rms_norm_nodes == 1 and report.rms_bias_adds == 0 and report.passed
    assert report.inputs == {"input": ["batch_size", 8]}
    assert [s["arg0"] for s in report.shapes] == [[3, 8], [4, 8]]


def test_a_traced_batch_of_one_still_gives_a_dynamic_axis(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), enjoyln.RMSNorm(8)).eval()
    report = export_onnx(net, tmp_path / "n.onnx", torch.randn(1, 8))
    assert report.inputs == {"input": ["batch_size", 8]} and report.passed


def test_static_export_keeps_the_traced_shape(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), enjoyln.RMSNorm(8)).eval()
    report = export_onnx(net, tmp_path / "n.onnx", torch.randn(3, 8), dynamic=False)
    assert report.inputs == {"input": [3, 8]} and report.passed


class FixedBatch(torch.nn.Module):
    def forward(self, x):
        return x.reshape(3, 2, 4).sum(1)


def test_a_model_that_fixes_its_batch_is_a_clear_error(tmp_path):
    with pytest.raises(enjoyln.EnjoylnError, match=r"static shape.*--static"):
        export_onnx(FixedBatch(), tmp_path / "x.onnx", torch.randn(3, 8))
    assert list(tmp_path.iterdir()) == []


def test_second_shape_grows_the_batch_shortens_the_rest_and_pads_the_mask():
    ids = torch.randint(0, 50, (2, 16))
    first = Inputs(
        (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    )
    axes = {
        "input_ids": ["batch_size", "sequence_length"],
        "attention_mask": ["batch_size", "sequence_length"],
    }
    second = second_shape(first, axes)
    assert second.kwargs["input_ids"].shape == second.kwargs["attention_mask"].shape == (3, 12)
    assert second.kwargs["use_cache"] is False
    assert int(second.kwargs["input_ids"].max()) <= int(ids.max())
    mask = second.kwargs["attention_mask"]
    assert mask[:-1].all() and mask[-1, :9].all() and not mask[-1, 9:].any()


def test_missing_extra_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(enjoyln.EnjoylnError, match=r"pip install 'enjoyln\[onnx\]'"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx", torch.randn(1, 2))


@pytest.mark.parametrize("opset,message", [(17, "opset 17 is too old"), (99, "opset 99 is newer")])
def test_unusable_opset_is_refused_and_leaves_no_file(tmp_path, opset, message):
    with pytest.raises(enjoyln.EnjoylnError, match=message):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx", torch.randn(1, 2), opset=opset)
    assert list(tmp_path.iterdir()) == []


def test_cli_export_fuse_affine_optimize(tmp_path):
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    src = tmp_path / "vit"
    perturb(tiny_model("vit"), seed=42).save_pretrained(src)
    runner = CliRunner()
    result = runner.invoke(
        app, ["export", str(src), str(tmp_path / "v.onnx"), "--fuse-affine", "--optimize"]
    )
    assert result.exit_code == 0, result.output
    assert "(opset 22): 5 RMSNorm ops, 0 LayerNormalization ops" in result.output
    assert "pixel_values [batch_size, 3, 32, 32]" in result.output
    assert "SimplifiedLayerNormalization 1, SkipSimplifiedLayerNormalization 4" in result.output
    assert "fused 4 of 4 residual Add + norm pairs" in result.output
    assert result.output.count("matches PyTorch") == 2
    ops = [n.op_type for n in onnx.load(tmp_path / "v.onnx").graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary debris
    result = runner.invoke(app, ["export", str(src), str(tmp_path / "v.onnx")])
    assert result.exit_code == 2 and "--force" in result.stderr


def test_cli_export_refuses_fuse_affine_on_a_plainly_folded_directory(tmp_path):
    from typer.testing import CliRunner

    from enjoyln.rewrite.convert import fold_checkpoint
    from enjoyln.cli.app import app

    src = tmp_path / "gpt2"
    perturb(tiny_model("gpt2"), seed=42).save_pretrained(src)
    fold_checkpoint(src, tmp_path / "folded", FoldOptions.of(check="none"))
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "folded"), str(tmp_path / "g.onnx"), "--fuse-affine"]
    )
    assert result.exit_code == 2
    assert "was folded without --fuse-affine" in result.stderr
    assert not (tmp_path / "g.onnx").exists()


def test_a_nan_or_inf_where_pytorch_is_finite_is_a_difference(tmp_path):
    """max(worst, nan) is worst: a NaN output would have passed the export's own check."""
    from enjoyln.export.onnx import compare_with_onnxruntime

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).eval()
    x = torch.randn(2, 8)
    export_onnx(net, tmp_path / "net.onnx", x, dynamic=False)
    want = net(x).detach()
    assert compare_with_onnxruntime(tmp_path / "net.onnx", [Inputs((x,), {})], [[want]]) < 1e-5
    for bad in (float("nan"), float("inf")):
        wrong = want.clone()
        wrong[1, 3] = bad
        assert compare_with_onnxruntime(
            tmp_path / "net.onnx", [Inputs((x,), {})], [[wrong]]
        ) == float("inf")
    shifted = want + 100  # a real difference still measures as one
    assert compare_with_onnxruntime(tmp_path / "net.onnx", [Inputs((x,), {})], [[shifted]]) > 0.5


def test_an_exporter_that_decomposes_the_op_still_writes_one_norm_each(tmp_path):
    """Older torch's ONNX exporter decomposes every composite op outside ATen, enjoyln::rms_norm
    too; inside ``ops.opaque()`` that decomposition is the opaque enjoyln::rms_norm_kernel, which
    the translation table also maps. Emulated here by leaving enjoyln::rms_norm out of the table."""
    from enjoyln.export.onnx import translation
    from enjoyln.ops import opaque

    model = torch.nn.Sequential(
        enjoyln.RMSNorm(16), torch.nn.Linear(16, 16), enjoyln.RMSNorm(16)
    ).eval()
    with (
        torch.no_grad(),
        opaque(),
    ):  # optimize=False: onnxscript's optimizer would fuse the math back
        program = torch.onnx.export(
            model,
            (torch.randn(2, 16),),
            dynamo=True,
            opset_version=23,
            optimize=False,
            custom_translation_table={torch.ops.enjoyln.rms_norm_kernel.default: translation(23)},
        )
    nodes = [str(n.target) for n in program.exported_program.graph.nodes if n.op == "call_function"]
    assert nodes.count("enjoyln.rms_norm_kernel.default") == 2 and "aten.rsqrt.default" not in nodes
    ops = [n.op_type for n in program.model_proto.graph.node]
    assert ops.count("RMSNormalization") == 2 and "ReduceMean" not in ops and "Sqrt" not in ops
