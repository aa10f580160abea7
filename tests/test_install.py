"""The install lines: the README's demo line needs no extra, CI runs exactly the README's test line,
and Triton is an extra of its own (1 GB that only a GPU uses), not part of ``dev``."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_line_and_the_demo_line_is_minimal():
    readme = (ROOT / "README.md").read_text()
    lines = re.findall(r"^(pip install .*?)\s+#", readme, re.M)
    demo = next(line for line in lines if line.endswith("enjoyln demo"))
    tests = next(line for line in lines if line.endswith("python -m pytest -q"))
    assert demo == "pip install torch==2.13.0 -e . && enjoyln demo"
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("pip install")
    ]
    assert ci == [tests] == ["pip install torch==2.13.0 -e '.[dev,triton]' && python -m pytest -q"]
    # offline first: the CPU index is the alternative, after the plain lines
    assert readme.index("--index-url https://download.pytorch.org/whl/cpu") > readme.index(demo)


def test_triton_is_its_own_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["triton"] == ["triton>=3.0"] and not any(
        d.startswith("triton") for d in extras["dev"]
    )
    assert not any(
        d.startswith(("triton", "onnx", "matplotlib", "sentence")) for d in project["dependencies"]
    )
