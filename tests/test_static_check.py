"""The static check: every tensor of a candidate is the plan applied to the reference."""

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import enjoyln
from enjoyln.checkpoint import fold_checkpoint, open_model_dir
from enjoyln.static_check import static_check
from enjoyln.testing import perturb, tiny_model
from conftest import copy_dir as clone


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    model = perturb(tiny_model("gpt2"), seed=41)
    model.save_pretrained(root / "ref")
    fold_checkpoint(root / "ref", root / "folded", check="none")
    return root / "ref", root / "folded", model



def run(ref, cand):
    return static_check(open_model_dir(ref), open_model_dir(cand))


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
    assert not report.passed and any("transformer.h.0.ln_2.bias differs" in p for p in report.problems)


def test_a_perturbed_centered_tensor_is_caught(pair, tmp_path):
    ref, folded, _ = pair
    key = "transformer.h.1.mlp.c_proj.weight"
    cand = edited(folded, tmp_path, lambda sd: sd[key].view(-1)[7].add_(1e-3 * float(sd[key].abs().max())))
    report = run(ref, cand)
    assert not report.passed and any(p.startswith(f"{key} is not {key} centered") for p in report.problems)


def test_a_partial_fold_without_a_block_is_not_proven(pair, tmp_path):
    """Only the embedding centered, head still tied: neither the reference nor the fold."""
    ref, _, _ = pair
    cand = clone(ref, tmp_path / "cand")
    sd = load_file(cand / "model.safetensors")
    wte = sd["transformer.wte.weight"]
    wte.sub_(wte.double().mean(1, keepdim=True).float())
    save_file(sd, cand / "model.safetensors", metadata={"format": "pt"})
    report = run(ref, cand)
    assert not report.passed and report.form == "identical"
    assert report.problems == ["transformer.wte.weight differs from the reference's transformer.wte.weight"]


def test_a_tampered_plan_is_refused(pair, tmp_path):
    ref, folded, _ = pair
    cand = clone(folded, tmp_path / "cand")
    config = json.loads((cand / "config.json").read_text())
    config["enjoyln"]["plan"]["layer_norms"][0]["centered"][0]["axis"] = 0
    (cand / "config.json").write_text(json.dumps(config))
    report = run(ref, cand)
    assert not report.passed and "the recorded plan is not what this enjoyln's analysis gives" in report.problems[0]


def test_a_config_change_is_caught(pair, tmp_path):
    ref, folded, _ = pair
    cand = clone(folded, tmp_path / "cand")
    config = json.loads((cand / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-3
    (cand / "config.json").write_text(json.dumps(config))
    report = run(ref, cand)
    assert not report.passed and "config.json changes layer_norm_epsilon from 1e-05 to 0.001" in report.problems


def test_a_missing_head_is_caught(pair, tmp_path):
    """tie_word_embeddings is false, so from_pretrained would initialise the head at random."""
    ref, folded, _ = pair
    cand = edited(folded, tmp_path, lambda sd: sd.pop("lm_head.weight"))
    report = run(ref, cand)
    assert not report.passed and any("no tensor for lm_head.weight" in p for p in report.problems)


def test_half_precision_candidate_of_a_float32_reference(pair, tmp_path):
    ref, folded, _ = pair
    cand = edited(folded, tmp_path, lambda sd: sd.update({k: v.to(torch.bfloat16) for k, v in sd.items()}))
    report = run(ref, cand)
    assert report.passed, report.summary()
    wrong = edited(cand, tmp_path / "w", lambda sd: sd["transformer.wpe.weight"].view(-1)[5].add_(0.05))
    assert not run(ref, wrong).passed


def test_pickle_reference(pair, tmp_path):
    ref, folded, model = pair
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    (pkl / "config.json").write_text((ref / "config.json").read_text())
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, pkl / "pytorch_model.bin")
    report = static_check(open_model_dir(pkl, allow_pickle=True), open_model_dir(folded))
    assert report.passed, report.summary()


def test_check_static_mode_runs_no_model(pair, monkeypatch):
    from enjoyln import checkpoint

    ref, folded, _ = pair
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("static mode loaded a model"))
    report = enjoyln.check_checkpoints(ref, folded, mode="static")
    assert report.passed and report.forward_skipped == "static check only" and report.outputs == []


def test_fold_refuses_a_forward_check_that_cannot_fit(pair, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from enjoyln import checkpoint
    from enjoyln.cli import app

    ref, _, _ = pair
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 1 << 20)
    runner = CliRunner()
    result = runner.invoke(app, ["fold", str(ref), str(tmp_path / "out")])
    assert result.exit_code == 2 and "--static" in result.stderr and "1.0 MiB is available" in result.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.enjoyln-*"))
    result = runner.invoke(app, ["fold", str(ref), str(tmp_path / "out"), "--static"])
    assert result.exit_code == 0 and "static check" in result.output and "forward comparison not run" in result.output
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in plain.modules()) == 5


def test_bounded_check_offloads_and_still_catches_a_change(pair, tmp_path, monkeypatch):
    """Within a budget far below the model, weights come from disk as each layer runs; the check
    stays exact, and a changed weight still fails the forward comparison."""
    from enjoyln import checkpoint

    ref, folded, _ = pair
    monkeypatch.setattr(checkpoint, "_activation_bytes", lambda md: 0)
    monkeypatch.setattr(checkpoint, "MIN_BUDGET", 0)
    maps, real = [], checkpoint.load

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        maps.append(set(getattr(model, "hf_device_map", {}).values()))
        return model

    monkeypatch.setattr(checkpoint, "load", spy)
    report = enjoyln.check_checkpoints(ref, folded, max_memory=200_000)
    assert report.passed, report.summary()
    # the reference, its float64 truth and the candidate (plain from_pretrained is loaded apart)
    assert len(maps) == 3 and all("disk" in m for m in maps) and "within 195.3 KiB" in report.memory
    assert report.max_rel_diff < 1e-6 and report.generation.passed
    key = "transformer.h.1.attn.c_proj.weight"  # (a change of 1e-3 of its scale moves the logits by 2e-6:
    cand = edited(folded, tmp_path, lambda sd: sd[key].view(-1)[3].add_(float(sd[key].abs().max())))  # static's job)
    report = enjoyln.check_checkpoints(ref, cand, max_memory=200_000, mode="forward")
    assert not report.passed and report.max_rel_diff > 1e-5


def test_fold_runs_the_check_one_model_at_a_time_when_two_do_not_fit(pair, tmp_path, monkeypatch):
    from enjoyln import checkpoint

    ref, _, _ = pair
    monkeypatch.setattr(checkpoint, "forward_check_bytes", lambda md: 1 << 40)  # "does not fit twice"
    result = fold_checkpoint(ref, tmp_path / "out")
    assert result.report.passed and "would not fit in memory side by side" in result.report.memory


def test_a_half_precision_change_within_a_few_ulps_of_the_maximum_is_caught(tmp_path):
    """In bfloat16, 4 ulp of a tensor's maximum is 3% of it: a bound on the whole tensor's scale
    let a whole embedding row move by that much, and the forward check's own half-precision
    margin did not see it either. Each element may be off by one ulp of itself, no more."""
    from typer.testing import CliRunner

    from enjoyln.cli import app

    perturb(tiny_model("gpt2"), seed=41).to(torch.bfloat16).save_pretrained(tmp_path / "ref")
    fold_checkpoint(tmp_path / "ref", tmp_path / "folded", check="none")
    assert run(tmp_path / "ref", tmp_path / "folded").passed

    def shift_row(sd):
        w = sd["transformer.wte.weight"].float()
        w[5] += 3.5 * torch.finfo(torch.bfloat16).eps * float(w.abs().max()) * torch.sign(torch.randn(w.shape[1]))
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
    cand = edited(folded, tmp_path, lambda sd: sd.update({k: sd[k].to(dtype) for k in (key, centered_key)}))
    report = run(ref, cand)
    assert not report.passed
    assert f"{key} is stored as {dtype}, but the reference's {key} is torch.float32" in report.problems
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
    assert any(p.startswith("the candidate still ties lm_head.weight to transformer.wte.weight")
               for p in report.problems), report.problems
    assert any("untied tensors include ('lm_head.weight', 'transformer.wpe.weight')" in p
               for p in report.problems), report.problems


@pytest.mark.parametrize("key,value", [("rmsnorm", ["transformer.h.0.ln_1", "transformer.h.9.ln_1"]),
                                       ("centered", []), ("untied", []),
                                       ("auxiliary_centering", [{"module": "transformer.h.0", "where": "output"}])])
def test_the_block_lists_beside_the_plan_are_confirmed(pair, tmp_path, key, value):
    """A reader that takes `rmsnorm` from the block, not the full plan, must not be told to swap
    LNs that were never folded."""
    ref, folded, _ = pair
    cand = clone(folded, tmp_path / "cand")
    config = json.loads((cand / "config.json").read_text())
    config["enjoyln"][key] = value
    (cand / "config.json").write_text(json.dumps(config))
    report = run(ref, cand)
    assert not report.passed and f"the enjoyln block's {key} list is not what its plan gives" in report.problems


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
    (swapped / "generation_config.json").write_text(json.dumps({**generation, "repetition_penalty": 1.3}))
    (swapped / "special_tokens_map.json").write_text("{}")
    report = run(source, swapped)
    assert not report.passed
    assert {"the candidate's tokenizer.json differs from the reference's",
            "the candidate's vocab.txt differs from the reference's",
            "the candidate's generation config changes repetition_penalty from None to 1.3",
            "the candidate has special_tokens_map.json, which the reference does not"} <= set(report.problems)
    (base / "vocab.txt").unlink()
    assert "the candidate lacks the reference's vocab.txt" in run(source, base).problems


def test_a_pickled_tensor_stored_as_a_strided_view(pair, tmp_path):
    """torch.save keeps strides: a transposed weight failed the fold and the check with
    "RuntimeError: view size is not compatible with input tensor's size and stride"."""
    ref, folded, model = pair
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    (pkl / "config.json").write_text((ref / "config.json").read_text())
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    key = "transformer.h.0.attn.c_attn.weight"
    sd[key] = sd[key].t().contiguous().t()
    torch.save(sd, pkl / "pytorch_model.bin")
    report = static_check(open_model_dir(pkl, allow_pickle=True), open_model_dir(folded))
    assert report.passed, report.summary()
