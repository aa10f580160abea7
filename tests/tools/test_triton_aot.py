"""Every Triton kernel variant compiles ahead of time for sm_80 and sm_90, with no GPU,
and ptxas spills nothing to local memory.

The interpreter tests (test_triton.py) check the arithmetic; only the real
compiler shows whether a variant compiles and how many registers it needs.
Nothing here imports Triton: compilation runs in fresh processes, and the
interpreter tests need Triton imported with TRITON_INTERPRET=1 first.
"""

import pytest

from tools import triton_aot

pytestmark = pytest.mark.slow

_reason = triton_aot.ptxas_missing()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

PAIRS = triton_aot.builds()
CANARY = triton_aot.Variant("row", "fp32", True, True, True, 65536, 32, aligned=False)
"""A row of 65536 in one block with 32 warps: it spills (64 registers a thread), so the
check below is seen to fail on a spilling variant."""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """All builds and the canary compiled once, in one pool of two processes, into a private
    Triton cache."""
    results = triton_aot.compile_all(
        [*PAIRS, (CANARY, 80)], str(tmp_path_factory.mktemp("triton-cache"))
    )
    return {(c.variant, c.arch): c for c in results}


def test_builds_cover_every_specialisation():
    kinds = {(v.kernel, v.dtype, v.residual, v.weight, v.bias) for v, _ in PAIRS}
    assert len(kinds) == 3 * 3 * 2 * 4  # kernel x dtype x residual x (weight, bias): each compiles
    heaviest = {
        (v.kernel, v.dtype, v.aligned, arch)
        for v, arch in PAIRS
        if v.residual and v.weight and v.bias and v.block * v.rows in (4096, 16384, 2048)
    }
    assert len(heaviest) == 3 * 3 * 2 * 2  # where spills would start: both alignments, both archs
    launches = {(v.kernel, v.block, v.rows, v.warps) for v, _ in PAIRS}
    from enjoyln.ops.triton_launch import all_configs

    assert launches == set(all_configs())  # every launch the launcher picks
    assert {v.block for v, _ in PAIRS if v.kernel != "looped"} == {2**k for k in range(15)}


@pytest.mark.parametrize(
    "variant, arch", PAIRS, ids=[f"sm{a}-{v.name.replace(' ', '-')}" for v, a in PAIRS]
)
def test_compiles_without_spills(compiled, variant, arch):
    c = compiled[(variant, arch)]
    assert c.registers > 0
    assert c.spills == 0 and c.stack == 0, (
        f"{variant.name} on sm_{arch}: {c.registers} registers, {c.spill_stores} B spill stores, "
        f"{c.spill_loads} B spill loads, {c.stack} B stack"
    )
    assert not c.ptx_local, f"{variant.name} on sm_{arch}: .local memory in the PTX"


def test_the_check_can_fail(compiled):
    """The parse sees the canary's spill, so a spilling variant would fail the test above."""
    c = compiled[(CANARY, 80)]
    assert c.registers == 64 and c.spill_stores > 0 and c.stack > 0
