"""Write a generated block into the document that holds its marker comments.

Each block lives in exactly one of README.md and docs/*.md, between
``<!-- name:start -->`` and ``<!-- name:end -->``; ``replace_section`` finds it
there, so a block can move between documents without its script changing.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def documents(root: Path = ROOT) -> list[Path]:
    """README.md and every document under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def block_file(name: str, root: Path = ROOT) -> Path:
    """The one document holding the ``name`` block."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    found = [
        p
        for p in documents(root)
        if p.is_file() and start in (text := p.read_text()) and end in text
    ]
    if len(found) != 1:
        where = ", ".join(str(p.relative_to(root)) for p in found) or "no document"
        raise SystemExit(
            f"the {start} ... {end} block must be in exactly one document; found in {where}"
        )
    return found[0]


def replace_section(name: str, body: str, root: Path = ROOT) -> Path:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->``; returns the
    file."""
    path = block_file(name, root)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    path.write_text(pattern.sub(lambda _: f"{start}\n{body.rstrip()}\n{end}", path.read_text()))
    return path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    plural = "" if threads == 1 else "s"
    return (
        f"{cpu}, {threads} thread{plural}, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )
