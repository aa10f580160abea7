"""onnxruntime's transformer optimizer on an exported file: which of its fusions took (a residual
``Add`` and norm into ``SkipSimplifiedLayerNormalization``), and the bias fusion it lacks for the
RMS form."""

from __future__ import annotations

import contextlib
import io
import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..analysis.inputs import config_value, is_causal_lm

if TYPE_CHECKING:
    from .onnx import ExportReport

OPTIMIZE_OPSET = (
    22  # the newest onnxruntime's optimizer fuses RMS in (it fails on opset 23's ``Attention``)
)
RMS_OPS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
LN_OPS = ("LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization")
SKIP_OPS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")


OPTIMIZER_TYPES = {
    "gpt2": "gpt2",
    "bert": "bert",
    "roberta": "bert",
    "distilbert": "bert",
    "vit": "vit",
    "deit": "vit",
    "swin": "swin",
    "bart": "bart",
    "t5": "t5",
    "gpt_neox": "gpt_neox",
    "phi": "phi",
    "clip": "clip",
}
"""Hugging Face model_type -> onnxruntime optimizer model_type; others: gpt2 for causal LMs, else
bert."""


def producers(proto: Any) -> dict[str, Any]:
    return {o: n for n in proto.graph.node for o in n.output}


def rms_bias_adds(proto: Any) -> int:
    """Adds of a constant straight after an RMS op: the β of a norm that kept it."""
    produced = producers(proto)
    constants = {i.name for i in proto.graph.initializer} | {
        n.output[0] for n in proto.graph.node if n.op_type == "Constant"
    }
    return sum(
        1
        for node in proto.graph.node
        if node.op_type == "Add"
        and len(node.input) == 2
        and any(getattr(produced.get(i), "op_type", None) in RMS_OPS for i in node.input)
        and set(node.input) & constants
    )


def _skip_candidates(proto: Any) -> int:
    """Norms fed by an ``Add`` of two computed tensors, neither an embedding lookup: what
    onnxruntime fuses."""
    produced = producers(proto)
    constants = {i.name for i in proto.graph.initializer}
    adds = [
        produced.get(node.input[0])
        for node in proto.graph.node
        if node.op_type
        in ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")
    ]
    return sum(
        1
        for add in adds
        if add is not None
        and add.op_type == "Add"
        and len(add.input) == 2
        and not set(add.input) & constants
        and not any(getattr(produced.get(i), "op_type", None) == "Gather" for i in add.input)
    )


def run_optimizer(model: nn.Module, src: Path, dst: Path, proto: Any, report: ExportReport) -> None:
    import onnx
    import onnxruntime
    from onnxruntime.transformers.optimizer import optimize_model

    config = getattr(model, "config", None)
    heads = config_value(
        config, "num_attention_heads", "n_head", "num_heads"
    )  # None without a config
    hidden = config_value(config, "hidden_size", "n_embd", "d_model")
    kind = OPTIMIZER_TYPES.get(
        getattr(config, "model_type", None), "gpt2" if is_causal_lm(model) else "bert"
    )
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    # the optimizer logs every pattern it did not find and its shape inference failures: the counts
    # say what matters
    logging.disable(logging.WARNING)
    onnxruntime.set_default_logger_severity(3)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            optimized = optimize_model(
                str(src), model_type=kind, num_heads=int(heads or 0), hidden_size=int(hidden or 0)
            )
            _fuse_bias_skip_simplified(optimized)
            optimized.save_model_to_file(str(dst), use_external_data_format=external)
    finally:
        logging.disable(logging.NOTSET)
        onnxruntime.set_default_logger_severity(2)
    ops = Counter(n.op_type for n in onnx.load(str(dst), load_external_data=False).graph.node)
    report.optimized = True
    report.optimizer_model_type = kind
    report.optimized_ops = dict(sorted(ops.items()))
    report.skip_candidates = _skip_candidates(proto)
    report.skip_fused = sum(ops[o] for o in SKIP_OPS)
    norms_before = (report.layer_norm_nodes, report.rms_norm_nodes)
    norms_after = (sum(ops[o] for o in LN_OPS), sum(ops[o] for o in RMS_OPS))
    if norms_after != norms_before:
        report.notes.append(
            f"the optimizer turned {norms_before[0]} LayerNorm and {norms_before[1]} RMSNorm ops "
            f"into {norms_after[0]} and {norms_after[1]}"
        )
    if report.skip_fused < report.skip_candidates:
        why = (
            f" (at opset {report.opset} it cannot fuse RMSNormalization, and its shape inference "
            "fails on "
            f"the Attention op; use opset {OPTIMIZE_OPSET})"
            if report.opset > OPTIMIZE_OPSET
            else ""
        )
        report.notes.append(
            f"onnxruntime's optimizer fused {report.skip_fused} of {report.skip_candidates} "
            f"residual Add + norm pairs{why}"
        )


def _fuse_bias_skip_simplified(model: Any) -> None:
    """Move a linear layer's bias ``Add`` into the ``SkipSimplifiedLayerNormalization`` it feeds, as
    onnxruntime's optimizer does for ``SkipLayerNormalization`` only."""
    produced = model.output_name_to_node()
    consumers = model.input_name_to_nodes()
    outputs = {o.name for o in model.model.graph.output}
    removed = []
    for node in model.get_nodes_by_op_type("SkipSimplifiedLayerNormalization"):
        if len(node.input) != 3:
            continue
        for slot in (0, 1):
            add = produced.get(node.input[slot])
            if (
                add is None
                or add.op_type != "Add"
                or add in removed
                or add.output[0] in outputs
                or len(consumers.get(add.output[0], [])) != 1
            ):
                continue
            for side in (0, 1):
                bias = model.get_initializer(add.input[1 - side])
                parent = produced.get(add.input[side])
                if (
                    bias is not None
                    and len(bias.dims) == 1
                    and parent is not None
                    and parent.op_type == "MatMul"
                ):
                    node.input[slot] = add.input[side]
                    node.input.append(add.input[1 - side])
                    removed.append(add)
                    break
            if len(node.input) == 4:
                break
    model.remove_nodes(removed)
