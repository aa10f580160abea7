"""Fold the same inputs with two source trees and compare the outputs byte for byte.

For refactors that must not change behaviour: each case (a small model directory and the
command that folds it) runs once with the tree under test and once with a baseline tree (a
checkout of an earlier commit, e.g. ``git worktree add /tmp/base 8744ee9``), each in its own
process, and every file of the two outputs is compared with ``cmp``'s rule (same names, same
bytes). The cases: a plain fold (early copy), ``--max-shard-size``, ``--fuse-affine``,
``rotate`` (Hadamard and random, without ``keep_mean``), a pickle input, a sharded BERT, a
sharded GPT-2 (its head untied into a shard), and a
timm hub-format directory (fold and fuse-affine) where timm imports. Each process runs inside
its tree, which is checked to be the one imported (an editable install would otherwise win), and
imports a torchvision built for another torch the way ``enjoyln.compat`` does, which a baseline
from before it cannot. For the timm cases, an environment beside the main one::

    python -m venv --system-site-packages /work/venv-timm
    /work/venv-timm/bin/pip install --no-deps torchvision==0.28.0 timm==1.0.29
    /work/venv-timm/bin/python scripts/compare_folds.py --baseline /tmp/base

    python scripts/compare_folds.py --baseline /tmp/base [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "plain": ("gpt2", ["fold", "--static"]),
    "sharded-out": ("gpt2", ["fold", "--static", "--max-shard-size", "200KB"]),
    "fuse-affine": ("gpt2", ["fold", "--static", "--fuse-affine"]),
    "hadamard": ("gpt2", ["rotate", "--static"]),
    "random-no-keep-mean": ("opt", ["rotate", "--static", "--kind", "random", "--no-keep-mean"]),
    "pickle": ("gpt2-pickle", ["fold", "--static", "--allow-pickle"]),
    "bert-sharded": ("bert-sharded", ["fold", "--static"]),
    "bloom-auxiliary": ("bloom", ["fold", "--static", "--auxiliary-centering"]),
    "vit": ("vit", ["fold", "--static"]),
    "gpt2-sharded-in": ("gpt2-sharded", ["fold", "--static"]),
    "gpt2-sharded-in-fused": ("gpt2-sharded", ["fold", "--static", "--fuse-affine"]),
}
TIMM_CASES = {  # where timm imports
    "timm-vit": ("timm-vit", ["fold", "--static"]),
    "timm-vit-fused": ("timm-vit", ["fold", "--static", "--fuse-affine"]),
}

BUILD = r"""
import sys, torch
from pathlib import Path
from enjoyln.testing import demo_checkpoint, perturb, tiny_model
kind, path = sys.argv[1], Path(sys.argv[2])
if kind == "gpt2":
    demo_checkpoint(path, layers=2, width=128, vocab=256)
elif kind == "gpt2-pickle":
    perturb(tiny_model("gpt2"), seed=5).save_pretrained(path, safe_serialization=False)
elif kind == "gpt2-sharded":  # the tied head untied into a sharded input
    perturb(tiny_model("gpt2"), seed=8).save_pretrained(path, max_shard_size="100KB")
elif kind == "timm-vit":  # timm's hub format, with the depth it was built at
    import json, timm
    from timm.models._hub import save_for_hf
    save_for_hf(perturb(timm.create_model("vit_tiny_patch16_224", depth=2), seed=9), path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_args": {"depth": 2}}))
elif kind == "bert-sharded":
    perturb(tiny_model("bert"), seed=6).save_pretrained(path, max_shard_size="100KB")
else:
    perturb(tiny_model(kind), seed=7).save_pretrained(path)
"""  # noqa: E501


def build(kind: str, path: Path) -> None:
    if not path.exists():
        subprocess.run(
            [sys.executable, "-c", BUILD, kind, str(path)], check=True, capture_output=True
        )


def check_tree(tree: Path) -> None:
    """That a process given ``tree`` imports enjoyln from it: an editable install (or a missing
    tree) would silently compare the installed code with itself."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", "import enjoyln; print(enjoyln.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    found = Path(proc.stdout.strip()).resolve() if proc.returncode == 0 else None
    if found is None or not found.is_relative_to(tree.resolve()):
        raise SystemExit(
            f"{tree}: enjoyln imports from {found or proc.stderr.strip()}, not from this tree"
        )


# A baseline from before enjoyln.compat cannot import a torchvision built for another torch:
# import it first with the same skip (fake kernels of operators that do not exist), then run.
RUN = r"""
import runpy, sys, torch, torch.library
try:
    import torchvision
except ImportError:
    pass
except RuntimeError:
    sys.modules.pop("torchvision", None)
    original = torch.library.register_fake
    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            try:
                getattr(torch.ops.torchvision, op.split("::")[1].split(".")[0])
            except (AttributeError, RuntimeError):
                return None if args else (lambda fn: fn)
        return original(op, *args, **kwargs)
    torch.library.register_fake = register_fake
    import torchvision
    torch.library.register_fake = original
sys.argv = ["enjoyln", *sys.argv[1:]]
runpy.run_module("enjoyln", run_name="__main__")
"""


def timm_imports() -> bool:
    return (
        subprocess.run(
            [sys.executable, "-c", "import enjoyln, timm"], capture_output=True
        ).returncode
        == 0
    )


def fold(tree: Path, args: list[str], src: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command, *options = args
    # run in the tree: ``python -c`` puts the working directory first on the path
    proc = subprocess.run(
        [sys.executable, "-c", RUN, command, str(src), str(out), *options],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"{tree}: enjoyln {' '.join(args)} failed:\n{proc.stdout[-800:]}{proc.stderr[-800:]}"
        )


def differences(a: Path, b: Path) -> list[str]:
    out = []
    names_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    names_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    out += [f"only in one: {n}" for n in sorted(names_a ^ names_b)]
    out += [
        f"differs: {n}"
        for n in sorted(names_a & names_b)
        if not filecmp.cmp(a / n, b / n, shallow=False)
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline", type=Path, required=True, help="a checkout of the tree to compare against"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", default="", help="comma-separated case names")
    args = parser.parse_args()
    args.baseline = args.baseline.resolve()
    for tree in (ROOT, args.baseline):
        check_tree(tree)
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="enjoyln-compare-"))).resolve()
    bad = 0
    cases = {**CASES, **(TIMM_CASES if timm_imports() else {})}
    for name, (kind, command) in cases.items():
        if args.only and name not in args.only.split(","):
            continue
        src = work / "inputs" / kind
        build(kind, src)
        outs = []
        for label, tree in (("tree", ROOT), ("baseline", args.baseline)):
            out = work / label / name
            shutil.rmtree(out, ignore_errors=True)
            fold(tree, command, src, out)
            outs.append(out)
        diff = differences(*outs)
        bad += bool(diff)
        print(f"{name}: {'identical' if not diff else 'DIFFERENT: ' + '; '.join(diff)}", flush=True)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
