"""The Triton kernels, run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1)."""

import importlib
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before the import
triton = pytest.importorskip(
    "triton", reason="triton is not installed (pip install 'enjoyln[triton]')"
)
kernels = importlib.import_module("enjoyln.ops.triton_kernels")
interpreter = importlib.import_module("triton.runtime.interpreter")
tl = importlib.import_module("triton.language")

from enjoyln.ops.reference import rms_norm_reference  # noqa: E402
from enjoyln.ops.triton_launch import MAX_FUSED, LaunchConfig  # noqa: E402


@triton.jit
def _count(Y, N):
    acc = 0.0
    for _ in range(0, N, 1):  # a loop bounded by a runtime argument, as in the looped kernel
        acc += 1.0
    tl.store(Y, acc)


def _loops_run() -> bool:
    y = torch.zeros(1)
    try:
        _count[(1,)](y, 3)
    except Exception:  # noqa: BLE001 - the interpreter's own error: it cannot run this loop
        return False
    return float(y[0]) == 3.0


def _index_as_triton_3_9(original):
    """Triton's interpreter turns a scalar argument into a one-element array; before Triton 3.9 its
    ``__index__`` (what ``range(0, N, BLOCK)`` calls) is ``int()`` of that array, which NumPy 2.4
    refuses.
    3.9 reads ``int(data.squeeze())``: the same, done here for an older interpreter."""

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch


def _how_loops_run() -> str:
    """'' where the interpreter runs the looped kernel as it is, 'patched' where it does with 3.9's
    ``__index__``, else why it cannot (the looped kernel's tests are then skipped with that
    reason)."""
    if _loops_run():
        return ""
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return (
            f"Triton {triton.__version__}'s interpreter cannot run a loop bounded by a runtime "
            "argument"
        )
    interpreter._patch_lang_tensor = _index_as_triton_3_9(original)
    try:
        return (
            "patched"
            if _loops_run()
            else (
                f"Triton {triton.__version__}'s interpreter cannot run a loop "
                "bounded by a runtime argument, even with 3.9's __index__"
            )
        )
    finally:
        interpreter._patch_lang_tensor = original


LOOPS = _how_loops_run()


@pytest.fixture(autouse=True)
def interpreter_loops(monkeypatch):
    """Every test here runs on an interpreter that can run the looped kernel, or is told why not."""
    if LOOPS == "patched":
        monkeypatch.setattr(
            interpreter, "_patch_lang_tensor", _index_as_triton_3_9(interpreter._patch_lang_tensor)
        )


def looped(value, loops=None):
    """A test parameter (a row length, or a config when ``loops`` says whether it runs the looped
    kernel), skipped with the reason where the interpreter cannot run the looped kernel."""
    if (value > MAX_FUSED if loops is None else loops) and LOOPS not in ("", "patched"):
        return pytest.param(value, marks=pytest.mark.skip(reason=LOOPS))
    return value


# N = 1, non-powers of two, a power of two, and rows beyond one block (the looped kernel)
NS = [looped(n) for n in (1, 7, 96, 1000, 1024, 16_384, 16_385, 70_001)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulps(a, b, dtype):
    eps = torch.finfo(dtype).eps
    scale = b.float().abs().max().clamp_min(1.0)
    return float((a.float() - b.float()).abs().max() / scale / eps)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_reference(n, dtype, bias):
    rows = 3 if n > 10_000 else 5
    x = (torch.randn(rows, n) * 2 + 0.3).to(dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    y = kernels.rms_norm_triton(x, w, b, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert ulps(y, rms_norm_reference(x, (n,), w, b, 1e-5), dtype) <= 4


@pytest.mark.parametrize("n", [looped(n) for n in (1, 96, 1000, 16_385, 70_001)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_variant_returns_sum_and_norm(n, dtype):
    x, r = torch.randn(3, n).to(dtype), torch.randn(3, n).to(dtype)
    w, b = (torch.rand(n) + 0.5).to(dtype), torch.randn(n).to(dtype)
    s, y = kernels.add_rms_norm_triton(x, r, w, b, 1e-6)
    assert ulps(s, x.float() + r.float(), dtype) <= 1
    assert ulps(y, rms_norm_reference(s, (n,), w, b, 1e-6), dtype) <= 4


def test_no_weight_and_strided_rows():
    x = torch.randn(6, 64)[::2]  # rows with a stride of 128
    y = kernels.rms_norm_triton(x)
    assert ulps(y, rms_norm_reference(x, (64,)), torch.float32) <= 4


def test_launch_config_follows_n():
    from enjoyln.ops.triton_launch import LaunchConfig, all_configs

    assert kernels.launch_config(768) == LaunchConfig("rows", 1024, 4, 8)  # 2048 rows: 512 programs
    assert kernels.launch_config(64) == LaunchConfig("rows", 64, 16, 4)
    assert kernels.launch_config(1) == LaunchConfig("rows", 1, 16, 4)
    assert kernels.launch_config(1025) == LaunchConfig("row", 2048, 1, 8)
    assert kernels.launch_config(4096) == LaunchConfig("row", 4096, 1, 8)
    assert kernels.launch_config(16384) == LaunchConfig("row", 16384, 1, 16)
    assert kernels.launch_config(16385) == LaunchConfig("looped", 2048, 1, 8)
    assert {c.kernel for c in all_configs()} == {"rows", "row", "looped"} and len(
        all_configs()
    ) == 16


# each kernel forced at a small size: the rows kernel over 7 rows, 4 to a program (the last
# program half empty), the looped one in blocks of 32 over rows of 100 (four passes each)
FORCED = [
    LaunchConfig("rows", 128, 4, 4),
    LaunchConfig("row", 128, 1, 4),
    LaunchConfig("looped", 32, 1, 4),
]


@pytest.mark.parametrize(
    "config", [looped(c, c.kernel == "looped") for c in FORCED], ids=[c.kernel for c in FORCED]
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_every_variant_matches_reference(config, dtype, residual, affine):
    """Every kernel, dtype, residual and (weight, bias) combination the AOT build compiles."""
    gen = torch.Generator().manual_seed(hash((config, str(dtype), residual, affine)) % 2**31)
    x, r = (
        (torch.randn(7, 100, generator=gen) * 2 + 0.3).to(dtype),
        torch.randn(7, 100, generator=gen).to(dtype),
    )
    w = (torch.rand(100, generator=gen) + 0.5).to(dtype) if affine in ("both", "weight") else None
    b = torch.randn(100, generator=gen).to(dtype) if affine in ("both", "bias") else None
    y, s = kernels._launch(x, r if residual else None, w, b, 1e-5, config=config)
    normed = (x + r) if residual else x  # the sum rounded to the dtype, as the unfused norm sees it
    assert y.dtype == dtype and y.shape == x.shape
    assert ulps(y, rms_norm_reference(normed, (100,), w, b, 1e-5), dtype) <= 4
    if residual:
        assert_sum(s, x, r)
    else:
        assert s is None


def assert_sum(s, x, r):
    """``s`` is ``x + r`` rounded to the dtype, as torch rounds it: to nearest. Triton's
    interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest), so in bf16 an
    element may also be the truncated sum, never anything else."""
    if s.dtype != torch.bfloat16:
        assert torch.equal(s, x + r)
        return
    exact = x.float() + r.float()
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert bool(((s == x + r) | (s == truncated)).all())


def test_multi_row_kernel_on_strided_rows_and_n_of_one():
    x = torch.randn(14, 64)[::2]  # 7 rows, a stride of 128: the kernel reads them in place
    assert kernels.launch_config(64).kernel == "rows"
    assert ulps(kernels.rms_norm_triton(x), rms_norm_reference(x, (64,)), torch.float32) <= 4
    ones = torch.randn(37, 1) * 3  # N = 1: each row normalises to its sign (times the gain)
    w, b = torch.full((1,), 2.0), torch.full((1,), 0.5)
    torch.testing.assert_close(
        kernels.rms_norm_triton(ones, w, b, 1e-12), torch.sign(ones) * 2 + 0.5
    )


def test_leading_dims_keep_their_shape():
    x = torch.randn(2, 3, 5, 96)
    y = kernels.rms_norm_triton(x)
    assert y.shape == x.shape
    assert ulps(y, rms_norm_reference(x, (96,)), torch.float32) <= 4
    s, y = kernels.add_rms_norm_triton(x, x)
    assert_sum(s, x, x)
    assert y.shape == x.shape


def test_cpu_tensors_never_reach_the_cached_launcher():
    """The interpreter runs on CPU tensors (device -1): Triton's own launch, nothing verified."""
    kernels.rms_norm_triton(torch.randn(3, 96))
    assert kernels.launcher_disabled() is None
    assert all(launcher.verified == 0 for launcher in kernels.LAUNCHERS.values())


def test_the_kernels_share_the_signature_the_launcher_and_the_aot_build_assume():
    import inspect

    from tools import triton_aot

    for name, kernel in kernels.KERNELS.items():
        params = inspect.signature(kernel.fn).parameters
        runtime = [n for n, p in params.items() if "constexpr" not in str(p.annotation)]
        assert len(runtime) == kernels.RUNTIME_ARGS == triton_aot.KERNEL_ARGS, name
        signature, _, _ = triton_aot._signature(
            triton_aot.Variant(name, "fp32", True, True, True, 64, 4, True)
        )
        assert list(params) == list(signature), name
        assert kernels.LAUNCHERS[name].runtime_args == kernels.RUNTIME_ARGS


def test_the_launch_key_separates_what_triton_specialises(monkeypatch):
    """Aligned tensors go to the cached launcher under a key holding every dtype, the integers
    Triton specialises on and the device; an unaligned pointer, a forced launch or cached=False
    go through Triton's own launcher."""
    calls = []

    class Recorder:
        def __call__(self, key, grid, args, warps, device, outputs):
            calls.append(("cached", key, grid, warps, len(outputs)))

        def jit(self, grid, args, warps, device):
            calls.append(("jit", grid))

    monkeypatch.setitem(kernels.LAUNCHERS, "rows", Recorder())
    w, b = torch.rand(768), torch.randn(768)
    kernels.rms_norm_triton(torch.randn(10, 768), w, b)
    kernels.rms_norm_triton(torch.randn(20, 768)[::2], w.to(torch.float16), None)  # row stride 1536
    kernels.add_rms_norm_triton(torch.randn(2, 5, 768), torch.randn(2, 5, 768))
    kernels.rms_norm_triton(
        torch.randn(10 * 768 + 1)[1:].view(10, 768), w, b
    )  # 4 bytes off alignment
    kernels.rms_norm_triton(torch.randn(10, 768), w, b, cached=False)
    f32, f16 = torch.float32, torch.float16
    assert calls == [
        ("cached", (768, 768, 768, f32, f32, f32, f32, False, -1), 3, 8, 1),
        ("cached", (768, 1536, 1536, f32, f32, f16, None, False, -1), 3, 8, 1),
        ("cached", (768, 768, 768, f32, f32, None, None, True, -1), 3, 8, 2),
        ("jit", 3),
        ("jit", 3),
    ]
