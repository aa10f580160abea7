"""The ``enjoyln`` command line: a thin typer layer over the Python API.

Every command maps to one or two API calls; this module only parses options,
draws tables and progress, and turns errors into one line and an exit code
(0 ok, 1 check failed, 2 bad input).
"""

from __future__ import annotations

import functools
import json
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

from .errors import EnjoylnError
from .plan import FoldPlan, format_bytes

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


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Any failure becomes one line on stderr and exit code 2, never a traceback
    (unless ENJOYLN_DEBUG is set)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            _quiet()
            return fn(*args, **kwargs)
        except EnjoylnError as exc:
            err.print(f"error: {exc}", markup=False)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            err.print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), markup=False)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug or an unforeseen input: still one line, and how to see more
            if os.environ.get("ENJOYLN_DEBUG"):
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            err.print(f"error: {type(exc).__name__}: {first} (set ENJOYLN_DEBUG=1 for the traceback)",
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
    for note in plan.notes:
        out.print(f"[yellow]Note:[/] {escape(note)}")
    if not plan.foldable:
        out.print("Nothing is foldable: the output would equal the input.")


def print_report(report: Any) -> None:
    colour = "green" if report.passed else "red"
    out.print(f"[{colour}]{escape(report.summary())}[/]")


class _Bytes:
    """A byte progress bar on stderr that appears only once bytes move, so an
    early error is not preceded by the traces of an empty bar."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.bar, self.task = enabled, None, None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("writing", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def __enter__(self) -> "_Bytes":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()


# --- commands ----------------------------------------------------------------------------------


@app.command()
@friendly
def fold(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory (config.json + safetensors)."),
    out_dir: Path = typer.Argument(..., help="Where to write the folded model directory."),
    max_shard_size: Optional[str] = typer.Option(None, help="Re-shard the output, e.g. 2GB; default: like the input."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT_DIR."),
    check: bool = typer.Option(True, "--check/--no-check", help="Compare outputs after writing."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Analyse and report; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON only."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Read .bin weights (weights_only=True)."),
    auxiliary_centering: bool = typer.Option(False, "--auxiliary-centering",
                                             help="Insert explicit centerings where each frees more LNs than it costs."),
    batches: int = typer.Option(3, min=1, help="Input batches for the check."),
    seq_len: int = typer.Option(16, min=1, help="Sequence length for the check."),
) -> None:
    """Fold a model directory into OUT_DIR and check that its outputs are unchanged."""
    from .checkpoint import check_checkpoints, fold_checkpoint, parse_size

    start = time.perf_counter()
    with _Bytes(enabled=not as_json) as bar:
        result = fold_checkpoint(model_dir, out_dir, max_shard_size=parse_size(max_shard_size),
                                 force=force, allow_pickle=allow_pickle, dry_run=dry_run,
                                 auxiliary_centering=auxiliary_centering, progress=bar)
    plan = result.plan
    payload: dict[str, Any] = {"plan": plan.to_dict(), "out_dir": str(result.out_dir) if result.out_dir else None,
                               "files": result.files, "bytes_written": result.bytes_written,
                               "fold_seconds": result.seconds, "stream_seconds": result.stream_seconds}
    if not as_json:
        print_plan(plan)
        if result.out_dir:
            speed = result.bytes_written / max(result.stream_seconds, 1e-9) / 1e6
            out.print(f"Wrote {result.out_dir} ({len(result.files)} weight files, "
                      f"{format_bytes(result.bytes_written)}) in {result.seconds:.2f} s; the weights took "
                      f"{result.stream_seconds:.2f} s ({speed:.0f} MB/s)")
        elif dry_run:
            out.print("Dry run: nothing written.")
    if not dry_run and not plan.foldable:
        if as_json:
            out.print_json(json.dumps(payload))
        what = ("has no LayerNorm" if not plan.layer_norms
                else f"has {len(plan.layer_norms)} LayerNorms and none can fold")
        raise EnjoylnError(f"nothing to fold: {plan.model} {what}; nothing was written")
    report = None
    if result.out_dir and check:
        report = check_checkpoints(model_dir, result.out_dir, allow_pickle=allow_pickle,
                                   batches=batches, seq_len=seq_len)
        payload["check"] = report.to_dict()
        if not as_json:
            print_report(report)
    payload["seconds"] = time.perf_counter() - start
    if as_json:
        out.print_json(json.dumps(payload))
    if report is not None and not report.passed:
        raise typer.Exit(1)


@app.command()
@friendly
def inspect(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    graph: Optional[Path] = typer.Option(None, help="Write each LN's zero-mean graph to this .html or .svg file."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Accept a directory with .bin weights."),
    auxiliary_centering: bool = typer.Option(False, "--auxiliary-centering",
                                             help="Also place explicit centerings where they pay off."),
) -> None:
    """Analyse a model directory on the meta device: which LNs fold, and why not."""
    from .checkpoint import analyze_checkpoint

    plan = analyze_checkpoint(model_dir, allow_pickle=allow_pickle, auxiliary_centering=auxiliary_centering)
    if graph is not None:
        from .checkpoint import meta_model, open_model_dir
        from .graph_view import write_graph

        write_graph(meta_model(open_model_dir(model_dir, allow_pickle=allow_pickle)), graph)
        if plan.auxiliary:
            out.print("Note: the picture shows the strict analysis, without the auxiliary centerings")
    if as_json:
        out.print_json(plan.to_json())
    else:
        print_plan(plan)
        if graph is not None:
            out.print(f"Wrote the zero-mean graphs to {graph}")


@app.command("check")
@friendly
def check_cmd(
    reference_dir: Path = typer.Argument(..., help="The original model directory."),
    candidate_dir: Path = typer.Argument(..., help="The converted model directory."),
    batches: int = typer.Option(3, min=1, help="Seeded input batches."),
    batch_size: int = typer.Option(2, min=1, help="Rows per batch."),
    seq_len: int = typer.Option(16, min=1, help="Sequence length of token inputs."),
    seed: int = typer.Option(0, help="Seed of the first batch."),
    rtol: float = typer.Option(1e-5, help="Relative tolerance in float32."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Accept .bin weights."),
) -> None:
    """CI gate: exit 0 if CANDIDATE computes what REFERENCE does, 1 if not, 2 on bad input."""
    from .checkpoint import check_checkpoints

    report = check_checkpoints(reference_dir, candidate_dir, allow_pickle=allow_pickle, batches=batches,
                               batch_size=batch_size, seq_len=seq_len, seed=seed, rtol=rtol)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
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
    from .bench import compare_latency
    from .capture import hf_example_inputs
    from .checkpoint import analyze_checkpoint, check_checkpoints, fold_checkpoint, load
    from .testing import demo_checkpoint

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
        out.rule("3. fold")
        with _Bytes() as bar:
            result = fold_checkpoint(src, dst, force=True, progress=bar)
        out.print(f"Wrote {dst} in {result.seconds:.2f} s: {', '.join(sorted(os.listdir(dst)))}")
        out.rule("4. check")
        report = check_checkpoints(src, dst)
        print_report(report)
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

    from . import ops
    from .bench import end_to_end, kernel_benchmark

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
        from .capture import hf_example_inputs

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
        from .bench import compiled_comparison

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
        from .bench import plot_results

        plot_results(results, e2e_result, plot)
        if not as_json:
            out.print(f"Saved {plot}")
    if as_json:
        out.print_json(json.dumps(payload))


def _bench_models(model_dir: Optional[Path], device: str) -> tuple[Any, Any]:
    """(original, folded): from a directory (either kind), or a random GPT-2 small."""
    import copy

    from . import fold as fold_model
    from .checkpoint import load, open_model_dir

    if model_dir is None:
        import transformers

        from .testing import perturb

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
    opset: int = typer.Option(23, help="23+: ONNX RMSNormalization; 18-22: onnxruntime's SimplifiedLayerNormalization."),
    batch: int = typer.Option(1, min=1, help="Batch size of the traced inputs."),
    seq_len: int = typer.Option(128, min=1, help="Sequence length of the traced inputs."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Accept .bin weights."),
) -> None:
    """Export to ONNX with RMSNorm as one op, check the file and run it once in onnxruntime."""
    import copy

    from . import fold as fold_model
    from .capture import hf_example_inputs
    from .checkpoint import load, open_model_dir
    from .onnx_export import export_onnx

    if out_file.exists() and not force:
        raise EnjoylnError(f"{out_file} exists; pass --force to replace it")
    md = open_model_dir(model_dir, allow_pickle=allow_pickle)
    model = load(model_dir, allow_pickle=allow_pickle)
    if not md.config.get("enjoyln"):
        model = fold_model(copy.deepcopy(model))
    inputs = hf_example_inputs(model, batch=batch, seq_len=seq_len)
    report = export_onnx(model, out_file, inputs, opset=opset)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        out.print(f"Wrote {out_file} (opset {opset}): {report.rms_norm_nodes} RMSNorm ops, "
                  f"{report.layer_norm_nodes} LayerNormalization ops; onnx.checker passed")
        verdict = "[green]matches[/]" if report.passed else "[red]DIFFERS from[/]"
        out.print(f"onnxruntime {verdict} PyTorch: max relative difference {report.max_rel_diff:.3g}")
    if not report.passed:
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
