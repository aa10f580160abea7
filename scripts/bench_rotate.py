"""Rotation against the disk: `rotate` and `check --static` of its output, side by side with cp and
cat.

For each width (2048, 1600 and 4544 by default: a power of two, GPT-2 XL's and Falcon-7B's, whose
odd parts are 1, 25 and 71), builds two GPT-2-shaped fp32 checkpoints of different depth (each at
least 0.4 GB; LayerNorm gains and biases moved away from their init), then runs in its own process,
each ``--repeat`` times after a ``sync`` with every file it reads in the page cache, the two sizes
one after the other (each marginal the median of the repeats' paired differences; the largest
peak RSS counts):

- ``cp -r`` of the reference, and ``cat`` of the reference and the rotated checkpoint (the read
floor);
- ``enjoyln rotate --no-check`` (the structured hadamard rotation, keeping the mean);
- ``enjoyln check --static`` of the rotated checkpoint against the reference;

and once, ``enjoyln check`` (the default check) of each rotated checkpoint. The difference between
the two sizes gives each command's marginal throughput, start-up excluded: bytes of the reference
for cp and rotate, bytes of both checkpoints for cat and the static check.

``--big`` instead measures one Falcon-180B-shaped bf16 checkpoint (width 14848 = 29 * 512, 232
heads, 8 key-value heads, MLP 59392, untied head; ``--big-layers`` layers, 4 by default, and a
vocabulary of ``--big-vocab``, 65024 by default: 21.6 GB), once each: cp, rotate, check --static,
cat of both.

    python scripts/bench_rotate.py [--workdir DIR] [--widths 2048,1600,4544] [--repeat 1] [--write]
    python scripts/bench_rotate.py --big [--workdir DIR] [--big-layers 4] [--big-vocab 65024]
    [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402
from bench_bounded_check import build as build_gpt2  # noqa: E402
from bench_check import enjoyln, fastest, files, run_once, size  # noqa: E402

SETTLE = 15.0
"""Seconds between removing a command's output and the next timed command: long enough for the
guest to hand the freed pages back (cp of a 4 GB checkpoint took 3.4-4.7 s right after removing
the previous copy, 6.5-8.3 s five to ten seconds after, on the machine of docs/performance.md)."""

DEPTHS = {2048: (2, 8), 1600: (3, 12), 4544: (1, 4)}
"""Layers of the two checkpoints of each width (vocabulary 8192): each at least 0.4 GB, and a
difference of over a gigabyte, so that the start-up's variation does not swamp it."""


def measure_width(width: int, work: Path, repeat: int) -> list[dict]:
    """The commands on both sizes of one width; each result keyed by command. The rotated
    checkpoints the checks read are written first, untimed; then every timed command that writes
    writes to ``out``, removed after it, and the next run starts ``SETTLE`` seconds later, so that
    each meets the page cache in the same state: on a virtual machine, pages the guest freed long
    ago cost the host a fault each when written again, and pages freed a moment ago do not. Without
    the wait ``cp`` wrote into the pages the previous output had just given back, while ``rotate``
    (whose writes begin seconds into its start-up) met them already returned to the host."""
    refs, rotated = [], []
    for layers in DEPTHS.get(width, (2, 4)):
        ref, out = work / f"ref-{width}-{layers}", work / f"rotated-{width}-{layers}"
        print(
            f"width {width}, {layers} layers: {build_gpt2(ref, layers, width) / 1e9:.2f} GB",
            flush=True,
        )
        refs.append(ref)
        rotated.append(out)
        if run_once(enjoyln("rotate", ref, out, "--no-check"), f"rotate ({ref.name})", (ref,))[
            "exit"
        ]:
            raise SystemExit(f"rotate {ref} failed")
    commands = {
        "rotate": (
            lambda ref, rot, out: enjoyln("rotate", ref, out, "--no-check"),
            lambda ref, rot: (ref,),
        ),
        "cp": (lambda ref, rot, out: ["cp", "-r", str(ref), str(out)], lambda ref, rot: (ref,)),
        "cat": (
            lambda ref, rot, out: [
                "sh",
                "-c",
                'cat "$@" > /dev/null',
                "cat",
                *map(str, files(ref, rot)),
            ],
            lambda ref, rot: (ref, rot),
        ),
        "static": (
            lambda ref, rot, out: enjoyln("check", ref, rot, "--static"),
            lambda ref, rot: (ref, rot),
        ),
    }
    runs: dict[str, list[list[dict]]] = {key: [[] for _ in refs] for key in commands}
    for _ in range(repeat):  # the commands take turns, so that a busy minute hits them all
        for key, (cmd, reads) in commands.items():
            for j, (ref, rot) in enumerate(zip(refs, rotated)):
                runs[key][j].append(
                    run_once(cmd(ref, rot, work / "out"), f"{key} ({ref.name})", reads(ref, rot))
                )
                if (work / "out").exists():
                    shutil.rmtree(work / "out", ignore_errors=True)
                    time.sleep(SETTLE)
    results: list[dict] = [
        {key: {**fastest(runs[key][j]), "runs": runs[key][j]} for key in commands}
        for j in range(len(refs))
    ]
    for j, (ref, rot) in enumerate(zip(refs, rotated)):
        results[j]["check"] = run_once(
            enjoyln("check", ref, rot), f"check ({ref.name})", (ref, rot)
        )
        results[j]["bytes_ref"], results[j]["bytes_both"] = size(ref), size(ref) + size(rot)
    for path in refs + rotated:
        shutil.rmtree(path)
    return results


def paired(small: dict, large: dict, key: str, field: str) -> list[float]:
    """The larger checkpoint's ``field`` (seconds, cpu) minus the smaller's, repeat by repeat: the
    two ran one after the other, so each difference meets the machine in one state."""
    return [b[field] - a[field] for a, b in zip(small[key]["runs"], large[key]["runs"])]


def width_rows(width: int, small: dict, large: dict) -> tuple[str, dict]:
    """One table row for a width, and its ratios: each marginal the median of the repeats' paired
    differences, each ratio's range that of the repeats' own ratios."""

    def rate(by: str, dt: float) -> float:
        """NaN where the larger checkpoint took no longer: other jobs swamped the difference."""
        return (large[by] - small[by]) / dt / 1e9 if dt > 0 else math.nan

    def marginal(key: str, by: str, field: str = "seconds") -> float:
        return rate(by, statistics.median(paired(small, large, key, field)))

    def spread(key: str, base: str, by: str, base_by: str) -> tuple[float, float]:
        """The repeats' own ratios, lowest and highest; NaN for both where a repeat's larger
        checkpoint took no longer (min and max would drop a NaN, or not, by its place)."""
        ratios = [
            rate(by, d) / rate(base_by, b)
            for d, b in zip(
                paired(small, large, key, "seconds"), paired(small, large, base, "seconds")
            )
        ]
        if not all(math.isfinite(r) for r in ratios):
            return math.nan, math.nan
        return min(ratios), max(ratios)

    def per_cpu(key: str, by: str) -> float:
        """GB per second of CPU time (user and system, all threads), marginal: what the work costs
        the cores."""
        return marginal(key, by, "cpu")

    def f(x: float) -> str:
        return f"{x:.2f}" if math.isfinite(x) else "–"

    def span(lo_hi: tuple[float, float]) -> str:
        return f"({f(lo_hi[0])}–{f(lo_hi[1])})" if math.isfinite(lo_hi[0]) else "(–)"

    cp, cat = marginal("cp", "bytes_ref"), marginal("cat", "bytes_both")
    rot, static = marginal("rotate", "bytes_ref"), marginal("static", "bytes_both")
    ratios = {
        "rotate/cp": rot / cp,
        "static/cat": static / cat,
        "rotate/cp range": spread("rotate", "cp", "bytes_ref", "bytes_ref"),
        "static/cat range": spread("static", "cat", "bytes_both", "bytes_both"),
        "rotate cpu": per_cpu("rotate", "bytes_ref"),
        "static cpu": per_cpu("static", "bytes_both"),
        "check/static": large["check"]["seconds"] / large["static"]["seconds"],
        "rss": {k: max(r[k]["rss"] for r in (small, large)) for k in ("rotate", "static", "check")},
        "passed": all(r["check"]["exit"] == 0 for r in (small, large)),
    }
    k = width & -width
    row = (
        f"| {width} = {k} × {width // k} | {small['bytes_ref'] / 1e9:.2f} / "
        f"{large['bytes_ref'] / 1e9:.2f} GB "
        f"| {f(cp)} | {f(rot)} | **{f(ratios['rotate/cp'])}** {span(ratios['rotate/cp range'])} "
        f"| {f(cat)} | {f(static)} | **{f(ratios['static/cat'])}** "
        f"{span(ratios['static/cat range'])} "
        f"| {f(ratios['rotate cpu'])} / {f(ratios['static cpu'])} "
        f"| {ratios['check/static']:.2f} | "
        f"{' / '.join(f'{v / 2**30:.2f}' for v in ratios['rss'].values())} GiB "
        f"| {'passed' if ratios['passed'] else 'FAILED'} |"
    )
    return row, ratios


def widths_table(results: dict[int, list[dict]], repeat: int, load: str) -> str:
    lines = [
        "| width | checkpoints | `cp` GB/s | `rotate` GB/s | rotate / cp | `cat` both GB/s "
        "| `check --static` GB/s | static / cat | GB per CPU-second: rotate / static "
        "| `check` / `check --static` | peak RSS: rotate / static / check | `check` |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [width_rows(width, *runs)[0] for width, runs in results.items()]
    return "\n".join(
        lines
        + [
            "",
            "Marginal throughputs (the difference between the two sizes of each width, start-up "
            "excluded): "
            "bytes of the reference for `cp` and `rotate --no-check`, of both checkpoints for "
            "`cat` and "
            "`check --static`; GB per CPU-second is the same difference over the commands' CPU "
            "time (user and "
            "system, all threads): what the work costs the cores, whatever else runs. `check / "
            "check --static` is "
            "the ratio of whole commands on the larger checkpoint; "
            "peak RSS the larger of the two runs of each command; `check` the default check of "
            "each rotated "
            f"output. GPT-2-shaped fp32 checkpoints, vocabulary 8192; each command run {repeat} "
            f"time{'s' if repeat != 1 else ''}, the two "
            "sizes one after the other, each marginal the median of the repeats' paired "
            "differences (in parentheses, the range of the repeats' own ratios); each command "
            "that writes started "
            f"{SETTLE:g} s after the previous output was removed (on a virtual machine, pages "
            "freed a moment before are cheaper to write than ones the host has taken back; "
            "without the wait `cp` got the cheap ones and `rotate` did not); "
            f"{machine()}; {load}. Each command also "
            "pays its start-up (importing torch and transformers, the analysis: about 10 s, "
            "varying by a second from run to run), which the difference cancels only on average: "
            "the ratios, measured side by side, mean more than the rates (– : the larger "
            "checkpoint took no longer). "
            "Command: `python scripts/bench_rotate.py --write`.",
        ]
    )


BIG = dict(width=14848, heads=232, kv_heads=8, ffn=59392, vocab=65024)
"""Falcon-180B's layer shape."""


def build_falcon(path: Path, layers: int) -> int:
    """A Falcon-180B-shaped bf16 checkpoint (new decoder architecture), one shard per layer."""
    from transformers import FalconConfig

    d, head = BIG["width"], BIG["width"] // BIG["heads"]
    config = FalconConfig(
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=BIG["heads"],
        num_kv_heads=BIG["kv_heads"],
        new_decoder_architecture=True,
        parallel_attn=True,
        bias=False,
        vocab_size=BIG["vocab"],
        ffn_hidden_size=BIG["ffn"],
        tie_word_embeddings=False,
        architectures=["FalconForCausalLM"],
        torch_dtype="bfloat16",
    )
    path.mkdir(parents=True)
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(
        1 << 24, generator=gen
    )  # 16 Mi values, tiled: drawing 10 G of them would take longer than the run

    def randn(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16).view(-1)
        for start in range(0, out.numel(), noise.numel()):
            piece = out[start : start + noise.numel()]
            piece.copy_(noise[: piece.numel()] * std + mean)
        return out.view(shape)

    weight_map, total, count = {}, 0, layers + 2
    for i in range(count):  # one shard at a time: the embedding, each layer, the head
        if i == 0:
            tensors = {"transformer.word_embeddings.weight": randn(BIG["vocab"], d)}
        elif i == count - 1:
            tensors = {
                "transformer.ln_f.weight": randn(d, std=0.3, mean=1.0),
                "transformer.ln_f.bias": randn(d, std=0.2),
                "lm_head.weight": randn(BIG["vocab"], d),
            }
        else:
            p = f"transformer.h.{i - 1}."
            tensors = {
                p + "ln_attn.weight": randn(d, std=0.3, mean=1.0),
                p + "ln_attn.bias": randn(d, std=0.2),
                p + "ln_mlp.weight": randn(d, std=0.3, mean=1.0),
                p + "ln_mlp.bias": randn(d, std=0.2),
                p + "self_attention.query_key_value.weight": randn(
                    d + 2 * BIG["kv_heads"] * head, d
                ),
                p + "self_attention.dense.weight": randn(d, d),
                p + "mlp.dense_h_to_4h.weight": randn(BIG["ffn"], d),
                p + "mlp.dense_4h_to_h.weight": randn(d, BIG["ffn"]),
            }
        name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        save_file(tensors, path / name, metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({k: name for k in tensors})
        del tensors
        print(f"  wrote {name}", file=sys.stderr, flush=True)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return total


def measure_big(work: Path, layers: int) -> str:
    ref, out = work / "falcon", work / "rotated"
    total = build_falcon(ref, layers)
    load = os.getloadavg()[0]
    print(f"Falcon-180B-shaped, {layers} layers: {total / 1e9:.2f} GB", flush=True)
    cp = run_once(["cp", "-r", str(ref), str(work / "copy")], "cp", (ref,))
    shutil.rmtree(work / "copy")
    time.sleep(SETTLE)
    rot = run_once(enjoyln("rotate", ref, out, "--no-check"), "rotate", (ref,))
    static = run_once(enjoyln("check", ref, out, "--static"), "check --static", (ref, out))
    cat = run_once(
        ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, files(ref, out))],
        "cat both",
        (ref, out),
    )
    both = total + size(out)
    load = (
        f"load average {load:.1f} before the first command, {os.getloadavg()[0]:.1f} after the last"
    )
    rate = lambda r, n: (
        f"{r['seconds']:.0f} s ({n / r['seconds'] / 1e9:.2f} GB/s), {r['cpu']:.0f} s of CPU"
    )  # noqa: E731
    return "\n".join(
        [
            f"A Falcon-180B-shaped bf16 checkpoint: width {BIG['width']} = 29 × 512, "
            f"{BIG['heads']} heads, "
            f"{BIG['kv_heads']} key-value heads, MLP {BIG['ffn']} (Falcon-180B's layer), "
            f"vocabulary {BIG['vocab']}, "
            f"untied head, {layers} "
            f"layers: {total / 1e9:.1f} GB in {len(list(ref.glob('*.safetensors')))} shards. Each "
            "command once, "
            "whole (start-up included), its inputs read once before it (this machine's page cache "
            "cannot hold both "
            f"checkpoints); {machine()}; {load}.",
            "",
            "| command | wall time | peak RSS | exit |",
            "|---|---|---|---|",
            f"| `cp -r` | {rate(cp, total)} | {cp['rss'] / 2**30:.2f} GiB | {cp['exit']} |",
            f"| `rotate --no-check` | {rate(rot, total)} | {rot['rss'] / 2**30:.2f} GiB | "
            f"{rot['exit']} |",
            f"| `cat` of both | {rate(cat, both)} | {cat['rss'] / 2**30:.2f} GiB | {cat['exit']} |",
            f"| `check --static` | {rate(static, both)} | {static['rss'] / 2**30:.2f} GiB | "
            f"{static['exit']} |",
            "",
            f"rotate / cp = **{cp['seconds'] / rot['seconds']:.2f}**, check --static / cat of both "
            "= "
            f"**{cat['seconds'] / static['seconds']:.2f}**. Command: `python "
            "scripts/bench_rotate.py --big --big-layers "
            f"{layers} --big-vocab {BIG['vocab']} --write`.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--widths", default="2048,1600,4544")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each command; the median of the paired differences counts",
    )
    parser.add_argument(
        "--big", action="store_true", help="the Falcon-180B-shaped checkpoint instead"
    )
    parser.add_argument("--big-layers", type=int, default=4)
    parser.add_argument(
        "--big-vocab", type=int, default=BIG["vocab"], help="the big checkpoint's vocabulary"
    )
    parser.add_argument(
        "--write", action="store_true", help="put the table into docs/performance.md"
    )
    args = parser.parse_args()
    if args.workdir is not None:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="enjoyln-bench-rotate-", dir=args.workdir))
    try:
        if args.big:
            BIG["vocab"] = args.big_vocab
            text, block = measure_big(work, args.big_layers), "rotate-big"
        else:
            before = os.getloadavg()[0]
            results = {
                int(w): measure_width(int(w), work, args.repeat) for w in args.widths.split(",")
            }
            load = (
                f"load average {before:.1f} before the first command, "
                f"{os.getloadavg()[0]:.1f} after the last"
            )
            text, block = widths_table(results, args.repeat, load), "rotate"
            for width, runs in results.items():
                print(f"{width}: {width_rows(width, *runs)[1]}")
        print(text)
        if args.write:
            print(f"wrote {replace_section(block, text)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
