"""The rules that fold the long tail (docs/how-it-works.md), each on a minimal module.

Every positive case folds exactly in float64 against the unmodified model, with
perturbed weights; every near miss is refused (and the fold stays exact).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import enjoyln
from enjoyln.testing import max_relative_diff, perturb
from models import D, Heads, LayerScale


def fold_exact(model, *inputs, tol=1e-9):
    """Analyze and fold a perturbed float64 copy; every output must stay the same."""
    torch.manual_seed(0)
    model = perturb(model.eval(), seed=3).double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    plan = enjoyln.analyze(model, inputs)
    folded = enjoyln.fold(copy.deepcopy(model), inputs, plan=plan)
    with torch.no_grad():
        ref, out = model(*inputs), folded(*inputs)
    ref, out = (ref, out) if isinstance(ref, tuple) else ((ref,), (out,))
    for r, o in zip(ref, out):
        assert max_relative_diff(r, o) < tol, plan.summary()
    return plan


def ids(T=6):
    return torch.randint(0, 32, (2, T))


def reasons(plan):
    return {e.name: e.reason for e in plan.layer_norms if not e.foldable}


# --- values read only for their shape -----------------------------------------------------------


class ShapeOnly(nn.Module):
    """BART's ``embed_positions(inputs_embeds[:, :, -1])`` and GPT-NeoX-Japanese's
    ``attn_bias.expand_as(residual)``: the stream is read for its shape only."""

    def __init__(self, read_value=False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(32, D), nn.Embedding(16, D)
        self.bias = nn.Parameter(torch.randn(D))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, 5)
        self.read_value = read_value

    def forward(self, ids):
        h = self.emb(ids)
        last = h[:, :, -1]  # a select along the feature axis
        h = h + self.pos(torch.arange(last.shape[1]))
        h = h + self.bias.expand_as(h)
        out = self.head(self.ln(h))
        return (out, last) if self.read_value else out


def test_values_read_only_for_their_shape_are_not_consumers():
    plan = fold_exact(ShapeOnly(), ids())
    assert plan["ln"].foldable
    assert {c.param for c in plan["ln"].centered} == {"emb.weight", "pos.weight", "bias"}


def test_near_miss_a_value_that_is_read():
    plan = fold_exact(ShapeOnly(read_value=True), ids())
    assert not plan["ln"].foldable and "select" in plan["ln"].reason


# --- LayerScale ---------------------------------------------------------------------------------


@pytest.mark.parametrize("left", [False, True])
def test_layer_scale_folds_by_centering_for_the_gain(left):
    plan = fold_exact(LayerScale(left=left), ids())
    assert plan["ln1"].foldable and plan["ln2"].foldable
    scaled = {(c.param, c.scale) for c in plan["ln2"].centered if c.scale}
    assert scaled == {("fc.weight", "gamma"), ("fc.bias", "gamma")}
    assert plan.to_dict()["layer_norms"][1]["centered"][0].get("scale") in (None, "gamma")


def test_layer_scale_centering_makes_the_scaled_output_zero_mean():
    model = perturb(LayerScale().eval()).double()
    enjoyln.fold(model, ids())
    scaled = model.fc.weight.detach() * model.gamma.detach()[:, None]
    assert scaled.mean(0).abs().max() < 1e-12
    assert (model.fc.bias * model.gamma).mean().abs() < 1e-12


@pytest.mark.parametrize(
    "case,why",
    [
        (dict(gamma=torch.cat([torch.zeros(1), torch.rand(D - 1) + 0.5])), "has a zero entry"),
        (dict(computed=True), "per-feature"),
        (dict(leak=True), "before its LayerScale"),
    ],
)
def test_layer_scale_near_misses(case, why):
    plan = fold_exact(LayerScale(**case), ids())
    assert plan["ln1"].foldable and not plan["ln2"].foldable
    assert why in plan["ln2"].reason


def test_a_plan_with_a_zero_gain_is_refused_before_any_change():
    model = perturb(LayerScale().eval())
    plan = enjoyln.analyze(model, ids())
    with torch.no_grad():
        model.gamma[3] = 0
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(enjoyln.PlanError, match="zero entry"):
        enjoyln.fold(model, plan=plan)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- ops that treat every feature alike along other axes -------------------------------------


class Positions(nn.Module):
    """A conv patch embedding plus a position table, then ``op``, then tokens into an LN."""

    def __init__(self, op):
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, 4, D))  # (1, positions, features), as YOLOS keeps it
        self.ln = nn.LayerNorm(
            2 * D if op == "upsample_features" else D // 2 if op == "pool_features" else D
        )
        self.head = nn.Linear(self.ln.normalized_shape[0], 3)
        self.op = op

    def forward(self, img):
        x = self.patch(img)  # [B, D, 4, 4]
        pos = self.pos.transpose(1, 2).reshape(1, D, 2, 2)
        x = x + F.interpolate(pos, size=x.shape[-2:], mode="bicubic", align_corners=False)
        op = self.op
        if op == "pool":
            x = F.avg_pool2d(x, 2)
        elif op == "adaptive_pool":
            x = F.adaptive_avg_pool2d(x, 3)
        elif op in ("reflect", "replicate"):
            x = F.pad(x, (1, 1, 1, 1), mode=op)
        elif op == "nearest":
            x = F.interpolate(x, scale_factor=2, mode="nearest")
        elif op == "roll":
            x = torch.roll(x, 1, dims=2)
        t = x.flatten(2).transpose(1, 2)  # tokens: [B, L, D]
        if op in ("gather", "gather_features"):
            keep = torch.argsort(torch.arange(t.shape[1]).flip(0))[:8]
            index = keep[None, :, None].repeat(t.shape[0], 1, D)
            if op == "gather_features":
                index = (index + torch.arange(D)) % t.shape[1]  # another position for each feature
            t = torch.gather(t, 1, index)
        elif op == "index_select":
            t = t.index_select(1, torch.tensor([3, 0, 5]))
        elif op == "upsample_features":
            t = F.interpolate(t, scale_factor=2, mode="linear")
        elif op == "pool_features":
            t = F.avg_pool1d(t, 2)
        elif op == "roll_features":
            t = torch.roll(t, 1, dims=-1)
        return self.head(self.ln(t))


@pytest.mark.parametrize(
    "op",
    [
        "upsample",
        "pool",
        "adaptive_pool",
        "reflect",
        "replicate",
        "nearest",
        "roll",
        "gather",
        "index_select",
    ],
)
def test_ops_that_treat_every_feature_alike_keep_the_zero_mean(op):
    plan = fold_exact(Positions(op), torch.randn(2, 3, 16, 16))
    assert plan["ln"].foldable, plan.summary()
    assert {c.param for c in plan["ln"].centered} == {"patch.weight", "patch.bias", "pos"}


@pytest.mark.parametrize(
    "op,why",
    [
        ("upsample_features", "resampled along the feature axis"),
        ("pool_features", "pooled along the feature axis"),
        ("gather_features", "indices that differ between features"),
        ("roll_features", "rolled along the feature axis"),
    ],
)
def test_the_same_ops_along_the_feature_axis_do_not(op, why):
    plan = fold_exact(Positions(op), torch.randn(2, 3, 16, 16))
    assert not plan["ln"].foldable and why in plan["ln"].reason


# --- per-head norms after a fused projection ------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_per_head_norms_fold_by_centering_each_heads_block(fused):
    plan = fold_exact(Heads(fused=fused), ids())
    assert len(plan.foldable) == len(plan.layer_norms) == 4
    q = {(c.param, c.groups, c.blocks) for c in plan["q_ln"].centered}
    if fused:  # blocks of (head, q/k/v): q is block 3h, k is 3h + 1, and v is left alone
        assert q == {("qkv.weight", 6, (0, 3)), ("qkv.bias", 6, (0, 3))}
        assert {c.blocks for c in plan["k_ln"].centered} == {(1, 4)}
    else:
        assert q == {("q.weight", 2, None), ("q.bias", 2, None)}


def test_near_miss_heads_mixed_before_the_norm():
    plan = fold_exact(Heads(mix=True), ids())
    assert not plan["q_ln"].foldable and "splits or merges" in plan["q_ln"].reason
    assert plan["k_ln"].foldable


def test_centering_one_tensor_in_blocks_for_two_norms_in_a_checkpoint_entry():
    from enjoyln.plan import Centering
    from enjoyln.transform.tensors import merge_centerings

    q, k = Centering("qkv.weight", 0, 6, (0, 3)), Centering("qkv.weight", 0, 6, (4, 1))
    assert merge_centerings([q, k]) == [Centering("qkv.weight", 0, 6, (0, 1, 3, 4))]
    assert merge_centerings([Centering("qkv.weight", 0, 6), k]) == [Centering("qkv.weight", 0, 6)]


# --- non-persistent buffers ------------------------------------------------------------------


def sinusoids(n, d):
    pos = torch.arange(n, dtype=torch.float32)[:, None] / 10 ** (torch.arange(d // 2) / (d // 2))
    return torch.cat([pos.sin(), pos.cos()], -1) + 0.3  # not zero-mean


class Sinusoidal(nn.Module):
    """A sinusoidal position table kept as a non-persistent buffer (M2M-100, XGLM)."""

    def __init__(self, leak=False):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.register_buffer("table", sinusoids(16, D), persistent=False)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, 5)
        self.leak = leak

    def forward(self, ids):
        pos = self.table[: ids.shape[1]]
        h = self.emb(ids) + pos
        h = h + self.fc(F.gelu(self.ln1(h)))
        out = self.head(self.ln2(h))
        return (out, pos.sum(-1)) if self.leak else out


def test_non_persistent_buffers_are_centered_in_memory():
    model = Sinusoidal()
    plan = fold_exact(model, ids())
    assert len(plan.foldable) == 2
    table = next(c for c in plan.centered if c.param == "table")
    assert table.saved is False and table.axis == 1
    assert "saved" not in plan.centered[0].to_dict() or plan.centered[0].param == "table"


def test_near_miss_a_buffer_read_by_something_else():
    plan = fold_exact(Sinusoidal(leak=True), ids())
    assert not plan.foldable
    assert "table" in plan["ln1"].reason and "sum" in plan["ln1"].reason


# --- no raw exceptions from the analysis ------------------------------------------------------


class DataDependent(nn.Module):
    """Rows chosen by a mask, so the batch is data-dependent: a mask on the layer's own output,
    which centering changes, or on the input, which it does not."""

    def __init__(self, mask_on_input: bool = False):
        super().__init__()
        self.lin, self.ln, self.mask_on_input = nn.Linear(8, 8), nn.LayerNorm(8), mask_on_input

    def forward(self, x):
        h = self.lin(x)
        return self.ln(h[(x if self.mask_on_input else h)[:, 0] > 0])


def test_data_dependent_sizes_are_followed():
    plan = enjoyln.analyze(DataDependent().eval(), torch.randn(6, 8))
    assert not plan["ln"].foldable and "the input of select" in plan["ln"].reason
    assert fold_exact(DataDependent(mask_on_input=True), torch.randn(6, 8))["ln"].foldable


class MaskedPatches(nn.Module):
    """A patch embedding as Idefics3 writes it: the real images picked by a mask (a data-dependent
    batch), a convolution with ``padding="valid"``, positions added, then a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4, padding="valid")
        self.pos = nn.Parameter(torch.randn(4, 8))
        self.ln, self.head = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, pixels):
        real = pixels.flatten(1).abs().sum(-1) > 0
        return self.head(self.ln(self.conv(pixels[real]).flatten(2).transpose(1, 2) + self.pos))


def test_a_patch_embedding_of_masked_images_is_centered():
    pixels = torch.randn(3, 3, 8, 8)
    pixels[1] = 0  # a padding image, dropped by the mask
    plan = fold_exact(MaskedPatches(), pixels)
    assert plan["ln"].foldable
    assert {c.param for c in plan["ln"].centered} == {"conv.weight", "conv.bias", "pos"}


class PooledTwice(nn.Module):
    """BLIP-2's vision tower: the post-norm over the sequence, then again over its first token,
    which the caller drops."""

    def __init__(self):
        super().__init__()
        self.lin, self.post, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        seq = self.post(self.lin(x))
        self.post(seq[:, 0])  # pooled, and never read
        return self.head(seq)


def test_a_dead_call_of_a_norm_does_not_block_it():
    plan = fold_exact(PooledTwice(), torch.randn(2, 5, 8))
    assert plan["post"].foldable


def test_any_analysis_failure_is_one_line_naming_the_op_and_module(monkeypatch):
    from enjoyln.analysis import rules

    def broken(op):
        raise IndexError("tuple index out of range")

    monkeypatch.setitem(rules.RULES, "add", rules.Rule(rules.SUM, broken))
    with pytest.raises(enjoyln.EnjoylnError) as info:
        enjoyln.analyze(LayerScale().eval(), ids())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "enjoyln could not analyse LayerScale at add at the top level of the model"
    )
    assert "IndexError: tuple index out of range" in message


# --- plans ---------------------------------------------------------------------------------------


def test_new_centering_fields_round_trip_and_old_plans_still_load():
    plan = enjoyln.analyze(Heads(), ids())
    again = enjoyln.FoldPlan.from_json(plan.to_json())
    assert again == plan
    old = {"param": "lin.weight", "axis": 0, "groups": 1}
    c = enjoyln.Centering.from_dict(old)
    assert c == enjoyln.Centering("lin.weight", 0) and c.to_dict() == old
