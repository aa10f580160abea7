"""The ``enjoyln`` command line: a thin typer layer over the Python API.

Every command maps to one or two API calls; this module only parses options,
draws tables and progress, and turns errors into one line and an exit code
(0 ok, 1 check failed, 2 bad input).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ..errors import CheckFailed, EnjoylnError, Interrupted
from ..plan import FoldPlan, format_bytes

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fold LayerNorm into RMSNorm with exactly the same outputs.")
# wide enough for the tables when piped, where rich would assume 80 columns
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _quiet() -> None:
    """Library chatter (progress bars, deprecation notes) would bury the one line that matters."""
    import logging
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)


_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def one_line(text: str) -> str:
    """``text`` with every character that could break the line or the terminal escaped: control
    characters (a newline in a path), line separators, and the undecodable bytes of a file name
    (surrogates), which no encoding can print."""

    def escape_char(m: re.Match[str]) -> str:
        c = ord(m.group())
        if 0xDC80 <= c <= 0xDCFF:  # a byte os.fsdecode could not decode
            return f"\\x{c - 0xDC00:02x}"
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(m.group()) or (
            f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")

    return _BREAKS.sub(escape_char, text)


def _tolerant_streams() -> None:
    """Text no stream can encode (a non-ASCII path on an ASCII stdout) is written escaped, not
    raised: a print after OUT_DIR is published must not turn a success into a failure."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Any failure becomes one line on stderr and exit code 2, never a traceback
    (unless ENJOYLN_DEBUG is set)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            _tolerant_streams()
            _quiet()
            return fn(*args, **kwargs)
        except EnjoylnError as exc:
            err.print(one_line(f"error: {exc}"), markup=False, emoji=False)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            err.print(one_line(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")), markup=False,
                      emoji=False)
            raise typer.Exit(2) from None
        except Interrupted as exc:
            err.print(exc.message)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:  # Ctrl-C where the command line's own handlers are not installed
            err.print("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug or an unforeseen input: still one line, and how to see more
            if os.environ.get("ENJOYLN_DEBUG"):
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            err.print(one_line(f"error: {type(exc).__name__}: {first} (set ENJOYLN_DEBUG=1 for the traceback)"),
                      markup=False)
            raise typer.Exit(2) from None

    return wrapper


# --- rendering ------------------------------------------------------------------------------


def _compact(params: list[str]) -> str:
    """'transformer.h.0.attn.c_proj.weight', ... -> 'transformer.h.*.attn.c_proj'."""
    modules = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", p.rsplit(".", 1)[0] if p.endswith(("weight", "bias")) else p)
                            for p in params)
    return f"{len(params)} tensors: " + ", ".join(modules)


def plan_table(plan: FoldPlan) -> Table:
    table = Table(title=f"{plan.model}: {len(plan.foldable)} of {len(plan.layer_norms)} LayerNorms foldable",
                  title_justify="left")
    table.add_column("LayerNorm", overflow="fold")
    table.add_column("fold")
    table.add_column("centered / reason", overflow="fold")
    for e in plan.layer_norms:
        if e.foldable:
            table.add_row(e.name, "[green]yes[/]", escape(_compact([c.param for c in e.centered])))
        else:
            table.add_row(e.name, "[red]no[/]", escape(e.reason))
    return table


def print_plan(plan: FoldPlan) -> None:
    if not plan.layer_norms:
        out.print(f"{plan.model} has no LayerNorm: nothing to fold.")
        return
    out.print(plan_table(plan))
    if plan.centered or plan.untied:
        changes = Table(title=f"Changes: center {len(plan.centered)} tensors, untie {len(plan.untied)} "
                              f"(+{format_bytes(plan.untie_bytes)})", title_justify="left")
        changes.add_column("parameter", overflow="fold")
        changes.add_column("change", overflow="fold")
        for c in plan.centered:
            changes.add_row(c.param, f"center along axis {c.axis}")
        for u in plan.untied:
            changes.add_row(u.param, f"untie from {u.tied_to}: +{format_bytes(u.nbytes)}")
        out.print(changes)
    for a in plan.auxiliary:
        out.print(f"Auxiliary centering: {a.describe()}")
    affine = [e for e in plan.foldable if e.affine]
    if affine:
        table = Table(title=f"Affine: {sum(e.weightless for e in affine)} of {len(affine)} folded norms become "
                            "weightless", title_justify="left")
        table.add_column("LayerNorm", overflow="fold")
        table.add_column("γ and β", overflow="fold")
        for e in affine:
            into = ", ".join(sorted({f.weight for f in e.fused})) or "nothing to move"
            what = {"fused": f"into {into}", "gain fused": f"γ into {into}; β stays as β/γ ({e.affine_reason})",
                    "kept": f"kept: {e.affine_reason}"}[e.affine]
            table.add_row(e.name, escape(what))
        out.print(table)
    if plan.rotation is not None:
        r = plan.rotation
        out.print(f"Rotation: {r.kind} (seed {r.seed}, {'keeps' if r.keep_mean else 'does not keep'} the mean) "
                  f"of {len(r.rotated)} tensors")
    for note in plan.notes:
        out.print(f"[yellow]Note:[/] {escape(note)}")
    if not plan.foldable:
        out.print("Nothing is foldable: the output would equal the input.")


def _strict(value: Any) -> Any:
    """``value`` as strict JSON allows: non-finite floats as the strings "inf", "-inf" and "nan"
    (JSON has no such numbers), and strings without the surrogates an undecodable file name
    leaves (no UTF-8 can carry them), its bytes written as \\xNN."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else "inf" if value > 0 else "-inf"
    if isinstance(value, str):
        return _SURROGATES.sub(lambda m: one_line(m.group()), value)
    if isinstance(value, dict):
        return {_strict(str(k)): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, Path):
        return _strict(str(value))
    return value


_SURROGATES = re.compile(r"[\ud800-\udfff]")


def print_json(value: Any) -> None:
    """Strict JSON on stdout, ASCII only, so it reads back whatever the terminal's encoding."""
    out.file.write(json.dumps(_strict(value), indent=2, ensure_ascii=True, allow_nan=False) + "\n")
    out.file.flush()


def print_report(report: Any) -> None:
    colour = "green" if report.passed else "red"
    out.print(f"[{colour}]{escape(report.summary())}[/]")


class _Bytes:
    """A byte progress bar on stderr that appears only once bytes move, so an
    early error is not preceded by the traces of an empty bar; ``phase(name)``
    gives the callback for one phase (writing, checking)."""

    def __init__(self, enabled: bool = True) -> None:
        # Off a terminal a bar shows nothing useful, and rich still ends it with a newline
        # that would land in front of an error message.
        self.enabled, self.bar, self.tasks = enabled and err.is_terminal, None, {}

    def phase(self, name: str) -> Callable[[int, int], None]:
        def update(done: int, total: int) -> None:
            if not self.enabled:
                return
            if self.bar is None:
                self.bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                    TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True)
                self.bar.start()
            if name not in self.tasks:
                self.tasks[name] = self.bar.add_task(name, total=total)
            self.bar.update(self.tasks[name], completed=done, total=total)
        return update

    def __call__(self, done: int, total: int) -> None:
        self.phase("writing")(done, total)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> "_Bytes":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# --- commands ----------------------------------------------------------------------------------

_RTOL_HELP = ("Judge the outputs with the fixed max|ref - cand| <= RTOL x max|ref| instead of the precision-aware "
              "criterion (at most 4x the original's own rounding, measured against a float64 run of it).")


@app.command()
@friendly
def fold(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory (config.json + safetensors)."),
    out_dir: Path = typer.Argument(..., help="Where to write the folded model directory."),
    max_shard_size: Optional[str] = typer.Option(None, help="Re-shard the output, e.g. 2GB; default: like the input."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it is an earlier enjoyln output."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check the fold before publishing it."),
    static: bool = typer.Option(False, "--static", help="Check every weight, but run no forward pass."),
    keep_failed: bool = typer.Option(False, "--keep-failed", help="Keep a candidate that fails its check."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Analyse and report; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON only."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Read .bin weights (weights_only=True)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="Analyse, run and keep the directory's custom model code."),
    auxiliary_centering: bool = typer.Option(False, "--auxiliary-centering",
                                             help="Insert explicit centerings where each frees more LNs than it costs."),
    fuse_affine: bool = typer.Option(False, "--fuse-affine",
                                     help="Move each folded norm's gain and bias into the layers reading it."),
    batches: int = typer.Option(3, min=1, help="Input batches for the forward check."),
    seq_len: int = typer.Option(16, min=1, help="Sequence length of the short check batches."),
    max_memory: Optional[str] = typer.Option(None, help="Run the check's models one at a time within this much "
                                                        "memory, e.g. 1GB (default: automatic)."),
    rtol: Optional[float] = typer.Option(None, min=0.0, help=_RTOL_HELP),
) -> None:
    """Fold a model directory, check the result, and publish it to OUT_DIR only if it passes."""
    _fold_command(model_dir, out_dir, max_shard_size=max_shard_size, force=force, check=check, static=static,
                  keep_failed=keep_failed, dry_run=dry_run, as_json=as_json, allow_pickle=allow_pickle,
                  trust_remote_code=trust_remote_code, auxiliary_centering=auxiliary_centering,
                  fuse_affine=fuse_affine, rotate=None, batches=batches, seq_len=seq_len, max_memory=max_memory,
                  rtol=rtol)


@app.command()
@friendly
def rotate(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory (the original, or a folded one)."),
    out_dir: Path = typer.Argument(..., help="Where to write the rotated model directory."),
    kind: str = typer.Option("hadamard", help="hadamard (randomized Hadamard, as QuaRot) or random (Haar)."),
    seed: int = typer.Option(0, help="Seed of the rotation."),
    keep_mean: bool = typer.Option(True, "--keep-mean/--no-keep-mean",
                                   help="Q fixes the all-ones vector, so plain from_pretrained stays exact."),
    max_shard_size: Optional[str] = typer.Option(None, help="Re-shard the output, e.g. 2GB; default: like the input."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it is an earlier enjoyln output."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check the result before publishing it."),
    static: bool = typer.Option(False, "--static", help="Check every weight, but run no forward pass."),
    keep_failed: bool = typer.Option(False, "--keep-failed", help="Keep a candidate that fails its check."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Analyse and report; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON only."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Read .bin weights (weights_only=True)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="Analyse, run and keep the directory's custom model code."),
    batches: int = typer.Option(3, min=1, help="Input batches for the forward check."),
    seq_len: int = typer.Option(16, min=1, help="Sequence length of the short check batches."),
    max_memory: Optional[str] = typer.Option(None, help="Run the check's models one at a time within this much "
                                                        "memory, e.g. 1GB (default: automatic)."),
    rtol: Optional[float] = typer.Option(None, min=0.0, help=_RTOL_HELP),
) -> None:
    """Fold with fused affines and rotate the residual stream by an orthogonal Q; same outputs, proved."""
    from ..analysis.rotation import KINDS

    if kind not in KINDS:
        raise EnjoylnError(f"unknown --kind {kind!r}; use {' or '.join(KINDS)}")
    _fold_command(model_dir, out_dir, max_shard_size=max_shard_size, force=force, check=check, static=static,
                  keep_failed=keep_failed, dry_run=dry_run, as_json=as_json, allow_pickle=allow_pickle,
                  trust_remote_code=trust_remote_code, auxiliary_centering=False, fuse_affine=True,
                  rotate=(kind, seed, keep_mean), batches=batches, seq_len=seq_len, max_memory=max_memory,
                  rtol=rtol)


def _fold_command(model_dir: Path, out_dir: Path, *, max_shard_size: Optional[str], force: bool, check: bool,
                  static: bool, keep_failed: bool, dry_run: bool, as_json: bool, allow_pickle: bool,
                  trust_remote_code: bool, auxiliary_centering: bool, fuse_affine: bool,
                  rotate: Optional[tuple[str, int, bool]], batches: int, seq_len: int,
                  max_memory: Optional[str], rtol: Optional[float] = None) -> None:
    from ..convert import fold_checkpoint, parse_size

    start = time.perf_counter()
    mode = "none" if not check else "static" if static else "full"
    payload: dict[str, Any] = {}
    with _Bytes(enabled=not as_json) as bar:
        try:
            result = fold_checkpoint(model_dir, out_dir, max_shard_size=parse_size(max_shard_size), force=force,
                                     allow_pickle=allow_pickle, dry_run=dry_run, check=mode,
                                     keep_failed=keep_failed, trust_remote_code=trust_remote_code,
                                     auxiliary_centering=auxiliary_centering, fuse_affine=fuse_affine,
                                     rotate=rotate, progress=bar.phase("writing"),
                                     check_options={"batches": batches, "seq_len": seq_len, "rtol": rtol,
                                                    "max_memory": parse_size(max_memory),
                                                    "progress": bar.phase("checking weights")})
        except CheckFailed as exc:
            bar.stop()
            if as_json:
                print_json({"check": exc.report.to_dict(), "out_dir": None,
                            "kept": str(exc.kept) if exc.kept else None})
            else:
                print_report(exc.report)
            raise
    plan = result.plan
    payload.update({"plan": plan.to_dict(), "out_dir": str(result.out_dir) if result.out_dir else None,
                    "files": result.files, "bytes_written": result.bytes_written,
                    "fold_seconds": result.seconds, "stream_seconds": result.stream_seconds,
                    "skipped": result.skipped, "followed": result.followed,
                    "cleaned": [str(p) for p in result.cleaned]})
    if result.report is not None:
        payload["check"] = result.report.to_dict()
    try:
        _show_fold(result, payload, mode=mode, as_json=as_json, dry_run=dry_run, start=start)
    except (OSError, UnicodeError):
        if result.out_dir is None:
            raise
        # OUT_DIR is published and checked: a closed stdout does not undo that, and the exit
        # code must say so
        _drop_stdout()


def _drop_stdout() -> None:
    """Send what is left of stdout to /dev/null, so Python's final flush raises nothing either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real descriptor (under a test runner)
        pass


def _show_fold(result: Any, payload: dict[str, Any], *, mode: str, as_json: bool, dry_run: bool,
               start: float) -> None:
    plan = result.plan
    if not as_json:
        if result.cleaned:
            out.print(f"Removed {len(result.cleaned)} temporary "
                      f"director{'y' if len(result.cleaned) == 1 else 'ies'} left by an interrupted run: "
                      + ", ".join(escape(str(p)) for p in result.cleaned))
        print_plan(plan)
        if result.skipped:
            out.print(f"[yellow]Not copied:[/] {escape('; '.join(result.skipped))}")
        if result.followed:
            out.print(f"Copied through links out of MODEL_DIR (files a model needs): "
                      f"{escape(', '.join(result.followed))}")
        if result.report is not None:
            print_report(result.report)
        if result.out_dir:
            speed = result.bytes_written / max(result.stream_seconds, 1e-9) / 1e6
            checked = {"none": "unchecked", "static": "weights checked", "full": "checked"}[mode]
            out.print(f"Wrote {escape(str(result.out_dir))} ({checked}; {len(result.files)} weight files, "
                      f"{format_bytes(result.bytes_written)}) in {result.seconds:.2f} s; moving the weights took "
                      f"{result.stream_seconds:.2f} s ({speed:.0f} MB/s)")
            if plan.rotation is not None and not plan.rotation.keep_mean:
                out.print("[yellow]Note:[/] this rotation does not keep the stream zero-mean: load it with "
                          "enjoyln.load; a plain from_pretrained runs LayerNorms and gives different outputs")
        elif dry_run:
            out.print("Dry run: nothing written.")
    if not dry_run and not plan.foldable:
        if as_json:
            print_json(payload)
        what = ("has no LayerNorm" if not plan.layer_norms
                else f"has {len(plan.layer_norms)} LayerNorms and none can fold")
        raise EnjoylnError(f"nothing to fold: {plan.model} {what}; nothing was written")
    payload["seconds"] = time.perf_counter() - start
    if as_json:
        print_json(payload)


@app.command()
@friendly
def inspect(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    graph: Optional[Path] = typer.Option(None, help="Write each LN's zero-mean graph to this .html or .svg file."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Accept a directory with .bin weights."),
    auxiliary_centering: bool = typer.Option(False, "--auxiliary-centering",
                                             help="Also place explicit centerings where they pay off."),
    fuse_affine: bool = typer.Option(False, "--fuse-affine", help="Also say where each norm's affine can move."),
    rotate: Optional[str] = typer.Option(None, help="Also say whether the stream can be rotated (hadamard or random)."),
) -> None:
    """Analyse a model directory on the meta device: which LNs fold, and why not."""
    from ..convert import analyze_checkpoint
    from ..analysis.rotation import KINDS

    if rotate is not None and rotate not in KINDS:
        raise EnjoylnError(f"unknown --rotate {rotate!r}; use {' or '.join(KINDS)}")
    plan = analyze_checkpoint(model_dir, allow_pickle=allow_pickle, auxiliary_centering=auxiliary_centering,
                              fuse_affine=fuse_affine, rotate=(rotate, 0, True) if rotate else None)
    if graph is not None:
        from ..convert import meta_model, open_model_dir
        from ..analysis.explain import write_graph

        write_graph(meta_model(open_model_dir(model_dir, allow_pickle=allow_pickle)), graph)
        if plan.auxiliary:
            out.print("Note: the picture shows the strict analysis, without the auxiliary centerings")
    if as_json:
        print_json(plan.to_dict())
    else:
        print_plan(plan)
        if graph is not None:
            out.print(f"Wrote the zero-mean graphs to {graph}")


@app.command("check")
@friendly
def check_cmd(
    reference_dir: Path = typer.Argument(..., help="The original model directory."),
    candidate_dir: Path = typer.Argument(..., help="The converted model directory."),
    static: bool = typer.Option(False, "--static", help="Check every weight only; no forward pass (any size)."),
    forward_only: bool = typer.Option(False, "--forward-only",
                                      help="Skip the weight check (for candidates made by other tools)."),
    batches: int = typer.Option(3, min=1, help="Seeded input batches (with --thorough or --forward-only, "
                                "the first covers every position)."),
    batch_size: int = typer.Option(2, min=1, help="Rows of the short batches."),
    seq_len: int = typer.Option(16, min=1, help="Sequence length of the short batches."),
    seed: int = typer.Option(0, help="Seed of the first batch."),
    thorough: bool = typer.Option(False, "--thorough", help="After the weight check, also run a batch that "
                                  "covers every position and thousands of token ids (slower)."),
    rtol: Optional[float] = typer.Option(None, min=0.0, help=_RTOL_HELP),
    dtype: Optional[str] = typer.Option(None, help="The dtype CANDIDATE is meant to load in, if not the "
                                        "reference's (float16, bfloat16, float32, float64); it is then judged "
                                        "at that precision. Without it another dtype fails."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Accept .bin weights."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run the directories' custom code."),
    max_memory: Optional[str] = typer.Option(None, help="Run the models one at a time within this much memory, "
                                                        "e.g. 1GB (default: automatic)."),
) -> None:
    """CI gate: exit 0 if CANDIDATE computes what REFERENCE does, 1 if not, 2 on bad input."""
    from ..convert import check_checkpoints, parse_size

    if static and forward_only:
        raise EnjoylnError("--static and --forward-only exclude each other")
    if static and thorough:
        raise EnjoylnError("--thorough adds to the forward comparison, which --static skips")
    mode = "static" if static else "forward" if forward_only else "full"
    with _Bytes(enabled=not as_json) as bar:
        report = check_checkpoints(reference_dir, candidate_dir, allow_pickle=allow_pickle,
                                   trust_remote_code=trust_remote_code, mode=mode,
                                   max_memory=parse_size(max_memory), dtype=dtype,
                                   progress=bar.phase("checking weights"), batches=batches,
                                   batch_size=batch_size, seq_len=seq_len, seed=seed, rtol=rtol,
                                   thorough=thorough)
    if as_json:
        print_json(report.to_dict())
    else:
        print_report(report)
    if not report.passed:
        raise typer.Exit(1)


@app.command()
@friendly
def demo(
    workdir: Optional[Path] = typer.Option(None, help="Keep the demo checkpoints here (default: a temporary directory)."),
    layers: int = typer.Option(4, min=1, help="Layers of the demo GPT-2."),
    width: int = typer.Option(256, min=1, help="Hidden size of the demo GPT-2."),
) -> None:
    """The whole flow on a small GPT-2 that enjoyln builds itself: build, inspect, fold, check, time."""
    from ..bench import compare_latency
    from ..analysis.capture import hf_example_inputs
    from ..convert import analyze_checkpoint, check_checkpoints, fold_checkpoint, load
    from ..testing import demo_checkpoint

    temp = None
    if workdir is None:
        temp = tempfile.TemporaryDirectory(prefix="enjoyln-demo-")
        workdir = Path(temp.name)
    try:
        src, dst = workdir / "gpt2-demo", workdir / "gpt2-demo-folded"
        out.rule("1. build")
        demo_checkpoint(src, layers=layers, width=width)
        out.print(f"A random GPT-2 ({layers} layers, width {width}, perturbed weights) in {src}")
        out.rule("2. inspect")
        print_plan(analyze_checkpoint(src))
        out.rule("3. fold, check and publish")
        with _Bytes() as bar:
            result = fold_checkpoint(src, dst, force=True, progress=bar.phase("writing"),
                                     check_options={"progress": bar.phase("checking weights")})
        report = result.report
        print_report(report)
        out.print(f"Wrote {dst} in {result.seconds:.2f} s: {', '.join(sorted(os.listdir(dst)))}")
        out.rule("4. check again, as a CI gate would: enjoyln check ORIGINAL FOLDED")
        print_report(check_checkpoints(src, dst))
        out.rule("5. speed (forward, batch 1, 512 tokens, median of alternating runs)")
        original, folded = load(src), load(dst)
        inputs = hf_example_inputs(original, batch=1, seq_len=512)
        timing = compare_latency(original, folded, inputs, repeats=10)
        out.print(f"original {timing.a_ms:.1f} ms, folded {timing.b_ms:.1f} ms: "
                  f"folded/original = {timing.ratio:.3f} ({timing.speedup:+.1%})")
        if not report.passed:
            raise typer.Exit(1)
    finally:
        if temp is not None:
            temp.cleanup()


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise EnjoylnError(f"cannot use --shapes {text!r}; write positive sizes such as 2048x768,4096x1024")
    return shapes  # type: ignore[return-value]


def _parse_dtypes(text: str) -> list[Any]:
    import torch

    out = []
    for name in text.split(","):
        dtype = getattr(torch, name.strip(), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise EnjoylnError(f"unknown floating dtype {name!r} in --dtypes")
        out.append(dtype)
    return out


@app.command()
@friendly
def bench(
    model_dir: Optional[Path] = typer.Argument(None, help="Model directory, original or folded (default: a random GPT-2 small)."),
    kernels: bool = typer.Option(True, "--kernels/--no-kernels", help="Time the norm kernels alone."),
    e2e: bool = typer.Option(True, "--e2e/--no-e2e", help="Time the original against the folded model."),
    shapes: str = typer.Option("2048x768,4096x1024", help="Kernel shapes, ROWSxCOLS, comma-separated."),
    dtypes: str = typer.Option("float32,bfloat16", help="Kernel dtypes, comma-separated."),
    batch: int = typer.Option(1, min=1, help="End-to-end batch size."),
    seq_len: int = typer.Option(512, min=1, help="End-to-end sequence length."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: torch's default)."),
    repeats: int = typer.Option(20, min=1, help="End-to-end forwards per model."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    plot: Optional[Path] = typer.Option(None, help="Save a PNG of the ratios (needs matplotlib)."),
    compile_: bool = typer.Option(False, "--compile", help="Also time both models under torch.compile "
                                  "(inductor, fullgraph=True), and check the compiled folded model."),
) -> None:
    """Measure enjoyln RMSNorm against native LayerNorm, alone and in a model."""
    import torch

    from .. import ops
    from ..bench import end_to_end, kernel_benchmark

    if device == "cuda" and not torch.cuda.is_available():
        raise EnjoylnError("--device cuda, but CUDA is not available")
    if threads is not None:
        torch.set_num_threads(threads)
    payload: dict[str, Any] = {"threads": torch.get_num_threads(), "backends": ops.status()}
    if not as_json:
        out.print(f"backends: {ops.status()}; {torch.get_num_threads()} threads")
    results = []
    if kernels:
        results = kernel_benchmark(_parse_shapes(shapes), _parse_dtypes(dtypes), device=device)
        payload["kernels"] = [r.to_dict() for r in results]
        if not as_json:
            table = Table(title="Norm kernels: median µs; torch = F.rms_norm + bias; copy = x.clone(), "
                                "the floor", title_justify="left")
            for col in ("shape", "dtype", "path", "LN µs", "RMS µs", "RMS/LN", "torch µs", "torch/LN",
                        "copy/LN", "LN GB/s", "RMS GB/s"):
                table.add_column(col, no_wrap=True)
            for r in results:
                table.add_row(f"{r.rows}x{r.cols}", r.dtype, r.backend, f"{r.layer_norm_us:.0f}",
                              f"{r.rms_norm_us:.0f}", f"{r.ratio:.2f}", f"{r.torch_rms_norm_us:.0f}",
                              f"{r.torch_ratio:.2f}", f"{r.copy_us / r.layer_norm_us:.2f}",
                              f"{r.gbps(r.layer_norm_us):.1f}", f"{r.gbps(r.rms_norm_us):.1f}")
            out.print(table)
    e2e_result = None
    if e2e or compile_:
        original, folded = _bench_models(model_dir, device)
        from ..analysis.capture import hf_example_inputs

        inputs = hf_example_inputs(original, batch=batch, seq_len=seq_len)
    if e2e:
        e2e_result = end_to_end(original, folded, inputs, repeats=repeats)
        payload["e2e"] = e2e_result.to_dict()
        if not as_json:
            lat = e2e_result.latency
            out.print(f"End to end ({type(original).__name__}, batch {batch}, seq {seq_len}): original "
                      f"{lat.a_ms:.1f} ms, folded {lat.b_ms:.1f} ms; folded/original {lat.ratio:.4f} "
                      f"({lat.speedup:+.2%}); {lat.tokens_per_s('a'):.0f} -> {lat.tokens_per_s('b'):.0f} tokens/s")
            out.print(f"LayerNorm share of the original (profiler): {e2e_result.layer_norm_share:.2%}; "
                      f"the fold captured {e2e_result.share_captured:.0%} of it")
            ln_ms, rms_ms, copy_ms = e2e_result.norm_ms
            out.print(f"Time inside the norms per forward: LayerNorm {ln_ms:.2f} ms, folded {rms_ms:.2f} ms, "
                      f"a bare copy in their place {copy_ms:.2f} ms (the floor: at best "
                      f"{e2e_result.best_possible_speedup:+.2%} end to end)")
    if compile_:
        from ..bench import compiled_comparison

        comp = compiled_comparison(original, folded, inputs, repeats=repeats)
        payload["compiled"] = comp.to_dict()
        if not as_json:
            lat = comp.latency
            out.print(f"Compiled (inductor, fullgraph, no graph breaks): original {lat.a_ms:.1f} ms, folded "
                      f"{lat.b_ms:.1f} ms; folded/original {lat.ratio:.4f}; compiled folded against the eager "
                      f"original: max relative difference {comp.max_rel_diff:.1e}")
            out.print(f"Generated kernels: original {comp.kernels[0]}, folded {comp.kernels[1]}; norm kernels "
                      f"{comp.norm_kernels[0]} and {comp.norm_kernels[1]}, {comp.fused_add_norms} of the folded "
                      f"ones with the residual add fused in; compile {comp.compile_s[0]:.0f} s and "
                      f"{comp.compile_s[1]:.0f} s")
    if plot is not None:
        from ..bench import plot_results

        plot_results(results, e2e_result, plot)
        if not as_json:
            out.print(f"Saved {plot}")
    if as_json:
        print_json(payload)


def _bench_models(model_dir: Optional[Path], device: str) -> tuple[Any, Any]:
    """(original, folded): from a directory (either kind), or a random GPT-2 small."""
    import copy

    from .. import fold as fold_model
    from ..convert import load, open_model_dir

    if model_dir is None:
        import transformers

        from ..testing import perturb

        original = perturb(transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval())
        folded = fold_model(copy.deepcopy(original))
    elif open_model_dir(model_dir).config.get("enjoyln"):
        import transformers

        md = open_model_dir(model_dir)
        original = getattr(transformers, md.architecture).from_pretrained(model_dir).eval()
        folded = load(model_dir)
    else:
        original = load(model_dir)
        folded = fold_model(copy.deepcopy(original))
    return original.to(device), folded.to(device)


@app.command("export")
@friendly
def export_cmd(
    model_dir: Path = typer.Argument(..., help="A model directory, folded or not (it is folded first)."),
    out_file: Path = typer.Argument(..., help="Where to write the .onnx file."),
    opset: Optional[int] = typer.Option(None, help="23+: ONNX RMSNormalization; 18-22: onnxruntime's "
                                        "SimplifiedLayerNormalization. Default 23, or 22 with --optimize."),
    optimize: bool = typer.Option(False, "--optimize", help="Run onnxruntime's transformer optimizer "
                                  "(Skip*LayerNormalization fusions), check and write its result."),
    fuse_affine: bool = typer.Option(False, "--fuse-affine", help="Fold with each norm's gain and bias moved "
                                     "into its readers: weightless RMSNorm ops with no Add after them."),
    static: bool = typer.Option(False, "--static", help="Fixed input shapes (the traced ones)."),
    batch: int = typer.Option(2, min=1, help="Batch size of the traced inputs."),
    seq_len: int = typer.Option(16, min=1, help="Sequence length of the traced inputs."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Accept .bin weights."),
) -> None:
    """Export to ONNX with RMSNorm as one op and dynamic batch and sequence axes; check the
    file and run it in onnxruntime at the traced shape and a second one."""
    from .. import fold as fold_model
    from ..analysis.capture import hf_example_inputs
    from ..convert import load, open_model_dir
    from ..export.onnx import export_onnx
    from ..checking.static import recorded_plan

    import logging

    import torch.onnx  # noqa: F401  its import resets the level _quiet gave it; the registry warns of a missing torchvision

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    if out_file.exists() and not force:
        raise EnjoylnError(f"{out_file} exists; pass --force to replace it")
    md = open_model_dir(model_dir, allow_pickle=allow_pickle)
    recorded = recorded_plan(md)
    if recorded is not None and fuse_affine and not any(e.affine for e in recorded.foldable):
        raise EnjoylnError(f"{model_dir} was folded without --fuse-affine; export it without --fuse-affine, "
                           "or fold the original with `enjoyln fold --fuse-affine`")
    model = load(model_dir, allow_pickle=allow_pickle)
    if recorded is None:
        model = fold_model(model, fuse_affine=fuse_affine)
    inputs = hf_example_inputs(model, batch=batch, seq_len=seq_len)
    report = export_onnx(model, out_file, inputs, opset=opset, optimize=optimize, dynamic=not static)
    if as_json:
        print_json(report.to_dict())
    else:
        def dims(shape: list[Any]) -> str:
            return escape("[" + ", ".join(map(str, shape)) + "]")

        bias = f" ({report.rms_bias_adds} followed by a bias Add)" if report.rms_bias_adds else ""
        out.print(f"Wrote {out_file} (opset {report.opset}): {report.rms_norm_nodes} RMSNorm ops{bias}, "
                  f"{report.layer_norm_nodes} LayerNormalization ops; onnx.checker passed")
        out.print("Inputs: " + ", ".join(f"{k} {dims(v)}" for k, v in report.inputs.items())
                  + "; outputs: " + ", ".join(f"{k} {dims(v)}" for k, v in report.outputs.items()))
        shapes = " and ".join(", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in s.items()) for s in report.shapes)
        verdict = "[green]matches[/]" if report.max_rel_diff <= 1e-4 else "[red]DIFFERS from[/]"
        out.print(f"onnxruntime {verdict} PyTorch at {shapes}: max relative difference {report.max_rel_diff:.3g}")
        if report.optimized:
            norms = ", ".join(f"{n} {report.optimized_ops[n]}" for n in sorted(report.optimized_ops)
                              if "Normalization" in n)
            verdict = "[green]matches[/]" if report.optimized_max_rel_diff <= 1e-4 else "[red]DIFFERS from[/]"
            out.print(f"Optimized (onnxruntime optimizer, model_type {report.optimizer_model_type}): {norms}; "
                      f"fused {report.skip_fused} of {report.skip_candidates} residual Add + norm pairs; "
                      f"{verdict} PyTorch: max relative difference {report.optimized_max_rel_diff:.3g}")
        for note in report.notes:
            out.print(f"[yellow]warning:[/] {escape(note)}")
    if not report.passed:
        raise typer.Exit(1)


def main() -> None:
    """Run the command line (the console script goes through ``enjoyln.__main__``)."""
    from ..__main__ import main as entry

    entry()


if __name__ == "__main__":  # pragma: no cover
    main()
