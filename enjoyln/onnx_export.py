"""ONNX export of folded models, with RMSNorm as a real RMSNorm op.

``enjoyln.RMSNorm`` traces as the custom op ``enjoyln::rms_norm``; this module
translates it for ``torch.onnx.export`` into:

- opset 23 and later: ONNX's ``RMSNormalization``;
- earlier opsets: onnxruntime's ``SimplifiedLayerNormalization`` (default
  domain), which only onnxruntime runs.

Neither takes a bias after the norm, so LN's β becomes a following ``Add``.
(``SkipSimplifiedLayerNormalization``'s bias is added before the norm, so it
cannot carry β.) Needs ``pip install 'enjoyln[onnx]'``.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .capture import ExampleInputs, resolve_inputs
from .equivalence import flatten_outputs
from .errors import EnjoylnError

DEFAULT_OPSET = 23
RMS_OPS = ("RMSNormalization", "SimplifiedLayerNormalization")


def _require() -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise EnjoylnError(f"ONNX export needs onnx, onnxscript and onnxruntime ({exc.name} is missing): "
                           "pip install 'enjoyln[onnx]'") from None


def _register_simplified_layer_norm() -> None:
    """Tell onnx (and so onnxscript and onnx.checker) the signature of
    onnxruntime's SimplifiedLayerNormalization, which is not a standard op."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has("SimplifiedLayerNormalization"):
        return
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    onnx.defs.register_schema(OpSchema(
        "SimplifiedLayerNormalization", "", 1, "onnxruntime's RMSNorm: x / sqrt(mean(x^2) + epsilon) * scale",
        inputs=[param("X", "T"), param("scale", "V")], outputs=[param("Y", "V")],
        type_constraints=[("T", floats, ""), ("V", floats, "")],
        attributes=[attr("axis", OpSchema.AttrType.INT, "", required=False),
                    attr("epsilon", OpSchema.AttrType.FLOAT, "", required=False),
                    attr("stash_type", OpSchema.AttrType.INT, "", required=False)]))


def translation(opset: int) -> Any:
    """The onnxscript function that lowers ``enjoyln::rms_norm`` at ``opset``."""
    import onnxscript

    op = onnxscript.values.Opset("", opset)
    if opset < DEFAULT_OPSET:
        _register_simplified_layer_norm()

    def rms_norm(x: Any, normalized_shape: list[int], weight: Any = None, bias: Any = None,
                 eps: float = 1e-5) -> Any:
        axis = -len(normalized_shape)
        if weight is None:  # both ops require a scale
            weight = op.Expand(op.CastLike(1.0, x), op.Constant(value_ints=list(normalized_shape)))
        if opset >= DEFAULT_OPSET:
            y = op.RMSNormalization(x, weight, axis=axis, epsilon=eps, stash_type=1)
        else:
            y = op.SimplifiedLayerNormalization(x, weight, axis=axis, epsilon=eps, stash_type=1)
        return op.Add(y, bias) if bias is not None else y

    return rms_norm


@dataclass
class ExportReport:
    """What ``export_onnx`` wrote and how onnxruntime agreed with PyTorch."""

    path: str
    opset: int
    ops: dict[str, int] = field(default_factory=dict)
    rms_norm_nodes: int = 0
    layer_norm_nodes: int = 0
    checked: bool = False
    max_rel_diff: float | None = None
    passed: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_onnx(model: nn.Module, path: str | os.PathLike, example_inputs: ExampleInputs = None, *,
                opset: int = DEFAULT_OPSET, verify: bool = True, rtol: float = 1e-4) -> ExportReport:
    """Export ``model`` (folded or not) to ONNX; check it and run it once in onnxruntime.

    >>> export_onnx(enjoyln.fold(model), "model.onnx")  # doctest: +SKIP
    """
    _require()
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if opset < 18:
        raise EnjoylnError(f"opset {opset} is too old; use 18 or later (23+ for ONNX's RMSNormalization)")
    if opset > newest:
        raise EnjoylnError(f"opset {opset} is newer than this onnx ({onnx.__version__}) knows; use at most {newest}")
    path = Path(path)
    inputs = resolve_inputs(model, example_inputs)
    kwargs = inputs.kwargs
    table = {torch.ops.enjoyln.rms_norm.default: translation(opset)}
    # Written into a temporary directory beside the target, under the final name
    # (external data files refer to it), and moved at the end: a failed export
    # leaves nothing behind.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.enjoyln-", dir=path.parent))
    tmp = tmpdir / path.name
    was_training = model.training
    try:
        model.eval()
        # the exporter narrates its steps on stdout and its optimiser on stderr
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            program = torch.onnx.export(model, inputs.args, kwargs=kwargs, dynamo=True, opset_version=opset,
                                        custom_translation_table=table, verbose=False)
            program.save(str(tmp))
        proto = onnx.load(str(tmp), load_external_data=False)
        ops = Counter(n.op_type for n in proto.graph.node)
        report = ExportReport(str(path), opset, dict(sorted(ops.items())),
                              sum(ops[o] for o in RMS_OPS), ops["LayerNormalization"])
        onnx.checker.check_model(str(tmp))
        report.checked = True
        if verify:
            report.max_rel_diff = _compare_with_onnxruntime(model, tmp, inputs.args, kwargs)
            report.passed = report.max_rel_diff <= rtol
        for item in tmpdir.iterdir():
            os.replace(item, path.parent / item.name)
    except EnjoylnError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise EnjoylnError(f"ONNX export of {type(model).__name__} failed: {first}") from exc
    finally:
        model.train(was_training)
        shutil.rmtree(tmpdir, ignore_errors=True)
    return report


def ort_session(path: str | os.PathLike, threads: int | None = None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_feed(session: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """onnxruntime inputs: keyword tensors by name, positional ones in order."""
    positional = iter(a for a in args if isinstance(a, torch.Tensor))
    feed = {}
    for i in session.get_inputs():
        value = kwargs.get(i.name)
        value = value if isinstance(value, torch.Tensor) else next(positional)
        feed[i.name] = value.detach().cpu().numpy()
    return feed


def _compare_with_onnxruntime(model: nn.Module, path: Path, args: tuple, kwargs: dict) -> float:
    session = ort_session(path)
    got = session.run(None, ort_feed(session, args, kwargs))
    with torch.no_grad():
        want = list(flatten_outputs(model(*args, **kwargs)).values())
    if not want or len(want) != len(got):
        raise EnjoylnError(f"onnxruntime returned {len(got)} outputs where PyTorch returns {len(want)}")
    worst = 0.0
    for a, b in zip(want, got):
        a = a.detach().double()
        b = torch.from_numpy(b).double()
        scale = float(a.abs().max()) or 1.0
        worst = max(worst, float((a - b).abs().max()) / scale)
    return worst
