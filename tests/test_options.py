"""The options objects: one per command family, each field in one place, an unknown one refused."""

import dataclasses
import importlib
import typing

import pytest

import enjoyln
from enjoyln import options
from enjoyln.errors import EnjoylnError
from enjoyln.options import Access, CheckOptions, FoldOptions
from test_layout import MODULES


def _walk(cls: type, path: str = "") -> list[tuple[str, str]]:
    """(dotted path, field name) of every field reachable from ``cls``, nested options followed."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        found.append((f"{path}{cls.__name__}.{f.name}", f.name))
        if dataclasses.is_dataclass(hints[f.name]):
            found += _walk(hints[f.name], f"{path}{cls.__name__}.{f.name}->")
    return found


def _imported(module: str) -> object:
    try:
        return importlib.import_module(module)
    except (
        ModuleNotFoundError
    ):  # an optional dependency (triton, onnx) not installed: no options there
        return object()


def test_rtol_has_one_home():
    """--rtol is CheckOptions.rtol, in a fold too: no options class copies it."""
    for root, expected in (
        (FoldOptions, ["FoldOptions.check->CheckOptions.rtol"]),
        (CheckOptions, ["CheckOptions.rtol"]),
    ):
        assert [p for p, name in _walk(root) if name == "rtol"] == expected
    # and no other options class anywhere in the package declares one
    classes = {
        obj
        for m in MODULES
        for obj in vars(_imported(m)).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__name__.endswith("Options")
        and obj.__module__.startswith("enjoyln")  # not one a module imports (Triton's, interpreted)
    }
    assert classes == {FoldOptions, CheckOptions}, classes


@pytest.mark.parametrize(
    "make",
    [
        lambda: CheckOptions(batchs=3),
        lambda: FoldOptions(fuse=True),
        lambda: Access(pickle=True),
        lambda: FoldOptions.of(check="static", seq=3),
        lambda: CheckOptions.of(CheckOptions(), rtl=1e-3),
    ],
)
def test_an_unknown_option_is_refused_in_one_line(make):
    with pytest.raises(EnjoylnError, match=r"^unknown option \w+; the options are \w+") as info:
        make()
    assert "\n" not in str(info.value)


def test_the_options_class_is_the_one_way_in(tmp_path):
    """No keyword fields beside the options object: a misplaced one fails at once, before any
    work."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'check'"):
        enjoyln.fold_checkpoint(tmp_path / "none", tmp_path / "out", check="static")
    with pytest.raises(TypeError, match="unexpected keyword argument 'mode'"):
        enjoyln.check_checkpoints(tmp_path / "a", tmp_path / "b", mode="static")
    assert (
        enjoyln.FoldOptions is options.FoldOptions and enjoyln.CheckOptions is options.CheckOptions
    )
