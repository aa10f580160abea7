"""Rewrite: functional LNs in a GraphModule, plans applied later, bad plans."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import enjoyln
from enjoyln.ops import rms_norm
from enjoyln.testing import perturb, tiny_model
from conftest import assert_same_outputs


class TwoFunctional(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = F.layer_norm(self.lin(x), (8,), self.w, self.b, eps=1e-6)
        return F.layer_norm(torch.relu(self.proj(h)), (8,), self.w, self.b)


def test_functional_layer_norm_in_graph_module_is_rewritten():
    gm = fx.symbolic_trace(TwoFunctional().eval())
    x = torch.randn(3, 4, 8)
    plan = enjoyln.analyze(gm, x)
    first, second = plan.layer_norms
    assert first.kind == "functional" and first.foldable and first.eps == 1e-6
    assert not second.foldable and "relu" in second.reason
    ref = copy.deepcopy(gm)
    folded = enjoyln.fold(gm, x, plan=plan)
    targets = [n.target for n in folded.graph.nodes if n.op == "call_function"]
    assert targets.count(rms_norm) == 1 and targets.count(F.layer_norm) == 1
    assert_same_outputs(ref, folded, x)


def test_plan_applied_after_json_round_trip():
    model = perturb(tiny_model("gpt2"), seed=5)
    plan = enjoyln.FoldPlan.from_json(enjoyln.analyze(model).to_json())
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert enjoyln.check(model, folded).passed


def test_plan_for_another_model_is_refused_before_any_change():
    gpt2 = tiny_model("gpt2")
    plan = enjoyln.analyze(perturb(tiny_model("opt")))
    before = copy.deepcopy(gpt2.state_dict())
    with pytest.raises(enjoyln.PlanError, match="made for a OPTForCausalLM, not a GPT2LMHeadModel"):
        enjoyln.fold(gpt2, plan=plan)
    after = gpt2.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, enjoyln.RMSNorm) for m in gpt2.modules())


def test_plan_for_a_smaller_config_is_refused():
    plan = enjoyln.analyze(perturb(tiny_model("gpt2")))
    deeper = tiny_model("gpt2", n_layer=3)
    with pytest.raises(enjoyln.PlanError, match="this model has transformer.h.2.ln_1"):
        enjoyln.fold(deeper, plan=plan)


def test_applying_a_plan_twice_changes_nothing_more():
    model = perturb(tiny_model("gpt2"), seed=6)
    plan = enjoyln.analyze(model)
    once = enjoyln.fold(copy.deepcopy(model), plan=plan)
    twice = enjoyln.fold(copy.deepcopy(once), plan=plan)
    for (name, a), b in zip(once.state_dict().items(), twice.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0, msg=name)
    assert sum(isinstance(m, enjoyln.RMSNorm) for m in twice.modules()) == 5
    assert enjoyln.analyze(once).layer_norms == []  # nothing left to fold


def test_fold_preserves_half_dtype():
    model = perturb(tiny_model("gpt2"), seed=7).to(torch.bfloat16)
    folded = enjoyln.fold(copy.deepcopy(model))
    assert {p.dtype for p in folded.parameters()} == {torch.bfloat16}
    report = enjoyln.check(model, folded)
    assert report.passed, report.summary()


def test_a_tensor_tied_under_two_centered_names_is_centered_once():
    """BART's plan centers encoder.embed_tokens and decoder.embed_tokens, one shared tensor:
    centering it once per name would round it twice, and no checkpoint would match it."""
    import transformers

    config = transformers.BartConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=128,
        max_position_embeddings=32,
    )
    model = perturb(transformers.BartModel(config).eval(), seed=5)
    plan = enjoyln.analyze(model)
    names = {c.param for c in plan.centered}
    assert {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} <= names
    wide = model.shared.weight.detach().double()
    expected = (wide - wide.mean(1, keepdim=True)).float()
    reference = copy.deepcopy(model)
    folded = enjoyln.fold(model, plan=plan)
    assert (
        folded.encoder.embed_tokens.weight
        is folded.shared.weight
        is folded.decoder.embed_tokens.weight
    )
    assert torch.equal(folded.shared.weight, expected)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    assert_same_outputs(reference, folded, {"input_ids": ids, "decoder_input_ids": ids})


def test_every_step_says_what_it_means_in_memory_on_disk_and_on_load():
    """A step is written in one place: its in-memory change, its trace (which the fold and the
    static check replay tensor by tensor) and what a load must do again. One that inherits the
    base class's trace would be silently wrong on disk."""
    from enjoyln.transform.steps import PIPELINE, Transformation

    for step in PIPELINE:
        cls = type(step)
        assert cls.__call__ is not Transformation.__call__, cls.__name__
        assert cls.trace is not Transformation.trace, cls.__name__
        assert (cls.on_load is not Transformation.on_load) == step.acts_on_load, cls.__name__
