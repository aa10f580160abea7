"""Auxiliary centering: where it pays off, where it must be refused, and persistence."""

import copy
import json

import pytest
import torch
import transformers

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.testing import perturb, tiny_model
from conftest import assert_same_outputs, steps_keep_their_promise
from enjoyln.options import FoldOptions

L = 2


@pytest.fixture(scope="module", params=["bloom", "whisper", "clip"])
def case(request):
    model = perturb(tiny_model(request.param), seed=61)
    return request.param, model, enjoyln.analyze(model, auxiliary_centering=True)


def test_counts_and_placement(case):
    arch, _, plan = case
    if arch == "bloom":
        assert len(plan.foldable) == len(plan.layer_norms) == 2 * L + 2
        assert [(a.module, a.where) for a in plan.auxiliary] == [
            ("transformer.word_embeddings_layernorm", "output")
        ]
        assert "1 inserted, 5 more LNs foldable" in plan.notes[0]
    if arch == "whisper":
        encoder = [e for e in plan.layer_norms if e.name.startswith("model.encoder")]
        assert len(encoder) == 2 * L + 1 and all(e.foldable for e in encoder)
        assert [(a.module, a.where) for a in plan.auxiliary] == [
            ("model.encoder.layers.0", "input")
        ]
    if arch == "clip":  # the vision tower's hidden state is not served: it may change
        assert [(a.module, a.where) for a in plan.auxiliary] == [
            ("vision_model.pre_layrnorm", "output")
        ]
        assert len(plan.foldable) == len(plan.layer_norms) == 2 * (2 * L + 1) + 1
        assert plan.changed_outputs == ["vision_model_output.last_hidden_state"]


def test_keeping_every_output_exact_refuses_the_centering():
    model = perturb(tiny_model("clip"), seed=61)
    plan = enjoyln.analyze(model, auxiliary_centering=True, exact_outputs="all")
    assert plan.auxiliary == [] and len(plan.foldable) == (2 * L + 1) + 1
    vision_kept = [e for e in plan.layer_norms if e.name.startswith("vision") and not e.foldable]
    assert vision_kept and all(
        "vision_model.pre_layrnorm would not help" in e.reason
        and "`vision_model_output.last_hidden_state`" in e.reason
        for e in vision_kept
    )
    assert plan.changed_outputs == [] and plan.exact_outputs == "all"


def test_fold_is_exact(case):
    arch, model, plan = case
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert sum(isinstance(m, enjoyln.RMSNorm) for m in folded.modules()) == len(plan.foldable)
    for seed in (62, 63):
        inputs = hf_example_inputs(model, seed=seed, seq_len=12)
        assert_same_outputs(model, folded, inputs, skip=plan.changed_outputs)
    assert enjoyln.check(model, folded, plan=plan).passed
    if plan.changed_outputs:  # compared, the tower's hidden state differs
        assert not enjoyln.check(model, folded).passed


def test_every_step_keeps_its_promise_with_centering():
    model = perturb(tiny_model("bloom"), seed=64)
    plan = enjoyln.analyze(model, auxiliary_centering=True)
    inputs = hf_example_inputs(model, seed=65)
    assert steps_keep_their_promise(model, plan, inputs) == []


def test_refused_where_the_stream_is_an_output():
    """A BLOOM returning its hidden states cannot take the centering after the
    embedding LN; only after the last layer's attention is it still safe."""
    model = perturb(tiny_model("bloom"), seed=66)
    inputs = {"input_ids": torch.randint(0, 128, (2, 8)), "output_hidden_states": True}
    served = enjoyln.analyze(model, inputs, auxiliary_centering=True)
    # the hidden states are not what a model with logits serves: by default they may change
    assert [(a.module, a.where) for a in served.auxiliary] == [
        ("transformer.word_embeddings_layernorm", "output")
    ]
    assert len(served.foldable) == 2 * L + 2 and "hidden_states.1" in served.changed_outputs
    plan = enjoyln.analyze(model, inputs, auxiliary_centering=True, exact_outputs="all")
    assert [(a.module, a.where) for a in plan.auxiliary] == [
        ("transformer.h.1.self_attention", "output")
    ]
    assert (
        "would also change the model output `hidden_states.0`"
        in plan["transformer.h.0.input_layernorm"].reason
    )
    assert len(plan.foldable) == 3
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert_same_outputs(model, folded, inputs)


def test_checkpoint_round_trip_with_centering(tmp_path):
    src = tmp_path / "bloom"
    perturb(tiny_model("bloom"), seed=67).save_pretrained(src)
    result = enjoyln.fold_checkpoint(
        src, tmp_path / "out", FoldOptions.of(auxiliary_centering=True)
    )
    config = json.loads((result.out_dir / "config.json").read_text())
    assert config["enjoyln"]["auxiliary_centering"] == [
        {"module": "transformer.word_embeddings_layernorm", "where": "output"}
    ]
    original = transformers.BloomForCausalLM.from_pretrained(src).eval()
    plain = transformers.BloomForCausalLM.from_pretrained(
        result.out_dir
    ).eval()  # no hooks, LNs kept
    loaded = enjoyln.load(result.out_dir)
    assert sum(isinstance(m, enjoyln.RMSNorm) for m in loaded.modules()) == 2 * L + 2
    inputs = hf_example_inputs(original, seed=68)
    assert_same_outputs(original, plain, inputs)
    assert_same_outputs(original, loaded, inputs)
    report = enjoyln.check(original, loaded)
    assert report.passed and report.generation.passed


def test_cli_flag(tmp_path):
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    src = tmp_path / "bloom"
    perturb(tiny_model("bloom"), seed=69).save_pretrained(src)
    result = CliRunner().invoke(app, ["inspect", str(src), "--auxiliary-centering"])
    assert result.exit_code == 0
    assert "6 of 6 LayerNorms foldable" in result.output
    assert (
        "an auxiliary centering at the output of transformer.word_embeddings_layernorm"
        in result.output
    )
