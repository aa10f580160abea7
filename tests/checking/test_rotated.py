"""Rotated checkpoints: one written before the structured rotation (version 1, kept in tests/data
from that release) still passes the static check; one of version 2 (BLAS's fused-bias products)
still checks; a new one records version 3 and checks; in memory, the same path."""

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_same_outputs
from safetensors.torch import load_file, save_file

import enjoyln
from enjoyln.checking.static import static_check
from enjoyln.ops import rotate as R
from enjoyln.plan import RotationSpec
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.testing import perturb, tiny_model
from enjoyln.options import FoldOptions

DATA = Path(__file__).resolve().parent.parent / "data" / "rotated-v1"
REFERENCE_SHA256 = "263d8c50fd8bd8978428ccba7b0354ff79baff5f069e71e39e45e30ee89bcc2c"
"""Of the reference's weights as the release before version 2 saved them: the model below."""


def small_gpt2():
    return perturb(
        tiny_model("gpt2", n_layer=1, n_embd=24, n_head=2, vocab_size=32, n_positions=16)
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    path = tmp_path_factory.mktemp("rotated") / "ref"
    small_gpt2().save_pretrained(path)
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == REFERENCE_SHA256
    return path


def sha(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["w24", "w24-random"])
def test_a_checkpoint_rotated_by_the_dense_release_still_checks(ref, name, tmp_path):
    old = DATA / name
    plan = json.loads((old / "config.json").read_text())["enjoyln"]["plan"]
    assert (
        "version" not in plan["rotation"] and plan["format_version"] == 1
    )  # as that release wrote it
    report = static_check(open_checkpoint(ref), open_checkpoint(old))
    assert report.passed, report.summary()
    # made again from its recorded plan: the same bytes, so the dense path is still what version 1
    # means
    r = plan["rotation"]
    fold_checkpoint(
        ref,
        tmp_path / "again",
        FoldOptions.of(
            fuse_affine=True,
            check="none",
            rotate=RotationSpec(r["kind"], r["seed"], r["keep_mean"], 1),
        ),
    )
    assert sha(tmp_path / "again") == sha(old)
    # and a changed bit of a rotated tensor is caught
    bad = tmp_path / "bad"
    shutil.copytree(old, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["transformer.h.0.mlp.c_proj.weight"].view(torch.int32)[3, 5] ^= 1
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    assert not static_check(open_checkpoint(ref), open_checkpoint(bad)).passed


def test_a_new_rotation_records_version_3_and_checks(ref, tmp_path):
    out = tmp_path / "new"
    fold_checkpoint(ref, out, FoldOptions.of(fuse_affine=True, rotate=RotationSpec(), check="none"))
    config = json.loads((out / "config.json").read_text())
    plan = config["enjoyln"]["plan"]
    assert plan["rotation"]["version"] == 3 and plan["format_version"] == 5
    assert static_check(open_checkpoint(ref), open_checkpoint(out)).passed
    assert sha(out) != sha(DATA / "w24")
    # the writer scales a fused gain inside the rotation kernel, the in-memory steps scale and then
    # rotate:
    # the same bits, so the written checkpoint is the model enjoyln.rotate makes
    written, memory = (
        load_file(out / "model.safetensors"),
        enjoyln.rotate(small_gpt2()).state_dict(),
    )
    for key in (
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "lm_head.weight",
    ):
        assert torch.equal(written[key].view(torch.int32), memory[key].view(torch.int32)), key
    # the same tensors claimed as version 1: the recomputation tells them apart
    plan["rotation"].pop("version")
    plan["format_version"] = 1
    (out / "config.json").write_text(json.dumps(config))
    assert not static_check(open_checkpoint(ref), open_checkpoint(out)).passed


def test_in_memory_rotate_uses_the_structured_path():
    original = small_gpt2()
    rotated = enjoyln.rotate(copy.deepcopy(original))
    fused = enjoyln.fold(copy.deepcopy(original), fuse_affine=True)
    expected = R.rotate_(fused.lm_head.weight.detach().clone(), 1, R.structured(24, 0, True))
    assert torch.equal(rotated.lm_head.weight, expected)
    dense = enjoyln.rotate(copy.deepcopy(original), version=1)
    assert not torch.equal(dense.lm_head.weight, rotated.lm_head.weight)
    ids = {"input_ids": torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))}
    for model in (rotated, dense):
        assert_same_outputs(original, model, ids)


def test_version_2_still_checks_and_differs_only_in_the_fused_biases(ref, tmp_path):
    """Version 3 keeps version 2's Q; only a fused bias's W β is summed in the fixed order, the
    bits of ``dot_vectors``, not BLAS's."""
    tensors = {}
    for version in (2, 3):
        out = tmp_path / f"v{version}"
        options = FoldOptions.of(
            fuse_affine=True, rotate=RotationSpec(version=version), check="none"
        )
        fold_checkpoint(ref, out, options)
        plan = json.loads((out / "config.json").read_text())["enjoyln"]["plan"]
        assert (plan["rotation"]["version"], plan["format_version"]) == (
            version,
            {2: 3, 3: 5}[version],
        )
        assert static_check(open_checkpoint(ref), open_checkpoint(out)).passed
        tensors[version] = load_file(out / "model.safetensors")
    assert tensors[2].keys() == tensors[3].keys()
    fused = {"transformer.h.0.attn.c_attn.bias", "transformer.h.0.mlp.c_fc.bias"}
    for key in tensors[2].keys() - fused:
        assert torch.equal(tensors[2][key], tensors[3][key]), key
    source = load_file(ref / "model.safetensors")
    for key, norm in zip(sorted(fused), ("ln_1", "ln_2")):
        weight = source[key.replace(".bias", ".weight")]  # Conv1D: [in, out], β along axis 0
        beta = source[f"transformer.h.0.{norm}.bias"].double()
        expected = (source[key].double() + R.dot_vectors(weight, 0, beta)).float()
        assert torch.equal(tensors[3][key], expected), key


@pytest.mark.parametrize(
    "key",
    [
        "transformer.h.0.attn.c_attn.weight",  # a gain multiplied in on the way
        "transformer.h.0.attn.c_proj.weight",  # centered first
        "lm_head.weight",  # the untied head, from the embedding's bytes
    ],
)
def test_one_ulp_of_a_rotated_weight_fails_where_it_is(ref, tmp_path, key):
    """The static check compares a rotated weight with the candidate's bytes in one pass from
    both mapped files; one ulp off anywhere fails, and the reading path then says where."""
    out = tmp_path / "rotated"
    fold_checkpoint(ref, out, FoldOptions.of(fuse_affine=True, rotate=RotationSpec(), check="none"))
    sd = load_file(out / "model.safetensors")
    sd[key].view(-1).view(torch.int32)[7] += 1
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    report = static_check(open_checkpoint(ref), open_checkpoint(out))
    assert not report.passed
    assert any(p.startswith(f"{key} is not what the plan makes") for p in report.problems), (
        report.problems
    )
    where = report.first_difference
    columns = sd[key].shape[1]
    assert report.first_differing.startswith(key) and where.index == [7 // columns, 7 % columns]


def test_the_static_check_moves_on_as_each_rotated_weight_is_proven(ref, tmp_path, monkeypatch):
    """The progress moves as each tensor is compared in one pass, not all at once after them."""
    from enjoyln.folded.stream import StreamedTensors

    out = tmp_path / "rotated"
    fold_checkpoint(ref, out, FoldOptions.of(fuse_affine=True, rotate=RotationSpec(), check="none"))
    compared, seen = [0], []
    real = StreamedTensors.equal_in_file

    def counting(self, *args):
        compared[0] += 1
        return real(self, *args)

    monkeypatch.setattr(StreamedTensors, "equal_in_file", counting)
    report = static_check(
        open_checkpoint(ref),
        open_checkpoint(out),
        progress=lambda d, t: seen.append((d, t, compared[0])),
    )
    assert report.passed and report.computed >= 4
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen) and seen[-1][0] == seen[-1][1]
    assert len({c for _, _, c in seen}) >= 4, seen  # progress seen between the comparisons
