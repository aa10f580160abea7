"""Several residual streams, each rotated with its own Q: a vision tower's and a language model's,
found from the graph; a tapped tower layer's reader takes the rotation, and the plan records each
stream and what it keeps."""

import copy
import json

import pytest
import torch
from torch import nn

import enjoyln
from enjoyln.analysis.rotation import stream_seed
from enjoyln.plan import STREAM_NOT_ROTATED, FoldPlan, RotationSpec
from enjoyln.testing import perturb, tiny_model
from conftest import assert_same_outputs


class Tower(nn.Module):
    """A ViT-like tower of width 16: patches embedded by a Linear plus positions (or then a
    LayerNorm, as CLIP's ``pre_layrnorm``; with ``pad``, its output padded with two rows of zeros,
    as Mllama pads its tiles' patches), two pre-LN blocks, read at the first block (a tap) and
    through a final norm."""

    def __init__(self, pre_norm: bool, pad: bool = False):
        super().__init__()
        self.pad = pad
        self.embed, self.pos = nn.Linear(12, 16), nn.Parameter(torch.randn(4, 16))
        self.pre = nn.LayerNorm(16) if pre_norm else None
        self.ln = nn.ModuleList(nn.LayerNorm(16) for _ in range(2))
        self.up = nn.ModuleList(nn.Linear(16, 24) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(24, 16) for _ in range(2))
        self.post = nn.LayerNorm(16)

    def forward(self, pixels):
        h = self.embed(pixels) + self.pos
        h = self.pre(h) if self.pre is not None else h
        h = torch.nn.functional.pad(h, (0, 0, 0, 2)) if self.pad else h
        taps = []
        for ln, up, down in zip(self.ln, self.up, self.down):
            h = h + down(torch.nn.functional.gelu(up(ln(h))))
            taps.append(h)
        return taps[0], self.post(h), h


class Vlm(nn.Module):
    """A tower whose tapped layer a projector reads (or, with ``merge``, its final norm's output
    with 2 tokens merged into one, as a pixel-shuffle connector does), its tokens before the
    text's in a pre-LN language model of width 32; it returns its logits and the tower's last
    hidden state."""

    def __init__(
        self,
        pre_norm: bool = False,
        merge: bool = False,
        pad: bool = False,
        pool: bool = False,
        deepstack: bool = False,
        taps: bool = False,
    ):
        super().__init__()
        self.merge, self.pool, self.taps = merge, pool, taps
        # Qwen3-VL's DeepStack: the tapped layer, 2 tokens merged into one, then a LayerNorm over
        # the merged width and a Linear, its tokens beside the image's
        self.deepstack = deepstack
        if deepstack:
            self.ds_norm, self.ds_fc = nn.LayerNorm(32), nn.Linear(32, 32)
        self.tower, self.proj, self.tok = (
            Tower(pre_norm, pad),
            nn.Linear(32 if merge or taps else 16, 32),
            nn.Embedding(20, 32),
        )
        self.ln_1, self.up, self.fc = nn.LayerNorm(32), nn.Linear(32, 48), nn.Linear(48, 32)
        self.ln_f, self.head = nn.LayerNorm(32), nn.Linear(32, 20)

    def forward(self, input_ids, pixels):
        tap, last, raw = self.tower(pixels)
        image = last.reshape(last.shape[0], -1, 32) if self.merge else last if self.pool else tap
        if self.taps:  # Mllama-like: two tapped layers side by side along the features
            image = torch.cat([tap, raw], -1)
        parts = [self.proj(image), self.tok(input_ids)]
        if self.deepstack:
            parts.insert(1, self.ds_fc(self.ds_norm(tap.reshape(tap.shape[0], -1, 32))))
        h = torch.cat(parts, 1)
        h = h + self.fc(torch.tanh(self.up(self.ln_1(h))))
        out = {"logits": self.head(self.ln_f(h)), "vision_hidden_state": last}
        # BLIP-2's vision model: its post-norm called again on its own output's first token
        return {**out, "pooled": self.tower.post(last[:, 0])} if self.pool else out


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(1)
    return {"input_ids": torch.randint(0, 20, (2, 5)), "pixels": torch.randn(2, 4, 12)}


def _vlm(pre_norm=False, merge=False, pad=False, pool=False, deepstack=False, taps=False):
    torch.manual_seed(0)
    return perturb(Vlm(pre_norm, merge, pad, pool, deepstack, taps)).eval()


@pytest.fixture(scope="module")
def two_streams(inputs):
    return enjoyln.analyze(_vlm(), inputs, rotate=("hadamard", 7, True))


def test_each_stream_gets_its_own_rotation(two_streams):
    plan = two_streams
    tower = [e for e in plan.layer_norms if e.name.startswith("tower.")]
    # the tap's reader sees the stream itself: centering cannot fold the tower's norms, a rotation
    # reaches them
    assert not any(e.foldable for e in tower) and all("proj" in e.reason for e in tower)
    assert [(r.stream, r.width, r.seed) for r in plan.rotations] == [
        ("tower", 16, 7),
        ("the model", 32, stream_seed(7, "the model")),
    ]
    first, second = plan.rotations
    assert first.seed != second.seed
    # the projector takes Qᵀ of the tower on its input and Q of the language model on its output
    assert ("proj.weight", 1) in {(r.param, r.axis) for r in first.rotated}
    assert ("proj.weight", 0) in {(r.param, r.axis) for r in second.rotated}
    # the tower's norms stay LayerNorms, weightless: their γ and β moved into their readers
    assert all(e.fused for e in tower if e.name != "tower.post")
    assert plan.changed_outputs == ["vision_hidden_state"]


def test_two_rotated_streams_keep_the_served_outputs(two_streams, inputs):
    model = _vlm()
    rotated = enjoyln.rotate(copy.deepcopy(model), inputs, seed=7)
    with torch.no_grad():
        got, want = rotated(**inputs), model(**inputs)
    assert torch.allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(
        got["vision_hidden_state"], want["vision_hidden_state"], atol=1e-2
    )  # rotated
    assert isinstance(rotated.tower.ln[0], nn.LayerNorm) and bool(
        (rotated.tower.ln[0].weight == 1).all()
    )
    assert type(rotated.ln_f).__name__ == "RMSNorm"
    assert not torch.allclose(rotated.proj.weight, model.proj.weight, atol=1e-3)


def test_a_plan_of_several_streams_reads_back(two_streams):
    data = json.loads(two_streams.to_json())
    # format 4 for several streams, 5 for version 3's fused biases, 6 for the tower's hidden
    # state changed
    assert data["format_version"] == 6 and len(data["more_rotations"]) == 1
    assert data["changed_outputs"] == ["vision_hidden_state"]
    assert data["rotation"]["stream"] == "tower" and data["rotation"]["width"] == 16
    assert FoldPlan.from_json(two_streams.to_json()) == two_streams


def test_a_single_stream_plan_is_written_as_before():
    model = perturb(tiny_model("gpt2"))
    ids = torch.randint(0, 64, (2, 6))
    plan = enjoyln.analyze(model, ids, rotate=RotationSpec("hadamard", 3, True, version=2))
    data = plan.to_dict()
    assert data["format_version"] == 3 and data["rotation"]["seed"] == 3
    newest = enjoyln.analyze(model, ids, rotate=("hadamard", 3, True)).to_dict()
    assert newest["format_version"] == 5 and newest["rotation"]["version"] == 3
    assert not {"more_rotations", "exact_outputs", "changed_outputs"} & data.keys()
    assert not {"stream", "width"} & data["rotation"].keys()


def test_keeping_every_output_exact_leaves_the_tower_alone(inputs):
    model = _vlm()
    plan = enjoyln.analyze(model, inputs, rotate=RotationSpec(seed=7, exact_outputs="all"))
    assert (
        [r.stream for r in plan.rotations] == [""]
        and plan.rotation.seed == 7
        and not plan.changed_outputs
    )
    note = next(n for n in plan.notes if n.kind == STREAM_NOT_ROTATED)
    assert (
        note.startswith("the residual stream of tower (width 16) cannot be rotated")
        and "vision_hidden_state" in note
    )
    assert plan.to_dict()["exact_outputs"] == "all"
    rotated = enjoyln.rotate(copy.deepcopy(model), inputs, seed=7, exact_outputs="all")
    assert_same_outputs(model, rotated, tuple(inputs.values()))


def test_a_stream_that_starts_at_a_gain_is_not_rotated_and_says_why(inputs):
    """CLIP's tower: its stream is written by a LayerNorm with a gain, which no weight edit can
    rotate."""
    plan = enjoyln.analyze(_vlm(pre_norm=True), inputs, rotate=("hadamard", 0, True))
    assert [r.width for r in plan.rotations] == [
        0
    ] and plan.rotation.seed == 0  # the language model's, alone
    note = next(n for n in plan.notes if n.kind == STREAM_NOT_ROTATED)
    assert (
        note.startswith("the residual stream of tower (width 16)")
        and "tower.pre writes the residual stream" in note
    )
    assert all(not e.fused for e in plan.layer_norms if e.name.startswith("tower."))


def test_a_pre_norm_padded_with_zeros_is_seen_through_to_the_stream_it_writes(inputs):
    """Mllama's tower pads its pre-norm's output with rows of zeros before the residual sums: the
    reason names the sum the norm writes, not the pad, and the fold stays exact."""
    model = _vlm(pre_norm=True, pad=True)
    plan = enjoyln.analyze(model, inputs, rotate=("hadamard", 0, True))
    note = next(n for n in plan.notes if n.kind == STREAM_NOT_ROTATED)
    assert "tower.pre writes the residual stream (add in tower adds its output" in note
    assert "pad" not in note and plan["tower.pre"].foldable
    assert_same_outputs(model, enjoyln.fold(copy.deepcopy(model), inputs), tuple(inputs.values()))


def test_a_second_call_that_only_unserved_outputs_read_lets_the_tower_rotate(inputs):
    """BLIP-2's post-norm also normalizes its own output's first token, into an output not served:
    the rotation (keeping the served outputs) changes it and says so; keeping every output exact
    leaves the tower alone, as before."""
    model = _vlm(pool=True)
    plan = enjoyln.analyze(model, inputs, rotate=("hadamard", 0, True))
    assert [r.stream for r in plan.rotations] == ["tower", "the model"]
    assert plan["tower.post"].affine == "fused" and "pooled" in plan.changed_outputs
    rotated = enjoyln.rotate(copy.deepcopy(model), inputs, plan=plan)
    with torch.no_grad():
        got, want = rotated(**inputs), model(**inputs)
    assert torch.allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got["pooled"], want["pooled"], atol=1e-2)
    every = enjoyln.analyze(model, inputs, rotate=RotationSpec(exact_outputs="all"))
    assert [r.stream for r in every.rotations] == [""]


def test_a_norm_over_merged_tokens_rides_the_rotation_block_by_block(inputs):
    """A DeepStack merger normalizes 2 merged tokens of a tapped layer at once: its LayerNorm
    commutes with I₂ ⊗ Q, so it stays a LayerNorm, weightless, and its Linear takes Qᵀ on each
    token's block."""
    model = _vlm(deepstack=True)
    plan = enjoyln.analyze(model, inputs, rotate=("hadamard", 0, True))
    tower = plan.rotations[0]
    assert tower.stream == "tower" and plan["ds_norm"].affine == "fused"
    assert {
        (r.start, r.length) for r in tower.rotated if r.param == "ds_fc.weight" and r.axis == 1
    } == {(0, 16), (16, 16)}
    rotated = enjoyln.rotate(copy.deepcopy(model), inputs, plan=plan)
    assert isinstance(rotated.ds_norm, nn.LayerNorm) and bool((rotated.ds_norm.weight == 1).all())
    with torch.no_grad():
        assert torch.allclose(
            rotated(**inputs)["logits"], model(**inputs)["logits"], rtol=1e-5, atol=1e-6
        )


def test_tapped_layers_side_by_side_take_the_rotation_block_by_block(inputs):
    """Two tapped layers concatenated along the features before the projector (as Mllama reads
    its intermediate layers with its last): each is the stream rotated by the same Q, so the
    projector takes Qᵀ on each block."""
    model = _vlm(taps=True)
    plan = enjoyln.analyze(model, inputs, rotate=("hadamard", 0, True))
    tower = plan.rotations[0]
    assert tower.stream == "tower" and {
        (r.start, r.length) for r in tower.rotated if r.param == "proj.weight" and r.axis == 1
    } == {(0, 16), (16, 16)}
    rotated = enjoyln.rotate(copy.deepcopy(model), inputs, plan=plan)
    with torch.no_grad():
        assert torch.allclose(
            rotated(**inputs)["logits"], model(**inputs)["logits"], rtol=1e-5, atol=1e-6
        )


def test_a_merger_of_tokens_takes_the_rotation_block_by_block(inputs):
    """A connector that lays 2 tokens side by side before its Linear reads the final norm's features
    twice: the norm's γ and β, and the rotation, go into each block of its input (I₂ ⊗ Q)."""
    model = _vlm(merge=True)
    plan = enjoyln.analyze(model, inputs, rotate=("hadamard", 0, True))
    tower = plan.rotations[0]
    assert {
        (r.start, r.length) for r in tower.rotated if r.param == "proj.weight" and r.axis == 1
    } == {(0, 16), (16, 16)}
    assert {(f.start, f.length) for f in plan["tower.post"].fused} == {(0, 16), (16, 16)}
    rotated = enjoyln.rotate(copy.deepcopy(model), inputs, plan=plan)
    with torch.no_grad():
        assert torch.allclose(
            rotated(**inputs)["logits"], model(**inputs)["logits"], rtol=1e-5, atol=1e-6
        )
