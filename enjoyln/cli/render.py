"""What the command line prints on stdout: reports (with ``-q`` only their verdict) and strict ASCII
JSON."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, cast

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import EnjoylnError
from ..plan import FoldPlan
from ..store.quiet import show_library_output
from ..units import format_bytes
from .progress import honest_rate


class _OnFirstUse:
    """A rich Console made when first used, not at import: making one asks the stream whether it is
    a terminal, and at import the command line has not yet made its streams safe (fd 1 closed
    leaves ``sys.stdout`` None)."""

    def __init__(self, make: Callable[[], Console]) -> None:
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_console", None)

    def _get(self) -> Console:
        if self._console is None:
            object.__setattr__(self, "_console", self._make())
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)


# wide enough for the tables when piped, where rich would assume 80 columns
out = cast(
    Console,
    _OnFirstUse(
        lambda: Console(
            highlight=False,
            soft_wrap=True,
            width=None if sys.stdout and sys.stdout.isatty() else 160,
        )
    ),
)
err = cast(Console, _OnFirstUse(lambda: Console(stderr=True, highlight=False, soft_wrap=True)))


class State:
    """What the running command asked for: ``--json`` (and whether it is printed yet), ``-q``,
    ``--verbose``."""

    def __init__(self) -> None:
        self.begin()

    def begin(self, *, as_json: bool = False, quiet: bool = False, verbose: bool = False) -> None:
        self.as_json, self.quiet, self.verbose, self.printed_json = as_json, quiet, verbose, False
        show_library_output(verbose)

    def end(self) -> None:
        show_library_output(False)


state = State()


def say(text: str, **kwargs: Any) -> None:
    """A line of the report that ``-q`` leaves out (the verdict and errors always print)."""
    if not state.quiet:
        out.print(text, **kwargs)


_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def one_line(text: str) -> str:
    """``text`` with control characters, line separators and surrogates (undecodable file name
    bytes) escaped.

    >>> one_line("a\\nb")
    'a\\\\nb'
    """

    def escape_char(m: re.Match[str]) -> str:
        c = ord(m.group())
        if 0xDC80 <= c <= 0xDCFF:  # a byte os.fsdecode could not decode
            return f"\\x{c - 0xDC00:02x}"
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(m.group()) or (
            f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
        )

    return _BREAKS.sub(escape_char, text)


_FEEDS = re.compile(r"its input includes the output of (\S+), which is not zero-mean")


def post_ln_note(plan: FoldPlan) -> str | None:
    """Why LayerNorms that read another's output stay, where the plan shows it: a post-LN model
    (BERT), whose blocks' LNs each read the one before, or a stream an LN writes (CLIP's vision
    tower's pre_layrnorm), read by the LNs after it."""
    names = {e.name for e in plan.layer_norms}
    unfoldable = {e.name for e in plan.layer_norms if not e.foldable}
    feeders = {
        e.name: m.group(1)
        for e in plan.layer_norms
        if not e.foldable and (m := _FEEDS.search(e.reason)) and m.group(1) in names
    }
    if not feeders:
        return None
    if not any(f in unfoldable for f in feeders.values()):  # no chain: an LN writes the stream
        writers = sorted(set(feeders.values()))
        it = "it" if len(writers) == 1 else "them"
        readers = (
            f"the {len(feeders)} LayerNorms that read {it} after stay"
            if len(feeders) > 1
            else f"the LayerNorm that reads {it} after stays"
        )
        if len(writers) == 1:
            return (
                f"{writers[0]} writes a residual stream, so the stream holds a LayerNorm's output, "
                f"which is not zero-mean: {readers}."
            )
        return (
            f"{', '.join(writers)} write residual streams, so each holds a LayerNorm's output, "
            f"which is not zero-mean: {readers}."
        )
    folded = ", ".join(sorted({f for f in feeders.values() if f not in unfoldable})) or "none"
    return (
        f"{plan.model} is a post-LN model: in each block the LayerNorm's input is the residual "
        "sum, whose skip branch is the output of the LayerNorm before it. That output is not "
        "zero-mean, so centering the layers that feed the sum cannot make the sum zero-mean, and "
        f"those {len(feeders)} LayerNorms stay. An LN whose inputs are all weights (the embedding "
        f"LN) can be centered, so it folds (here: {folded})."
    )


def no_layer_norm(plan: FoldPlan) -> str:
    """Why a plan lists no LayerNorm: the model has none, or the inputs made for its meta model
    reach none (a tower that reads the values of its inputs, such as image grids, cannot run on
    the meta device)."""
    if not plan.norm_modules:
        return "has no LayerNorm"
    n = len(plan.norm_modules)
    return (
        f"has {n} normalization layer{'s' if n > 1 else ''} ({plan.norm_modules[0]}"
        f"{', ...' if n > 1 else ''}), but the inputs enjoyln could make for its meta model reach "
        f"none of them (a tower that reads the values of its inputs cannot run there; "
        f"enjoyln.fold on the loaded model can)"
    )


def plan_sentence(plan: FoldPlan) -> str:
    """The plan in one sentence, the first line of ``inspect``."""
    if not plan.layer_norms:
        return f"{plan.model} {no_layer_norm(plan)}: nothing to fold."
    n, total = len(plan.foldable), len(plan.layer_norms)
    what = (
        f"all {total} LayerNorms fold"
        if n == total
        else f"{n} of {total} LayerNorms fold"
        if n
        else f"none of its {total} LayerNorms can fold"
    )
    changes = f", by centering {len(plan.centered)} tensors" if plan.centered and n else ""
    untie = f" and untying {len(plan.untied)}" if plan.untied and n else ""
    return f"{plan.model}: {what}{changes}{untie}."


def _table(
    title: str, columns: Iterable[str], rows: Iterable[Iterable[str]], **style: Any
) -> Table:
    """A table titled on its left, every column styled alike."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, **style)
    for row in rows:
        table.add_row(*row)
    return table


def print_plan(plan: FoldPlan) -> None:
    say(escape(plan_sentence(plan)))
    if not plan.layer_norms:
        return
    note = post_ln_note(plan)
    if note:
        say(f"[yellow]Note:[/] {escape(note)}")
    if state.quiet:
        return
    out.print(_norms_table(plan))
    if plan.centered or plan.untied:
        out.print(_changes_table(plan))
    for a in plan.auxiliary:
        out.print(f"Auxiliary centering: {a.describe()}")
    if any(e.affine for e in plan.foldable) or plan.affine_moved:
        out.print(_affine_table(plan))
    _print_rotations_and_notes(plan)


def _norms_table(plan: FoldPlan) -> Table:
    """One row per norm: folded, with the modules it centers, or the reason it is kept."""
    table = Table(
        title=f"{plan.model}: {len(plan.foldable)} of {len(plan.layer_norms)} LayerNorms foldable",
        title_justify="left",
    )
    table.add_column("LayerNorm", overflow="fold")
    table.add_column("fold")
    table.add_column("centered / reason", overflow="fold")
    for e in plan.layer_norms:
        # centered 'transformer.h.0.attn.c_proj.weight', ... as 'transformer.h.*.attn.c_proj'
        modules = dict.fromkeys(
            re.sub(
                r"\.\d+\.",
                ".*.",
                c.param.rsplit(".", 1)[0] if c.param.endswith(("weight", "bias")) else c.param,
            )
            for c in e.centered
        )
        table.add_row(
            e.name,
            "[green]yes[/]" if e.foldable else "[red]no[/]",
            escape(f"{len(e.centered)} tensors: " + ", ".join(modules) if e.foldable else e.reason),
        )
    return table


def _changes_table(plan: FoldPlan) -> Table:
    """The tensors the plan centers and unties."""
    return _table(
        f"Changes: center {len(plan.centered)} tensors, untie {len(plan.untied)} "
        f"(+{format_bytes(plan.untie_bytes)})",
        ("parameter", "change"),
        [(c.param, f"center along axis {c.axis}") for c in plan.centered]
        + [(u.param, f"untie from {u.tied_to}: +{format_bytes(u.nbytes)}") for u in plan.untied],
        overflow="fold",
    )


def _affine_table(plan: FoldPlan) -> Table:
    """Where each folded norm's γ and β go, and those of norms that stay on a rotated stream."""
    affine = [e for e in plan.foldable if e.affine]
    rows = []
    for e in affine:
        into = ", ".join(sorted({f.weight for f in e.fused})) or "nothing to move"
        what = {
            "fused": f"into {into}",
            "gain fused": f"γ into {into}; β stays as β/γ ({e.affine_reason})",
            "kept": f"kept: {e.affine_reason}",
        }[e.affine]
        rows.append((e.name, escape(what)))
    rows += [
        (
            e.name,
            escape(
                f"into {', '.join(sorted({f.weight for f in e.fused})) or 'nothing to move'}; "
                "it stays a LayerNorm, on a rotated stream"
            ),
        )
        for e in plan.affine_moved
        if not e.foldable
    ]
    return _table(
        f"Affine: {sum(e.weightless for e in affine)} of {len(affine)} folded norms become "
        "weightless",
        ("LayerNorm", "γ and β"),
        rows,
        overflow="fold",
    )


def _print_rotations_and_notes(plan: FoldPlan) -> None:
    for r in plan.rotations:
        stream = f"{r.stream}, width {r.width}, " if r.width else ""
        out.print(
            f"Rotation: {r.kind} ({stream}seed {r.seed}, "
            f"{'keeps' if r.keep_mean else 'does not keep'} the "
            f"mean) of {len(r.rotated)} tensors"
        )
    if plan.changed_outputs:
        out.print(
            "Outputs the model does not serve that change (so not compared): "
            f"{', '.join(plan.changed_outputs)}"
        )
    for note in plan.notes:
        out.print(f"[yellow]Note:[/] {escape(note)}")
    if not plan.changes:
        out.print("Nothing is foldable: the output would equal the input.")


def _strict(value: Any) -> Any:
    """Non-finite floats as "inf", "-inf", "nan"; surrogates (no UTF-8 can carry them) as \\xNN."""
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
    """ASCII only, so it reads back whatever the terminal's encoding."""
    out.file.write(json.dumps(_strict(value), indent=2, ensure_ascii=True, allow_nan=False) + "\n")
    out.file.flush()
    state.printed_json = True


def print_report(report: Any, subject: str = "the candidate") -> None:
    colour = "green" if report.passed else "red"
    out.print(f"[{colour}]{escape(report.verdict(subject))}[/]")
    details = report.summary().splitlines()[1:]  # its first line is the bare verdict
    if details and not state.quiet:
        out.print(escape("\n".join(details)))


def drop_stdout() -> None:
    """Send what is left of stdout to /dev/null, so Python's final flush raises nothing either."""
    with contextlib.suppress(
        OSError, ValueError, AttributeError
    ):  # no real descriptor (under a test runner)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def show_fold(
    result: Any, payload: dict[str, Any], *, mode: str, as_json: bool, dry_run: bool
) -> None:
    """What ``fold`` and ``rotate`` print (or the JSON document); nothing to fold is an error (exit
    2)."""
    plan = result.plan
    if not as_json:
        if result.cleaned:
            say(
                f"Removed {len(result.cleaned)} temporary "
                f"director{'y' if len(result.cleaned) == 1 else 'ies'} left by an interrupted run: "
                + ", ".join(escape(str(p)) for p in result.cleaned)
            )
        print_plan(plan)
        if result.skipped:
            say(f"[yellow]Not copied:[/] {escape('; '.join(result.skipped))}")
        if result.followed:
            say(
                "Copied through links out of MODEL_DIR (files a model needs): "
                f"{escape(', '.join(result.followed))}"
            )
        if result.report is not None:
            print_report(result.report, "the folded model")
        if result.out_dir:
            rate = honest_rate(result.bytes_written, result.stream_seconds)
            speed = f" ({rate / 1e6:.0f} MB/s)" if rate is not None else ""
            checked = {"none": "unchecked", "static": "weights checked", "full": "checked"}[mode]
            out.print(
                f"Wrote {escape(str(result.out_dir))} ({checked}; {len(result.files)} weight "
                "files, "
                f"{format_bytes(result.bytes_written)}) in {result.seconds:.2f} s; moving the "
                "weights took "
                f"{result.stream_seconds:.2f} s{speed}"
            )
            if plan.rotation is not None and not plan.rotation.keep_mean:
                out.print(
                    "[yellow]Note:[/] this rotation does not keep the stream zero-mean: load it "
                    "with "
                    "enjoyln.load; a plain from_pretrained runs LayerNorms and gives different "
                    "outputs"
                )
        elif dry_run:
            out.print("Dry run: nothing written.")
    if not dry_run and not plan.changes:
        what = (
            no_layer_norm(plan)
            if not plan.layer_norms
            else f"has {len(plan.layer_norms)} LayerNorms and none can fold"
        )
        error = EnjoylnError(f"nothing to fold: {plan.model} {what}; nothing was written")
        # the --json document says what was found
        error.payload = payload  # type: ignore[attr-defined]
        raise error
    if as_json:
        print_json(payload)


def print_export(report: Any, out_file: Path) -> None:
    def dims(shape: list[Any]) -> str:
        return escape("[" + ", ".join(map(str, shape)) + "]")

    bias = f" ({report.rms_bias_adds} followed by a bias Add)" if report.rms_bias_adds else ""
    out.print(
        f"Wrote {out_file} (opset {report.opset}): {report.rms_norm_nodes} RMSNorm ops{bias}, "
        f"{report.layer_norm_nodes} LayerNormalization ops; onnx.checker passed"
    )
    out.print(
        "Inputs: "
        + ", ".join(f"{k} {dims(v)}" for k, v in report.inputs.items())
        + "; outputs: "
        + ", ".join(f"{k} {dims(v)}" for k, v in report.outputs.items())
    )
    shapes = " and ".join(
        ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in s.items()) for s in report.shapes
    )
    verdict = "[green]matches[/]" if report.max_rel_diff <= 1e-4 else "[red]DIFFERS from[/]"
    out.print(
        f"onnxruntime {verdict} PyTorch at {shapes}: max relative difference "
        f"{report.max_rel_diff:.3g}"
    )
    if report.optimized:
        norms = ", ".join(
            f"{n} {report.optimized_ops[n]}"
            for n in sorted(report.optimized_ops)
            if "Normalization" in n
        )
        verdict = (
            "[green]matches[/]" if report.optimized_max_rel_diff <= 1e-4 else "[red]DIFFERS from[/]"
        )
        out.print(
            f"Optimized (onnxruntime optimizer, model_type {report.optimizer_model_type}): "
            f"{norms}; "
            f"fused {report.skip_fused} of {report.skip_candidates} residual Add + norm pairs; "
            f"{verdict} PyTorch: max relative difference {report.optimized_max_rel_diff:.3g}"
        )
    for note in report.notes:
        out.print(f"[yellow]warning:[/] {escape(note)}")


def print_kernels(results: list[Any]) -> None:
    out.print(
        _table(
            "Norm kernels: median µs; torch = F.rms_norm + bias; copy = x.clone(), the floor",
            (
                "shape",
                "dtype",
                "path",
                "LN µs",
                "RMS µs",
                "RMS/LN",
                "torch µs",
                "torch/LN",
                "copy/LN",
                "LN GB/s",
                "RMS GB/s",
            ),
            [
                (
                    f"{r.rows}x{r.cols}",
                    r.dtype,
                    r.backend,
                    f"{r.layer_norm_us:.0f}",
                    f"{r.rms_norm_us:.0f}",
                    f"{r.ratio:.2f}",
                    f"{r.torch_rms_norm_us:.0f}",
                    f"{r.torch_ratio:.2f}",
                    f"{r.copy_us / r.layer_norm_us:.2f}",
                    f"{r.gbps(r.layer_norm_us):.1f}",
                    f"{r.gbps(r.rms_norm_us):.1f}",
                )
                for r in results
            ],
            no_wrap=True,
        )
    )
    print_warnings(w for r in results for w in r.warnings)


def print_latency(lat: Any, a: str = "original", b: str = "folded", what: str = "") -> None:
    """The difference in one direction (from the run-by-run ratios), then the reference's own time:
    the two medians are not set side by side, since on a drifting machine they can point the
    other way."""
    out.print(f"{what}{lat.difference(a, b)}")
    tokens = f", {lat.tokens_per_s('a'):,.0f} tokens/s" if lat.tokens else ""
    out.print(
        f"  {a}: {lat.a_ms:.2f} ms per forward (median of {lat.repeats} runs, IQR "
        f"{lat.a_iqr_ms:.2f} ms"
        f"{tokens})"
    )
    print_warnings(lat.warnings(a, b))


def print_end_to_end(result: Any, model: str, batch: int, seq_len: int) -> None:
    print_latency(result.latency, what=f"End to end ({model}, batch {batch}, seq {seq_len}): ")
    out.print(f"LayerNorm share of the original (profiler): {result.layer_norm_share:.2%}")
    ln_ms, rms_ms, copy_ms = result.norm_ms
    if not ln_ms:  # CUDA: hooks around a module cannot time the kernels it queues
        out.print("Time inside the norms: not measured on CUDA")
        return
    out.print(
        f"Time inside the norms per forward: LayerNorm {ln_ms:.2f} ms, folded {rms_ms:.2f} ms "
        f"({rms_ms / ln_ms:.2f}x), a bare copy of the input in their place {copy_ms:.2f} ms"
    )
    if copy_ms < ln_ms:  # the floor: no norm kernel reads and writes less than a copy
        out.print(
            "  even a norm as cheap as a copy would save at most "
            f"{result.best_possible_speedup:.2%} of a "
            f"forward ({ln_ms - copy_ms:.2f} ms)"
        )
    else:
        out.print(
            "  a bare copy took no less than LayerNorm here: no norm kernel can make this forward "
            "faster"
        )


def print_warnings(warnings: Iterable[str]) -> None:
    for warning in warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}")


def print_compiled(comp: Any) -> None:
    print_latency(comp.latency, what="Compiled (inductor, fullgraph, no graph breaks): ")
    out.print(
        "Compiled folded against the eager original: max relative difference "
        f"{comp.max_rel_diff:.1e}"
    )
    out.print(
        f"Generated kernels: original {comp.kernels[0]}, folded {comp.kernels[1]}; norm kernels "
        f"{comp.norm_kernels[0]} and {comp.norm_kernels[1]}, {comp.fused_add_norms} of the folded "
        f"ones with the residual add fused in; compile {comp.compile_s[0]:.0f} s and "
        f"{comp.compile_s[1]:.0f} s"
    )
