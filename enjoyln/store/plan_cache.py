"""The analysis of a config, kept on disk so that ``check`` after ``fold`` does not trace again.

A plan depends only on the model the config builds, the analysis options and the code that
runs: the key is a digest of the config's JSON, the options, and the versions of torch and
transformers with a digest of enjoyln's own source (a changed rule is a new key). Models with
remote code are never cached. The cache sits beside the compiled kernels (``ENJOYLN_CACHE``,
default ``~/.cache/enjoyln``), which it trusts as much; ``ENJOYLN_PLAN_CACHE=0`` turns it off.
A cache that cannot be read or written is skipped, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..ops.cpu import cache_dir
from ..plan import FoldPlan
from .model_dir import ModelDir


@functools.cache
def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _key(md: ModelDir, options: dict[str, Any]) -> str | None:
    if md.custom_code or os.environ.get("ENJOYLN_PLAN_CACHE", "1") == "0":
        return None
    import torch
    import transformers

    text = json.dumps({"config": md.config, "architecture": md.architecture, "options": options,
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "enjoyln": _source_digest()}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def cached_plan(md: ModelDir, options: dict[str, Any], analyze: Callable[[], FoldPlan]) -> FoldPlan:
    """``analyze()``, or the plan it gave before for the same config, options and code.

    >>> cached_plan(md, {"fuse_affine": False}, lambda: analyze(meta))  # doctest: +SKIP
    """
    key = _key(md, options)
    file = cache_dir() / "plans" / f"{key}.json" if key else None
    if file is not None:
        try:
            return FoldPlan.from_dict(json.loads(file.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    plan = analyze()
    if file is not None:
        data = plan.to_dict()
        if FoldPlan.from_dict(data).to_dict() == data:  # only what reads back as it was
            try:
                file.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as f:
                    json.dump(data, f)
                os.replace(f.name, file)
            except OSError:
                pass
    return plan
