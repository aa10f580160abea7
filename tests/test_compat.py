"""A torchvision built for another torch (PyPI's CUDA wheel beside a CPU torch): its import fails
on the fake kernels it registers for C++ operators that did not load. ``import enjoyln`` lets it
import without them, says so in one line with the fix, and models still fold.

The torchvision here is a stand-in that fails exactly as that wheel does (the control test shows
it), with the few names transformers reads of torchvision at import time."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from enjoyln.testing import perturb, tiny_model

FAKE_INIT = """
import torch
import torch.library

__version__ = "0.28.0+cu130"
_lib = torch.library.Library("torchvision", "DEF")
_lib.define("present(Tensor x) -> Tensor")


@torch.library.register_fake("torchvision::present")  # an operator that exists: registered as usual
def _present(x):
    return torch.empty_like(x)


@torch.library.register_fake("torchvision::nms")  # one its C++ library would have defined
def _nms(dets, scores, iou_threshold):
    return dets


from . import io, transforms
"""

ANYTHING = """
class _Any:
    def __getattr__(self, name):
        return _Any()

    def __call__(self, *args, **kwargs):
        return _Any()


def __getattr__(name):
    return _Any()
"""


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    """A directory to put first on PYTHONPATH: a torchvision whose import fails as the mismatched
    wheel's does, with its distribution metadata (transformers imports it only then)."""
    root = tmp_path_factory.mktemp("site")
    (root / "torchvision" / "transforms").mkdir(parents=True)
    (root / "torchvision" / "__init__.py").write_text(FAKE_INIT)
    for name in ("io.py", "transforms/__init__.py", "transforms/functional.py"):
        (root / "torchvision" / name).write_text(ANYTHING)
    (root / "torchvision" / "data.txt").write_text("read through its loader")
    (root / "torchvision-0.28.0.dist-info").mkdir()
    (root / "torchvision-0.28.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n"
    )
    return root


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """A torchvision that matches torch: its operators are defined (as its C++ library would), and
    importing it again re-runs only its __init__, as the real package's does."""
    root = tmp_path_factory.mktemp("healthy")
    (root / "torchvision").mkdir()
    (root / "torchvision" / "__init__.py").write_text(
        '__version__ = "0.28.0+cpu"\nfrom . import _C, _meta\n'
    )
    (root / "torchvision" / "_C.py").write_text(
        'import torch.library\nlib = torch.library.Library("torchvision", "DEF")\n'
        'lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")\n'
    )
    (root / "torchvision" / "_meta.py").write_text(
        'import torch.library\n\n\n@torch.library.register_fake("torchvision::nms")\n'
        "def _nms(dets, scores, iou_threshold):\n    return dets\n"
    )
    (root / "torchvision" / "data.txt").write_text("read through its loader")
    return root


# what importlib gives a package it imported itself, and what the guard must leave alone
AS_IMPORTLIB_LEAVES_IT = """
import importlib, importlib.resources, json, sys, warnings
import enjoyln, torch
register_fake = torch.library.register_fake
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torchvision
state = {"loader": type(torchvision.__loader__).__name__,
         "spec_loader_is_loader": torchvision.__spec__.loader is torchvision.__loader__,
         "resource": importlib.resources.files("torchvision").joinpath("data.txt").read_text(),
         "guard_left": [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "enjoyln.compat"],
         "register_fake_restored": torch.library.register_fake is register_fake,
         "warnings": [w.category.__name__ for w in caught]}
"""  # noqa: E501


def _run(site, *args, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def test_the_stand_in_fails_to_import_as_the_mismatched_wheel_does(mismatched):
    result = _run(mismatched, "-c", "import torchvision")
    assert result.returncode == 1 and "operator torchvision::nms does not exist" in result.stderr


def test_import_enjoyln_lets_it_import_with_one_warning_and_the_fix(mismatched):
    code = AS_IMPORTLIB_LEAVES_IT + textwrap.dedent("""
        present = torch._library.simple_registry.singleton.find("torchvision::present").fake_impl.kernel
        print(json.dumps({"warnings": [(w.category.__name__, str(w.message)) for w in caught], "state": state,
                          "present_registered": present is not None, "cuda": torch.version.cuda}))
    """)  # noqa: E501
    result = _run(mismatched, "-c", code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["present_registered"]  # only an operator that does not exist is skipped
    assert out["state"] == {
        "loader": "SourceFileLoader",
        "spec_loader_is_loader": True,
        "guard_left": [],
        "resource": "read through its loader",
        "register_fake_restored": True,
        "warnings": ["TorchvisionMismatchWarning"],
    }
    [(category, message)] = out["warnings"]
    index = "cpu" if out["cuda"] is None else "cu" + out["cuda"].replace(".", "")
    assert category == "TorchvisionMismatchWarning" and "\n" not in message
    assert "torchvision 0.28.0+cu130 was built for another torch" in message
    assert (
        f"pip install torchvision==0.28.* --index-url https://download.pytorch.org/whl/{index}"
        in message
    )


def test_a_transformers_model_folds_beside_it_with_one_warning_line(mismatched, tmp_path):
    perturb(tiny_model("bert"), seed=3).save_pretrained(tmp_path / "bert")
    result = _run(mismatched, "-m", "enjoyln", "fold", "bert", "out", "--static", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warning_lines = [line for line in result.stderr.splitlines() if "torchvision" in line]
    assert len(warning_lines) == 1 and warning_lines[0].startswith(
        "warning: torchvision 0.28.0+cu130"
    )
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_torchvision_that_matches_torch_is_left_as_importlib_makes_it(healthy):
    """No warning, its own loader, resources read through it, reload works, nothing of the guard
    left."""
    code = AS_IMPORTLIB_LEAVES_IT + textwrap.dedent("""
        importlib.reload(torchvision)
        state["reloaded_by"] = type(torchvision.__spec__.loader).__name__
        print(json.dumps(state))
    """)
    result = _run(healthy, "-c", code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "loader": "SourceFileLoader",
        "spec_loader_is_loader": True,
        "resource": "read through its loader",
        "guard_left": [],
        "register_fake_restored": True,
        "warnings": [],
        "reloaded_by": "SourceFileLoader",
    }
