"""onnxruntime (CPU) latency of original against folded BERT-base- and ViT-base-shaped models.

Random weights, perturbed away from init. Each model is exported with
``enjoyln.export_onnx`` (opset 23: LayerNormalization vs RMSNormalization),
then both sessions run alternately and the medians are compared.

    python scripts/bench_onnx.py [--repeats 15] [--write]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import enjoyln
from enjoyln.capture import hf_example_inputs
from enjoyln.onnx_export import export_onnx, ort_feed, ort_session
from enjoyln.testing import perturb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _readme import machine, replace_section  # noqa: E402

MODELS = [
    ("BERT-base", transformers.BertModel, transformers.BertConfig(), dict(batch=8, seq_len=128), "batch 8, seq 128"),
    ("ViT-base", transformers.ViTForImageClassification, transformers.ViTConfig(), dict(batch=4), "batch 4, 224x224"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows = ["| model | inputs | LNs folded | original ms | folded ms | **folded / original** |",
            "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for label, cls, config, shape, shape_text in MODELS:
            torch.manual_seed(0)
            original = perturb(cls(config).eval())
            plan = enjoyln.analyze(original)
            folded = enjoyln.fold(copy.deepcopy(original), plan=plan)
            inputs = hf_example_inputs(original, **shape)
            paths = {}
            for key, model in (("a", original), ("b", folded)):
                paths[key] = Path(tmp) / f"{label}-{key}.onnx"
                report = export_onnx(model, paths[key], inputs, opset=23)
                assert report.passed, report
            sessions = {k: ort_session(p) for k, p in paths.items()}
            feed = ort_feed(sessions["a"], (), inputs.kwargs if hasattr(inputs, "kwargs") else inputs)
            times = {"a": [], "b": []}
            for k in "ab":
                sessions[k].run(None, feed)
            for i in range(args.repeats):
                for k in ("ab" if i % 2 == 0 else "ba"):
                    start = time.perf_counter()
                    sessions[k].run(None, feed)
                    times[k].append(time.perf_counter() - start)
            a, b = (statistics.median(times[k]) * 1e3 for k in "ab")
            rows.append(f"| {label} | {shape_text} | {len(plan.foldable)} of {len(plan.layer_norms)} | {a:.1f} | "
                        f"{b:.1f} | **{b / a:.3f}** |")
            print(rows[-1], file=sys.stderr)
    text = "\n".join([f"onnxruntime CPU, opset 23, medians of {args.repeats} alternating runs. {machine()}.", "",
                      *rows, "", "Command: `python scripts/bench_onnx.py --write`."])
    print(text)
    if args.write:
        replace_section("onnx", text)


if __name__ == "__main__":
    main()
