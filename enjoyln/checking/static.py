"""The static check: prove a checkpoint is the fold plan applied to another, weight by weight.

No forward pass and no model in memory: both directories are streamed tensor
by tensor, so it runs at disk speed and fits any size. Every tensor the
candidate's model loads is accounted for:

- an unchanged tensor is byte-identical to the reference's (or equal to it
  cast exactly, for a half-precision candidate of a float32 reference or a
  wider float; no other change of dtype is accepted);
- a centered tensor equals the reference's, centered in float64 and cast to
  its dtype, to within that dtype's rounding;
- an untied head equals the tensor it was tied to;
- the candidate loads in the reference's dtype (config, index metadata or
  first weight), unless the caller names another one (``dtype``), and then
  in that one;
- the candidate's config.json, as parsed JSON values, is the reference's
  with exactly what the confirmed plan writes (the ``enjoyln`` block, an
  untied head); only the writing tool's version in the block is taken on
  trust;
- every other file is what a fold of the reference holds: the same set of
  files, each the reference's by content (JSON by value), whatever its name;
- the recorded plan is what this enjoyln's analysis gives for the config.

It is not independent of the fold: it reads the directories through the store
(``store.model_dir``), and the tensors it expects are computed by the fold's own
code (the plan's tensors, centering and fusing in float64, from ``convert`` and
``transform.steps``). What it proves is that the candidate on disk is exactly what
this enjoyln's plan and arithmetic make of the reference; the forward check, which
runs both models, is the part that does not rely on that arithmetic.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import CheckpointError, EnjoylnError, first_line
from ..store.model_dir import ModelDir, load_dtype, meta_model
from ..store.files import extra_files, is_weight_file, loader_files
from ..store.formats import (DTYPES, JSON_LIMIT, PT_INDEX, SAFE_INDEX, input_file, load_pickled, loader_text,
                             parse_json_file)
from ..store.hf import check_shapes, checkpoint_key, saved_names
from ..store.transaction import OWNER_FILE
from ..ops.compare import same_bytes
from ..store.sources import source_of
from ..plan import Centering, FoldPlan, RotationSpec, block_lists
from ..store.tensors import Buffer, TensorReader, read_ahead

LOAD_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""The dtypes ``check --dtype`` accepts for a candidate meant to run at another precision."""


@dataclass
class StaticReport:
    """What the static check verified, and every problem it found (empty when it passed)."""

    passed: bool
    tensors: int = 0
    identical: int = 0
    centered: int = 0
    untied: int = 0
    computed: int = 0
    """With a fused affine or a rotation: tensors recomputed from the reference, and equal."""
    bytes_read: int = 0
    seconds: float = 0.0
    form: str = ""
    """'folded' (the plan applied) or 'identical' (the candidate is the reference)."""
    plan: str = ""
    """Where the plan came from: 'recorded' (the enjoyln block, confirmed) or 'analysis'."""
    problems: list[str] = field(default_factory=list)
    scope: str = "static check"
    """What was checked: every weight and file, or (with ``--forward-only``) the load settings only."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.scope != "static check":
            return "\n".join([f"{verdict}: {self.scope}"] + [f"  [FAIL] {p}" for p in self.problems])
        kinds = (f"{self.computed} recomputed with the fused affine and rotation" if self.computed else
                 f"{self.identical} identical, {self.centered} centered, {self.untied} untied")
        what = f"{self.tensors} tensors verified ({kinds}), {self.bytes_read / 1e6:.1f} MB read in {self.seconds:.2f} s"
        lines = [f"{verdict}: static check, {what}"]
        if self.form:
            lines.append(f"  the candidate is {'the plan applied to the reference' if self.form == 'folded' else 'identical to the reference'}"
                         f" (plan: {self.plan})")
        lines += [f"  [FAIL] {p}" for p in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"  ... and {len(self.problems) - 20} more problems")
        return "\n".join(lines)


def center_as_planned(t: torch.Tensor, cs: list[Centering], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """``t`` centered in place as ``cs`` say (per-head centerings of one weight come as several),
    by the very function the fold uses (float64 arithmetic, one block at a time, so no wide copy
    of the whole tensor). ``read`` gives a LayerScale gain by parameter name."""
    from ..transform.tensors import center_

    for c in cs:
        center_(t, c.axis, c.groups, scale=read(c.scale) if c.scale else None, blocks=c.blocks)
    return t


_ELEMENTS = 1 << 21


def _close(expected: torch.Tensor, cand: torch.Tensor, scale: Callable[[], float], *,
           exact: bool = True) -> tuple[bool, float]:
    """``expected`` rounded to the candidate's dtype against the candidate; (equal, max abs diff).

    In the reference's own dtype the candidate must be bit for bit what the fold computes: the
    fold and this check run the same float64 code, which gives the same bits on every x86
    capability and thread count, and one ulp of a bfloat16 bias moves the logits by 1e-3. Only a
    candidate in another dtype (``exact`` False, ``--dtype``) may sit one ulp of that dtype off,
    plus float64 noise of the input's scale (``scale()``, the largest magnitude before
    centering): it may have been centered after the cast, which rounds twice. That bound is per
    element, since one relative to the whole tensor's maximum would let a small element move by
    many of its own ulps.
    """
    if expected.shape != cand.shape:
        return False, math.inf
    rounded = expected.to(cand.dtype)
    if same_bytes(rounded, cand):
        return True, 0.0
    if not cand.is_floating_point():
        return False, math.inf
    diff, bound_scale = 0.0, None
    for e, c in zip(expected.reshape(-1).split(_ELEMENTS), cand.reshape(-1).split(_ELEMENTS)):
        if same_bytes(e.to(c.dtype), c):
            continue
        d = c.to(torch.float64).sub_(e.to(torch.float64)).abs_()
        diff = max(diff, float(d.nan_to_num(math.inf).max()))
        if exact:
            continue  # keep reading, to report the largest difference
        bound_scale = scale() if bound_scale is None else bound_scale
        info = torch.finfo(c.dtype)
        bound = e.to(torch.float64).abs_().clamp_min_(info.tiny).mul_(info.eps).add_(1e-12 * bound_scale)
        if not bool(d.le(bound).all()):
            return False, diff
    return not exact, diff


def parse_dtype(dtype: Any) -> str | None:
    """A ``dtype`` option as a name (``torch.float16`` or ``"float16"`` -> ``"float16"``), or None."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in LOAD_DTYPES:
        raise EnjoylnError(f"cannot judge a candidate in dtype {dtype!r}; use one of {', '.join(LOAD_DTYPES)}")
    return name


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: objects in any key order, but ``1``, ``1.0`` and ``true`` differ (a
    loader may test them apart), NaN equals NaN, and ``-0.0`` is not ``0.0``. No recursion, so
    a deeply nested file cannot exhaust the stack."""
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
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_differences(ref: dict[str, Any], cand: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, reference's value, candidate's value) for every key that differs, descending
    into objects present on both sides; a missing side is ``_MISSING``."""
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
    """Where two JSON values first differ (``plan.layer_norms[3].reason``), and the two values there."""
    while True:
        if isinstance(a, dict) and isinstance(b, dict):
            key = next((k for k in sorted(a.keys() | b.keys())
                        if not (k in a and k in b and same_json(a[k], b[k]))), None)
            if key is None or key not in a or key not in b:
                return (f"{path}.{key}", a.get(key, _MISSING), b.get(key, _MISSING)) if key else (path, a, b)
            path, a, b = f"{path}.{key}", a[key], b[key]
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if not same_json(x, y))
            path, a, b = f"{path}[{i}]", a[i], b[i]
        else:
            return path, a, b


def _without_dtypes(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without its ``dtype`` and ``torch_dtype`` entries, at every level (sub-configs
    carry them too); a non-string value under that name (a token id in a vocabulary) stays."""
    config = copy.deepcopy(config)
    stack = [config]
    while stack:
        d = stack.pop()
        for key in ("dtype", "torch_dtype"):
            if key in d and (d[key] is None or isinstance(d[key], str)):
                del d[key]
        stack += [v for v in d.values() if isinstance(v, dict)]
    return config


def _config_problems(expected: dict[str, Any], actual: dict[str, Any], dtype: str | None) -> list[str]:
    """config.json against what it must be: every key as a JSON value. The enjoyln block must be
    what the confirmed plan writes, but for the writing tool's version, which nothing can check.
    With ``dtype`` the dtype entries may differ (``load_problems`` judges the dtype the model
    loads in)."""
    if dtype is not None:
        expected, actual = _without_dtypes(expected), _without_dtypes(actual)
    expected, actual = dict(expected), dict(actual)
    block, theirs = expected.pop("enjoyln", _MISSING), actual.pop("enjoyln", _MISSING)
    problems = []
    for key, a, b in _json_differences(expected, actual):
        if a is _MISSING:
            problems.append(f"config.json adds {key} = {_short(b)}")
        elif b is _MISSING:
            problems.append(f"config.json drops {key} (the reference's is {_short(a)})")
        else:
            problems.append(f"config.json changes {key} from {_short(a)} to {_short(b)}")
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
                problems.append(f"the enjoyln block's {key} is not what the confirmed plan gives: its {where} is "
                                f"{_short(y) if y is not _MISSING else 'missing'}, not "
                                f"{_short(x) if x is not _MISSING else 'absent'}")
    return problems


def _expected_config(ref: ModelDir, plan: FoldPlan, *, block: bool) -> dict[str, Any]:
    """config.json as a fold of ``ref`` by ``plan`` writes it (without the enjoyln block, as a
    fold saved by transformers has it)."""
    from ..convert import _output_config

    config = _output_config(ref, plan)
    if not block:
        del config["enjoyln"]
    return config


def load_problems(ref: ModelDir, cand: ModelDir, dtype: str | None = None) -> list[str]:
    """What makes ``from_pretrained`` load the candidate otherwise than the reference, beyond its
    files: another dtype (unless ``dtype`` names the one it is meant to load in), or an index
    it cannot read."""
    problems = []
    index = cand.path / (PT_INDEX if cand.pickled else SAFE_INDEX)
    if index.exists() and not isinstance(parse_json_file(index, "a weight index").get("metadata"), dict):
        # transformers reads index["metadata"] whatever the config says
        problems.append(f"the candidate's {index.name} has no metadata object, so from_pretrained fails on it")
    theirs, _ = load_dtype(ref)
    ours, source = load_dtype(cand)
    if dtype is None and ours != theirs:
        problems.append(f"the candidate loads in {ours} (from {source}), the reference in {theirs}; pass "
                        f"--dtype {ours} (dtype= in Python) to judge it at that precision")
    elif dtype is not None and ours != dtype:
        problems.append(f"the candidate loads in {ours} (from {source}), not in {dtype} as --dtype says")
    return problems


class _Unreadable(Exception):
    pass


class _Object(list):
    """A JSON object as its (key, value) pairs, in the file's order: a loader may iterate one
    (the added tokens of a tokenizer, BPE merges kept as an object), so two files whose objects
    hold the same pairs in another order are not proven to load the same."""


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
    except (ValueError, RecursionError):  # not JSON as loaders read it (UnicodeDecodeError is a ValueError)
        raise _Unreadable from None


def _same_content(a: Path, b: Path) -> bool:
    """Whether two files hold the same content: JSON files up to ``JSON_LIMIT`` token by token
    when both parse as transformers reads them (``loader_text``: whitespace does not matter; key
    order does, see ``_Object``), anything else byte for byte, streamed (so a byte-order mark,
    which makes a loader refuse or ignore the file, is a difference)."""
    try:
        size_a, size_b = a.stat().st_size, b.stat().st_size
        if a.suffix == ".json" and max(size_a, size_b) <= JSON_LIMIT:
            try:
                return same_json(_json_value(a), _json_value(b))
            except _Unreadable:
                pass
        if size_a != size_b:
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError as exc:
        raise CheckpointError(f"cannot read {exc.filename or b}: {exc.strerror or exc}") from None


def _file_problems(ref: ModelDir, cand: ModelDir) -> list[str]:
    """Every file of the candidate but its config and the weights it loads must be one a fold
    of the reference holds (``copy_extras``), with the reference's content, whatever its name: a
    loader may read any of them (PhoBERT's bpe.codes, a .spm, trusted remote code). Weights in
    another format (a pytorch_model.bin beside the safetensors) must be the reference's own."""
    expected = extra_files(ref)
    actual, problems = loader_files(cand.path)
    problems = [f"the candidate's {p}" for p in problems]
    index = PT_INDEX if cand.pickled else SAFE_INDEX
    # OWNER_FILE marks the temporary directory a fold checks before publishing it; no loader reads it
    own = {"config.json", OWNER_FILE, *cand.shards} | ({index} if (cand.path / index).exists() else set())
    theirs_gen, ours_gen = source_of(ref).generation(ref), source_of(cand).generation(cand)
    for key in sorted(k for k in theirs_gen.keys() | ours_gen.keys()
                      if not same_json(theirs_gen.get(k), ours_gen.get(k))):
        problems.append(f"the candidate's generation config changes {key} from {theirs_gen.get(key)!r} "
                        f"to {ours_gen.get(key)!r}")
    for rel in sorted(actual.keys() - own):
        source = expected.get(rel)
        if source is None and "/" not in rel and is_weight_file(rel) and (ref.path / rel).is_file():
            source = input_file(ref.path / rel)  # the reference's own copy, kept as it was
        if source is None:
            what = "weights a fold of the reference would not hold" if "/" not in rel and is_weight_file(rel) \
                else "a file a fold of the reference would not hold"
            problems.append(f"the candidate has {rel}, {what}")
        elif not _same_content(source, actual[rel]):
            problems.append(f"the candidate's {rel} differs from the reference's")
    for rel in sorted(expected.keys() - actual.keys()):
        problems.append(f"the candidate lacks the reference's {rel}")
    return problems


def code_problems(ref: ModelDir, cand: ModelDir) -> list[str]:
    """With remote code on either side: what makes the candidate's code other than the
    reference's. Every ``.py`` file at any depth (what ``auto_map`` names, and what those import)
    must be the reference's byte for byte, and config.json's ``auto_map`` (which class, from
    which file or repository, ``from_pretrained`` imports) the reference's value.

    The user trusted the reference's code. The candidate's is imported (to build its model, read
    its config) only once this finds nothing: code that differs could rewrite the gate itself.
    """
    if not (ref.custom_code or cand.custom_code):
        return []
    ours = {rel: p for rel, p in loader_files(ref.path)[0].items() if rel.endswith(".py")}
    theirs = {rel: p for rel, p in loader_files(cand.path)[0].items() if rel.endswith(".py")}
    problems = [f"the candidate has {rel}, code the reference does not have" for rel in sorted(theirs.keys() - ours.keys())]
    problems += [f"the candidate lacks the reference's {rel}" for rel in sorted(ours.keys() - theirs.keys())]
    problems += [f"the candidate's {rel} differs from the reference's" for rel in sorted(ours.keys() & theirs.keys())
                 if not _same_content(ours[rel], theirs[rel])]
    a, b = ref.config.get("auto_map", _MISSING), cand.config.get("auto_map", _MISSING)
    if not (a is b or a is not _MISSING and b is not _MISSING and same_json(a, b)):
        problems.append(f"config.json's auto_map is {_short(b) if b is not _MISSING else 'missing'}, "
                        f"not the reference's {_short(a) if a is not _MISSING else '(none)'}")
    return problems


def code_report(problems: list[str]) -> StaticReport:
    """The verdict on a candidate whose remote code is not the reference's: none of it was run."""
    return StaticReport(passed=False, problems=problems,
                        scope="remote code, compared before any of the candidate's code runs (none of it ran)")


def _essentials(plan: FoldPlan) -> dict[str, set]:
    r = plan.rotation
    return {"folded LayerNorms": {e.name for e in plan.foldable},
            "norm forms": {(e.name, *e.form) for e in plan.foldable if not e.plain_form},
            "centered tensors": {tuple(sorted(asdict(c).items())) for c in plan.centered},
            "untied tensors": {(u.param, u.tied_to) for u in plan.untied},
            "auxiliary centerings": {(a.module, a.where) for a in plan.auxiliary},
            "fused affines": {(e.name, e.affine, tuple(tuple(asdict(f).items()) for f in e.fused))
                              for e in plan.foldable if e.affine},
            "rotations": {(r.kind, r.seed, r.keep_mean, tuple(tuple(asdict(x).items()) for x in r.rotated))}
            if r else set()}


def _options(recorded: FoldPlan | None) -> dict[str, Any]:
    """The analysis options a recorded plan was made with."""
    if recorded is None:
        return {"auxiliary_centering": False}
    r = recorded.rotation
    return {"auxiliary_centering": bool(recorded.auxiliary),
            "fuse_affine": any(e.affine for e in recorded.layer_norms),
            "rotate": RotationSpec(r.kind, r.seed, r.keep_mean) if r else None}


def _plan_problems(recorded: FoldPlan, analysed: FoldPlan) -> list[str]:
    problems = []
    mine, theirs = _essentials(analysed), _essentials(recorded)
    for what in mine:
        extra, missing = theirs[what] - mine[what], mine[what] - theirs[what]
        if extra or missing:
            odd = sorted(map(str, extra or missing))[0]
            problems.append(f"the recorded plan is not what this enjoyln's analysis gives: its {what} "
                            f"{'include' if extra else 'lack'} {odd}; fold again with this version")
    return problems


def recorded_plan(md: ModelDir) -> FoldPlan | None:
    block = md.config.get("enjoyln")
    if block is None:
        return None
    try:
        return FoldPlan.from_dict(block["plan"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the enjoyln block in {md.path / 'config.json'} is malformed "
                              f"({type(exc).__name__}: {exc})") from None


def _names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter or persistent buffer name -> all names of the same tensor."""
    by_id: dict[int, list[str]] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for name, t in list(model.named_parameters(remove_duplicate=False)) + [
            (n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent]:
        by_id.setdefault(id(t), []).append(name)
    return {n: tuple(names) for names in by_id.values() for n in names}


def static_check(ref: ModelDir, cand: ModelDir, *, plan: FoldPlan | None = None,
                 progress: Callable[[int, int], None] | None = None, dtype: Any = None) -> StaticReport:
    """Verify, without running either model, that ``cand`` is ``ref`` with its fold plan applied.

    ``plan`` is the plan the fold used, when the caller knows it (the check
    inside ``fold_checkpoint``); otherwise the reference is analysed, and a
    plan recorded in the candidate must agree with that analysis. ``dtype``
    (``"float16"``, ``torch.bfloat16``) accepts a candidate that loads in that
    dtype instead of the reference's, its tensors stored as the reference's
    cast to it.

    >>> static_check(open_model_dir("gpt2"), open_model_dir("gpt2-folded")).passed  # doctest: +SKIP
    True
    """
    from ..convert import _analyze, moves_values
    from ..transform.tensors import merge_centerings, tie_groups
    from ..store.stream import StreamedTensors

    start = time.perf_counter()
    dtype = parse_dtype(dtype)
    if code := code_problems(ref, cand):  # before meta_model(cand) imports any of it
        return code_report(code)
    report = StaticReport(passed=False)
    problems = report.problems
    recorded = recorded_plan(cand)
    analysed = plan is not None
    ref_model, cand_model = meta_model(ref), meta_model(cand)
    check_shapes(ref, ref_model)
    check_shapes(cand, cand_model)
    if plan is None:
        try:
            plan = _analyze(ref, ref_model, **_options(recorded))
            if recorded is not None and not recorded.auxiliary and plan.to_dict() != recorded.to_dict():
                # --auxiliary-centering that placed none leaves a trace only in the plan's notes
                # and reasons, which the block must still match: the analysis with it may
                other = _analyze(ref, ref_model, **{**_options(recorded), "auxiliary_centering": True})
                plan = other if not other.auxiliary and other.to_dict() == recorded.to_dict() else plan
            report.plan, analysed = "analysis", True
        except EnjoylnError as exc:
            if recorded is not None:
                problems.append(f"cannot confirm the recorded plan: the analysis of the reference failed ({exc})")
            plan = FoldPlan(type(ref_model).__name__)
            report.plan = "none (the analysis failed)"
    if recorded is not None:
        problems += _plan_problems(recorded, plan)
        # the block must be what the fold writes for the plan this enjoyln confirms: every claim
        # in it (rotation.plain_loading_exact, the lists beside the plan) follows from that plan
        problems += _config_problems(_expected_config(ref, plan if analysed else recorded, block=True),
                                     cand.config, dtype)
        plan, report.plan = recorded, "recorded, confirmed by the analysis" if not problems else "recorded"
    else:  # judged below against the form the candidate has: the reference, or the plan applied
        as_reference = _config_problems(ref.config, cand.config, dtype)
        as_folded = (_config_problems(_expected_config(ref, plan, block=False), cand.config, dtype)
                     if plan.foldable else as_reference)
    # read before any weight, so a bad file is refused first; reported after the weights
    files = load_problems(ref, cand, dtype) + _file_problems(ref, cand)

    ref_names, cand_names = _names(ref_model), _names(cand_model)
    centerings: dict[str, list[Centering]] = {}
    for c in plan.centered:
        if c.saved:  # a non-persistent buffer is not in any checkpoint; load centers it
            centerings.setdefault(c.param, []).append(c)
    untied = {u.param for u in plan.untied}
    ref_groups = tie_groups(ref_model, untied)
    reader_ref, reader_cand = _reader(ref), _reader(cand)
    ref_keys, cand_keys = reader_ref.keys(), reader_cand.keys()
    prefix = getattr(ref_model, "base_model_prefix", "") or ""
    saved_ref, saved_cand = saved_names(ref_model), saved_names(cand_model)

    def ref_key(name: str) -> str | None:
        for alias in (name, *ref_names.get(name, ())):
            key = checkpoint_key(alias, ref_keys, prefix, saved_ref)
            if key is not None:
                return key
        return None

    def read_param(name: str) -> torch.Tensor:
        key = ref_key(name)
        if key is None:
            raise CheckpointError(f"the reference has no tensor for {name}, which the plan's centering reads")
        return reader_ref.read(key)

    # one entry per tensor the candidate's model loads: (candidate key, reference key, centerings)
    todo: dict[str, tuple[str, Centering | None, bool]] = {}
    for name, aliases in cand_names.items():
        if name != aliases[0]:
            continue  # a tied alias: the same tensor, checked once
        ck = next((k for a in aliases if (k := checkpoint_key(a, cand_keys, prefix, saved_cand))), None)
        rk = ref_key(name)
        if ck is None:
            if rk is not None:
                problems.append(f"the candidate has no tensor for {name}; loading it would initialise it at random")
            continue
        if rk is None:
            problems.append(f"the candidate's {ck} has no counterpart in the reference")
            continue
        # the reference's tied names are one tensor, centered once for all of them, even where
        # the candidate stores them apart (an untied config no longer ties BART's shared table)
        names = dict.fromkeys((*aliases, *(a for n in aliases for a in ref_groups.get(n, (n,)))))
        c = merge_centerings([x for a in names if a in centerings for x in centerings[a]]) or None
        todo[ck] = (rk, c, any(a in untied for a in aliases))
    for key in sorted(cand_keys - todo.keys()):  # stored but not loaded: must still be the reference's
        if key in ref_keys:
            todo[key] = (key, None, False)
        else:
            problems.append(f"the candidate holds {key}, which neither its model nor the reference has")
    for key in sorted(ref_keys - cand_keys - {rk for rk, _, _ in todo.values()}):
        problems.append(f"the candidate lacks the reference's tensor {key}")

    # A fused affine or a rotation computes tensors from other tensors: each is recomputed from
    # the reference tensors it depends on, by the code the fold used, when its turn comes.
    expected = (StreamedTensors(ref, plan, ref_model, reader=reader_ref) if moves_values(plan) and not problems
                else None)
    if expected is not None:
        report.form = "folded"
    total = sum(reader_cand.nbytes(k) if cand.tensors else 0 for k in todo)
    not_identical: list[str] = []
    # whatever the plan says it was tied to: a tie to anything means the head follows a centering
    not_folded = [f"the candidate still ties {u.param} to {others[0]}, so centering one changes the other"
                  for u in plan.untied if (others := [a for a in cand_names.get(u.param, ()) if a != u.param])]

    def plan_of(item: tuple[str, tuple[str, list[Centering] | None, bool]]) -> tuple[bool, bool]:
        """(read the reference, read the candidate) for one tensor."""
        ck, (rk, _, _) = item
        comparable = (_cast_allowed(reader_ref.dtype(rk), reader_cand.dtype(ck), dtype)
                      and reader_ref.shape(rk) == reader_cand.shape(ck))
        return comparable and expected is None, comparable and (expected is None or ck in expected)

    # two buffers a side: one holds the tensor being compared, the other the one read ahead
    buffers = [(Buffer(), Buffer()), (Buffer(), Buffer())]

    def load(job: tuple[int, tuple[str, tuple[str, list[Centering] | None, bool]]]):
        i, item = job
        ck, (rk, _, _) = item
        want_ref, want_cand = plan_of(item)
        into_ref, into_cand = buffers[i % 2]
        if not (want_ref and want_cand):
            return (reader_ref.read(rk, into_ref) if want_ref else None,
                    reader_cand.read(ck, into_cand) if want_cand else None)
        cand_read = side.submit(reader_cand.read, ck, into_cand)  # the two files read at once
        return reader_ref.read(rk, into_ref), cand_read.result()

    def size(job: tuple[int, tuple[str, tuple[str, list[Centering] | None, bool]]]) -> int:
        ck, (rk, _, _) = item = job[1]
        want_ref, want_cand = plan_of(item)
        return want_ref * reader_ref.nbytes(rk) + want_cand * reader_cand.nbytes(ck)

    # the candidate's files front to back, each tensor's successor read while it is compared
    order = sorted(todo.items(), key=lambda item: reader_cand.offset(item[0]))
    done = 0
    side = ThreadPoolExecutor(1, thread_name_prefix="enjoyln-read")
    try:
        for (_, (ck, (rk, c, is_untied))), (r, t) in read_ahead(enumerate(order), load, size):
            ref_dtype, cand_dtype = reader_ref.dtype(rk), reader_cand.dtype(ck)
            same_dtype = ref_dtype == cand_dtype
            shape_ok = reader_ref.shape(rk) == reader_cand.shape(ck)
            diff, recast = None, None
            if not _cast_allowed(ref_dtype, cand_dtype, dtype):
                # the reference cast to int8 or float8 compares equal to a candidate that lost
                # almost everything; loaded into the model's dtype, it would run
                recast = f"{ck} is stored as {cand_dtype}, but the reference's {rk} is {ref_dtype}"
                identical = folded = False
            elif not shape_ok:
                identical = folded = False
            elif expected is not None:
                identical = False
                e = expected.get(ck) if t is not None else None
                folded, diff = (_close(e, t, lambda: float(e.abs().max()) if e.numel() else 0.0, exact=same_dtype)
                                if t is not None else (False, None))
                report.computed += folded
                del e
            elif c is None and same_dtype:
                identical = folded = same_bytes(r, t)
            else:
                identical = recorded is None and same_bytes(r.to(cand_dtype), t)
                if c is None:
                    folded = identical or same_bytes(r.to(cand_dtype), t)
                else:
                    largest = float(r.abs().max()) if r.numel() and not same_dtype else 0.0
                    folded, diff = _close(center_as_planned(r, c, read_param), t, lambda: largest,
                                          exact=same_dtype)
            del r, t
            report.tensors += 1
            report.identical += identical and c is None
            report.centered += bool(c) and folded
            report.untied += is_untied and folded
            if not identical:
                not_identical.append(recast or f"{ck} differs from the reference's {rk}")
            if not folded:
                not_folded.append(recast or (
                    f"{ck} has shape {list(reader_cand.shape(ck))}, not {list(reader_ref.shape(rk))}"
                    if not shape_ok else
                    f"{ck} is not what the plan makes of the reference (max abs diff "
                    f"{diff if diff is not None else float('inf'):.3g})" if expected is not None else
                    f"{ck} is not {rk} centered along axis {c[0].axis} (max abs diff {diff:.3g})"
                    if c is not None else f"{ck} differs from the reference's {rk}"))
            done += reader_cand.nbytes(ck) if cand.tensors else 0
            if progress is not None:
                progress(done, total)
    finally:
        side.shutdown()
        if expected is not None:
            expected.close()
        reader_ref.close()
        reader_cand.close()
    # Without a recorded plan the candidate may be the reference itself or the
    # whole plan applied; anything in between is not proven, so it is judged
    # against whichever form it is closer to.
    if expected is None and recorded is None and (not not_identical or len(not_identical) < len(not_folded)):
        report.form = "identical"
        problems += not_identical + (as_reference if recorded is None else [])
    else:
        report.form = "folded"
        problems += not_folded + (as_folded if recorded is None else [])
    problems += files
    report.bytes_read = reader_ref.bytes_read + reader_cand.bytes_read
    report.seconds = time.perf_counter() - start
    report.passed = not problems
    return report


def _reader(md: ModelDir) -> TensorReader:
    if not md.pickled:
        return TensorReader(md)
    return TensorReader(md, {k: t for k, (_, t) in load_pickled(md).items()})


def _cast_allowed(ref: torch.dtype, cand: torch.dtype, dtype: str | None = None) -> bool:
    """The changes of dtype a candidate may make: a wider float, which is exact (the model still
    loads in its own dtype, which ``load_problems`` checks), or, when the caller names the dtype
    the candidate is meant to run in (``dtype``), a narrower float of that dtype, judged at that
    precision by the forward check's own criterion."""
    wider = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    narrower = (dtype is not None and cand == getattr(torch, dtype) and ref.is_floating_point
                and ref.itemsize > cand.itemsize and ref in (torch.float32, torch.float64))
    return ref == cand or cand in wider.get(ref, ()) or narrower

