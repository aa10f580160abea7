import functools
import os

# Triton's interpreter runs the kernels on CPU tensors (tests/ops/test_triton.py); Triton reads the
# variable when it is first imported, and any test module that imports transformers' model classes
# (torch._dynamo, then Triton) may be collected first
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import typer.testing  # noqa: E402

# typer's runner builds the click command from the functions' signatures on every invoke (50 ms
# for enjoyln's): build it once per app
typer.testing._get_command = functools.cache(typer.testing._get_command)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAX_WORKERS = 4
"""More workers than this mostly multiply the imports of torch and transformers (seconds and
about a GB each) for tests that are small."""


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # each worker its share of the cores, so that the workers' torch threads do not outnumber them
    torch.set_num_threads(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core up to MAX_WORKERS; none on one core."""
    cores = _cores()
    return 0 if cores < 2 else min(cores, MAX_WORKERS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_analyses(request):
    """A test that patches code in process may change what an analysis computes: it starts and
    ends without the analyses earlier tests left in this worker's memo."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    from enjoyln.folded.planning import forget_analyses

    forget_analyses()
    yield
    forget_analyses()


def assert_same_outputs(reference, candidate, inputs, rtol=1e-5, skip=()):
    """Independent of enjoyln.check: every output but ``skip`` (a plan's changed outputs, which
    must then differ) within rtol of the reference's scale."""
    from enjoyln.testing import max_relative_diff, model_outputs

    ref, cand = model_outputs(reference, inputs), model_outputs(candidate, inputs)
    assert ref.keys() == cand.keys()
    assert ref, "the model returned no tensors"
    for name in skip:
        assert max_relative_diff(ref[name], cand[name]) > 1e-3, f"{name} did not change"
    for name in set(ref) - set(skip):
        assert ref[name].shape == cand[name].shape, name
        assert ref[name].dtype == cand[name].dtype, name
        rel = max_relative_diff(ref[name], cand[name])
        assert rel <= rtol, f"{name}: relative difference {rel:.3g} > {rtol:g}"


def steps_keep_their_promise(model, plan, inputs):
    """Apply the rewrite pipeline to a copy of ``model`` one step at a time; after each step
    that declares ``preserves_computation`` the outputs must be the original's. Returns the
    steps that do not declare it."""
    import copy

    from enjoyln.transform.steps import PIPELINE

    work, undeclared = copy.deepcopy(model), []
    for step in PIPELINE:
        step(work, plan)
        if step.preserves_computation:
            assert_same_outputs(model, work, inputs)
        else:
            undeclared.append(step)
    return undeclared


def copy_dir(src, dst):
    """A copy of a flat model directory's files (a fresh candidate to tamper with)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst
