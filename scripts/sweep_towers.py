"""Sweep the multimodal model types of transformers (those whose config has a vision or audio
sub-config) through analyze, fold and a comparison, count the LayerNorms of their towers, then
rotate every residual stream that can rotate (the towers' and the language model's) and compare
what the model serves (the outputs the plan does not record as changed).

Each type is run as ``sweep_transformers.py`` runs it (a tiny config made consistent for its towers,
perturbed weights, enjoyln's own inputs, every output compared on two batches), with the class a
user folds for images or audio first (image-text-to-text, multimodal LM), and the tower LNs counted
apart: those under a submodule built from the vision or audio sub-config.

    python scripts/sweep_towers.py --jobs 1 --timeout 300            # to
    docs/data/sweep_towers_results.json python scripts/sweep_towers.py --only llava,idefics3 --out
    /tmp/t.json python scripts/sweep_towers.py --from-results --write            # the sweep-towers
    block in docs/architectures.md python scripts/sweep_towers.py --only llava,clip --merge
    # these types again, the others' records kept
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sweep_transformers as zoo  # noqa: E402 - the script beside this one

DATA = HERE.parent / "docs" / "data"  # results are data, kept apart from the scripts
DEFAULT_OUT = DATA / "sweep_towers_results.json"
FIRST = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")
NAMED = (
    "llava",
    "llava_next",
    "mllama",
    "qwen2_vl",
    "qwen3_vl",
    "paligemma",
    "idefics3",
    "smolvlm",
    "blip-2",
    "clip",
    "siglip",
)
"""The families swept first (the rest follow in registry order)."""


def multimodal_types() -> list[str]:
    """Model types whose default config has a vision or audio sub-config, the named families
    first."""
    import warnings

    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in CONFIG_MAPPING_NAMES:
            try:
                cfg = CONFIG_MAPPING[t]()
            except Exception:  # noqa: BLE001 - a config that needs arguments has no default to read
                continue
            if any(
                isinstance(v, PretrainedConfig) and ("vision" in k or "audio" in k)
                for k, v in vars(cfg).items()
            ):
                found.append(t)
    return [t for t in NAMED if t in found] + [t for t in found if t not in NAMED]


def in_towers(name: str, towers: list[str]) -> bool:
    return any(name == t or name.startswith(t + ".") for t in towers)


def run_tower(model_type: str) -> dict[str, Any]:
    """``sweep_transformers.run_one`` with the multimodal class first, and its tower LNs counted
    apart."""
    r = zoo.run_one(model_type, FIRST)
    towers = r.get("towers") or []
    names = r.get("folded_names", []) + list(r.get("refused", {}))
    if not towers or "ln_entries" not in r:
        return r
    refused = {n: why for n, why in r["refused"].items() if in_towers(n, towers)}
    reasons: dict[str, int] = {}
    for why in refused.values():
        key = zoo.normalize_reason(why, names)
        reasons[key] = reasons.get(key, 0) + 1
    r["tower_lns"] = sum(in_towers(n, towers) for n in names)
    r["tower_folded"] = sum(in_towers(n, towers) for n in r["folded_names"])
    r["tower_reasons"] = reasons
    if r.get("status") in ("exact", "inexact") and r.get("inputs") == "enjoyln":
        r["rotation"] = rotate_streams(model_type, towers)
    return r


def rotate_streams(model_type: str, towers: list[str]) -> dict[str, Any]:
    """The model built again, every stream rotated that can be (hadamard, seed 0, keeping the mean)
    and compared with the original on the outputs it serves: the streams found, rotated (a
    tower's among them) and why not."""
    import copy

    import enjoyln
    from enjoyln.analysis.inputs import hf_example_inputs
    from enjoyln.plan import NOT_ROTATED, STREAM_NOT_ROTATED

    try:
        model, _ = zoo.prepare(model_type, FIRST)
        plan = enjoyln.analyze(model, rotate=("hadamard", 0, True))
        notes = [n for n in plan.notes if n.kind in (NOT_ROTATED, STREAM_NOT_ROTATED)]
        names = [e.name for e in plan.layer_norms]
        out: dict[str, Any] = {
            "rotated": len(plan.rotations),
            "streams": len(plan.rotations)
            + sum(n.kind == STREAM_NOT_ROTATED or not n.endswith(NO_STREAM) for n in notes),
            "tower_rotated": sum(
                any(in_towers(x.param, towers) for x in r.rotated) for r in plan.rotations
            ),
            "why_not": [
                zoo.normalize_reason(n.split("cannot be rotated: ", 1)[-1], names) for n in notes
            ],
            "changed_outputs": plan.changed_outputs,
        }
        if plan.rotations:
            rotated = enjoyln.rotate(copy.deepcopy(model), plan=plan)
            batches = [
                hf_example_inputs(model, batch=zoo.BATCH, seq_len=zoo.SEQ, seed=s) for s in (0, 1)
            ]
            out.update(zoo.compare(model, rotated, batches, skip=plan.changed_outputs))
            out["status"] = "exact" if out["max_rel"] <= zoo.RTOL else "inexact"
        return out
    except Exception as exc:  # noqa: BLE001 - recorded
        return zoo.classify(exc, "rotate")


NO_STREAM = ("there is no weightless stream to rotate", "no folded norm reads the stream")
"""The ends of the note of a model with no stream to rotate (no norm whose input traces back to its
writers)."""


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rs = list(results.values())
    status = {
        s: sum(r["status"] == s for r in rs)
        for s in ("exact", "inexact", "clean_error", "raw_error", "skipped")
    }
    unsound = sum(
        r["status"] == "inexact" and not r.get("float64", {}).get("rounding", False) for r in rs
    )
    with_towers = [r for r in rs if r.get("tower_lns")]
    rot = [r["rotation"] for r in rs if "rotation" in r]
    return {
        "model_types": len(rs),
        **status,
        "unsound": unsound,
        "with_tower_lns": len(with_towers),
        "tower_lns": sum(r["tower_lns"] for r in with_towers),
        "tower_folded": sum(r["tower_folded"] for r in with_towers),
        "ln_entries": sum(r.get("ln_entries", 0) for r in rs),
        "folded": sum(r.get("folded", 0) for r in rs),
        "rotation_tried": len(rot),
        "streams": sum(x.get("streams", 0) for x in rot),
        "streams_rotated": sum(x.get("rotated", 0) for x in rot),
        "tower_streams_rotated": sum(x.get("tower_rotated", 0) for x in rot),
        "rotated_exact": sum(x.get("status") == "exact" for x in rot),
        "rotated_inexact": sum(x.get("status") == "inexact" for x in rot),
        "rotation_clean_errors": sum(x.get("status") == "clean_error" for x in rot),
        "rotation_raw_errors": sum(x.get("status") == "raw_error" for x in rot),
    }


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _rotation_cells(rot: dict[str, Any] | None) -> str:
    """The rotation's three cells: streams rotated of those found (a tower's among them), its max
    relative difference, and why the others are not rotated."""
    if rot is None:
        return "- | - | not tried"
    if "streams" not in rot:
        return f"- | {rot.get('status', '')} | {_cell((rot.get('message') or '')[:120])}"
    rel = rot.get("max_rel")
    diff = (
        "-"
        if rel is None
        else f"{rel:.1e}" + ("" if rot.get("status") == "exact" else f" {rot.get('status')}")
    )
    why = "; ".join(sorted(set(rot.get("why_not", []))))
    return (
        f"{rot['rotated']} / {rot['streams']} ({rot['tower_rotated']}) | {diff} | "
        f"{_cell(why) or '-'}"
    )


def docs_block(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The sweep-towers block: one line per type whose forward ran with a LayerNorm, then the
    counts."""
    s = summarize(results)
    lines = [
        f"{s['model_types']} multimodal model types of transformers {meta['transformers']} (a "
        "vision or audio "
        "sub-config), each with enjoyln's own inputs (an image or audio in every batch); "
        f"{meta['machine']}; "
        f"{meta['jobs']} worker, {meta['timeout']:.0f} s per type, {meta['wall_seconds'] / 60:.0f} "
        "min wall; "
        f"enjoyln `{meta['enjoyln_commit']}`." + (f" {meta['note']}" if meta.get("note") else ""),
        "",
        f"{s['exact']} exact, {s['inexact']} inexact ({s['unsound']} not explained by float32 "
        "rounding: unsound), "
        f"{s['clean_error']} clean errors, {s['raw_error']} raw errors, {s['skipped']} skipped. "
        f"Tower LNs folded: **{s['tower_folded']} of {s['tower_lns']}** in {s['with_tower_lns']} "
        "types; all LNs: "
        f"{s['folded']} of {s['ln_entries']}.",
        "",
        "Rotation (`enjoyln.rotate`, hadamard, keeping the mean, the served outputs compared) of "
        "the "
        f"{s['rotation_tried']} types that fold exactly: **{s['streams_rotated']} of "
        f"{s['streams']} streams rotated**, "
        f"{s['tower_streams_rotated']} of them a tower's; {s['rotated_exact']} exact, "
        f"{s['rotated_inexact']} inexact, "
        f"{s['rotation_clean_errors']} clean errors, {s['rotation_raw_errors']} raw errors.",
        "",
        "| model type | class | tower LNs folded | all LNs folded | max rel diff | why the others "
        "do not fold "
        "| streams rotated (tower) | rotated: max rel diff | why a stream is not rotated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, r in results.items():
        if "ln_entries" not in r:
            continue
        why = "; ".join(
            f"{k} ({n})"
            for k, n in sorted(r.get("tower_reasons", {}).items(), key=lambda kv: -kv[1])
        )
        rel = r.get("max_rel")
        lines.append(
            f"| {t} | {r.get('class', '')} | {r.get('tower_folded', 0)} / {r.get('tower_lns', 0)} "
            "| "
            f"{r['folded']} / {r['ln_entries']} | "
            f"{'-' if rel is None else f'{rel:.1e}'} "
            f"{r['status'] if r['status'] != 'exact' else ''} | "
            f"{_cell(why) or '-'} | {_rotation_cells(r.get('rotation'))} |"
        )
    other = {}
    for r in results.values():
        if "ln_entries" not in r:
            key = r["status"] + ": " + (r.get("reason") or r.get("message") or "").split(":")[0]
            other[key] = other.get(key, 0) + 1
    lines += [
        "",
        "Types not in the table: "
        + ", ".join(f"{k} ({n})" for k, n in sorted(other.items(), key=lambda kv: -kv[1]))
        + ".",
        "",
        "Command: `python scripts/sweep_towers.py --jobs 1 --write` (records in "
        "`docs/data/sweep_towers_results.json`).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument(
        "--write", action="store_true", help="write the sweep-towers block in docs/architectures.md"
    )
    ap.add_argument(
        "--from-results", action="store_true", help="do not sweep: summarise --out again"
    )
    ap.add_argument(
        "--merge", action="store_true", help="keep the records of --out for the types not swept now"
    )
    ap.add_argument(
        "--from-log",
        type=Path,
        help="do not sweep: the records an interrupted sweep logged (its "
        ".jsonl), with the meta of --out; the types it did not reach are counted as not run",
    )
    args = ap.parse_args(argv)
    if args.from_log:
        saved = json.loads(args.out.read_text())
        meta = saved["meta"]
        logged = [
            json.loads(line) for line in args.from_log.read_text().splitlines() if line.strip()
        ]
        results = {r["model_type"]: r for r in logged}
        results.update(
            {
                t: {
                    "model_type": t,
                    "status": "skipped",
                    "reason": "not run: the sweep was stopped",
                }
                for t in (args.only.split(",") if args.only else multimodal_types())
                if t not in results
            }
        )
        args.out.write_text(
            json.dumps({"meta": meta, "summary": summarize(results), "results": results}, indent=1)
            + "\n"
        )
    elif args.from_results:
        saved = json.loads(args.out.read_text())
        results, meta = saved["results"], saved["meta"]
    else:
        import torch
        import transformers

        import enjoyln

        types = args.only.split(",") if args.only else multimodal_types()
        start = time.perf_counter()
        with open(args.out.with_suffix(".jsonl"), "a" if args.merge else "w") as log:
            results = zoo.sweep(types, jobs=args.jobs, timeout=args.timeout, log=log, run=run_tower)
        if args.merge:
            saved = json.loads(args.out.read_text())
            results = {**saved["results"], **results}
        root = Path(enjoyln.__file__).resolve().parent.parent
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        from _docs import machine

        meta = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "enjoyln_commit": commit,
            "machine": machine(),
            "jobs": args.jobs,
            "timeout": args.timeout,
            "wall_seconds": round(time.perf_counter() - start, 1),
        }
        args.out.write_text(
            json.dumps({"meta": meta, "summary": summarize(results), "results": results}, indent=1)
            + "\n"
        )
    print(json.dumps(summarize(results)))
    if args.write:
        from _docs import replace_section

        replace_section("sweep-towers", docs_block(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
