"""The truth run one module at a time: the same outputs as the model converted whole, the model
as it was afterwards, and the whole conversion wherever that cannot be vouched for."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import enjoyln
from enjoyln.analysis.inputs import Inputs, hf_example_inputs
from enjoyln.checking import forward, widening
from enjoyln.checking.running import cast_inputs, run_model
from enjoyln.checking.widening import NotWidened, widened
from enjoyln.testing import perturb, tiny_model

W = torch.float64


@pytest.mark.parametrize("arch", ["gpt2", "opt", "bloom", "gpt_neox", "falcon", "bert", "whisper"])
def test_the_outputs_are_the_whole_conversions_bit_for_bit(arch, monkeypatch):
    monkeypatch.setattr(widening, "CHUNK", 64)  # chunks as small as these models' weights
    model = perturb(tiny_model(arch), seed=3).eval()
    inputs = cast_inputs(Inputs((), hf_example_inputs(model, batch=2, seq_len=12, seed=1)), W)
    whole = run_model(copy.deepcopy(model).to(W), inputs, 0)
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    with widened(model, W) as scratch:
        lazy = run_model(model, inputs, 0)
    assert whole.keys() == lazy.keys()
    for key in whole:
        assert whole[key].dtype == lazy[key].dtype and torch.equal(whole[key], lazy[key]), key
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before
    # the scratch is about the largest module's own weights, not the model
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    total = sum(p.numel() for p in model.parameters())
    assert sum(c.numel() for c in scratch.chunks) <= 2 * largest < total


class ReadsAChildsWeight(nn.Module):
    """A parent that reads its child's weight itself, as a tied head written with F.linear does."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        return F.linear(self.norm(self.embed(ids)), self.embed.weight)


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


class ReturnsItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 4))

    def forward(self, n):
        return self.table[:n]  # a view of the widened weight


class TwoTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = ReturnsItsWeight(), ReturnsItsWeight()

    def forward(self, n):
        first = self.a(n)
        return first, self.b(n)  # b's widening reuses the scratch a's view would point into


def test_a_weight_read_outside_its_owners_forward_fails_loudly_and_the_model_is_restored():
    model = ReadsAChildsWeight()
    with pytest.raises(RuntimeError):
        with widened(model, W):
            model(torch.tensor([[1, 2, 3]]))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_weight_no_forward_converted_is_not_vouched_for():
    model = Unused()
    with pytest.raises(NotWidened, match="1 weights|2 weights"):
        with widened(model, W):
            model(torch.randn(2, 4, dtype=W))


def test_a_view_of_a_widened_weight_is_returned_as_a_copy():
    model = TwoTables()
    with widened(model, W):
        a, b = model(3)
    assert a.dtype == W and torch.equal(a, model.a.table[:3].double())
    assert torch.equal(b, model.b.table[:3].double())


@pytest.mark.parametrize(
    "model, inputs",
    [(ReadsAChildsWeight(), torch.tensor([[1, 2, 3]])), (Unused(), torch.randn(2, 4))],
)
def test_the_check_converts_whole_where_it_cannot_widen_by_module(model, inputs, monkeypatch):
    """The forward check still judges against a float64 truth, and the same one."""
    model = perturb(model, seed=2).eval()
    report = enjoyln.check(model, copy.deepcopy(model), inputs)
    assert (
        report.passed and report.criterion_kind == "precision" and report.truth_dtype == "float64"
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_check_gives_the_same_verdict_either_way(monkeypatch):
    ref = perturb(tiny_model("gpt2"), seed=5).eval()
    cand = enjoyln.fold(copy.deepcopy(ref))
    lazy = enjoyln.check(ref, cand)

    def refuse(model, dtype):
        raise NotWidened("forced")

    monkeypatch.setattr(forward, "widened", refuse)
    whole = enjoyln.check(ref, cand)
    assert lazy.passed and whole.passed
    assert [(o.name, o.max_abs_diff, o.reference_error, o.allowed) for o in lazy.outputs] == [
        (o.name, o.max_abs_diff, o.reference_error, o.allowed) for o in whole.outputs
    ]
    assert all(p.dtype == torch.float32 for p in ref.parameters())


def test_a_model_offloaded_by_accelerate_is_widened_as_its_layers_load(tmp_path):
    """Within a memory budget the weights stay on the meta device until accelerate's hook loads
    them for their module's forward: widened, they load in float64, and the outputs are those of
    the model loaded whole in float64, bit for bit; afterwards the model is as it was."""
    from enjoyln.store.load import load

    perturb(tiny_model("gpt2"), seed=3).save_pretrained(tmp_path / "ref")
    model = load(tmp_path / "ref", max_memory=60_000, offload_dir=tmp_path / "offload")
    assert "disk" in set(model.hf_device_map.values())
    # remove_duplicate=False: accelerate's own forward unties the two meta names of a tied weight
    meta = {n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"}
    assert meta
    inputs = cast_inputs(Inputs((), hf_example_inputs(model, batch=2, seq_len=12, seed=1)), W)
    whole = run_model(load(tmp_path / "ref", dtype=W), inputs, 0)
    with widened(model, W):
        lazy = run_model(model, inputs, 0)
    for key in whole:
        assert lazy[key].dtype == W and torch.equal(whole[key], lazy[key]), key
    assert {
        n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"
    } == meta
    assert all(p.dtype == torch.float32 for p in model.parameters())
