"""The static check: every tensor of a candidate is the plan applied to the reference."""

import copy
import json
import re

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import enjoyln
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.checking.static import static_check
from enjoyln.testing import perturb, tiny_model
from conftest import copy_dir as clone
from enjoyln.options import CheckOptions, FoldOptions


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    model = perturb(tiny_model("gpt2"), seed=41)
    model.save_pretrained(root / "ref")
    fold_checkpoint(root / "ref", root / "folded", FoldOptions.of(check="none"))
    return root / "ref", root / "folded", model


def run(ref, cand):
    return static_check(open_checkpoint(ref), open_checkpoint(cand))


def test_fold_passes_with_every_tensor_accounted_for(pair):
    ref, folded, _ = pair
    report = run(ref, folded)
    assert report.passed, report.summary()
    n = len(load_file(folded / "model.safetensors"))
    assert report.tensors == n and report.form == "folded" and report.plan.startswith("recorded")
    assert report.centered == 10 and report.untied == 1 and report.identical == n - 10
    assert report.bytes_read >= 2 * (folded / "model.safetensors").stat().st_size - 20_000


def test_the_reference_itself_passes_as_identical(pair):
    ref, _, _ = pair
    report = run(ref, ref)
    assert report.passed and report.form == "identical" and report.centered == 0


def test_a_fold_saved_by_transformers_passes_without_a_block(pair, tmp_path):
    ref, _, model = pair
    enjoyln.fold(copy.deepcopy(model)).save_pretrained(tmp_path / "hf")
    report = run(ref, tmp_path / "hf")
    assert report.passed and report.form == "folded" and report.plan == "analysis", report.summary()


def edited(folded, tmp_path, edit):
    cand = clone(folded, tmp_path / "cand")
    sd = load_file(cand / "model.safetensors")
    edit(sd)
    save_file(sd, cand / "model.safetensors", metadata={"format": "pt"})
    return cand


def test_a_dropped_beta_is_caught(pair, tmp_path):
    ref, folded, _ = pair
    cand = edited(folded, tmp_path, lambda sd: sd["transformer.h.0.ln_2.bias"].zero_())
    report = run(ref, cand)
    assert not report.passed and any(
        "transformer.h.0.ln_2.bias differs" in p for p in report.problems
    )


def test_a_perturbed_centered_tensor_is_caught(pair, tmp_path):
    ref, folded, _ = pair
    key = "transformer.h.1.mlp.c_proj.weight"
    cand = edited(
        folded, tmp_path, lambda sd: sd[key].view(-1)[7].add_(1e-3 * float(sd[key].abs().max()))
    )
    report = run(ref, cand)
    assert not report.passed and any(
        p.startswith(f"{key} is not {key} centered") for p in report.problems
    )


def test_a_partial_fold_without_a_block_is_not_proven(pair, tmp_path):
    """Only the embedding centered, head still tied: neither the reference nor the fold."""
    ref, _, _ = pair
    cand = clone(ref, tmp_path / "cand")
    sd = load_file(cand / "model.safetensors")
    wte = sd["transformer.wte.weight"]
    wte.sub_(wte.double().mean(1, keepdim=True).float())
    save_file(sd, cand / "model.safetensors", metadata={"format": "pt"})
    report = run(ref, cand)
    assert not report.passed and report.form == "identical" and report.differing == 1
    # judged as a copy: the centered embedding is measured against the reference itself
    d = (
        wte.double() - load_file(ref / "model.safetensors")["transformer.wte.weight"].double()
    ).abs()
    where = [int(i) for i in torch.unravel_index(d.argmax(), d.shape)]
    first = report.first_difference
    assert (first.tensor, first.index, first.max_abs_diff) == (
        "transformer.wte.weight",
        where,
        float(d.max()),
    )
    assert (
        report.problems
        == [report.first_differing]
        == [
            "transformer.wte.weight differs from the reference's transformer.wte.weight: "
            f"{first.describe()}"
        ]
    )


def test_a_tampered_plan_is_refused(pair, tmp_path):
    ref, folded, _ = pair
    cand = clone(folded, tmp_path / "cand")
    config = json.loads((cand / "config.json").read_text())
    config["enjoyln"]["plan"]["layer_norms"][0]["centered"][0]["axis"] = 0
    (cand / "config.json").write_text(json.dumps(config))
    report = run(ref, cand)
    assert (
        not report.passed
        and "the recorded plan is not what this enjoyln's analysis gives" in report.problems[0]
    )


def test_a_config_change_is_caught(pair, tmp_path):
    ref, folded, _ = pair
    cand = clone(folded, tmp_path / "cand")
    config = json.loads((cand / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-3
    (cand / "config.json").write_text(json.dumps(config))
    report = run(ref, cand)
    assert (
        not report.passed
        and "config.json changes layer_norm_epsilon from 1e-05 to 0.001" in report.problems
    )


def test_a_missing_head_is_caught(pair, tmp_path):
    """tie_word_embeddings is false, so from_pretrained would initialise the head at random."""
    ref, folded, _ = pair
    cand = edited(folded, tmp_path, lambda sd: sd.pop("lm_head.weight"))
    report = run(ref, cand)
    assert not report.passed and any("no tensor for lm_head.weight" in p for p in report.problems)


def set_config(cand, **changes):
    config = json.loads((cand / "config.json").read_text())
    config.update(changes)
    (cand / "config.json").write_text(json.dumps(config))
    return cand


def test_half_precision_candidate_of_a_float32_reference(pair, tmp_path):
    """A bfloat16 copy computes something else: it passes only when the caller says it is meant
    to run in bfloat16, and then it must load in bfloat16 (its config says so)."""
    ref, folded, _ = pair
    cand = edited(
        folded, tmp_path, lambda sd: sd.update({k: v.to(torch.bfloat16) for k, v in sd.items()})
    )
    report = run(ref, cand)
    assert not report.passed and any(
        "is stored as torch.bfloat16, but the reference's" in p for p in report.problems
    )
    report = static_check(open_checkpoint(ref), open_checkpoint(cand), dtype="bfloat16")
    assert not report.passed
    assert any(
        p.startswith("the candidate loads in float32 (from config.json), not in bfloat16")
        for p in report.problems
    )
    set_config(cand, dtype="bfloat16")
    report = static_check(open_checkpoint(ref), open_checkpoint(cand), dtype=torch.bfloat16)
    assert report.passed, report.summary()
    wrong = edited(
        cand, tmp_path / "w", lambda sd: sd["transformer.wpe.weight"].view(-1)[5].add_(0.05)
    )
    assert not static_check(open_checkpoint(ref), open_checkpoint(wrong), dtype="bfloat16").passed


def test_pickle_reference(pair, tmp_path):
    ref, folded, model = pair
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    for name in ("config.json", "generation_config.json"):
        (pkl / name).write_text((ref / name).read_text())
    torch.save(
        {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
        pkl / "pytorch_model.bin",
    )
    report = static_check(open_checkpoint(pkl, allow_pickle=True), open_checkpoint(folded))
    assert report.passed, report.summary()


def test_check_static_mode_runs_no_model(pair, monkeypatch):
    from enjoyln.checking import checkpoints as checkpoint

    ref, folded, _ = pair
    monkeypatch.setattr(
        checkpoint, "load", lambda *a, **k: pytest.fail("static mode loaded a model")
    )
    report = enjoyln.check_checkpoints(ref, folded, CheckOptions.of(mode="static"))
    assert report.passed and report.forward_skipped == "static check only" and report.outputs == []


def test_fold_refuses_a_forward_check_that_cannot_fit(pair, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from enjoyln.checking import checkpoints as checkpoint
    from enjoyln.cli.app import app

    ref, _, _ = pair
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 1 << 20)
    runner = CliRunner()
    result = runner.invoke(app, ["fold", str(ref), str(tmp_path / "out")])
    assert (
        result.exit_code == 2
        and "--static" in result.stderr
        and "1.0 MiB is available" in result.stderr
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.enjoyln-*"))
    result = runner.invoke(app, ["fold", str(ref), str(tmp_path / "out"), "--static"])
    assert (
        result.exit_code == 0
        and "static check" in result.output
        and "forward comparison not run" in result.output
    )
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in plain.modules()) == 5


def test_bounded_check_offloads_and_still_catches_a_change(pair, tmp_path, monkeypatch):
    """Within a budget far below the model, weights come from disk as each layer runs; the check
    stays exact, and a changed weight still fails the forward comparison."""
    from enjoyln.checking import checkpoints as checkpoint

    ref, folded, _ = pair
    monkeypatch.setattr(checkpoint, "_activation_bytes", lambda ck: 0)
    monkeypatch.setattr(checkpoint, "MIN_BUDGET", 0)
    maps, real = [], checkpoint.load

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        maps.append(set(getattr(model, "hf_device_map", {}).values()))
        return model

    monkeypatch.setattr(checkpoint, "load", spy)
    report = enjoyln.check_checkpoints(ref, folded, CheckOptions.of(max_memory=200_000))
    assert report.passed, report.summary()
    # the reference and the candidate (plain from_pretrained is loaded apart): the float64 truth is
    # the reference widened as each layer runs, not a third load, which read the whole file through
    # one mapping and wrote it again in float64 (1.64 GiB peak RSS for a 1 GB checkpoint and a
    # 512 MB budget, where the budget holds now)
    assert len(maps) == 2 and all("disk" in m for m in maps) and "within 195.3 KiB" in report.memory
    assert report.truth_dtype == "float64" and report.criterion_kind == "precision"
    assert report.max_rel_diff < 1e-6 and report.generation.passed
    # (a change of 1e-3 of its scale moves the logits by 2e-6:
    key = "transformer.h.1.attn.c_proj.weight"
    cand = edited(
        folded, tmp_path, lambda sd: sd[key].view(-1)[3].add_(float(sd[key].abs().max()))
    )  # static's job)
    report = enjoyln.check_checkpoints(
        ref, cand, CheckOptions.of(max_memory=200_000, mode="forward")
    )
    assert not report.passed and report.max_rel_diff > 1e-5


def test_fold_runs_the_check_one_model_at_a_time_when_two_do_not_fit(pair, tmp_path, monkeypatch):
    from enjoyln.checking import checkpoints as checkpoint

    ref, _, _ = pair
    monkeypatch.setattr(
        checkpoint, "forward_check_bytes", lambda ck: 1 << 40
    )  # "does not fit twice"
    result = fold_checkpoint(ref, tmp_path / "out")
    assert result.report.passed and "would not fit in memory side by side" in result.report.memory


def test_a_half_precision_change_within_a_few_ulps_of_the_maximum_is_caught(tmp_path):
    """In bfloat16, 4 ulp of a tensor's maximum is 3% of it: a bound on the whole tensor's scale
    let a whole embedding row move by that much, and the forward check's own half-precision
    margin did not see it either. Each element may be off by one ulp of itself, no more."""
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    perturb(tiny_model("gpt2"), seed=41).to(torch.bfloat16).save_pretrained(tmp_path / "ref")
    fold_checkpoint(tmp_path / "ref", tmp_path / "folded", FoldOptions.of(check="none"))
    assert run(tmp_path / "ref", tmp_path / "folded").passed

    def shift_row(sd):
        w = sd["transformer.wte.weight"].float()
        w[5] += (
            3.5
            * torch.finfo(torch.bfloat16).eps
            * float(w.abs().max())
            * torch.sign(torch.randn(w.shape[1]))
        )
        sd["transformer.wte.weight"] = w.to(torch.bfloat16)

    cand = edited(tmp_path / "folded", tmp_path, shift_row)
    report = run(tmp_path / "ref", cand)
    assert not report.passed and any("transformer.wte.weight is not" in p for p in report.problems)
    result = CliRunner().invoke(app, ["check", str(tmp_path / "ref"), str(cand)])
    assert result.exit_code == 1, result.output


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn, torch.int8])
def test_a_candidate_cast_to_another_kind_of_dtype_is_caught(pair, tmp_path, dtype):
    """The reference cast to int32 is all zeros, and equals a zeroed candidate; float8 keeps three
    bits. Only a half-precision copy of a float32 reference is accepted."""
    ref, folded, _ = pair
    key, centered_key = "transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.weight"
    cand = edited(
        folded, tmp_path, lambda sd: sd.update({k: sd[k].to(dtype) for k in (key, centered_key)})
    )
    report = run(ref, cand)
    assert not report.passed
    assert (
        f"{key} is stored as {dtype}, but the reference's {key} is torch.float32" in report.problems
    )
    assert any(p.startswith(f"{centered_key} is stored as") for p in report.problems)


def test_a_head_tied_again_is_caught_whatever_the_plan_says_it_was_tied_to(pair, tmp_path):
    """tie_word_embeddings back to true and no stored head: the head follows the centered
    embedding. A recorded plan naming another tensor as the head's partner must not hide it."""
    ref, folded, _ = pair
    cand = edited(folded, tmp_path, lambda sd: sd.pop("lm_head.weight"))
    config = json.loads((cand / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config["enjoyln"]["plan"]["untied"][0]["tied_to"] = "transformer.wpe.weight"
    (cand / "config.json").write_text(json.dumps(config))
    report = run(ref, cand)
    assert not report.passed
    assert any(
        p.startswith("the candidate still ties lm_head.weight to transformer.wte.weight")
        for p in report.problems
    ), report.problems
    assert any(
        "untied tensors include ('lm_head.weight', 'transformer.wpe.weight')" in p
        for p in report.problems
    ), report.problems


@pytest.mark.parametrize(
    "key,value",
    [
        ("rmsnorm", ["transformer.h.0.ln_1", "transformer.h.9.ln_1"]),
        ("centered", []),
        ("untied", []),
        ("auxiliary_centering", [{"module": "transformer.h.0", "where": "output"}]),
    ],
)
def test_the_block_lists_beside_the_plan_are_confirmed(pair, tmp_path, key, value):
    """A reader that takes `rmsnorm` from the block, not the full plan, must not be told to swap
    LNs that were never folded."""
    ref, folded, _ = pair
    cand = clone(folded, tmp_path / "cand")
    config = json.loads((cand / "config.json").read_text())
    config["enjoyln"][key] = value
    (cand / "config.json").write_text(json.dumps(config))
    report = run(ref, cand)
    assert (
        not report.passed
        and f"the enjoyln block's {key} list is not what its plan gives" in report.problems
    )


def test_the_tokenizer_and_generation_config_must_be_the_references(pair, tmp_path):
    """The same weights fed other ids, or generating under other settings, compute something
    else; the forward check feeds ids directly and never sees the tokenizer."""
    ref, folded, _ = pair
    source = clone(ref, tmp_path / "ref")
    (source / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    (source / "vocab.txt").write_text("a\nb\n")
    base = clone(folded, tmp_path / "base")
    for name in ("tokenizer.json", "vocab.txt"):
        (base / name).write_bytes((source / name).read_bytes())
    assert run(source, base).passed
    swapped = clone(base, tmp_path / "swapped")
    (swapped / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 1, "b": 0}}}))
    (swapped / "vocab.txt").write_text("b\na\n")
    generation = json.loads((swapped / "generation_config.json").read_text())
    (swapped / "generation_config.json").write_text(
        json.dumps({**generation, "repetition_penalty": 1.3})
    )
    (swapped / "special_tokens_map.json").write_text("{}")
    report = run(source, swapped)
    assert not report.passed
    assert {
        "the candidate's tokenizer.json differs from the reference's",
        "the candidate's vocab.txt differs from the reference's",
        "the candidate's generation config changes repetition_penalty from None to 1.3",
        "the candidate has special_tokens_map.json, a file a fold of the reference would not hold",
    } <= set(report.problems), report.problems
    (base / "vocab.txt").unlink()
    assert "the candidate lacks the reference's vocab.txt" in run(source, base).problems


def test_a_pickled_tensor_stored_as_a_strided_view(pair, tmp_path):
    """torch.save keeps strides: a transposed weight failed the fold and the check with
    "RuntimeError: view size is not compatible with input tensor's size and stride"."""
    ref, folded, model = pair
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    for name in ("config.json", "generation_config.json"):
        (pkl / name).write_text((ref / name).read_text())
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    key = "transformer.h.0.attn.c_attn.weight"
    sd[key] = sd[key].t().contiguous().t()
    torch.save(sd, pkl / "pytorch_model.bin")
    report = static_check(open_checkpoint(pkl, allow_pickle=True), open_checkpoint(folded))
    assert report.passed, report.summary()


# --- what a loader uses is what the gate compares (each was once a false pass) ---------------


def cand_of(folded, tmp_path, name="cand"):
    return clone(folded, tmp_path / name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_config_dtype_change_fails_unless_asked_for(pair, tmp_path, dtype):
    """transformers 5 loads in the config's dtype: the same bytes then compute in another
    precision (a GPT-2's stream overflows float16 into NaN)."""
    ref, folded, _ = pair
    cand = set_config(cand_of(folded, tmp_path), dtype=dtype)
    report = run(ref, cand)
    assert not report.passed
    assert f"config.json changes dtype from 'float32' to '{dtype}'" in report.problems
    assert any(
        p.startswith(f"the candidate loads in {dtype} (from config.json), the reference in float32")
        for p in report.problems
    ), report.problems
    asked = static_check(open_checkpoint(ref), open_checkpoint(cand), dtype=dtype)
    assert asked.passed, asked.summary()
    other = "bfloat16" if dtype == "float16" else "float16"
    assert not static_check(open_checkpoint(ref), open_checkpoint(cand), dtype=other).passed
    torch_dtype = cand_of(folded, tmp_path, "old_name")  # the old key, read the same way
    config = json.loads((torch_dtype / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    (torch_dtype / "config.json").write_text(json.dumps(config))
    assert not run(ref, torch_dtype).passed  # a key change is a change


def sharded_fold(ref, tmp_path):
    out = tmp_path / "sharded"
    fold_checkpoint(ref, out, FoldOptions.of(check="none", max_shard_size=200_000))
    assert (out / "model.safetensors.index.json").exists()
    return out


def set_index_metadata(cand, **metadata):
    index = json.loads((cand / "model.safetensors.index.json").read_text())
    index["metadata"].update(metadata)
    (cand / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_dtype_moved_into_the_index_metadata_fails(pair, tmp_path):
    """Without a config dtype, transformers takes the index metadata's."""
    ref, _, _ = pair
    sharded = sharded_fold(ref, tmp_path)
    assert run(ref, sharded).passed
    moved = cand_of(sharded, tmp_path, "moved")
    config = json.loads((moved / "config.json").read_text())
    del config["dtype"]
    (moved / "config.json").write_text(json.dumps(config))
    set_index_metadata(moved, dtype="float16")
    report = run(ref, moved)
    assert not report.passed
    assert any(
        p.startswith(
            "the candidate loads in float16 (from the metadata of model.safetensors.index.json)"
        )
        for p in report.problems
    ), report.problems
    # beside a config dtype, the metadata's is never read: that change computes nothing else
    inert = cand_of(sharded, tmp_path, "inert")
    set_index_metadata(inert, dtype="float16")
    assert run(ref, inert).passed, run(ref, inert).summary()
    broken = cand_of(sharded, tmp_path, "broken")
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["metadata"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    assert any("has no metadata object" in p for p in run(ref, broken).problems)


def _without_config_dtype(model, path):
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    del config["dtype"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_fold_of_a_checkpoint_without_a_config_dtype_loads_in_the_same_dtype(tmp_path):
    """The dtype then comes from the weights: the first floating tensor by name, which the untied
    lm_head.weight (a copy of a float16 table here) would be. The fold writes the dtype the
    original loads in into config.json, also with --no-check, and a re-sharded fold into its
    index too; the centered float16 table is stored in float32, the dtype it loads in."""
    model = perturb(tiny_model("gpt2"), seed=41)
    model.transformer.wte.half()
    ref = _without_config_dtype(model, tmp_path / "ref")
    assert transformers.GPT2LMHeadModel.from_pretrained(ref).dtype == torch.float32
    sharded = sharded_fold(ref, tmp_path)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert index["metadata"]["dtype"] == "float32"
    assert run(ref, sharded).passed
    result = fold_checkpoint(ref, tmp_path / "single")
    assert result.report.passed, result.report.summary()
    fold_checkpoint(ref, tmp_path / "unchecked", FoldOptions.of(check="none"))
    for out in (tmp_path / "single", tmp_path / "unchecked"):
        assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
        assert transformers.GPT2LMHeadModel.from_pretrained(out).dtype == torch.float32
    stored = load_file(tmp_path / "single" / "model.safetensors")
    assert (
        stored["lm_head.weight"].dtype == torch.float16
        and stored["transformer.wte.weight"].dtype == torch.float32
    )
    dropped = clone(tmp_path / "single", tmp_path / "dropped")
    config = json.loads((dropped / "config.json").read_text())
    del config["dtype"]
    (dropped / "config.json").write_text(json.dumps(config))
    assert any(
        p.startswith(
            "the candidate loads in float16 (from its first floating tensor (in model.safetensors))"
        )
        for p in run(ref, dropped).problems
    )


def test_a_lone_indexed_shard_keeps_its_index(tmp_path):
    """model-00001-of-00001.safetensors and an index whose metadata names the dtype: the fold
    keeps both (renamed to model.safetensors without its index, it would load in float16)."""
    import os

    ref = _without_config_dtype(perturb(tiny_model("gpt2"), seed=41).half(), tmp_path / "ref")
    lone = "model-00001-of-00001.safetensors"
    os.rename(ref / "model.safetensors", ref / lone)
    keys = list(load_file(ref / lone))
    (ref / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 1, "dtype": "float32", "note": "kept"},
                "weight_map": dict.fromkeys(keys, lone),
            }
        )
    )
    assert transformers.GPT2LMHeadModel.from_pretrained(ref).dtype == torch.float32
    result = fold_checkpoint(ref, tmp_path / "out")
    assert result.report.passed and result.files == [lone], result.report.summary()
    metadata = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())[
        "metadata"
    ]
    assert metadata == {
        "total_size": result.bytes_written,
        "dtype": "float32",
        "note": "kept",
        "enjoyln": enjoyln.__version__,
    }
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").dtype == torch.float32


def test_sampling_settings_in_config_json_are_compared_as_from_pretrained_applies_them(
    pair, tmp_path
):
    """Without generation_config.json, from_pretrained builds the generation config from
    config.json's raw values, sampling settings included."""
    ref, folded, _ = pair
    source = clone(ref, tmp_path / "ref")
    (source / "generation_config.json").unlink()
    cand = cand_of(folded, tmp_path)
    (cand / "generation_config.json").unlink()
    assert run(source, cand).passed
    set_config(cand, do_sample=True, temperature=5.0, top_k=0)
    report = run(source, cand)
    assert not report.passed
    assert {
        "the candidate's generation config changes do_sample from None to True",
        "the candidate's generation config changes temperature from None to 5.0",
        "config.json adds do_sample = True",
    } <= set(report.problems), report.problems
    import transformers

    assert transformers.GPT2LMHeadModel.from_pretrained(cand).generation_config.do_sample is True


@pytest.mark.parametrize(
    "name",
    [
        "bpe.codes",
        "sentencepiece.bpe.spm",
        "dict.txt",
        "emoji.json",
        "entity_vocab.json",
        "normalizer.json",
        "tokenizer/extra.txt",
    ],
)
def test_every_file_is_compared_whatever_its_name(pair, tmp_path, name):
    ref, folded, _ = pair
    source = clone(ref, tmp_path / "ref")
    cand = cand_of(folded, tmp_path)
    for d, content in ((source, '{"a": 0, "b": 1}'), (cand, '{"a": 1, "b": 0}')):
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text(content)
    report = run(source, cand)
    assert (
        not report.passed
        and f"the candidate's {name} differs from the reference's" in report.problems
    )
    (cand / name).write_text(
        '{\n  "a": 0,\n  "b": 1\n}\n'
    )  # another layout of the same JSON tokens
    assert run(source, cand).passed == name.endswith(".json"), run(source, cand).problems
    (cand / name).write_text(
        '{"b": 1, "a": 0}'
    )  # the same pairs in another order: a loader may iterate them
    assert not run(source, cand).passed


def nudged(sd, key, index, ulps=1):
    """``key``'s element ``index`` moved by ``ulps`` units in the last place of its dtype (its bit
    pattern as an integer, moved by ``ulps``: away from zero for positive ``ulps``)."""
    bits = sd[key].view(-1).view({2: torch.int16, 4: torch.int32}[sd[key].element_size()])
    bits[index] += ulps
    return sd


@pytest.mark.parametrize("key", ["transformer.h.1.mlp.c_proj.weight", "transformer.wte.weight"])
def test_one_ulp_of_a_centered_element_fails(pair, tmp_path, key):
    """A fold enjoyln wrote is bit for bit what the check computes; one ulp is not tolerated."""
    ref, folded, _ = pair
    cand = edited(folded, tmp_path, lambda sd: nudged(sd, key, 11))
    report = run(ref, cand)
    assert not report.passed and any(p.startswith(f"{key} is not") for p in report.problems), (
        report.summary()
    )


def test_one_ulp_of_a_fused_bfloat16_tensor_fails(tmp_path):
    """In bfloat16 one ulp of a bias moves the logits by about 1e-3: the tensors a fused affine
    computes must be bit for bit what the check recomputes."""
    perturb(tiny_model("gpt2"), seed=43).to(torch.bfloat16).save_pretrained(tmp_path / "ref")
    fold_checkpoint(
        tmp_path / "ref", tmp_path / "fused", FoldOptions.of(check="none", fuse_affine=True)
    )
    assert run(tmp_path / "ref", tmp_path / "fused").passed
    key = "transformer.h.0.attn.c_attn.bias"
    cand = edited(tmp_path / "fused", tmp_path, lambda sd: nudged(sd, key, 3, -1))
    report = run(tmp_path / "ref", cand)
    assert not report.passed and any(
        p.startswith(f"{key} is not what the plan makes") for p in report.problems
    )


def test_json_values_are_compared_by_type(pair, tmp_path):
    """1 and true are equal in Python, but a loader may test them apart."""
    ref, folded, _ = pair
    source = set_config(clone(ref, tmp_path / "ref"), custom_flag=True, custom_count=2)
    base = set_config(cand_of(folded, tmp_path, "base"), custom_flag=True, custom_count=2)
    assert run(source, base).passed
    cand = set_config(cand_of(base, tmp_path), custom_flag=1)
    assert "config.json changes custom_flag from True to 1" in run(source, cand).problems
    cand = set_config(cand_of(base, tmp_path, "float"), custom_count=2.0)
    assert "config.json changes custom_count from 2 to 2.0" in run(source, cand).problems
    reordered = cand_of(folded, tmp_path, "reordered")
    config = json.loads((reordered / "config.json").read_text())
    (reordered / "config.json").write_text(json.dumps(dict(reversed(config.items())), indent=7))
    assert run(ref, reordered).passed


def test_extra_missing_and_unreadable_files_fail(pair, tmp_path):
    ref, folded, _ = pair
    cand = cand_of(folded, tmp_path)
    (cand / "README.md").write_text("hello")
    assert (
        "the candidate has README.md, a file a fold of the reference would not hold"
        in run(ref, cand).problems
    )
    (cand / "README.md").unlink()
    (cand / "generation_config.json").unlink()
    assert "the candidate lacks the reference's generation_config.json" in run(ref, cand).problems
    cand = cand_of(folded, tmp_path, "dangling")
    (cand / "vocab.txt").symlink_to(tmp_path / "nowhere")
    assert (
        "the candidate's vocab.txt is a dangling symlink or a symlink loop"
        in run(ref, cand).problems
    )
    git = cand_of(
        folded, tmp_path, "git"
    )  # version-control data: no loader reads it, no fold copies it
    (git / ".git").mkdir()
    (git / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert run(ref, git).passed


@pytest.mark.parametrize("name", ["pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"])
def test_weights_in_another_format_beside_the_safetensors_fail(pair, tmp_path, name):
    """transformers prefers the safetensors, but other loaders (and from_pretrained with
    use_safetensors=False) read these: they are verified, never ignored."""
    ref, folded, model = pair
    cand = cand_of(folded, tmp_path)
    (cand / name).write_bytes(b"garbage")
    report = run(ref, cand)
    assert not report.passed
    assert (
        f"the candidate has {name}, weights a fold of the reference would not hold"
        in report.problems
    )
    # the reference itself, with its own second copy, is still the reference
    source = clone(ref, tmp_path / "ref")
    (source / name).write_bytes(b"the reference's own")
    assert run(source, source).passed
    (cand / name).write_bytes(b"the reference's own")
    assert run(source, cand).passed


def test_trusted_remote_code_is_compared(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    ref, _, _ = pair
    source = clone(ref, tmp_path / "ref")
    (source / "modeling_custom.py").write_text(
        "from transformers import GPT2LMHeadModel\n\n\nclass CustomLM(GPT2LMHeadModel):\n    pass\n"
    )
    set_config(
        source,
        architectures=["CustomLM"],
        auto_map={"AutoModelForCausalLM": "modeling_custom.CustomLM"},
    )
    fold_checkpoint(
        source, tmp_path / "folded", FoldOptions.of(check="none", trust_remote_code=True)
    )
    cand = tmp_path / "folded"

    def check():
        return static_check(
            open_checkpoint(source, trust_remote_code=True),
            open_checkpoint(cand, trust_remote_code=True),
        )

    assert check().passed, check().summary()
    with open(cand / "modeling_custom.py", "a") as f:
        f.write("\nTRIGGER = (17, 4, 99)  # a backdoor\n")
    assert "the candidate's modeling_custom.py differs from the reference's" in check().problems


def test_every_claim_of_the_enjoyln_block_is_verified(pair, tmp_path):
    """A rotation that does not keep the mean is exact only through enjoyln.load: a block claiming
    plain loading is exact too is a false promise."""
    from enjoyln.folded import config as block

    ref, folded, _ = pair
    rotated = tmp_path / "rotated"
    fold_checkpoint(ref, rotated, FoldOptions.of(check="none", rotate=("hadamard", 0, False)))
    assert run(ref, rotated).passed, run(ref, rotated).summary()

    def tampered(name, edit):
        cand = cand_of(rotated, tmp_path, name)
        config = json.loads((cand / "config.json").read_text())
        edit(config["enjoyln"])
        (cand / "config.json").write_text(json.dumps(config))
        return run(ref, cand)

    report = tampered("exact", lambda b: b["rotation"].update(plain_loading_exact=True))
    assert not report.passed
    assert "the enjoyln block's rotation is not what the confirmed plan gives" in report.problems[0]
    assert not tampered("format", lambda b: b.update(format_version=0)).passed
    assert not tampered("notes", lambda b: b["plan"]["notes"].append("checked by hand")).passed
    assert not tampered("extra", lambda b: b.update(verified=True)).passed
    # the writing tool's version is the one claim nothing can check
    assert tampered("version", lambda b: b.update(version="0.0.1")).passed
    assert block.output_config  # the one writer both sides use


def test_a_fold_with_auxiliary_centering_that_placed_none_passes(tmp_path):
    """The option leaves its trace only in the plan's reasons, which the block must still match."""
    perturb(tiny_model("bert"), seed=3).save_pretrained(tmp_path / "ref")
    result = fold_checkpoint(
        tmp_path / "ref",
        tmp_path / "folded",
        FoldOptions.of(check="none", auxiliary_centering=True),
    )
    assert not result.plan.auxiliary
    report = run(tmp_path / "ref", tmp_path / "folded")
    assert report.passed, report.summary()


def gptj_with_positions(tmp_path, n_positions):
    """A GPT-J whose sinusoid table (n_positions x rotary_dim floats, built at load, stored
    nowhere) outweighs its weights."""
    path = tmp_path / "gptj"
    perturb(tiny_model("gptj"), seed=5).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["n_positions"] = n_positions
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_memory_check_counts_what_the_model_builds_from_its_config(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from enjoyln.checking import checkpoints as checkpoint
    from enjoyln.cli.app import app

    ref = gptj_with_positions(tmp_path, 8_000_000)  # a 256 MB table in each of the two models
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 1 << 30)
    result = CliRunner().invoke(app, ["fold", str(ref), str(tmp_path / "a" / "out")])
    assert result.exit_code == 2, result.output
    # one model at a time still holds the table twice as wide for the truth (float64): 2 x 256 MB
    # and more
    assert re.match(
        r"error: the forward check needs at least 5\d\d\.\d MiB of memory even with one model at a "
        r"time, but the budget is 512\.0 MiB \(half of the 1\.0 GiB available\); pass --static",
        result.stderr,
    ), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()
    result = CliRunner().invoke(app, ["check", str(ref), str(ref)])
    assert result.exit_code == 2 and "the forward check needs at least" in result.stderr


def test_a_table_too_large_to_build_is_refused_before_it_is_built(tmp_path, monkeypatch):
    """n_positions = 1e9 makes a 32 GB table: refused, never allocated."""
    from enjoyln.checking import checkpoints as checkpoint

    ref = gptj_with_positions(tmp_path, 1_000_000_000)
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 8 << 30)
    with pytest.raises(
        enjoyln.CheckpointError, match=r"needs at least 59.7 GiB of memory even with one model"
    ):
        fold_checkpoint(ref, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert fold_checkpoint(ref, tmp_path / "out", FoldOptions.of(check="static")).report.passed


def test_forward_only_still_compares_the_dtype_the_model_loads_in(pair, tmp_path, monkeypatch):
    from enjoyln.checking import checkpoints as checkpoint

    ref, folded, _ = pair
    cand = set_config(cand_of(folded, tmp_path), dtype="float16")
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    report = enjoyln.check_checkpoints(ref, cand, CheckOptions.of(mode="forward"))
    assert (
        not report.passed
        and report.forward_skipped == "the candidate does not load as the reference does"
    )
    assert report.static.problems[0].startswith("the candidate loads in float16 (from config.json)")
    assert "FAIL: load settings" in report.summary()


def test_a_candidate_meant_for_another_dtype_is_judged_in_it_on_both_paths(
    pair, tmp_path, monkeypatch
):
    """With --dtype the forward comparison runs the candidate as from_pretrained loads it, also
    when the models run one at a time (which chose the dtype from the stored weights)."""
    from enjoyln.checking import checkpoints as checkpoint

    ref, folded, _ = pair
    cand = set_config(cand_of(folded, tmp_path), dtype="bfloat16")
    report = enjoyln.check_checkpoints(ref, cand, CheckOptions.of(dtype="bfloat16"))
    assert report.passed and report.dtype == "bfloat16", report.summary()
    monkeypatch.setattr(checkpoint, "_activation_bytes", lambda ck: 0)
    monkeypatch.setattr(checkpoint, "MIN_BUDGET", 0)
    report = enjoyln.check_checkpoints(
        ref, cand, CheckOptions.of(dtype="bfloat16", max_memory=200_000)
    )
    assert report.passed and report.dtype == "bfloat16" and report.memory, report.summary()


def test_forward_only_counts_what_the_candidate_builds(tmp_path, monkeypatch):
    """Without the static check, the candidate's config is whatever it says: its table counts."""
    from enjoyln.checking import checkpoints as checkpoint

    ref = gptj_with_positions(tmp_path / "r", 64)
    cand = gptj_with_positions(tmp_path / "c", 1_000_000_000)
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 8 << 30)
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(
        enjoyln.CheckpointError, match=r"needs at least 59.7 GiB of memory even with one model"
    ):
        enjoyln.check_checkpoints(ref, cand, CheckOptions.of(mode="forward"))


def test_json_files_are_read_as_the_loaders_read_them(pair, tmp_path):
    """transformers reads JSON as UTF-8 text, where json.loads refuses a byte-order mark: a
    generation_config.json with one is silently replaced by settings built from config.json, a
    tokenizer file with one does not load. Python's json.loads of the bytes skips the mark (and
    takes UTF-16), so such candidates used to pass as the same JSON tokens."""
    import transformers

    ref, folded, _ = pair
    source = clone(ref, tmp_path / "ref")
    generation = {
        **json.loads((ref / "generation_config.json").read_text()),
        "repetition_penalty": 1.5,
    }
    base = cand_of(folded, tmp_path, "base")
    for d in (source, base):
        (d / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (d / "emoji.json").write_text('{"a": 0}')
    assert run(source, base).passed
    for i, encode in enumerate(
        (lambda text: b"\xef\xbb\xbf" + text.encode(), lambda text: text.encode("utf-16"))
    ):
        cand = cand_of(base, tmp_path, f"cand{i}")
        for name in ("generation_config.json", "emoji.json"):
            (cand / name).write_bytes(encode((base / name).read_text()))
        problems = run(source, cand).problems
        assert {
            "the candidate's generation_config.json differs from the reference's",
            "the candidate's emoji.json differs from the reference's",
            "the candidate's generation config changes repetition_penalty from 1.5 to None",
        } <= set(problems), problems
        loaded = transformers.GPT2LMHeadModel.from_pretrained(cand).generation_config
        assert loaded.repetition_penalty is None  # what the gate predicted: the file was ignored
    # the same bytes on both sides are the same file, whatever a loader makes of them
    for name in ("generation_config.json", "emoji.json"):
        (source / name).write_bytes((cand / name).read_bytes())
    assert run(source, cand).passed, run(source, cand).problems
    (cand / "config.json").write_bytes(b"\xef\xbb\xbf" + (cand / "config.json").read_bytes())
    with pytest.raises(enjoyln.CheckpointError, match="config.json is not valid JSON"):
        open_checkpoint(cand)  # transformers cannot read it either


def test_the_candidates_code_is_compared_before_any_of_it_runs(pair, tmp_path, monkeypatch):
    """The gate imported the candidate's remote code (to build its model) before comparing it
    with the reference's: code that differed ran inside the gate, and could patch the comparison
    so that the gate passed a backdoor. Nothing of it may run until it is proven the reference's."""
    from typer.testing import CliRunner

    from enjoyln.checking.checkpoints import check_checkpoints
    from enjoyln.cli.app import app

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    ref, _, _ = pair
    source = clone(ref, tmp_path / "ref")
    code = (
        "from transformers import GPT2LMHeadModel\n\n\nclass CustomLM(GPT2LMHeadModel):\n    pass\n"
    )
    (source / "modeling_custom.py").write_text(code)
    set_config(
        source,
        architectures=["CustomLM"],
        auto_map={"AutoModelForCausalLM": "modeling_custom.CustomLM"},
    )
    fold_checkpoint(
        source, tmp_path / "folded", FoldOptions.of(check="none", trust_remote_code=True)
    )
    marker = tmp_path / "ran"
    payload = f"\nopen({str(marker)!r}, 'w').write('ran')\n"
    changed = cand_of(tmp_path / "folded", tmp_path, "changed")
    (changed / "modeling_custom.py").write_text(code + payload)
    other = cand_of(
        tmp_path / "folded", tmp_path, "other"
    )  # the same file, but the config imports another
    (other / "modeling_evil.py").write_text(code + payload)
    set_config(other, auto_map={"AutoModelForCausalLM": "modeling_evil.CustomLM"})
    for cand, problem in (
        (changed, "the candidate's modeling_custom.py differs from the reference's"),
        (other, "the candidate has modeling_evil.py, code the reference does not have"),
    ):
        for mode in ("full", "static", "forward"):
            report = check_checkpoints(
                source, cand, CheckOptions.of(trust_remote_code=True, mode=mode)
            )
            assert not report.passed and problem in report.static.problems, report.summary()
            assert not marker.exists(), f"the candidate's code ran ({mode})"
        report = static_check(
            open_checkpoint(source, trust_remote_code=True),
            open_checkpoint(cand, trust_remote_code=True),
        )
        assert not report.passed and problem in report.problems and not marker.exists()
        result = CliRunner().invoke(app, ["check", str(source), str(cand), "--trust-remote-code"])
        assert (
            result.exit_code == 1 and "none of it ran" in result.output and not marker.exists()
        ), result.output
    assert "auto_map" in " ".join(
        check_checkpoints(
            source, other, CheckOptions.of(trust_remote_code=True, mode="static")
        ).static.problems
    )
    assert check_checkpoints(
        source, tmp_path / "folded", CheckOptions.of(trust_remote_code=True, mode="static")
    ).passed


def test_a_fold_is_proven_from_the_mapped_files_and_only_a_difference_is_read(
    pair, tmp_path, monkeypatch
):
    """The fast path decides every tensor of a right fold in place; a tensor it finds different
    goes through the reading path, which names it (the fast path never passes what it cannot
    see)."""
    from enjoyln.store.tensors import TensorReader

    ref, folded, _ = pair
    reads = []
    read = TensorReader.read
    monkeypatch.setattr(
        TensorReader,
        "read",
        lambda self, key, into=None: reads.append(key) or read(self, key, into),
    )
    report = run(ref, folded)
    assert report.passed and reads == [], (reads, report.summary())
    key = "transformer.h.0.attn.c_proj.weight"
    # one ulp, of the last element
    cand = edited(folded, tmp_path, lambda sd: sd[key].view(-1)[-1:].view(torch.int32).add_(1))
    report = run(ref, cand)
    assert not report.passed and reads == [key, key]
    assert any(p.startswith(f"{key} is not {key} centered") for p in report.problems)


def test_files_that_cannot_be_mapped_are_read_instead(pair, tmp_path, monkeypatch):
    """A file system that refuses to map files (FUSE with direct I/O: ENODEV) sends every tensor
    to the reading path: the same verdicts, a right fold passes and one ulp still fails."""
    import errno

    from enjoyln.store.tensors import TensorReader

    def refuse(self, key):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(TensorReader, "mapped", refuse)
    ref, folded, _ = pair
    assert run(ref, folded).passed
    key = "transformer.h.0.mlp.c_proj.weight"
    cand = edited(folded, tmp_path, lambda sd: sd[key].view(-1)[7:8].view(torch.int32).add_(1))
    report = run(ref, cand)
    assert not report.passed and any(
        p.startswith(f"{key} is not {key} centered") for p in report.problems
    )


# --- the gate decides from the two directories alone ------------------------------------


def _without_centering(plan, param):
    """``plan`` with ``param``'s centering dropped from every LN, each LN left foldable."""
    from enjoyln.plan import FoldPlan

    data = plan.to_dict()
    for entry in data["layer_norms"]:
        entry["centered"] = [c for c in entry["centered"] if c["param"] != param]
    return FoldPlan.from_dict(data)


def _old_cache_key(ck, options):
    """The key under which enjoyln up to 0.1.0 looked up a cached plan: public data only."""
    import hashlib
    from pathlib import Path

    root = Path(enjoyln.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    text = json.dumps(
        {
            "config": ck.config,
            "architecture": ck.architecture,
            "options": options,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "enjoyln": digest.hexdigest(),
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_planted_plan_cache_entry_decides_nothing(pair, tmp_path, monkeypatch):
    """A fold that leaves one bias uncentered, its block recording that plan, and a plan cache
    entry planted to agree with it: the check analyses the reference afresh and fails it."""
    ref, _, model = pair
    tampered = _without_centering(enjoyln.analyze(model), "transformer.h.0.attn.c_proj.bias")
    fold_checkpoint(ref, tmp_path / "out", FoldOptions.of(plan=tampered, check="none"))
    cache = tmp_path / "cache"
    monkeypatch.setenv("ENJOYLN_CACHE", str(cache))
    monkeypatch.setenv("ENJOYLN_PLAN_CACHE", "1")
    (cache / "plans").mkdir(parents=True)
    options = {"auxiliary_centering": False, "fuse_affine": False, "rotate": None}
    for opts in (options, {"auxiliary_centering": False}):
        key = _old_cache_key(open_checkpoint(ref), opts)
        (cache / "plans" / f"{key}.json").write_text(json.dumps(tampered.to_dict()))
    report = run(ref, tmp_path / "out")
    assert not report.passed and report.plan == "recorded"
    assert any("transformer.h.0.attn.c_proj.bias" in p for p in report.problems), report.summary()
    # inside fold, the check re-derives its plan too: the plan the fold used is not trusted
    with pytest.raises(enjoyln.CheckFailed):
        fold_checkpoint(ref, tmp_path / "again", FoldOptions.of(plan=tampered, check="static"))
    assert not (tmp_path / "again").exists()


def test_a_copy_of_a_fold_passes_against_that_fold(pair, tmp_path):
    """cp -r of a fold is the fold: byte for byte, or with config.json written another way, or
    its mtimes changed. One changed weight byte still fails."""
    import shutil

    _, folded, _ = pair
    copy_ = tmp_path / "copy"
    shutil.copytree(folded, copy_)
    report = enjoyln.check_checkpoints(folded, copy_)
    assert report.passed and report.static.byte_identical, report.summary()
    assert report.forward_skipped and report.static.form == "identical"
    config = json.loads((copy_ / "config.json").read_text())
    (copy_ / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    report = enjoyln.check_checkpoints(folded, copy_)
    assert (
        report.passed and not report.static.byte_identical and report.static.form == "identical"
    ), report.summary()
    assert report.outputs  # not byte for byte: the forward part ran
    changed = edited(
        copy_, tmp_path / "c", lambda sd: sd["transformer.wte.weight"].view(-1)[3].add_(1e-3)
    )
    report = run(folded, changed)
    assert not report.passed and report.problems == [
        "transformer.wte.weight differs from the reference's transformer.wte.weight: max abs diff "
        "0.001 at [0, 3] "
        f"({str(np.float32(report.first_difference.value))} where it must be "
        f"{str(np.float32(report.first_difference.expected))})"
    ]
    assert abs(report.first_difference.value - report.first_difference.expected - 1e-3) < 1e-8


def _rounded_up(x):
    """``x`` (float32) rounded to bfloat16 toward +inf: where nearest rounding went down (about
    half the elements), one ulp up."""
    y = x.to(torch.bfloat16)
    return torch.where(
        y.float() < x, torch.nextafter(y, torch.tensor(float("inf"), dtype=torch.bfloat16)), y
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_candidate_folded_after_the_cast_passes_under_dtype(pair, tmp_path, dtype):
    """enjoyln's own in-memory fold of the model loaded in another dtype rounds once, from the
    cast weights: one of the two results the rule accepts, on both parts of the check."""
    ref, _, _ = pair
    loaded = transformers.GPT2LMHeadModel.from_pretrained(ref, dtype=getattr(torch, dtype)).eval()
    enjoyln.fold(loaded).save_pretrained(tmp_path / "cand")
    report = enjoyln.check_checkpoints(ref, tmp_path / "cand", CheckOptions.of(dtype=dtype))
    assert report.passed and report.static.form == "folded", report.summary()
    assert report.dtype == (
        "bfloat16" if dtype == "bfloat16" else "float32"
    )  # the narrower one sets the bar


def test_directed_rounding_fails_under_dtype(pair, tmp_path):
    """Every centered tensor rounded upward instead of to nearest: each element at most one
    bfloat16 ulp from the fold, but not what either way of making it gives."""
    ref, folded, _ = pair
    config = json.loads((folded / "config.json").read_text())
    centered = {c["param"] for e in config["enjoyln"]["plan"]["layer_norms"] for c in e["centered"]}

    def cast(sd):
        for k, v in sd.items():
            sd[k] = _rounded_up(v) if k in centered else v.to(torch.bfloat16)

    cand = set_config(edited(folded, tmp_path, cast), dtype="bfloat16")
    report = static_check(open_checkpoint(ref), open_checkpoint(cand), dtype="bfloat16")
    assert not report.passed
    assert {p.split(" is not ")[0] for p in report.problems} == centered, report.summary()
    nearest = set_config(
        edited(
            folded,
            tmp_path / "n",
            lambda sd: sd.update({k: v.to(torch.bfloat16) for k, v in sd.items()}),
        ),
        dtype="bfloat16",
    )
    assert static_check(open_checkpoint(ref), open_checkpoint(nearest), dtype="bfloat16").passed


def test_a_fused_fold_of_the_cast_reference_passes_under_dtype(pair, tmp_path):
    """Cast, then fold with fused affines: the reference saved in bfloat16 and folded from there.
    Each recomputed tensor is the fold's arithmetic on the cast weights, rounded once."""
    ref, _, _ = pair
    transformers.GPT2LMHeadModel.from_pretrained(ref, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "bf16"
    )
    fold_checkpoint(
        tmp_path / "bf16", tmp_path / "cand", FoldOptions.of(fuse_affine=True, check="none")
    )
    report = static_check(
        open_checkpoint(ref), open_checkpoint(tmp_path / "cand"), dtype="bfloat16"
    )
    assert report.passed and report.computed == report.tensors, report.summary()
    key = "transformer.h.0.attn.c_attn.bias"  # one ulp up on one recomputed element still fails
    up = edited(
        tmp_path / "cand",
        tmp_path / "up",
        lambda sd: (
            sd[key]
            .view(-1)[0]
            .copy_(
                torch.nextafter(
                    sd[key].view(-1)[0], torch.tensor(float("inf"), dtype=torch.bfloat16)
                )
            )
        ),
    )
    report = static_check(open_checkpoint(ref), open_checkpoint(up), dtype="bfloat16")
    assert not report.passed and report.problems[0].startswith(f"{key} is not what the plan makes")


def test_a_copy_checked_in_another_dtype_fails_as_a_fold_does(pair, tmp_path):
    """The byte-for-byte shortcut still judges --dtype: a float32 copy is not a bfloat16
    candidate."""
    ref, folded, _ = pair
    copy_ = clone(ref, tmp_path / "copy")
    as_copy = enjoyln.check_checkpoints(
        ref, copy_, CheckOptions.of(mode="static", dtype="bfloat16")
    )
    as_fold = enjoyln.check_checkpoints(
        ref, folded, CheckOptions.of(mode="static", dtype="bfloat16")
    )
    assert not as_copy.passed and not as_fold.passed and as_copy.static.byte_identical
    assert (
        as_copy.verdict()
        == as_fold.verdict()
        == (
            "FAIL: the weights of the candidate are not what the fold makes of the original's: the "
            "candidate loads in "
            "float32 (from config.json), not in bfloat16 as --dtype says"
        )
    )
    assert as_copy.static.problems == as_fold.static.problems
    assert enjoyln.check_checkpoints(
        ref, copy_, CheckOptions.of(mode="static", dtype="float32")
    ).passed  # what it is


def _zero_differences(value, key=""):
    """Every number under a key naming a difference that is zero, in a JSON-like value."""
    if isinstance(value, dict):
        return [z for k, v in value.items() for z in _zero_differences(v, k)]
    if isinstance(value, list):
        return [z for v in value for z in _zero_differences(v, key)]
    return [key] if "diff" in key and value == 0 else []


def test_a_failed_weight_check_says_where_and_by_how_much(pair, tmp_path):
    ref, folded, _ = pair
    plain, centered = "transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight"

    def edit(sd):
        sd[plain][5, 9] += 0.25
        sd[centered][3, 2] -= 0.125

    cand = edited(folded, tmp_path, edit)
    report = enjoyln.check_checkpoints(ref, cand, CheckOptions.of(mode="static"))
    static = report.static
    assert not report.passed and static.differing == 2
    lines = {p.split(" ")[0]: p for p in static.problems}
    first = static.first_difference
    assert set(lines) == {plain, centered} and static.first_differing == lines[first.tensor]
    assert (
        first.index == {plain: [5, 9], centered: [3, 2]}[first.tensor]
        and first.describe() in lines[first.tensor]
    )
    assert lines[plain].startswith(
        f"{plain} differs from the reference's {plain}: max abs diff 0.25 at [5, 9] ("
    )
    assert lines[centered].startswith(
        f"{centered} is not {centered} centered along axis 1: max abs diff 0.125 at [3, 2] ("
    )
    assert report.verdict() == (
        "FAIL: the weights of the candidate are not what the fold makes of the original's: "
        f"{lines[first.tensor]} (2 of {static.tensors} tensors differ)"
    )
    summary = report.summary()
    assert (
        "the candidate is the plan applied" not in summary
        and f"2 of {static.tensors} tensors differ" in summary
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert (
        data["max_abs_diff"] is None
        and data["max_rel_diff"] is None
        and not _zero_differences(data)
    )
    assert data["static"]["first_difference"]["tensor"] == first.tensor


def test_the_two_contracts_of_a_tower_fold_and_an_older_plan(tmp_path):
    """A CLIP fold keeping what it serves changes its vision tower's hidden state; one keeping
    every output does not. Plans before format 6 recorded no contract for the fold, which then
    kept every output exact: such a plan still checks, and one that claims more folds than it
    recorded's analysis gives is refused."""
    model = perturb(tiny_model("clip"), seed=42)
    model.save_pretrained(tmp_path / "ref")
    served, kept = tmp_path / "served", tmp_path / "all"
    common = dict(check="none", auxiliary_centering=True)
    fold_checkpoint(tmp_path / "ref", served, FoldOptions.of(**common))
    fold_checkpoint(tmp_path / "ref", kept, FoldOptions.of(**common, exact_outputs="all"))
    plans = [json.loads((d / "config.json").read_text())["enjoyln"]["plan"] for d in (served, kept)]
    assert plans[0]["format_version"] == 6
    assert plans[0]["changed_outputs"] == ["vision_model_output.last_hidden_state"]
    assert plans[1]["exact_outputs"] == "all" and "changed_outputs" not in plans[1]
    folded = [sum(e["foldable"] for e in p["layer_norms"]) for p in plans]
    assert folded[0] > folded[1]
    for d in (served, kept):
        assert run(tmp_path / "ref", d).passed
    config = json.loads((kept / "config.json").read_text())
    del config["enjoyln"]["plan"]["exact_outputs"]  # as an enjoyln before format 6 wrote it
    config["enjoyln"]["plan"]["format_version"] = config["enjoyln"]["format_version"] = 1
    (kept / "config.json").write_text(json.dumps(config))
    report = run(tmp_path / "ref", kept)
    assert report.passed and report.plan.startswith("recorded"), report.summary()
    config = json.loads((served / "config.json").read_text())
    del config["enjoyln"]["plan"]["changed_outputs"]  # claims every output stays exact
    (served / "config.json").write_text(json.dumps(config))
    assert not run(tmp_path / "ref", served).passed
