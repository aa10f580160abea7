"""The code style in one command: ``ruff format`` at the line limit of pyproject.toml, then what
ruff leaves over it wrapped (comments, docstrings, long strings); ``ruff check`` then names any
line still over it. Idempotent, so it can run again after a merge; ``tests/test_style.py`` checks
that nothing is left for it to do.

    python -m tools.format                # the tracked Python files
    python -m tools.format FILE ...       # these files only
    python -m tools.format --check        # exit 1, naming each line still over the limit
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
LIMIT = int(
    re.search(r"^line-length\s*=\s*(\d+)", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
)
KEPT_COMMENTS = ("noqa", "type:", "pragma", "fmt:", "doctest:")
"""Trailing comments a tool reads where they are: they stay on their line."""


@dataclass(frozen=True)
class Edit:
    """Replace lines ``first``..``last`` (1-based, inclusive) with ``lines``."""

    first: int
    last: int
    lines: list[str]


def wrapped(text: str, first: str, rest: str) -> list[str]:
    """``text`` in lines of at most LIMIT, the first after ``first``, the others after ``rest``."""
    width = LIMIT - max(len(first), len(rest))
    parts = textwrap.wrap(text, width=width, break_long_words=False, break_on_hyphens=False)
    return [(first if i == 0 else rest) + part for i, part in enumerate(parts)] or [first.rstrip()]


def _docstring_lines(tree: ast.AST) -> dict[int, int]:
    """Line -> the column of its docstring's opening quotes, for every line of every docstring (a
    string alone as a statement: a module's, a class's, a function's, or an attribute's after
    it)."""
    found: dict[int, int] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for line in range(node.lineno, node.end_lineno + 1):
                found[line] = node.col_offset
    return found


def _in_doctest(lines: list[str], index: int, docstring: dict[int, int]) -> bool:
    """A doctest's source or expected output: its lines are read as they stand."""
    i = index
    while i >= 0 and (i + 1) in docstring and lines[i].strip():
        if lines[i].lstrip().startswith((">>>", "...")):
            return True
        i -= 1
    return False


STRUCTURE = re.compile(r"(-|\*|\+|>>>|\.\.\.|\||#|\d+[.)]|[A-Za-z ]+:$|\"\"\"|''')")
"""A line that starts a list item, a doctest, a table row or a heading, or closes a docstring: never
joined to the line above it."""


def _paragraph_end(
    lines: list[str], index: int, indent: str, inside: Callable[[int], bool], prefix: str = ""
) -> int:
    """The last row (0-based) of the paragraph that starts at ``index``: the rows after it at the
    same indent that continue its prose, so that wrapping reflows them instead of leaving a word
    alone on a line."""
    end = index
    while end + 1 < len(lines) and inside(end + 1):
        nxt = lines[end + 1]
        text = nxt.strip().removeprefix(prefix)
        if (
            not text
            or nxt[: len(nxt) - len(nxt.lstrip())] != indent
            or STRUCTURE.match(text)
            or lines[end].rstrip().endswith((":", '"""', "'''"))
        ):
            break
        end += 1
    return end


def docstring_edit(
    lines: list[str], index: int, column: int, docstring: dict[int, int]
) -> Edit | None:
    """A docstring's long line, wrapped at its words with the docstring's indent, together with the
    lines that continue its paragraph."""
    line = lines[index]
    stripped = line.lstrip()
    lead = line[: len(line) - len(stripped)]
    opening = ""
    for quote in ('r"""', '"""', "r'''", "'''"):
        if stripped.startswith(quote):
            opening, stripped = quote, stripped[len(quote) :]
            break
    if len(stripped.split()) < 2:
        return None
    indent = " " * column if opening else lead
    last = _paragraph_end(lines, index, indent, lambda i: (i + 1) in docstring)
    text = " ".join([stripped.rstrip(), *(lines[i].strip() for i in range(index + 1, last + 1))])
    out = wrapped(text, lead + opening, indent)
    return Edit(index + 1, last + 1, out) if len(out) > 1 or last > index else None


def comment_edit(lines: list[str], token: tokenize.TokenInfo) -> Edit | None:
    """A long comment wrapped: one on its own line in place, a trailing one moved above its line."""
    row, col = token.start
    line = lines[row - 1]
    text = token.string.lstrip("#").strip()
    if token.string.startswith("#!") or not text or len(text.split()) < 2:
        return None
    code = line[:col].rstrip()
    indent = line[: len(line) - len(line.lstrip())]
    if not code:  # the comment lines after it at its indent continue it: reflowed together

        def own_comment(i: int) -> bool:
            return lines[i].lstrip().startswith("# ") and "noqa" not in lines[i]

        last = _paragraph_end(lines, row - 1, indent, own_comment, prefix="# ")
        more = [lines[i].strip()[1:].strip() for i in range(row, last + 1)]
        return Edit(row, last + 1, wrapped(" ".join([text, *more]), indent + "# ", indent + "# "))
    if any(k in text for k in KEPT_COMMENTS):
        return None
    return Edit(row, row, [*wrapped(text, indent + "# ", indent + "# "), code])


def _split_point(body: str, room: int, formatted: bool) -> int | None:
    """Where a string literal's body may be cut (after a space, before ``room``): not inside an
    f-string's braces, nor inside an escape."""
    depth, best, i = 0, None, 0
    while i < len(body) and i < room:
        ch = body[i]
        if ch == "\\":
            i += 2
            continue
        if formatted and ch in "{}":
            if i + 1 < len(body) and body[i + 1] == ch:
                i += 2
                continue
            depth += 1 if ch == "{" else -1
        elif ch == " " and depth == 0 and 0 < i < len(body) - 1:
            best = i + 1
        i += 1
    return best


def _prefix(prefix: str, piece: str) -> str:
    return prefix if "{" in piece else prefix.replace("f", "").replace("F", "")


def string_edit(lines: list[str], token: tokenize.TokenInfo, depth: int) -> Edit | None:
    """A one-line string literal inside brackets, cut in two at a space: implicit concatenation."""
    (row, col), (end_row, end_col) = token.start, token.end
    if row != end_row:
        return None
    text = token.string
    prefix = text[: len(text) - len(text.lstrip("rRbBfFuU"))]
    quote = text[len(prefix)]
    if text[len(prefix) :].startswith(quote * 3):
        return None
    body = text[len(prefix) + 1 : -1]
    line = lines[row - 1]
    room = LIMIT - col - len(prefix) - 2
    cut = _split_point(body, room, "f" in prefix.lower())
    if cut is None:
        return None
    head, tail = body[:cut], body[cut:]
    # a piece keeps the f prefix only if it still formats something
    first = f"{_prefix(prefix, head)}{quote}{head}{quote}"
    second = f"{_prefix(prefix, tail)}{quote}{tail}{quote}"
    if depth:  # inside brackets: the two pieces are one string
        return Edit(row, row, [line[:col] + first, " " * col + second + line[end_col:]])
    # elsewhere, in brackets of their own (``("a " "b").format(x)`` is what ``"a b".format(x)`` was)
    return Edit(
        row, row, [line[:col] + "(" + first, " " * (col + 1) + second + ")" + line[end_col:]]
    )


def noqa_edits(source: str) -> list[Edit]:
    """What no wrapping can shorten (a doctest's line, a long name) is marked for the linter: at the
    end of the line, or of the string it lies in, where a ``noqa`` applies to the whole string."""
    lines = source.splitlines()
    long = {i + 1 for i, line in enumerate(lines) if len(line) > LIMIT}
    ends = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING and token.start[0] != token.end[0]:
            for row in range(token.start[0], token.end[0] + 1):
                ends[row] = token.end[0]
    marked = {ends.get(row, row) for row in long}
    return [
        Edit(row, row, [lines[row - 1] + "  # noqa: E501"])
        for row in sorted(marked, reverse=True)
        if "noqa" not in lines[row - 1]
    ]


def edits(source: str) -> list[Edit]:
    """One edit per long line that can be wrapped, bottom first."""
    lines = source.splitlines()
    long = {i + 1 for i, line in enumerate(lines) if len(line) > LIMIT}
    if not long:
        return []
    docstring = _docstring_lines(ast.parse(source))
    found: dict[int, Edit] = {}
    for row in sorted(long):
        if row in docstring and not _in_doctest(lines, row - 1, docstring):
            edit = docstring_edit(lines, row - 1, docstring[row], docstring)
            if edit is not None:
                found[row] = edit
    tokens, depth = [], 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        if token.start[0] in long and token.start[0] not in docstring:
            tokens.append((token, depth))
    # a trailing comment moves first; a string on its line is cut on a later pass if still needed
    for token, depth in [t for t in tokens if t[0].type == tokenize.COMMENT] + tokens:
        row = token.start[0]
        if row in found:
            continue
        if token.type == tokenize.COMMENT:
            edit = comment_edit(lines, token)
        elif token.type == tokenize.STRING and token.end[1] > LIMIT:
            edit = string_edit(lines, token, depth)
        else:
            continue
        if edit is not None:
            found[row] = edit
    kept, covered = [], 0
    for row in sorted(found):  # an edit that reflows the rows below it takes their own edits' place
        if row > covered:
            kept.append(found[row])
            covered = found[row].last
    return kept[::-1]


def _applied(source: str, todo: list[Edit]) -> str:
    lines = source.splitlines()
    for e in todo:  # bottom first, so the rows above stay where they were
        lines[e.first - 1 : e.last] = e.lines
    return "\n".join(lines) + "\n"


def wrap_file(path: Path, mark: bool = False) -> bool:
    """Wrap what can be wrapped in ``path``, a pass at a time until nothing changes; with ``mark``,
    mark what is left (``noqa_edits``). True if it changed the file."""
    source = original = path.read_text()
    for _ in range(20):
        todo = edits(source)
        if not todo:
            break
        source = _applied(source, todo)
    if mark:
        source = _applied(source, noqa_edits(source))
    if source != original:
        path.write_text(source)
    return source != original


def python_files(given: list[str]) -> list[Path]:
    if given:
        return [Path(p).resolve() for p in given]
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in listed if (ROOT / p).exists()]


def ruff(*args: str, files: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *map(str, files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything would")
    args = ap.parse_args(argv)
    files = python_files(args.files)
    if args.check:
        results = [ruff("format", "--check", "-q", files=files), ruff("check", "-q", files=files)]
        for r in results:
            sys.stdout.write(r.stdout + r.stderr)
        return 1 if any(r.returncode for r in results) else 0
    for _ in range(3):  # ruff after the wrapping, which may open or close a bracket's lines
        ruff("format", "-q", files=files)
        changed = [p for p in files if wrap_file(p)]
        if not changed:
            break
    if [p for p in files if wrap_file(p, mark=True)]:
        ruff("format", "-q", files=files)
    left = ruff("check", "-q", "--output-format", "concise", files=files)
    sys.stdout.write(left.stdout)
    return 1 if left.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
