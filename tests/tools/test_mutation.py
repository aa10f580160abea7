"""Mutation testing of the gate: 500 seeded mutations of checked folds, each owed a verdict.

The score test runs ``enjoyln check REFERENCE MUTANT`` (in process, in two worker
processes) on every mutation and requires every verdict right. The other tests check
the harness itself: that a mutation owed a pass is inert (loaded as a user would,
it computes what the unmutated fold computes, bit for bit), that one claimed to change
what a loader reads does change it (the dtype a model loads in, the plan enjoyln.load
runs, a bfloat16 rounding), that draws are seeded, and that every kind is drawn.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import shutil

import pytest
import torch

from tools.mutation.applying import Mutation, apply, rounded
from tools.mutation.drawing import CATEGORIES, ELEMENT_KINDS, INERT_KINDS, draw
from tools.mutation.gate_inputs import GATE_INPUT_CATEGORIES, KINDS, old_cache_key
from tools.mutation.judging import Observe, gate, judge_all, score, tree_digest
from tools.mutation.sources import build_sources, quiet
from tools.mutation.json_edits import json_tokens, respace_json

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
    return _sample(
        mutations,
        lambda m: (
            m.category != "cast-rounding"
            and (
                m.ground in ("weights-loaded", "config-read", "plan-read")
                or (m.ground == "file-read" and m.kind in ("missing", "replace"))
            )
        ),
        2,
    )


def _gate_input_failures(mutations):
    """Up to two of each gate-input kind owed a failure, observed to show its particular claim.
    (A bfloat16 rounding differs from the float32 fold whatever it is: its claim is shown
    against the nearest rounding, in its own test.)"""
    return _sample(
        mutations,
        lambda m: (
            m.category in GATE_INPUT_CATEGORIES
            and m.category != "cast-rounding"
            and m.expect == "fail"
        ),
        2,
    )


@pytest.fixture(scope="module")
def results(sources, mutations):
    """Every mutation judged once, in two worker processes, and each source's fold as it is
    (one more result per source). Mutations owed a pass, and a sample of those claimed
    to change what a loader reads, are also loaded and observed."""
    before = {s.name: (tree_digest(s.reference), tree_digest(s.candidate)) for s in sources}
    unmutated = [
        Mutation(
            s.name,
            "none",
            "unmutated",
            "the checked fold itself",
            (),
            "pass",
            "inert",
            "a fold enjoyln wrote and checked",
            index=N + i,
        )
        for i, s in enumerate(sources)
    ]
    observed = [*_claimed(mutations), *_gate_input_failures(mutations)]
    observe = Observe(wrong=False, inert=True, indices=frozenset(m.index for m in observed))
    out = judge_all(sources, [*mutations, *unmutated], workers=2, observe=observe)
    after = {s.name: (tree_digest(s.reference), tree_digest(s.candidate)) for s in sources}
    return out[:N], [name for name in before if before[name] != after[name]], out[N:]


def test_gate_gets_every_mutation_right(results):
    results = results[0]
    assert len(results) == N
    wrong = [r for r in results if not r.correct]
    summary = ", ".join(f"{k} {100 * r['score']:.1f}%" for k, r in score(results).items())
    assert not wrong, f"{len(wrong)} of {N} verdicts wrong ({summary}); the first:\n" + "\n".join(
        r.describe() for r in wrong[:15]
    )


def test_the_gate_leaves_its_inputs_alone(results):
    assert not results[1], f"the gate changed its inputs: {results[1]}"


def test_mutations_owed_a_pass_are_inert(results):
    """Every inert mutation drawn: both loaders, the tokenizer or the image processor give
    what the unmutated fold gives, bit for bit."""
    inert = [r for r in results[0] if r.mutation.ground == "inert"]
    assert {r.mutation.kind for r in inert if r.mutation.category == "inert"} == set(INERT_KINDS)
    # a tensor widened with the config's dtype kept, the index's dtype beside the config's, its
    # total_size
    assert {
        (r.mutation.category, r.mutation.kind) for r in inert if r.mutation.category != "inert"
    } == {
        ("load-dtype", "widened"),
        ("index-metadata", "metadata-dtype"),
        ("index-metadata", "total-size"),
    }
    assert len(inert) >= 30
    unproven = [r.describe() for r in inert if r.effect != []]
    assert not unproven, "\n".join(unproven)


def test_claimed_changes_change_what_a_loader_reads(results, mutations):
    """A sample of the mutations claimed to change a loaded tensor, a config value transformers
    reads, the plan enjoyln.load reads, or a file a loader reads: loading the mutant shows it."""
    claimed = {m.index for m in _claimed(mutations)}
    sample = [r for r in results[0] if r.mutation.index in claimed]
    assert {r.mutation.ground for r in sample} == {
        "weights-loaded",
        "config-read",
        "plan-read",
        "file-read",
    }
    assert len(sample) >= 30
    shows = {
        "weights-loaded": ("from_pretrained", "enjoyln.load"),
        "config-read": ("config", "from_pretrained"),
        "plan-read": ("enjoyln.load",),
        "file-read": (
            "tokenizer",
            "image_processor",
            "from_pretrained:generat",
            "enjoyln.load:generat",
        ),
    }
    unshown = [
        r.describe()
        for r in sample
        if not any(e.startswith(shows[r.mutation.ground]) for e in r.effect)
    ]
    assert not unshown, "\n".join(unshown)


def test_gate_input_changes_are_what_they_claim(results, mutations, sources):
    """Each gate-input kind owed a failure, loaded: the planted plan changes what enjoyln.load
    computes; a widened first tensor or the index's dtype, without one in config.json, changes
    the dtype from_pretrained loads in; an index without metadata fails to load; a removed
    parameter loads other values; a deleted config dtype changes the config and nothing else."""
    wanted = {m.index for m in _gate_input_failures(mutations)}
    sample = [r for r in results[0] if r.mutation.index in wanted]
    assert {(r.mutation.category, r.mutation.kind) for r in sample} == {
        (c, k)
        for c, kinds in KINDS.items()
        if c != "cast-rounding"
        for k in kinds
        if (c, k)
        not in (
            ("load-dtype", "widened"),
            ("index-metadata", "metadata-dtype"),
            ("index-metadata", "total-size"),
        )
    }
    wrong = []
    for r in sample:
        m, effect = r.mutation, r.effect
        source = next(s for s in sources if s.name == m.source)
        with open(os.path.join(source.candidate, "config.json")) as f:
            dtype = json.load(f)["dtype"]
        if m.category == "plan-cache":
            ok = any(e.startswith("enjoyln.load:outputs") for e in effect)
        elif m.kind == "first-widened":
            ok = f"from_pretrained:dtype: torch.{dtype} -> torch.float64" in effect
        elif m.kind == "metadata-dtype-no-config":
            other = m.ops[-1][3]  # ("json-set", index, ["metadata", "dtype"], other)
            ok = f"from_pretrained:dtype: torch.{dtype} -> torch.{other}" in effect
        elif m.kind == "metadata-dropped":
            ok = any(e.startswith("from_pretrained: null -> error: KeyError") for e in effect)
        elif m.kind == "dtype-deleted":
            ok = effect == [f"config: dtype {dtype} -> null"]
        else:  # a removed parameter: another value loads
            ok = m.ground == "policy" or any(e.startswith("from_pretrained:state") for e in effect)
        if not ok:
            wrong.append(r.describe())
    assert not wrong, "\n".join(wrong)


def test_the_unmutated_folds_pass(results):
    """The sources are correct folds: the gate must pass them, or every score is noise."""
    assert [(r.mutation.source, r.exit_code, r.message) for r in results[2]] == [
        (r.mutation.source, 0, "") for r in results[2]
    ]


def test_draws_are_seeded_and_cover_every_kind(sources, mutations):
    again = draw(sources, 40, seed=SEED)
    assert [m.describe() for m in again] == [m.describe() for m in mutations[:40]]
    assert [m.ops for m in again] == [m.ops for m in mutations[:40]]
    other = draw(sources, 40, seed=SEED + 1)
    assert [m.describe() for m in other] != [m.describe() for m in again]
    categories = collections.Counter(m.category for m in mutations)
    assert set(categories) == set(CATEGORIES)
    # the value categories still make most of the draw, and every gate-input kind comes up
    assert sum(categories[c] for c in GATE_INPUT_CATEGORIES) < 0.2 * N
    drawn = collections.Counter(
        (m.category, m.kind) for m in mutations if m.category in GATE_INPUT_CATEGORIES
    )
    assert set(drawn) == {(c, k) for c, kinds in KINDS.items() for k in kinds}
    assert min(drawn.values()) >= 2, drawn
    # only a planted cache sets the gate's environment (and is judged statically, or in full);
    # --dtype rounding is checked with --dtype
    assert {m.category for m in mutations if m.env} == {"plan-cache"}
    assert {
        (m.category, m.args) for m in mutations if m.category in ("plan-cache", "cast-rounding")
    } == {
        ("plan-cache", ()),
        ("plan-cache", ("--static",)),
        ("cast-rounding", ("--dtype", "bfloat16")),
    }
    assert all(not m.args for m in mutations if m.category not in ("plan-cache", "cast-rounding"))
    assert all(
        "env" not in m.to_dict() and "args" not in m.to_dict()
        for m in mutations
        if m.category not in GATE_INPUT_CATEGORIES
    )
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
        ((_, file, offset, data),) = m.ops
        a, b = (source.candidate + "/" + file), copy / file
        old, new = open(a, "rb").read(), b.read_bytes()
        changed = [i for i in range(len(old)) if old[i] != new[i]]
        assert (
            len(old) == len(new)
            and changed
            and offset <= min(changed)
            and max(changed) < offset + len(base64.b64decode(data))
        ), m.describe()


def test_rounding_and_retyping_do_what_they_say(tmp_path):
    """bfloat16 holds 7 bits after the point: 1 + 2**-8 is a tie (nearest goes to even, 1.0),
    1 + 2**-9 rounds down to 1.0 at nearest; one ulp at 1 is 2**-7."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    x = torch.tensor([1 + 2**-8, 1 + 2**-9, -(1 + 2**-9), 3.0])
    up, one = 1 + 2**-7, 1.0
    assert rounded(x, torch.bfloat16, "nearest").tolist() == [one, one, -one, 3.0]
    assert rounded(x, torch.bfloat16, "up").tolist() == [up, up, -one, 3.0]
    assert rounded(x, torch.bfloat16, "down").tolist() == [one, one, -up, 3.0]
    assert rounded(x, torch.bfloat16, "zero").tolist() == [one, one, -one, 3.0]
    save_file(
        {"a": x, "b": torch.ones(2), "c": torch.tensor([7])},
        tmp_path / "w.safetensors",
        metadata={"k": "v"},
    )
    spec = {
        "cast": {"a": ["F64", "nearest"], "*": ["BF16", "up"]},
        "drop": ["b"],
        "ulp": ["a", 3, -1],
    }
    m = Mutation(
        "s", "c", "k", "t", (("retype", "w.safetensors", json.dumps(spec)),), "fail", "policy", "r"
    )
    apply(m, tmp_path, tmp_path / "outside")
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["a", "c"] and f.metadata() == {"k": "v"}
        a, c = f.get_tensor("a"), f.get_tensor("c")
    assert a.dtype == torch.float64 and a[:3].tolist() == x[:3].double().tolist()
    assert a[3].item() == torch.nextafter(
        torch.tensor(3.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
    )
    assert c.tolist() == [7]


def test_cast_rounding_mutants_are_what_they_claim(sources, mutations, tmp_path):
    """The nearest mutant loads as the fold loaded and cast to bfloat16, bit for bit; a directed
    one differs from it only in the tensors it names, each element by at most one ulp; a one-ulp
    one in exactly one element."""
    import transformers

    def loaded(directory, architecture, cast=False):
        torch.manual_seed(0)
        model = getattr(transformers, architecture).from_pretrained(directory)
        return {
            k: v.clone()
            for k, v in (model.to(torch.bfloat16) if cast else model).state_dict().items()
        }

    nearest_spec = json.dumps({"cast": {"*": ["BF16", "nearest"]}})
    picked = _sample(mutations, lambda m: m.category == "cast-rounding" and m.kind != "nearest", 1)
    assert {m.kind for m in picked} == {"directed-up", "directed-down", "directed-zero", "ulp"}
    for m in picked:
        source = next(s for s in sources if s.name == m.source)
        nearest = Mutation(
            m.source,
            m.category,
            "nearest",
            "",
            (m.ops[0], ("retype", "model.safetensors", nearest_spec)),
            "pass",
            "",
            "",
        )
        dirs = {}
        for name, mut in (("nearest", nearest), ("mutant", m)):
            dirs[name] = tmp_path / f"{m.index}-{name}"
            shutil.copytree(source.candidate, dirs[name])
            apply(mut, dirs[name], tmp_path / f"{m.index}-{name}-outside")
        fold = loaded(source.candidate, source.architecture, cast=True)
        near, mutant = (loaded(dirs[k], source.architecture) for k in ("nearest", "mutant"))
        assert all(
            torch.equal(fold[k].view(torch.int16), near[k].view(torch.int16))
            for k in fold
            if fold[k].dtype == torch.bfloat16 and not k.startswith("pooler.")
        ), m.describe()
        moved = {
            k: int((near[k] != mutant[k]).sum())
            for k in near
            if not torch.equal(near[k], mutant[k])
        }
        assert moved, m.describe()
        for k in moved:  # one ulp either way: the larger of the gaps to the two neighbours
            x = near[k].double()
            gap = torch.maximum(
                *(
                    (torch.nextafter(near[k], torch.full_like(near[k], d)).double() - x).abs()
                    for d in (float("inf"), float("-inf"))
                )
            )
            assert bool(((mutant[k].double() - x).abs() <= gap).all()), m.describe()
        if m.kind == "ulp":
            assert list(moved.values()) == [1], m.describe()
        else:
            assert sum(moved.values()) == int(m.target.split("(")[1].split()[0]), m.describe()


def test_planted_cache_entries_sit_where_the_old_code_read(sources, mutations):
    """Each planted entry holds the plan the candidate's block records, under the key the old
    check computed from the reference's config.json and the recorded plan's options, in the
    directory ENJOYLN_CACHE names for the gate's run; and that plan lacks or moves one centering
    of the source's own plan."""
    planted = [m for m in mutations if m.category == "plan-cache"]
    assert planted
    for m in planted:
        source = next(s for s in sources if s.name == m.source)
        assert dict(m.env) == {"ENJOYLN_CACHE": "{outside}/cache", "ENJOYLN_PLAN_CACHE": "1"}
        config = json.loads(base64.b64decode(m.ops[0][2]))
        plan = config["enjoyln"]["plan"]
        with open(os.path.join(source.reference, "config.json")) as f:
            reference = json.load(f)
        options = {
            "auxiliary_centering": bool(plan["auxiliary"]),
            "fuse_affine": any(e.get("affine") for e in plan["layer_norms"]),
            "rotate": None,
        }
        plants = {op[1]: json.loads(base64.b64decode(op[2])) for op in m.ops if op[0] == "plant"}
        assert f"cache/plans/{old_cache_key(reference, options)}.json" in plants, m.describe()
        assert all(p == plan for p in plants.values())
        with open(os.path.join(source.candidate, "config.json")) as f:
            original = json.load(f)["enjoyln"]["plan"]
        before = {
            (e["name"], c["param"], c["axis"])
            for e in original["layer_norms"]
            for c in e["centered"]
        }
        after = {
            (e["name"], c["param"], c["axis"]) for e in plan["layer_norms"] for c in e["centered"]
        }
        assert after != before and (after < before) == (m.kind == "dropped-centering"), m.describe()


def test_the_gate_runs_in_a_mutations_environment_alone(sources, tmp_path):
    """The environment a mutation names is set for the gate's run and restored after it."""
    source = sources[0]
    before = dict(os.environ)
    code, message = gate(
        source.reference,
        source.candidate,
        (),
        {"ENJOYLN_CACHE": str(tmp_path / "cache"), "ENJOYLN_PLAN_CACHE": "1"},
    )
    assert (code, message) == (0, "")
    assert dict(os.environ) == before
