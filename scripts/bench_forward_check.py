"""The cost of the forward check on a large vocabulary: a GPT-2-shaped checkpoint with 262,144 token
ids.

Builds a GPT-2-shaped checkpoint with random fp32 weights (width 96, 2 layers, 1,024 positions, a
vocabulary of 262,144: about 100 MB, nearly all of it the embedding that the head also reads;
LayerNorm gains and biases moved away from their init), folds it without a check, then times, each
in its own process under ``/usr/bin/time -v``, one after the other in one run:

- ``enjoyln check REF FOLD``: the default check (every weight, then 2 short batches);
- ``enjoyln check REF FOLD --forward-only``: the outputs only, with the coverage batch and the token
  sweep up to its default limit, the report saying how many token ids ran;
- the same with ``--sweep-tokens 0``: what the sweep itself costs is the difference.

Each row gives the exit code, the wall time, the peak RSS and the token ids the batches covered.

    python scripts/bench_forward_check.py [--workdir DIR] [--vocab 262144] [--width 96] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402


def build(path: Path, vocab: int, width: int) -> int:
    """The reference checkpoint; its size in bytes."""
    import transformers

    from enjoyln.testing import perturb

    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=width, n_layer=2, n_head=4, n_positions=1024
    )
    perturb(transformers.GPT2LMHeadModel(config).eval(), seed=0).save_pretrained(path)
    return (path / "model.safetensors").stat().st_size


def timed(*args: str) -> dict:
    """Run ``enjoyln ARGS --json`` under /usr/bin/time -v: exit code, peak RSS (bytes), wall
    seconds, report."""
    proc = subprocess.run(
        ["/usr/bin/time", "-v", sys.executable, "-m", "enjoyln", *args, "--json"],
        capture_output=True,
        text=True,
    )
    rss = (
        int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    )
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr).group(
        1
    )
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    cpu = sum(
        float(re.search(rf"{kind} time \(seconds\): (\S+)", proc.stderr).group(1))
        for kind in ("User", "System")
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = {}
    print(
        f"  exit {proc.returncode}, peak RSS {rss / 2**30:.2f} GiB, {seconds:.1f} s ({cpu:.1f} s "
        f"of CPU): enjoyln {' '.join(args[:1])} "
        f"{' '.join(args[3:])} ({report.get('verdict', proc.stderr.strip()[-300:])})",
        flush=True,
    )
    return {
        "exit": proc.returncode,
        "rss": rss,
        "seconds": seconds,
        "cpu": cpu,
        "report": report,
        "load": os.getloadavg()[0],
    }


def coverage(report: dict) -> str:
    c = report.get("coverage") or {}
    if not c.get("distinct_ids"):
        return "(no coverage batch: the weights are proven)"
    limit = (
        f", the token sweep stopped at its limit of {c['sweep_limit']:,}"
        if c.get("sweep_limit")
        else ""
    )
    return f"{c['distinct_ids']:,} of {c['vocab_size']:,} token ids{limit}"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument(
        "--write", action="store_true", help="put the figures into docs/checking.md"
    )
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="enjoyln-sweep-")) if args.workdir is None else args.workdir
    try:
        ref, folded = root / "ref", root / "folded"
        size = (
            build(ref, args.vocab, args.width)
            if not ref.exists()
            else (ref / "model.safetensors").stat().st_size
        )
        print(f"reference: {size / 1e6:.0f} MB in {ref}", flush=True)
        if not folded.exists():
            subprocess.run(
                [sys.executable, "-m", "enjoyln", "fold", str(ref), str(folded), "--no-check"],
                check=True,
                capture_output=True,
            )
        folded_size = (folded / "model.safetensors").stat().st_size
        print("timing (each in its own process):", flush=True)
        runs = [
            dict(
                timed("check", str(ref), str(folded)),
                what="`enjoyln check REF FOLD` (every weight, then 2 short batches)",
            ),
            dict(
                timed("check", str(ref), str(folded), "--forward-only"),
                what="`enjoyln check REF FOLD --forward-only` (the outputs only, with the token "
                "sweep)",
            ),
            dict(
                timed("check", str(ref), str(folded), "--forward-only", "--sweep-tokens", "0"),
                what="`enjoyln check REF FOLD --forward-only --sweep-tokens 0` (no token sweep)",
            ),
        ]
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    bad = [r["what"] for r in runs if r["exit"] != 0]
    if bad:
        raise SystemExit(f"a correct fold failed: {bad}")
    body = "\n".join(
        [
            f"Synthetic GPT-2-shaped checkpoint, width {args.width}, 2 layers, vocabulary "
            f"{args.vocab:,}, fp32: "
            f"{size / 1e6:.0f} MB (its fold {folded_size / 1e6:.0f} MB with the untied head). Each "
            "command in its own process under `/usr/bin/time -v`, one after the other; "
            f"{machine()}. Other processes shared the two cores (the load average, over 1 minute, "
            "as each command ended, "
            "is in the table): the wall times are upper bounds, and the CPU time (user and system, "
            "both threads) is "
            "what the command itself spent.",
            "",
            "| command | exit | wall | CPU time | load | peak RSS | token ids covered |",
            "|---|---|---|---|---|---|---|",
            *[
                f"| {r['what']} | {r['exit']} | {r['seconds']:.0f} s | {r['cpu']:.0f} s | "
                f"{r['load']:.1f} | "
                f"{r['rss'] / 2**30:.2f} GiB | {coverage(r['report'])} |"
                for r in runs
            ],
            "",
            "Command: `python scripts/bench_forward_check.py --write`.",
        ]
    )
    print(body)
    if args.write:
        print(f"wrote {replace_section('forward-check', body)}")
    return runs


if __name__ == "__main__":
    main()
