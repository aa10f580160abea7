"""Compile every Triton kernel variant for sm_80 and sm_90 with no GPU, and tabulate ptxas' report.

Prints one line per variant and architecture (registers, spill bytes, stack,
shared memory); with --write, puts a summary per kernel, block and dtype in
docs/performance.md. Nothing runs on a GPU: these are compiler figures, not timings.

    python scripts/compile_triton.py [--workers 2] [--write]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import triton

from enjoyln.ops import triton_aot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import replace_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    reason = triton_aot.ptxas_missing()
    if reason:
        raise SystemExit(reason)
    pairs = [(v, arch) for v in triton_aot.variants() for arch in triton_aot.ARCHS]
    with tempfile.TemporaryDirectory() as cache:
        results = triton_aot.compile_all(pairs, cache, workers=args.workers)
    print(f"{'variant':<52} {'arch':>5} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem B':>7}")
    groups: dict[tuple, list] = defaultdict(list)
    for c in results:
        v = c.variant
        print(f"{v.name:<52} sm_{c.arch:<2} {c.registers:>5} {c.spills:>8} {c.stack:>8} {c.shared:>7}")
        groups[(v.kernel, v.block, v.warps, v.dtype)].append(c)
    rows = ["| kernel | block / warps | dtype | variants | registers sm_80 | registers sm_90 | spill bytes "
            "| shared memory |", "|---|---|---|---|---|---|---|---|"]
    for (kernel, block, warps, dtype), cs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "row", -kv[0][1],
                                                                                     kv[0][3])):
        if kernel == "row" and block < 1024 and len(cs) <= 2:
            continue  # the small blocks of the sweep: summarised in the line below the table
        regs = {a: [c.registers for c in cs if c.arch == a] for a in triton_aot.ARCHS}
        span = {a: f"{min(r)}-{max(r)}" if min(r) != max(r) else str(r[0]) for a, r in regs.items()}
        rows.append(f"| {'one block' if kernel == 'row' else 'looped'} | {block} / {warps} | {dtype} "
                    f"| {len(cs) // len(triton_aot.ARCHS)} | {span[80]} | {span[90]} | {sum(c.spills for c in cs)} "
                    f"| {max(c.shared for c in cs)} B |")
    small = [c for c in results if c.variant.kernel == "row" and c.variant.block < 1024]
    text = "\n".join([
        f"Triton {triton.__version__}, compiled with the ptxas it ships; **no GPU ran these kernels.** "
        f"{len(results)} compilations: every dtype, with and without the residual, each (weight, bias) "
        "combination, with Triton's 16-divisibility specialisation of pointers, strides and N or without "
        "it, for the one-block kernel at its largest block and the looped kernel; then every smaller "
        "block the launcher picks, in the heaviest form (fp32, residual, weight, bias, not aligned).", "",
        *rows, "",
        f"Blocks 1-512 (4 warps, heaviest form): {min(c.registers for c in small)}-"
        f"{max(c.registers for c in small)} registers, {sum(c.spills for c in small)} spill bytes. "
        f"Total spill bytes over all {len(results)}: **{sum(c.spills for c in results)}**. "
        "Command: `python scripts/compile_triton.py --write`; `tests/ops/test_triton_aot.py` fails on any spill."])
    print()
    print(text)
    if args.write:
        replace_section("triton-compile", text)


if __name__ == "__main__":
    main()
