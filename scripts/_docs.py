"""Write a generated block into README.md between marker comments."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def replace_section(name: str, body: str, readme: Path = README) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->``."""
    text = readme.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no {start} ... {end} block")
    readme.write_text(pattern.sub(lambda _: f"{start}\n{body.rstrip()}\n{end}", text))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} threads, Python {platform.python_version()}, "
            f"torch {torch.__version__}")
