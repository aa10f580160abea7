"""Check a checkpoint larger than a memory budget, and measure the peak memory of each mode.

Builds a GPT-2-shaped checkpoint of about 1 GB (width 1024, 20 layers, a vocabulary of
8,192, so that 512 MB holds the largest tensor and one forward's activations; random fp32
weights, LayerNorm gains and biases moved away from their init), folds it, then runs, each
in its own process under
``/usr/bin/time -v`` (peak RSS, wall time):

- ``enjoyln check REF FOLDED`` with both models in memory (the default where they fit);
- ``enjoyln check REF FOLDED --max-memory 512MB``: one model at a time, weights
  beyond the budget read from the safetensors files as each layer runs;
- ``enjoyln check REF FOLDED --static``: every weight, no forward pass;
- the bounded and static checks against a candidate with one element of one
  centered tensor moved by 1e-3 of its scale, and ``--static`` against a
  candidate with one LayerNorm bias dropped: each must exit 1.

    python scripts/bench_bounded_check.py [--workdir DIR] [--write]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402


def build(path: Path, layers: int = 20, width: int = 1024, vocab: int = 8192) -> int:
    import transformers

    config = transformers.GPT2Config(
        n_embd=width,
        n_layer=layers,
        n_head=width // 64,
        vocab_size=vocab,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=1,
        architectures=["GPT2LMHeadModel"],
    )
    with torch.device("meta"):
        shapes = {
            k: v.shape
            for k, v in transformers.GPT2LMHeadModel(config).state_dict().items()
            if k != "lm_head.weight"
        }
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * 0.02
        if ".ln_" in name:
            t = (
                (1 + 0.3 * torch.randn(shape, generator=gen))
                if name.endswith("weight")
                else 0.2 * torch.randn(shape, generator=gen)
            )
        elif name.endswith("bias"):
            t = 0.2 * torch.randn(shape, generator=gen)
        tensors[name] = t
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(path)
    return (path / "model.safetensors").stat().st_size


def timed(*args: str) -> dict:
    """Run ``enjoyln ARGS`` under /usr/bin/time -v: exit code, peak RSS (bytes), wall seconds."""
    proc = subprocess.run(
        ["/usr/bin/time", "-v", sys.executable, "-m", "enjoyln", *args],
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
    first = next((line for line in proc.stdout.splitlines() if line.strip()), "")
    print(
        f"  exit {proc.returncode}, peak RSS {rss / 2**30:.2f} GiB, {seconds:.1f} s: enjoyln "
        f"{' '.join(args[2:])} ({first})",
        flush=True,
    )
    return {"exit": proc.returncode, "rss": rss, "seconds": seconds, "stdout": proc.stdout}


def perturbed(src: Path, dst: Path, key: str, how: str) -> Path:
    """A copy of ``src`` with one tensor changed in place in the file."""
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    data = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    info = json.loads(data[8 : 8 + n])[key]
    lo, hi = (8 + n + v for v in info["data_offsets"])
    t = torch.frombuffer(data[lo:hi], dtype=torch.float32).clone()
    if how == "element":
        t[7] += 1e-3 * float(t.abs().max())
    else:
        t.zero_()
    data[lo:hi] = t.numpy().tobytes()
    file.write_bytes(bytes(data))
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--budget", default="512MB")
    parser.add_argument(
        "--write", action="store_true", help="put the figures into docs/checking.md"
    )
    args = parser.parse_args()
    root = (
        Path(tempfile.mkdtemp(prefix="enjoyln-bounded-")) if args.workdir is None else args.workdir
    )
    try:
        ref, folded = root / "ref", root / "folded"
        if not ref.exists():
            size = build(ref)
            print(f"built {size / 1e9:.2f} GB in {ref}", flush=True)
        size = (ref / "model.safetensors").stat().st_size
        if not folded.exists():
            subprocess.run(
                [sys.executable, "-m", "enjoyln", "fold", str(ref), str(folded), "--static"],
                check=True,
                capture_output=True,
            )
        wrong = (
            perturbed(folded, root / "wrong", "transformer.h.3.mlp.c_proj.weight", "element")
            if not (root / "wrong").exists()
            else root / "wrong"
        )
        no_beta = (
            perturbed(folded, root / "no-beta", "transformer.h.5.ln_2.bias", "zero")
            if not (root / "no-beta").exists()
            else root / "no-beta"
        )
        print("timing (each in its own process):", flush=True)
        runs = {
            "full": timed("check", str(ref), str(folded)),
            "bounded": timed("check", str(ref), str(folded), "--max-memory", args.budget),
            "static": timed("check", str(ref), str(folded), "--static"),
            "bounded_wrong": timed("check", str(ref), str(wrong), "--max-memory", args.budget),
            "bounded_wrong_forward": timed(
                "check", str(ref), str(wrong), "--max-memory", args.budget, "--forward-only"
            ),
            "static_wrong": timed("check", str(ref), str(wrong), "--static"),
            "static_no_beta": timed("check", str(ref), str(no_beta), "--static"),
        }
        folded_size = sum(p.stat().st_size for p in folded.glob("*.safetensors"))
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    expected = {
        "full": 0,
        "bounded": 0,
        "static": 0,
        "bounded_wrong": 1,
        "static_wrong": 1,
        "static_no_beta": 1,
    }
    bad = {k: r["exit"] for k, r in runs.items() if k in expected and r["exit"] != expected[k]}
    if bad:
        raise SystemExit(f"unexpected exit codes: {bad}")

    def row(label: str, key: str, note: str) -> str:
        r = runs[key]
        return (
            f"| {label} | {r['exit']} | {r['rss'] / 2**30:.2f} GiB | {r['seconds']:.0f} s | "
            f"{note} |"
        )

    forward = runs["bounded_wrong_forward"]["exit"]
    body = "\n".join(
        [
            "Synthetic GPT-2-shaped checkpoint, width 1024, 20 layers, vocabulary 8,192, fp32: "
            f"{size / 1e9:.2f} GB "
            f"(its fold: {folded_size / 1e9:.2f} GB with the untied "
            f"head). Each command in its own process under `/usr/bin/time -v`; {machine()}.",
            "",
            "| `enjoyln check REF CANDIDATE` | exit | peak RSS | wall | what |",
            "|---|---|---|---|---|",
            row("(both models in memory)", "full", "the default where they fit"),
            row(
                f"`--max-memory {args.budget}`",
                "bounded",
                "one model at a time, weights read from disk",
            ),
            row("`--static`", "static", "every weight, no forward pass"),
            row(
                f"`--max-memory {args.budget}`, one centered element moved by 1e-3 of its scale",
                "bounded_wrong",
                "caught by the weight check, before any forward",
            ),
            row("`--static`, the same candidate", "static_wrong", "caught"),
            row("`--static`, one LayerNorm bias dropped", "static_no_beta", "caught"),
            row(
                f"`--max-memory {args.budget} --forward-only`, the 1e-3 candidate",
                "bounded_wrong_forward",
                "outputs only, every token id swept",
            ),
            "",
            f"With `--forward-only` (no weight check) the same 1e-3 change exits {forward}: it "
            "moves the logits by "
            "less than the forward comparison's tolerance, which is why the weight check comes "
            "first.",
            "Command: `python scripts/bench_bounded_check.py --write`.",
        ]
    )
    print(body)
    if args.write:
        replace_section("bounded-check", body)


if __name__ == "__main__":
    main()
