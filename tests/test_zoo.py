"""Every architecture of the zoo, with perturbed weights: counts, reasons, exactness."""

import copy

import pytest
import torch

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs, is_causal_lm
from enjoyln.testing import ARCHITECTURES, perturb, tiny_model
from conftest import assert_same_outputs, steps_keep_their_promise

L = 2  # layers in every tiny model
# (foldable, total, untied): the provable maximum under strict folding (docs/how-it-works.md).
EXPECTED = {
    "gpt2": (2 * L + 1, 2 * L + 1, ["lm_head.weight"]),
    "opt": (2 * L + 1, 2 * L + 1, ["lm_head.weight"]),
    "bloom": (1, 2 * L + 2, ["lm_head.weight"]),
    "phi": (L + 1, L + 1, []),
    "gptj": (L + 1, L + 1, []),
    "gpt_neox": (2 * L + 1, 2 * L + 1, []),
    "falcon": (L + 1, L + 1, ["lm_head.weight"]),
    "vit": (2 * L + 1, 2 * L + 1, []),
    "bert": (1, 2 * L + 1, []),
    "clip": ((2 * L + 1) + 1, (2 * L + 1) + (2 * L + 2), []),
    "whisper": (3 * L + 1, (2 * L + 1) + (3 * L + 1), ["proj_out.weight"]),
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def zoo(request):
    arch = request.param
    model = perturb(tiny_model(arch), seed=1)
    return arch, model, enjoyln.analyze(model)


def test_counts_reach_the_provable_maximum(zoo):
    arch, model, plan = zoo
    foldable, total, untied = EXPECTED[arch]
    assert len(plan.layer_norms) == total
    assert len(plan.foldable) == foldable
    assert [u.param for u in plan.untied] == untied
    for u in plan.untied:
        assert u.nbytes == model.get_parameter(u.param).numel() * 4
    for e in plan.layer_norms:
        assert e.foldable == (e.reason == ""), e.name
        assert e.foldable == bool(e.centered), e.name


def test_known_reasons(zoo):
    arch, _, plan = zoo
    keep = {e.name: e.reason for e in plan.layer_norms if not e.foldable}
    if arch == "bert":
        assert keep["encoder.layer.0.attention.output.LayerNorm"] == (
            "its input includes the output of embeddings.LayerNorm, which is not zero-mean"
        )
        assert plan.foldable[0].name == "embeddings.LayerNorm"
    if arch == "bloom":
        assert plan.foldable[0].name == "transformer.word_embeddings_layernorm"
        assert all("word_embeddings_layernorm" in r for r in keep.values())
    if arch == "clip":
        assert [e.name for e in plan.foldable if e.name.startswith("vision")] == [
            "vision_model.pre_layrnorm"
        ]
    if arch == "whisper":
        assert all(n.startswith("model.encoder") and "gelu" in r for n, r in keep.items())


def test_fold_is_exact_in_fp32(zoo):
    arch, model, plan = zoo
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    n_rms = sum(isinstance(m, enjoyln.RMSNorm) for m in folded.modules())
    assert n_rms == len(plan.foldable)
    for seed in (11, 12):
        assert_same_outputs(
            model, folded, hf_example_inputs(model, seed=seed, seq_len=12), rtol=1e-5
        )
    # state_dict keys are unchanged, and so are the parameters that were not centered
    centered = {c.param for c in plan.centered} | {u.param for u in plan.untied}
    ref_sd, new_sd = model.state_dict(), folded.state_dict()
    assert ref_sd.keys() == new_sd.keys()
    for k in ref_sd:
        if k not in centered:
            assert torch.equal(ref_sd[k], new_sd[k]), k
    for c in plan.centered:
        mean = new_sd[c.param].double().mean(c.axis)
        assert mean.abs().max() < 1e-6, c.param
    if plan.untied:
        assert getattr(folded.config, "tie_word_embeddings", False) is False
    report = enjoyln.check(model, folded)
    assert report.passed, report.summary()
    if is_causal_lm(model):
        assert report.generation is not None and report.generation.passed


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "opt"])
def test_folded_lm_generates_the_same_tokens(arch):
    # a wide init, so greedy decoding does not repeat one token forever
    model = perturb(tiny_model(arch, initializer_range=0.5), seed=2)
    folded = enjoyln.fold(copy.deepcopy(model))
    prompt = torch.randint(0, 128, (2, 5))
    kwargs = dict(
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones_like(prompt),
    )
    with torch.no_grad():
        a = model.generate(prompt, **kwargs)
        b = folded.generate(prompt, **kwargs)
    assert a.shape == (2, 17)
    assert len(set(a[:, 5:].flatten().tolist())) >= 4
    assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["gpt2", "bert", "whisper"])
def test_every_transformation_keeps_its_promise(arch):
    """Each step, applied after the ones before it, leaves the outputs as they were."""
    model = perturb(tiny_model(arch), seed=3)
    plan = enjoyln.analyze(model)
    inputs = hf_example_inputs(model, seed=4)
    steps_keep_their_promise(model, plan, inputs)


def test_model_without_layer_norm_says_nothing_to_fold():
    model = tiny_model("llama")
    plan = enjoyln.analyze(model)
    assert plan.layer_norms == []
    assert "nothing to fold" in plan.summary()
    assert enjoyln.fold(model, plan=plan) is model
