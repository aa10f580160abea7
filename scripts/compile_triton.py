"""Compile every Triton kernel variant for sm_80 and sm_90 with no GPU, and tabulate ptxas' report.

Prints one line per variant and architecture (registers, spill bytes, stack,
shared memory); with --write, puts a summary per kernel, launch and dtype in
docs/performance.md. By default it compiles what the test suite does (a covering
set); ``--full`` compiles every combination at the largest launches on both
architectures. Nothing runs on a GPU: these are compiler figures, not timings.

    python scripts/compile_triton.py [--workers 2] [--full] [--write]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # tools/ is a folder of the repository
from _docs import replace_section  # noqa: E402
from tools import triton_aot  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--full", action="store_true", help="every combination at the largest launches"
    )
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    reason = triton_aot.ptxas_missing()
    if reason:
        raise SystemExit(reason)
    pairs = triton_aot.builds(full=args.full)
    with tempfile.TemporaryDirectory() as cache:
        results = triton_aot.compile_all(pairs, cache, workers=args.workers)
    print(f"{'variant':<56} {'arch':>5} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem B':>7}")
    for c in results:
        print(
            f"{c.variant.name:<56} sm_{c.arch:<2} {c.registers:>5} {c.spills:>8} {c.stack:>8} "
            f"{c.shared:>7}"
        )
    text = "\n".join(
        [_intro(results, args.full), "", *_table(results), "", _tail(results, args.full)]
    )
    print()
    print(text)
    if args.write:
        replace_section("triton-compile", text)


KERNELS = {"rows": "several rows", "row": "one row", "looped": "looped"}


def _launch(v: triton_aot.Variant) -> str:
    return f"{v.rows} x {v.block} / {v.warps}" if v.rows > 1 else f"{v.block} / {v.warps}"


def _largest(results: list) -> set:
    """The largest launch of each kernel, as ``builds`` picks them."""
    best: dict[str, triton_aot.Variant] = {}
    for c in results:
        v = c.variant
        if v.kernel not in best or v.block * v.rows > best[v.kernel].block * best[v.kernel].rows:
            best[v.kernel] = v
    return {(v.kernel, v.block, v.rows, v.warps) for v in best.values()}


def _table(results: list) -> list[str]:
    """One row per kernel, launch and dtype at the largest launches."""
    groups: dict[tuple, list] = defaultdict(list)
    largest = _largest(results)
    for c in results:
        v = c.variant
        if (v.kernel, v.block, v.rows, v.warps) in largest:
            groups[(list(KERNELS).index(v.kernel), v.dtype, _launch(v))].append(c)
    rows = [
        "| kernel | rows x block / warps | dtype | builds | registers sm_80 | registers sm_90 | "
        "spill bytes "
        "| shared memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (kernel, dtype, launch), cs in sorted(groups.items()):
        regs = {a: [c.registers for c in cs if c.arch == a] for a in triton_aot.ARCHS}
        span = {
            a: (f"{min(r)}-{max(r)}" if min(r) != max(r) else str(r[0])) if r else "-"
            for a, r in regs.items()
        }
        rows.append(
            f"| {list(KERNELS.values())[kernel]} | {launch} | {dtype} | {len(cs)} | {span[80]} | "
            f"{span[90]} "
            f"| {sum(c.spills for c in cs)} | {max(c.shared for c in cs)} B |"
        )
    return rows


def _intro(results: list, full: bool) -> str:
    what = (
        "every dtype, with and without the residual, each (weight, bias) combination, with "
        "Triton's "
        "16-divisibility specialisation of pointers, strides and N or without it, on both "
        "architectures"
        if full
        else "every dtype and (residual, weight, bias) combination on sm_90; the heaviest form "
        "(residual, weight and bias) in every dtype, aligned to 16 bytes or not, on sm_80 and sm_90"
    )
    return (
        f"Triton {triton.__version__}, compiled with the ptxas it ships; **no GPU ran these "
        "kernels.** "
        f"{len(results)} compilations: at each kernel's largest launch, {what}; then every other "
        "launch "
        "the launcher picks, in the heaviest form (fp32, residual, weight, bias, not aligned), on "
        "both."
    )


def _tail(results: list, full: bool) -> str:
    largest = _largest(results)
    small = [
        c
        for c in results
        if (c.variant.kernel, c.variant.block, c.variant.rows, c.variant.warps) not in largest
    ]
    command = "python scripts/compile_triton.py" + (" --full" if full else "") + " --write"
    return (
        f"The other {len(small)} launches (heaviest form): {min(c.registers for c in small)}-"
        f"{max(c.registers for c in small)} registers, {sum(c.spills for c in small)} spill bytes. "
        f"Total spill bytes over all {len(results)}: **{sum(c.spills for c in results)}**. "
        "Command: "
        f"`{command}`; `tests/tools/test_triton_aot.py` compiles the covering set and fails on any "
        "spill."
    )


if __name__ == "__main__":
    main()
