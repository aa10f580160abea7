"""The benchmark helpers: what they time, and that timing leaves the models as they were."""

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import enjoyln
from enjoyln.bench import end_to_end, kernel_benchmark, norm_time_ms
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.cli.app import app
from enjoyln.testing import perturb, tiny_model


@pytest.fixture(scope="module")
def pair():
    original = perturb(tiny_model("gpt2"), seed=5)
    return original, enjoyln.fold(copy.deepcopy(original))


def test_kernel_benchmark_reports_ratios_and_bytes():
    (r,) = kernel_benchmark([(16, 96)], [torch.float32], repeats=10)
    assert (r.rows, r.cols, r.dtype, r.threads) == (16, 96, "float32", torch.get_num_threads())
    assert min(r.layer_norm_us, r.rms_norm_us, r.torch_rms_norm_us, r.copy_us) > 0
    assert r.ratio == pytest.approx(r.rms_norm_us / r.layer_norm_us)
    assert r.bytes_moved == 16 * 96 * 2 * 4 + 96 * 2 * 4
    assert r.gbps(r.rms_norm_us) == pytest.approx(r.bytes_moved / (r.rms_norm_us * 1e-6) / 1e9)


def test_norm_time_restores_the_folded_model(pair):
    """The copy floor swaps each RMSNorm for a bare copy while timing; it must swap back."""
    original, folded = pair
    inputs = hf_example_inputs(original, seed=6)
    with torch.no_grad():
        before = folded(**inputs).logits
    ln, rms, floor = norm_time_ms(original, folded, inputs, runs=2)
    assert min(ln, rms, floor) > 0
    assert not any("forward" in vars(m) for m in folded.modules())
    with torch.no_grad():
        assert torch.equal(folded(**inputs).logits, before)


def test_end_to_end_fields_agree(pair):
    original, folded = pair
    r = end_to_end(original, folded, hf_example_inputs(original, batch=1, seq_len=8), repeats=2)
    assert (r.batch, r.seq_len) == (1, 8) and 0 < r.layer_norm_share < 1
    ln, _, floor = r.norm_ms
    assert r.best_possible_speedup == pytest.approx((ln - floor) / r.latency.a_ms)
    assert r.share_captured == pytest.approx(r.latency.speedup / r.layer_norm_share)
    d = r.to_dict()
    assert (
        set(d["norm_ms"]) == {"layer_norm", "folded", "copy_floor"} and d["latency"]["tokens"] == 8
    )


def test_cli_bench_json_on_a_model_dir(tmp_path):
    path = tmp_path / "m"
    perturb(tiny_model("gpt2"), seed=7).save_pretrained(path)
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(path),
            "--shapes",
            "8x64",
            "--dtypes",
            "float32",
            "--seq-len",
            "8",
            "--repeats",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [k["cols"] for k in payload["kernels"]] == [64]
    assert payload["e2e"]["latency"]["repeats"] == 2 and "copy_floor" in payload["e2e"]["norm_ms"]


def test_models_to_compare_folds_then_casts(tmp_path):
    from enjoyln.bench import compare_latency, models_to_compare

    path = tmp_path / "m"
    perturb(tiny_model("gpt2"), seed=8).save_pretrained(path)
    original, folded = models_to_compare(path, "cpu", torch.bfloat16)
    assert {p.dtype for p in (*original.parameters(), *folded.parameters())} == {torch.bfloat16}
    assert any(isinstance(m, enjoyln.RMSNorm) for m in folded.modules())
    lat = compare_latency(
        original, folded, hf_example_inputs(original, batch=1, seq_len=8), repeats=4
    )
    assert lat.a_iqr_ms >= 0 and lat.b_iqr_ms >= 0 and lat.to_dict()["a_iqr_ms"] == lat.a_iqr_ms
