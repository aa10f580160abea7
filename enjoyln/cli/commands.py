"""The commands on model directories. Whatever can be checked without torch is checked first
(options, paths, a hub id), so bad input is refused in a fraction of a second."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from ..errors import CheckFailed, EnjoylnError
from ..options import Access, CheckOptions, FoldOptions
from ..plan import MAX_SEED, FoldPlan, RotationSpec
from ..store.locate import precheck_model_dir, resolve_model_dir
from ..store.quiet import quiet_libraries
from ..store.transaction import check_out_dir
from ..units import parse_size
from .options import (
    ACCESS,
    FOLD,
    LOGGING,
    CheckDevice,
    Exact,
    JsonOnly,
    ModelClass,
    OptionSet,
    Revision,
    Rtol,
    check_cuda,
    parse_check_dtype,
    parse_device,
    parse_dtypes,
    parse_exact,
    parse_rotation,
    takes,
)
from .progress import Display
from .render import (
    drop_stdout,
    err,
    out,
    plan_sentence,
    post_ln_note,
    print_export,
    print_json,
    print_plan,
    print_report,
    show_fold,
    state,
)

ModelDir = Annotated[
    str,
    typer.Argument(
        metavar="MODEL_DIR",
        help="Hugging Face model directory (config.json + safetensors), or a hub id such as "
        "gpt2 or org/name.",
    ),
]
IMPORTING = "loading torch and transformers"


def model_dir_of(
    spec: str, revision: Optional[str], access: Access, display: Display, role: str = "MODEL_DIR"
) -> Path:
    """The local directory a MODEL_DIR names (a path, or a hub id fetched), checked as far as it can
    be without torch.

    >>> model_dir_of("/no/such/dir", None, Access(), Display(err))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    enjoyln.errors.CheckpointError: /no/such/dir does not exist, and is not a Hugging Face hub id ...
    """  # noqa: E501
    path = Path(spec)
    if not (path.exists() or path.is_symlink()):
        display.stage(f"fetching {spec} from the Hugging Face hub (or its cache)")
    with quiet_libraries(transformers=False):  # transformers would take seconds to import
        found = resolve_model_dir(
            spec, revision=revision, allow_pickle=access.allow_pickle, role=role
        )
    return precheck_model_dir(found, allow_pickle=access.allow_pickle)


@takes(LOGGING, options=FOLD)
def fold(
    model_dir: ModelDir,
    out_dir: Annotated[
        Path, typer.Argument(metavar="OUT_DIR", help="Where to write the folded model directory.")
    ],
    auxiliary_centering: Annotated[
        bool,
        typer.Option(
            "--auxiliary-centering",
            help="Insert explicit centerings where each frees more LNs than it costs.",
        ),
    ] = False,
    fuse_affine: Annotated[
        bool,
        typer.Option(
            "--fuse-affine",
            help="Move each folded norm's gain and bias into the layers reading it.",
        ),
    ] = False,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            help="Store the fold in this dtype (float16, bfloat16, float32 or float64), each "
            "tensor rounded once "
            "from the float64 fold; the check then judges it at that precision, as check --dtype "
            "does."
        ),
    ] = None,
    exact: Exact = "served",
    *,
    options: FoldOptions,
    as_json: JsonOnly = False,
    revision: Revision = None,
) -> None:
    """Fold a model directory, check the result, and publish it to OUT_DIR only if it passes.

    Example: enjoyln fold gpt2-dir gpt2-folded
    """
    options = dataclasses.replace(
        options,
        auxiliary_centering=auxiliary_centering,
        fuse_affine=fuse_affine,
        dtype=parse_dtypes(dtype, "--dtype")[0] if dtype is not None else None,
        exact_outputs=parse_exact(exact),
    )
    _publish(model_dir, out_dir, options, as_json, revision)


@takes(LOGGING, options=FOLD)
def rotate(
    model_dir: ModelDir,
    out_dir: Annotated[
        Path, typer.Argument(metavar="OUT_DIR", help="Where to write the rotated model directory.")
    ],
    kind: Annotated[
        str, typer.Option(help="hadamard (randomized Hadamard, as QuaRot) or random (Haar).")
    ] = "hadamard",
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the rotation.")] = 0,
    keep_mean: Annotated[
        bool,
        typer.Option(
            "--keep-mean/--no-keep-mean",
            help="Q fixes the all-ones vector, so plain from_pretrained stays exact.",
        ),
    ] = True,
    exact: Exact = "served",
    *,
    options: FoldOptions,
    as_json: JsonOnly = False,
    revision: Revision = None,
) -> None:
    """Fold with fused affines and rotate each residual stream (a vision tower's too) by an
    orthogonal Q; same outputs, proved.

    Example: enjoyln rotate gpt2-dir gpt2-rotated --kind hadamard
    """
    parse_rotation(kind, "--kind")
    options = dataclasses.replace(
        options,
        fuse_affine=True,
        rotate=RotationSpec(kind, seed, keep_mean, exact_outputs=parse_exact(exact)),
        exact_outputs=exact,
    )
    _publish(model_dir, out_dir, options, as_json, revision)


def _publish(
    spec: str, out_dir: Path, options: FoldOptions, as_json: bool, revision: Optional[str]
) -> None:
    start = time.perf_counter()
    with Display(err, enabled=not as_json and not state.quiet) as display:
        src = model_dir_of(spec, revision, options.access, display)
        check_out_dir(src, out_dir, options.force, dry_run=options.dry_run)
        display.stage(IMPORTING)
        from ..rewrite import convert

        check_cuda(options.check.device)
        try:
            result = convert.fold_checkpoint(
                src,
                out_dir,
                options,
                progress=display.phase("writing"),
                check_progress=display.phase("checking weights"),
                stage=display.stage,
            )
        except CheckFailed as exc:
            display.stop()
            exc.payload = {
                "verdict": exc.report.verdict("the folded model"),  # type: ignore[attr-defined]
                "check": exc.report.to_dict(),
                "out_dir": None,
                "kept": str(exc.kept) if exc.kept else None,
            }
            if not as_json:
                print_report(exc.report, "the folded model")
            raise
    payload: dict[str, Any] = {
        "verdict": result.report.verdict("the folded model") if result.report is not None else None,
        "exit_code": 0,
        "plan": result.plan.to_dict(),
        "out_dir": str(result.out_dir) if result.out_dir else None,
        "files": result.files,
        "bytes_written": result.bytes_written,
        "fold_seconds": result.seconds,
        "stream_seconds": result.stream_seconds,
        "skipped": result.skipped,
        "followed": result.followed,
        "cleaned": [str(p) for p in result.cleaned],
    }
    if result.report is not None:
        payload["check"] = result.report.to_dict()
    payload["seconds"] = time.perf_counter() - start
    try:
        show_fold(
            result, payload, mode=options.check.mode, as_json=as_json, dry_run=options.dry_run
        )
    except (OSError, UnicodeError):
        if result.out_dir is None:
            raise
        # OUT_DIR is published and checked: a closed stdout does not undo that, nor must the exit
        # code
        drop_stdout()


@takes(LOGGING)
def inspect(
    model_dir: ModelDir,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    graph: Annotated[
        Optional[Path],
        typer.Option(help="Write each LN's zero-mean graph to this .html or .svg file."),
    ] = None,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept a directory with .bin weights.")
    ] = False,
    auxiliary_centering: Annotated[
        bool,
        typer.Option(
            "--auxiliary-centering", help="Also place explicit centerings where they pay off."
        ),
    ] = False,
    fuse_affine: Annotated[
        bool, typer.Option("--fuse-affine", help="Also say where each norm's affine can move.")
    ] = False,
    rotate: Annotated[
        Optional[str],
        typer.Option(help="Also say whether the stream can be rotated (hadamard or random)."),
    ] = None,
    exact: Exact = "served",
    model_class: ModelClass = None,
    revision: Revision = None,
) -> None:
    """Analyse a model directory on the meta device: which LNs fold, and why not.

    Example: enjoyln inspect gpt2-dir --json
    """
    parse_rotation(rotate, "--rotate")
    parse_exact(exact)
    if graph is not None and graph.suffix.lower() not in (".html", ".htm", ".svg"):
        raise EnjoylnError(f"--graph must end in .html or .svg, not {graph.suffix or 'nothing'}")
    access = Access(allow_pickle=allow_pickle, model_class=model_class)
    with Display(err, enabled=not as_json and not state.quiet) as display:
        src = model_dir_of(model_dir, revision, access, display)
        display.stage(IMPORTING)
        from ..rewrite.convert import analyze_checkpoint

        display.stage("analysing the model on the meta device")
        plan = analyze_checkpoint(
            src,
            allow_pickle=allow_pickle,
            auxiliary_centering=auxiliary_centering,
            fuse_affine=fuse_affine,
            rotate=RotationSpec(rotate, exact_outputs=exact) if rotate else None,
            model_class=model_class,
            exact_outputs=exact,
        )
        if graph is not None:
            display.stage(f"drawing the zero-mean graphs into {graph}")
            _draw_graphs(src, access, graph)
    if as_json:
        print_json(_plan_payload(plan))
        return
    if state.quiet:  # the plan in one sentence is inspect's verdict
        out.print(escape(plan_sentence(plan)))
    else:
        print_plan(plan)
    if graph is not None:
        if plan.auxiliary:
            out.print(
                "Note: the picture shows the strict analysis, without the auxiliary centerings"
            )
        out.print(f"Wrote the zero-mean graphs to {graph}")


def _draw_graphs(src: str, access: Access, graph: Path) -> None:
    """Each LN's zero-mean graph of the directory's meta model, into ``graph``."""
    from ..analysis.explain import write_graph
    from ..store.checkpoint import open_checkpoint

    with quiet_libraries():
        meta = open_checkpoint(
            src, allow_pickle=access.allow_pickle, model_class=access.model_class
        ).meta
        write_graph(meta, graph)


def _plan_payload(plan: FoldPlan) -> dict[str, Any]:
    """inspect's JSON: the counts and the sentence first; then the plan, which reads back with
    FoldPlan.from_dict, and the centered parameters beside its untied ones, both lists."""
    return {
        "foldable": len(plan.foldable),
        "total": len(plan.layer_norms),
        "not_foldable": len(plan.layer_norms) - len(plan.foldable),
        "n_centered": len(plan.centered),
        "n_untied": len(plan.untied),
        "untie_bytes": plan.untie_bytes,
        "n_auxiliary": len(plan.auxiliary),
        "summary": plan_sentence(plan),
        "post_ln": post_ln_note(plan),
        "centered": [c.to_dict() for c in plan.centered],
        **plan.to_dict(),
    }


def _check_access(
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept .bin weights.")
    ] = False,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Run the directories' custom code.")
    ] = False,
    model_class: ModelClass = None,
) -> Access:
    return Access(
        allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, model_class=model_class
    )


@takes(access=OptionSet(_check_access))
def _check_options(
    access: Access,
    batches: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="Seeded input batches (default: 2 short ones after the weight check; 3 with "
            "--thorough "
            "or --forward-only, the first covering every position).",
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows of the short batches.")] = 2,
    seq_len: Annotated[int, typer.Option(min=1, help="Sequence length of the short batches.")] = 16,
    seed: Annotated[int, typer.Option(min=0, max=2**62, help="Seed of the first batch.")] = 0,
    sweep_tokens: Annotated[
        Optional[int],
        typer.Option(
            min=0,
            help="With --forward-only: the most token ids the token sweep runs beyond the other "
            "batches' "
            "(default: 8192; 0: none).",
        ),
    ] = None,
    rtol: Rtol = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            help="The dtype CANDIDATE is meant to load in, if not the reference's (float16, "
            "bfloat16, float32, "
            "float64); it is then judged at that precision. Without it another dtype fails."
        ),
    ] = None,
    max_memory: Annotated[
        Optional[str],
        typer.Option(
            help="Run the models one at a time within this much memory, e.g. 1GB (default: "
            "automatic)."
        ),
    ] = None,
    device: CheckDevice = "cpu",
) -> CheckOptions:
    return CheckOptions(
        max_memory=parse_size(max_memory),
        dtype=parse_check_dtype(dtype),
        device=parse_device(device),
        batches=batches,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        rtol=rtol,
        sweep_tokens=sweep_tokens,
        access=access,
    )


@takes(LOGGING, options=OptionSet(_check_options))
def check(
    reference_dir: Annotated[
        str, typer.Argument(metavar="REFERENCE", help="The original model directory (or hub id).")
    ],
    candidate_dir: Annotated[
        str, typer.Argument(metavar="CANDIDATE", help="The converted model directory (or hub id).")
    ],
    static: Annotated[
        bool, typer.Option("--static", help="Check every weight only; no forward pass (any size).")
    ] = False,
    forward_only: Annotated[
        bool,
        typer.Option(
            "--forward-only", help="Skip the weight check (for candidates made by other tools)."
        ),
    ] = False,
    thorough: Annotated[
        bool,
        typer.Option(
            "--thorough",
            help="After the weight check, also run a batch that covers every position and "
            "thousands of token ids (slower).",
        ),
    ] = False,
    *,
    options: CheckOptions,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    revision: Annotated[
        Optional[str],
        typer.Option(
            help="The revision (branch, tag or commit) of a REFERENCE given as a Hugging Face hub "
            "id."
        ),
    ] = None,
) -> None:
    """CI gate: exit 0 if CANDIDATE computes what REFERENCE does, 1 if not, 2 on bad input.

    Example: enjoyln check gpt2-dir gpt2-folded --json > check.json
    """
    if static and forward_only:
        raise EnjoylnError("--static and --forward-only exclude each other")
    if static and thorough:
        raise EnjoylnError("--thorough adds to the forward comparison, which --static skips")
    if options.sweep_tokens is not None and not forward_only:
        raise EnjoylnError("--sweep-tokens sets the token sweep, which only --forward-only runs")
    mode = "static" if static else "forward" if forward_only else "full"
    options = dataclasses.replace(options, mode=mode, thorough=thorough)
    with Display(err, enabled=not as_json and not state.quiet) as display:
        reference = model_dir_of(reference_dir, revision, options.access, display, role="REFERENCE")
        candidate = model_dir_of(candidate_dir, None, options.access, display, role="CANDIDATE")
        display.stage(IMPORTING)
        from ..checking import checkpoints

        check_cuda(options.device)
        report = checkpoints.check_checkpoints(
            reference,
            candidate,
            options,
            progress=display.phase("checking weights"),
            stage=display.stage,
        )
    if as_json:
        print_json(
            {
                "verdict": report.verdict(),
                "exit_code": 0 if report.passed else 1,
                **report.to_dict(),
            }
        )
    else:
        print_report(report)
    if not report.passed:
        raise typer.Exit(1)


def _traced(
    static: Annotated[
        bool, typer.Option("--static", help="Fixed input shapes (the traced ones).")
    ] = False,
    batch: Annotated[int, typer.Option(min=1, help="Batch size of the traced inputs.")] = 2,
    seq_len: Annotated[int, typer.Option(min=1, help="Sequence length of the traced inputs.")] = 16,
) -> dict[str, Any]:
    """The inputs an export traces, as ``export_checkpoint`` takes them."""
    return {"dynamic": not static, "batch": batch, "seq_len": seq_len}


@takes(LOGGING, access=ACCESS, traced=OptionSet(_traced))
def export(
    model_dir: ModelDir,
    out_file: Annotated[
        Path, typer.Argument(metavar="OUT_FILE", help="Where to write the .onnx file.")
    ],
    opset: Annotated[
        Optional[int],
        typer.Option(
            help="23+: ONNX RMSNormalization; 18-22: onnxruntime's SimplifiedLayerNormalization. "
            "Default 23, or 22 "
            "with --optimize."
        ),
    ] = None,
    optimize: Annotated[
        bool,
        typer.Option(
            "--optimize",
            help="Run onnxruntime's transformer optimizer (Skip*LayerNormalization fusions), check "
            "and "
            "write its result.",
        ),
    ] = False,
    fuse_affine: Annotated[
        bool,
        typer.Option(
            "--fuse-affine",
            help="Fold with each norm's gain and bias moved into its readers: weightless RMSNorm "
            "ops "
            "with no Add after them.",
        ),
    ] = False,
    *,
    traced: dict[str, Any],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    access: Access,
    revision: Revision = None,
) -> None:
    """Export to ONNX with RMSNorm as one op and dynamic batch and sequence axes; check the
    file and run it in onnxruntime at the traced shape and a second one.

    Example: enjoyln export gpt2-dir gpt2.onnx
    """
    if out_file.suffix != ".onnx" or out_file.is_dir():
        raise EnjoylnError(
            f"cannot write the ONNX model to {out_file}; name a file ending in .onnx"
        )
    if out_file.exists() and not force:
        raise EnjoylnError(f"{out_file} exists; pass --force to replace it")
    with Display(err, enabled=not as_json and not state.quiet) as display:
        src = model_dir_of(model_dir, revision, access, display)
        display.stage(IMPORTING)
        import importlib
        import logging

        # torch.onnx's import resets the level quiet_libraries gives it; its registry warns of a
        # missing torchvision
        importlib.import_module("torch.onnx")

        from ..export.onnx import export_checkpoint

        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        display.stage("folding, exporting and checking in onnxruntime")
        report = export_checkpoint(
            src,
            out_file,
            fuse_affine=fuse_affine,
            opset=opset,
            optimize=optimize,
            **traced,
            **dataclasses.asdict(access),
        )
    if as_json:
        print_json(report.to_dict())
    else:
        print_export(report, out_file)
    if not report.passed:
        raise typer.Exit(1)
