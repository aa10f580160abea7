"""Every Triton kernel variant compiles ahead of time for sm_80 and sm_90, with no GPU,
and ptxas spills nothing to local memory.

The interpreter tests (test_triton.py) check the arithmetic; only the real
compiler shows whether a variant compiles and how many registers it needs.
Nothing here imports Triton: compilation runs in fresh processes, and the
interpreter tests need Triton imported with TRITON_INTERPRET=1 first.
"""

import pytest

from enjoyln.ops import triton_aot

pytestmark = pytest.mark.slow

_reason = triton_aot.ptxas_missing()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

PAIRS = [(v, arch) for v in triton_aot.variants() for arch in triton_aot.ARCHS]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """All variants compiled once, two at a time, into a private Triton cache."""
    results = triton_aot.compile_all(PAIRS, str(tmp_path_factory.mktemp("triton-cache")))
    return {(c.variant, c.arch): c for c in results}


def test_variants_cover_every_specialisation():
    kinds = {(v.kernel, v.dtype, v.residual, v.weight, v.bias, v.aligned) for v, _ in PAIRS}
    assert len(kinds) == 2 * 3 * 2 * 4 * 2  # kernel x dtype x residual x (weight, bias) x alignment
    blocks = {v.block for v, _ in PAIRS if v.kernel == "row"}
    assert blocks == {2 ** k for k in range(15)}  # 1 .. 16384, every block the launcher picks


@pytest.mark.parametrize("variant, arch", PAIRS, ids=[f"sm{a}-{v.name.replace(' ', '-')}" for v, a in PAIRS])
def test_compiles_without_spills(compiled, variant, arch):
    c = compiled[(variant, arch)]
    assert c.registers > 0
    assert c.spills == 0 and c.stack == 0, (
        f"{variant.name} on sm_{arch}: {c.registers} registers, {c.spill_stores} B spill stores, "
        f"{c.spill_loads} B spill loads, {c.stack} B stack")
    assert not c.ptx_local, f"{variant.name} on sm_{arch}: .local memory in the PTX"


def test_the_check_can_fail(tmp_path):
    """A row of 65536 in one block with 32 warps spills (64 registers a thread): the parse
    sees the spill, so a spilling variant would fail the test above."""
    v = triton_aot.Variant("row", "fp32", True, True, True, 65536, 32, aligned=False)
    (c,) = triton_aot.compile_all([(v, 80)], str(tmp_path), workers=1)
    assert c.registers == 64 and c.spill_stores > 0 and c.stack > 0
