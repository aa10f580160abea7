"""End-to-end benchmark for the README: GPT-2 small, original against folded.

fp32, batch 1, sequence 512, eval, no grad; forwards alternate A, B, A, B and
the medians are compared. The share of the original's time spent in
LayerNorm comes from the PyTorch profiler.

    python scripts/bench_e2e.py [--repeats 30] [--write]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import transformers

import enjoyln
from enjoyln.bench import end_to_end
from enjoyln.capture import hf_example_inputs
from enjoyln.testing import perturb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _readme import machine, replace_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    original = perturb(transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval())
    folded = enjoyln.fold(copy.deepcopy(original))
    inputs = hf_example_inputs(original, batch=1, seq_len=args.seq_len)
    default = torch.get_num_threads()
    rows = ["| threads | original ms | folded ms | **speedup** | LN share of original | needed (60% of share) "
            "| in the norms per forward: LN → RMSNorm → bare copy | best possible (copy floor) |",
            "|---|---|---|---|---|---|---|---|"]
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        r = end_to_end(original, folded, inputs, repeats=args.repeats)
        lat = r.latency
        ln, rms, floor = r.norm_ms
        rows.append(f"| {threads} | {lat.a_ms:.1f} | {lat.b_ms:.1f} | **{lat.speedup:+.2%}** | "
                    f"{r.layer_norm_share:.2%} | {0.6 * r.layer_norm_share:+.2%} "
                    f"| {ln:.2f} → {rms:.2f} ({rms / ln:.2f}x) → {floor:.2f} ms ({floor / ln:.2f}x) "
                    f"| {r.best_possible_speedup:+.2%} |")
    torch.set_num_threads(default)
    text = "\n".join([f"GPT-2 small (random, perturbed), fp32, batch 1, sequence {args.seq_len}; medians of "
                      f"{args.repeats} alternating forwards each. {machine()}.", "", *rows, "",
                      "Command: `python scripts/bench_e2e.py --write`."])
    print(text)
    if args.write:
        replace_section("e2e", text)


if __name__ == "__main__":
    main()
