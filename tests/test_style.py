"""The code style: ``ruff format`` and the line limit of 100 (pyproject.toml) hold for every tracked
Python file. ``python -m tools.format`` makes them hold."""

import shutil
import subprocess
import sys

import pytest

from tools import format as style

ruff = pytest.mark.skipif(
    shutil.which("ruff") is None
    and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode
    != 0,
    reason="ruff is not installed (pip install -e '.[dev]')",
)


@ruff
def test_the_tree_is_formatted_and_within_the_line_limit():
    files = style.python_files([])
    assert len(files) > 100 and style.LIMIT == 100
    for args in (("format", "--check", "-q"), ("check", "-q", "--output-format", "concise")):
        result = style.ruff(*args, files=files)
        assert result.returncode == 0, f"run python -m tools.format\n{result.stdout}{result.stderr}"


def test_the_wrapping_keeps_what_a_line_means(tmp_path):
    """A long comment, docstring line and string are wrapped; a doctest's line is only marked."""
    words = " ".join(["word"] * 30)
    path = tmp_path / "long.py"
    path.write_text(
        f'def f(x):\n    """{words}.\n\n    >>> f("{words}")\n    """\n'
        f'    # {words}\n    return print(x, "{words}")  # {words}\n'
    )
    style.wrap_file(path, mark=True)
    text = path.read_text()
    assert [line for line in text.splitlines() if len(line) > style.LIMIT] == [
        f'    >>> f("{words}")'
    ], text
    namespace: dict = {}
    exec(compile(text, str(path), "exec"), namespace)
    assert " ".join(namespace["f"].__doc__.split()).startswith(words + ".")
    assert f'>>> f("{words}")' in text and '    """  # noqa: E501' in text
    assert text.count(f"# {words}") == 0 and text.count("# word") >= 4
