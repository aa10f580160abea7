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


def test_a_wrapped_line_reflows_its_paragraph_and_leaves_no_word_alone(tmp_path):
    """The lines after a long one in its paragraph are wrapped with it (a docstring's and a comment
    block's), up to a list item, a doctest or a blank line, which stay as they are."""
    long, short = " ".join(["alpha"] * 19), "beta gamma"
    path = tmp_path / "para.py"
    path.write_text(
        f'def f():\n    """{long} {short}\n    delta epsilon.\n    - item one\n    """\n'
        f"    # {long} {short}\n    # delta epsilon\n\n    # kept\n    return 1\n"
    )
    style.wrap_file(path)
    lines = path.read_text().splitlines()
    assert all(len(line) <= style.LIMIT for line in lines)
    assert all(len(line.split()) > 2 for line in lines if line.strip() and "alpha" in line)
    words = " ".join(lines).split()
    assert words.count("delta") == 2 and "- item one" in "\n".join(lines) and "    # kept" in lines
    text = "\n".join(lines)
    assert text.count(f"{short} delta epsilon.") == 1  # the docstring's paragraph, reflowed
    assert text.count(f"{short} # delta epsilon") == 0 and f"{short} delta epsilon\n" in text
