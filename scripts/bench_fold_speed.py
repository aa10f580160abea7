"""Time analyze + fold of a GPT-2-small-sized model (124M parameters, random init).

python scripts/bench_fold_speed.py [--repeats 3] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import enjoyln

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    analyze_s, fold_s = [], []
    for i in range(args.repeats):
        torch.manual_seed(i)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
        start = time.perf_counter()
        plan = enjoyln.analyze(model)
        mid = time.perf_counter()
        enjoyln.fold(model, plan=plan)
        end = time.perf_counter()
        analyze_s.append(mid - start)
        fold_s.append(end - mid)
    a, f = statistics.median(analyze_s), statistics.median(fold_s)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    text = (
        f"GPT-2 small ({params:.0f}M parameters after untying, random init, fp32): `analyze` "
        f"{a:.2f} s + `fold` {f:.2f} s = **{a + f:.2f} s** (median of {args.repeats}; "
        f"{len(plan.foldable)}/{len(plan.layer_norms)} LNs folded). {machine()}. "
        "Command: `python scripts/bench_fold_speed.py --write`."
    )
    print(text)
    if args.write:
        replace_section("fold-speed", text)


if __name__ == "__main__":
    main()
