"""Which torch releases enjoyln works on: each minor release installed into a venv of its own, then
tried.

For each version, a fresh virtual environment gets ``torch==X.Y.*`` and this tree (editable, the
other dependencies resolving as pip picks them), and a child process in it tries, each step on its
own:

- ``import``: ``import enjoyln`` and ``enjoyln.ops``, and the kernels (``rms_norm``, ``RMSNorm``,
and its
  gradients) against the float64 reference;
- ``fold``: ``enjoyln fold`` of a small GPT-2 (``enjoyln.testing.demo_checkpoint``), its check
included;
- ``load``: ``enjoyln.load`` of the folded directory, logits against the original's;
- ``compile``: ``torch.compile`` of the loaded model, logits against eager;
- ``export``: ``torch.export.export`` of the loaded model, one ``enjoyln.rms_norm`` node per norm.

Results are kept in ``docs/data/torch_versions.json`` (one entry per version, the latest run's), so
versions can be run one at a time; ``--write`` puts the table of all of them into the
``torch-versions`` block. Each venv is removed after its run (``--keep`` keeps it): a CUDA build of
torch with its nvidia-* wheels takes several GB, and nothing is cached (``--no-cache-dir``).

    python scripts/check_torch_versions.py --versions 2.6,2.7 [--write] [--workdir /tmp/tv] [--keep]
    python scripts/check_torch_versions.py --write            # the table from the kept results only
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "data" / "torch_versions.json"
VERSIONS = ("2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13")
STEPS = ("import", "fold", "load", "compile", "export")


# --- in the venv: the steps
# ------------------------------------------------------------------------------


def _kernels() -> str:
    import torch

    import enjoyln.ops
    from enjoyln.modules.norm import RMSNorm
    from enjoyln.ops.reference import rms_norm_reference

    x = torch.randn(6, 64)
    w, b = torch.randn(64), torch.randn(64)
    want = rms_norm_reference(x.double(), (64,), w.double(), b.double(), 1e-5)
    got = enjoyln.ops.rms_norm(x, (64,), w, b)
    err = float((got.double() - want).abs().max())
    if err > 1e-5:
        raise AssertionError(f"rms_norm is {err:.1e} from the float64 reference")
    norm = RMSNorm(64, bias=True).double()
    xd = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    if not torch.autograd.gradcheck(lambda t: norm(t), (xd,)):
        raise AssertionError("RMSNorm's gradients fail gradcheck")
    wg = w.clone().requires_grad_()  # float32 with a gradient: the kernel as one autograd node
    enjoyln.ops.rms_norm(x, (64,), wg, b).sum().backward()
    wd = w.double().requires_grad_()
    rms_norm_reference(x.double(), (64,), wd, b.double(), 1e-5).sum().backward()
    err = float((wg.grad.double() - wd.grad).abs().max())
    if err > 1e-4:
        raise AssertionError(f"the weight's gradient is {err:.1e} from the float64 reference's")
    return f"kernels: {enjoyln.ops.backend(x, w, b)}, gradients within {err:.0e}"


def _fold(src: Path, dst: Path) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "enjoyln", "fold", str(src), str(dst), "--quiet"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if run.returncode:
        raise RuntimeError((run.stderr or run.stdout).strip().splitlines()[-1])
    return "folded and checked"


def _logits(model, ids):  # noqa: ANN001, ANN202
    import torch

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return (out.logits if hasattr(out, "logits") else out[0]).double()


class OriginalFails(Exception):
    """The unfolded model fails the same step: the step fails for transformers or torch, not for
    enjoyln."""


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _blame(exc: Exception, original) -> Exception:  # noqa: ANN001
    """The folded model's failure ``exc`` as ``OriginalFails`` where ``original()`` (the same step
    on the unfolded model) fails too, else ``exc``."""
    try:
        original()
    except Exception:  # noqa: BLE001 - any failure of the original's: the step is not enjoyln's to pass
        return OriginalFails(_first_line(exc))
    return exc


def _probe(workdir: Path) -> dict[str, str]:
    """Each step's outcome: 'ok: ...', 'FAIL: the first line of its error', or 'BOTH: ...' where the
    unfolded model fails that step too."""
    import torch

    results: dict[str, str] = {}
    state: dict = {}

    def step(name: str, fn) -> None:  # noqa: ANN001
        try:
            results[name] = "ok: " + fn()
        except OriginalFails as exc:
            results[name] = f"BOTH: {exc}"
        except BaseException as exc:  # noqa: BLE001 - a step's failure is its result
            results[name] = f"FAIL: {_first_line(exc)}"

    step("import", _kernels)

    def fold() -> str:
        from enjoyln.testing import demo_checkpoint

        demo_checkpoint(workdir / "gpt2", layers=2, width=64, vocab=128)
        return _fold(workdir / "gpt2", workdir / "gpt2-folded")

    step("fold", fold)

    def load() -> str:
        import transformers

        import enjoyln

        src = workdir / "gpt2"
        if not (
            workdir / "gpt2-folded"
        ).is_dir():  # the fold failed: load what a fold on 2.13 would write
            raise RuntimeError("no folded directory (the fold failed)")
        state["model"] = model = enjoyln.load(workdir / "gpt2-folded")
        state["ids"] = ids = torch.randint(
            0, 128, (2, 16), generator=torch.Generator().manual_seed(0)
        )
        ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        err = float((_logits(model, ids) - _logits(ref, ids)).abs().max())
        if err > 1e-3:
            raise AssertionError(f"folded logits are {err:.1e} from the original's")
        return f"logits within {err:.0e} of the original's"

    step("load", load)

    def original() -> torch.nn.Module:
        import transformers

        if "original" not in state:
            state["original"] = transformers.AutoModelForCausalLM.from_pretrained(
                workdir / "gpt2"
            ).eval()
        return state["original"]

    def compiled() -> str:
        from enjoyln.modules.norm import RMSNorm

        torch._dynamo.reset()
        norm, x = RMSNorm(64), torch.randn(3, 64)
        with torch.no_grad():
            err = float((torch.compile(norm)(x) - norm(x)).abs().max())
        if err > 1e-5:
            raise AssertionError(f"a compiled RMSNorm is {err:.1e} from eager")
        model, ids = state["model"], state["ids"]
        try:
            err = float((_logits(torch.compile(model), ids) - _logits(model, ids)).abs().max())
        except Exception as exc:
            torch._dynamo.reset()
            raise _blame(exc, lambda: _logits(torch.compile(original()), ids)) from None
        if err > 1e-4:
            raise AssertionError(f"compiled logits are {err:.1e} from eager")
        return f"within {err:.0e} of eager"

    def exported() -> str:
        model, ids = state["model"], state["ids"]
        kwargs = {"input_ids": ids, "use_cache": False}
        try:
            ep = torch.export.export(model, (), kwargs, strict=False)
        except Exception as exc:
            raise _blame(
                exc, lambda: torch.export.export(original(), (), kwargs, strict=False)
            ) from None
        norms = sum(1 for n in ep.graph.nodes if "enjoyln.rms_norm" in str(n.target))
        want = sum(1 for m in model.modules() if type(m).__name__ == "RMSNorm")
        if norms != want:
            raise AssertionError(f"{norms} enjoyln.rms_norm nodes for {want} norms")
        err = float((_logits(ep.module(), ids) - _logits(model, ids)).abs().max())
        return f"{norms} enjoyln.rms_norm nodes, within {err:.0e} of eager"

    for name, fn in (("compile", compiled), ("export", exported)):
        if "model" in state:
            step(name, fn)
        else:
            results[name] = "FAIL: nothing loaded"
    return results


# --- on the host: the venvs
# ------------------------------------------------------------------------------


def _install(venv: Path, version: str, log: Path) -> str:
    """Make the venv and install torch ``version`` and this tree; '' or why it failed."""
    shutil.rmtree(venv, ignore_errors=True)
    with log.open("a") as out:
        subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out
        )
        pip = [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--no-cache-dir",
            "--progress-bar",
            "off",
        ]
        run = subprocess.run([*pip, f"torch=={version}.*", "-e", str(ROOT)], stdout=out, stderr=out)
    if run.returncode:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
        return f"pip failed: {tail[0][:200] if tail else run.returncode}"
    return ""


def _versions(venv: Path) -> dict[str, str]:
    code = (
        "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
        "('torch', 'transformers', 'triton') if __import__('importlib.util').util.find_spec(p)}))"
    )
    run = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True)
    return json.loads(run.stdout) if run.returncode == 0 else {}


def check_version(version: str, workdir: Path, keep: bool) -> dict:
    """Install ``version`` into a venv under ``workdir`` (kept from an earlier ``--keep`` run: used
    as it is), run the steps there, and remove the venv unless ``keep``."""
    venv, log = workdir / f"torch-{version}", workdir / f"torch-{version}.log"
    start = time.time()
    entry: dict = {"version": version, "date": time.strftime("%Y-%m-%d")}
    try:
        kept = (venv / "bin" / "python").is_file() and _versions(venv).get("torch", "").startswith(
            version + "."
        )
        failed = "" if kept else _install(venv, version, log)
        if failed:
            return {**entry, "steps": {s: f"FAIL: {failed}" for s in STEPS}}
        entry["packages"] = _versions(venv)
        probe = workdir / f"probe-{version}"
        shutil.rmtree(probe, ignore_errors=True)
        probe.mkdir()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree, whatever else is installed
        run = subprocess.run(
            [str(venv / "bin" / "python"), __file__, "--probe", str(probe)],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
        with log.open("a") as out:
            out.write(run.stdout + run.stderr)
        lines = run.stdout.strip().splitlines()
        try:
            entry["steps"] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
            entry["steps"] = {s: f"FAIL: the probe died: {tail[:200]}" for s in STEPS}
        shutil.rmtree(probe, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    entry["seconds"] = round(time.time() - start)
    return entry


def table(results: dict[str, dict]) -> str:
    import platform

    rows = [
        "| torch | transformers | " + " | ".join(STEPS) + " |",
        "|---|---|" + "---|" * len(STEPS),
    ]
    notes = []
    for version in sorted(results, key=lambda v: tuple(int(p) for p in v.split("."))):
        entry = results[version]
        packages = entry.get("packages", {})
        cells = []
        for step in STEPS:
            outcome = entry["steps"].get(step, "FAIL: not run")
            kind, _, what = outcome.partition(": ")
            cells.append({"ok": "yes", "BOTH": "no, nor unfolded"}.get(kind, "**no**"))
            if kind != "ok":
                whose = " (the unfolded model fails the same way)" if kind == "BOTH" else ""
                if kind == "BOTH" and step == "compile":
                    whose += "; an RMSNorm alone compiles and matches eager"
                notes.append(f"- torch {version}, {step}{whose}: {what}")
        rows.append(
            f"| {packages.get('torch', version)} | {packages.get('transformers', '?')} | "
            + " | ".join(cells)
            + " |"
        )
    dates = sorted({e["date"] for e in results.values()})
    head = (
        f"Run by `scripts/check_torch_versions.py` on {', '.join(dates)}: Python "
        f"{platform.python_version()}, "
        "Linux x86-64, CPU only (the PyPI wheels of torch, CUDA builds, run here without a GPU). "
        "*no, nor unfolded*: the step fails the same way on the original model, for torch or "
        "transformers.\n"
    )
    return "\n".join([head, *rows, *([""] + notes if notes else [])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--versions", default="", help=f"comma-separated minor releases, e.g. {','.join(VERSIONS)}"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the venvs go (default: a temporary one)"
    )
    parser.add_argument("--keep", action="store_true", help="keep each venv after its run")
    parser.add_argument("--write", action="store_true", help="write the torch-versions block")
    parser.add_argument(
        "--probe", type=Path, help=argparse.SUPPRESS
    )  # in the venv: run the steps there
    args = parser.parse_args()
    if args.probe is not None:
        print(json.dumps(_probe(args.probe)))
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="enjoyln-torch-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for version in filter(None, args.versions.split(",")):
        print(f"torch {version}: installing into {workdir}", flush=True)
        entry = check_version(version.strip(), workdir, args.keep)
        print(json.dumps(entry, indent=1), flush=True)
        # after each version (runs are long), into what the file holds now (another run may have
        # added to it)
        results = {
            **(json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}),
            version.strip(): entry,
        }
        tmp = RESULTS.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        tmp.replace(RESULTS)
    print(table(results))
    if args.write:
        sys.path.insert(0, str(ROOT / "scripts"))
        from _docs import replace_section

        print(f"wrote {replace_section('torch-versions', table(results))}")


if __name__ == "__main__":
    main()
