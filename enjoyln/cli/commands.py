"""The commands: each parses its options, calls the Python API, and hands the result to ``render``.

The API is imported inside each command, so that ``enjoyln --help`` and a bad
argument answer before torch loads; a module's functions are looked up when
the command runs.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import CheckFailed, EnjoylnError, first_line
from ..options import Access
from ..plan import RotationSpec
from .options import (Batches, Check, CheckMemory, DryRun, Force, JsonOnly, KeepFailed, MaxShardSize, ModelClass,
                      ReadPickle, Rtol, SeqLen, StaticCheck, TrustCode, parse_device, parse_dtypes, parse_plot,
                      parse_shapes)
from .render import (ByteProgress, drop_stdout, out, print_compiled, print_end_to_end, print_export, print_json,
                     print_kernels, print_plan, print_report, show_fold)


def fold(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (config.json + safetensors).")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the folded model directory.")],
    max_shard_size: MaxShardSize = None, force: Force = False, check: Check = True, static: StaticCheck = False,
    keep_failed: KeepFailed = False, dry_run: DryRun = False, as_json: JsonOnly = False,
    allow_pickle: ReadPickle = False, trust_remote_code: TrustCode = False,
    auxiliary_centering: Annotated[bool, typer.Option(
        "--auxiliary-centering", help="Insert explicit centerings where each frees more LNs than it costs.")] = False,
    fuse_affine: Annotated[bool, typer.Option(
        "--fuse-affine", help="Move each folded norm's gain and bias into the layers reading it.")] = False,
    batches: Batches = None, seq_len: SeqLen = 16, max_memory: CheckMemory = None, rtol: Rtol = None,
    model_class: ModelClass = None,
) -> None:
    """Fold a model directory, check the result, and publish it to OUT_DIR only if it passes."""
    options = _fold_options(max_shard_size=max_shard_size, force=force, keep_failed=keep_failed, dry_run=dry_run,
                            auxiliary_centering=auxiliary_centering, fuse_affine=fuse_affine,
                            allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, model_class=model_class,
                            check=_check_options(check, static, batches=batches, seq_len=seq_len, rtol=rtol,
                                                 max_memory=max_memory))
    _publish(model_dir, out_dir, options, as_json)


def rotate(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (the original, or a folded one).")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the rotated model directory.")],
    kind: Annotated[str, typer.Option(help="hadamard (randomized Hadamard, as QuaRot) or random (Haar).")] = "hadamard",
    seed: Annotated[int, typer.Option(help="Seed of the rotation.")] = 0,
    keep_mean: Annotated[bool, typer.Option(
        "--keep-mean/--no-keep-mean", help="Q fixes the all-ones vector, so plain from_pretrained stays exact.")] = True,
    max_shard_size: MaxShardSize = None, force: Force = False, check: Check = True, static: StaticCheck = False,
    keep_failed: KeepFailed = False, dry_run: DryRun = False, as_json: JsonOnly = False,
    allow_pickle: ReadPickle = False, trust_remote_code: TrustCode = False,
    batches: Batches = None, seq_len: SeqLen = 16, max_memory: CheckMemory = None, rtol: Rtol = None,
    model_class: ModelClass = None,
) -> None:
    """Fold with fused affines and rotate the residual stream by an orthogonal Q; same outputs, proved."""
    from ..transform.rotation import KINDS

    if kind not in KINDS:
        raise EnjoylnError(f"unknown --kind {kind!r}; use {' or '.join(KINDS)}")
    options = _fold_options(max_shard_size=max_shard_size, force=force, keep_failed=keep_failed, dry_run=dry_run,
                            fuse_affine=True, rotate=RotationSpec(kind, seed, keep_mean), allow_pickle=allow_pickle,
                            trust_remote_code=trust_remote_code, model_class=model_class,
                            check=_check_options(check, static, batches=batches, seq_len=seq_len, rtol=rtol,
                                                 max_memory=max_memory))
    _publish(model_dir, out_dir, options, as_json)


def _check_options(check: bool, static: bool, *, max_memory: Optional[str], **values: Any) -> Any:
    from ..options import CheckOptions
    from ..units import parse_size

    mode = "none" if not check else "static" if static else "full"
    return CheckOptions.of(mode=mode, max_memory=parse_size(max_memory), **values)


def _fold_options(*, max_shard_size: Optional[str], **values: Any) -> Any:
    from ..options import FoldOptions
    from ..units import parse_size

    return FoldOptions.of(max_shard_size=parse_size(max_shard_size), **values)


def _publish(model_dir: Path, out_dir: Path, options: Any, as_json: bool) -> None:
    """``fold_checkpoint`` with the options of ``fold`` or ``rotate``, and its result shown."""
    from ..rewrite import convert

    start = time.perf_counter()
    mode, dry_run = options.check.mode, options.dry_run
    with ByteProgress(enabled=not as_json) as bar:
        try:
            result = convert.fold_checkpoint(model_dir, out_dir, options, progress=bar.phase("writing"),
                                             check_progress=bar.phase("checking weights"))
        except CheckFailed as exc:
            bar.stop()
            if as_json:
                print_json({"check": exc.report.to_dict(), "out_dir": None,
                            "kept": str(exc.kept) if exc.kept else None})
            else:
                print_report(exc.report)
            raise
    payload: dict[str, Any] = {
        "plan": result.plan.to_dict(), "out_dir": str(result.out_dir) if result.out_dir else None,
        "files": result.files, "bytes_written": result.bytes_written, "fold_seconds": result.seconds,
        "stream_seconds": result.stream_seconds, "skipped": result.skipped, "followed": result.followed,
        "cleaned": [str(p) for p in result.cleaned]}
    if result.report is not None:
        payload["check"] = result.report.to_dict()
    try:
        show_fold(result, payload, mode=mode, as_json=as_json, dry_run=dry_run, start=start)
    except (OSError, UnicodeError):
        if result.out_dir is None:
            raise
        # OUT_DIR is published and checked: a closed stdout does not undo that, and the exit
        # code must say so
        drop_stdout()


def inspect(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    graph: Annotated[Optional[Path], typer.Option(
        help="Write each LN's zero-mean graph to this .html or .svg file.")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Accept a directory with .bin weights.")] = False,
    auxiliary_centering: Annotated[bool, typer.Option(
        "--auxiliary-centering", help="Also place explicit centerings where they pay off.")] = False,
    fuse_affine: Annotated[bool, typer.Option(
        "--fuse-affine", help="Also say where each norm's affine can move.")] = False,
    rotate: Annotated[Optional[str], typer.Option(
        help="Also say whether the stream can be rotated (hadamard or random).")] = None,
    model_class: ModelClass = None,
) -> None:
    """Analyse a model directory on the meta device: which LNs fold, and why not."""
    from ..rewrite.convert import analyze_checkpoint
    from ..transform.rotation import KINDS

    if rotate is not None and rotate not in KINDS:
        raise EnjoylnError(f"unknown --rotate {rotate!r}; use {' or '.join(KINDS)}")
    plan = analyze_checkpoint(model_dir, allow_pickle=allow_pickle, auxiliary_centering=auxiliary_centering,
                              fuse_affine=fuse_affine, rotate=RotationSpec(rotate) if rotate else None,
                              model_class=model_class)
    if graph is not None:
        from ..analysis.explain import write_graph
        from ..store.checkpoint import open_checkpoint

        write_graph(open_checkpoint(model_dir, allow_pickle=allow_pickle, model_class=model_class).meta, graph)
        if plan.auxiliary:
            out.print("Note: the picture shows the strict analysis, without the auxiliary centerings")
    if as_json:
        print_json(plan.to_dict())
    else:
        print_plan(plan)
        if graph is not None:
            out.print(f"Wrote the zero-mean graphs to {graph}")


def check(
    reference_dir: Annotated[Path, typer.Argument(help="The original model directory.")],
    candidate_dir: Annotated[Path, typer.Argument(help="The converted model directory.")],
    static: Annotated[bool, typer.Option(
        "--static", help="Check every weight only; no forward pass (any size).")] = False,
    forward_only: Annotated[bool, typer.Option(
        "--forward-only", help="Skip the weight check (for candidates made by other tools).")] = False,
    batches: Annotated[Optional[int], typer.Option(
        min=1, help="Seeded input batches (default: 2 short ones after the weight check; 3 with --thorough "
                    "or --forward-only, the first covering every position).")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows of the short batches.")] = 2,
    seq_len: Annotated[int, typer.Option(min=1, help="Sequence length of the short batches.")] = 16,
    seed: Annotated[int, typer.Option(min=0, max=2**62, help="Seed of the first batch.")] = 0,
    thorough: Annotated[bool, typer.Option(
        "--thorough", help="After the weight check, also run a batch that covers every position and "
                           "thousands of token ids (slower).")] = False,
    rtol: Rtol = None,
    dtype: Annotated[Optional[str], typer.Option(
        help="The dtype CANDIDATE is meant to load in, if not the reference's (float16, bfloat16, float32, "
             "float64); it is then judged at that precision. Without it another dtype fails.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Accept .bin weights.")] = False,
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Run the directories' custom code.")] = False,
    max_memory: Annotated[Optional[str], typer.Option(
        help="Run the models one at a time within this much memory, e.g. 1GB (default: automatic).")] = None,
    model_class: ModelClass = None,
) -> None:
    """CI gate: exit 0 if CANDIDATE computes what REFERENCE does, 1 if not, 2 on bad input."""
    from ..checking import checkpoints
    from ..units import parse_size

    if static and forward_only:
        raise EnjoylnError("--static and --forward-only exclude each other")
    if static and thorough:
        raise EnjoylnError("--thorough adds to the forward comparison, which --static skips")
    mode = "static" if static else "forward" if forward_only else "full"
    with ByteProgress(enabled=not as_json) as bar:
        report = checkpoints.check_checkpoints(reference_dir, candidate_dir, allow_pickle=allow_pickle,
                                               trust_remote_code=trust_remote_code, mode=mode,
                                               max_memory=parse_size(max_memory), dtype=dtype,
                                               progress=bar.phase("checking weights"), batches=batches,
                                               batch_size=batch_size, seq_len=seq_len, seed=seed, rtol=rtol,
                                               thorough=thorough, model_class=model_class)
    if as_json:
        print_json(report.to_dict())
    else:
        print_report(report)
    if not report.passed:
        raise typer.Exit(1)


def demo(
    workdir: Annotated[Optional[Path], typer.Option(
        help="Keep the demo checkpoints here (default: a temporary directory).")] = None,
    layers: Annotated[int, typer.Option(min=1, help="Layers of the demo GPT-2.")] = 4,
    width: Annotated[int, typer.Option(min=1, help="Hidden size of the demo GPT-2.")] = 256,
) -> None:
    """The whole flow on a small GPT-2 that enjoyln builds itself: build, inspect, fold, check, time."""
    from ..analysis.inputs import hf_example_inputs
    from ..bench import compare_latency
    from ..checking.checkpoints import check_checkpoints
    from ..rewrite.convert import analyze_checkpoint, fold_checkpoint
    from ..store.load import load
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
        with ByteProgress() as bar:
            result = fold_checkpoint(src, dst, force=True, progress=bar.phase("writing"),
                                     check_progress=bar.phase("checking weights"))
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


def bench(
    model_dir: Annotated[Optional[Path], typer.Argument(
        help="Model directory, original or folded (default: a random GPT-2 small).")] = None,
    kernels: Annotated[bool, typer.Option("--kernels/--no-kernels", help="Time the norm kernels alone.")] = True,
    e2e: Annotated[bool, typer.Option("--e2e/--no-e2e", help="Time the original against the folded model.")] = True,
    shapes: Annotated[str, typer.Option(help="Kernel shapes, ROWSxCOLS, comma-separated.")] = "2048x768,4096x1024",
    dtypes: Annotated[str, typer.Option(help="Kernel dtypes, comma-separated.")] = "float32,bfloat16",
    batch: Annotated[int, typer.Option(min=1, help="End-to-end batch size.")] = 1,
    seq_len: Annotated[int, typer.Option(min=1, help="End-to-end sequence length.")] = 512,
    threads: Annotated[Optional[int], typer.Option(min=1, max=1024, help="torch threads (default: torch's default).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="End-to-end forwards per model.")] = 20,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    dtype: Annotated[Optional[str], typer.Option(
        help="dtype of both models end to end and compiled: float32, bfloat16 or float16 (default: as loaded; "
             "the folded model is folded first, then cast).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Save a PNG of the ratios (needs matplotlib).")] = None,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also time both models under torch.compile (inductor, fullgraph=True), and check the "
                          "compiled folded model.")] = False,
    allow_pickle: ReadPickle = False, trust_remote_code: TrustCode = False,
) -> None:
    """Measure enjoyln RMSNorm against native LayerNorm, alone and in a model."""
    import torch

    from .. import bench as timing
    from .. import ops
    from ..analysis.inputs import hf_example_inputs

    device, plot = parse_device(device), parse_plot(plot)
    shape_list, dtype_list = parse_shapes(shapes), parse_dtypes(dtypes)
    model_dtype = parse_dtypes(dtype, "--dtype")[0] if dtype is not None else None
    if threads is not None:
        torch.set_num_threads(threads)
    payload: dict[str, Any] = {"threads": torch.get_num_threads(), "backends": ops.status()}
    if not as_json:
        out.print(f"backends: {ops.status()}; {torch.get_num_threads()} threads")
    results = []
    if kernels:
        try:
            results = timing.kernel_benchmark(shape_list, dtype_list, device=device)
        except (RuntimeError, MemoryError) as exc:  # torch's allocator says "can't allocate memory"
            if "alloc" not in str(exc).lower() and not isinstance(exc, MemoryError):
                raise
            raise EnjoylnError(f"not enough memory to time --shapes {shapes}: {first_line(exc)}") from None
        payload["kernels"] = [r.to_dict() for r in results]
        if not as_json:
            print_kernels(results)
    e2e_result = None
    if e2e or compile_:
        access = Access(allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
        original, folded = timing.models_to_compare(model_dir, device, model_dtype, access)
        inputs = hf_example_inputs(original, batch=batch, seq_len=seq_len)
    if e2e:
        e2e_result = timing.end_to_end(original, folded, inputs, repeats=repeats)
        payload["e2e"] = e2e_result.to_dict()
        if not as_json:
            print_end_to_end(e2e_result, type(original).__name__, batch, seq_len)
    if compile_:
        comp = timing.compiled_comparison(original, folded, inputs, repeats=repeats)
        payload["compiled"] = comp.to_dict()
        if not as_json:
            print_compiled(comp)
    if plot is not None:
        timing.plot_results(results, e2e_result, plot)
        if not as_json:
            out.print(f"Saved {plot}")
    if as_json:
        print_json(payload)


def export(
    model_dir: Annotated[Path, typer.Argument(help="A model directory, folded or not (it is folded first).")],
    out_file: Annotated[Path, typer.Argument(help="Where to write the .onnx file.")],
    opset: Annotated[Optional[int], typer.Option(
        help="23+: ONNX RMSNormalization; 18-22: onnxruntime's SimplifiedLayerNormalization. Default 23, or 22 "
             "with --optimize.")] = None,
    optimize: Annotated[bool, typer.Option(
        "--optimize", help="Run onnxruntime's transformer optimizer (Skip*LayerNormalization fusions), check and "
                           "write its result.")] = False,
    fuse_affine: Annotated[bool, typer.Option(
        "--fuse-affine", help="Fold with each norm's gain and bias moved into its readers: weightless RMSNorm ops "
                              "with no Add after them.")] = False,
    static: Annotated[bool, typer.Option("--static", help="Fixed input shapes (the traced ones).")] = False,
    batch: Annotated[int, typer.Option(min=1, help="Batch size of the traced inputs.")] = 2,
    seq_len: Annotated[int, typer.Option(min=1, help="Sequence length of the traced inputs.")] = 16,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    allow_pickle: ReadPickle = False, trust_remote_code: TrustCode = False, model_class: ModelClass = None,
) -> None:
    """Export to ONNX with RMSNorm as one op and dynamic batch and sequence axes; check the
    file and run it in onnxruntime at the traced shape and a second one."""
    import logging

    import torch.onnx  # noqa: F401  its import resets the level render._quiet gave it; the registry warns of a missing torchvision

    from ..export.onnx import export_checkpoint

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    if out_file.suffix != ".onnx" or out_file.is_dir():
        raise EnjoylnError(f"cannot write the ONNX model to {out_file}; name a file ending in .onnx")
    if out_file.exists() and not force:
        raise EnjoylnError(f"{out_file} exists; pass --force to replace it")
    report = export_checkpoint(model_dir, out_file, fuse_affine=fuse_affine, batch=batch, seq_len=seq_len,
                               opset=opset, optimize=optimize, dynamic=not static, allow_pickle=allow_pickle,
                               trust_remote_code=trust_remote_code, model_class=model_class)
    if as_json:
        print_json(report.to_dict())
    else:
        print_export(report, out_file)
    if not report.passed:
        raise typer.Exit(1)
