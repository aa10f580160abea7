"""Training-time CBWC: the paper's Prop. 3.2, checked step by step."""

import copy
import warnings

import pytest
import torch
from torch.nn.utils import parametrize

import enjoyln
from enjoyln.testing import perturb, tiny_model

STEPS = 50


def lm():
    model = tiny_model(
        "gpt2",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    # float64: exact arithmetic would give exactly equal trajectories; in
    # float64 the rounding stays far below the 1e-4 being checked, also where
    # Adam divides tiny gradients by tiny second moments (attention's key bias
    # has an exactly-zero gradient, so its noise is all Adam sees).
    return perturb(model, seed=51).double().train()


def batches(n, seed=52):
    """A few batches, cycled, so the model can learn them within n steps."""
    gen = torch.Generator().manual_seed(seed)
    few = [torch.randint(0, 128, (4, 16), generator=gen) for _ in range(5)]
    return [few[i % 5] for i in range(n)]


def train(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_cbwc_follows_the_layer_norm_trajectory():
    ln_model = lm()
    plan = enjoyln.analyze(copy.deepcopy(ln_model).eval())
    cb_model = enjoyln.cbwc(copy.deepcopy(ln_model))
    assert (
        sum(isinstance(m, enjoyln.RMSNorm) for m in cb_model.modules()) == len(plan.foldable) == 5
    )
    assert parametrize.is_parametrized(cb_model.transformer.wte, "weight")
    data = batches(STEPS)
    ln_losses, cb_losses = train(ln_model, data), train(cb_model, data)
    assert ln_losses[-1] < ln_losses[0] * 0.9  # it learns, so the comparison means something
    for step, (a, b) in enumerate(zip(ln_losses, cb_losses)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: {a} vs {b}"
    enjoyln.cbwc_remove(cb_model)
    assert not any(parametrize.is_parametrized(m) for m in cb_model.modules())
    ln_sd, cb_sd = ln_model.state_dict(), cb_model.state_dict()
    assert ln_sd.keys() == cb_sd.keys()
    axes = {c.param: c.axis for c in plan.centered}
    for name, w in ln_sd.items():
        expected = w - w.mean(axes[name], keepdim=True) if name in axes else w
        torch.testing.assert_close(cb_sd[name], expected, atol=1e-4, rtol=0, msg=name)


def test_baked_model_is_a_folded_model():
    model = lm().float().eval()
    cb = enjoyln.cbwc_remove(enjoyln.cbwc(copy.deepcopy(model)))
    report = enjoyln.check(model, cb)
    assert report.passed, report.summary()


def test_active_dropout_warns():
    model = perturb(tiny_model("gpt2"), seed=53).train()  # default dropout 0.1
    with pytest.warns(UserWarning, match="break the exact equivalence"):
        enjoyln.cbwc(model)
    assert model.training


def test_no_warning_without_dropout():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enjoyln.cbwc(lm())


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_tied_head_trains_as_in_the_layer_norm_model(optimizer):
    base = (
        perturb(tiny_model("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), seed=54)
        .double()
        .train()
    )
    assert base.lm_head.weight is base.transformer.wte.weight
    ref, cb = copy.deepcopy(base), enjoyln.cbwc(copy.deepcopy(base))
    assert (
        cb.lm_head.weight is cb.transformer.wte.parametrizations.weight.original
    )  # still one tensor
    make = {
        "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
        "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    }[optimizer]
    data = batches(10)
    for model in (ref, cb):
        opt = make(model.parameters())
        for ids in data:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    ids = data[0]
    with torch.no_grad():
        a = ref.eval()(input_ids=ids, use_cache=False).logits
        b = cb.eval()(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    enjoyln.cbwc_remove(cb)
    assert cb.config.tie_word_embeddings is False
    assert cb.lm_head.weight is not cb.transformer.wte.weight
    torch.testing.assert_close(cb.lm_head.weight, ref.lm_head.weight, rtol=0, atol=1e-9)


def test_cbwc_centers_in_groups_for_a_group_norm():
    from torch import nn

    model = perturb(nn.Sequential(nn.Linear(8, 8), nn.GroupNorm(2, 8)).eval())
    x = torch.randn(5, 8)
    cb = enjoyln.cbwc(copy.deepcopy(model), x)
    with torch.no_grad():
        torch.testing.assert_close(cb(x), model(x), rtol=1e-5, atol=1e-5)
    enjoyln.cbwc_remove(cb)
    with torch.no_grad():
        torch.testing.assert_close(cb(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["LayerScale", "Heads"])
def test_cbwc_with_a_trained_layer_scale_gain_and_per_head_blocks(arch):
    """The centering for a gain reads the gain as it trains; block centering leaves v alone."""
    import models

    torch.manual_seed(0)
    base = perturb(getattr(models, arch)().eval(), seed=55).double()
    ids = torch.randint(0, 32, (2, 6))
    cb = enjoyln.cbwc(copy.deepcopy(base), ids)
    assert any(parametrize.is_parametrized(m) for m in cb.modules())
    for model in (base, cb):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(5):
            loss = (
                model(torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(step)))
                .square()
                .mean()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        torch.testing.assert_close(cb(ids), base(ids), rtol=1e-9, atol=1e-9)
        if arch == "LayerScale":  # the gain trained, so the comparison means something
            assert not torch.equal(
                cb.gamma, perturb(getattr(models, arch)().eval(), seed=55).double().gamma
            )
    enjoyln.cbwc_remove(cb)
    with torch.no_grad():
        torch.testing.assert_close(cb(ids), base(ids), rtol=1e-9, atol=1e-9)


def test_baked_masked_lm_saves_and_reloads(tmp_path):
    """cbwc_remove unties the head; BERT's other declared tie (the decoder bias) must survive a
    save."""
    import transformers

    from enjoyln.analysis.inputs import hf_example_inputs
    from enjoyln.testing import perturb
    from conftest import assert_same_outputs

    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = perturb(transformers.BertForMaskedLM(config).eval(), seed=8)
    enjoyln.cbwc_remove(enjoyln.cbwc(model))
    model.save_pretrained(tmp_path / "baked")
    reloaded = transformers.BertForMaskedLM.from_pretrained(tmp_path / "baked").eval()
    assert_same_outputs(model, reloaded, hf_example_inputs(model, seed=2))
