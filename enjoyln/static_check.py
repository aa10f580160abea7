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
- the candidate's config is the reference's, with the ``enjoyln`` block and
  an untied head as the only differences, and its tokenizer, processor and
  generation config are the reference's;
- the recorded plan is what this enjoyln's analysis gives for the config.

The expectations come from the plan and the model's own parameter names, not
from the code that wrote the fold, so the two check each other.
"""

from __future__ import annotations

import filecmp
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .errors import CheckpointError, EnjoylnError
from .model_dir import (DTYPES, ModelDir, TensorInfo, check_shapes, checkpoint_key, input_file, is_weight_file,
                        meta_model, needed_file, saved_names)
from .plan import Centering, FoldPlan, block_lists

_CHUNK = 16 << 20
_IGNORED_CONFIG = {"enjoyln", "transformers_version", "_name_or_path", "_commit_hash", "dtype",
                   "torch_dtype", "tie_word_embeddings", "_attn_implementation_autoset"}


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
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


class _Reader:
    """Tensors of a model directory, read one at a time."""

    def __init__(self, md: ModelDir) -> None:
        self.md = md
        self.fds: dict[str, int] = {}
        self.pickled: dict[str, torch.Tensor] | None = None
        self.bytes_read = 0
        if md.pickled:
            from .checkpoint import _load_pickled

            self.pickled = {k: t for k, (_, t) in _load_pickled(md).items()}

    def keys(self) -> set[str]:
        return set(self.pickled) if self.pickled is not None else set(self.md.tensors)

    def dtype(self, key: str) -> torch.dtype:
        return self.pickled[key].dtype if self.pickled is not None else DTYPES[self.md.tensors[key].dtype]

    def _fd(self, info: TensorInfo) -> int:
        if info.file not in self.fds:
            self.fds[info.file] = os.open(self.md.path / info.file, os.O_RDONLY)
        return self.fds[info.file]

    def tensor(self, key: str) -> torch.Tensor:
        """A fresh copy: callers center it in place."""
        if self.pickled is not None:
            return self.pickled[key].clone()
        info = self.md.tensors[key]
        data = torch.empty(info.nbytes, dtype=torch.uint8)
        view, got = memoryview(data.numpy()), 0
        while got < info.nbytes:
            n = os.preadv(self._fd(info), [view[got:]], info.start + got)
            if not n:
                raise CheckpointError(f"{self.md.path / info.file} ended early")
            got += n
        self.bytes_read += info.nbytes
        return data.view(DTYPES[info.dtype]).view(info.shape) if info.nbytes else torch.empty(
            info.shape, dtype=DTYPES[info.dtype])

    def chunks(self, key: str):
        info = self.md.tensors[key]
        for at in range(info.start, info.end, _CHUNK):
            chunk = os.pread(self._fd(info), min(_CHUNK, info.end - at), at)
            self.bytes_read += len(chunk)
            yield chunk

    def elements(self, key: str, count: int) -> Iterator[torch.Tensor]:
        """The tensor flattened, ``count`` elements at a time, never all of it in memory."""
        if self.pickled is not None:
            yield from self.pickled[key].reshape(-1).split(count)
            return
        info, dtype = self.md.tensors[key], DTYPES[self.md.tensors[key].dtype]
        step = count * dtype.itemsize
        for at in range(info.start, info.end, step):
            chunk = os.pread(self._fd(info), min(step, info.end - at), at)
            self.bytes_read += len(chunk)
            yield torch.frombuffer(bytearray(chunk), dtype=dtype)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _same_bytes(ref: _Reader, cand: _Reader, rk: str, ck: str) -> bool:
    if ref.pickled is not None or cand.pickled is not None:
        return _bitwise_equal(ref.tensor(rk), cand.tensor(ck))  # a pickled tensor may be a strided view
    if ref.md.tensors[rk].nbytes != cand.md.tensors[ck].nbytes:
        return False
    return all(a == b for a, b in zip(ref.chunks(rk), cand.chunks(ck)))


def center_as_planned(t: torch.Tensor, cs: list[Centering], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """``t`` centered in place as ``cs`` say (per-head centerings of one weight come as several),
    by the very function the fold uses (float64 arithmetic, one block at a time, so no wide copy
    of the whole tensor). ``read`` gives a LayerScale gain by parameter name."""
    from .rewrite import center_

    for c in cs:
        center_(t, c.axis, c.groups, scale=read(c.scale) if c.scale else None, blocks=c.blocks)
    return t


_ELEMENTS = 1 << 21


def _equal_to_file(expected: torch.Tensor, cand: _Reader, key: str) -> bool:
    """Bit for bit, once ``expected`` is cast to the candidate's dtype."""
    flat, at = expected.reshape(-1), 0
    for chunk in cand.elements(key, _ELEMENTS):
        if not _bitwise_equal(flat[at:at + chunk.numel()].to(chunk.dtype), chunk):
            return False
        at += chunk.numel()
    return at == flat.numel()


def _close_to_file(expected: torch.Tensor, cand: _Reader, key: str, scale: float | None = None) -> tuple[bool, float]:
    """``expected`` rounded to the candidate's dtype, element by element, read in chunks.

    At most one ulp of each element off (another tool may sum in another order,
    which can flip a rounding), plus float64 noise of the input's ``scale``. A
    bound relative to the whole tensor's maximum would let a small element move
    by many of its own ulps (in bfloat16, 3% of the maximum). A fold enjoyln
    wrote is bit-identical.
    """
    flat, at, diff = expected.reshape(-1), 0, 0.0
    if scale is None:
        scale = float(flat.abs().max()) if flat.numel() else 0.0
    for chunk in cand.elements(key, _ELEMENTS):
        e = flat[at:at + chunk.numel()]
        at += chunk.numel()
        if _bitwise_equal(e.to(chunk.dtype), chunk):
            continue
        if not chunk.is_floating_point():
            return False, math.inf
        info = torch.finfo(chunk.dtype)
        d = chunk.to(torch.float64).sub_(e.to(torch.float64)).abs_()
        bound = e.to(torch.float64).abs_().clamp_min_(info.tiny).mul_(info.eps).add_(1e-12 * scale)
        diff = max(diff, float(d.max()))
        if not bool(d.le(bound).all()):
            return False, diff
    if at != flat.numel():
        return False, math.inf
    return True, diff


def _config_problems(ref: dict[str, Any], cand: dict[str, Any], untie: bool, path: str = "") -> list[str]:
    problems = []
    for key in sorted(ref.keys() | cand.keys()):
        if key in _IGNORED_CONFIG:
            if key == "tie_word_embeddings" and ref.get(key) != cand.get(key) and not (untie and not cand.get(key)):
                problems.append(f"config.json changes {path}{key} from {ref.get(key)!r} to {cand.get(key)!r}")
            continue
        a, b = ref.get(key), cand.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            problems += _config_problems(a, b, untie, f"{path}{key}.")
        elif a != b:
            problems.append(f"config.json changes {path}{key} from {a!r} to {b!r}")
    return problems


def _serving_files(md: ModelDir) -> dict[str, Path]:
    """The files beside the weights that decide what the model is fed and how it generates."""
    return {p.name: p for p in md.path.iterdir() if needed_file(p.name) and not is_weight_file(p.name)
            and p.name not in ("config.json", "generation_config.json")
            and p.is_file()}  # as the fold copies them: through links


def _generation(md: ModelDir) -> dict[str, Any]:
    """The generation settings ``from_pretrained`` gives the model: the file's, or, without one,
    those it derives from config.json."""
    import transformers

    try:
        if (md.path / "generation_config.json").is_file():
            settings = transformers.GenerationConfig.from_pretrained(md.path).to_dict()
        else:
            config = transformers.AutoConfig.from_pretrained(md.path, trust_remote_code=md.trust_remote_code)
            settings = transformers.GenerationConfig.from_model_config(config).to_dict()
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise CheckpointError(f"cannot read the generation config of {md.path}: "
                              f"{(str(exc).splitlines() or [''])[0]}") from None
    settings.pop("transformers_version", None)
    return settings


def _json(path: Path) -> Any:
    """A JSON file's content, without the transformers version that saved it."""
    try:
        data = json.loads(input_file(path).read_bytes())
    except ValueError:
        return None  # compared as bytes instead
    return {k: v for k, v in data.items() if k != "transformers_version"} if isinstance(data, dict) else data


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.suffix == ".json" and (ja := _json(a)) is not None:
            return ja == _json(b)
        return filecmp.cmp(input_file(a), input_file(b), shallow=False)
    except OSError as exc:
        raise CheckpointError(f"cannot read {exc.filename or b}: {exc.strerror or exc}") from None


def _file_problems(ref: ModelDir, cand: ModelDir) -> list[str]:
    """The fold copies the tokenizer, processor and generation config as they are; a candidate
    whose tokenizer maps text to other ids computes something else from the same weights."""
    theirs, ours = _serving_files(ref), _serving_files(cand)
    problems = []
    theirs_gen, ours_gen = _generation(ref), _generation(cand)
    for key in sorted(k for k in theirs_gen.keys() | ours_gen.keys() if theirs_gen.get(k) != ours_gen.get(k)):
        problems.append(f"the candidate's generation config changes {key} from {theirs_gen.get(key)!r} "
                        f"to {ours_gen.get(key)!r}")
    for name in sorted(theirs.keys() | ours.keys()):
        if name not in ours:
            problems.append(f"the candidate lacks the reference's {name}")
        elif name not in theirs:
            problems.append(f"the candidate has {name}, which the reference does not")
        elif not _same_file(theirs[name], ours[name]):
            problems.append(f"the candidate's {name} differs from the reference's")
    return problems


def _loaded_config(md: ModelDir) -> dict[str, Any]:
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(md.path, trust_remote_code=md.trust_remote_code).to_dict()
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise CheckpointError(f"cannot read {md.path / 'config.json'}: {str(exc).splitlines()[0]}") from None


def _essentials(plan: FoldPlan) -> dict[str, set]:
    r = plan.rotation
    return {"folded LayerNorms": {e.name for e in plan.foldable},
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
            "rotate": (r.kind, r.seed, r.keep_mean) if r else None}


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
                 progress: Callable[[int, int], None] | None = None) -> StaticReport:
    """Verify, without running either model, that ``cand`` is ``ref`` with its fold plan applied.

    ``plan`` is the plan the fold used, when the caller knows it (the check
    inside ``fold_checkpoint``); otherwise the reference is analysed, and a
    plan recorded in the candidate must agree with that analysis.

    >>> static_check(open_model_dir("gpt2"), open_model_dir("gpt2-folded")).passed  # doctest: +SKIP
    True
    """
    from .checkpoint import _analyze, final_tensors, moves_values

    start = time.perf_counter()
    report = StaticReport(passed=False)
    problems = report.problems
    recorded = recorded_plan(cand)
    ref_model, cand_model = meta_model(ref), meta_model(cand)
    check_shapes(ref, ref_model)
    check_shapes(cand, cand_model)
    if plan is None:
        try:
            plan = _analyze(ref, ref_model, **_options(recorded))
            report.plan = "analysis"
        except EnjoylnError as exc:
            if recorded is not None:
                problems.append(f"cannot confirm the recorded plan: the analysis of the reference failed ({exc})")
            plan = FoldPlan(type(ref_model).__name__)
            report.plan = "none (the analysis failed)"
    if recorded is not None:
        problems += _plan_problems(recorded, plan)
        problems += [f"the enjoyln block's {key} list is not what its plan gives" for key, value
                     in block_lists(recorded).items() if cand.config["enjoyln"].get(key) != value]
        plan, report.plan = recorded, "recorded, confirmed by the analysis" if not problems else "recorded"
    problems += _config_problems(_loaded_config(ref), _loaded_config(cand), bool(plan.untied))
    problems += _file_problems(ref, cand)

    ref_names, cand_names = _names(ref_model), _names(cand_model)
    centerings: dict[str, list[Centering]] = {}
    for c in plan.centered:
        if c.saved:  # a non-persistent buffer is not in any checkpoint; load centers it
            centerings.setdefault(c.param, []).append(c)
    untied = {u.param for u in plan.untied}
    reader_ref, reader_cand = _Reader(ref), _Reader(cand)
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
        return reader_ref.tensor(key)

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
        c = next((centerings[a] for a in aliases if a in centerings), None)  # a list, or None
        todo[ck] = (rk, c, any(a in untied for a in aliases))
    for key in sorted(cand_keys - todo.keys()):  # stored but not loaded: must still be the reference's
        if key in ref_keys:
            todo[key] = (key, None, False)
        else:
            problems.append(f"the candidate holds {key}, which neither its model nor the reference has")
    for key in sorted(ref_keys - cand_keys - {rk for rk, _, _ in todo.values()}):
        problems.append(f"the candidate lacks the reference's tensor {key}")

    # A fused affine or a rotation computes tensors from other tensors: those are recomputed
    # from the reference in memory, by the code the fold used, and compared in chunks.
    expected = final_tensors(ref, plan, ref_model) if moves_values(plan) and not problems else None
    if expected is not None:
        report.form = "folded"
    total = sum(reader_cand.md.tensors[k].nbytes if cand.tensors else 0 for k in todo)
    not_identical: list[str] = []
    # whatever the plan says it was tied to: a tie to anything means the head follows a centering
    not_folded = [f"the candidate still ties {u.param} to {others[0]}, so centering one changes the other"
                  for u in plan.untied if (others := [a for a in cand_names.get(u.param, ()) if a != u.param])]
    done = 0
    try:
        for ck, (rk, c, is_untied) in todo.items():
            ref_dtype, cand_dtype = reader_ref.dtype(rk), reader_cand.dtype(ck)
            same_dtype = ref_dtype == cand_dtype
            shape_ok = _shape(reader_ref, rk) == _shape(reader_cand, ck)
            diff, recast = None, None
            if not _cast_allowed(ref_dtype, cand_dtype):
                # the reference cast to int8 or float8 compares equal to a candidate that lost
                # almost everything; loaded into the model's dtype, it would run
                recast = f"{ck} is stored as {cand_dtype}, but the reference's {rk} is {ref_dtype}"
                identical = folded = False
            elif not shape_ok:
                identical = folded = False
            elif expected is not None:
                identical = False
                folded, diff = _close_to_file(expected[ck], reader_cand, ck) if ck in expected else (False, None)
                report.computed += folded
            elif c is None and same_dtype:
                identical = folded = _same_bytes(reader_ref, reader_cand, rk, ck)
            else:  # one tensor in memory at a time; the candidate is read in chunks
                r = reader_ref.tensor(rk)
                identical = recorded is None and _equal_to_file(r, reader_cand, ck)
                if c is None:
                    folded = identical or _equal_to_file(r, reader_cand, ck)
                else:
                    scale = float(r.abs().max()) if r.numel() else 0.0
                    folded, diff = _close_to_file(center_as_planned(r, c, read_param), reader_cand, ck, scale)
                del r
            report.tensors += 1
            report.identical += identical and c is None
            report.centered += bool(c) and folded
            report.untied += is_untied and folded
            if not identical:
                not_identical.append(recast or f"{ck} differs from the reference's {rk}")
            if not folded:
                not_folded.append(recast or (
                    f"{ck} has shape {list(_shape(reader_cand, ck))}, not {list(_shape(reader_ref, rk))}"
                    if not shape_ok else
                    f"{ck} is not what the plan makes of the reference (max abs diff "
                    f"{diff if diff is not None else float('inf'):.3g})" if expected is not None else
                    f"{ck} is not {rk} centered along axis {c[0].axis} (max abs diff {diff:.3g})"
                    if c is not None else f"{ck} differs from the reference's {rk}"))
            done += reader_cand.md.tensors[ck].nbytes if cand.tensors else 0
            if progress is not None:
                progress(done, total)
    finally:
        reader_ref.close()
        reader_cand.close()
    # Without a recorded plan the candidate may be the reference itself or the
    # whole plan applied; anything in between is not proven, so it is judged
    # against whichever form it is closer to.
    if expected is None and recorded is None and (not not_identical or len(not_identical) < len(not_folded)):
        report.form = "identical"
        problems += not_identical
    else:
        report.form = "folded"
        problems += not_folded
    report.bytes_read = reader_ref.bytes_read + reader_cand.bytes_read
    report.seconds = time.perf_counter() - start
    report.passed = not problems
    return report


def _shape(reader: _Reader, key: str) -> tuple[int, ...]:
    return tuple(reader.pickled[key].shape) if reader.pickled is not None else reader.md.tensors[key].shape


def _cast_allowed(ref: torch.dtype, cand: torch.dtype) -> bool:
    """The changes of dtype a candidate may make: a half-precision copy of a float32 (or float64)
    reference, whose own criterion the forward check applies, or a wider float, which is exact."""
    wider = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    return (ref == cand or cand in wider.get(ref, ())
            or (ref in (torch.float32, torch.float64) and cand in (torch.float16, torch.bfloat16)))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool or a.element_size() == 0:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
