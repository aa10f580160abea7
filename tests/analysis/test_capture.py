import copy

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

import enjoyln
from enjoyln.analysis.capture import capture
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.testing import perturb, tiny_model
from enjoyln.options import CheckOptions


def test_plain_module_needs_example_inputs():
    with pytest.raises(enjoyln.CaptureError, match="pass example_inputs"):
        enjoyln.analyze(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))


class Branchy(nn.Module):
    """An LN behind Python control flow on the input's values."""

    def __init__(self):
        super().__init__()
        self.proj, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        y = self.proj(x)
        if x.sum() > 0:  # data-dependent control flow
            return self.ln(y)
        return y


def test_data_dependent_branch_is_specialized_and_said():
    """torch.export refuses `if x.sum() > 0:`; draft_export traces the example's branch,
    and the plan says the proof covers only inputs that take it."""
    model = perturb(Branchy()).eval()
    x = torch.randn(4, 8).abs()
    cap = capture(model, x)
    assert len(cap.specialized) == 1
    assert "if x.sum() > 0:" in cap.specialized[0] and "test_capture.py" in cap.specialized[0]
    plan = enjoyln.analyze(model, x)
    assert [e.name for e in plan.foldable] == ["ln"]
    assert any("same data-dependent branches" in n and "x.sum() > 0" in n for n in plan.notes)
    assert "if x.sum() > 0:" in plan.summary()
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert enjoyln.check(model, folded, x, CheckOptions(batches=1)).passed
    # the other branch returns the centered projection itself: check catches it
    assert not enjoyln.check(model, folded, -x, CheckOptions(batches=1)).passed


class Packed(PreTrainedModel):
    """Tokens of several images packed in one sequence, attended image by image: split by lengths
    read from the data, as Qwen's vision towers do, which torch.export cannot follow."""

    config_class = PretrainedConfig

    def __init__(self):
        super().__init__(PretrainedConfig())
        self.proj, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def attend(self, x, lengths):
        parts = torch.split(x, lengths.tolist())
        return torch.cat([p.softmax(0) * p if p.shape[0] > 1 else p for p in parts])

    def forward(self, x, lengths):
        return self.ln(self.attend(self.proj(x), lengths))


def _equal_lengths(original):
    """A patch in the manner of transformers' export patches: images of one size, as a batch."""

    def attend(self, x, lengths):
        p = x.unflatten(0, (lengths.shape[0], -1))
        return (p.softmax(1) * p).flatten(0, 1)

    return attend


def test_a_split_by_data_is_traced_under_transformers_export_patches(monkeypatch):
    """torch.export refuses the split; the capture retries under transformers' export patches
    (registered per class in transformers.exporters), and the plan says so."""
    from transformers.exporters import exporter_dynamo  # noqa: F401 - registers its own first
    from transformers.exporters import utils

    path = f"{Packed.__module__}.{Packed.__qualname__}"
    monkeypatch.setitem(utils._PATCHES, "dynamo", [(path, "attend", _equal_lengths)])
    model = perturb(Packed()).eval()
    inputs = (torch.randn(6, 8), torch.tensor([3, 3]))
    original = Packed.attend
    cap = capture(model, inputs)
    assert cap.patched and cap.specialized == [] and Packed.attend is original  # restored
    assert not [n for n in cap.graph.nodes if "split" in str(n.target)]
    plan = enjoyln.analyze(model, inputs)
    assert any("transformers' export patches" in n for n in plan.notes)


def test_plain_export_records_no_specialization():
    cap = capture(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), torch.randn(2, 4))
    assert cap.specialized == []


def test_plain_export_skips_stack_traces_and_restores_the_setting():
    """Stack traces and eager code generation are about half of torch.export's time and nothing
    reads them; the global setting is the user's again afterwards, also after a failed trace, and
    the program still runs (its code is generated when first called)."""
    model = perturb(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))).eval()
    x = torch.randn(2, 4)
    for before in (False, True):
        torch.fx.config.do_not_emit_stack_traces = before
        try:
            cap = capture(model, x)
            with pytest.raises(enjoyln.CaptureError):
                capture(model, torch.randn(2, 5))
            assert torch.fx.config.do_not_emit_stack_traces is before
        finally:
            torch.fx.config.do_not_emit_stack_traces = False
        calls = [n for n in cap.graph.nodes if n.op == "call_function"]
        assert calls and all(not n.meta.get("stack_trace") for n in calls)
        assert torch.equal(cap.program.module()(x), model(x))
        assert "layer_norm" in cap.program.graph_module.code


def test_export_generates_the_graphs_code_once_not_after_each_pass(monkeypatch):
    made = []
    python_code = torch.fx.graph.Graph.python_code

    def counted(self, *args, **kwargs):
        made.append(self)
        return python_code(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.graph.Graph, "python_code", counted)
    capture(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).eval(), torch.randn(2, 4))
    assert len(made) <= 1  # torch.export's passes recompile six times when eager


def test_untraceable_model_names_both_causes_on_one_line():
    class FailsOnExample(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent, and the example takes the failing branch
                raise ValueError("positive inputs are not supported")
            return x

    with pytest.raises(
        enjoyln.CaptureError, match="torch.export could not trace FailsOnExample"
    ) as err:
        enjoyln.analyze(FailsOnExample(), torch.ones(3))
    message = str(err.value)
    assert "\n" not in message
    assert "draft_export" in message and "positive inputs are not supported" in message
    # both failures point into the model's code
    assert "(at tests/analysis/test_capture.py:" in message or "test_capture.py:" in message
    assert "`if x.sum() > 0:" in message and "`raise ValueError(" in message


def test_non_data_dependent_failure_is_not_retried():
    class Unsupported(nn.Module):
        def forward(self, x):
            return torch.from_numpy(x.numpy())  # leaves the tracer's world

    with pytest.raises(
        enjoyln.CaptureError, match="torch.export could not trace Unsupported"
    ) as err:
        enjoyln.analyze(Unsupported(), torch.ones(3))
    assert "draft_export" not in str(err.value) and "\n" not in str(err.value)


def test_wrong_example_inputs_type():
    with pytest.raises(enjoyln.CaptureError, match="example_inputs must be"):
        enjoyln.analyze(nn.Linear(2, 2), "not a tensor")


def test_non_module():
    with pytest.raises(enjoyln.CaptureError, match="expected a torch.nn.Module"):
        enjoyln.analyze(lambda x: x, torch.randn(2))


@pytest.mark.parametrize(
    "arch,keys",
    [
        ("gpt2", {"input_ids", "use_cache"}),
        ("vit", {"pixel_values"}),
        ("bert", {"input_ids", "use_cache"}),
        ("clip", {"input_ids", "pixel_values"}),
        ("whisper", {"input_features", "decoder_input_ids", "use_cache"}),
    ],
)
def test_synthesized_inputs(arch, keys):
    model = tiny_model(arch)
    inputs = hf_example_inputs(model, batch=3, seed=1)
    assert set(inputs) == keys
    if "input_ids" in inputs:
        assert inputs["input_ids"].shape[0] == 3 and int(inputs["input_ids"].max()) < 128
    if "input_features" in inputs:
        assert inputs["input_features"].shape == (3, 16, 64)
    again = hf_example_inputs(model, batch=3, seed=1)
    assert all(
        torch.equal(inputs[k], again[k]) for k in inputs if isinstance(inputs[k], torch.Tensor)
    )


def test_tied_parameters_detected_by_identity():
    cap = capture(tiny_model("gpt2"))
    assert set(cap.aliases["lm_head.weight"]) == {"lm_head.weight", "transformer.wte.weight"}
    assert cap.output_names == ["logits"]


def test_meta_device_analysis_matches_real():
    import transformers

    config = tiny_model("gpt2").config
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(config).eval()
    plan = enjoyln.analyze(meta)
    assert len(plan.foldable) == 5 and plan.untied[0].param == "lm_head.weight"


def test_a_failure_retracing_the_program_is_one_line(monkeypatch):
    """run_decompositions retraces a draft_export program, and can disagree with the example's
    values (Cosmos3)."""
    import importlib

    from enjoyln.errors import CaptureError

    capture_mod = importlib.import_module("enjoyln.analysis.capture")

    def mismatch(self, table):
        raise RuntimeError("Real tensor propagation found a metadata mismatch\nand more")

    monkeypatch.setattr(capture_mod, "_functionalize", lambda graph: False)
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", mismatch)
    with pytest.raises(CaptureError) as err:
        capture_mod.capture(torch.nn.Linear(4, 4), torch.randn(2, 4))
    assert str(err.value) == (
        "torch.export could not functionalize the graph of Linear: RuntimeError: Real tensor "
        "propagation found a metadata mismatch"
    )
