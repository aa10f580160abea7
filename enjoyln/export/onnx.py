"""ONNX export of folded models: ``enjoyln::rms_norm`` as ``RMSNormalization`` (opset 23+) or
onnxruntime's ``SimplifiedLayerNormalization``, then an ``Add`` for a kept β
(docs/performance.md)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..ops import opaque  # importing ops registers enjoyln::rms_norm, which export_onnx translates
from ..analysis.inputs import (
    ExampleInputs,
    Inputs,
    config_value,
    hf_example_inputs,
    inputs_like,
    is_hf_model,
    resolve_inputs,
)
from ..checking.running import flatten_outputs
from ..errors import EnjoylnError, first_line
from ..options import Access
from ..store.load import load
from ..store.checkpoint import open_checkpoint
from ..store.quiet import quiet
from ..transform.steps import fold
from .optimize import OPTIMIZE_OPSET, RMS_OPS, rms_bias_adds, run_optimizer

DEFAULT_OPSET = 23
SEQUENCE_AXES = {0: "batch_size", 1: "sequence_length"}
DECODER_AXES = {0: "batch_size", 1: "decoder_sequence_length"}
AXES = {
    "input_ids": SEQUENCE_AXES,
    "attention_mask": SEQUENCE_AXES,
    "token_type_ids": SEQUENCE_AXES,
    "position_ids": SEQUENCE_AXES,
    "decoder_input_ids": DECODER_AXES,
    "decoder_attention_mask": DECODER_AXES,
}
"""Dynamic axes of the inputs optimum names; any other tensor input gets a dynamic ``batch_size``
axis 0."""


def _require() -> None:
    try:
        for name in ("onnx", "onnxruntime", "onnxscript"):
            importlib.import_module(name)
    except ImportError as exc:
        raise EnjoylnError(
            f"ONNX export needs onnx, onnxscript and onnxruntime ({exc.name} is missing): "
            "pip install 'enjoyln[onnx]'"
        ) from None


def _register_simplified_layer_norm() -> None:
    """Tell onnx (so onnxscript and onnx.checker) onnxruntime's SimplifiedLayerNormalization, not a
    standard op."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has("SimplifiedLayerNormalization"):
        return
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    param, attr = OpSchema.FormalParameter, OpSchema.Attribute
    onnx.defs.register_schema(
        OpSchema(
            "SimplifiedLayerNormalization",
            "",
            1,
            "onnxruntime's RMSNorm: x / sqrt(mean(x^2) + epsilon) * scale",
            inputs=[param("X", "T"), param("scale", "V")],
            outputs=[param("Y", "V")],
            type_constraints=[("T", floats, ""), ("V", floats, "")],
            attributes=[
                attr("axis", OpSchema.AttrType.INT, "", required=False),
                attr("epsilon", OpSchema.AttrType.FLOAT, "", required=False),
                attr("stash_type", OpSchema.AttrType.INT, "", required=False),
            ],
        )
    )


def translation(opset: int) -> Any:
    import onnxscript

    op = onnxscript.values.Opset("", opset)
    if opset < DEFAULT_OPSET:
        _register_simplified_layer_norm()

    def rms_norm(
        x: Any, normalized_shape: list[int], weight: Any = None, bias: Any = None, eps: float = 1e-5
    ) -> Any:
        axis = -len(normalized_shape)
        if (
            weight is None
        ):  # both ops require a scale: ones, which the exporter folds into a constant
            weight = op.Expand(op.CastLike(1.0, x), op.Constant(value_ints=list(normalized_shape)))
        norm = op.RMSNormalization if opset >= DEFAULT_OPSET else op.SimplifiedLayerNormalization
        y = norm(x, weight, axis=axis, epsilon=eps, stash_type=1)
        return op.Add(y, bias) if bias is not None else y

    return rms_norm


@dataclass
class ExportReport:
    path: str
    opset: int
    ops: dict[str, int] = field(default_factory=dict)  # of the exported graph, before any optimizer
    rms_norm_nodes: int = 0
    layer_norm_nodes: int = 0
    rms_bias_adds: int = 0  # RMS ops followed by an ``Add`` of a constant: norms that kept β
    inputs: dict[str, list[Any]] = field(
        default_factory=dict
    )  # name -> shape, dynamic axes by name
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    checked: bool = False
    shapes: list[dict[str, list[int]]] = field(
        default_factory=list
    )  # checked at: the traced one, a second one
    max_rel_diff: float | None = None
    passed: bool | None = None
    optimized: bool = False
    optimizer_model_type: str = ""
    optimized_ops: dict[str, int] = field(default_factory=dict)
    skip_candidates: int = (
        0  # norms fed by a residual ``Add`` of two computed tensors, which the optimizer fuses
    )
    skip_fused: int = 0
    optimized_max_rel_diff: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    example_inputs: ExampleInputs = None,
    *,
    opset: int | None = None,
    verify: bool = True,
    rtol: float = 1e-4,
    dynamic: bool = True,
    optimize: bool = False,
) -> ExportReport:
    """Export to ONNX with dynamic axes, check it in onnxruntime at two shapes; ``optimize``: its
    optimizer too.

    >>> export_onnx(enjoyln.fold(model, fuse_affine=True), "model.onnx", optimize=True)  # doctest: +SKIP
    """  # noqa: E501
    _require()
    opset = _opset(opset, optimize)
    path = Path(path)
    inputs = deployment_inputs(model, example_inputs)
    axes = _dynamic_axes(model, inputs) if dynamic else {}
    # written beside the target under the final name (external data files refer to it) and moved at
    # the end: a failed export leaves nothing behind
    path.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.enjoyln-", dir=path.parent))
    plain = tmpdir / "plain" / path.name
    plain.parent.mkdir()
    was_training = model.training
    try:
        model.eval()
        traced_outputs, proto = _export(model, inputs, axes, opset, plain)
        report = _checked_report(path, opset, proto, plain)
        runs = [inputs, second_shape(inputs, report.inputs)] if verify else []
        report.shapes = [_shape_of(r) for r in runs]
        with torch.no_grad():  # the traced shape's outputs are already at hand
            wants = [
                list(flatten_outputs(traced_outputs if r is inputs else r.call(model)).values())
                for r in runs
            ]
        if verify:
            report.max_rel_diff = compare_with_onnxruntime(plain, runs, wants)
            report.passed = report.max_rel_diff <= rtol
        final = plain
        if optimize:
            final = tmpdir / path.name
            run_optimizer(model, plain, final, proto, report)
            if verify:
                report.optimized_max_rel_diff = compare_with_onnxruntime(final, runs, wants)
                report.passed = report.passed and report.optimized_max_rel_diff <= rtol
        for item in final.parent.iterdir():
            if item.is_file():
                os.replace(item, path.parent / item.name)
    except EnjoylnError:
        raise
    except Exception as exc:
        raise _export_error(model, exc) from exc
    finally:
        model.train(was_training)
        shutil.rmtree(tmpdir, ignore_errors=True)
    return report


def _opset(opset: int | None, optimize: bool) -> int:
    import onnx

    opset = opset if opset is not None else (OPTIMIZE_OPSET if optimize else DEFAULT_OPSET)
    newest = onnx.defs.onnx_opset_version()
    if opset < 18:
        raise EnjoylnError(
            f"opset {opset} is too old; use 18 or later (23+ for ONNX's RMSNormalization)"
        )
    if opset > newest:
        raise EnjoylnError(
            f"opset {opset} is newer than this onnx ({onnx.__version__}) knows; use at most "
            f"{newest}"
        )
    return opset


def _export(
    model: nn.Module, inputs: Inputs, axes: dict[str, Any], opset: int, plain: Path
) -> tuple[Any, Any]:
    """``model`` exported to ``plain``, its dynamic axes named: (its outputs on ``inputs``, the ONNX
    graph)."""
    import onnx

    # where the exporter spares only ATen ops from decomposition (older torch), ``opaque()`` below
    # makes the composite enjoyln::rms_norm decompose to enjoyln::rms_norm_kernel, translated the
    # same
    table = {
        torch.ops.enjoyln.rms_norm.default: translation(opset),
        torch.ops.enjoyln.rms_norm_kernel.default: translation(opset),
    }
    with torch.no_grad():
        traced_outputs = inputs.call(model)
    names = _output_names(traced_outputs)
    shapes = {k: v for k, v in axes.items() if v is not None}
    # the exporter narrates its steps on stdout and its optimiser on stderr
    with (
        torch.no_grad(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        opaque(),
    ):
        program = torch.onnx.export(
            model,
            inputs.args,
            kwargs=inputs.kwargs,
            dynamo=True,
            opset_version=opset,
            custom_translation_table=table,
            dynamic_shapes=axes or None,
            output_names=names,
            verbose=False,
        )
        program.save(str(plain))
    proto = onnx.load(str(plain), load_external_data=False)
    _name_axes(proto, shapes)
    onnx.save(proto, str(plain))  # only the graph: external data, if any, stays where it is
    return traced_outputs, proto


def _checked_report(path: Path, opset: int, proto: Any, plain: Path) -> ExportReport:
    import onnx

    ops = Counter(n.op_type for n in proto.graph.node)
    report = ExportReport(
        str(path),
        opset,
        dict(sorted(ops.items())),
        sum(ops[o] for o in RMS_OPS),
        ops["LayerNormalization"],
        rms_bias_adds(proto),
        _value_shapes(proto.graph.input),
        _value_shapes(proto.graph.output),
        checked=True,
    )
    onnx.checker.check_model(
        str(plain)
    )  # the report is returned only once the checker accepts the file
    return report


def _export_error(model: nn.Module, exc: Exception) -> EnjoylnError:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    # a dynamic axis the model fixes: torch.export says which, deep in its message
    fixed = [line.strip("- ") for line in lines if "inferred a static shape" in line]
    if fixed:
        return EnjoylnError(
            f"ONNX export of {type(model).__name__} failed: {fixed[0]}; export with "
            "dynamic=False (--static) for fixed shapes"
        )
    return EnjoylnError(f"ONNX export of {type(model).__name__} failed: {lines[0]}")


@quiet
def export_checkpoint(
    model_dir: str | os.PathLike,
    path: str | os.PathLike,
    *,
    fuse_affine: bool = False,
    batch: int = 2,
    seq_len: int = 16,
    **options: Any,
) -> ExportReport:
    """``export_onnx`` for a model directory, folded in memory if it is not; ``options``: its and
    ``Access``'s.

    >>> export_checkpoint("gpt2-folded", "gpt2.onnx").passed  # doctest: +SKIP
    True
    """
    export = {k: options.pop(k) for k in ("opset", "optimize", "dynamic") if k in options}
    checkpoint = open_checkpoint(model_dir, **asdict(Access(**options)))
    recorded = checkpoint.recorded_plan
    if recorded is not None and fuse_affine and not any(e.affine for e in recorded.foldable):
        raise EnjoylnError(
            f"{model_dir} was folded without --fuse-affine; export it without --fuse-affine, "
            "or fold the original with `enjoyln fold --fuse-affine`"
        )
    model = load(checkpoint)
    if recorded is None:
        model = fold(model, fuse_affine=fuse_affine)
    return export_onnx(
        model, path, hf_example_inputs(model, batch=batch, seq_len=seq_len), **export
    )


def deployment_inputs(model: nn.Module, example_inputs: ExampleInputs = None) -> Inputs:
    """The example inputs plus what a deployed HF model is fed: an ``attention_mask``,
    ``token_type_ids``."""
    inputs = resolve_inputs(model, example_inputs)
    inputs = Inputs(tuple(inputs.args), dict(inputs.kwargs))  # entries are added and replaced below
    ids = inputs.kwargs.get("input_ids")
    if is_hf_model(model) and isinstance(ids, torch.Tensor):
        params = inspect.signature(model.forward).parameters
        if "attention_mask" in params:
            inputs.kwargs.setdefault("attention_mask", torch.ones_like(ids))
        if "token_type_ids" in params and config_value(model.config, "type_vocab_size"):
            inputs.kwargs.setdefault("token_type_ids", torch.zeros_like(ids))
    return inputs


def _dynamic_axes(model: nn.Module, inputs: Inputs) -> dict[str, Any]:
    """``dynamic_shapes``; torch.export fixes an axis traced at size 0 or 1, so such are repeated to
    2 in place."""
    bound = inspect.signature(model.forward).bind(*inputs.args, **inputs.kwargs).arguments

    def spec(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            # image sizes stay fixed: ViT checks them against its config, and with
            # interpolate_pos_encoding
            # its graph keeps the traced size's shortcut (onnxruntime then fails at any other size)
            return {a: n for a, n in AXES.get(name, {0: "batch_size"}).items() if a < value.dim()}
        if isinstance(value, (tuple, list)):
            return type(value)(spec(name, v) for v in value)
        return None

    axes = {name: spec(name, value) for name, value in bound.items()}
    for name, value in bound.items():
        if isinstance(value, torch.Tensor) and axes[name]:
            grown = value
            for a in axes[name]:
                if grown.shape[a] == 1:
                    grown = grown.repeat_interleave(2, dim=a)
            if grown is not value and name in inputs.kwargs:
                inputs.kwargs[name] = grown
            elif grown is not value:
                position = list(inspect.signature(model.forward).parameters).index(name)
                inputs.args = inputs.args[:position] + (grown,) + inputs.args[position + 1 :]
    return axes


def second_shape(inputs: Inputs, shapes: dict[str, list[Any]]) -> Inputs:
    """Fresh inputs with every dynamic axis of ``shapes`` resized: ``batch_size`` one larger, every
    other a quarter shorter; an ``attention_mask`` pads the end of its last row."""
    positional = [n for n in shapes if n not in inputs.kwargs]
    named = dict(zip(positional, inputs.args)) | inputs.kwargs
    sizes: dict[str, int] = {}
    for name, dims in shapes.items():
        for axis, dim in enumerate(dims):
            if isinstance(dim, str) and isinstance(named.get(name), torch.Tensor):
                n = named[name].shape[axis]
                sizes.setdefault(dim, n + 1 if dim == "batch_size" else n - max(1, n // 4))

    def resize(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        for axis, dim in enumerate(shapes.get(name, ())):
            if isinstance(dim, str) and axis < value.dim():
                want = sizes[dim]
                value = torch.cat([value] * -(-want // value.shape[axis]), dim=axis).narrow(
                    axis, 0, want
                )
        return value

    args = tuple(
        resize(positional[i] if i < len(positional) else "", a) for i, a in enumerate(inputs.args)
    )
    second = inputs_like(Inputs(args, {k: resize(k, v) for k, v in inputs.kwargs.items()}), seed=1)
    mask = second.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 1:
        mask[-1, mask.shape[1] - max(1, mask.shape[1] // 4) :] = 0
    return second


def _shape_of(inputs: Inputs) -> dict[str, list[int]]:
    named = {f"arg{i}": a for i, a in enumerate(inputs.args)} | inputs.kwargs
    return {k: list(v.shape) for k, v in named.items() if isinstance(v, torch.Tensor)}


def _output_names(out: Any) -> list[str]:
    """optimum's names (``logits``, ``last_hidden_state``) where the model has them, else
    output_N."""
    names = list(flatten_outputs(out))
    return [
        n if re.fullmatch(r"[A-Za-z_]\w*", n) else "output_" + re.sub(r"\W", "_", n) for n in names
    ]


def _name_axes(proto: Any, axes: dict[str, Any]) -> None:
    """Give the exporter's symbols (``s72``) the names asked for (it does only when every argument
    is a tensor)."""
    rename: dict[str, str] = {}
    for value in proto.graph.input:
        spec = axes.get(value.name)
        if not isinstance(spec, dict):
            continue
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if axis in spec and dim.dim_param and dim.dim_param != spec[axis]:
                rename.setdefault(dim.dim_param, spec[axis])
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")
    for value in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: rename[m.group(1)], dim.dim_param)


def _value_shapes(values: Any) -> dict[str, list[Any]]:
    return {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values
    }


def ort_session(path: str | os.PathLike) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def ort_feed(session: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    positional = iter(a for a in args if isinstance(a, torch.Tensor))
    feed = {}
    for i in session.get_inputs():
        value = kwargs.get(i.name)
        value = value if isinstance(value, torch.Tensor) else next(positional)
        feed[i.name] = value.detach().cpu().numpy()
    return feed


def compare_with_onnxruntime(
    path: str | os.PathLike, runs: list[Inputs], wants: list[list[torch.Tensor]]
) -> float:
    """The largest difference of onnxruntime's outputs from ``wants``, relative to each output's
    largest magnitude."""
    session = ort_session(path)
    worst = 0.0
    for inputs, want in zip(runs, wants):
        try:
            got = session.run(None, ort_feed(session, inputs.args, inputs.kwargs))
        except Exception as exc:
            raise EnjoylnError(
                f"onnxruntime cannot run the exported file at input shapes {_shape_of(inputs)}: "
                f"{first_line(exc)}"
            ) from exc
        if not want or len(want) != len(got):
            raise EnjoylnError(
                f"onnxruntime returned {len(got)} outputs where PyTorch returns {len(want)}"
            )
        for a, b in zip(want, got):
            a, b = a.detach().double(), torch.from_numpy(b).double()
            finite = a.isfinite()
            # a NaN or Inf where PyTorch is finite (or another non-finite value where it is not) is
            # a
            # difference; max(worst, nan) would be worst, so these are counted apart
            if (
                a.shape != b.shape
                or not torch.equal(finite, b.isfinite())
                or not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num())
            ):
                return math.inf
            if finite.any():
                scale = float(a[finite].abs().max()) or 1.0
                worst = max(worst, float((a[finite] - b[finite]).abs().max()) / scale)
    return worst
