"""The forward half of the gate: non-finite outputs, the precision-aware criterion, greedy
near-ties, both load paths of a checkpoint, and short contexts."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import enjoyln
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.cli.app import app
from enjoyln.checking.forward import FACTOR, CandidatePath, ModelSource, check_sources
from enjoyln.checking.generation import judge_generation
from enjoyln.checking.report import NearTie
from enjoyln.testing import perturb, tiny_model
from conftest import copy_dir
from enjoyln.options import CheckOptions, FoldOptions

NAN, INF = float("nan"), float("inf")


def hooked(model, edit, *, only_steps=False):
    """``model`` with ``edit(logits, call)`` applied to its logits on every forward (or only on
    the one-token steps of greedy generation)."""
    calls = [0]

    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if only_steps and (ids is None or ids.shape[-1] != 1):
            return output
        calls[0] += 1
        with torch.no_grad():
            edit(output.logits, calls[0])
        return output

    model.register_forward_hook(hook, with_kwargs=True)
    return model


def all_nan(logits, call):
    logits.fill_(NAN)


def shifted_with_one_nan(logits, call):
    logits.add_(100.0)
    logits.view(-1)[3] = NAN


def one_inf(logits, call):
    logits.view(-1)[5] = INF


def quick_check(reference, candidate, **kwargs):
    return enjoyln.check(
        reference, candidate, options=CheckOptions(batches=1, generate_tokens=0, **kwargs)
    )


@pytest.fixture(scope="module")
def gpt2():
    return perturb(tiny_model("gpt2"), seed=51)


def run_mode(reference, candidate, mode):
    quick = dict(batches=1, generate_tokens=0)
    if mode == "default":
        return enjoyln.check(reference, candidate, options=CheckOptions(**quick))
    if mode == "rtol":
        return enjoyln.check(reference, candidate, options=CheckOptions(rtol=1e-3, **quick))
    if mode == "spill":  # the path of a check within a memory budget
        return check_sources(
            ModelSource.of(reference),
            [CandidatePath("", ModelSource.of(candidate))],
            None,
            CheckOptions(spill=True, max_rows=1, **quick),
        )
    raise AssertionError(mode)


@pytest.mark.parametrize("edit", [all_nan, shifted_with_one_nan, one_inf])
@pytest.mark.parametrize("mode", ["default", "rtol", "spill", "half"])
def test_a_nan_or_inf_where_the_reference_is_finite_fails(gpt2, edit, mode):
    """Python's max(0.0, nan) is 0.0: a NaN output once recorded no difference at all."""
    reference = gpt2
    if mode == "half":
        reference = copy.deepcopy(gpt2).to(torch.bfloat16)
    candidate = hooked(enjoyln.fold(copy.deepcopy(reference)), edit)
    report = run_mode(reference, candidate, "default" if mode == "half" else mode)
    assert not report.passed, report.summary()
    logits = next(o for o in report.outputs if o.name == "logits")
    assert not logits.passed and logits.nonfinite >= 1 and logits.max_abs_diff == INF
    assert math.isinf(report.max_abs_diff) and "NaN or Inf" in report.summary()


def test_a_vit_with_nan_logits_fails():
    vit = perturb(tiny_model("vit"), seed=52)
    candidate = hooked(
        enjoyln.fold(copy.deepcopy(vit)), lambda logits, call: logits[:, 2].fill_(NAN)
    )
    for mode in ("default", "rtol", "spill"):
        report = run_mode(vit, candidate, mode)
        assert not report.passed and report.outputs[0].nonfinite >= 2, (mode, report.summary())


def test_non_finite_reference_values_must_be_matched_exactly(gpt2):
    """Where the reference itself is -Inf (a masked logit) or NaN, the candidate must hold the
    same value there: the same infinity, or NaN."""

    def masked(value):
        return lambda logits, call: logits[..., 7].fill_(value)

    reference = hooked(copy.deepcopy(gpt2), masked(-INF))
    folded = enjoyln.fold(copy.deepcopy(gpt2))
    report = quick_check(reference, hooked(copy.deepcopy(folded), masked(-INF)))
    assert report.passed, report.summary()
    assert report.outputs[0].nonfinite == 0 and math.isfinite(report.max_abs_diff)
    for value in (INF, NAN, 0.0):
        report = quick_check(reference, hooked(copy.deepcopy(folded), masked(value)))
        assert not report.passed and report.outputs[0].nonfinite > 0, value
    nan_ref = hooked(copy.deepcopy(gpt2), masked(NAN))
    assert quick_check(nan_ref, hooked(copy.deepcopy(folded), masked(NAN))).passed
    assert not quick_check(nan_ref, hooked(copy.deepcopy(folded), masked(-INF))).passed


# --- the precision-aware criterion ---------------------------------------------------------


def test_the_criterion_is_the_references_own_rounding(gpt2):
    """The reference against itself is exactly its own error from float64; a candidate may be
    at most FACTOR times as far, and one element moved past that fails."""
    own = quick_check(gpt2, gpt2)
    out = own.outputs[0]
    assert own.passed and own.criterion_kind == "precision" and own.truth_dtype == "float64"
    assert (
        out.candidate_error == out.reference_error > 0
        and out.allowed == FACTOR * out.reference_error
    )
    room = out.allowed - out.reference_error

    def nudge(by):
        return hooked(copy.deepcopy(gpt2), lambda logits, call: logits.view(-1)[11].add_(by))

    inside = quick_check(gpt2, nudge(0.5 * room))
    assert inside.passed and 1 < inside.margin, inside.summary()
    outside = quick_check(gpt2, nudge(2.5 * out.allowed))
    assert not outside.passed and outside.margin < 1, outside.summary()
    # an explicit rtol replaces it, and says so
    fixed = quick_check(gpt2, nudge(2.5 * out.allowed), rtol=1e-3)
    assert fixed.passed and fixed.criterion_kind == "rtol" and "fixed" in fixed.criterion
    o = fixed.outputs[0]
    assert o.allowed == pytest.approx(1e-3 * o.max_abs_diff / o.max_rel_diff)


def test_the_report_names_the_criterion_and_the_margin(gpt2):
    report = enjoyln.check(gpt2, enjoyln.fold(copy.deepcopy(gpt2)))
    text = report.summary()
    assert "precision-aware: max|candidate - float64 original| <= 4 x" in text and "margin" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["criterion_kind"] == "precision" and data["truth_dtype"] == "float64"
    assert data["margin"] == min(o["margin"] for o in data["outputs"]) > 1
    out = data["outputs"][0]
    assert (
        out["candidate_error"]
        <= out["allowed"]
        == pytest.approx(out["margin"] * out["candidate_error"])
    )


def test_a_reference_that_cannot_run_in_float64_falls_back_to_a_fixed_tolerance():
    class Float32Only(torch.nn.Module):
        """A hard-coded float32 cast, which float64 weights then meet."""

        def __init__(self):
            super().__init__()
            self.lin, self.norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.lin(x.float()))

    net = perturb(Float32Only().eval())
    x = torch.randn(4, 8)
    folded = enjoyln.fold(copy.deepcopy(net), x)
    report = enjoyln.check(net, folded, x)
    assert report.passed and report.criterion_kind == "rtol" and "1e-05" in report.criterion
    assert any("float64, which failed" in n for n in report.notes)


def test_a_float64_reference_is_judged_with_a_fixed_tight_tolerance(gpt2):
    ref = copy.deepcopy(gpt2).double()
    report = enjoyln.check(ref, enjoyln.fold(copy.deepcopy(ref)))
    assert report.passed and report.criterion_kind == "rtol" and "1e-10" in report.criterion
    assert report.max_rel_diff < 1e-13


# --- greedy generation ---------------------------------------------------------------------


def test_a_flip_within_the_tolerance_is_a_near_tie_and_one_beyond_it_fails():
    f64 = dict(dtype=torch.float64)
    ref_logits = [
        torch.tensor([[3.0, 1.0, 2.0]], **f64),
        torch.tensor([[0.0, 5.0, 5.0 - 1e-7]], **f64),
    ]
    ref = ([[0, 1]], ref_logits, ref_logits)  # no logits processors: the scores are the logits
    near_logits = [ref_logits[0], torch.tensor([[0.0, 5.0 - 1e-7, 5.0]], **f64)]
    near = ([[0, 2]], near_logits, near_logits)
    ok, ties, problem = judge_generation(ref, near, tolerance=1e-6)
    assert ok and not problem
    assert ties == [
        NearTie(
            0,
            1,
            1,
            2,
            pytest.approx(1e-7, rel=0.5),
            pytest.approx(1e-7, rel=0.5),
            pytest.approx(1e-7, rel=0.5),
        )
    ]
    far_logits = [ref_logits[0], torch.tensor([[0.0, 5.0, 6.0]], **f64)]
    ok, _, problem = judge_generation(ref, ([[0, 2]], far_logits, far_logits), tolerance=1e-6)
    assert not ok and "not a near-tie" in problem
    ok, _, problem = judge_generation(ref, near, tolerance=None)
    assert not ok
    nan = [ref_logits[0], torch.tensor([[0.0, NAN, 5.0]], **f64)]
    assert not judge_generation(ref, ([[0, 2]], nan, nan), tolerance=1e3)[0]


def test_a_flip_the_logits_processors_make_is_no_near_tie():
    """generate() chooses by the scores after the generation config's logits processors: raw
    logits within the tolerance excused a flip that a suppressed token (score -inf) or a
    repetition penalty made, with margins 1e5 times the tolerance."""
    f64 = dict(dtype=torch.float64)
    logits = [torch.tensor([[0.0, 5.0, 4.9]], **f64)]
    ref = ([[1]], logits, logits)
    suppressed = ([[2]], logits, [torch.tensor([[0.0, -INF, 4.9]], **f64)])
    ok, ties, problem = judge_generation(ref, suppressed, tolerance=1e-6)
    assert not ok and not ties
    assert (
        "margins 0.1 (original) and inf (candidate)" in problem and "not a near-tie" in problem
    ), problem
    penalized = ([[2]], logits, [torch.tensor([[0.0, 5.0 / 1.3, 4.9]], **f64)])
    ok, _, problem = judge_generation(ref, penalized, tolerance=1e-6)
    assert not ok and "margins 0.1 (original) and 1.05 (candidate)" in problem, problem
    # the margin is judged where the rows first differ, in the scores: a tie there is excused
    tie = [torch.tensor([[0.0, 5.0, 5.0 - 1e-7]], **f64)]
    ok, ties, _ = judge_generation(
        ([[1]], logits, tie), ([[2]], logits, [tie[0].flip(-1).roll(1, -1)]), 1e-6
    )
    assert ok and ties[0].reference_margin == pytest.approx(1e-7, rel=1e-3)


def test_generation_settings_are_compared_and_their_flips_are_not_near_ties(gpt2):
    """A candidate whose generation config suppresses the reference's greedy tokens: every row
    flips with the raw logits equal, which the check called near-ties and passed."""
    folded = enjoyln.fold(copy.deepcopy(gpt2))
    first = {row[0] for row in enjoyln.check(gpt2, folded).generation.reference}
    folded.generation_config.suppress_tokens = sorted(first)
    report = enjoyln.check(gpt2, folded)
    g = report.generation
    assert (
        not report.passed and not g.passed and not g.near_ties and "not a near-tie" in g.problem
    ), report.summary()
    assert "inf (candidate) in the scores generate() used" in g.problem
    assert report.generation_settings == [
        f"generation settings: suppress_tokens is {sorted(first)!r}, the original's None"
    ]
    assert f"[FAIL] generation settings: suppress_tokens is {sorted(first)!r}" in report.summary()


def test_greedy_flips_through_the_check(gpt2):
    """A reference whose top two logits at a generation step are 1e-6 apart: a candidate that
    takes the other token, with its logits as close as rounding, passes; one that takes it by a
    clear margin fails."""
    tolerance = enjoyln.check(gpt2, enjoyln.fold(copy.deepcopy(gpt2))).generation.tolerance

    def tie(sign, gap=tolerance / 4):
        def edit(logits, call):
            if call == 2:
                last = logits[:, -1]
                top = last.topk(2, dim=-1)
                last.scatter_(1, top.indices[:, 1:], top.values[:, :1] + sign * gap)

        return edit

    reference = hooked(copy.deepcopy(gpt2), tie(-1), only_steps=True)
    report = enjoyln.check(
        reference, hooked(enjoyln.fold(copy.deepcopy(gpt2)), tie(+1), only_steps=True)
    )
    g = report.generation
    assert report.passed and g.passed and not g.identical, report.summary()
    assert {t.row for t in g.near_ties} == {0, 1} and all(t.step == 2 for t in g.near_ties)
    assert (
        all(t.reference_margin <= 2 * g.tolerance for t in g.near_ties)
        and "near-ties" in report.summary()
    )
    report = enjoyln.check(
        reference, hooked(enjoyln.fold(copy.deepcopy(gpt2)), tie(+1, gap=1.0), only_steps=True)
    )
    assert (
        not report.passed and not report.generation.passed and "not a near-tie" in report.summary()
    )


# --- models that draw random numbers in their eval forward ---------------------------------


def tiny_vit_mae(seed=57):
    """ViTMAE masks a random 75% of its patches in every forward, eval mode included."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.ViTMAEConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=8,
    )
    return perturb(transformers.ViTMAEModel(config).eval(), seed=seed)


def test_every_model_call_runs_under_the_same_seed_and_the_callers_rng_is_untouched():
    """Each run drew its own masks: an exact copy of a ViTMAE failed (ids_restore differed), and
    the reference's own float64 "rounding" was two different masks."""
    mae = tiny_vit_mae()
    inputs = {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))}
    torch.manual_seed(5)
    state = torch.get_rng_state()
    report = enjoyln.check(mae, copy.deepcopy(mae), inputs)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG, as it was
    assert report.passed and report.max_abs_diff == 0, report.summary()
    assert {o.name for o in report.outputs} == {"last_hidden_state", "mask", "ids_restore"}
    ref_err = next(o.reference_error for o in report.outputs if o.name == "last_hidden_state")
    assert ref_err < 1e-5  # the float64 truth masked the same patches: only rounding is left
    folded = enjoyln.fold(copy.deepcopy(mae), inputs)
    assert enjoyln.check(mae, folded, inputs).passed
    with torch.no_grad():
        folded.layers[0].mlp.fc2.bias[3] += 0.05
    assert not enjoyln.check(mae, folded, inputs).passed


def test_a_vit_mae_checkpoint_folds_and_a_changed_weight_fails(tmp_path):
    """`enjoyln fold` refused to publish its own correct fold of a ViTMAE, and REF vs an exact
    copy failed."""
    tiny_vit_mae().save_pretrained(tmp_path / "ref")
    result = CliRunner().invoke(app, ["fold", str(tmp_path / "ref"), str(tmp_path / "out")])
    assert result.exit_code == 0 and (tmp_path / "out" / "model.safetensors").exists(), (
        result.output
    )
    assert gate(tmp_path / "ref", copy_dir(tmp_path / "ref", tmp_path / "copy"))[0] == 0
    key = "encoder.layer.0.output.dense.bias"
    changed = edited(tmp_path / "out", tmp_path / "cand", set_(key, 3, 0.05))
    code, out = gate(tmp_path / "ref", changed, "--forward-only")
    assert code == 1 and "[FAIL] last_hidden_state (enjoyln.load)" in out, out


# --- checkpoints: both load paths, NaN in every mode, short contexts -----------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    gpt2 = perturb(tiny_model("gpt2"), seed=53)
    gpt2.save_pretrained(root / "gpt2")
    gpt2.to(torch.bfloat16).save_pretrained(root / "gpt2-bf16")
    perturb(tiny_model("vit"), seed=54).save_pretrained(root / "vit")
    for name in ("gpt2", "gpt2-bf16", "vit"):
        fold_checkpoint(root / name, root / f"{name}-folded", FoldOptions.of(check="none"))
    fold_checkpoint(
        root / "gpt2", root / "gpt2-fused", FoldOptions.of(check="none", fuse_affine=True)
    )
    return root


def edited(src, dst, edit, config=None):
    cand = copy_dir(src, dst)
    sd = load_file(cand / "model.safetensors")
    edit(sd)
    save_file(sd, cand / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((cand / "config.json").read_text())
        config(cfg)
        (cand / "config.json").write_text(json.dumps(cfg))
    return cand


def gate(ref, cand, *args):
    """``enjoyln check``, with one batch: the coverage batch, which is what these cases need."""
    result = CliRunner().invoke(app, ["check", str(ref), str(cand), "--batches", "1", *args])
    return result.exit_code, result.output


MODES = [(), ("--forward-only",), ("--forward-only", "--max-memory", "300KB")]


def set_(key, index, value):
    def edit(sd):
        sd[key].view(-1)[index] = value

    return edit


@pytest.mark.parametrize(
    "case", ["gpt2 all NaN", "gpt2-bf16 all NaN", "vit +100 with one NaN", "vit NaN logits"]
)
@pytest.mark.parametrize("mode", MODES, ids=["default", "forward-only", "max-memory"])
def test_non_finite_checkpoints_fail_in_every_mode(dirs, tmp_path, monkeypatch, case, mode):
    from enjoyln.checking import checkpoints as checkpoint

    monkeypatch.setattr(checkpoint, "_activation_bytes", lambda ck: 0)
    monkeypatch.setattr(checkpoint, "MIN_BUDGET", 0)
    name = case.split()[0]

    def edit(sd):
        if "all NaN" in case:
            sd["transformer.ln_f.weight"].fill_(NAN)
        elif "+100" in case:
            sd["classifier.bias"].add_(100.0)
            sd["classifier.bias"][1] = NAN
        else:
            sd["classifier.weight"].fill_(NAN)

    cand = edited(dirs / f"{name}-folded", tmp_path / "cand", edit)
    code, out = gate(dirs / name, cand, *mode)
    assert code == 1, out
    if mode:  # the forward comparison judged it (the default mode stops at the weights)
        assert "NaN or Inf" in out and "[FAIL] logits" in out


def test_forward_only_runs_both_load_paths(dirs, tmp_path):
    """γ of a fused norm is 1 on disk and enjoyln.load drops it; plain from_pretrained runs it.
    A tampered γ passed the enjoyln.load path and moved plain loading's outputs."""
    cand = edited(
        dirs / "gpt2-fused", tmp_path / "cand", set_("transformer.h.1.ln_2.weight", 5, 1.3)
    )
    code, out = gate(dirs / "gpt2", cand, "--forward-only")
    assert (
        code == 1
        and "[FAIL] logits (from_pretrained)" in out
        and "[ok] logits (enjoyln.load)" in out
    ), out
    cand = edited(
        dirs / "gpt2-fused", tmp_path / "cand2", set_("transformer.h.0.ln_1.bias", 0, 0.02)
    )
    assert gate(dirs / "gpt2", cand, "--forward-only")[0] == 1
    code, out = gate(dirs / "gpt2", dirs / "gpt2-fused", "--forward-only")
    assert code == 0 and "through enjoyln.load and from_pretrained" in out, out
    assert "[ok] logits (from_pretrained)" in out


def test_forward_only_compares_the_generation_settings_the_loaders_apply(dirs, tmp_path):
    """--forward-only did not compare generation settings: a repetition penalty that leaves the
    greedy tokens of the check as they were passed, and so did sampling settings in config.json,
    which transformers uses when there is no generation_config.json."""
    cand = copy_dir(dirs / "gpt2-folded", tmp_path / "cand")
    g = json.loads((cand / "generation_config.json").read_text())
    (cand / "generation_config.json").write_text(json.dumps({**g, "repetition_penalty": 1.0001}))
    code, out = gate(dirs / "gpt2", cand, "--forward-only")
    assert code == 1, out
    assert (
        "[FAIL] generation settings (enjoyln.load and from_pretrained): repetition_penalty is "
        "1.0001, "
        "the original's None"
    ) in out
    assert "greedy generation of 8 tokens after 8: identical" in out  # only the settings show it
    ref = copy_dir(dirs / "gpt2", tmp_path / "ref")
    for d in (ref, cand):
        (d / "generation_config.json").unlink()
    assert gate(ref, cand, "--forward-only")[0] == 0
    cfg = json.loads((cand / "config.json").read_text())
    (cand / "config.json").write_text(json.dumps({**cfg, "do_sample": True, "temperature": 5.0}))
    code, out = gate(ref, cand, "--forward-only")
    assert (
        code == 1
        and "do_sample is True, the original's None" in out
        and "temperature is 5.0" in out
    ), out


def test_a_block_declaring_plain_loading_inexact_is_shown_on_the_verdict(dirs, tmp_path):
    """Only a rotation without keep_mean is inexact under plain loading. A block that declares it
    (both flags false) is not verified by --forward-only, so the verdict says what it leaves out;
    a block claiming exactness is held to it."""
    rot = tmp_path / "rot"
    assert (
        CliRunner()
        .invoke(app, ["rotate", str(dirs / "gpt2"), str(rot), "--no-keep-mean", "--no-check"])
        .exit_code
        == 0
    )

    def claim_exact(cfg):
        cfg["enjoyln"]["rotation"]["plain_loading_exact"] = True

    lying = edited(rot, tmp_path / "lying", lambda sd: None, config=claim_exact)
    code, out = gate(dirs / "gpt2", lying, "--forward-only")
    assert code == 1 and "[FAIL] logits (from_pretrained)" in out, out
    code, out = gate(dirs / "gpt2", rot, "--forward-only")
    first = out.splitlines()[0]
    assert (
        code == 0
        and first.startswith("PASS: the candidate computes the same outputs (")
        and "weights not compared); judged through enjoyln.load only" in first
        and "run the full check" in first
    )
    assert "differs, not required] logits (from_pretrained)" in out
    code, out = gate(dirs / "gpt2", rot)
    assert (
        code == 0
        and out.splitlines()[0].startswith(
            "PASS: the candidate computes the same outputs (every weight proven; 1 batch within 4"
        )
        and "reported but not required" in out
    ), out
    data = json.loads(
        CliRunner()
        .invoke(app, ["check", str(dirs / "gpt2"), str(rot), "--forward-only", "--json"])
        .stdout
    )
    assert data["caveat"].startswith("judged through enjoyln.load only")

    def only_flag(cfg):  # no keep_mean=False rotation in the plan: the flag alone is not believed
        cfg["enjoyln"]["rotation"] = {
            "kind": "hadamard",
            "seed": 0,
            "keep_mean": False,
            "plain_loading_exact": False,
        }

    fused = edited(
        dirs / "gpt2-fused",
        tmp_path / "flag",
        set_("transformer.h.1.ln_2.weight", 5, 1.3),
        config=only_flag,
    )
    code, out = gate(dirs / "gpt2", fused, "--forward-only")
    assert code == 1 and not out.startswith("PASS"), out


def test_short_context_folds_end_to_end(tmp_path):
    """n_positions=12: the check generated 8 tokens after an 8-token prompt (IndexError, exit 2)."""
    perturb(tiny_model("gpt2", n_positions=12), seed=55).save_pretrained(tmp_path / "short")
    result = CliRunner().invoke(
        app, ["fold", str(tmp_path / "short"), str(tmp_path / "out"), "--json"]
    )
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)["check"]
    # the weights are proven: the forward part is a short confirmation, with a 4-token decode
    assert (
        check["passed"]
        and check["generation"]["new_tokens"] == 4
        and check["generation"]["prompt_tokens"] == 8
    )
    assert check["coverage"] is None
    result = CliRunner().invoke(
        app, ["check", str(tmp_path / "short"), str(tmp_path / "out"), "--thorough", "--json"]
    )
    assert result.exit_code == 0, result.output
    thorough = json.loads(result.stdout)
    assert thorough["coverage"]["positions"] == 12
    assert (
        thorough["generation"]["new_tokens"] == 8 and thorough["generation"]["prompt_tokens"] == 4
    )
    perturb(tiny_model("gpt2", n_positions=5), seed=55).save_pretrained(tmp_path / "shorter")
    report = fold_checkpoint(tmp_path / "shorter", tmp_path / "out5").report
    assert (
        report.passed and report.generation.prompt_tokens == 1 and report.generation.new_tokens == 4
    )


def test_fold_and_rotate_accept_rtol(dirs, tmp_path):
    runner = CliRunner()
    for cmd in (["fold", "--fuse-affine"], ["rotate"]):
        out = tmp_path / cmd[0]
        result = runner.invoke(
            app, [cmd[0], str(dirs / "gpt2"), str(out), *cmd[1:], "--rtol", "1e-12", "--json"]
        )
        assert result.exit_code == 1 and not out.exists(), result.output
        check = json.loads(result.stdout)["check"]
        assert check["criterion_kind"] == "rtol" and "1e-12" in check["criterion"]
        result = runner.invoke(
            app, [cmd[0], str(dirs / "gpt2"), str(out), *cmd[1:], "--rtol", "1e-4"]
        )
        assert (
            result.exit_code == 0 and "fixed: max|original - candidate| <= 0.0001" in result.output
        )


def test_a_one_weight_change_still_fails_the_default_check(dirs, tmp_path):
    key = "transformer.h.1.attn.c_proj.weight"

    def nudge(sd):
        sd[key].view(-1)[3] += 1e-3 * float(sd[key].abs().max())

    cand = edited(dirs / "gpt2-folded", tmp_path / "cand", nudge)
    code, out = gate(dirs / "gpt2", cand)
    assert code == 1 and key in out


def test_the_memory_pre_check_counts_the_truth(dirs, monkeypatch):
    """The float64 truth of a float32 reference is twice its weights, and one model at a time
    needs room for its largest tensor in float64."""
    from enjoyln.checking import checkpoints as checkpoint
    from enjoyln.checking.checkpoints import require_memory
    from enjoyln.store.memory import forward_check_bytes
    from enjoyln.store.checkpoint import open_checkpoint

    ck, half = open_checkpoint(dirs / "gpt2"), open_checkpoint(dirs / "gpt2-bf16")
    assert forward_check_bytes(ck) == int(2.1 * ck.nbytes) + 2 * ck.nbytes + (256 << 20)
    assert forward_check_bytes(half) == int(2.1 * half.nbytes) + 2 * half.nbytes + (256 << 20)
    monkeypatch.setattr(checkpoint, "_activation_bytes", lambda ck: 0)
    monkeypatch.setattr(checkpoint, "MIN_BUDGET", 0)
    largest = checkpoint._largest_tensor(ck)
    require_memory(ck, 2 * largest)
    with pytest.raises(enjoyln.CheckpointError, match="--static"):
        require_memory(ck, int(1.5 * largest))


def test_a_correct_fold_of_an_imprecise_original_passes_by_default(tmp_path):
    """A stream whose mean dwarfs its spread costs the original's LayerNorms digits by cancellation
    (its own float32 error from float64 is ~1e-3 of the logits here), which the fold's centered
    weights no longer lose: a fixed 1e-5 failed this correct fold, the original's own rounding
    does not; a real change of the outputs still fails."""
    model = perturb(tiny_model("gpt2"), seed=56)
    with torch.no_grad():
        model.transformer.wte.weight.add_(10.0)
    model.save_pretrained(tmp_path / "ref")
    runner = CliRunner()
    result = runner.invoke(
        app, ["fold", str(tmp_path / "ref"), str(tmp_path / "fixed"), "--rtol", "1e-5"]
    )
    assert result.exit_code == 1 and "fixed:" in result.output
    result = runner.invoke(app, ["fold", str(tmp_path / "ref"), str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)["check"]
    assert (
        check["max_rel_diff"] > 1e-5
        and check["criterion_kind"] == "precision"
        and check["margin"] > 2
    )
    out = check["outputs"][0]
    assert (
        out["candidate_error"] < out["reference_error"]
    )  # the fold is closer to float64 than the original
    changed = edited(tmp_path / "out", tmp_path / "cand", set_("transformer.ln_f.bias", 3, 0.5))
    code, text = gate(tmp_path / "ref", changed, "--forward-only")
    assert code == 1 and "[FAIL] logits (enjoyln.load)" in text, text


def test_the_tolerance_benchmark_at_a_small_size(tmp_path, monkeypatch):
    """scripts/bench_tolerance.py folds a GPT-2 and an OPT with outliers three ways with the default
    check and writes the criterion, the original's own error and the margin into the README."""
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_tolerance.py"
    spec = importlib.util.spec_from_file_location("bench_tolerance", script)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_tolerance", bench)
    spec.loader.exec_module(bench)
    written = {}
    monkeypatch.setattr(bench, "replace_section", lambda name, text: written.update({name: text}))
    rows = bench.main(
        [
            "--layers",
            "1",
            "--width",
            "64",
            "--vocab",
            "256",
            "--positions",
            "32",
            "--workdir",
            str(tmp_path),
            "--write",
        ]
    )
    assert [(r["model"], r["command"]) for r in rows] == [
        (m, c) for m in ("GPT-2", "OPT, outliers") for c in ("fold", "fold --fuse-affine", "rotate")
    ]
    assert all(
        r["passed"] and r["kind"] == "precision" and 0 < r["own"] and r["margin"] > 1 for r in rows
    )
    assert all(r["candidate"] <= r["allowed"] == pytest.approx(FACTOR * r["own"]) for r in rows)
    text = written["tolerance"]
    assert text.count("\n| GPT-2 |") == 3 and text.count("\n| OPT, outliers |") == 3
    assert "shared with other agents" in text and "bench_tolerance.py --write" in text


def test_default_check_confirms_briefly_once_the_weights_are_proven(tmp_path):
    """The static part proves every weight, so the default forward part runs short batches only;
    --thorough adds the batch over every position, and --forward-only always runs it."""
    perturb(tiny_model("gpt2", n_positions=24), seed=56).save_pretrained(tmp_path / "ref")
    fold_checkpoint(tmp_path / "ref", tmp_path / "out", FoldOptions.of(check="none"))
    runs = {}
    for name, args in {
        "default": [],
        "thorough": ["--thorough"],
        "forward": ["--forward-only"],
    }.items():
        result = CliRunner().invoke(
            app, ["check", str(tmp_path / "ref"), str(tmp_path / "out"), "--json", *args]
        )
        assert result.exit_code == 0, result.output
        runs[name] = json.loads(result.stdout)
    assert runs["default"]["coverage"] is None and runs["default"]["batches"] == 2
    # --forward-only then sweeps the token ids the 3 batches missed: 1 more batch for 128 ids
    assert runs["thorough"]["batches"] == 3 and runs["forward"]["batches"] == 4
    assert (
        runs["forward"]["coverage"]["distinct_ids"]
        == 128
        > runs["thorough"]["coverage"]["distinct_ids"]
    )
    assert any(
        "2 short batches (plain loading on the first) and a greedy decode" in n
        for n in runs["default"]["notes"]
    )
    assert (
        runs["default"]["generation"]["new_tokens"] == 4
        and runs["thorough"]["generation"]["new_tokens"] == 8
    )
    assert any("--thorough" in note for note in runs["default"]["notes"])
    assert (
        runs["thorough"]["coverage"]["positions"] == 24
        and runs["forward"]["coverage"]["positions"] == 24
    )
    assert not any("--thorough" in note for note in runs["thorough"]["notes"])
    result = CliRunner().invoke(
        app, ["check", str(tmp_path / "ref"), str(tmp_path / "out"), "--static", "--thorough"]
    )
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


def test_forward_only_runs_every_token_id_and_catches_a_garbage_row(tmp_path):
    """16 positions and a vocabulary of 8,192: the coverage batch draws 64 ids, so a garbage
    embedding row passed. The token sweep runs the other 8,128 (within its default limit), its
    outputs kept as sketches; with a lower limit it runs that many, and the report says how many ids
    ran."""
    from enjoyln.checking import sweep

    perturb(tiny_model("gpt2", n_positions=16, vocab_size=8192), seed=3).save_pretrained(
        tmp_path / "ref"
    )
    fold_checkpoint(tmp_path / "ref", tmp_path / "out", FoldOptions.of(check="none"))
    report = enjoyln.check_checkpoints(
        tmp_path / "ref", tmp_path / "out", CheckOptions.of(mode="forward")
    )
    assert report.passed and report.coverage.distinct_ids == 8192, report.summary()
    assert report.coverage.sweep_limit is None and "stopped" not in report.summary()
    assert any(o.name == "logits" + sweep.SUFFIX for o in report.outputs)
    bad = copy_dir(tmp_path / "out", tmp_path / "bad")
    weights = load_file(bad / "model.safetensors")
    weights["transformer.wte.weight"][4321] = torch.randn(64)
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    report = enjoyln.check_checkpoints(tmp_path / "ref", bad, CheckOptions.of(mode="forward"))
    failed = [o.name for o in report.outputs if not o.passed]
    assert not report.passed and failed == ["logits" + sweep.SUFFIX], report.summary()
    assert (
        sweep.SWEEP_TOKENS == 8192
        and "default: 8192" in CliRunner().invoke(app, ["check", "-h"]).output
    )
    report = enjoyln.check_checkpoints(
        tmp_path / "ref", tmp_path / "out", CheckOptions.of(mode="forward", sweep_tokens=100)
    )
    # every batch's ids: 64 in the coverage batch, 100 swept, at most 64 in the short batches and 12
    # after the
    # swept ones in the sweep's last row of 16
    n = report.coverage.distinct_ids
    assert report.passed and 164 <= n <= 240 and report.batches == 4, report.summary()
    assert (
        report.coverage.sweep_limit == 100
        and (
            f"{n} distinct token ids of 8192 (the token sweep stopped at its "
            "limit of 100 ids; --sweep-tokens)"
        )
        in report.summary()
    )
