"""End-to-end benchmark for docs/performance.md: GPT-2 small, original against folded.

fp32, batch 1, sequence 512, eval, no grad; forwards alternate A, B, A, B and
the medians are compared. The share of the original's time spent in
LayerNorm comes from the PyTorch profiler. Then both models compiled with
torch.compile (inductor, fullgraph=True), timed the same way, with the
compiled folded model checked against the eager original.

    python scripts/bench_e2e.py [--repeats 30] [--only eager|compiled] [--write]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import transformers

import enjoyln
from enjoyln.bench import end_to_end
from enjoyln.bench_compiled import compiled_comparison
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.testing import perturb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--only", choices=["eager", "compiled"])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    original = perturb(transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval())
    folded = enjoyln.fold(copy.deepcopy(original))
    inputs = hf_example_inputs(original, batch=1, seq_len=args.seq_len)
    if args.only != "compiled":
        eager(original, folded, inputs, args)
    if args.only != "eager":
        compiled(original, folded, inputs, args)


def eager(
    original: torch.nn.Module, folded: torch.nn.Module, inputs: dict, args: argparse.Namespace
) -> None:
    default = torch.get_num_threads()
    rows = [
        "| threads | original ms | folded ms | speedup of the medians (noise, see above) | LN "
        "share of original | needed (60% of share) "
        "| in the norms per forward: LN → RMSNorm → bare copy | best possible (copy floor) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        r = end_to_end(original, folded, inputs, repeats=args.repeats)
        lat = r.latency
        ln, rms, floor = r.norm_ms
        rows.append(
            f"| {threads} | {lat.a_ms:.1f} | {lat.b_ms:.1f} | {lat.speedup:+.2%} | "
            f"{r.layer_norm_share:.2%} | {0.6 * r.layer_norm_share:+.2%} "
            f"| {ln:.2f} → {rms:.2f} ({rms / ln:.2f}x) → {floor:.2f} ms ({floor / ln:.2f}x) "
            f"| {r.best_possible_speedup:+.2%} |"
        )
    torch.set_num_threads(default)
    text = "\n".join(
        [
            f"GPT-2 small (random, perturbed), fp32, batch 1, sequence {args.seq_len}; medians of "
            f"{args.repeats} alternating forwards each. {machine()}.",
            "",
            *rows,
            "",
            "Command: `python scripts/bench_e2e.py --write`.",
        ]
    )
    print(text)
    if args.write:
        replace_section("e2e", text)


def compiled(
    original: torch.nn.Module, folded: torch.nn.Module, inputs: dict, args: argparse.Namespace
) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (
        device == "cuda"
    ):  # where a GPU is present, compile for it; the figures in docs/performance.md are CPU
        original, folded = original.to(device), folded.to(device)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    default = torch.get_num_threads()
    load = [os.getloadavg()[0]]  # the machine may be shared: say how busy it was
    rows = [
        "| threads | compiled original ms | compiled folded ms | **folded / original** | kernels "
        "generated "
        "(original → folded) | norm kernels with the residual add fused in | in the norm kernels "
        "per "
        "forward: LN → RMSNorm | compiled folded vs eager original (max rel. diff) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for threads in sorted({1, default}) if device == "cpu" else [default]:
        torch.set_num_threads(threads)  # inductor's CPU code is generated for this count
        r = compiled_comparison(
            original, folded, inputs, repeats=args.repeats, profile_kernels=device == "cpu"
        )
        lat, (ln, rms) = r.latency, r.norm_kernel_ms
        norms = f"{ln:.2f} → {rms:.2f} ms ({rms / ln:.2f}x)" if ln else "-"
        rows.append(
            f"| {threads} | {lat.a_ms:.1f} | {lat.b_ms:.1f} | **{lat.ratio:.3f}** | {r.kernels[0]} "
            "→ "
            f"{r.kernels[1]} | {r.fused_add_norms} of {r.norm_kernels[1]} | {norms} | "
            f"{r.max_rel_diff:.1e} |"
        )
        load.append(os.getloadavg()[0])
    torch.set_num_threads(default)
    text = "\n".join(
        [
            f"GPT-2 small (random, perturbed), fp32, batch 1, sequence {args.seq_len}, "
            f"{device.upper()}; both "
            "compiled with `torch.compile(model, fullgraph=True)` (inductor, no graph breaks); "
            "medians of "
            f"{args.repeats} alternating forwards each. {machine()}; 1-minute load average "
            f"{', '.join(f'{x:.1f}' for x in load)} at the start and after each row.",
            "",
            *rows,
            "",
            "The norm kernels are timed by the profiler (inductor's `cpp.enable_kernel_profile`), "
            "with what inductor "
            "fused into them. Command: `python scripts/bench_e2e.py --only compiled --write` (or "
            "`enjoyln bench "
            "--compile`).",
        ]
    )
    print(text)
    if args.write and device == "cpu":
        replace_section("e2e-compile", text)


if __name__ == "__main__":
    main()
