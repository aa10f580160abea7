"""Analysis on small hand-built models: what folds, what is refused and why."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import enjoyln
from enjoyln.testing import perturb
from conftest import assert_same_outputs

D = 16


class LinearLN(nn.Module):
    def __init__(self, between=None):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.between = between or nn.Identity()
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        return self.ln(self.between(self.lin(x)))


class Concat(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.a, self.b, self.dim = nn.Linear(D, D), nn.Linear(D, D), dim
        self.ln = nn.LayerNorm(2 * D if dim == -1 else D)

    def forward(self, x):
        return self.ln(torch.cat([self.a(x), self.b(x)], dim=self.dim))


class LayerScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        return self.ln(self.lin(x) * self.gamma)


class ConvLN(nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1, groups=groups)
        self.ln = nn.LayerNorm(D)

    def forward(self, x):  # x: [B, T, D]
        return self.ln(self.conv(x.transpose(1, 2)).transpose(1, 2))


class StreamOut(nn.Module):
    """A pre-LN block whose residual stream is also returned."""

    def __init__(self, return_stream):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.return_stream = return_stream

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc(F.gelu(self.ln1(h)))
        out = self.ln2(h)
        return (out, h) if self.return_stream else out


class PostLN(nn.Module):
    """BERT-style: the residual stream is an LN output."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.emb_ln = nn.LayerNorm(D)
        self.attn = nn.Linear(D, D)
        self.ln1 = nn.LayerNorm(D)
        self.ffn = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)

    def forward(self, ids):
        h = self.emb_ln(self.emb(ids))
        h = self.ln1(h + self.attn(h))
        return self.ln2(h + self.ffn(h))


class ViTLike(nn.Module):
    """conv -> flatten(2) -> transpose(1, 2), a cls token concatenated along the sequence."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, 5, D))
        self.ln = nn.LayerNorm(D, eps=1e-12)
        self.head = nn.Linear(D, 3)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.ln(x)[:, 0])


def x_inputs():
    return torch.randn(2, 5, D)


def ids_inputs():
    return torch.randint(0, 32, (2, 5))


def entry(model, inputs, name="ln"):
    return enjoyln.analyze(model, inputs)[name]


def fold_and_compare(model, inputs):
    model = perturb(model.eval())
    folded = enjoyln.fold(copy.deepcopy(model), inputs)
    assert_same_outputs(model, folded, inputs)
    return folded


@pytest.mark.parametrize("between", [nn.Identity(), nn.Dropout(0.3), None])
def test_linear_then_ln_folds(between):
    model = LinearLN(between).eval()
    e = entry(model, x_inputs())
    assert e.foldable and e.reason == ""
    assert {c.param for c in e.centered} == {"lin.weight", "lin.bias"}
    assert {c.axis for c in e.centered} == {0}
    folded = fold_and_compare(model, x_inputs())
    assert isinstance(folded.ln, enjoyln.RMSNorm)


def test_ln_after_gelu_is_refused():
    e = entry(LinearLN(nn.GELU()).eval(), x_inputs())
    assert not e.foldable
    assert "gelu" in e.reason and "not zero-mean" in e.reason


def test_concat_along_features_is_refused_but_along_sequence_folds():
    e = entry(Concat(-1).eval(), x_inputs())
    assert not e.foldable and "concatenated along the feature axis" in e.reason
    e = entry(Concat(1).eval(), x_inputs())
    assert e.foldable
    fold_and_compare(Concat(1), x_inputs())


def test_layerscale_folds_by_centering_for_its_gain():
    e = entry(LayerScale().eval(), x_inputs())
    assert e.foldable and {(c.param, c.scale) for c in e.centered} == {
        ("lin.weight", "gamma"),
        ("lin.bias", "gamma"),
    }
    fold_and_compare(LayerScale(), x_inputs())


def test_depthwise_conv_is_refused_dense_conv_folds():
    e = entry(ConvLN(groups=D).eval(), x_inputs())
    assert not e.foldable and "depthwise" in e.reason
    e = entry(ConvLN(groups=1).eval(), x_inputs())
    assert e.foldable and {(c.param, c.axis) for c in e.centered} == {
        ("conv.weight", 0),
        ("conv.bias", 0),
    }
    fold_and_compare(ConvLN(groups=1), x_inputs())


def test_residual_stream_returned_as_output_is_refused():
    plan = enjoyln.analyze(StreamOut(return_stream=True).eval(), ids_inputs())
    assert not plan["ln2"].foldable and not plan["ln1"].foldable
    assert "model output" in plan["ln2"].reason
    plan = enjoyln.analyze(StreamOut(return_stream=False).eval(), ids_inputs())
    assert plan["ln1"].foldable and plan["ln2"].foldable
    fold_and_compare(StreamOut(return_stream=False), ids_inputs())


def test_dropout_in_train_mode_is_refused():
    model = LinearLN(nn.Dropout(0.1)).train()
    plan = enjoyln.analyze(model, x_inputs())
    assert not plan["ln"].foldable
    assert "training mode" in plan["ln"].reason
    assert any("training mode" in n for n in plan.notes)


def test_post_ln_in_layer_lns_are_refused():
    plan = enjoyln.analyze(PostLN().eval(), ids_inputs())
    assert plan["emb_ln"].foldable
    assert not plan["ln1"].foldable and "output of emb_ln" in plan["ln1"].reason
    assert not plan["ln2"].foldable and "output of ln1" in plan["ln2"].reason
    fold_and_compare(PostLN(), ids_inputs())


def test_vit_like_patch_embedding_folds_with_cls_and_positions():
    model = ViTLike().eval()
    inputs = torch.randn(2, 3, 8, 8)
    e = entry(model, inputs)
    assert e.foldable
    assert {(c.param, c.axis) for c in e.centered} == {
        ("patch.weight", 0),
        ("patch.bias", 0),
        ("cls", 2),
        ("pos", 2),
    }
    folded = fold_and_compare(model, inputs)
    assert folded.ln.eps == 1e-12


def test_functional_layer_norm_in_plain_module_is_reported_not_rewritten():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.w = nn.Parameter(torch.rand(D))

        def forward(self, x):
            return F.layer_norm(self.lin(x), (D,), self.w)

    plan = enjoyln.analyze(Functional().eval(), x_inputs())
    (e,) = plan.layer_norms
    assert e.kind == "functional" and not e.foldable
    assert "GraphModule" in e.reason


def test_in_place_add_is_followed():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
            self.ln = nn.LayerNorm(D)

        def forward(self, x):
            h = self.a(x)
            h += self.b(x)
            return self.ln(h)

    e = entry(InPlace().eval(), x_inputs())
    assert e.foldable and {c.param for c in e.centered} >= {"a.weight", "b.weight"}
    fold_and_compare(InPlace(), x_inputs())


def test_shared_weight_read_elsewhere_blocks_the_fold():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.ln = nn.LayerNorm(D)

        def forward(self, x):
            return self.ln(self.lin(x)), F.linear(x, self.lin.weight).relu()

    e = entry(Shared().eval(), x_inputs())
    assert not e.foldable and "reads the same weight" in e.reason


def test_no_layer_norm_says_so():
    plan = enjoyln.analyze(nn.Sequential(nn.Linear(D, D), nn.ReLU()), x_inputs())
    assert plan.layer_norms == [] and "nothing to fold" in plan.summary()


@pytest.mark.parametrize(
    "dtype,folds", [(torch.int64, False), (torch.float16, False), (torch.float32, True)]
)
def test_casts(dtype, folds):
    """A cast that keeps every value carries the zero mean; rounding does not."""

    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.ln = nn.Linear(D, D), nn.LayerNorm(D)

        def forward(self, x):
            return self.ln((self.lin(x) * 3).to(dtype).to(torch.float32))

    e = entry(Cast().eval(), x_inputs())
    assert e.foldable == folds
    if not folds:
        assert ("cast to int64" if dtype == torch.int64 else "rounded to float16") in e.reason
    fold_and_compare(Cast(), x_inputs())


def test_custom_layer_norm_modules_are_named_by_path():
    """ConvNext's LayerNorm subclass has its own forward: reported by module path, not folded."""
    import transformers

    config = transformers.ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=32
    )
    model = transformers.ConvNextForImageClassification(config).eval()
    plan = enjoyln.analyze(model, auxiliary_centering=True)
    names = [e.name for e in plan.layer_norms]
    assert "convnext.embeddings.layernorm" in names and "convnext.layernorm" in names
    assert all(not e.name.startswith("layer_norm") for e in plan.layer_norms)
