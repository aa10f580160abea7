"""Mutation score of the gate: seeded mutations of checked folds, and what `enjoyln check` said.

Builds the tiny folded sources of ``tools.mutation`` (GPT-2 plain, ``--fuse-affine``
and ``rotate``, BERT, ViT, ViT in bfloat16, BERT without its pooler; tokenizers with unusually
named files), draws N seeded
mutations of them, each with the verdict a sound gate gives it (non-zero for a
change, 0 for a proven-inert one), runs ``enjoyln check REFERENCE MUTANT`` on each
(in process, as the command line would, with the options and environment a mutation names) and
prints the score per category and every wrong verdict, with what the mutation changes for a user
(observed by loading the mutant with ``from_pretrained``, ``enjoyln.load``, its tokenizer or image
processor).

    python scripts/mutation_score.py [--n 5000] [--seed 0] [--workers 2] [--prove-inert] [--json
    out.json] [--write]

``--prove-inert`` also loads every inert mutant and requires it to compute what the
unmutated fold computes, bit for bit (exits 1 if one does not). ``--write`` puts N, the
seed and the score into docs/checking.md between the ``mutation-score`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # the harness lives in tools/, not the package
from _docs import machine, replace_section  # noqa: E402

from tools.mutation.drawing import draw  # noqa: E402
from tools.mutation.judging import GATE_TREE, Observe, judge_all, score, tree_digest  # noqa: E402
from tools.mutation.sources import build_sources  # noqa: E402


def table(rows: dict) -> str:
    lines = [
        "| category | mutations | must fail | must pass | false passes | false failures | score |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        label = "**all**" if name == "all" else name
        lines.append(
            f"| {label} | {r['n']} | {r['must_fail']} | {r['must_pass']} | {r['false_pass']} | "
            f"{r['false_fail']} | {100 * r['score']:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="Mutations to draw.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workers", type=int, default=2, help="Processes judging mutations (0: this one)."
    )
    parser.add_argument(
        "--workdir", type=Path, help="Where to build the sources (default: a temporary directory)."
    )
    parser.add_argument(
        "--prove-inert",
        action="store_true",
        help="Load every inert mutant and compare bit for bit.",
    )
    parser.add_argument(
        "--no-observe", action="store_true", help="Do not load wrong verdicts' mutants to say why."
    )
    parser.add_argument("--json", type=Path, help="Write every result here.")
    parser.add_argument(
        "--write", action="store_true", help="Write the score into docs/checking.md."
    )
    parser.add_argument(
        "--gate-tree",
        type=Path,
        help="Judge with the gate of this source tree (a checkout of "
        "another commit), each check in a process of its own: the same mutants, another gate.",
    )
    args = parser.parse_args()
    if args.gate_tree is not None:
        if args.write:
            parser.error(
                "--gate-tree judges another tree's gate: its score does not go into the docs"
            )
        os.environ[GATE_TREE] = str(args.gate_tree.resolve())

    with tempfile.TemporaryDirectory(prefix="enjoyln-mutation-sources-") as tmp:
        root = args.workdir or Path(tmp)
        start = time.perf_counter()
        sources = build_sources(root)
        mutations = draw(sources, args.n, seed=args.seed)
        print(
            f"built {len(sources)} sources and drew {len(mutations)} mutations in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
        before = {s.name: (tree_digest(s.reference), tree_digest(s.candidate)) for s in sources}

        def progress(done: int, total: int) -> None:
            if done % 100 == 0 or done == total:
                print(f"  {done}/{total} judged ({time.perf_counter() - start:.0f} s)", flush=True)

        observe = Observe(wrong=not args.no_observe, inert=args.prove_inert)
        results = judge_all(
            sources, mutations, workers=args.workers, observe=observe, progress=progress
        )
        # an "equivalent" pass (the plain form without a block, the fold cast under --dtype)
        # computes to rounding what the fold does, not bit for bit: only "inert" ones are proven
        unproven = [r for r in results if r.mutation.ground == "inert" and r.effect]
        changed = [
            s.name
            for s in sources
            if before[s.name] != (tree_digest(s.reference), tree_digest(s.candidate))
        ]
        seconds = time.perf_counter() - start

    rows = score(results)
    print()
    print(table(rows))
    wrong = [r for r in results if not r.correct]
    print(f"\n{len(wrong)} wrong verdicts (seed {args.seed}, {args.n} mutations, {seconds:.0f} s):")
    for r in wrong:
        print(r.describe())
    unforeseen = [r for r in results if "(unforeseen)" in r.message]
    if unforeseen:
        print(
            f"\n{len(unforeseen)} verdicts came from an exception enjoyln did not foresee (exit 2 "
            "all the same):"
        )
        for r in unforeseen:
            print(f"  {r.mutation.describe()}: {r.message}")
    if args.prove_inert:
        print(
            "\ninert mutations proven: "
            f"{len([m for m in mutations if m.ground == 'inert']) - len(unproven)}; "
            f"not inert after all: {len(unproven)}"
        )
        for r in unproven:
            print(r.describe())
    if changed:
        print(f"\nthe gate changed its inputs: {', '.join(changed)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        **r.mutation.to_dict(),
                        "exit_code": r.exit_code,
                        "message": r.message,
                        "seconds": r.seconds,
                        "correct": r.correct,
                        "effect": r.effect,
                    }
                    for r in results
                ],
                indent=1,
            )
        )
    if args.write:
        a = rows["all"]
        body = (
            f"{a['n']} seeded mutations (seed {args.seed}) of seven tiny checked folds (GPT-2 "
            "plain, "
            "`--fuse-affine` and `rotate`, BERT, ViT, ViT in bfloat16, BERT without its pooler), "
            "each "
            "judged by `enjoyln check REFERENCE MUTANT` (with `--dtype bfloat16`, or a planted "
            "cache's "
            f"environment, where the mutation says): "
            f"**{100 * a['score']:.1f}%** right ({a['false_pass']} false passes, {a['false_fail']} "
            "false "
            f"failures); {machine()}, {args.workers} worker processes of one "
            f"thread.\n\n{table(rows)}\n\n"
            f"Command: `python scripts/mutation_score.py --n {args.n} --seed {args.seed} --write`; "
            f"CI runs 500 (`tests/tools/test_mutation.py`)."
        )
        replace_section("mutation-score", body)
    sys.exit(1 if unproven or changed else 0)


if __name__ == "__main__":
    main()
