"""What the command line shows: progress that never jumps or boasts, no third-party bars,
verdicts in one sentence, notes that fit the model, a demo that keeps what it says it wrote,
and timings reported with their spread (judged here on made-up timings, never measured ones)."""

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from enjoyln.bench import LatencyComparison
from enjoyln.cli import progress, render
from enjoyln.cli.app import app
from enjoyln.cli.render import post_ln_note, print_latency
from enjoyln.plan import FoldPlan, LayerNormEntry
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.store.load import load, load_plain
from enjoyln.testing import perturb, tiny_model
from enjoyln.timings import Spread
from enjoyln.options import FoldOptions

runner = CliRunner()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rep") / "gpt2"
    perturb(tiny_model("gpt2"), seed=43).save_pretrained(path)
    return path


# --- progress ---------------------------------------------------------------------------------


def test_no_rate_over_a_near_zero_interval():
    assert progress.honest_rate(480.6e9, 0.001) is None  # the "480.6 GB/s" of a burst
    assert progress.honest_rate(0, 5.0) is None
    assert progress.honest_rate(300e6, 2.0) == 150e6


def test_the_write_total_is_unknown_then_final(gpt2_dir, tmp_path):
    seen = []
    result = fold_checkpoint(
        gpt2_dir,
        tmp_path / "out",
        FoldOptions.of(check="none"),
        progress=lambda done, total: seen.append((done, total)),
    )
    known = [total for _, total in seen if total]
    # the tensors the early copy put in place and the fold then centered there count once, as they
    # are written
    assert (
        known[0]
        == result.bytes_written
        == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
        - sum(
            8 + int.from_bytes((tmp_path / "out" / f).read_bytes()[:8], "little")
            for f in result.files
        )
    )
    assert known and len(set(known)) == 1  # one total, never revised
    first_known = next(i for i, (_, total) in enumerate(seen) if total)
    assert all(total == 0 for _, total in seen[:first_known])  # before it, "not known yet"
    assert all(total == known[0] for _, total in seen[first_known:])
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == known[0]


def test_the_display_shows_phases_and_bars_on_a_terminal_only():
    buffer = io.StringIO()
    display = progress.Display(Console(file=buffer, force_terminal=True, width=120))
    display.stage("analysing GPT2LMHeadModel")
    write = display.phase("writing")
    write(10_000_000, 0)
    bar = display.bar
    task = next(t for t in bar.tasks if t.description == "writing")
    assert task.total is None  # no bar against a total that will change
    assert progress._Bytes().render(task).plain == "10.0 MB"
    write(20_000_000, 50_000_000)
    task = next(t for t in bar.tasks if t.description == "writing")
    assert task.total == 50_000_000 and progress._Bytes().render(task).plain == "20.0 MB of 50.0 MB"
    assert progress._Rate().render(task).plain == ""  # both moves within a second: no rate
    write(50_000_000, 50_000_000)
    assert not next(t for t in bar.tasks if t.description == "writing").visible  # done: taken away
    display.stop()
    off = io.StringIO()
    quiet = progress.Display(Console(file=off, force_terminal=False))
    quiet.stage("analysing")
    quiet.phase("writing")(1, 2)
    assert quiet.bar is None and off.getvalue() == ""


def test_the_rate_is_over_the_bars_own_movement():
    bar = progress.Progress()
    task_id = bar.add_task("writing", total=100e6, moved_at=(40e6, 10.0), last=(100e6, 12.0))
    task = bar.tasks[0]
    assert task.id == task_id and progress._Rate().render(task).plain == "30 MB/s"  # 60 MB over 2 s


def test_no_third_party_bars_or_logs_and_the_users_settings_back(gpt2_dir, tmp_path, capsys):
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as tf_logging

    tf_logging.enable_progress_bar()
    tf_logging.set_verbosity_info()
    try:
        result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out")])
        assert result.exit_code == 0, result.output
        assert (
            result.stderr == ""
        )  # no "Loading weights", no LOAD REPORT: not a TTY, so no progress either
        fold_checkpoint(
            gpt2_dir, tmp_path / "api", FoldOptions.of(check="full")
        )  # the API path too
        load(tmp_path / "api")
        load_plain(tmp_path / "api")
        captured = capsys.readouterr()
        assert (
            "Loading weights" not in captured.err + captured.out
            and "LOAD REPORT" not in captured.err
        )
        assert (
            tf_logging.is_progress_bar_enabled() and tf_logging.get_verbosity() == tf_logging.INFO
        )
        assert not hub_utils.are_progress_bars_disabled()
    finally:
        tf_logging.set_verbosity_warning()


# --- verdicts and notes -----------------------------------------------------------------------


def test_every_report_opens_with_a_verdict(gpt2_dir, tmp_path):
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out")])
    lines = result.stdout.splitlines()
    verdict = next(line for line in lines if line.startswith(("PASS", "FAIL")))
    assert verdict == (
        "PASS: the folded model computes the same outputs (every weight proven; 2 batches within "
        "4× the original's own rounding; the same greedy tokens)"
    )
    result = runner.invoke(app, ["check", str(gpt2_dir), str(tmp_path / "out"), "--static"])
    assert result.stdout.splitlines()[0] == (
        "PASS: every weight of the candidate is what the fold makes of the "
        "original's, proven tensor by tensor (no forward pass was run)"
    )
    result = runner.invoke(app, ["check", str(gpt2_dir), str(gpt2_dir)])
    assert result.stdout.splitlines()[0] == (
        "PASS: the candidate is byte for byte the original, so it computes the same outputs"
    )


def test_a_failing_forward_check_names_the_output(gpt2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    assert runner.invoke(app, ["fold", str(gpt2_dir), str(out), "--no-check"]).exit_code == 0
    sd = load_file(out / "model.safetensors")
    sd["transformer.h.0.mlp.c_fc.bias"] = sd["transformer.h.0.mlp.c_fc.bias"] + 0.5
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(
        app, ["check", str(gpt2_dir), str(out), "--forward-only", "--batches", "1"]
    )
    first = result.stdout.splitlines()[0]
    assert result.exit_code == 1 and re.match(
        r"FAIL: the candidate computes different outputs: logits "
        r"\(enjoyln\.load\) is off by \S+ where \S+ is allowed",
        first,
    ), first


def test_an_encoder_is_not_said_to_decode(tmp_path):
    perturb(tiny_model("bert"), seed=5).save_pretrained(tmp_path / "bert")
    result = runner.invoke(app, ["fold", str(tmp_path / "bert"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "decod" not in result.stdout and "greedy" not in result.stdout
    assert (
        "confirmed it on 2 short batches (plain loading on the first); --thorough also runs"
        in result.stdout
    )


def test_a_post_ln_model_is_told_why_once(tmp_path, gpt2_dir):
    tiny_model("bert").save_pretrained(tmp_path / "bert")
    text = runner.invoke(app, ["inspect", str(tmp_path / "bert")], env={"COLUMNS": "400"}).stdout
    assert text.splitlines()[0] == "BertModel: 1 of 5 LayerNorms fold, by centering 3 tensors."
    note = text.splitlines()[1]
    assert text.count("post-LN model") == 1 and note.startswith(
        "Note: BertModel is a post-LN model"
    )
    assert (
        "the LayerNorm's input is the residual sum, whose skip branch is the output of the "
        "LayerNorm before it. "
        "That output is not zero-mean, so centering the layers that feed the sum cannot make the "
        "sum zero-mean" in note
    )
    assert "(here: embeddings.LayerNorm)" in note
    assert "post-LN" not in runner.invoke(app, ["inspect", str(gpt2_dir)]).stdout


def test_a_stream_an_ln_writes_is_not_called_post_ln(tmp_path):
    """CLIP's vision tower is pre-LN; its pre_layrnorm writes the stream the later LNs read. The
    note names that LN, and lists no LN of the text tower as an embedding LN."""
    perturb(tiny_model("clip"), seed=3).save_pretrained(tmp_path / "clip")
    text = runner.invoke(app, ["inspect", str(tmp_path / "clip")], env={"COLUMNS": "400"}).stdout
    assert "post-LN" not in text and "text_model" not in text.splitlines()[1]
    assert text.splitlines()[1] == (
        "Note: vision_model.pre_layrnorm writes a residual stream, so the stream holds a "
        "LayerNorm's output, which is not zero-mean: the 5 LayerNorms that read it after stay."
    )


# --- the demo keeps what it says it wrote -----------------------------------------------------


def test_the_demo_keeps_its_workdir_or_says_it_is_temporary(tmp_path):
    args = ["demo", "--layers", "1", "--width", "64", "--seconds", "0"]
    result = runner.invoke(app, [*args, "--workdir", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d" / "gpt2-demo-folded" / "model.safetensors").is_file()
    assert f"Wrote {tmp_path / 'd' / 'gpt2-demo-folded'} in " in result.stdout
    assert f"The checkpoints stay in {tmp_path / 'd'}" in result.stdout
    # the time the speed comparison takes, from a forward measured here, said before it, not a fixed
    # figure
    said = re.search(
        r"^One forward takes about [\d.]+ s here, so the timings below take about \d+ (s|min)$",
        result.stdout,
        re.M,
    )
    assert said and said.start() < result.stdout.index("  original: ")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    temp = Path(
        re.search(
            r"Working in the temporary directory (\S+), removed when the demo ends", result.stdout
        ).group(1)
    )
    assert (
        f"Wrote {temp / 'gpt2-demo-folded'} (temporary: removed when the demo ends)"
        in result.stdout
    )
    assert f"Removed the temporary directory {temp}." in result.stdout and not temp.exists()


# --- timings: reported with their spread --------------------------------------------------------


def test_runs_at_a_scheduler_step_are_flagged():
    runs = [8.01, 7.99, 16.02, 8.0, 15.98, 8.02, 24.01, 7.98, 16.0, 8.01, 15.99, 8.0, 23.99]
    warnings = Spread.of(runs).warnings("original")
    assert len(warnings) == 1 and "fall into 3 groups about 8 ms apart" in warnings[0]


def test_a_busy_machine_is_flagged_and_a_quiet_one_is_not():
    busy = [10.0, 14.0, 11.0, 19.0, 12.5, 16.0, 10.5, 13.0, 17.5, 11.5]
    warnings = Spread.of(busy).warnings("folded")
    assert (
        len(warnings) == 1
        and warnings[0].startswith("folded: the runs spread by")
        and "busy" in warnings[0]
    )
    quiet = [10.0 + 0.01 * (i % 7) for i in range(30)]
    assert Spread.of(quiet).warnings("original") == []


def test_runs_at_the_clocks_resolution_are_flagged(monkeypatch):
    import time

    coarse = time.get_clock_info("perf_counter")
    monkeypatch.setattr(
        time, "get_clock_info", lambda name: type("Info", (), {"resolution": 1e-3})()
    )
    assert "within 100x the clock's resolution" in Spread.of([5.0] * 10).warnings("x")[0]
    assert coarse.resolution < 1e-3


def test_a_difference_is_claimed_only_when_measurable(capsys):
    same = LatencyComparison.of(
        [10.0, 10.2, 9.9, 10.1, 10.0, 9.8], [10.1, 10.0, 10.0, 10.2, 9.9, 9.9]
    )
    assert same.difference().startswith("no measurable difference between folded and original (")
    faster = LatencyComparison.of(
        [10.0, 10.2, 9.9, 10.1, 10.0, 9.8], [9.0, 9.1, 8.9, 9.0, 9.2, 8.8]
    )
    assert faster.difference() == (
        "folded 10.2% faster than original, measurably (the middle half of 6 run-by-run "
        "ratios, 0.892-0.905, lies below 1)"
    )
    slower = LatencyComparison.of([10.0] * 6, [11.0, 11.1, 10.9, 11.0, 11.2, 10.8])
    assert slower.direction() == "slower" and slower.difference().startswith(
        "folded 10.0% slower than original"
    )
    assert (same.to_dict()["direction"], faster.to_dict()["direction"]) == ("same", "faster")
    render.state.begin()
    print_latency(same)
    captured = capsys.readouterr()
    first, second = captured.out.splitlines()
    assert (
        first.startswith("no measurable difference") and "%" not in captured.out
    )  # no percentage as a result
    assert second == "  original: 10.00 ms per forward (median of 6 runs, IQR 0.25 ms)"
    assert captured.err == ""


def test_a_speed_line_shows_no_second_median_to_point_the_other_way(capsys):
    """The medians are 10% apart, but the run-by-run ratios spread across 1: no difference is
    claimed, and the folded median, which would suggest one, is not printed."""
    lat = LatencyComparison.of([10.0, 10.0, 10.0, 30.0, 30.0], [11.0, 11.0, 11.0, 9.0, 9.0])
    assert lat.b_ms / lat.a_ms == pytest.approx(1.1) and lat.direction() == "same"
    render.state.begin()
    print_latency(lat)
    text = capsys.readouterr().out
    assert text.startswith("no measurable difference between folded and original")
    assert "11.00" not in text and "%" not in text and "faster" not in text and "slower" not in text


def test_the_floor_line_never_reads_negative(capsys):
    from enjoyln.bench import EndToEndResult

    render.state.begin()
    lat = LatencyComparison.of([100.0] * 6, [100.0] * 6)
    render.print_end_to_end(EndToEndResult(lat, 0.01, 1, 8, 2, (1.0, 0.9, 1.2)), "GPT2", 1, 8)
    text = capsys.readouterr().out
    assert (
        "a bare copy took no less than LayerNorm here: no norm kernel can make this forward faster"
        in text
    )
    assert not re.search(r"-\d[\d.]*%", text)  # the old "at best -0.12% end to end"
    render.print_end_to_end(EndToEndResult(lat, 0.01, 1, 8, 2, (1.0, 0.9, 0.5)), "GPT2", 1, 8)
    assert (
        "even a norm as cheap as a copy would save at most 0.50% of a forward (0.50 ms)"
        in capsys.readouterr().out
    )


def test_bench_says_how_long_it_will_take_before_timing(monkeypatch, tmp_path):
    from enjoyln import bench

    tiny_model("gpt2").save_pretrained(tmp_path / "m")
    monkeypatch.setattr(
        bench, "forward_seconds", lambda model, inputs: 2.0
    )  # a made-up slow machine

    def stop(*args, **kwargs):
        raise RuntimeError("the timings would start here")

    monkeypatch.setattr(bench, "end_to_end", stop)
    result = runner.invoke(app, ["bench", str(tmp_path / "m"), "--no-kernels", "--repeats", "20"])
    # 2 x 2 s x (3 warm-up + 20 timed pairs) + 2 s x (4 profiled + 21 inside the norms) = 142 s
    assert (
        "One forward takes about 2 s here, so the timings below take about 2 min" in result.stdout
    )
    assert result.exit_code != 0  # stopped at the first timing, after the estimate


def test_bench_warns_when_its_timings_are_noisy(monkeypatch):
    from enjoyln import bench

    def noisy(shapes, dtypes, device="cpu"):
        return [
            bench.KernelResult(
                8,
                64,
                "float32",
                "cpu",
                2,
                "fused C kernel",
                8000.0,
                8000.0,
                8000.0,
                8000.0,
                4096,
                ["8x64 float32 LayerNorm: the 40 runs fall into 2 groups about 8 ms apart"],
            )
        ]

    monkeypatch.setattr(bench, "kernel_benchmark", noisy)
    result = runner.invoke(app, ["bench", "--no-e2e", "--shapes", "8x64", "--dtypes", "float32"])
    assert (
        result.exit_code == 0
        and "warning: 8x64 float32 LayerNorm: the 40 runs fall into 2 groups" in result.stderr
    )
    result = runner.invoke(
        app, ["bench", "--no-e2e", "--shapes", "8x64", "--dtypes", "float32", "--json"]
    )
    assert json.loads(result.stdout)["kernels"][0]["warnings"][0].startswith(
        "8x64 float32 LayerNorm"
    )


def test_the_stream_note_counts_its_writers_and_readers():
    why = "its input includes the output of {}, which is not zero-mean"
    one, two = FoldPlan("M"), FoldPlan("M")
    one.layer_norms = [
        LayerNormEntry("a.pre", "ln", True),
        LayerNormEntry("a.l0", "ln", False, why.format("a.pre")),
    ]
    two.layer_norms = one.layer_norms + [
        LayerNormEntry("b.pre", "ln", True),
        LayerNormEntry("b.l0", "ln", False, why.format("b.pre")),
    ]
    assert post_ln_note(one) == (
        "a.pre writes a residual stream, so the stream holds a LayerNorm's output, which is not "
        "zero-mean: the LayerNorm that reads it after stays."
    )
    assert post_ln_note(two) == (
        "a.pre, b.pre write residual streams, so each holds a LayerNorm's output, which is not "
        "zero-mean: the 2 LayerNorms that read them after stay."
    )
