"""The timm and open_clip sweep (scripts/sweep_timm.py): its sample, its summary and README block,
and one model through it where timm imports (skipped with the reason where it does not)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
spec = importlib.util.spec_from_file_location("sweep_timm", SCRIPTS / "sweep_timm.py")
sweep_timm = importlib.util.module_from_spec(spec)
sys.modules["sweep_timm"] = sweep_timm
spec.loader.exec_module(sweep_timm)


def test_sample_is_broad():
    keys = sweep_timm.all_keys()
    timm_keys = [k for k in keys if k.startswith("timm/")]
    towers = [k for k in keys if k.startswith("open_clip/")]
    assert len(timm_keys) >= 80 and len(set(timm_keys)) == len(timm_keys)
    assert len({sweep_timm.FAMILY[k] for k in timm_keys}) >= 30
    assert len(towers) >= 9
    assert {k.rsplit("/", 1)[1] for k in towers} == {"text", "visual"}
    named = {
        "vit_small_patch16_18x2_224",
        "vit_pwee_patch16_reg1_gap_256",
        "test_efficientnet_ln",
        "maxxvit_rmlp_nano_rw_256",
        "convformer_s18",
        "caformer_s18",
    }
    assert named <= {k.split("/", 1)[1] for k in timm_keys}


def _record(key, status, ln, folded, refusals, **extra):
    return {
        "key": key,
        "status": status,
        "forward_runs": True,
        "norm_calls": ln,
        "ln_entries": ln,
        "folded": folded,
        "refusals": refusals,
        "no_input": {"ok": False, "message": "X is not a Hugging Face model"},
        "seconds": 1.0,
        "cpu_seconds": 1.0,
        **extra,
    }


def test_summary_counts_and_groups():
    reason = "it is a functional layer_norm call in a LayerNorm, not a plain nn.LayerNorm"
    results = {
        "timm/a": _record("timm/a", "exact", 10, 4, {reason: 6}),
        "timm/b": _record("timm/b", "inexact", 5, 5, {}, float64={"rounding": True}),
        "timm/c": _record("timm/c", "inexact", 3, 1, {reason: 2}, float64={"rounding": False}),
        "open_clip/M/text": _record("open_clip/M/text", "exact", 7, 0, {reason: 5, "other": 2}),
        "timm/d": {
            "key": "timm/d",
            "status": "skipped",
            "reason": "no LayerNorm or GroupNorm in the forward",
        },
    }
    s = sweep_timm.summarize(results)
    assert (s["models"], s["tried"], s["exact"], s["inexact"], s["skipped"]) == (5, 4, 2, 2, 1)
    assert s["inexact_float64_rounding"] == 1 and s["unsound"] == 1
    assert (s["folded"], s["ln_entries"]) == (10, 25)
    assert math.isclose(s["folded_pct"], 40.0)
    assert s["by_source"]["open_clip"] == {
        "models": 1,
        "tried": 1,
        "exact": 1,
        "ln_entries": 7,
        "folded": 0,
    }
    assert s["refusals"][reason] == {"models": 3, "entries": 13, "example": "timm/a"}
    assert list(s["refusals"])[0] == reason  # most entries first
    assert s["no_input_ok"] == 0 and s["no_input_errors"] == {
        "CLASS is not a Hugging Face model": 4
    }


def test_readme_block_has_both_columns_against_an_older_baseline():
    results = {"timm/a": _record("timm/a", "exact", 10, 4, {"r": 6})}
    now = sweep_timm.summarize(results)
    before = sweep_timm.summarize({"timm/a": _record("timm/a", "exact", 10, 1, {"r": 9})})
    meta = {
        "timm": "1",
        "open_clip": "2",
        "machine": "m",
        "jobs": 2,
        "wall_seconds": 60.0,
        "enjoyln_commit": "new",
        "machine_note": "Shared.",
    }
    text = sweep_timm.readme_section(
        now, meta, {"meta": {"enjoyln_commit": "old"}, "summary": before}
    )
    assert "| | before (`old`) | now |" in text
    assert "| **folded LNs** / LN entries | **1** / 10 (10.0%) | **4** / 10 (40.0%) |" in text
    assert "Shared." in text
    base = {
        "meta": {"enjoyln_commit": "old"},
        "summary": before,
        "results": {"timm/a": _record("timm/a", "exact", 10, 6, {"r": 4})},
    }
    assert (
        "fewer LNs than the baseline: `timm/a` (6 -> 4) (of 1 in both)"
        in sweep_timm.readme_section(now, meta, base, results)
    )
    base["results"]["timm/a"] = _record("timm/a", "exact", 10, 1, {"r": 9})
    assert "fewer LNs than the baseline: none (of 1 in both)" in sweep_timm.readme_section(
        now, meta, base, results
    )
    alone = sweep_timm.readme_section(now, meta, None)
    assert "| | enjoyln `new` |" in alone


def _timm_or_skip():
    try:
        sweep_timm.import_torchvision()
        sweep_timm.import_libraries()
    except ImportError as exc:
        pytest.skip(f"timm, open_clip or torchvision is not installed ({exc})")


def test_one_timm_model_through_the_sweep():
    _timm_or_skip()
    record = sweep_timm.run_one("timm/test_vit")
    assert record["status"] == "exact", record
    assert record["ln_entries"] == 13 and record["inputs"] == "pretrained_cfg input_size 3x160x160"
    assert record["max_rel"] <= sweep_timm.RTOL
    assert sum(record["refusals"].values()) == record["ln_entries"] - record["folded"]
