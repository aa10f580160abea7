"""The equivalence check, including deliberately wrong folds it must catch."""

import copy

import pytest
import torch
from torch import nn

import enjoyln
from enjoyln.plan import LayerNormEntry
from enjoyln.transform.steps import apply_plan
from enjoyln.testing import perturb, tiny_model
from enjoyln.options import CheckOptions


@pytest.fixture(scope="module")
def gpt2():
    return perturb(tiny_model("gpt2"), seed=8)


def test_correct_fold_passes_with_details(gpt2):
    folded = enjoyln.fold(copy.deepcopy(gpt2))
    report = enjoyln.check(gpt2, folded, options=CheckOptions(batches=4))
    assert report.passed and report.batches == 4
    assert [o.name for o in report.outputs] == ["logits"]
    assert 0 < report.max_abs_diff and report.max_rel_diff < 1e-5
    assert report.generation.passed and len(report.generation.reference[0]) == 8
    assert "PASS" in report.summary() and report.to_dict()["passed"] is True


def test_dropped_beta_fails(gpt2):
    folded = enjoyln.fold(copy.deepcopy(gpt2))
    folded.transformer.h[1].ln_2.bias = None  # the classic bug: RMSNorm without LN's bias
    report = enjoyln.check(gpt2, folded)
    assert not report.passed and report.max_rel_diff > 1e-4
    assert "FAIL" in report.summary()


def test_hard_coded_eps_fails():
    bert = perturb(tiny_model("bert"), seed=9)  # BERT uses eps=1e-12
    folded = enjoyln.fold(copy.deepcopy(bert))
    folded.embeddings.LayerNorm.eps = 1e-5
    # a tiny epsilon change is a tiny output change; make the scale small enough to show it
    with torch.no_grad():
        bert.embeddings.word_embeddings.weight.mul_(1e-3)
        folded.embeddings.word_embeddings.weight.mul_(1e-3)
    assert not enjoyln.check(bert, folded).passed


def test_swapping_a_post_ln_layer_norm_fails():
    bert = perturb(tiny_model("bert"), seed=10)
    plan = enjoyln.analyze(bert)
    forged = copy.deepcopy(plan)
    name = "encoder.layer.0.attention.output.LayerNorm"
    forged.layer_norms = [
        LayerNormEntry(name, "module", True, centered=[]) if e.name == name else e
        for e in forged.layer_norms
    ]
    wrong = apply_plan(copy.deepcopy(bert), forged)
    assert isinstance(wrong.get_submodule(name), enjoyln.RMSNorm)
    report = enjoyln.check(bert, wrong)
    assert not report.passed
    assert not any(o.passed for o in report.outputs)


def test_uncentered_swap_fails_for_plain_module():
    net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).eval()
    perturb(net)
    wrong = copy.deepcopy(net)
    wrong[1] = enjoyln.RMSNorm.from_layer_norm(wrong[1])
    x = torch.randn(4, 8)
    report = enjoyln.check(net, wrong, x)
    assert not report.passed and report.batches == 3


def test_half_precision_uses_the_relative_criterion():
    model = perturb(tiny_model("opt"), seed=11).to(torch.float16)
    folded = enjoyln.fold(copy.deepcopy(model))
    report = enjoyln.check(model, folded)
    assert report.passed, report.summary()
    assert (
        report.dtype == "float16"
        and report.criterion_kind == "precision"
        and report.truth_dtype == "float32"
    )
    assert "float32 original" in report.criterion
    out = report.outputs[0]
    assert out.reference_error > 0 and out.candidate_error <= 2 * out.reference_error
    assert report.generation is not None and not report.generation.required
    # and a real bug still fails in half precision
    folded.model.decoder.final_layer_norm.bias = None
    assert not enjoyln.check(model, folded).passed


def test_plain_module_without_inputs_is_a_clear_error():
    with pytest.raises(enjoyln.CaptureError, match="pass example_inputs"):
        enjoyln.check(nn.Linear(2, 2), nn.Linear(2, 2))


def test_half_candidate_of_an_fp32_original():
    """A folded model converted to fp16 is judged against the fp32 original's own fp16 rounding."""
    model = perturb(tiny_model("gpt2"), seed=12)
    folded = enjoyln.fold(copy.deepcopy(model)).half()
    report = enjoyln.check(model, folded)
    assert report.passed and report.dtype == "float16", report.summary()
    folded.transformer.ln_f.bias = None
    assert not enjoyln.check(model, folded).passed


def test_a_given_reference_becomes_its_own_truth(gpt2, monkeypatch):
    """The checkpoint check hands its loaded reference over: after its own runs it is its own
    float64 truth, widened one module at a time (no second load, no copy of the model), with the
    same verdict and figures as a truth made from a copy; a half-precision candidate still takes
    the truth from its own source."""
    from enjoyln.checking.forward import CandidatePath, ModelSource, check_sources

    def paths(model):
        return [CandidatePath("", ModelSource.of(model))]

    folded = enjoyln.fold(copy.deepcopy(gpt2))
    by_copy = check_sources(ModelSource.of(gpt2), paths(folded))
    given = copy.deepcopy(gpt2)
    never = ModelSource(torch.float32, lambda dtype: pytest.fail("the truth was loaded again"))
    to = torch.nn.Module.to
    monkeypatch.setattr(
        torch.nn.Module,
        "to",
        lambda self, *a, **k: (
            pytest.fail("converted whole") if torch.float64 in a else to(self, *a, **k)
        ),
    )
    in_place = check_sources(ModelSource.given(given), paths(folded), truth=never)
    monkeypatch.undo()
    assert given.transformer.wte.weight.dtype == torch.float32  # put back after each module
    assert given.lm_head.weight is given.transformer.wte.weight  # ties stay tied
    assert in_place.passed and in_place.criterion_kind == "precision"
    assert (in_place.max_abs_diff, in_place.margin) == (by_copy.max_abs_diff, by_copy.margin)

    loads = []
    truth = ModelSource(
        torch.float32, lambda dtype: loads.append(dtype) or copy.deepcopy(gpt2).to(dtype)
    )
    half = check_sources(
        ModelSource.given(copy.deepcopy(gpt2)), paths(copy.deepcopy(folded).half()), truth=truth
    )
    assert loads == [torch.float32] and half.dtype == "float16"


def test_a_second_load_path_may_run_only_the_first_batches(gpt2):
    from enjoyln.checking.forward import CandidatePath, ModelSource, check_sources

    folded = enjoyln.fold(copy.deepcopy(gpt2))
    plain = enjoyln.fold(copy.deepcopy(gpt2))
    calls = []
    plain.register_forward_hook(lambda module, args, out: calls.append(1))
    report = check_sources(
        ModelSource.of(gpt2),
        [
            CandidatePath("a", ModelSource.of(folded)),
            CandidatePath("b", ModelSource.of(plain), batches=1),
        ],
    )
    assert report.passed and report.batches == 3 and len(calls) == 1
    assert {o.path for o in report.outputs} == {"a", "b"}


def test_a_given_model_in_its_own_dtype_is_run_as_loaded():
    """A half-precision model whose loader keeps a module in float32 is run that way: asking a
    given model for its own dtype must not cast the kept module down."""
    from enjoyln.checking.forward import ModelSource

    model = nn.Sequential(nn.Linear(4, 4).half(), nn.Linear(4, 4))  # the second kept in float32
    got = ModelSource.given(model).get(torch.float16)
    assert got is model and model[1].weight.dtype == torch.float32


def test_a_dropped_model_is_collected_at_once_only_when_large(monkeypatch):
    """A full collection walks every object of the process: after a small model it costs more than
    it frees."""
    from enjoyln.checking import forward

    calls = []
    monkeypatch.setattr(forward.gc, "collect", lambda *a: calls.append(a) or 0)
    small = forward.ModelSource.given(torch.nn.Linear(4, 4))
    assert small.nbytes == 4 * 4 * 4 + 4 * 4
    small.drop(torch.float32)
    assert calls == []
    monkeypatch.setattr(forward, "COLLECT_BYTES", 80)
    small.drop(torch.float32)  # 80 bytes now reach the threshold
    assert len(calls) == 1
    unknown = forward.ModelSource(torch.float32, lambda dtype: None)
    unknown.drop(torch.float32)
    assert len(calls) == 2
    forward.ModelSource.of(torch.nn.Linear(4, 4)).drop(
        torch.float32
    )  # the caller holds it: nothing to free
    assert len(calls) == 2


def test_a_recorded_claim_never_hides_what_the_model_serves(gpt2):
    """Outputs a plan lets its rotation change are skipped only where the model does not serve them:
    a block claiming the logits changed (a forged one) still has them compared."""
    from enjoyln.options import CheckOptions

    broken = enjoyln.fold(copy.deepcopy(gpt2))
    with torch.no_grad():
        broken.lm_head.weight.mul_(1.01)
    claims = CheckOptions(skip=("logits", "past_key_values"), batches=1, generate_tokens=0)
    report = enjoyln.check(gpt2, broken, options=claims)
    assert not report.passed
    assert any(o.name == "logits" and not o.passed for o in report.outputs)
