"""rotate: an orthogonal Q on the residual stream, proved exact on the graph."""

import copy

import pytest
import torch
import transformers
from torch import nn

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.transform.tensors import tensor_at
from enjoyln.transform.rotation import hadamard_matrix, rotate_, rotation_matrix
from enjoyln.testing import perturb, tiny_model
from conftest import assert_same_outputs, steps_keep_their_promise

ROTATABLE = ["gpt2", "opt", "phi", "gptj", "gpt_neox", "falcon", "vit"]


@pytest.mark.parametrize("n", [8, 64, 96, 1000])
@pytest.mark.parametrize("kind", ["hadamard", "random"])
@pytest.mark.parametrize("keep_mean", [True, False])
def test_rotation_matrices_are_orthogonal(n, kind, keep_mean):
    q = rotation_matrix(n, kind, 3, keep_mean)
    eye = torch.eye(n, dtype=torch.float64)
    assert torch.allclose(q @ q.T, eye, atol=1e-12)
    ones = torch.ones(n, dtype=torch.float64)
    assert torch.allclose(q @ ones, ones, atol=1e-12) == keep_mean
    assert torch.equal(q, rotation_matrix(n, kind, 3, keep_mean).clone())  # the same every time
    assert not torch.equal(q, rotation_matrix(n, kind, 4, keep_mean))


def test_a_returned_matrix_is_the_callers_own():
    """Changing a returned Q in place must not change the Q later rotations use."""
    q = rotation_matrix(8, "hadamard", 0, True)
    q.mul_(2)
    assert torch.allclose(
        rotation_matrix(8, "hadamard", 0, True) @ rotation_matrix(8, "hadamard", 0, True).T,
        torch.eye(8, dtype=torch.float64),
    )


def test_hadamard_spreads_a_single_feature():
    q = rotation_matrix(64, "hadamard", 0, False)
    assert torch.allclose(q.abs(), torch.full((64, 64), 1 / 8, dtype=torch.float64))
    h = hadamard_matrix(4) * 2
    assert torch.equal(
        h,
        torch.tensor(
            [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1.0]], dtype=torch.float64
        ),
    )


def test_rotate_along_any_axis_in_slabs():
    t = torch.randn(5, 12, 3)
    q = rotation_matrix(12, "random", 0, False)
    expected = torch.einsum("akb,kj->ajb", t.double(), q).float()
    rotate_(t, 1, q, slab=4 * 12 * 3)
    assert torch.allclose(t, expected, atol=1e-6)


@pytest.mark.parametrize("arch", ROTATABLE)
def test_rotate_is_exact_and_changes_every_stream_weight(arch):
    model = perturb(tiny_model(arch), seed=21)
    plan = enjoyln.analyze(model, fuse_affine=True, rotate=("hadamard", 0, True))
    assert plan.rotation is not None, plan.notes
    fused = enjoyln.fold(copy.deepcopy(model), fuse_affine=True)
    rotated = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert_same_outputs(model, rotated, hf_example_inputs(model, seed=22))
    for r in plan.rotation.rotated:
        before, after = tensor_at(fused, r.param), tensor_at(rotated, r.param)
        assert not torch.allclose(before, after, atol=1e-3), (
            r.param
        )  # really moved to the rotated basis
    # every writer of the stream is rotated: its centered weights are all in the rotation
    rotated_names = {r.param for r in plan.rotation.rotated}
    for c in plan.centered:
        if c.saved and not c.param.startswith("lm_head"):
            assert c.param in rotated_names or any(
                tensor_at(model, c.param) is tensor_at(model, n) for n in rotated_names
            ), c.param


def test_every_transformation_keeps_its_promise_when_rotating():
    model = perturb(tiny_model("gpt2"), seed=23)
    plan = enjoyln.analyze(model, fuse_affine=True, rotate=("random", 5, False))
    inputs = hf_example_inputs(model, seed=24)
    assert steps_keep_their_promise(model, plan, inputs) == []


def test_rotate_entry_point_and_its_refusals():
    model = perturb(tiny_model("gpt2"), seed=25)
    rotated = enjoyln.rotate(copy.deepcopy(model), kind="random", seed=1)
    assert_same_outputs(model, rotated, hf_example_inputs(model, seed=26))
    with pytest.raises(enjoyln.PlanError, match="already folded in memory"):
        enjoyln.rotate(rotated)
    base = perturb(transformers.GPT2Model(tiny_model("gpt2").config).eval(), seed=27)
    with pytest.raises(
        enjoyln.PlanError,
        match=r"ln_f's gain cannot move into the layers that read it, as a "
        r"rotation needs: its output is the model output `last_hidden_state`",
    ):
        enjoyln.rotate(base)


class Stream(nn.Module):
    """A tiny pre-LN stream: embedding, one residual block, final norm, head."""

    def __init__(self, case="plain", d=8, vocab=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.ln_f = nn.LayerNorm(d, elementwise_affine=case != "affine", bias=case != "tied")
        self.head = nn.Linear(d, vocab, bias=False)
        self.case = case
        if case == "tied":
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        y = self.ln1(h)
        if self.case == "gelu":
            y = torch.nn.functional.gelu(y)  # a norm output feeding a GELU
        h = h + self.out(torch.relu(self.fc(y)))
        f = self.ln_f(h)
        if self.case == "output":
            return self.head(f), f  # a norm output used as a model output
        if (
            self.case == "nonlinear"
        ):  # a non-linear reader of the (explicitly centered) stream: folding is
            side = torch.tanh(h - h.mean(-1, keepdim=True))  # fine, a rotation is not
            return self.head(f) + side.sum(-1, keepdim=True)
        if self.case == "unfolded":  # a LayerNorm of the stream that enjoyln cannot replace
            side = torch.nn.functional.layer_norm(h, (h.shape[-1],))
            return self.head(f) + side.sum(-1, keepdim=True)
        return self.head(f)


def _stream(case):
    torch.manual_seed(0)
    m = Stream(case)
    if case == "tied":  # a weightless final norm: nothing to fuse, so the head stays the embedding
        with torch.no_grad():
            m.ln_f.weight.fill_(1)
        m.ln_f.weight.requires_grad_(False)
    return perturb(m).eval()


@pytest.mark.parametrize(
    "case,why",
    [
        ("output", "the model output `1`"),
        ("gelu", "gelu"),
        ("nonlinear", "tanh"),
        ("unfolded", "it is a functional layer_norm, whose affine enjoyln keeps"),
    ],
)
def test_refusals(case, why):
    model = _stream(case)
    ids = torch.randint(0, 16, (2, 6))
    plan = enjoyln.analyze(model, ids, rotate=("hadamard", 0, True))
    assert plan.rotation is None and len(plan.foldable) >= 1
    note = next(n for n in plan.notes if "cannot be rotated" in n)
    assert why in note, note
    with pytest.raises(enjoyln.PlanError, match="cannot be rotated"):
        enjoyln.rotate(copy.deepcopy(model), ids)


def test_plain_stream_rotates_exactly():
    model = _stream("plain")
    ids = torch.randint(0, 16, (2, 6))
    rotated = enjoyln.rotate(copy.deepcopy(model), ids, kind="random")
    assert_same_outputs(model, rotated, ids)
    assert not torch.allclose(
        rotated.embed.weight,
        model.embed.weight - model.embed.weight.mean(1, keepdim=True),
        atol=1e-3,
    )


def test_a_tied_head_is_rotated_with_the_embedding():
    """Centering the embedding unties the head (the fold reports the cost); both are then
    rotated, the embedding on its output axis and the head on its input axis."""
    model = _stream("tied")
    ids = torch.randint(0, 16, (2, 6))
    plan = enjoyln.analyze(model, ids, rotate=("hadamard", 0, True))
    assert [u.param for u in plan.untied] == ["head.weight"] and plan.rotation is not None
    assert {(r.param, r.axis) for r in plan.rotation.rotated} >= {
        ("embed.weight", 1),
        ("head.weight", 1),
    }
    rotated = enjoyln.rotate(copy.deepcopy(model), ids, plan=plan)
    assert rotated.head.weight is not rotated.embed.weight
    assert_same_outputs(model, rotated, ids)


def test_rotated_checkpoint_through_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    src = tmp_path / "src"
    model = perturb(tiny_model("phi"), seed=28)
    model.save_pretrained(src)
    runner = CliRunner()
    inputs = hf_example_inputs(model, seed=29)
    for flag, plain_exact in (("--keep-mean", True), ("--no-keep-mean", False)):
        out = tmp_path / flag
        result = runner.invoke(app, ["rotate", str(src), str(out), flag, "--seed", "3"])
        assert result.exit_code == 0, result.output
        assert "PASS" in result.output and "recomputed" in result.output
        loaded = enjoyln.load(out)
        assert_same_outputs(model, loaded, inputs)
        plain = transformers.PhiForCausalLM.from_pretrained(out).eval()
        if plain_exact:
            assert_same_outputs(
                model, plain, inputs
            )  # the stream stays zero-mean: LayerNorms agree
        else:
            with pytest.raises(AssertionError):
                assert_same_outputs(model, plain, inputs)
        result = runner.invoke(app, ["check", str(src), str(out), "--static"])
        assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["rotate", str(src), str(tmp_path / "x"), "--kind", "fourier"])
    assert result.exit_code == 2 and "unknown --kind" in result.stderr


def test_rotate_refusal_through_the_command_line_writes_nothing(tmp_path, monkeypatch):
    """A post-LN model: refused in one sentence that says why, from one analysis of the meta model
    (what inspect runs), before any weight is read."""
    from typer.testing import CliRunner

    from enjoyln.cli.app import app
    from enjoyln.folded import planning
    from enjoyln.store.tensors import TensorReader

    src = tmp_path / "bert"
    perturb(tiny_model("bert"), seed=30).save_pretrained(src)
    analyses = []
    monkeypatch.setattr(
        planning, "analyze", lambda *a, **k: analyses.append(1) or enjoyln.analyze(*a, **k)
    )

    def no_reading(*args):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(TensorReader, "__init__", no_reading)
    result = CliRunner().invoke(app, ["rotate", str(src), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: the residual stream cannot be rotated: embeddings.LayerNorm writes the residual "
        "stream (add in "
        "encoder.layer.0.attention.output adds its output to another value), so its gain cannot "
        "move into the layers "
        "that read it, as a rotation needs; post-LN models such as BERT and MPNet, and towers "
        "whose stream starts at a LayerNorm with a gain such as CLIP's and Mllama's, cannot be "
        "rotated; nothing was written"
    )
    assert len(analyses) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.enjoyln-*"))
