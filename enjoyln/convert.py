"""Fold a model directory into a new one: analyse it on the meta device, write the fold into a
temporary directory beside OUT_DIR, check it there, and publish it by rename.

The analysis runs on the meta device (no weights in memory). The fold then
streams tensor by tensor (``store.writer``): tensors that do not change are
copied byte for byte, centered ones are loaded one at a time, centered in
float64 and written back in their own dtype. Peak memory is a few of the
largest tensors (pickle weights, read only with ``--allow-pickle``, are loaded
whole).

OUT_DIR never holds a partial or unchecked fold; the input directory is only
ever read. Reading, containing and publishing directories is ``store``'s job;
the check is ``checking.checkpoints``'.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ._version import __version__
from .analysis.norms import norm_module_paths
from .checking.checkpoints import check_checkpoints, require_memory
from .errors import CheckFailed, CheckpointError, EnjoylnError
from .plan import NOT_ROTATED, FoldPlan, RotationSpec
from .store.block import output_config
from .store.expected import analyze_dir, index_metadata, moved_entries, moves_values, plan_entries, reshard
from .store.files import check_links, copy_extras
from .store.formats import SAFE_INDEX, read_safetensors_header
from .store.hf import check_shapes
from .store.checkpoint import Checkpoint, open_checkpoint
from .store.stream import StreamedTensors
from .store.tensors import Buffer, TensorReader
from .store.transaction import check_out_dir, clean_stale, keep_failed as _keep_failed, missing_dirs, publish, remove_dirs, signals_held, temp_dir
from .store.writer import EarlyCopy, early_layout, early_spans, finish_shard, write_shard
from .transform.steps import check_fits

if TYPE_CHECKING:
    from .checking.report import CheckReport

__all__ = ["fold_checkpoint", "analyze_checkpoint", "FoldResult"]

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes total) as the output is written."""

CHECK_MODES = ("full", "static", "none")
"""full: the static weight check, then a forward comparison; static: weights only; none."""


def analyze_checkpoint(path: str | os.PathLike, *, allow_pickle: bool = False,
                       auxiliary_centering: bool = False, trust_remote_code: bool = False,
                       fuse_affine: bool = False, rotate: RotationSpec | tuple[str, int, bool] | None = None,
                       model_class: str | None = None) -> FoldPlan:
    """The fold plan for a model directory, computed on the meta device.

    >>> analyze_checkpoint("path/to/gpt2").summary()  # doctest: +SKIP
    """
    ck = open_checkpoint(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, model_class=model_class)
    check_shapes(ck)
    return analyze_dir(ck, auxiliary_centering, fuse_affine, RotationSpec.of(rotate))


def _os_error(exc: OSError, out: Path, tmp: Path | None) -> CheckpointError:
    """One line naming the path at fault: OUT_DIR for anything written there, else the file itself."""
    name = Path(exc.filename) if exc.filename else None
    where = out if name is None or (tmp is not None and (name == tmp or tmp in name.parents)) else name
    if exc.errno == errno.ENOSPC:
        return CheckpointError(f"disk full while writing {where}; nothing was written")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"permission denied writing {where}; nothing was written")
    return CheckpointError(f"cannot write {where}: {exc.strerror or exc}; nothing was written")


def _same_load_dtype(ck: Checkpoint, tmp: Path) -> None:
    """The fold's postcondition on dtypes: the output loads in the dtype the original loads in."""
    out = open_checkpoint(tmp, allow_pickle=True, trust_remote_code=ck.trust_remote_code)
    theirs, (ours, why) = ck.load_dtype[0], out.load_dtype
    if ours != theirs:
        raise CheckpointError(f"the fold would load in {ours} (from {why}) where the original loads in {theirs}; "
                              "nothing was written; set dtype in the original's config.json and run again")


@dataclass
class FoldResult:
    """What ``fold_checkpoint`` did."""

    plan: FoldPlan
    out_dir: Path | None
    files: list[str]
    bytes_written: int
    seconds: float
    """Wall time of the whole fold, analysis and check included."""
    stream_seconds: float = 0.0
    """Time spent moving the weights: the copy itself, not the wait for imports or the analysis."""
    report: "CheckReport | None" = None
    """The check that ran before OUT_DIR was published (None with ``check="none"``)."""
    skipped: list[str] = field(default_factory=list)
    """Entries of MODEL_DIR not copied, with the reason (outside it, special files)."""
    cleaned: list[Path] = field(default_factory=list)
    """Temporary directories of killed runs for the same OUT_DIR, removed first."""
    followed: list[str] = field(default_factory=list)
    """Files a model directory needs, copied through links that leave MODEL_DIR (``name -> target``)."""


def fold_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                    max_shard_size: int | None = None, force: bool = False,
                    allow_pickle: bool = False, dry_run: bool = False, auxiliary_centering: bool = False,
                    plan: FoldPlan | None = None, progress: Progress | None = None,
                    check: str = "full", keep_failed: bool = False, trust_remote_code: bool = False,
                    check_options: dict[str, Any] | None = None, fuse_affine: bool = False,
                    rotate: RotationSpec | tuple[str, int, bool] | None = None,
                    model_class: str | None = None) -> FoldResult:
    """Fold a Hugging Face model directory into OUT_DIR, streaming tensor by tensor, and check it.

    OUT_DIR gets every file of MODEL_DIR (tokenizer and processor files
    included), the centered weights in their own dtypes, an explicit untied
    head, and an ``enjoyln`` block in config.json. It loads with plain
    ``from_pretrained`` (the LNs are still there and see zero-mean inputs), or
    with ``enjoyln.load`` (the LNs run as RMSNorm).

    The fold is written to a temporary directory and checked there
    (``check``: ``"full"`` proves every weight and then compares outputs,
    ``"static"`` proves the weights only, ``"none"`` skips it); only a
    candidate that passes is renamed to OUT_DIR. A failing one raises
    ``CheckFailed`` and is removed, or kept beside OUT_DIR with
    ``keep_failed``.

    With ``model_class`` the directory is folded as that transformers class (config.json of
    OUT_DIR then names it). With ``fuse_affine`` the folded norms' affines move into their readers;
    with ``rotate`` (kind, seed, keep_mean) the residual stream is rotated too
    (see ``enjoyln.rotate``). Both compute tensors from other tensors: each is
    computed from the reference tensors it depends on as the writer reaches it
    (``StreamedTensors``), so memory stays a few of the largest tensors.

    >>> fold_checkpoint("gpt2-dir", "gpt2-folded").report.passed  # doctest: +SKIP
    True
    """
    start = time.perf_counter()
    rotate = RotationSpec.of(rotate)
    src, out = Path(model_dir), Path(out_dir)
    if out.is_symlink() or out.name in ("", ".."):
        # publishing renames OUT_DIR itself: a link would be replaced by a directory (its target
        # left stale), and '.' or '..' have no name to put a temporary directory beside
        out = out.resolve()
    if check not in CHECK_MODES:
        raise EnjoylnError(f"unknown check mode {check!r}; use one of {', '.join(CHECK_MODES)}")
    ck = open_checkpoint(src, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, model_class=model_class)
    if max_shard_size is not None and not ck.library.shards:
        raise CheckpointError(f"{ck.library.name} loads one weight file, model.safetensors, so this directory "
                              "is not re-sharded; drop --max-shard-size")
    check_out_dir(src, out, force, dry_run=dry_run)
    check_links(ck)  # a file a loader reads, outside MODEL_DIR: refused before anything is written
    if check == "full" and not dry_run:
        require_memory(ck, (check_options or {}).get("max_memory"))  # say so before anything is written
    cleaned = [] if dry_run else clean_stale(out)
    created = [] if dry_run else missing_dirs(out.parent)  # removed again unless OUT_DIR is published
    done, total, lock = [0], [0], threading.Lock()

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], max(total[0], done[0]))

    tmp: Path | None = None
    early: EarlyCopy | None = None
    streamed: StreamedTensors | None = None
    reader: TensorReader | None = None
    try:
        # a plan that moves values rewrites nearly every tensor: nothing to copy ahead
        moving = fuse_affine or rotate is not None or (plan is not None and moves_values(plan))
        spans = early_spans(ck, max_shard_size) if not dry_run and not moving else {}
        if spans:  # copy while the model's code loads and the analysis runs; see EarlyCopy
            total[0] = sum(length for _, _, length in spans.values())
            with signals_held():  # an interrupt must find tmp and early set, to clean them up
                tmp = temp_dir(out)
                early = EarlyCopy(ck, tmp, spans, advance)
        model = ck.meta
        if early is not None and not norm_module_paths(model):
            early.cancel()  # no norm module: almost surely nothing to fold, so stop copying now
            early, spans = None, {}
        if plan is not None:
            check_fits(model, plan)
        check_shapes(ck)
        if plan is None:
            plan = analyze_dir(ck, auxiliary_centering, fuse_affine, rotate)
        if rotate is not None and plan.rotation is None and not dry_run:
            why = plan.note(NOT_ROTATED) or "the plan has no rotation"
            raise EnjoylnError(f"{why}; nothing was written")
        if dry_run or not plan.foldable:
            return FoldResult(plan, None, [], 0, time.perf_counter() - start, cleaned=cleaned)
        if moves_values(plan):
            streamed = StreamedTensors(ck, plan)
            entries = moved_entries(ck, streamed)
        else:
            entries = plan_entries(ck, plan)
        shards = reshard(entries, max_shard_size, indexed=ck.index is not None)
        bytes_out = sum(e.nbytes for _, es in shards for e in es)
        by_name = {name: shard for shard, (name, _, _) in spans.items()}
        layout = {name: early_layout(ck, by_name.get(name), entries) for name, entries in shards}
        with lock:  # what is left: whole shards written afresh; centered and appended tensors
            total[0] += sum(e.nbytes for name, es in shards for i, e in enumerate(es)
                            if layout[name] is None or i >= layout[name] or e.axis is not None)
        if tmp is None:
            with signals_held():
                tmp = temp_dir(out)
        write_start = time.perf_counter()
        followed: list[str] = []
        skipped = copy_extras(ck, tmp, followed)
        (tmp / "config.json").write_text(json.dumps(output_config(ck, plan), indent=2) + "\n")
        metadata = {"format": "pt", "enjoyln": __version__}
        buffer, reader = Buffer(), TensorReader(ck)
        for name, entries in shards:
            shard = by_name.get(name) if early is not None else None  # set wherever layout[name] is
            copied = (lambda upto, s=shard: early.wait(s, upto)) if shard is not None else None
            finished = layout[name] is not None and finish_shard(tmp / name, entries, reader, shard,
                                                                 spans[shard][1], metadata, advance, buffer, copied)
            if shard is not None:  # the whole copy: the tail behind the centering, or before a rewrite of the file
                early.wait(shard)
            if finished:
                continue
            if layout[name] is not None:  # the header outgrew its room: write the shard afresh
                with lock:
                    total[0] += sum(e.nbytes for e in entries)
            write_shard(tmp / name, entries, reader, metadata, advance, buffer)
        stream_seconds = time.perf_counter() - write_start
        reader.close()
        reader = None
        if streamed is not None:
            streamed.close()
            streamed = None
        if early is not None:
            early.cancel()
            stream_seconds += early.seconds_before(write_start)
        files = [name for name, _ in shards]
        if len(shards) > 1 or ck.index is not None:
            index = {"metadata": index_metadata(ck, bytes_out),
                     "weight_map": {e.name: name for name, es in shards for e in es}}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for name in files:  # the output must read back, or it is not published
            read_safetensors_header(tmp / name)
        _same_load_dtype(ck, tmp)  # even with check="none": it must load as the original does
        report = None
        if check != "none":
            report = check_checkpoints(ck, tmp, mode=check, allow_pickle=allow_pickle, model_class=model_class,
                                       trust_remote_code=trust_remote_code, **(check_options or {}))
            if not report.passed:
                kept = _keep_failed(tmp, out) if keep_failed else None
                tmp = None if kept else tmp
                where = (f"the candidate is kept in {kept}" if kept
                         else "pass --keep-failed to keep the candidate for inspection")
                raise CheckFailed(f"the folded model failed its check, so {out} was not written; {where}",
                                  report, kept)
        publish(tmp, out)
        tmp, created = None, []
    except OSError as exc:
        raise _os_error(exc, out, tmp) from None
    finally:
        if reader is not None:
            reader.close()
        if streamed is not None:
            streamed.close()
        if early is not None:
            early.cancel()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_dirs(created)
    return FoldResult(plan, out, files, bytes_out, time.perf_counter() - start, stream_seconds,
                      report=report, skipped=skipped, cleaned=cleaned, followed=followed)

