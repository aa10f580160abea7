"""What `fold`, `check` and `inspect` spend before the first weight byte is read.

Each phase runs in a fresh process, one after the other as the commands run them, and is
timed there (the median of ``--repeat`` processes):

- the interpreter, and ``import enjoyln.cli.app`` (the command line, before torch);
- ``import torch``, then ``import transformers``;
- reading the directory (``open_checkpoint``: config and safetensors headers);
- importing the model's class (transformers imports its modeling module on first use);
- building the meta model;
- the analysis, traced with ``torch.export`` (every command analyses afresh: there is no plan
  cache, so that the gate decides from the two directories alone).

Then the whole commands on the same small checkpoint, where the weights take a small part of the
time: ``inspect``, ``fold --no-check`` and ``check --static``. Every file is read right before
each run, so nothing waits on the disk.

    python scripts/bench_startup.py [--layers 1] [--width 2048] [--repeat 3] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402
from bench_bounded_check import build  # noqa: E402

PHASES = r"""
import json, os, sys, time
t = {"start": time.perf_counter()}
import enjoyln.cli.app
t["cli"] = time.perf_counter()
import torch
t["torch"] = time.perf_counter()
import transformers
t["transformers"] = time.perf_counter()
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.store.hf import model_class
from enjoyln.folded.planning import analyze_dir
t["enjoyln"] = time.perf_counter()
ck = open_checkpoint(sys.argv[1])
t["open"] = time.perf_counter()
model_class(ck)
t["class"] = time.perf_counter()
ck.meta
t["meta"] = time.perf_counter()
analyze_dir(ck, False, False, None)
t["traced"] = time.perf_counter()
print(json.dumps(t))
"""

ROWS = [
    ("the interpreter", "process", "start"),
    ("`import enjoyln.cli.app`", "start", "cli"),
    ("`import torch`", "cli", "torch"),
    ("`import transformers`", "torch", "transformers"),
    ("enjoyln's modules", "transformers", "enjoyln"),
    ("reading the directory (config, headers)", "enjoyln", "open"),
    ("importing the model's class", "open", "class"),
    ("building the meta model", "class", "meta"),
    ("analysis, traced with `torch.export`", "meta", "traced"),
]


def warm(*dirs: Path) -> None:
    for d in dirs:
        for f in sorted(d.iterdir()):
            if f.is_file():
                f.read_bytes()


def phases(ckpt: Path, repeat: int) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        warm(ckpt)
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", PHASES, str(ckpt)], capture_output=True, text=True, check=True
        )
        t = json.loads(out.stdout.strip().splitlines()[-1])
        t["process"] = start  # the interpreter's own start-up: until the first line runs
        runs.append(t)
    # perf_counter is the system's monotonic clock here, so the child's times and the parent's
    # compare
    return {label: statistics.median(r[b] - r[a] for r in runs) for label, a, b in ROWS}


def commands(ckpt: Path, work: Path, repeat: int) -> dict[str, float]:
    folded = work / "folded"
    subprocess.run(
        [sys.executable, "-m", "enjoyln", "fold", str(ckpt), str(folded), "--no-check"],
        check=True,
        capture_output=True,
    )
    cmds = {
        "`inspect`": ["inspect", ckpt],
        "`fold --no-check`": ["fold", ckpt, work / "out", "--no-check"],
        "`check --static`": ["check", ckpt, folded, "--static"],
    }
    out: dict[str, float] = {}
    for label, args in cmds.items():
        times = []
        for _ in range(repeat):
            warm(ckpt, folded)
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "enjoyln", *map(str, args)],
                check=True,
                env={**os.environ, "ENJOYLN_CACHE": str(work / "cache")},
                capture_output=True,
            )
            times.append(time.perf_counter() - start)
            shutil.rmtree(work / "out", ignore_errors=True)
        out[label] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--write", action="store_true", help="put the table into docs/performance.md"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="enjoyln-bench-startup-", dir=args.workdir))
    try:
        ckpt = work / "ref"
        size = build(ckpt, args.layers, args.width)
        # the compiled kernels come from the same cache: build them once, outside the timings
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from enjoyln.ops import center, cpu; center.kernel(); cpu.library()",
            ],
            check=True,
            env={**os.environ, "ENJOYLN_CACHE": str(work / "cache")},
        )
        p = phases(ckpt, args.repeat)
        c = commands(ckpt, work, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = ["| before the first weight byte | seconds |", "|---|---|"]
    lines += [f"| {label} | {seconds:.2f} |" for label, seconds in p.items()]
    lines += ["", "| whole command | seconds |", "|---|---|"]
    lines += [f"| {label} | {t:.2f} |" for label, t in c.items()]
    lines += [
        "",
        f"GPT-2-shaped fp32 checkpoint, {args.layers} layer(s), width {args.width} "
        f"({size / 1e9:.2f} GB); each figure the median of {args.repeat} fresh processes, every "
        "file "
        f"read right before each; {machine()}. Command: `python scripts/bench_startup.py --write`.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        print(f"wrote {replace_section('startup', text)}")


if __name__ == "__main__":
    main()
