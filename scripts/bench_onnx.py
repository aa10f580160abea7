"""onnxruntime (CPU) latency of the optimized original against the optimized folded model.

GPT-2-small, BERT-base and ViT-base shapes, random weights perturbed away from
init. The folded model is the fused-affine form (``enjoyln.fold(...,
fuse_affine=True)``). Each is exported once with dynamic axes and run through
onnxruntime's transformer optimizer (``export_onnx(..., optimize=True)``, opset
22), then both sessions run alternately at two input shapes and the medians are
compared. onnxruntime's profiler gives the time inside the norm ops.

    python scripts/bench_onnx.py [--repeats 9] [--models gpt2,bert,vit] [--write]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnxruntime
import torch
import transformers

import enjoyln
from enjoyln.bench import compare_latency
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.export.onnx import deployment_inputs, export_onnx, ort_feed, ort_session
from enjoyln.export.optimize import LN_OPS, RMS_OPS
from enjoyln.testing import perturb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402

MODELS = {
    "gpt2": (
        "GPT-2-small",
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config,
        [dict(batch=1, seq_len=64), dict(batch=2, seq_len=128)],
    ),
    "bert": (
        "BERT-base",
        transformers.BertModel,
        transformers.BertConfig,
        [dict(batch=1, seq_len=128), dict(batch=4, seq_len=64)],
    ),
    "vit": (
        "ViT-base",
        transformers.ViTForImageClassification,
        transformers.ViTConfig,
        [dict(batch=1), dict(batch=2)],
    ),
}
NORM_OPS = LN_OPS + RMS_OPS
PROFILED_RUNS = 2


class OrtModel:
    """An onnxruntime session called like the PyTorch model, for ``compare_latency``."""

    def __init__(self, path: Path) -> None:
        self.session = ort_session(path)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.session.run(None, ort_feed(self.session, args, kwargs))


def norm_time_ms(path: Path, feed: dict[str, Any], runs: int) -> tuple[float, float]:
    """(ms per run inside norm ops, ms per run in all ops), from onnxruntime's profiler."""
    options = onnxruntime.SessionOptions()
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        for _ in range(runs + 1):  # the first run warms up, and is left out below
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(nodes) // (runs + 1)
    nodes = nodes[per_run:]
    norm = sum(e["dur"] for e in nodes if e["args"].get("op_name") in NORM_OPS)
    total = sum(e["dur"] for e in nodes)
    return norm / runs / 1e3, total / runs / 1e3


def shape_text(key: str, shape: dict[str, int]) -> str:
    if key == "vit":
        return f"batch {shape['batch']}, 224x224"
    return f"batch {shape['batch']}, seq {shape['seq_len']}"


def bench_model(key: str, repeats: int, tmp: Path) -> tuple[list[str], str]:
    label, cls, config_cls, shapes = MODELS[key]
    torch.manual_seed(0)
    original = perturb(cls(config_cls()).eval())
    plan = enjoyln.analyze(original, fuse_affine=True)
    folded = enjoyln.fold(copy.deepcopy(original), plan=plan)
    reports = {}
    for name, model in (("original", original), ("folded", folded)):
        start = time.perf_counter()
        reports[name] = export_onnx(model, tmp / f"{key}-{name}.onnx", optimize=True)
        assert reports[name].passed, reports[name]
        print(
            f"{label} {name}: exported, optimized and checked in {time.perf_counter() - start:.0f} "
            "s "
            f"(max rel diff {reports[name].optimized_max_rel_diff:.2g} at {reports[name].shapes})",
            file=sys.stderr,
        )
    a, b = (OrtModel(tmp / f"{key}-{name}.onnx") for name in ("original", "folded"))
    rows = []
    for shape in shapes:
        inputs = deployment_inputs(original, hf_example_inputs(original, **shape))
        lat = compare_latency(a, b, inputs, repeats=repeats, warmup=1)
        feed = ort_feed(a.session, inputs.args, inputs.kwargs)
        norm_a, total_a = norm_time_ms(tmp / f"{key}-original.onnx", feed, runs=PROFILED_RUNS)
        norm_b, _ = norm_time_ms(tmp / f"{key}-folded.onnx", feed, runs=PROFILED_RUNS)
        rows.append(
            f"| {label} | {shape_text(key, shape)} | {lat.a_ms:.1f} | {lat.b_ms:.1f} | "
            f"**{lat.ratio:.3f}** | "
            f"{norm_a:.2f} → {norm_b:.2f} ({norm_b / norm_a:.2f}x) | {norm_a / total_a:.1%} |"
        )
        print(rows[-1], file=sys.stderr)
    ops_a, ops_b = reports["original"].optimized_ops, reports["folded"].optimized_ops

    def norms(ops: dict[str, int]) -> str:
        return ", ".join(f"{n} {ops[n]}" for n in NORM_OPS if ops.get(n))

    weightless = sum(e.weightless for e in plan.foldable)
    ops_row = (
        f"| {label} | {len(plan.foldable)} of {len(plan.layer_norms)} ({weightless} weightless) | "
        f"{norms(ops_a)} | {norms(ops_b)} | {reports['folded'].rms_bias_adds} |"
    )
    return rows, ops_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--models", default="gpt2,bert,vit")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows = [
        "| model | inputs | original ms | folded ms | **folded / original** | time in norm ops, ms "
        "(original → folded) | norm share of the original |",
        "|---|---|---|---|---|---|---|",
    ]
    ops = [
        "| model | LNs folded | original, optimized | folded (fused affine), optimized | RMS ops "
        "followed by "
        "a bias Add |",
        "|---|---|---|---|---|",
    ]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            model_rows, ops_row = bench_model(key, args.repeats, Path(tmp))
            rows += model_rows
            ops.append(ops_row)
    minutes = (time.perf_counter() - start) / 60
    text = "\n".join(
        [
            f"onnxruntime {onnxruntime.__version__} CPU, both files through its transformer "
            "optimizer (opset 22); "
            f"medians of {args.repeats} alternating runs; norm times from onnxruntime's profiler "
            f"({PROFILED_RUNS} runs). "
            f"{machine()}.",
            "",
            *rows,
            "",
            *ops,
            "",
            f"Command: `python scripts/bench_onnx.py --write` ({minutes:.0f} min here).",
        ]
    )
    print(text)
    if args.write:
        replace_section("onnx", text)


if __name__ == "__main__":
    main()
