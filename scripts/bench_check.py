"""The gate and the file commands against the disk: two checkpoint sizes, side by side with cp and cat.

Builds two GPT-2-shaped checkpoints with random fp32 weights (width 2048; by
default 1 layer, ~0.6 GB, and 10 layers, ~2.4 GB; LayerNorm gains and biases
moved away from their init), then for each, every command in its own process
under ``/usr/bin/time -v`` (wall time, peak RSS), one after the other in one run, each
``--repeat`` times after a ``sync`` (the fastest time and the largest peak RSS are reported):

- ``cp -r`` of the reference, and ``cat`` of both checkpoints' files (the read floor);
- ``enjoyln fold --no-check``, ``fold --fuse-affine --no-check``, ``rotate --no-check``;
- ``enjoyln check --static`` and ``enjoyln check`` of the fold against the reference.

Every file a command reads is read once right before each of its runs, so all of them
read from the page cache (these virtual machines evict file pages left untouched for a
minute). The whole commands include seconds of start-up (imports, the meta model,
the analysis); the difference between the two sizes gives the marginal throughput
without it: bytes of the reference for cp and the folds, bytes of both checkpoints
for cat and the checks.

    python scripts/bench_check.py [--workdir DIR] [--layers 1] [--more-layers 10] [--repeat 5] [--write]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402
from bench_bounded_check import build as build_checkpoint  # noqa: E402

WIDTH = 2048


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".safetensors")


def timed(cmd: list[str], label: str) -> dict:
    """Run ``cmd`` under /usr/bin/time -v: exit code, wall seconds, peak RSS (bytes)."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr).group(1)
    seconds = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall.split(":"))))
    print(f"  {label}: exit {proc.returncode}, {seconds:.2f} s, peak RSS {rss / 2**30:.2f} GiB", flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-2000:], file=sys.stderr)
    return {"exit": proc.returncode, "seconds": seconds, "rss": rss}


def enjoyln(*args: object) -> list[str]:
    return [sys.executable, "-m", "enjoyln", *map(str, args)]


def warm(*dirs: Path) -> None:
    """Read every weight file of ``dirs`` once, so that the command after it reads from the page
    cache: a machine that reclaims file pages left untouched for a minute (DAMON's reclaim on
    these virtual machines) would otherwise time the disk for some runs and memory for others."""
    files = [str(f) for d in dirs if d.exists() for f in sorted(d.glob("*.safetensors"))]
    if files:
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)


IMPORTS = "import torch, transformers, enjoyln.cli.app, enjoyln.convert; transformers.GPT2LMHeadModel"


def repeated(n: int, cmd: Callable[[int], list[str]], label: str, after: Callable[[int], None] = lambda i: None,
             reads: tuple[Path, ...] = ()) -> dict:
    """``timed`` ``n`` times: the fastest wall time (what the command costs; a shared virtual
    machine only ever adds to it, by seconds at a time), the largest peak RSS, and every time."""
    runs = []
    for i in range(n):
        # the previous command's dirty pages written back first: each command is timed from
        # the same clean state, not throttled by its predecessor's writeback
        subprocess.run(["sync"], check=True)
        warm(*reads)
        if cmd(i)[0] == sys.executable:  # the libraries' files too, which the same reclaim evicts
            subprocess.run([sys.executable, "-c", IMPORTS], check=True)
        runs.append(timed(cmd(i), label))
        after(i)
    times = sorted(r["seconds"] for r in runs)
    return {"exit": max(r["exit"] for r in runs), "seconds": times[0],
            "rss": max(r["rss"] for r in runs), "times": times}


def measure(ref: Path, root: Path, repeat: int = 3) -> dict[str, dict]:
    root.mkdir(parents=True, exist_ok=True)
    folded = root / "folded"
    out: dict[str, dict] = {}
    out["cp"] = repeated(repeat, lambda i: ["cp", "-r", str(ref), str(root / "copy")], "cp -r",
                         lambda i: shutil.rmtree(root / "copy"), reads=(ref,))
    # the first fold is the one checked below; the others go and come again
    out["fold"] = repeated(repeat, lambda i: enjoyln("fold", ref, folded if i == 0 else root / "again", "--no-check"),
                           "fold --no-check", lambda i: shutil.rmtree(root / "again", ignore_errors=True), reads=(ref,))
    files = [str(f) for d in (ref, folded) for f in sorted(d.glob("*.safetensors"))]
    out["cat"] = repeated(repeat, lambda i: ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files], "cat both",
                          reads=(ref, folded))
    for name, args in {"fuse": ("fold", "--fuse-affine"), "rotate": ("rotate",)}.items():
        target = root / name
        out[name] = repeated(repeat, lambda i: enjoyln(*args, ref, target, "--no-check"), " ".join(args) + " --no-check",
                             lambda i: shutil.rmtree(target, ignore_errors=True), reads=(ref,))
    out["static"] = repeated(repeat, lambda i: enjoyln("check", ref, folded, "--static"), "check --static",
                             reads=(ref, folded))
    out["check"] = repeated(repeat, lambda i: enjoyln("check", ref, folded), "check", reads=(ref, folded))
    out["bytes_ref"], out["bytes_both"] = size(ref), size(ref) + size(folded)
    shutil.rmtree(folded)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--more-layers", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command; the table has the fastest")
    parser.add_argument("--write", action="store_true", help="put the table into docs/performance.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="enjoyln-bench-check-", dir=args.workdir))
    try:
        runs = []
        for layers in (args.layers, args.more_layers):
            ref = work / f"ref{layers}"
            print(f"{layers} layers: {build_checkpoint(ref, layers, WIDTH) / 1e9:.2f} GB", flush=True)
            runs.append(measure(ref, work / f"out{layers}", args.repeat))
            shutil.rmtree(work / f"out{layers}", ignore_errors=True)
            shutil.rmtree(ref)
        text = table(*runs, args.layers, args.more_layers, args.repeat)
        print(text)
        if args.write:
            print(f"wrote {replace_section('bench-check', text)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(small: dict, large: dict, layers: int, more: int, repeat: int = 1) -> str:
    def marginal(key: str, by: str) -> float:
        dt = large[key]["seconds"] - small[key]["seconds"]
        return (large[by] - small[by]) / dt / 1e9 if dt > 0 else float("inf")  # inf: within the noise

    rows = [("`cp -r`", "cp", "bytes_ref"), ("`cat` of both checkpoints", "cat", "bytes_both"),
            ("`fold --no-check`", "fold", "bytes_ref"), ("`fold --fuse-affine --no-check`", "fuse", "bytes_ref"),
            ("`rotate --no-check`", "rotate", "bytes_ref"), ("`check --static`", "static", "bytes_both"),
            ("`check`", "check", "bytes_both")]
    g = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    lines = [f"| command | marginal throughput | {g(small['bytes_ref'])}: time, peak RSS | "
             f"{g(large['bytes_ref'])}: time, peak RSS |", "|---|---|---|---|"]
    for label, key, by in rows:
        lines.append(f"| {label} | {marginal(key, by):.2f} GB/s | {small[key]['seconds']:.2f} s, "
                     f"{small[key]['rss'] / 2**30:.2f} GiB | {large[key]['seconds']:.2f} s, "
                     f"{large[key]['rss'] / 2**30:.2f} GiB |")
    ratios = (f"Ratios from this run: `check --static` marginal throughput = "
              f"**{marginal('static', 'bytes_both') / marginal('cat', 'bytes_both'):.2f}×** `cat` of both; "
              f"`fold` = **{marginal('fold', 'bytes_ref') / marginal('cp', 'bytes_ref'):.2f}×** `cp`; "
              f"default `check` = **{large['check']['seconds'] / large['static']['seconds']:.2f}×** "
              f"`check --static` on {g(large['bytes_ref'])}; peak RSS of `rotate` "
              f"{large['rotate']['rss'] / 2**30:.2f} GiB and `fold --fuse-affine` "
              f"{large['fuse']['rss'] / 2**30:.2f} GiB on {g(large['bytes_ref'])}.")
    return "\n".join(lines + ["", ratios, "",
                              f"GPT-2-shaped fp32 checkpoints, width {WIDTH}, {layers} and {more} layers, read "
                              f"from the page cache; each command run {repeat} times, the fastest time and the "
                              f"largest peak RSS shown; {machine()}. Command: `python scripts/bench_check.py --write`."])


if __name__ == "__main__":
    main()
