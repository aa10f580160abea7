"""scripts/bench_gpu.py's dry run: on the CPU at tiny sizes, every part runs and the report
has its tables (no GPU here or in CI; the figures it writes come from a GPU run)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.py"
spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
bench_gpu = importlib.util.module_from_spec(spec)
sys.modules["bench_gpu"] = bench_gpu
spec.loader.exec_module(bench_gpu)


def test_the_dry_run_runs_every_part(tmp_path, capsys):
    threads = torch.get_num_threads()
    res = bench_gpu.main(
        [
            "--dry-run",
            "--models",
            "gpt2",
            "--dtypes",
            "fp32,bf16",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert torch.get_num_threads() == threads  # put back
    assert res["env"]["torch"] == torch.__version__ and "gpu" not in res["env"]
    host = res["host"]["fp32"]
    assert (
        host["F.layer_norm"] > 0
        and host["ops.rms_norm, weight and bias"] > 0
        and host["path (weight and bias)"] == "cpu"
    )
    assert [(r["shape"], r["dtype"]) for r in res["kernels"]] == [
        ("64x96", "float32"),
        ("32x1024", "float32"),
        ("64x96", "bfloat16"),
        ("32x1024", "bfloat16"),
    ]
    for r in res["kernels"]:
        assert r["us"]["enjoyln"] > 0 and r["enjoyln_ulps"] <= 2 and r["add_sum_exact"]
    (gpt2,) = res["e2e"]
    assert gpt2["folded"] == gpt2["layer_norms"] == 5
    assert gpt2["fp32"]["rel_original"] == 0 and gpt2["fp32"]["rel_folded"] < 1e-5
    assert 0 < gpt2["bf16"]["rel_folded"] < 0.05 and gpt2["bf16"]["eager"]["b_ms"] > 0
    report = capsys.readouterr().out
    assert (
        "a dry run" in report
        and "**Host time per call**" in report
        and "| gpt2 | 5/5 | bf16 |" in report
    )
    assert "Against the targets" not in report  # a dry run judges nothing
    assert (tmp_path / "r.json").stat().st_size > 0


def test_writing_needs_a_gpu_run():
    with pytest.raises(SystemExit):
        bench_gpu.parse(["--dry-run", "--write"])
