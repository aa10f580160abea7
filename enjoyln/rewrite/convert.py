"""Fold a model directory into a new one, streamed into a temporary directory beside OUT_DIR,
checked there and published by rename: OUT_DIR never holds a partial or unchecked fold
(docs/how-it-works.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .._version import __version__
from ..analysis.norms import norm_module_paths
from ..checking.checkpoints import check_checkpoints, require_memory
from ..errors import CheckFailed, CheckpointError, EnjoylnError
from ..folded.config import output_config
from ..folded.planning import analyze_dir, missing_refusal, moves_values, refuse_inexact_source
from ..folded.stream import StreamedTensors
from ..options import FoldOptions
from ..plan import SERVED, FoldPlan, RotationSpec, check_exact, checked_seed
from ..store.checkpoint import Checkpoint, open_checkpoint
from ..store.files import check_links, copy_extras
from ..store.formats import read_safetensors_header
from ..store.locate import SAFE_INDEX
from ..store.hf import check_shapes
from ..store.quiet import quiet
from ..store.tensors import TensorReader
from ..store.transaction import (
    check_out_dir,
    clean_stale,
    keep_failed,
    missing_dirs,
    publish,
    remove_dirs,
    signals_held,
    temp_dir,
)
from ..transform.steps import check_fits
from .entries import Entry, cast_entries, fold_entries, index_metadata, reshard
from .pages import EarlyPages
from .writer import EarlyCopy, Writing, early_layout, early_spans, finish_shard, write_shard

if TYPE_CHECKING:
    from ..checking.report import CheckReport

__all__ = ["fold_checkpoint", "analyze_checkpoint", "FoldResult"]

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes total); total is 0 while the early copy runs ahead of the
analysis."""

Stage = Callable[[str], None]
"""Called with a few words naming what a long call does now ("analysing GPT2LMHeadModel")."""


@quiet
def analyze_checkpoint(
    path: str | os.PathLike,
    *,
    auxiliary_centering: bool = False,
    fuse_affine: bool = False,
    rotate: RotationSpec | tuple[str, int, bool] | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    model_class: str | None = None,
    exact_outputs: str = SERVED,
) -> FoldPlan:
    """The fold plan for a model directory, computed on the meta device; ``exact_outputs`` as for
    ``enjoyln.analyze``.

    >>> analyze_checkpoint("path/to/gpt2").summary()  # doctest: +SKIP
    """
    checkpoint = open_checkpoint(
        path,
        allow_pickle=allow_pickle,
        trust_remote_code=trust_remote_code,
        model_class=model_class,
    )
    check_shapes(checkpoint)
    refuse_inexact_source(checkpoint)
    spec = RotationSpec.of(rotate)
    if spec is not None:
        checked_seed(spec.seed)
    return analyze_dir(
        checkpoint,
        auxiliary_centering,
        fuse_affine,
        spec,
        exact_outputs=check_exact(exact_outputs),
    )


def _os_error(exc: OSError, out: Path, tmp: Path | None) -> CheckpointError:
    """One line naming OUT_DIR for anything written there, else the file itself."""
    name = Path(exc.filename) if exc.filename else None
    where = (
        out if name is None or (tmp is not None and (name == tmp or tmp in name.parents)) else name
    )
    if exc.errno == errno.ENOSPC:
        return CheckpointError(f"disk full while writing {where}; nothing was written")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"permission denied writing {where}; nothing was written")
    return CheckpointError(f"cannot write {where}: {exc.strerror or exc}; nothing was written")


def _same_load_dtype(checkpoint: Checkpoint, tmp: Path, opts: FoldOptions) -> Checkpoint:
    """The fold's postcondition: the output loads in the original's dtype, or in the one asked for.
    The output is opened as its check opens it, and handed to the check, so its config is read
    once."""
    out = open_checkpoint(tmp, **dataclasses.asdict(opts.access))
    theirs, (ours, why) = opts.dtype or checkpoint.load_dtype[0], out.load_dtype
    if ours != theirs:
        raise CheckpointError(
            f"the fold would load in {ours} (from {why}) where the original loads in {theirs}; "
            "nothing was written; set dtype in the original's config.json and run again"
        )
    return out


@dataclass
class FoldResult:
    """What ``fold_checkpoint`` did."""

    plan: FoldPlan
    out_dir: Path | None
    files: list[str]
    bytes_written: int
    seconds: float
    stream_seconds: float = 0.0
    """Time spent moving the weights, not the imports or the analysis."""
    report: "CheckReport | None" = None
    skipped: list[str] = field(default_factory=list)
    """Entries of MODEL_DIR not copied, with the reason."""
    cleaned: list[Path] = field(default_factory=list)
    """Temporary directories of killed runs for the same OUT_DIR, removed first."""
    followed: list[str] = field(default_factory=list)
    """Files copied through links that leave MODEL_DIR (``name -> target``)."""


@quiet
def fold_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    options: FoldOptions | None = None,
    *,
    progress: Progress | None = None,
    check_progress: Progress | None = None,
    stage: Stage | None = None,
) -> FoldResult:
    """Fold a Hugging Face (or timm) model directory into OUT_DIR, checked (``FoldOptions.check``: a
    full, static or no check) before it is published, else ``CheckFailed``. ``options``: a
    ``FoldOptions`` (``FoldOptions.of(check="static")``); ``progress`` hears of the bytes
    written, ``check_progress`` of the check's.
    >>> fold_checkpoint("gpt2-dir", "gpt2-folded").report.passed  # doctest: +SKIP
    True
    """
    opts = options if options is not None else FoldOptions()
    start = time.perf_counter()
    checkpoint = open_checkpoint(model_dir, **dataclasses.asdict(opts.access))
    out = _out_dir(Path(out_dir))
    _refuse_early(checkpoint, out, opts)
    fold = _Fold(checkpoint, out, opts, progress)
    say = stage or (lambda what: None)
    try:
        with fold:
            say(f"analysing {checkpoint.architecture}")
            plan = fold.plan()
            if opts.dry_run or not plan.changes:
                return FoldResult(
                    plan, None, [], 0, time.perf_counter() - start, cleaned=fold.cleaned
                )
            say("writing the folded model")
            written = fold.write(plan)
            report = fold.check(check_progress, stage)
            fold.publish()
    except OSError as exc:
        raise _os_error(exc, out, fold.tmp) from None
    return dataclasses.replace(
        written, seconds=time.perf_counter() - start, report=report, cleaned=fold.cleaned
    )


def _out_dir(out: Path) -> Path:
    """OUT_DIR resolved where a publish by rename would replace a link (its target left stale) or
    '.'/'..' has no name to put a temporary directory beside."""
    if out.is_symlink() or out.name in ("", ".."):
        try:
            return out.resolve(strict=False)
        except RuntimeError:  # a loop of links
            raise CheckpointError(
                f"OUT_DIR {out} is a symbolic link that leads back to itself"
            ) from None
    return out


def _refuse_early(checkpoint: Checkpoint, out: Path, opts: FoldOptions) -> None:
    if opts.rotate is not None:  # a new rotation's seed (a recorded one is checked as it was made)
        checked_seed(opts.rotate.seed)
    if opts.dtype is not None and checkpoint.source != "transformers":
        raise CheckpointError(
            f"{checkpoint.library.name} builds its models in {checkpoint.load_dtype[0]} whatever "
            "the file holds, "
            "so a fold stored in another dtype would not load in it; drop --dtype"
        )
    if opts.max_shard_size is not None and not checkpoint.library.shards:
        raise CheckpointError(
            f"{checkpoint.library.name} loads one weight file, model.safetensors, so this "
            "directory "
            "is not re-sharded; drop --max-shard-size"
        )
    check_out_dir(checkpoint.path, out, opts.force, dry_run=opts.dry_run)
    refuse_inexact_source(checkpoint)
    if (
        checkpoint.missing and not opts.allow_missing
    ):  # the meta model's names against the saved ones: no weight read
        raise missing_refusal(checkpoint)
    check_links(
        checkpoint
    )  # a file a loader reads, outside MODEL_DIR: refused before anything is written
    if opts.check.mode == "full" and not opts.dry_run:
        require_memory(checkpoint, opts.check.max_memory)


class _Fold:
    """One fold in progress, owning in one ``ExitStack`` everything it holds until it publishes."""

    def __init__(
        self, checkpoint: Checkpoint, out: Path, opts: FoldOptions, progress: Progress | None
    ) -> None:
        self.checkpoint, self.out, self.opts, self.progress = checkpoint, out, opts, progress
        self.tmp: Path | None = None
        self.candidate: Checkpoint | None = None  # the written output, opened
        self.early: EarlyCopy | None = None
        self.pages: EarlyPages | None = None
        self.cleaned: list[Path] = []
        self.published = False
        self._done, self._total, self._lock = 0, 0, threading.Lock()
        self._total_known = False

    def __enter__(self) -> "_Fold":
        self.stack = contextlib.ExitStack().__enter__()
        if not self.opts.dry_run:
            self.cleaned = clean_stale(self.out)
            created = missing_dirs(self.out.parent)  # removed again unless OUT_DIR is published
            self.stack.callback(lambda: None if self.published else remove_dirs(created))
        self.stack.callback(self._remove_tmp)
        self.resources = self.stack.enter_context(contextlib.ExitStack())  # released first
        self._start_early_copy()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.__exit__(*exc)

    def _remove_tmp(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _temp_dir(self) -> Path:
        if self.tmp is None:
            with signals_held():  # an interrupt must find tmp set, to clean it up
                self.tmp = temp_dir(self.out)
        return self.tmp

    def advance(self, n: int, more_total: int = 0, *, known: bool = False) -> None:
        """``n`` bytes done, ``more_total`` more to do; ``known``: the total is whole from now
        on."""
        with self._lock:
            self._done, self._total = self._done + n, self._total + more_total
            self._total_known |= known
            if self.progress is not None and (n or known):
                self.progress(self._done, max(self._total, self._done) if self._total_known else 0)

    def _start_early_copy(self) -> None:
        """Not for a plan that moves values, which rewrites nearly every tensor: its output's pages
        are made ahead instead."""
        opts = self.opts
        # nor for another dtype, in which no byte of the input is written as it is
        moving = (
            opts.fuse_affine
            or opts.rotate is not None
            or opts.dtype is not None
            or (opts.plan is not None and moves_values(opts.plan))
        )
        spans = early_spans(self.checkpoint, opts.max_shard_size) if not opts.dry_run else {}
        if spans and moving:  # its pages, then, not its bytes
            tmp = self._temp_dir()
            sizes = [(tmp / name, start + length) for name, start, length in spans.values()]
            with signals_held():  # an interrupt must find it registered, to stop it first
                self.pages = EarlyPages.start(sizes)
                if self.pages is not None:
                    self.resources.callback(self.pages.finish)
        elif spans:
            self.advance(0, sum(length for _, _, length in spans.values()))
            tmp = self._temp_dir()
            with (
                signals_held()
            ):  # an interrupt must find the copy registered, to stop it before tmp goes
                self.early = EarlyCopy(self.checkpoint, tmp, spans, self.advance)
                self.resources.callback(self.early.cancel)

    def plan(self) -> FoldPlan:
        checkpoint, opts = self.checkpoint, self.opts
        if self.early is not None and not norm_module_paths(checkpoint.meta):
            # no norm module: almost surely nothing to fold, so stop copying now
            self.early.cancel()
            self.early = None
        if opts.plan is not None:
            check_fits(checkpoint.meta, opts.plan)
        check_shapes(checkpoint)
        plan = opts.plan or analyze_dir(
            checkpoint,
            opts.auxiliary_centering,
            opts.fuse_affine,
            opts.rotate,
            must_rotate=opts.rotate is not None and not opts.dry_run,
            exact_outputs=opts.exact_outputs,
        )
        if opts.rotate is not None and plan.rotation is None and not opts.dry_run:
            why = plan.not_rotated()
            raise EnjoylnError(f"{why}; nothing was written")
        return plan

    def write(self, plan: FoldPlan) -> FoldResult:
        """Every file of the fold, in the temporary directory; then its postconditions."""
        checkpoint = self.checkpoint
        streamed = StreamedTensors(checkpoint, plan)
        self.resources.callback(streamed.close)
        entries = fold_entries(checkpoint, plan, streamed)
        if self.opts.dtype is not None:
            entries = cast_entries(checkpoint, entries, self.opts.dtype)
        shards = reshard(entries, self.opts.max_shard_size, indexed=checkpoint.index is not None)
        tmp, write_start = self._temp_dir(), time.perf_counter()
        followed: list[str] = []
        skipped = copy_extras(checkpoint, tmp, followed)
        config = output_config(checkpoint, plan, self.opts.dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self._write_shards(shards)
        seconds = time.perf_counter() - write_start
        if self.early is not None:
            self.early.cancel()
            seconds += self.early.seconds_before(write_start)
        nbytes = sum(e.nbytes for _, es in shards for e in es)
        if len(shards) > 1 or checkpoint.index is not None:
            index = {
                "metadata": {
                    **index_metadata(checkpoint, shards),
                    **({"dtype": self.opts.dtype} if self.opts.dtype else {}),
                },
                "weight_map": {e.name: name for name, es in shards for e in es},
            }
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for name, _ in shards:  # the output must read back, or it is not published
            read_safetensors_header(tmp / name)
        # even with check="none": it must load as the original does
        self.candidate = _same_load_dtype(checkpoint, tmp, self.opts)
        return FoldResult(
            plan,
            self.out,
            [name for name, _ in shards],
            nbytes,
            0.0,
            seconds,
            skipped=skipped,
            followed=followed,
        )

    def _write_shards(self, shards: list[tuple[str, list[Entry]]]) -> None:
        """Each shard finished from its early copy where its layout allows, else written afresh
        (into the pages made ahead for it, if any)."""
        made = self.pages.finish() if self.pages is not None else {}
        by_name = (
            {name: shard for shard, (name, _, _) in self.early.spans.items()}
            if self.early is not None
            else {}
        )
        layout = {
            name: early_layout(self.checkpoint, by_name.get(name), entries)
            for name, entries in shards
        }
        # the early copy counted the bytes of the tensors it put in place, centered there or not:
        # the total
        # is what the output holds, each byte once
        self.advance(
            0,
            sum(
                e.nbytes
                for name, es in shards
                for i, e in enumerate(es)
                if layout[name] is None or i >= layout[name]
            ),
            known=True,
        )
        reader = self.resources.enter_context(contextlib.closing(TensorReader(self.checkpoint)))
        w = Writing(reader, {"format": "pt", "enjoyln": __version__}, self.advance)
        for name, entries in shards:
            shard = by_name.get(name)  # set wherever layout[name] is
            finished = layout[name] is not None and finish_shard(
                self.tmp / name, entries, w, self.early, shard
            )
            if (
                shard is not None
            ):  # the whole copy: the tail behind the centering, or before a rewrite of the file
                self.early.wait(shard)
            if finished:
                continue
            if layout[name] is not None:  # the header outgrew its room: write the shard afresh
                self.advance(0, sum(e.nbytes for e in entries))
            write_shard(self.tmp / name, entries, w, made=made.get(self.tmp / name, 0))
        for path in made.keys() - {self.tmp / name for name, _ in shards}:
            path.unlink()  # made ahead for a shard the output does not have

    def check(self, progress: Progress | None, stage: Stage | None = None) -> CheckReport | None:
        """The check of the written fold; ``CheckFailed`` if it fails."""
        if self.opts.check.mode == "none":
            return None
        report = check_checkpoints(
            self.checkpoint, self.candidate, self.opts.checking, progress=progress, stage=stage
        )
        if not report.passed:
            kept = keep_failed(self.tmp, self.out) if self.opts.keep_failed else None
            self.tmp = None if kept else self.tmp
            where = (
                f"the candidate is kept in {kept}"
                if kept
                else "pass --keep-failed (keep_failed=True) to keep the candidate for inspection"
            )
            raise CheckFailed(
                f"the folded model failed its check, so {self.out} was not written; {where}",
                report,
                kept,
            )
        return report

    def publish(self) -> None:
        # the early copy and the readers first: nothing may still write into it
        self.resources.close()
        publish(self.tmp, self.out)
        self.tmp, self.published = None, True
