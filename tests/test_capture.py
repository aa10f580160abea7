import pytest
import torch
from torch import nn

import enjoyln
from enjoyln.capture import capture, hf_example_inputs
from enjoyln.testing import tiny_model


def test_plain_module_needs_example_inputs():
    with pytest.raises(enjoyln.CaptureError, match="pass example_inputs"):
        enjoyln.analyze(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))


def test_untraceable_model_names_the_cause():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x
            return -x

    with pytest.raises(enjoyln.CaptureError, match="torch.export could not trace DataDependent") as err:
        enjoyln.analyze(DataDependent(), torch.randn(3))
    assert "\n" not in str(err.value)


def test_wrong_example_inputs_type():
    with pytest.raises(enjoyln.CaptureError, match="example_inputs must be"):
        enjoyln.analyze(nn.Linear(2, 2), "not a tensor")


def test_non_module():
    with pytest.raises(enjoyln.CaptureError, match="expected a torch.nn.Module"):
        enjoyln.analyze(lambda x: x, torch.randn(2))


@pytest.mark.parametrize("arch,keys", [
    ("gpt2", {"input_ids", "use_cache"}),
    ("vit", {"pixel_values"}),
    ("bert", {"input_ids", "use_cache"}),
    ("clip", {"input_ids", "pixel_values"}),
    ("whisper", {"input_features", "decoder_input_ids", "use_cache"}),
])
def test_synthesized_inputs(arch, keys):
    model = tiny_model(arch)
    inputs = hf_example_inputs(model, batch=3, seed=1)
    assert set(inputs) == keys
    if "input_ids" in inputs:
        assert inputs["input_ids"].shape[0] == 3 and int(inputs["input_ids"].max()) < 128
    if "input_features" in inputs:
        assert inputs["input_features"].shape == (3, 16, 64)
    again = hf_example_inputs(model, batch=3, seed=1)
    assert all(torch.equal(inputs[k], again[k]) for k in inputs if isinstance(inputs[k], torch.Tensor))


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
