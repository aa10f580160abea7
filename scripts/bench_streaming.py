"""Fold a synthetic sharded checkpoint larger than 8 GB, and measure memory and speed.

Builds GPT-2-shaped checkpoints with random fp32 weights (width 4096; 10
layers, ~9 GB, and 20 layers, ~17 GB), written shard by shard so this script
never holds more than one shard. Then, side by side for each:

- a plain copy of the same files (``cp -r``), timed;
- ``enjoyln fold --no-check`` in a subprocess, timed, with its peak RSS.

The whole command includes seconds of fixed start-up (importing torch and
transformers, the meta-device analysis); the difference between the two
sizes gives the throughput without it.

    python scripts/bench_streaming.py [--workdir DIR] [--layers 10] [--more-layers 20] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402


def build(path: Path, layers: int, width: int, shard_bytes: int = 2 << 30) -> int:
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=width // 128, vocab_size=50257, n_positions=1024
    )
    config.architectures = ["GPT2LMHeadModel"]
    path.mkdir(parents=True)
    config.save_pretrained(path)
    d = width
    shapes = {"transformer.wte.weight": (50257, d), "transformer.wpe.weight": (1024, d)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "attn.c_attn.weight": (d, 3 * d),
                p + "attn.c_attn.bias": (3 * d,),
                p + "attn.c_proj.weight": (d, d),
                p + "attn.c_proj.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "mlp.c_fc.weight": (d, 4 * d),
                p + "mlp.c_fc.bias": (4 * d,),
                p + "mlp.c_proj.weight": (4 * d, d),
                p + "mlp.c_proj.bias": (d,),
            }
        )
    shapes.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        n = 4 * torch.Size(shape).numel()
        if current and size + n > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    groups.append(current)
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=gen) * 0.02 + 0.01 for n in names}
        save_file(tensors, path / file, metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update({n: file for n in names})
        del tensors
        print(f"  wrote {file}", file=sys.stderr)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return total


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Wall time, peak RSS (bytes, from /usr/bin/time) and stdout of a child process."""
    start = time.perf_counter()
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *cmd], check=True, capture_output=True, text=True
    )
    secs = time.perf_counter() - start
    peak_kb = int(proc.stderr.strip().splitlines()[-1])
    return secs, peak_kb * 1024, proc.stdout


def _ram_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def measure(src: Path, root: Path, runs: int) -> tuple[float, float, float, int]:
    """(copy s, fold s, fold's streaming s, peak RSS) for one checkpoint: best of ``runs``
    alternating runs of each, so both see the same page cache."""
    copies, folds = [], []
    for _ in range(runs):
        copies.append(timed(["cp", "-r", str(src), str(root / "copy")])[0])
        shutil.rmtree(root / "copy")
        secs, rss, stdout = timed(
            [
                sys.executable,
                "-m",
                "enjoyln",
                "fold",
                str(src),
                str(root / "out"),
                "--no-check",
                "--json",
            ]
        )
        folds.append((secs, json.loads(stdout)["stream_seconds"], rss))
        shutil.rmtree(root / "out")
    fold_s, stream_s, _ = min(folds)
    return min(copies), fold_s, stream_s, max(f[2] for f in folds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument(
        "--more-layers",
        type=int,
        default=20,
        help="a second, larger checkpoint, for the marginal throughput (0: skip)",
    )
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--write", action="store_true", help="update the figures in docs/performance.md"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="enjoyln-stream-", dir=args.workdir))
    try:
        results = []
        for layers in [args.layers] + ([args.more_layers] if args.more_layers else []):
            src = root / f"big-{layers}"
            print(f"building a synthetic checkpoint with {layers} layers in {src}", file=sys.stderr)
            total = build(src, layers, args.width)
            subprocess.run(["sync"], check=False)
            results.append(
                (total, len(list(src.glob("*.safetensors"))), *measure(src, root, args.runs))
            )
            shutil.rmtree(src)
        rows = [
            "| checkpoint | `cp -r` | `enjoyln fold --no-check` | fold / copy throughput | peak "
            "RSS |",
            "|---|---|---|---|---|",
        ]
        for total, shards, copy_s, fold_s, stream_s, rss in results:
            rows.append(
                f"| {total / 1e9:.2f} GB, {shards} shards | {copy_s:.1f} s "
                f"({total / 1e9 / copy_s:.2f} GB/s) "
                f"| {fold_s:.1f} s ({total / 1e9 / fold_s:.2f} GB/s) | **{copy_s / fold_s:.2f}** "
                f"| {rss / 2**30:.2f} GiB |"
            )
        lines = [
            f"Synthetic GPT-2-shaped checkpoints, width {args.width}, fp32, random weights; "
            f"{machine()}. "
            f"Best of {args.runs} alternating runs each, so both meet the same page cache (on this "
            f"{_ram_gb():.0f} GB machine it cannot hold input and output of the larger one).",
            "",
            *rows,
            "",
        ]
        if len(results) == 2:
            (b1, _, c1, f1, _, _), (b2, _, c2, f2, _, _) = results
            copy_rate, fold_rate = (b2 - b1) / (c2 - c1) / 1e9, (b2 - b1) / (f2 - f1) / 1e9
            lines.append(
                "Marginal throughput, from the difference between the two sizes (what each "
                "further "
                f"gigabyte costs, start-up excluded): copy {copy_rate:.2f} GB/s, fold "
                f"{fold_rate:.2f} GB/s, "
                f"fold / copy = **{fold_rate / copy_rate:.2f}**."
            )
        lines.append("Command: `python scripts/bench_streaming.py --write`.")
        text = "\n".join(lines)
        print(text)
        if args.write:
            replace_section("streaming", text)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
