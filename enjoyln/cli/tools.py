"""The commands around the fold: ``demo``, ``bench`` and ``env``."""

from __future__ import annotations

import os
import platform
import tempfile
from types import SimpleNamespace
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.markup import escape

from .._version import __version__
from ..errors import EnjoylnError, first_line
from ..options import Access, FoldOptions
from ..units import format_duration
from .commands import IMPORTING, model_dir_of
from .options import (
    LOGGING,
    JsonOnly,
    OptionSet,
    ReadPickle,
    Revision,
    TrustCode,
    check_cuda,
    parse_device,
    parse_dtypes,
    parse_plot,
    parse_shapes,
    takes,
)
from .progress import Display
from .render import (
    err,
    out,
    print_compiled,
    print_end_to_end,
    print_json,
    print_kernels,
    print_latency,
    print_plan,
    print_report,
    say,
    state,
)


@takes(LOGGING)
def demo(
    workdir: Annotated[
        Optional[Path],
        typer.Option(
            help="Keep the demo checkpoints here (default: a temporary directory, removed at the "
            "end)."
        ),
    ] = None,
    layers: Annotated[int, typer.Option(min=1, help="Layers of the demo GPT-2.")] = 4,
    width: Annotated[int, typer.Option(min=1, help="Hidden size of the demo GPT-2.")] = 256,
    seconds: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="After 10 pairs of runs, keep timing the speed comparison until this many seconds "
            "have "
            "passed.",
        ),
    ] = 3.0,
) -> None:
    """The whole flow on a small GPT-2 that enjoyln builds itself: build, inspect, fold, check,
    time.

    Example: enjoyln demo --workdir demo
    """
    workdir, temp = _demo_workdir(workdir)
    try:
        with Display(err, enabled=not state.quiet) as display:
            display.stage(IMPORTING)
            from ..store.load import load
            from ..testing import demo_checkpoint

            src, dst = workdir / "gpt2-demo", workdir / "gpt2-demo-folded"
            display.stage("building the demo GPT-2")
            demo_checkpoint(src, layers=layers, width=width)
            display.stop()
            _rule("1. build")
            say(
                f"A random GPT-2 ({layers} layers, width {width}, perturbed weights) in "
                f"{escape(str(src))}"
            )
            passed = _demo_fold_and_check(display, src, dst, temp is not None)
            _rule("5. speed: forward, batch 1, 512 tokens, alternating runs")
            display.stage("loading both models to time them")
            timing = _demo_timing(display, load(src), load(dst), seconds)
        print_latency(timing)
        if temp is None:
            say(
                f"The checkpoints stay in {escape(str(workdir))}: gpt2-demo (the original) and "
                "gpt2-demo-folded."
            )
        if not passed:
            raise typer.Exit(1)
    finally:
        if temp is not None:
            temp.cleanup()
            say(f"Removed the temporary directory {escape(str(workdir))}.")


def _demo_workdir(workdir: Optional[Path]) -> tuple[Path, Optional[tempfile.TemporaryDirectory]]:
    """Where the demo writes: ``workdir`` if it is empty or holds an earlier demo, else a temporary
    directory (returned too, to remove at the end)."""
    if (
        workdir is not None
        and workdir.exists()
        and any(workdir.iterdir())
        and not (workdir / "gpt2-demo").is_dir()
    ):
        raise EnjoylnError(
            f"--workdir {workdir} is not empty and holds no earlier demo; choose another directory"
        )
    if workdir is not None:
        return workdir, None
    temp = tempfile.TemporaryDirectory(prefix="enjoyln-demo-")
    say(
        f"Working in the temporary directory {escape(temp.name)}, removed when the demo "
        "ends "
        "(pass --workdir DIR to keep the checkpoints)."
    )
    return Path(temp.name), temp


def _demo_fold_and_check(display: Display, src: Path, dst: Path, temporary: bool) -> bool:
    """Steps 2 to 4: inspect, fold with its check, and check again as a CI gate; whether both
    checks passed."""
    from ..checking.checkpoints import check_checkpoints
    from ..rewrite.convert import analyze_checkpoint, fold_checkpoint

    _rule("2. inspect: enjoyln inspect ORIGINAL")
    display.stage("analysing")
    plan = analyze_checkpoint(src)
    display.stop()
    print_plan(plan)
    _rule("3. fold, check and publish: enjoyln fold ORIGINAL FOLDED")
    result = fold_checkpoint(
        src,
        dst,
        FoldOptions(force=True),
        progress=display.phase("writing"),
        check_progress=display.phase("checking weights"),
        stage=display.stage,
    )
    display.stop()
    report = result.report
    print_report(report, "the folded model")
    kept = " (temporary: removed when the demo ends)" if temporary else ""
    say(
        f"Wrote {escape(str(dst))}{kept} in {result.seconds:.2f} s: "
        f"{', '.join(sorted(os.listdir(dst)))}"
    )
    _rule("4. check again, as a CI gate would: enjoyln check ORIGINAL FOLDED")
    again = check_checkpoints(
        src, dst, stage=display.stage, progress=display.phase("checking weights")
    )
    display.stop()
    print_report(again)
    return report.passed and again.passed


def _demo_timing(display: Display, original: Any, folded: Any, seconds: float) -> Any:
    """Step 5: the original against the folded model, batch 1, 512 tokens."""
    from ..analysis.inputs import hf_example_inputs
    from ..bench import compare_latency, forward_seconds, latency_seconds

    inputs = hf_example_inputs(original, batch=1, seq_len=512)
    forward_s = forward_seconds(original, inputs)  # this machine's speed, not a fixed promise
    estimate = latency_seconds(forward_s, 10, seconds)
    _estimate(display, forward_s, estimate, state.quiet)
    display.stage(
        f"timing the original against the folded model (about {format_duration(estimate)})"
    )
    timing = compare_latency(original, folded, inputs, repeats=10, seconds=seconds)
    display.stop()
    return timing


def _rule(title: str) -> None:
    if not state.quiet:
        out.rule(title)


def _kernel_run(
    kernels: Annotated[
        bool, typer.Option("--kernels/--no-kernels", help="Time the norm kernels alone.")
    ] = True,
    shapes: Annotated[
        str, typer.Option(help="Kernel shapes, ROWSxCOLS, comma-separated.")
    ] = "2048x768,4096x1024",
    dtypes: Annotated[
        str, typer.Option(help="Kernel dtypes, comma-separated.")
    ] = "float32,bfloat16",
) -> SimpleNamespace:
    return SimpleNamespace(
        on=kernels, text=shapes, shapes=parse_shapes(shapes), dtypes=parse_dtypes(dtypes)
    )


def _model_run(
    e2e: Annotated[
        bool, typer.Option("--e2e/--no-e2e", help="Time the original against the folded model.")
    ] = True,
    batch: Annotated[int, typer.Option(min=1, help="End-to-end batch size.")] = 1,
    seq_len: Annotated[int, typer.Option(min=1, help="End-to-end sequence length.")] = 512,
    repeats: Annotated[
        Optional[int], typer.Option(min=1, help="End-to-end forwards per model (default: 20).")
    ] = None,
    seconds: Annotated[
        Optional[float],
        typer.Option(
            min=0.0,
            help="Past --repeats, keep timing end to end until about this many seconds have "
            "passed, so that "
            "the spread of the runs means something (default: 5, or 0 with --repeats).",
        ),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            help="dtype of both models end to end and compiled: float32, bfloat16 or float16 "
            "(default: as loaded; "
            "the folded model is folded first, then cast)."
        ),
    ] = None,
    compile_: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Also time both models under torch.compile (inductor, fullgraph=True), and check "
            "the "
            "compiled folded model.",
        ),
    ] = False,
) -> SimpleNamespace:
    return SimpleNamespace(
        e2e=e2e,
        batch=batch,
        seq_len=seq_len,
        repeats=repeats if repeats is not None else 20,
        # --repeats alone asks for that many runs, as it always did
        seconds=seconds if seconds is not None else 0.0 if repeats is not None else 5.0,
        dtype=parse_dtypes(dtype, "--dtype")[0] if dtype is not None else None,
        compile=compile_,
    )


def _bench_access(allow_pickle: ReadPickle = False, trust_remote_code: TrustCode = False) -> Access:
    return Access(allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)


@takes(
    LOGGING,
    kernel_run=OptionSet(_kernel_run),
    model_run=OptionSet(_model_run),
    access=OptionSet(_bench_access),
)
def bench(
    model_dir: Annotated[
        Optional[str],
        typer.Argument(
            metavar="[MODEL_DIR]",
            help="Model directory (or hub id), original or folded (default: a random GPT-2 small).",
        ),
    ] = None,
    *,
    kernel_run: SimpleNamespace,
    model_run: SimpleNamespace,
    threads: Annotated[
        Optional[int],
        typer.Option(min=1, max=1024, help="torch threads (default: torch's default)."),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot: Annotated[
        Optional[Path], typer.Option(help="Save a PNG of the ratios (needs matplotlib).")
    ] = None,
    access: Access,
    revision: Revision = None,
) -> None:
    """Measure enjoyln RMSNorm against native LayerNorm, alone and in a model.

    Example: enjoyln bench --no-kernels --threads 2
    """
    device, plot = parse_device(device), parse_plot(plot)
    results, e2e_result = [], None
    with Display(err, enabled=not as_json and not state.quiet) as display:
        m = model_run
        src = (
            model_dir_of(model_dir, revision, access, display)
            if model_dir is not None and (m.e2e or m.compile)
            else None
        )
        display.stage(IMPORTING)
        import torch

        from .. import ops

        check_cuda(device)
        if threads is not None:
            torch.set_num_threads(threads)
        payload: dict[str, Any] = {"threads": torch.get_num_threads(), "backends": ops.status()}
        display.stop()
        if not as_json:
            say(f"backends: {ops.status()}; {torch.get_num_threads()} threads")
        if kernel_run.on:
            results = _phase(
                display,
                payload,
                "kernels",
                "timing the norm kernels",
                lambda: _kernel_benchmark(
                    kernel_run.shapes,
                    [getattr(torch, n) for n in kernel_run.dtypes],
                    kernel_run.text,
                    device,
                ),
                print_kernels,
                as_json,
            )
        if m.e2e or m.compile:
            e2e_result = _bench_models(display, payload, src, device, m, access, as_json)
    if plot is not None:
        _save_plot(plot, results, e2e_result, as_json)
    if as_json:
        print_json(payload)


def _bench_models(
    display: Display,
    payload: dict[str, Any],
    src: Any,
    device: str,
    m: SimpleNamespace,
    access: Access,
    as_json: bool,
) -> Any:
    """The model phases of ``bench``: load and fold, estimate, then end to end and compiled as
    asked; the end-to-end result, or None."""
    import torch

    from .. import bench as timing
    from ..bench_compiled import compiled_comparison
    from ..analysis.inputs import hf_example_inputs

    display.stage("loading and folding the model")
    cast = getattr(torch, m.dtype) if m.dtype else None
    original, folded = timing.models_to_compare(src, device, cast, access)
    inputs = hf_example_inputs(original, batch=m.batch, seq_len=m.seq_len)
    forward_s = timing.forward_seconds(original, inputs)
    _estimate(
        display,
        forward_s,
        (timing.end_to_end_seconds(forward_s, m.repeats, m.seconds) if m.e2e else 0.0)
        + (timing.latency_seconds(forward_s, m.repeats, m.seconds) if m.compile else 0.0),
        as_json,
        ", plus compiling both models" if m.compile else "",
    )
    e2e_result = None
    if m.e2e:
        e2e_result = _phase(
            display,
            payload,
            "e2e",
            f"timing end to end for at least {m.repeats} pairs of runs",
            lambda: timing.end_to_end(
                original, folded, inputs, repeats=m.repeats, seconds=m.seconds
            ),
            lambda r: print_end_to_end(r, type(original).__name__, m.batch, m.seq_len),
            as_json,
        )
    if m.compile:
        _phase(
            display,
            payload,
            "compiled",
            "compiling both models and timing them",
            lambda: compiled_comparison(
                original, folded, inputs, repeats=m.repeats, seconds=m.seconds
            ),
            print_compiled,
            as_json,
        )
    return e2e_result


def _save_plot(plot: Path, results: list[Any], e2e_result: Any, as_json: bool) -> None:
    from .. import bench as timing

    timing.plot_results(results, e2e_result, plot)
    if not as_json:
        noisy = any(r.warnings for r in results) or (
            e2e_result is not None and e2e_result.latency.warnings()
        )
        out.print(
            f"Saved {plot}" + (" (titled with a warning: the timings were noisy)" if noisy else "")
        )


def _estimate(
    display: Display, forward_s: float, total_s: float, quiet: bool, more: str = ""
) -> None:
    """How long the timings will take, from one forward measured first: said before they start."""
    display.stop()
    if not quiet:
        each = f"{forward_s:.2g}" if forward_s < 10 else f"{forward_s:.0f}"
        say(
            f"One forward takes about {each} s here, so the timings below take about "
            f"{format_duration(total_s)}"
            f"{more}"
        )


def _kernel_benchmark(
    shape_list: list[tuple[int, int]], dtypes: list[Any], shapes: str, device: str
) -> list[Any]:
    """``bench.kernel_benchmark``; out of memory, an error naming ``--shapes``."""
    from .. import bench as timing

    try:
        return timing.kernel_benchmark(shape_list, dtypes, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch's allocator says "can't allocate memory"
        if "alloc" not in str(exc).lower() and not isinstance(exc, MemoryError):
            raise
        raise EnjoylnError(
            f"not enough memory to time --shapes {shapes}: {first_line(exc)}"
        ) from None


def _phase(
    display: Display,
    payload: dict[str, Any],
    key: str,
    words: str,
    measure: Callable[[], Any],
    show: Callable[[Any], None],
    as_json: bool,
) -> Any:
    """One timing of ``bench``: ``measure`` under the stage ``words``, its dicts kept under ``key``,
    ``show`` it."""
    display.stage(words)
    result = measure()
    display.stop()
    payload[key] = [r.to_dict() for r in result] if isinstance(result, list) else result.to_dict()
    if not as_json:
        show(result)
    return result


PACKAGES = (
    "torch",
    "transformers",
    "safetensors",
    "huggingface_hub",
    "accelerate",
    "tokenizers",
    "triton",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "timm",
    "open_clip_torch",
    "numpy",
    "typer",
    "rich",
    "click",
)


@takes(LOGGING)
def env(as_json: JsonOnly = False) -> None:
    """Print what a bug report needs: versions, the RMSNorm kernels each device would run, the GPU,
    and the cache directories.

    Example: enjoyln env --json
    """
    versions = {
        "enjoyln": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    with Display(err, enabled=not as_json and not state.quiet) as display:
        display.stage(IMPORTING)
        import torch

        from .. import ops
        from ..ops.cpu import cache_dir

        display.stage("asking torch about the GPU and the kernels")
        backends, paths = ops.status(), ops.paths()
        gpus = (
            [
                {
                    "name": torch.cuda.get_device_name(i),
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                    "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 1e9, 1),
                }
                for i in range(torch.cuda.device_count())
            ]
            if torch.cuda.is_available()
            else []
        )
    info = {
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "backends": backends,
        "paths": paths,
        "gpus": gpus,
        "caches": _caches(cache_dir()),
    }
    if as_json:
        print_json(info)
        return
    sections = {
        "[bold]versions[/]": [
            f"{name}: {version or 'not installed'}" for name, version in versions.items()
        ]
        + [
            f"torch built for CUDA: {torch.version.cuda or 'no (a CPU build)'}; {info['threads']} "
            "CPU threads"
        ],
        "[bold]RMSNorm kernels[/] (what a folded model runs on each device)": [
            f"{device}: {escape(what)}" for device, what in backends.items()
        ],
        "[bold]RMSNorm paths[/] (by call)": [
            f"{device}, {escape(case)}: {escape(what)}"
            for device, cases in paths.items()
            for case, what in cases.items()
        ],
        "[bold]GPU[/]": [
            f"{g['name']} (compute capability {g['capability']}, {g['memory_gb']} GB)" for g in gpus
        ]
        or ["none"],
        "[bold]caches[/]": [
            f"{name}: {escape(str(path))}" for name, path in info["caches"].items()
        ],
    }
    for heading, lines in sections.items():
        out.print(heading)
        for line in lines:
            out.print(f"  {line}")


def _caches(enjoyln_cache: Path) -> dict[str, str]:
    home = Path(
        os.environ.get(
            "HF_HOME",
            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface",
        )
    )
    try:
        from huggingface_hub import constants

        hub = constants.HF_HUB_CACHE
    except ImportError:
        hub = os.environ.get("HF_HUB_CACHE", str(home / "hub"))
    triton = os.environ.get(
        "TRITON_CACHE_DIR",
        str(Path(os.environ.get("TRITON_HOME", Path.home())) / ".triton" / "cache"),
    )
    return {
        "huggingface hub": str(hub),
        "huggingface home": str(home),
        "triton": triton,
        "enjoyln kernels": str(enjoyln_cache),
    }
