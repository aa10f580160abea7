"""The gate and the file commands against the disk: two checkpoint sizes, side by side with cp and
cat.

Builds two GPT-2-shaped checkpoints with random fp32 weights (width 2048; by
default 1 layer, ~0.6 GB, and 10 layers, ~2.4 GB; LayerNorm gains and biases
moved away from their init), then for each, every command in its own process
under ``/usr/bin/time -v`` (wall time, peak RSS), one after the other in one run, each
``--repeat`` times after a ``sync``, the two sizes alternating (the fastest time and the largest
peak RSS are reported):

- ``cp -r`` of the reference, and ``cat`` of both checkpoints' files (the read floor);
- ``enjoyln fold --no-check``, ``fold --fuse-affine --no-check``, ``rotate --no-check``;
- ``enjoyln check --static`` and ``enjoyln check`` of the fold against the reference.

Every file a command reads is read once right before each of its runs, so all of them
read from the page cache (these virtual machines evict file pages left untouched for a
minute). The whole commands include seconds of start-up (imports, the meta model,
the analysis); the difference between the two sizes gives the marginal throughput
without it: bytes of the reference for cp and the folds, bytes of both checkpoints
for cat and the checks.

    python scripts/bench_check.py [--workdir DIR] [--layers 1] [--more-layers 10] [--repeat 5]
    [--write]
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
    print(
        f"  {label}: exit {proc.returncode}, {seconds:.2f} s ({cpu:.2f} s of CPU), peak RSS "
        f"{rss / 2**30:.2f} GiB",
        flush=True,
    )
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-2000:], file=sys.stderr)
    return {"exit": proc.returncode, "seconds": seconds, "rss": rss, "cpu": cpu}


def enjoyln(*args: object) -> list[str]:
    return [sys.executable, "-m", "enjoyln", *map(str, args)]


def warm(*dirs: Path) -> None:
    """Read every weight file of ``dirs`` once, so that the command after it reads from the page
    cache: a machine that reclaims file pages left untouched for a minute (DAMON's reclaim on
    these virtual machines) would otherwise time the disk for some runs and memory for others."""
    found = [str(f) for f in files(*(d for d in dirs if d.exists()))]
    if found:
        subprocess.run(["cat", *found], stdout=subprocess.DEVNULL, check=True)


IMPORTS = (
    "import torch, transformers, enjoyln.cli.app, enjoyln.rewrite.convert; "
    "transformers.GPT2LMHeadModel"
)


def run_once(cmd: list[str], label: str, reads: tuple[Path, ...]) -> dict:
    """One timed run from the same state as every other: the previous command's dirty pages
    written back (``sync``), and every file it reads in the page cache."""
    subprocess.run(["sync"], check=True)
    warm(*reads)
    if cmd[0] == sys.executable:  # the libraries' files too, which the same reclaim evicts
        subprocess.run([sys.executable, "-c", IMPORTS], check=True)
    return timed(cmd, label)


def fastest(runs: list[dict]) -> dict:
    """The fastest wall time (what the command costs: a shared virtual machine only ever adds to
    it, by seconds at a time), the largest peak RSS, and every time."""
    times = sorted(r["seconds"] for r in runs)
    return {
        "exit": max(r["exit"] for r in runs),
        "seconds": times[0],
        "rss": max(r["rss"] for r in runs),
        "times": times,
        "cpu": min(r["cpu"] for r in runs),
    }


def measure(refs: list[Path], roots: list[Path], repeat: int = 5) -> list[dict[str, dict]]:
    """Every command on both checkpoints, the two sizes alternating run by run, so that both meet
    the machine in the same states; each run writes to ``root/out``, removed after it."""
    folded = [root / "folded" for root in roots]
    for ref, root, f in zip(refs, roots, folded):  # the folds the checks read
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(enjoyln("fold", ref, f, "--no-check"), check=True, capture_output=True)
    both = lambda ref, f: (ref, f)  # noqa: E731
    commands: dict[
        str, tuple[str, Callable[[Path, Path, Path], list[str]], Callable[[Path, Path], tuple]]
    ] = {
        "cp": (
            "cp -r",
            lambda ref, out, f: ["cp", "-r", str(ref), str(out)],
            lambda ref, f: (ref,),
        ),
        "fold": (
            "fold --no-check",
            lambda ref, out, f: enjoyln("fold", ref, out, "--no-check"),
            lambda ref, f: (ref,),
        ),
        "cat": (
            "cat both",
            lambda ref, out, f: [
                "sh",
                "-c",
                'cat "$@" > /dev/null',
                "cat",
                *map(str, files(ref, f)),
            ],
            both,
        ),
        "fuse": (
            "fold --fuse-affine --no-check",
            lambda ref, out, f: enjoyln("fold", "--fuse-affine", ref, out, "--no-check"),
            lambda ref, f: (ref,),
        ),
        "rotate": (
            "rotate --no-check",
            lambda ref, out, f: enjoyln("rotate", ref, out, "--no-check"),
            lambda ref, f: (ref,),
        ),
        "static": (
            "check --static",
            lambda ref, out, f: enjoyln("check", ref, f, "--static"),
            both,
        ),
        "check": ("check", lambda ref, out, f: enjoyln("check", ref, f), both),
    }
    results: list[dict[str, dict]] = [{} for _ in refs]
    for key, (label, cmd, reads) in commands.items():
        runs: list[list[dict]] = [[] for _ in refs]
        for _ in range(repeat):
            for j, (ref, root, f) in enumerate(zip(refs, roots, folded)):
                runs[j].append(
                    run_once(cmd(ref, root / "out", f), f"{label} ({ref.name})", reads(ref, f))
                )
                shutil.rmtree(root / "out", ignore_errors=True)
        for j in range(len(refs)):
            results[j][key] = fastest(runs[j])
    for j, (ref, f) in enumerate(zip(refs, folded)):
        results[j]["bytes_ref"], results[j]["bytes_both"] = size(ref), size(ref) + size(f)
        for what in ("static", "fold"):
            results[j][f"in_{what}"] = min(
                in_process(what, ref, f, f.parent / "out") for _ in range(repeat)
            )
    return results


IN_PROCESS = """
import shutil, sys, time
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.checking.static import static_check
from enjoyln.rewrite.convert import fold_checkpoint
what, ref, cand, out = sys.argv[1:]
def run():
    start = time.perf_counter()
    if what == "static":
        assert static_check(open_checkpoint(ref), open_checkpoint(cand)).passed
    else:
        fold_checkpoint(ref, out, check="none")
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return seconds
run()  # the imports, the meta models, the analysis, the kernels
print(run())
"""


def in_process(what: str, ref: Path, folded: Path, out: Path) -> float:
    """Seconds of ``static_check`` (``what="static"``) or of ``fold_checkpoint`` into ``out``
    (``"fold"``) in a process that has run it once already: the weights' part, without the
    start-up that the whole commands' marginal figures subtract out, and without its noise."""
    subprocess.run(["sync"], check=True)
    warm(ref, folded)
    done = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, what, str(ref), str(folded), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def files(*dirs: Path) -> list[Path]:
    return [f for d in dirs for f in sorted(d.glob("*.safetensors"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--more-layers", type=int, default=10)
    parser.add_argument(
        "--repeat", type=int, default=5, help="runs of each command; the table has the fastest"
    )
    parser.add_argument(
        "--write", action="store_true", help="put the table into docs/performance.md"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="enjoyln-bench-check-", dir=args.workdir))
    try:
        refs = [work / f"ref{layers}" for layers in (args.layers, args.more_layers)]
        for layers, ref in zip((args.layers, args.more_layers), refs):
            print(
                f"{layers} layers: {build_checkpoint(ref, layers, WIDTH) / 1e9:.2f} GB", flush=True
            )
        runs = measure(
            refs, [work / f"out{layers}" for layers in (args.layers, args.more_layers)], args.repeat
        )
        text = table(*runs, args.layers, args.more_layers, args.repeat)
        print(text)
        if args.write:
            print(f"wrote {replace_section('bench-check', text)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(small: dict, large: dict, layers: int, more: int, repeat: int = 1) -> str:
    def marginal(key: str, by: str) -> float:
        dt = large[key]["seconds"] - small[key]["seconds"]
        return (
            (large[by] - small[by]) / dt / 1e9 if dt > 0 else float("inf")
        )  # inf: within the noise

    rows = [
        ("`cp -r`", "cp", "bytes_ref"),
        ("`cat` of both checkpoints", "cat", "bytes_both"),
        ("`fold --no-check`", "fold", "bytes_ref"),
        ("`fold --fuse-affine --no-check`", "fuse", "bytes_ref"),
        ("`rotate --no-check`", "rotate", "bytes_ref"),
        ("`check --static`", "static", "bytes_both"),
        ("`check`", "check", "bytes_both"),
    ]
    g = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    rate = lambda x: f"{x:.2f} GB/s" if x != float("inf") else "below the noise¹"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}×" if a != float("inf") and b != float("inf") else "n/a¹"  # noqa: E731
    lines = [
        f"| command | marginal throughput | {g(small['bytes_ref'])}: time, peak RSS | "
        f"{g(large['bytes_ref'])}: time, peak RSS |",
        "|---|---|---|---|",
    ]
    for label, key, by in rows:
        lines.append(
            f"| {label} | {rate(marginal(key, by))} | {small[key]['seconds']:.2f} s, "
            f"{small[key]['rss'] / 2**30:.2f} GiB | {large[key]['seconds']:.2f} s, "
            f"{large[key]['rss'] / 2**30:.2f} GiB |"
        )

    def inside(key: str, by: str) -> float:
        return (large[by] - small[by]) / max(large[key] - small[key], 1e-9) / 1e9

    lines += [
        f"| `fold_checkpoint` in process, after a first run (no start-up) | "
        f"{inside('in_fold', 'bytes_ref'):.2f} GB/s | {small['in_fold']:.2f} s | "
        f"{large['in_fold']:.2f} s |",
        f"| `static_check` in process, after a first run (no start-up) | "
        f"{inside('in_static', 'bytes_both'):.2f} GB/s | {small['in_static']:.2f} s | "
        f"{large['in_static']:.2f} s |",
    ]
    floor = large["bytes_both"] / large["cat"]["seconds"]
    cp = marginal("cp", "bytes_ref")
    ratios = (
        f"Ratios from this run: `check --static` marginal throughput = "
        f"**{ratio(marginal('static', 'bytes_both'), marginal('cat', 'bytes_both'))}** `cat` of "
        "both "
        f"(in process, {large['bytes_both'] / large['in_static'] / 1e9:.2f} GB/s on the larger "
        "pair = "
        f"**{large['bytes_both'] / large['in_static'] / floor:.2f}×** `cat` of it); "
        f"`fold` = **{ratio(marginal('fold', 'bytes_ref'), cp)}** `cp` "
        f"(in process, **{ratio(inside('in_fold', 'bytes_ref'), cp)}**); "
        f"default `check` = **{large['check']['seconds'] / large['static']['seconds']:.2f}×** "
        f"`check --static` on {g(large['bytes_ref'])}; peak RSS of `rotate` "
        f"{large['rotate']['rss'] / 2**30:.2f} GiB and `fold --fuse-affine` "
        f"{large['fuse']['rss'] / 2**30:.2f} GiB on {g(large['bytes_ref'])}."
    )
    notes = (
        [
            "",
            "¹ The larger checkpoint took no longer than the smaller: what each further gigabyte "
            "costs "
            "is below what whole commands on this machine resolve.",
        ]
        if "¹" in "\n".join(lines + [ratios])
        else []
    )
    return "\n".join(
        lines
        + notes
        + [
            "",
            ratios,
            "",
            f"GPT-2-shaped fp32 checkpoints, width {WIDTH}, {layers} and {more} layers, read "
            f"from the page cache; each command run {repeat} times, the two sizes alternating, "
            f"the fastest time and the largest peak RSS shown; {machine()}. "
            "Command: `python scripts/bench_check.py --write`.",
        ]
    )


if __name__ == "__main__":
    main()
