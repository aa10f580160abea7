import json

from enjoyln import convert
from enjoyln.store import expected
from enjoyln.plan import FoldPlan
from enjoyln.store.model_dir import open_model_dir
from enjoyln.testing import perturb, tiny_model


def test_a_config_is_analysed_once_per_options_and_code(tmp_path, monkeypatch):
    monkeypatch.setenv("ENJOYLN_PLAN_CACHE", "1")
    monkeypatch.setenv("ENJOYLN_CACHE", str(tmp_path / "cache"))
    perturb(tiny_model("gpt2"), seed=3).save_pretrained(tmp_path / "ref")
    calls = []
    real = expected.analyze
    monkeypatch.setattr(expected, "analyze", lambda *a, **k: calls.append(k) or real(*a, **k))
    first = convert.analyze_checkpoint(tmp_path / "ref")
    again = convert.analyze_checkpoint(tmp_path / "ref")
    assert len(calls) == 1 and again.to_dict() == first.to_dict() and first.foldable
    assert len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 1
    convert.analyze_checkpoint(tmp_path / "ref", fuse_affine=True)  # other options: another key
    assert len(calls) == 2

    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    config["n_layer"] = 1  # another config: another model, analysed afresh
    (tmp_path / "ref" / "config.json").write_text(json.dumps(config))
    (tmp_path / "ref" / "model.safetensors").unlink()
    perturb(tiny_model("gpt2", n_layer=1), seed=3).save_pretrained(tmp_path / "ref")
    one = convert.analyze_checkpoint(tmp_path / "ref")
    assert len(calls) == 3 and len(one.layer_norms) < len(first.layer_norms)

    # a damaged entry is analysed afresh, not an error
    for f in (tmp_path / "cache" / "plans").glob("*.json"):
        f.write_text("{not json")
    assert convert.analyze_checkpoint(tmp_path / "ref").to_dict() == one.to_dict() and len(calls) == 4


def test_off_switch_and_remote_code_are_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ENJOYLN_CACHE", str(tmp_path / "cache"))
    perturb(tiny_model("gpt2"), seed=3).save_pretrained(tmp_path / "ref")
    monkeypatch.setenv("ENJOYLN_PLAN_CACHE", "0")
    convert.analyze_checkpoint(tmp_path / "ref")
    assert not (tmp_path / "cache" / "plans").exists()
    monkeypatch.setenv("ENJOYLN_PLAN_CACHE", "1")
    md = open_model_dir(tmp_path / "ref")
    md.custom_code = ["auto_map in config.json"]
    from enjoyln.store.plan_cache import cached_plan

    assert cached_plan(md, {}, lambda: FoldPlan("X")).model == "X"
    assert not (tmp_path / "cache" / "plans").exists()
