"""Kernel benchmark for docs/performance.md: enjoyln RMSNorm (with bias) against native LayerNorm.

Runs in one process, on one thread and on the default thread count, at the
shapes and dtypes of the acceptance criteria; each ratio comes from
interleaved timings in the same run.

    python scripts/bench_kernels.py [--write]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from enjoyln import ops
from enjoyln.bench import kernel_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402

SHAPES = [(2048, 768), (4096, 1024)]
DTYPES = [torch.float32, torch.bfloat16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    default = torch.get_num_threads()
    rows = [
        "| threads | shape | dtype | LayerNorm µs | enjoyln µs | **enjoyln / LN** | F.rms_norm + "
        "bias / LN "
        "| copy / LN (floor) | LN GB/s | enjoyln GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        for r in kernel_benchmark(SHAPES, DTYPES, repeats=args.repeats):
            rows.append(
                f"| {threads} | {r.rows}x{r.cols} | {r.dtype} | {r.layer_norm_us:.0f} | "
                f"{r.rms_norm_us:.0f} "
                f"| **{r.ratio:.2f}** | {r.torch_ratio:.2f} | {r.copy_us / r.layer_norm_us:.2f} "
                f"| {r.gbps(r.layer_norm_us):.1f} | {r.gbps(r.rms_norm_us):.1f} |"
            )
    torch.set_num_threads(default)
    text = "\n".join(
        [
            f"CPU: {machine()}. Path: {ops.status()['cpu']}.",
            "",
            *rows,
            "",
            "Bytes moved = M·N·(size_x + size_y) + N·(size_γ + size_β). Command: "
            "`python scripts/bench_kernels.py --write`.",
        ]
    )
    print(text)
    if args.write:
        replace_section("kernels", text)


if __name__ == "__main__":
    main()
