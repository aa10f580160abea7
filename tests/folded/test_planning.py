"""The plan for a directory: its analysis traced once per process for the content it is built
from, never for a path or for what another directory held."""

import json
import shutil

import pytest

from enjoyln.folded import planning
from enjoyln.options import FoldOptions
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.testing import perturb, tiny_model


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("planning") / "gpt2"
    perturb(tiny_model("gpt2"), seed=5).save_pretrained(path)
    return path


@pytest.fixture
def traces(monkeypatch):
    """The analyses actually traced (the fixture's monkeypatch starts the test with none
    remembered)."""
    seen = []
    real = planning.analyze

    def counted(model, **options):
        seen.append(type(model).__name__)
        return real(model, **options)

    monkeypatch.setattr(planning, "analyze", counted)
    return seen


def test_a_fold_and_its_check_trace_the_source_once(src, tmp_path, traces):
    result = fold_checkpoint(src, tmp_path / "out", FoldOptions.of(check="static"))
    assert result.report.passed and result.report.static.computed == 0
    assert traces == ["GPT2LMHeadModel"]


def test_the_key_is_the_content_not_the_path(src, tmp_path, traces):
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    first = planning.analyze_dir(open_checkpoint(src), auxiliary_centering=False)
    again = planning.analyze_dir(open_checkpoint(copy), auxiliary_centering=False)
    assert again == first and len(traces) == 1
    # another option, or one changed value of config.json, is traced again
    planning.analyze_dir(open_checkpoint(copy), auxiliary_centering=False, fuse_affine=True)
    config = json.loads((copy / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-3
    (copy / "config.json").write_text(json.dumps(config))
    changed = planning.analyze_dir(open_checkpoint(copy), auxiliary_centering=False)
    assert len(traces) == 3
    assert {e.eps for e in changed.layer_norms} == {1e-3} != {e.eps for e in first.layer_norms}


def test_each_caller_gets_its_own_plan(src, traces):
    first = planning.analyze_dir(open_checkpoint(src), auxiliary_centering=False)
    first.notes.append("changed by its caller")
    first.layer_norms.clear()
    again = planning.analyze_dir(open_checkpoint(src), auxiliary_centering=False)
    assert len(traces) == 1
    assert again.layer_norms and "changed by its caller" not in again.notes
