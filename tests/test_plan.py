import json

import pytest
import torch

import enjoyln
from enjoyln.plan import (
    NOT_ROTATED,
    TRAINING_MODE,
    Centering,
    FoldPlan,
    LayerNormEntry,
    Note,
    RotationSpec,
    Untie,
)
from enjoyln.options import FoldOptions
from enjoyln.testing import perturb, tiny_model
from models import Heads


def test_json_round_trip_of_a_real_plan():
    plan = enjoyln.analyze(perturb(tiny_model("bert")))
    again = FoldPlan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(plan.to_json())["format_version"] == 1
    assert isinstance(again.layer_norms[0].centered[0], Centering)


def test_summary_names_every_ln_and_the_untie_cost():
    plan = enjoyln.analyze(perturb(tiny_model("gpt2")))
    text = plan.summary()
    assert text.startswith("GPT2LMHeadModel: 5 of 5 LayerNorms foldable")
    for e in plan.layer_norms:
        assert e.name in text
    assert "Untie lm_head.weight from transformer.wte.weight: +32.0 KiB" in text


def test_centered_is_deduplicated_and_only_from_foldable():
    a, b = Centering("x", 0), Centering("y", 1)
    plan = FoldPlan(
        "M",
        [
            LayerNormEntry("l1", "module", True, centered=[a, b]),
            LayerNormEntry("l2", "module", True, centered=[a]),
            LayerNormEntry("l3", "module", False, "no", centered=[Centering("z", 0)]),
        ],
        untied=[Untie("h", "x", 10), Untie("g", "x", 6)],
    )
    assert plan.centered == [a, b]
    assert plan.untie_bytes == 16
    with pytest.raises(KeyError):
        plan["nope"]


def test_newer_format_is_refused():
    with pytest.raises(enjoyln.PlanError, match="format version 99"):
        FoldPlan.from_dict({"format_version": 99, "model": "M"})


def test_notes_are_typed_and_keep_their_kind_through_json():
    model = perturb(tiny_model("gpt2")).train()
    plan = enjoyln.analyze(model, rotate=("hadamard", 0, True))
    assert plan.note(TRAINING_MODE) is not None and plan.note(NOT_ROTATED) is not None
    # plain strings in the checkpoint's block, which the static check compares type for type
    assert all(type(n) is str for n in plan.to_dict()["notes"])
    again = FoldPlan.from_json(plan.to_json())
    assert again == plan
    assert [getattr(n, "kind", None) for n in again.notes] == [n.kind for n in plan.notes]
    with pytest.warns(UserWarning, match="training mode"):
        enjoyln.fold(perturb(tiny_model("gpt2")).train(), plan=again)
    with pytest.raises(enjoyln.PlanError, match="cannot be rotated: no LayerNorm folds"):
        enjoyln.rotate(perturb(tiny_model("gpt2")).train(), plan=again)


def test_code_acts_on_a_note_kind_not_on_its_words():
    # a note that only mentions the words: fold used to warn on `"training mode" in note`
    model = perturb(tiny_model("gpt2")).eval()
    plan = enjoyln.analyze(model)
    plan.notes.append(Note("auxiliary centering was not applied: a hook met training mode dropout"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enjoyln.fold(model, plan=plan)
    plan = FoldPlan(
        "M",
        notes=["the residual stream cannot be rotated, said a note", Note.of(NOT_ROTATED, "why")],
    )
    assert plan.note(NOT_ROTATED) == "the residual stream cannot be rotated: why"


def test_rotation_spec_takes_the_public_tuple():
    assert RotationSpec.of(("random", "3", 0)) == RotationSpec("random", 3, False)
    assert RotationSpec.of(None) is None and RotationSpec.of(RotationSpec()) == RotationSpec(
        "hadamard", 0, True
    )


def test_a_rotation_seed_outside_64_bits_is_refused_not_aliased():
    """Seeds wrap modulo 2**64 in the generators, so one outside would give another seed's Q under
    its own name in the config."""
    assert RotationSpec.of(("hadamard", 2**64 - 1, True)).seed == 2**64 - 1
    model = perturb(tiny_model("gpt2"))
    for seed in (-1, 2**64):
        with pytest.raises(
            enjoyln.PlanError, match=rf"seed must be from 0 to 2\*\*64 - 1, got {seed}"
        ):
            RotationSpec.of(("hadamard", seed, True))
        with pytest.raises(enjoyln.PlanError, match="seed must be from 0"):
            enjoyln.rotate(model, seed=seed)


def test_a_new_rotation_of_a_directory_checks_its_seed_first(tmp_path):
    """However the spec is built; a recorded one is checked as it was made (no such refusal)."""
    perturb(tiny_model("gpt2")).save_pretrained(tmp_path / "m")
    spec = RotationSpec("hadamard", 2**64)
    with pytest.raises(enjoyln.PlanError, match="seed must be from 0"):
        enjoyln.analyze_checkpoint(tmp_path / "m", fuse_affine=True, rotate=spec)
    with pytest.raises(enjoyln.PlanError, match="seed must be from 0"):
        enjoyln.fold_checkpoint(tmp_path / "m", tmp_path / "out", FoldOptions(rotate=spec))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "blocks, words",
    [
        (None, "in 2 groups)"),
        ((1,), "in 2 groups, blocks 1)"),
        (tuple(range(8)), "in 8 groups, blocks 0, 1, 2, 3, 4, 5, ...)"),
    ],
)
def test_a_grouped_centering_describes_itself(blocks, words):
    groups = 8 if blocks and len(blocks) > 6 else 2
    assert Centering("w", 0, groups, blocks).describe() == f"w (axis 0, {words}"


def test_summary_of_per_head_norms_fed_by_separate_projections():
    """q and k LayerNorms over each head, after q/k/v projections of their own: every block of q's
    and k's output is centered (blocks None), which the summary once failed to print."""
    plan = enjoyln.analyze(perturb(Heads(fused=False)), torch.randint(0, 32, (2, 5)))
    grouped = [c for c in plan.centered if c.groups > 1]
    assert grouped and all(c.blocks is None for c in grouped)
    assert f"  {grouped[0].describe()}" in plan.summary().splitlines()
