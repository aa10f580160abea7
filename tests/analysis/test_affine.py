"""fuse_affine: each folded norm's γ and β move into the linear layers that read it."""

import copy

import pytest
import torch
import transformers
from torch import nn

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.plan import AFFINE_FUSED, AFFINE_GAIN, AFFINE_KEPT, FoldPlan
from enjoyln.testing import perturb, tiny_model
from conftest import assert_same_outputs, steps_keep_their_promise
from enjoyln.options import FoldOptions

# arch -> (weightless, bias-only) RMSNorms after fold(fuse_affine=True) of the tiny perturbed model
ZOO = {
    "gpt2": (4, 1),  # ln_f feeds lm_head, which has no bias: β stays as β/γ
    "opt": (4, 1),
    "phi": (3, 0),
    "gptj": (1, 2),  # q, k, v have no bias
    "gpt_neox": (4, 1),
    "falcon": (0, 3),
    "vit": (5, 0),
    # the text final_layer_norm's output is text_model_output.last_hidden_state, not served: its
    # affine moves (the bias stays); vision pre_layrnorm feeds an LN
    "clip": (4, 1),
    "whisper": (6, 6),  # k_proj has no bias; encoder_last_hidden_state is not served
    "bloom": (4, 1),  # with auxiliary centering
}


@pytest.mark.parametrize("arch", sorted(ZOO))
def test_fuse_affine_is_exact_and_leaves_weightless_norms(arch):
    model = perturb(tiny_model(arch), seed=11)
    plan = enjoyln.analyze(
        model, fuse_affine=True, auxiliary_centering=arch in ("bloom", "whisper")
    )
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    changed = {
        "clip": ["text_model_output.last_hidden_state"],
        "whisper": ["encoder_last_hidden_state"],
    }
    assert plan.changed_outputs == changed.get(arch, [])
    assert_same_outputs(model, folded, hf_example_inputs(model, seed=12), skip=plan.changed_outputs)
    norms = [m for m in folded.modules() if isinstance(m, enjoyln.RMSNorm)]
    weightless = sum(not m.elementwise_affine and m.bias is None for m in norms)
    bias_only = sum(not m.elementwise_affine and m.bias is not None for m in norms)
    assert (weightless, bias_only) == ZOO[arch]


def test_fused_weights_are_the_float64_products():
    model = perturb(tiny_model("gpt2"), seed=13)
    plan = enjoyln.analyze(model, fuse_affine=True)
    ln = model.transformer.h[0].ln_1
    w, b = model.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.bias
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    g64, b64 = ln.weight.double(), ln.bias.double()
    expected_w = (w.double() * g64[:, None]).float()  # Conv1D: [in, out], the input axis is 0
    expected_b = (b.double() + b64 @ w.double()).float()
    assert torch.equal(folded.transformer.h[0].attn.c_attn.weight, expected_w)
    assert torch.equal(folded.transformer.h[0].attn.c_attn.bias, expected_b)
    entry = plan["transformer.h.0.ln_1"]
    assert entry.affine == AFFINE_FUSED and [f.weight for f in entry.fused] == [
        "transformer.h.0.attn.c_attn.weight"
    ]
    assert entry.fused[0].axis == 0 and entry.fused[0].bias == "transformer.h.0.attn.c_attn.bias"


def test_every_transformation_keeps_its_promise_with_fused_affines():
    model = perturb(tiny_model("gpt2"), seed=14)
    plan = enjoyln.analyze(model, fuse_affine=True)
    inputs = hf_example_inputs(model, seed=15)
    assert steps_keep_their_promise(model, plan, inputs) == []


def test_plan_round_trip_keeps_the_fusion():
    plan = enjoyln.analyze(perturb(tiny_model("gptj")), fuse_affine=True)
    again = FoldPlan.from_json(plan.to_json())
    assert again == plan and any(e.affine == AFFINE_GAIN for e in again.layer_norms)
    assert "β stays, as β/γ" in plan.summary()


class Block(nn.Module):
    def __init__(self, reader="linear", d=8):
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.ln = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.wide = nn.Linear(2 * d, 4)
        self.reader = reader

    def forward(self, ids):
        y = self.ln(self.embed(ids))
        if self.reader == "output":
            return self.lin(y), y
        if self.reader == "gelu":
            return self.lin(torch.nn.functional.gelu(y))
        if self.reader == "cat":  # two blocks of a wider linear's input
            return self.wide(torch.cat([y, y], -1))
        if self.reader == "rows":  # selecting positions moves values only
            return self.lin(y[:, 1:3].transpose(0, 1))
        if self.reader == "mean":  # the mean of γ ⊙ r + β over positions is γ ⊙ mean(r) + β
            return self.lin(y.mean(1))
        if self.reader == "sum":  # summing positions multiplies what β contributes
            return self.lin(y.sum(1))
        if self.reader == "feature mean":  # the mean over the features mixes γ's entries
            return self.lin(y - y.mean(-1, keepdim=True))
        return self.lin(y)


def _block(reader):
    torch.manual_seed(0)
    return perturb(Block(reader)).eval()


@pytest.mark.parametrize(
    "reader,affine,why",
    [
        ("linear", AFFINE_FUSED, ""),
        ("rows", AFFINE_FUSED, ""),
        ("cat", AFFINE_FUSED, ""),
        ("output", AFFINE_KEPT, "is the model output `1`"),
        ("gelu", AFFINE_KEPT, "reaches gelu"),
        ("mean", AFFINE_FUSED, ""),
        ("sum", AFFINE_KEPT, "reaches sum"),
        ("feature mean", AFFINE_KEPT, "is reduced over the feature axis by mean"),
    ],
)
def test_where_the_affine_can_go(reader, affine, why):
    model = _block(reader)
    ids = torch.randint(0, 16, (3, 5))
    plan = enjoyln.analyze(model, ids, fuse_affine=True)
    entry = plan["ln"]
    assert entry.foldable and entry.affine == affine and why in entry.affine_reason
    if reader == "cat":
        assert sorted((f.start, f.length, f.offset) for f in entry.fused) == [(0, 8, 0), (8, 8, 0)]
    folded = enjoyln.fold(copy.deepcopy(model), ids, plan=plan)
    assert_same_outputs(model, folded, ids)
    assert (not folded.ln.elementwise_affine) == (affine == AFFINE_FUSED)


def test_a_stream_pooled_by_a_mean_rotates():
    """A tower whose last norm is averaged over its positions before the head (SigLIP's image
    classifier): the norm's affine moves through the mean into the head, which takes Qᵀ."""
    model = _block("mean")
    ids = torch.randint(0, 16, (3, 5))
    rotated = enjoyln.rotate(copy.deepcopy(model), ids, seed=2)
    assert_same_outputs(model, rotated, ids)
    assert not torch.allclose(rotated.lin.weight, model.lin.weight, atol=1e-3)
    assert not rotated.ln.elementwise_affine


def test_a_zero_gain_keeps_the_affine_when_a_reader_has_no_bias():
    torch.manual_seed(0)
    model = perturb(Block()).eval()
    model.lin = nn.Linear(8, 8, bias=False)
    ids = torch.randint(0, 16, (3, 5))
    assert enjoyln.analyze(model, ids, fuse_affine=True)["ln"].affine == AFFINE_GAIN
    with torch.no_grad():
        model.ln.weight[3] = 0
    entry = enjoyln.analyze(model, ids, fuse_affine=True)["ln"]
    assert entry.affine == AFFINE_KEPT and "zero entry" in entry.affine_reason
    assert_same_outputs(model, enjoyln.fold(copy.deepcopy(model), ids, fuse_affine=True), ids)


def test_a_weight_read_elsewhere_is_untied_with_its_cost():
    """GPT-2's head is the embedding: the fused head gets its own copy."""
    model = perturb(tiny_model("gpt2", n_layer=1), seed=16)
    plan = enjoyln.analyze(model, fuse_affine=True)
    assert [u.param for u in plan.untied] == ["lm_head.weight"] and plan.untied[
        0
    ].nbytes == 128 * 64 * 4
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert folded.lm_head.weight is not folded.transformer.wte.weight


def test_checkpoint_with_fused_affines(tmp_path):
    src = tmp_path / "src"
    model = perturb(tiny_model("opt"), seed=17)
    model.save_pretrained(src)
    result = enjoyln.fold_checkpoint(src, tmp_path / "out", FoldOptions.of(fuse_affine=True))
    assert result.report.passed and result.report.static.computed == result.report.static.tensors
    inputs = hf_example_inputs(model, seed=18)
    plain = transformers.OPTForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(plain.model.decoder.layers[0].self_attn_layer_norm.weight, torch.ones(64))
    assert torch.equal(plain.model.decoder.layers[0].self_attn_layer_norm.bias, torch.zeros(64))
    assert_same_outputs(model, plain, inputs)  # LN(x)·1 + 0 feeding the fused layers
    loaded = enjoyln.load(tmp_path / "out")
    norms = [m for m in loaded.modules() if isinstance(m, enjoyln.RMSNorm)]
    assert sum(not m.elementwise_affine and m.bias is None for m in norms) == 4
    assert_same_outputs(model, loaded, inputs)


class Shared(nn.Module):
    """A norm whose readers share a weight or a bias in ways a single fusion cannot serve."""

    def __init__(self, case, d=8):
        super().__init__()
        self.embed, self.other = nn.Embedding(16, d), nn.Embedding(16, d)
        self.ln, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d)
        self.lin, self.wide, self.part = (
            nn.Linear(d, d),
            nn.Linear(2 * d, d),
            nn.Linear(d // 2, d // 2),
        )
        self.w, self.b, self.b2 = (
            nn.Parameter(torch.randn(d, d)),
            nn.Parameter(torch.randn(d)),
            nn.Parameter(torch.randn(d)),
        )
        self.head = nn.Linear(d, 16)
        self.case, self.d = case, d

    def forward(self, ids):
        h = self.embed(ids)
        y = self.ln(h)
        F, d = torch.nn.functional, self.d
        z = {
            "twice": lambda: self.lin(y) + self.lin(y[:, :1]),  # one layer, two paths: fused once
            "two_biases": lambda: F.linear(y, self.w, self.b) + F.linear(y, self.w, self.b2),
            "one_bias": lambda: F.linear(y, self.w, self.b) + F.linear(y, self.lin.weight, self.b),
            "halves": lambda: torch.cat(
                [self.part(y[..., : d // 2]), self.part(y[..., d // 2 :])], -1
            ),
            "swapped": lambda: (
                self.wide(torch.cat([y, self.other(ids)], -1))
                + self.wide(torch.cat([self.other(ids), y], -1))
            ),
            "addmm_beta": lambda: torch.addmm(self.b, y.reshape(-1, d), self.w, beta=0.5).view(
                y.shape
            ),
            "addmm_alpha": lambda: torch.addmm(self.b, y.reshape(-1, d), self.w, alpha=2.0).view(
                y.shape
            ),
        }[self.case]()
        return self.head(self.ln_f(h + z))


@pytest.mark.parametrize(
    "case,affine,why",
    [
        ("twice", AFFINE_FUSED, ""),
        ("two_biases", AFFINE_KEPT, "read different values with it"),
        ("one_bias", AFFINE_KEPT, "b is the bias of more than one weight"),
        ("halves", AFFINE_KEPT, "read different values with it"),
        ("swapped", AFFINE_KEPT, "read different values with it"),
        ("addmm_beta", AFFINE_KEPT, "scales its product or its bias"),
        ("addmm_alpha", AFFINE_KEPT, "scales its product or its bias"),
    ],
)
def test_readers_sharing_a_weight_or_bias(case, affine, why):
    """Each block of a weight takes γ once and each bias W β once: readers that would need
    it twice, or differently, keep the affine (they used to be fused twice, silently wrong)."""
    torch.manual_seed(0)
    model = perturb(Shared(case)).eval()
    ids = torch.randint(0, 16, (2, 5))
    plan = enjoyln.analyze(model, ids, fuse_affine=True)
    entry = plan["ln"]
    assert entry.foldable and entry.affine == affine and why in entry.affine_reason, (
        entry.affine_reason
    )
    assert_same_outputs(model, enjoyln.fold(copy.deepcopy(model), ids, plan=plan), ids)
    if affine == AFFINE_FUSED:
        assert len(entry.fused) == 1
        assert_same_outputs(model, enjoyln.rotate(copy.deepcopy(model), ids), ids)


class SharedAffine(nn.Module):
    """Two norms sharing one γ and β, or a γ the model also reads itself."""

    def __init__(self, case, d=8):
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.lin1, self.lin2, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 16)
        self.case = case

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.lin1(self.ln1(h))
        h = h + self.lin2(self.ln2(h))
        out = self.head(self.ln_f(h))
        return out * self.ln1.weight.sum() if self.case == "read" else out


@pytest.mark.parametrize(
    "case,why",
    [
        ("tied", "its gain ln1.weight is also read by the LayerNorm ln2"),
        ("read", "its gain ln1.weight is also read by sum"),
    ],
)
def test_a_gain_read_elsewhere_keeps_the_affine(case, why):
    """Fusing sets γ to 1 and β to 0: a second norm sharing them (or the model reading γ) would
    see 1 and 0 (they used to, silently wrong; a plain load of the checkpoint too)."""
    torch.manual_seed(0)
    model = perturb(SharedAffine(case)).eval()
    if case == "tied":
        model.ln2.weight, model.ln2.bias = model.ln1.weight, model.ln1.bias
    ids = torch.randint(0, 16, (2, 5))
    plan = enjoyln.analyze(model, ids, fuse_affine=True)
    assert plan["ln1"].affine == AFFINE_KEPT and why in plan["ln1"].affine_reason, plan[
        "ln1"
    ].affine_reason
    assert plan["ln_f"].affine == AFFINE_FUSED
    assert_same_outputs(model, enjoyln.fold(copy.deepcopy(model), ids, plan=plan), ids)
    with pytest.raises(enjoyln.PlanError, match="ln1.weight is also read"):
        enjoyln.rotate(copy.deepcopy(model), ids)


def test_checkpoint_keys_the_model_does_not_load_are_kept(tmp_path):
    """The hub's GPT-2 stores attn.bias masks that the model does not load: the fused fold
    (computed on the loaded model) used to drop them and then fail its own static check."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    model = perturb(tiny_model("gpt2", n_layer=1), seed=19)
    model.save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    tensors["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = enjoyln.fold_checkpoint(src, tmp_path / "out", FoldOptions.of(fuse_affine=True))
    assert result.report.passed
    assert torch.equal(
        load_file(tmp_path / "out" / "model.safetensors")["transformer.h.0.attn.masked_bias"],
        torch.tensor(-1e4),
    )
    assert_same_outputs(model, enjoyln.load(tmp_path / "out"), hf_example_inputs(model, seed=20))
