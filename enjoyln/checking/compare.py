"""What the static check compares besides tensors: config.json as JSON values against what the
plan writes, the other files by content, the dtype a candidate loads in, its remote code, and a
recorded plan against this enjoyln's analysis."""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, EnjoylnError
from ..plan import FoldPlan, block_lists
from ..store.files import extra_files, is_weight_file, loader_files
from ..store.formats import JSON_LIMIT, input_file, loader_text, parse_json_file
from ..store.locate import PT_INDEX, SAFE_INDEX
from ..store.checkpoint import Checkpoint
from ..store.transaction import OWNER_FILE

LOAD_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""The dtypes ``check --dtype`` accepts."""


def parse_dtype(dtype: Any) -> str | None:
    """``torch.float16`` or ``"float16"`` -> ``"float16"``."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in LOAD_DTYPES:
        raise EnjoylnError(
            f"cannot judge a candidate in dtype {dtype!r}; use one of {', '.join(LOAD_DTYPES)}"
        )
    return name


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: objects in any key order, but ``1``, ``1.0`` and ``true`` differ (a
    loader may test them apart), NaN equals NaN, ``-0.0`` is not ``0.0``. No recursion."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if x.keys() != y.keys():
                return False
            stack += [(x[k], y[k]) for k in x]
        elif isinstance(x, _Object):
            if len(x) != len(y) or any(kx != ky for (kx, _), (ky, _) in zip(x, y)):
                return False
            stack += [(vx, vy) for (_, vx), (_, vy) in zip(x, y)]
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack += list(zip(x, y))
        elif isinstance(x, float):
            if not (x == y and math.copysign(1, x) == math.copysign(1, y) or x != x and y != y):
                return False
        elif x != y:
            return False
    return True


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_differences(ref: dict[str, Any], cand: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, reference's value, candidate's value) for every key that differs; a missing side
    is ``_MISSING``."""
    out, stack = [], [("", ref, cand)]
    while stack:
        path, a, b = stack.pop()
        for key in sorted(a.keys() | b.keys(), reverse=True):
            x, y = a.get(key, _MISSING), b.get(key, _MISSING)
            if isinstance(x, dict) and isinstance(y, dict):
                stack.append((f"{path}{key}.", x, y))
            elif x is _MISSING or y is _MISSING or not same_json(x, y):
                out.append((f"{path}{key}", x, y))
    return out


_MISSING = object()


def _first_difference(path: str, a: Any, b: Any) -> tuple[str, Any, Any]:
    """Where two JSON values first differ (``plan.layer_norms[3].reason``), and the two values
    there."""
    while True:
        if isinstance(a, dict) and isinstance(b, dict):
            key = next(
                (
                    k
                    for k in sorted(a.keys() | b.keys())
                    if not (k in a and k in b and same_json(a[k], b[k]))
                ),
                None,
            )
            if key is None or key not in a or key not in b:
                return (
                    (f"{path}.{key}", a.get(key, _MISSING), b.get(key, _MISSING))
                    if key
                    else (path, a, b)
                )
            path, a, b = f"{path}.{key}", a[key], b[key]
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if not same_json(x, y))
            path, a, b = f"{path}[{i}]", a[i], b[i]
        else:
            return path, a, b


def _without_dtypes(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without its ``dtype`` and ``torch_dtype`` entries, at every level; a non-string
    value under that name (a token id in a vocabulary) stays."""
    config = copy.deepcopy(config)
    stack = [config]
    while stack:
        d = stack.pop()
        for key in ("dtype", "torch_dtype"):
            if key in d and (d[key] is None or isinstance(d[key], str)):
                del d[key]
        stack += [v for v in d.values() if isinstance(v, dict)]
    return config


def config_problems(
    expected: dict[str, Any], actual: dict[str, Any], dtype: str | None
) -> list[str]:
    """config.json against what it must be, every key as a JSON value (the enjoyln block but for its
    version)."""
    if dtype is not None:
        expected, actual = _without_dtypes(expected), _without_dtypes(actual)
    expected, actual = dict(expected), dict(actual)
    block, theirs = expected.pop("enjoyln", _MISSING), actual.pop("enjoyln", _MISSING)
    problems = [
        f"config.json adds {key} = {_short(b)}"
        if a is _MISSING
        else f"config.json drops {key} (the reference's is {_short(a)})"
        if b is _MISSING
        else f"config.json changes {key} from {_short(a)} to {_short(b)}"
        for key, a, b in _json_differences(expected, actual)
    ]
    if block is _MISSING and theirs is not _MISSING:
        problems.append("config.json has an enjoyln block, which the plan does not write")
    elif block is not _MISSING and not isinstance(theirs, dict):
        problems.append("config.json has no enjoyln block, or one that is not an object")
    elif block is not _MISSING:
        block, theirs = dict(block), dict(theirs)
        block.pop("version", None)
        if not isinstance(theirs.pop("version", None), str):
            problems.append("the enjoyln block's version is not a string")
        lists = block_lists(FoldPlan("")).keys()
        for key in sorted(block.keys() | theirs.keys()):
            a, b = block.get(key, _MISSING), theirs.get(key, _MISSING)
            if a is not _MISSING and b is not _MISSING and same_json(a, b):
                continue
            if key in lists:
                problems.append(f"the enjoyln block's {key} list is not what its plan gives")
            else:
                where, x, y = _first_difference(key, a, b)
                problems.append(
                    f"the enjoyln block's {key} is not what the confirmed plan gives: its {where} "
                    "is "
                    f"{_short(y) if y is not _MISSING else 'missing'}, not "
                    f"{_short(x) if x is not _MISSING else 'absent'}"
                )
    return problems


def load_problems(ref: Checkpoint, cand: Checkpoint, dtype: str | None = None) -> list[str]:
    """What makes ``from_pretrained`` load the candidate otherwise than the reference, beyond its
    files:
    another dtype (unless ``dtype`` names it), or an index it cannot read."""
    problems = []
    index = cand.path / (PT_INDEX if cand.pickled else SAFE_INDEX)
    if index.exists() and not isinstance(
        parse_json_file(index, "a weight index").get("metadata"), dict
    ):
        # transformers reads index["metadata"] whatever the config says
        problems.append(
            f"the candidate's {index.name} has no metadata object, so from_pretrained fails on it"
        )
    theirs, _ = ref.load_dtype
    ours, source = cand.load_dtype
    if dtype is None and ours != theirs:
        problems.append(
            f"the candidate loads in {ours} (from {source}), the reference in {theirs}; pass "
            f"--dtype {ours} (dtype= in Python) to judge it at that precision"
        )
    elif dtype is not None and ours != dtype:
        problems.append(
            f"the candidate loads in {ours} (from {source}), not in {dtype} as --dtype says"
        )
    return problems


class _Unreadable(Exception):
    pass


class _Object(list):
    """A JSON object as its (key, value) pairs, in the file's order: a loader may iterate one (a
    tokenizer's added tokens), so the same pairs in another order are not proven to load the
    same."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> _Object:
    if len({k for k, _ in pairs}) != len(pairs):
        raise _Unreadable  # which of the two a reader keeps is its own choice: compare the bytes
    return _Object(pairs)


def _json_value(path: Path) -> Any:
    with open(path, "rb") as f:
        raw = f.read(JSON_LIMIT + 1)
    if len(raw) > JSON_LIMIT:
        raise _Unreadable
    try:
        return json.loads(loader_text(raw), object_pairs_hook=_no_duplicate_keys)
    except (
        ValueError,
        RecursionError,
    ):  # not JSON as loaders read it (UnicodeDecodeError is a ValueError)
        raise _Unreadable from None


def _same_content(a: Path, b: Path) -> bool:
    """JSON files token by token when both parse as transformers reads them, anything else byte for
    byte (so a byte-order mark, which makes a loader refuse or ignore the file, is a difference)."""
    try:
        size_a, size_b = a.stat().st_size, b.stat().st_size
        if a.suffix == ".json" and max(size_a, size_b) <= JSON_LIMIT:
            with contextlib.suppress(_Unreadable):
                return same_json(_json_value(a), _json_value(b))
        return size_a == size_b and _same_bytes(a, b)
    except OSError as exc:
        raise CheckpointError(f"cannot read {exc.filename or b}: {exc.strerror or exc}") from None


def _same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def identical_directories(ref: Checkpoint, cand: Checkpoint) -> bool:
    """Whether every file a loader reads in ``cand`` is the same-named one in ``ref``, byte for
    byte."""
    (ours, odd), (theirs, odd_too) = loader_files(ref.path), loader_files(cand.path)
    for files in (ours, theirs):
        files.pop(
            OWNER_FILE, None
        )  # marks the temporary directory a fold checks; no loader reads it
    if odd or odd_too or ours.keys() != theirs.keys():
        return False
    try:
        sizes = {rel: (ours[rel].stat().st_size, theirs[rel].stat().st_size) for rel in ours}
        order = sorted(ours, key=lambda rel: (rel != "config.json", sizes[rel][0], rel))
        return all(x == y for x, y in sizes.values()) and all(
            _same_bytes(ours[rel], theirs[rel]) for rel in order
        )
    except OSError as exc:
        raise CheckpointError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None


def file_problems(ref: Checkpoint, cand: Checkpoint) -> list[str]:
    """Every file of the candidate but its config and weights must be one a fold of the reference
    holds, with its content, whatever its name (a loader may read any: PhoBERT's bpe.codes)."""
    expected = extra_files(ref)
    actual, problems = loader_files(cand.path)
    problems = [f"the candidate's {p}" for p in problems]
    index = PT_INDEX if cand.pickled else SAFE_INDEX
    # OWNER_FILE marks the temporary directory a fold checks before publishing it; no loader reads
    # it
    own = {"config.json", OWNER_FILE, *cand.shards} | (
        {index} if (cand.path / index).exists() else set()
    )
    theirs_gen, ours_gen = ref.library.generation(ref), cand.library.generation(cand)
    for key in sorted(
        k
        for k in theirs_gen.keys() | ours_gen.keys()
        if not same_json(theirs_gen.get(k), ours_gen.get(k))
    ):
        problems.append(
            f"the candidate's generation config changes {key} from {theirs_gen.get(key)!r} "
            f"to {ours_gen.get(key)!r}"
        )
    for rel in sorted(actual.keys() - own):
        source, weights = expected.get(rel), "/" not in rel and is_weight_file(rel)
        if source is None and weights and (ref.path / rel).is_file():
            source = input_file(ref.path / rel)  # the reference's own copy, kept as it was
        if source is None:
            problems.append(
                f"the candidate has {rel}, {'weights' if weights else 'a file'} a fold of the "
                "reference "
                "would not hold"
            )
        elif not _same_content(source, actual[rel]):
            problems.append(f"the candidate's {rel} differs from the reference's")
    for rel in sorted(expected.keys() - actual.keys()):
        problems.append(f"the candidate lacks the reference's {rel}")
    return problems


def code_problems(ref: Checkpoint, cand: Checkpoint) -> list[str]:
    """What makes the candidate's remote code other than the reference's. Its code is imported only
    once this finds nothing: code that differs could rewrite the gate itself."""
    if not (ref.custom_code or cand.custom_code):
        return []
    ours = {rel: p for rel, p in loader_files(ref.path)[0].items() if rel.endswith(".py")}
    theirs = {rel: p for rel, p in loader_files(cand.path)[0].items() if rel.endswith(".py")}
    problems = [
        f"the candidate has {rel}, code the reference does not have"
        for rel in sorted(theirs.keys() - ours.keys())
    ]
    problems += [
        f"the candidate lacks the reference's {rel}" for rel in sorted(ours.keys() - theirs.keys())
    ]
    problems += [
        f"the candidate's {rel} differs from the reference's"
        for rel in sorted(ours.keys() & theirs.keys())
        if not _same_content(ours[rel], theirs[rel])
    ]
    a, b = ref.config.get("auto_map", _MISSING), cand.config.get("auto_map", _MISSING)
    if not (a is b or a is not _MISSING and b is not _MISSING and same_json(a, b)):
        problems.append(
            f"config.json's auto_map is {_short(b) if b is not _MISSING else 'missing'}, "
            f"not the reference's {_short(a) if a is not _MISSING else '(none)'}"
        )
    return problems


def _essentials(plan: FoldPlan) -> dict[str, set]:
    return {
        "folded LayerNorms": {e.name for e in plan.foldable},
        "norm forms": {(e.name, *e.form) for e in plan.foldable if not e.plain_form},
        "centered tensors": {tuple(sorted(asdict(c).items())) for c in plan.centered},
        "untied tensors": {(u.param, u.tied_to) for u in plan.untied},
        "auxiliary centerings": {(a.module, a.where) for a in plan.auxiliary},
        "fused affines": {
            (e.name, e.affine, tuple(tuple(asdict(f).items()) for f in e.fused))
            for e in plan.layer_norms
            if e.foldable and e.affine or e in plan.affine_moved
        },
        "rotations": {
            (
                r.kind,
                r.seed,
                r.keep_mean,
                r.version,
                r.stream,
                r.width,
                tuple(tuple(asdict(x).items()) for x in r.rotated),
            )
            for r in plan.rotations
        },
        "outputs changed": set(plan.changed_outputs),
    }


def plan_problems(
    recorded: FoldPlan, analysed: FoldPlan, hint: str = "fold again with this version"
) -> list[str]:
    """Where a recorded plan is not what this enjoyln's analysis gives, one line per kind, each
    ending with ``hint``."""
    problems = []
    mine, theirs = _essentials(analysed), _essentials(recorded)
    for what in mine:
        extra, missing = theirs[what] - mine[what], mine[what] - theirs[what]
        if extra or missing:
            odd = sorted(map(str, extra or missing))[0]
            problems.append(
                f"the recorded plan is not what this enjoyln's analysis gives: its {what} "
                f"{'include' if extra else 'lack'} {odd}; {hint}"
            )
    return problems
