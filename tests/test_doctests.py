"""The examples in the package's docstrings run as written (those marked ``+SKIP`` need a model
directory or a GPU). A public entry point's one example must not go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest

from test_layout import MODULES

OPTIONAL = ("triton", "onnx", "onnxruntime", "onnxscript", "matplotlib")


@pytest.mark.parametrize("name", sorted(m for m, p in MODULES.items() if ">>>" in p.read_text()))
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{exc.name} is not installed")
        raise
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples in {name} failed (see the output)"
    )
