"""Norms however they are written: a norm is what its captured body computes, not its class.

Plain-PyTorch mirrors of timm's, open_clip's and transformers' norm modules, so
that neither library is needed: each is recognised by what its captured body
computes, not by its class, and replaced by an RMSNorm that keeps its dtype
behaviour and layout. Modules that compute anything else are refused with the
reason.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import enjoyln
from enjoyln.errors import PlanError
from enjoyln.plan import FoldPlan
from enjoyln.testing import perturb
from conftest import assert_same_outputs

D = 16


# --- the mirrors ---------------------------------------------------------------------------


class TimmLayerNorm(nn.LayerNorm):
    """timm.layers.LayerNorm: an nn.LayerNorm subclass that calls F.layer_norm."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class OpenClipLayerNorm(nn.LayerNorm):
    """open_clip.transformer.LayerNorm: casts its output back to the input's dtype."""

    def forward(self, x):
        orig_type = x.dtype
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.to(orig_type)


class LayerNormFp32(nn.LayerNorm):
    """timm.layers.LayerNormFp32: computes in float32, whatever the input's dtype."""

    def forward(self, x):
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class OlmoLayerNorm(nn.Module):
    """transformers' OlmoLayerNorm: not an nn.LayerNorm at all, no weight or bias, upcasts."""

    def __init__(self, hidden_size):
        super().__init__()
        self.normalized_shape = (hidden_size,)

    def forward(self, hidden_states):
        orig_dtype = hidden_states.dtype
        return F.layer_norm(
            hidden_states.to(dtype=torch.float32), self.normalized_shape, None, None, eps=1e-5
        ).to(orig_dtype)


class LayerNorm2d(nn.LayerNorm):
    """timm.layers.LayerNorm2d: channels-first."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class LayerNorm2dNoBias(LayerNorm2d):
    """timm metaformer's LayerNorm2dNoBias."""

    def __init__(self, num_channels, **kwargs):
        super().__init__(num_channels, **kwargs)
        self.eps = kwargs.get("eps", 1e-6)
        self.bias = None


class LayerNormAct2d(nn.LayerNorm):
    """timm.layers.LayerNormAct2d: channels-first, then a dropout and an in-place activation."""

    def __init__(self, num_channels, act_layer=nn.SiLU):
        super().__init__(num_channels)
        self.drop = nn.Identity()
        self.act = act_layer(inplace=True)

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        x = self.drop(x)
        return self.act(x)


class ConvNextLayerNorm(nn.LayerNorm):
    """transformers' ConvNextLayerNorm (and SamLayerNorm, RfDetrLayerNorm, ...)."""

    def __init__(self, normalized_shape, *, eps=1e-6, data_format="channels_last"):
        super().__init__(normalized_shape, eps=eps)
        self.data_format = data_format

    def forward(self, features):
        if self.data_format == "channels_first":
            features = features.permute(0, 2, 3, 1)
            features = super().forward(features)
            return features.permute(0, 3, 1, 2)
        return super().forward(features)


class LayerScale2d(nn.Module):
    """timm.layers.LayerScale2d: γ viewed as (1, C, 1, 1)."""

    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma.view(1, -1, 1, 1)


class Scale(nn.Module):
    """timm metaformer's Scale: γ viewed as (C, 1, 1)."""

    def __init__(self, dim, init_value=1.0):
        super().__init__()
        self.scale = nn.Parameter(init_value * torch.ones(dim))

    def forward(self, x):
        return x * self.scale.view(dim_view(self.scale))


def dim_view(scale):
    return (scale.shape[0], 1, 1)


class LayerScale(nn.Module):
    """timm.layers.LayerScale: channels-last γ."""

    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


# --- models built from them -------------------------------------------------------------------


class PreLN(nn.Module):
    """embed -> one pre-norm residual block -> final norm -> head, with ``norm`` as every norm."""

    def __init__(self, norm):
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.norm1 = norm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.norm = norm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.embed(x)
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return self.head(self.norm(x))


class ConvBlocks(nn.Module):
    """A channels-first stem and pre-norm block: 1x1 convs, ``norm`` channels-first, ``scale`` after
    the block."""

    def __init__(self, norm, scale=None):
        super().__init__()
        self.stem = nn.Conv2d(3, D, 1)
        self.norm1 = norm(D)
        self.fc1, self.fc2 = nn.Conv2d(D, 2 * D, 1), nn.Conv2d(2 * D, D, 1)
        self.ls = scale(D) if scale else nn.Identity()
        self.norm = norm(D)
        self.head = nn.Conv2d(D, 3, 1)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.ls(self.fc2(F.gelu(self.fc1(self.norm1(x)))))
        return self.head(self.norm(x))


class ParallelScalingBlock(nn.Module):
    """timm's ParallelScalingBlock: ls(attn_out_proj(a) + mlp_out_proj(m)), one LN in."""

    def __init__(self, dim=D, heads=2):
        super().__init__()
        self.heads = heads
        self.in_norm = TimmLayerNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * dim + 3 * dim, bias=False)
        self.mlp_bias = nn.Parameter(torch.zeros(2 * dim))
        self.attn_out_proj = nn.Linear(dim, dim)
        self.mlp_out_proj = nn.Linear(2 * dim, dim)
        self.ls = LayerScale(dim, 0.5)

    def forward(self, x):
        B, N, C = x.shape
        y = self.in_proj(self.in_norm(x))
        x_mlp, q, k, v = torch.split(y, [2 * C, C, C, C], dim=-1)
        x_mlp = x_mlp + self.mlp_bias
        q, k, v = (t.view(B, N, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        x_attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        y = self.attn_out_proj(x_attn) + self.mlp_out_proj(F.gelu(x_mlp))
        return x + self.ls(y)


class Parallel(nn.Module):
    def __init__(self, blocks=2):
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.Sequential(*(ParallelScalingBlock() for _ in range(blocks)))
        self.norm = TimmLayerNorm(D)

    def forward(self, x):
        return self.norm(self.blocks(self.embed(x)))


class PoolingViT(nn.Module):
    """timm's PiT stem: conv(x) + pos, pos of shape (1, C, H, W), then tokens with a cls token."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, D, 4, 4)
        self.pos_embed = nn.Parameter(torch.randn(1, D, 4, 4))
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.norm1 = TimmLayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.norm = TimmLayerNorm(D)

    def forward(self, x):
        x = self.conv(x) + self.pos_embed
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.fc(self.norm1(x))
        return self.norm(x)[:, 0]


class HieraDetStem(nn.Module):
    """timm's HieraDet: a (1, C, h, w) table interpolated, plus a tiled window table, permuted,
    added NHWC."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, D, 2, 2)
        self.pos_embed = nn.Parameter(torch.randn(1, D, 3, 3))
        self.pos_embed_window = nn.Parameter(torch.randn(1, D, 4, 4))
        self.norm1 = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.proj(x).permute(0, 2, 3, 1)
        h, w = x.shape[1:3]
        pos = F.interpolate(self.pos_embed, size=(h, w), mode="bicubic")
        pos = pos + self.pos_embed_window.tile((h // 4, w // 4))
        return self.head(self.norm1(x + pos.permute(0, 2, 3, 1)))


def prepared(model, seed=0):
    """Perturbed away from init, LayerScale gains included (not near 0, not all equal)."""
    torch.manual_seed(seed)
    perturb(model, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "scale")):
                p.copy_(0.5 + torch.rand_like(p))
    return model.eval()


def fold_and_compare(model, x, seeds=(1, 2)):
    plan = enjoyln.analyze(model, x)
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    for seed in seeds:
        other = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype)
        assert_same_outputs(model, folded, other)
    return plan, folded


def tokens(dtype=torch.float32):
    return torch.randn(2, 5, 4).to(dtype)


def image():
    return torch.randn(2, 3, 16, 16)


# --- recognised by what they compute -------------------------------------------------------------


@pytest.mark.parametrize(
    "norm, upcast",
    [
        (TimmLayerNorm, False),
        (OpenClipLayerNorm, False),
        (LayerNormFp32, True),
        (OlmoLayerNorm, True),
    ],
)
def test_layer_norm_modules_of_any_class_fold(norm, upcast):
    model = prepared(PreLN(norm))
    plan, folded = fold_and_compare(model, tokens())
    assert [(e.name, e.kind, e.foldable, e.upcast) for e in plan.layer_norms] == [
        ("norm1", "module", True, upcast),
        ("norm", "module", True, upcast),
    ]
    assert {c.param for c in plan.centered} == {
        "embed.weight",
        "embed.bias",
        "fc2.weight",
        "fc2.bias",
    }
    for name in ("norm1", "norm"):
        rms = getattr(folded, name)
        assert type(rms) is enjoyln.RMSNorm and rms.upcast is upcast and rms.dim == -1
        # a non-parametric norm is weightless (its weight a buffer of ones, outside the state dict)
        assert rms.elementwise_affine is not (norm is OlmoLayerNorm)
        assert (f"{name}.weight" in folded.state_dict()) is not (norm is OlmoLayerNorm)
    assert plan.format_version == (2 if upcast else 1)


@pytest.mark.parametrize("norm", [LayerNormFp32, OlmoLayerNorm])
def test_an_upcasting_norm_stays_upcasting_in_bfloat16(norm):
    model = prepared(PreLN(norm)).to(torch.bfloat16)
    x = tokens(torch.bfloat16)
    plan = enjoyln.analyze(model, x)
    assert [e.upcast for e in plan.foldable] == [True, True]
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert folded.norm.upcast and folded(x).dtype == torch.bfloat16
    assert enjoyln.check(model, folded, x).passed
    # the norm itself computes in float32 and rounds once: exactly the float32 norm, rounded
    half = torch.randn(3, D // 2, dtype=torch.bfloat16)
    z = torch.cat([half, -half], -1)  # zero-mean exactly, in any precision
    original = norm(D).to(torch.bfloat16)
    rms = enjoyln.RMSNorm.from_module(original, (D,), 1e-5, upcast=True)
    wide = enjoyln.RMSNorm.from_module(copy.deepcopy(original).float(), (D,), 1e-5)
    assert rms(z).dtype == torch.bfloat16
    assert torch.equal(rms(z), wide(z.float()).to(torch.bfloat16))
    torch.testing.assert_close(rms(z), original(z))


@pytest.mark.parametrize(
    "norm, bias",
    [
        (LayerNorm2d, True),
        (LayerNorm2dNoBias, False),
        (lambda d: ConvNextLayerNorm(d, data_format="channels_first"), True),
    ],
)
def test_channels_first_norms_fold_with_the_convolutions_centered_on_their_channels(norm, bias):
    model = prepared(ConvBlocks(norm))
    plan, folded = fold_and_compare(model, image())
    assert [(e.name, e.foldable, e.dim) for e in plan.layer_norms] == [
        ("norm1", True, 1),
        ("norm", True, 1),
    ]
    expected = {("stem.weight", 0), ("fc2.weight", 0)} | ({("stem.bias", 0), ("fc2.bias", 0)})
    assert {(c.param, c.axis) for c in plan.centered} == expected
    assert folded.norm.dim == 1 and (folded.norm.bias is not None) is bias
    assert plan.format_version == 2


def test_layer_norm_act_2d_keeps_its_activation_after_the_rms_norm():
    model = prepared(ConvBlocks(LayerNormAct2d))
    plan, folded = fold_and_compare(model, image())
    assert [(e.name, e.foldable, e.dim, e.then) for e in plan.layer_norms] == [
        ("norm1", True, 1, ("act",)),
        ("norm", True, 1, ("act",)),
    ]
    rms = folded.norm1
    assert (
        type(rms) is enjoyln.RMSNorm
        and isinstance(rms.act, nn.SiLU)
        and isinstance(rms.drop, nn.Identity)
    )
    assert set(dict(folded.named_parameters())) == set(dict(model.named_parameters()))


def test_a_plan_with_norm_forms_round_trips_and_applies_to_a_fresh_copy():
    model = prepared(ConvBlocks(LayerNormAct2d))
    plan = enjoyln.analyze(model, image())
    text = plan.to_json()
    again = FoldPlan.from_json(text)
    assert again == plan and '"then": [' in text and '"dim": 1' in text
    folded = enjoyln.fold(copy.deepcopy(model), plan=again)
    assert_same_outputs(model, folded, image())
    old_reader = dict(plan.to_dict(), format_version=99)
    with pytest.raises(PlanError, match="format version 99"):
        FoldPlan.from_dict(old_reader)


@pytest.mark.parametrize("norm", [LayerNormAct2d, OlmoLayerNorm])
def test_the_swap_in_place_keeps_the_form(norm):
    """Under accelerate's offloading the module changes class in place (``_become``)."""
    model, x = (
        (prepared(ConvBlocks(norm)), image())
        if norm is LayerNormAct2d
        else (prepared(PreLN(norm)), tokens())
    )
    plan = enjoyln.analyze(model, x)
    folded = copy.deepcopy(model)
    for m in (folded.norm1, folded.norm):
        m._hf_hook = object()
    enjoyln.fold(folded, plan=plan)
    assert type(folded.norm) is enjoyln.RMSNorm
    expected = (1, False, ("act",)) if norm is LayerNormAct2d else (-1, True, ())
    assert (folded.norm.dim, folded.norm.upcast, folded.norm.then) == expected
    assert_same_outputs(model, folded, x)


def test_a_top_level_group_norm_call_is_reported():
    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, D)

        def forward(self, x):
            return F.group_norm(self.lin(x), 2)

    (e,) = enjoyln.analyze(prepared(Top()), torch.randn(3, 4)).layer_norms
    assert e.norm == "group_norm" and not e.foldable and "not an nn.GroupNorm" in e.reason


def test_a_plan_for_fewer_norm_modules_of_another_class_is_refused():
    small, big = prepared(PreLN(OlmoLayerNorm)), prepared(PreLN(OlmoLayerNorm))
    big.extra = OlmoLayerNorm(D)  # one more norm module of the recognised class
    plan = enjoyln.analyze(small, tokens())
    assert plan.norm_modules == ["norm", "norm1"]
    with pytest.raises(PlanError, match="this model has extra"):
        enjoyln.fold(big, plan=plan)


# --- LayerScale through views, and over sums
# ----------------------------------------------------------


@pytest.mark.parametrize("scale", [LayerScale2d, Scale])
def test_layer_scale_through_a_view_of_its_gain(scale):
    model = prepared(ConvBlocks(LayerNorm2d, scale))
    plan, _ = fold_and_compare(model, image())
    assert [e.name for e in plan.foldable] == ["norm1", "norm"]
    gain = "ls.gamma" if scale is LayerScale2d else "ls.scale"
    assert {(c.param, c.axis, c.scale) for c in plan.centered} == {
        ("stem.weight", 0, None),
        ("stem.bias", 0, None),
        ("fc2.weight", 0, gain),
        ("fc2.bias", 0, gain),
    }


def test_convnext_gamma_reshape_through_a_permuted_linear():
    class Block(nn.Module):  # timm's ConvNeXtBlock with conv_mlp=False, without its depthwise conv
        def __init__(self):
            super().__init__()
            self.norm = TimmLayerNorm(D)
            self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
            self.gamma = nn.Parameter(torch.ones(D))

        def forward(self, x):
            shortcut = x
            x = x.permute(0, 2, 3, 1)
            x = self.fc2(F.gelu(self.fc1(self.norm(x)))).permute(0, 3, 1, 2)
            return x.mul(self.gamma.reshape(1, -1, 1, 1)) + shortcut

    model = prepared(nn.Sequential(nn.Conv2d(3, D, 1), Block(), LayerNorm2d(D)))
    plan, _ = fold_and_compare(model, image())
    assert [e.name for e in plan.foldable] == ["1.norm", "2"]
    assert ("1.fc2.weight", 0, "1.gamma") in {(c.param, c.axis, c.scale) for c in plan.centered}


def test_layer_scale_over_a_sum_of_linear_outputs():
    model = prepared(Parallel())
    plan, _ = fold_and_compare(model, tokens())
    assert len(plan.foldable) == len(plan.layer_norms) == 3
    scaled = {(c.param, c.scale) for c in plan.centered if c.scale}
    assert scaled == {
        (f"blocks.{i}.{p}_out_proj.{w}", f"blocks.{i}.ls.gamma")
        for i in (0, 1)
        for p in ("attn", "mlp")
        for w in ("weight", "bias")
    }


def test_a_layer_scaled_sum_whose_term_is_read_elsewhere_is_refused():
    class Leaky(ParallelScalingBlock):
        def forward(self, x):
            B, N, C = x.shape
            y = self.in_proj(self.in_norm(x))
            x_mlp, q, k, v = torch.split(y, [2 * C, C, C, C], dim=-1)
            attn = self.attn_out_proj(v)
            side = torch.tanh(attn)  # reads one term before the LayerScale
            return x + self.ls(attn + self.mlp_out_proj(F.gelu(x_mlp))), side

    class Model(Parallel):
        def __init__(self):
            super().__init__(blocks=1)
            self.blocks = nn.Sequential(Leaky())

        def forward(self, x):
            x, side = self.blocks[0](self.embed(x))
            return self.norm(x), side

    model = prepared(Model())
    plan, _ = fold_and_compare(model, tokens())
    assert [e.name for e in plan.foldable] == ["blocks.0.in_norm"]
    assert "reads the output of blocks.0.attn_out_proj before its LayerScale" in plan["norm"].reason


def test_a_layer_scaled_sum_with_a_zero_gain_entry_is_refused():
    model = prepared(Parallel(blocks=1))
    with torch.no_grad():
        model.blocks[0].ls.gamma[3] = 0.0
    plan, _ = fold_and_compare(model, tokens())
    assert [e.name for e in plan.foldable] == ["blocks.0.in_norm"]
    assert (
        "zero entry, so no centering of blocks.0.attn_out_proj and blocks.0.mlp_out_proj makes the "
        "product zero-mean"
    ) in plan["norm"].reason


# --- channels-first positional tables
# ---------------------------------------------------------------


def test_a_channels_first_position_table_is_centered_on_its_channels():
    model = prepared(PoolingViT())
    plan, _ = fold_and_compare(model, image())
    assert len(plan.foldable) == 2
    assert {(c.param, c.axis) for c in plan.centered} >= {
        ("pos_embed", 1),
        ("cls_token", 2),
        ("conv.weight", 0),
    }


def test_an_interpolated_and_tiled_channels_first_table():
    model = prepared(HieraDetStem())
    plan, _ = fold_and_compare(model, image())
    assert plan["norm1"].foldable
    assert {(c.param, c.axis) for c in plan.centered} == {
        ("pos_embed", 1),
        ("pos_embed_window", 1),
        ("proj.weight", 0),
        ("proj.bias", 0),
    }


def test_a_table_tiled_along_its_channels_is_refused():
    class Tiled(HieraDetStem):
        def __init__(self):
            super().__init__()
            self.pos_embed_window = nn.Parameter(torch.randn(1, D // 2, 8, 8))

        def forward(self, x):
            x = self.proj(x).permute(0, 2, 3, 1)
            pos = self.pos_embed_window.tile((1, 2, 1, 1))
            return self.head(self.norm1(x + pos.permute(0, 2, 3, 1)))

    plan, _ = fold_and_compare(prepared(Tiled()), image())
    assert not plan["norm1"].foldable


# --- modules that compute something else
# ---------------------------------------------------------------


class GainPlusOne(nn.LayerNorm):
    """transformers' VideoPrismLayerNorm: γ + 1 is not the module's own weight."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class ScaledOutput(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps) * 2


class ActFirst(nn.LayerNorm):
    def __init__(self, d):
        super().__init__(d)
        self.act = nn.GELU()

    def forward(self, x):
        return F.layer_norm(self.act(x), self.normalized_shape, self.weight, self.bias, self.eps)


class HalfCast(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(
            x.to(torch.bfloat16),
            self.normalized_shape,
            self.weight.to(torch.bfloat16),
            self.bias.to(torch.bfloat16),
            self.eps,
        ).to(x.dtype)


class Unused(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, None, self.eps)


class NotBack(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(
            x.transpose(1, 2), self.normalized_shape, self.weight, self.bias, self.eps
        )


def not_replaced(model, x):
    """The analysis's plan, and why it does not replace each norm module (whatever else refuses
    it)."""
    from enjoyln.analysis.capture import capture
    from enjoyln.analysis.driver import Analysis

    analysis = Analysis(capture(model, x))
    return analysis.run(), analysis.why_not_replaced


@pytest.mark.parametrize(
    "norm, why, first",
    [
        (GainPlusOne, "normalizes with add in norm1 as its weight, not its own weight", None),
        (ScaledOutput, "computes mul after its layer norm", None),
        (Unused, "leaves its bias norm1.bias unused", None),
        # the proof on the graph refuses these anyway, and says so first
        (
            ActFirst,
            "computes gelu in norm1.act before its layer norm",
            "its input includes the output of gelu",
        ),
        (HalfCast, "casts its input to bfloat16", "its input is rounded to bfloat16 in norm1"),
    ],
)
def test_a_module_computing_more_than_a_layer_norm_is_refused_with_what_it_computes(
    norm, why, first
):
    model = prepared(PreLN(norm))
    plan, whys = not_replaced(model, tokens())
    assert whys["norm1"] == why
    for e in plan.layer_norms:
        assert e.kind == "functional" and not e.foldable
    if first is None:
        assert plan["norm1"].reason.startswith(
            f"enjoyln cannot replace norm1 with an RMSNorm: it {why}; "
        )
    else:
        assert plan["norm1"].reason.startswith(first)
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert not any(isinstance(m, enjoyln.RMSNorm) for m in folded.modules())
    assert_same_outputs(model, folded, tokens())


def test_a_module_that_permutes_without_permuting_back_is_refused():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, D)
            self.norm = NotBack(5)

        def forward(self, x):
            return self.norm(self.lin(x))

    _, whys = not_replaced(prepared(Model()), tokens())
    assert whys == {"norm": "permutes its input and does not permute it back"}


def test_a_module_that_also_returns_its_input_is_refused():
    class Both(nn.LayerNorm):
        def forward(self, x):
            y = x.permute(0, 2, 1)
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps), y

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, D)
            self.norm = Both(D)

        def forward(self, x):
            out, side = self.norm(self.lin(x))
            return out, side

    plan, whys = not_replaced(prepared(Model()), tokens())
    assert whys == {"norm": "also computes permute besides its layer norm"}
    assert not plan["norm"].foldable


def test_a_top_level_functional_call_is_still_reported():
    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, D)

        def forward(self, x):
            return F.layer_norm(self.lin(x), (D,))

    (e,) = enjoyln.analyze(prepared(Top()), tokens()).layer_norms
    assert (
        e.kind == "functional"
        and "top level of the model" in e.reason
        and "GraphModule" in e.reason
    )
