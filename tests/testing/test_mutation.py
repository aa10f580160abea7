"""Mutation testing of the gate: 500 seeded mutations of checked folds, each owed a verdict.

The score test runs ``enjoyln check REFERENCE MUTANT`` (in process, in two worker
processes) on every mutation and requires every verdict right. The other tests check
the harness itself: that a mutation owed a pass is inert (loaded as a user would,
it computes what the unmutated fold computes, bit for bit), that one claimed to change
what a loader reads does change it, that draws are seeded, and that every kind is drawn.
"""

from __future__ import annotations

import base64
import collections

import pytest

from enjoyln.testing.mutation.applying import Mutation, apply
from enjoyln.testing.mutation.drawing import CATEGORIES, ELEMENT_KINDS, INERT_KINDS, draw
from enjoyln.testing.mutation.judging import Observe, judge_all, score, tree_digest
from enjoyln.testing.mutation.sources import build_sources, quiet
from enjoyln.testing.mutation.json_edits import json_tokens, respace_json

pytestmark = pytest.mark.slow

N, SEED = 500, 0


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    quiet()
    return build_sources(tmp_path_factory.mktemp("mutation-sources"))


@pytest.fixture(scope="module")
def mutations(sources):
    return draw(sources, N, seed=SEED)


def _sample(mutations, pick, per_key):
    """Up to ``per_key`` mutations of each (category, kind) that ``pick`` accepts."""
    seen, out = collections.Counter(), []
    for m in mutations:
        if pick(m) and seen[(m.category, m.kind)] < per_key:
            seen[(m.category, m.kind)] += 1
            out.append(m)
    return out


def _claimed(mutations):
    """Mutations whose claim is certain: a loaded tensor's bytes, a config value, the plan, or a
    file the loaders read removed or replaced whole. (A byte or a pair of lines in a file the
    loaders read may fall where they look past: a count PhoBERT drops, two keys of a JSON
    object; those are owed a failure by the policy all the same.)"""
    return _sample(mutations, lambda m: m.ground in ("weights-loaded", "config-read", "plan-read") or (
        m.ground == "file-read" and m.kind in ("missing", "replace")), 2)


@pytest.fixture(scope="module")
def results(sources, mutations):
    """Every mutation judged once, in two worker processes, and each source's fold as it is
    (one more result per source). Mutations owed a pass, and a sample of those claimed
    to change what a loader reads, are also loaded and observed."""
    before = {s.name: (tree_digest(s.reference), tree_digest(s.candidate)) for s in sources}
    unmutated = [Mutation(s.name, "none", "unmutated", "the checked fold itself", (), "pass", "inert",
                             "a fold enjoyln wrote and checked", index=N + i) for i, s in enumerate(sources)]
    observe = Observe(wrong=False, inert=True, indices=frozenset(m.index for m in _claimed(mutations)))
    out = judge_all(sources, [*mutations, *unmutated], workers=2, observe=observe)
    after = {s.name: (tree_digest(s.reference), tree_digest(s.candidate)) for s in sources}
    return out[:N], [name for name in before if before[name] != after[name]], out[N:]


def test_gate_gets_every_mutation_right(results):
    results = results[0]
    assert len(results) == N
    wrong = [r for r in results if not r.correct]
    summary = ", ".join(f"{k} {100 * r['score']:.1f}%" for k, r in score(results).items())
    assert not wrong, (f"{len(wrong)} of {N} verdicts wrong ({summary}); the first:\n"
                       + "\n".join(r.describe() for r in wrong[:15]))


def test_the_gate_leaves_its_inputs_alone(results):
    assert not results[1], f"the gate changed its inputs: {results[1]}"


def test_mutations_owed_a_pass_are_inert(results):
    """Every inert mutation drawn: both loaders, the tokenizer or the image processor give
    what the unmutated fold gives, bit for bit."""
    inert = [r for r in results[0] if r.mutation.ground == "inert"]
    assert {r.mutation.kind for r in inert} == set(INERT_KINDS)
    assert len(inert) >= 30
    unproven = [r.describe() for r in inert if r.effect != []]
    assert not unproven, "\n".join(unproven)


def test_claimed_changes_change_what_a_loader_reads(results, mutations):
    """A sample of the mutations claimed to change a loaded tensor, a config value transformers
    reads, the plan enjoyln.load reads, or a file a loader reads: loading the mutant shows it."""
    claimed = {m.index for m in _claimed(mutations)}
    sample = [r for r in results[0] if r.mutation.index in claimed]
    assert {r.mutation.ground for r in sample} == {"weights-loaded", "config-read", "plan-read", "file-read"}
    assert len(sample) >= 30
    shows = {"weights-loaded": ("from_pretrained", "enjoyln.load"), "config-read": ("config", "from_pretrained"),
             "plan-read": ("enjoyln.load",),
             "file-read": ("tokenizer", "image_processor", "from_pretrained:generat", "enjoyln.load:generat")}
    unshown = [r.describe() for r in sample if not any(e.startswith(shows[r.mutation.ground]) for e in r.effect)]
    assert not unshown, "\n".join(unshown)


def test_the_unmutated_folds_pass(results):
    """The sources are correct folds: the gate must pass them, or every score is noise."""
    assert [(r.mutation.source, r.exit_code, r.message) for r in results[2]] == [
        (r.mutation.source, 0, "") for r in results[2]]


def test_draws_are_seeded_and_cover_every_kind(sources, mutations):
    again = draw(sources, 40, seed=SEED)
    assert [m.describe() for m in again] == [m.describe() for m in mutations[:40]]
    assert [m.ops for m in again] == [m.ops for m in mutations[:40]]
    other = draw(sources, 40, seed=SEED + 1)
    assert [m.describe() for m in other] != [m.describe() for m in again]
    categories = collections.Counter(m.category for m in mutations)
    assert set(categories) == set(CATEGORIES)
    weights = {m.kind for m in mutations if m.category == "weights"}
    assert weights == set(ELEMENT_KINDS)
    assert {m.source for m in mutations} == {s.name for s in sources}
    # stored tensors that no loader loads are mutated too, and nested and enjoyln-block keys
    assert any(m.category == "weights" and m.ground == "policy" for m in mutations)
    assert any(m.category == "config" and "task_specific_params." in m.target for m in mutations)
    assert any(m.category == "enjoyln-block" and ".plan." in m.target for m in mutations)
    assert sum(m.expect == "pass" for m in mutations) >= 30


def test_respaced_json_keeps_every_token():
    import random

    text = '{"a": [1, 2.50, -0.0, 1e-05, "x\\"y\\\\"], "b": {"c": null, "d": true}}'
    for seed in range(20):
        new = respace_json(text, random.Random(seed))
        assert new != text
        assert list(json_tokens(new)) == list(json_tokens(text))
        assert "2.50" in new and "1e-05" in new and "-0.0" in new  # numbers keep their spelling


def test_an_element_mutation_changes_exactly_its_bytes(sources, tmp_path):
    """Applied to a copy, a weight mutation changes the bytes of one element and nothing else."""
    import shutil

    weights = [m for m in draw(sources, 60, seed=SEED + 2) if m.category == "weights"][:10]
    assert weights
    for m in weights:
        source = next(s for s in sources if s.name == m.source)
        copy = tmp_path / f"c{m.index}"
        shutil.copytree(source.candidate, copy)
        apply(m, copy, tmp_path / f"o{m.index}")
        (_, file, offset, data), = m.ops
        a, b = (source.candidate + "/" + file), copy / file
        old, new = open(a, "rb").read(), b.read_bytes()
        changed = [i for i in range(len(old)) if old[i] != new[i]]
        assert len(old) == len(new) and changed and offset <= min(changed) and max(changed) < offset + len(
            base64.b64decode(data)), m.describe()
