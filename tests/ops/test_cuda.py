"""The CUDA policy (ops/cuda.py) without a GPU: which path each call takes given what the
process has, the fallbacks and what status() says, and the arithmetic of the paths that need
no GPU to run (torch's F.rms_norm, then the bias add) on CPU tensors. The Triton paths' arithmetic
is tested under the interpreter (test_triton.py), their launcher against fakes
(test_triton_cached.py)."""

import copy
import types

import pytest
import torch

import enjoyln
from enjoyln import ops
from enjoyln.checking.forward import FACTOR
from enjoyln.ops import cuda
from enjoyln.ops.reference import rms_norm_reference
from enjoyln.testing import perturb, tiny_model


class FakeKernels:
    """The triton_kernels module's surface: records what it is asked to run."""

    triton = types.SimpleNamespace(__version__="3.9.0")

    def __init__(self, off=None):
        self.off, self.calls = off, []

    def launcher_disabled(self):
        return self.off

    def rms_norm_triton(self, x, weight, bias, eps, cached):
        self.calls.append(("rms_norm", tuple(x.shape), cached))
        flat = [
            t.reshape(-1) if t is not None else None for t in (weight, bias)
        ]  # the kernel reads them flat
        return rms_norm_reference(x, (x.shape[-1],), *flat, eps)

    def add_rms_norm_triton(self, x, residual, weight, bias, eps, cached):
        self.calls.append(("add_rms_norm", tuple(x.shape), cached))
        s = x + residual
        return s, rms_norm_reference(s, (x.shape[-1],), weight, bias, eps)


@pytest.fixture
def state(monkeypatch):
    """Install a process state: ``state(native=..., triton=FakeKernels() or None, forced=...)``."""
    monkeypatch.setattr(cuda, "_state", None)

    def install(**fields):
        st = cuda._State(**fields)
        monkeypatch.setattr(cuda, "_state", st)
        return st

    return install


SMALL, LARGE = (
    torch.empty(2048, 768, dtype=torch.bfloat16),
    torch.empty(8192, 4096, dtype=torch.bfloat16),
)
W, B = torch.empty(768, dtype=torch.bfloat16), torch.empty(768, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "native, triton, off, x, bias, residual, path",
    [
        # everything at hand: F.rms_norm without a bias, Triton (cached) with one, Triton when large
        (True, True, None, SMALL, None, False, "native"),
        (True, True, None, SMALL, B, False, "triton"),
        (True, True, None, SMALL, None, True, "triton"),
        (True, True, None, LARGE, None, False, "triton"),
        # the cached launcher off: F.rms_norm then the add below 32 MiB, Triton's launcher above
        (True, True, "hooks", SMALL, B, False, "native+bias"),
        (True, True, "hooks", SMALL, None, False, "native"),
        (True, True, "hooks", LARGE, B, False, "triton-jit"),
        # no fused F.rms_norm in this torch: Triton throughout
        (False, True, None, SMALL, None, False, "triton"),
        (False, True, "hooks", SMALL, B, False, "triton-jit"),
        # no Triton
        (True, False, None, SMALL, B, False, "native+bias"),
        (True, False, None, LARGE, None, True, "native"),
        (False, False, None, SMALL, B, False, "reference"),
    ],
)
def test_the_policy(state, native, triton, off, x, bias, residual, path):
    state(native=native, triton=FakeKernels(off) if triton else None)
    assert cuda.choose(x, W, bias, residual=residual) == path


@pytest.mark.parametrize(
    "forced, bias, path",
    [
        ("native", B, "native+bias"),
        ("native", None, "native"),
        ("triton-jit", None, "triton-jit"),
        ("reference", B, "reference"),
    ],
)
def test_a_pinned_path_is_taken_whatever_the_call(state, forced, bias, path):
    state(native=True, triton=FakeKernels(), forced=forced)
    assert cuda.choose(LARGE, W, bias) == path


def test_triton_paths_reach_the_kernels_with_the_launcher_asked_for(state):
    kernels = FakeKernels()
    state(native=True, triton=kernels)
    x, r = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    w, b = torch.rand(8), torch.randn(8)
    cuda.rms_norm_cuda(x, (8,), w, b, 1e-5)
    s, y = cuda.add_rms_norm_cuda(x, r, (8,), w, None, 1e-5)
    cuda.rms_norm_cuda(
        x, (3, 8), torch.rand(3, 8), torch.randn(3, 8), 1e-5
    )  # two normalised axes: flattened
    assert kernels.calls == [
        ("rms_norm", (4, 3, 8), True),
        ("add_rms_norm", (4, 3, 8), True),
        ("rms_norm", (4, 24), True),
    ]
    assert torch.equal(s, x + r)
    kernels.off = "hooks"  # Triton's launcher now; F.rms_norm, then the add, below 32 MiB
    assert cuda.choose(x, w, b) == "native+bias"
    s, y = cuda.add_rms_norm_cuda(x, r, (8,), w, b, 1e-5)
    assert len(kernels.calls) == 3 and torch.equal(s, x + r)


def ulps(a, truth, dtype):
    return float(
        (a.double() - truth).abs().max() / truth.abs().max().clamp_min(1.0) / torch.finfo(dtype).eps
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_the_native_paths_are_as_exact_as_layer_norm(state, dtype, affine):
    """F.rms_norm rounds once; with a bias the add rounds a second time, so the native path may be
    half an ulp (of the output's scale) farther from the float64 truth than LayerNorm on the same
    zero-mean input, no more."""
    state(native=True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 96, generator=gen, dtype=torch.float64) * 3
    x = (x - x.mean(-1, keepdim=True)).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype) if affine in ("both", "weight") else None
    b = torch.randn(96, generator=gen).to(dtype) if affine in ("both", "bias") else None
    y = cuda.rms_norm_cuda(x, (96,), w, b, 1e-5)
    truth = torch.nn.functional.layer_norm(
        x.double(),
        (96,),
        None if w is None else w.double(),
        None if b is None else b.double(),
        1e-5,
    )
    ln = torch.nn.functional.layer_norm(x, (96,), w, b, 1e-5)
    assert y.dtype == dtype and ulps(y, truth, dtype) <= ulps(ln, truth, dtype) + 0.5


@pytest.mark.parametrize("name", ["gpt2", "opt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_folded_model_through_the_native_path_stays_as_close_as_the_original(
    state, monkeypatch, name, dtype
):
    """In bf16 and fp16, the folded model run through F.rms_norm and the bias add is as close to
    the float32 original as the original in that dtype is: within the check's precision-aware
    criterion (max error within ``FACTOR`` times the original's), and in RMS error within 1.25x
    (the bias add's second rounding: 1.03-1.19x over five tiny models when this was written)."""
    state(native=True)
    original = perturb(tiny_model(name), seed=3).eval()
    folded = enjoyln.fold(copy.deepcopy(original))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        truth = original(input_ids=ids).logits.double()
        low = copy.deepcopy(original).to(dtype)(input_ids=ids).logits.double()
        monkeypatch.setattr(
            ops,
            "rms_norm",
            lambda x, shape, weight=None, bias=None, eps=1e-5: cuda.rms_norm_cuda(
                x, shape, weight, bias, eps
            ),
        )
        candidate = folded.to(dtype)(input_ids=ids).logits.double()
    assert float((candidate - truth).abs().max()) <= FACTOR * float((low - truth).abs().max())
    rms = lambda t: float((t - truth).square().mean().sqrt())  # noqa: E731
    assert rms(candidate) <= 1.25 * rms(low)


def test_status_names_the_path_and_why(state, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    state(native=True, triton=FakeKernels())
    text = cuda.status()
    assert (
        "F.rms_norm without a bias" in text and "Triton 3.9.0" in text and "cached launcher" in text
    )
    state(native=True, triton=FakeKernels(off="Triton launch hooks are set"))
    text = cuda.status()
    assert (
        "Triton's own launcher" in text
        and "the cached launcher is off: Triton launch hooks are set" in text
    )
    state(
        native=False,
        native_reason="torch 2.6's F.rms_norm has no fused CUDA kernel",
        triton=None,
        triton_reason="no Triton",
    )
    assert (
        cuda.status()
        == "reference PyTorch (no Triton; torch 2.6's F.rms_norm has no fused CUDA kernel)"
    )


def test_forcing_a_path(monkeypatch):
    monkeypatch.setattr(cuda, "_state", None)
    monkeypatch.setattr(cuda, "_import_kernels", lambda: (None, "no Triton (test)"))
    with pytest.raises(ValueError, match="unknown CUDA path"):
        cuda.force("fast")
    with pytest.raises(RuntimeError, match="no Triton"):
        cuda.force("triton")
    cuda.force("reference")
    assert cuda.choose(SMALL, W, B) == "reference"
    cuda.force(None)
    monkeypatch.setenv("ENJOYLN_CUDA_PATH", "warp")
    assert "ENJOYLN_CUDA_PATH=warp is not one of" in cuda._setup().notes[0]
    monkeypatch.setenv("ENJOYLN_CUDA_PATH", "native")
    assert cuda._setup().forced == "native"


def test_cpu_calls_never_look_for_triton(monkeypatch):
    """The CPU hot path and the CPU backends decide nothing about CUDA."""
    monkeypatch.setattr(cuda, "_state", None)
    ops.rms_norm(torch.randn(2, 8), (8,))
    assert ops.backend(torch.randn(2, 8)) in ("cpu", "reference")
    assert cuda._state is None


WIDE = torch.empty(2048, 768, dtype=torch.float64)
STATES = [
    dict(native=native, triton=triton, off=off, forced=forced)
    for native in (True, False)
    for triton in (True, False)
    for off in (None, "hooks")
    for forced in (None, *cuda.PATHS)
    if triton or off is None
]


@pytest.mark.parametrize("st", STATES, ids=str)
def test_float64_never_reaches_a_triton_kernel(state, st):
    """The Triton kernels compute in float32: float64 (x, weight or bias) takes torch's own path,
    whatever the process has or pins, at any size, fused with a residual or not, contiguous or
    not."""
    kernels = FakeKernels(st["off"]) if st["triton"] else None
    state(native=st["native"], triton=kernels, forced=st["forced"])
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    w, b = torch.rand(8, dtype=torch.float64) + 0.5, torch.randn(8, dtype=torch.float64)
    for big in (WIDE, torch.empty(8192, 4096, dtype=torch.float64)):
        for bias, residual in (
            (None, False),
            (B.double(), False),
            (None, True),
            (B.double(), True),
        ):
            assert cuda.choose(big, W.double(), bias, residual=residual) in (
                "native",
                "native+bias",
                "reference",
            )
    for args in (
        (x.float(), w, None),
        (x.float(), w.float(), b),
        (x, None, None),
    ):  # any one of them float64
        assert not cuda.narrow(*args) and cuda.choose(*args) not in ("triton", "triton-jit")
    assert (
        cuda.unfused(x.transpose(0, 1), w, b) == "reference"
    )  # strided, which the hot path turns away
    y = cuda.rms_norm_cuda(x, (8,), w, b, 1e-5)
    s, z = cuda.add_rms_norm_cuda(x, x, (8,), w, b, 1e-5)
    t = cuda.rms_norm_any(x.transpose(0, 1), (8,), w, b, 1e-5)
    assert kernels is None or kernels.calls == []
    truth = rms_norm_reference(x, (8,), w, b, 1e-5)
    assert y.dtype == z.dtype == t.dtype == torch.float64
    torch.testing.assert_close(y, truth, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(
        z, rms_norm_reference(x + x, (8,), w, b, 1e-5), rtol=1e-15, atol=1e-15
    )
    torch.testing.assert_close(
        t, rms_norm_reference(x.transpose(0, 1), (8,), w, b, 1e-5), rtol=1e-15, atol=1e-15
    )


def test_narrow_dtypes_still_take_triton_where_the_policy_says(state):
    kernels = FakeKernels()
    state(native=True, triton=kernels)
    x = torch.randn(4, 8)
    assert cuda.choose(x, W.float(), B.float()) == "triton"
    assert (
        cuda.unfused(x.t(), None, None) == "triton"
        and cuda.unfused(x, torch.rand(8, dtype=torch.bfloat16), None) == "triton"
    )
    cuda.rms_norm_any(x.t(), (4,), None, None, 1e-5)
    assert kernels.calls == [("rms_norm", (8, 4), True)]


class Failing(FakeKernels):
    """Triton that cannot compile or launch here."""

    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def rms_norm_triton(self, *args, **kwargs):
        self.calls.append("rms_norm")
        raise self.exc

    add_rms_norm_triton = rms_norm_triton


@pytest.mark.parametrize("native", [True, False])
def test_a_failing_triton_kernel_falls_back_once_and_says_why(state, native):
    st = state(
        native=native,
        triton=Failing(RuntimeError("PTX .version 8.7 does not support .target sm_120\nmore")),
    )
    kernels = st.triton
    x, r, w, b = torch.randn(4, 8), torch.randn(4, 8), torch.rand(8) + 0.5, torch.randn(8)
    with pytest.warns(RuntimeWarning) as caught:
        y = cuda.rms_norm_cuda(x, (8,), w, b, 1e-5)
        s, z = cuda.add_rms_norm_cuda(x, r, (8,), w, b, 1e-5)
        t = cuda.rms_norm_any(x.t(), (4,), None, None, 1e-5)
    instead = "torch's F.rms_norm" if native else "reference PyTorch"
    assert [str(c.message) for c in caught] == [
        "enjoyln: the Triton RMSNorm kernel failed (RuntimeError: PTX .version 8.7 does not "
        "support .target "
        f"sm_120); {instead} runs instead for the rest of this process"
    ]
    assert kernels.calls == ["rms_norm"]  # tried once
    assert st.triton is None and "the Triton kernel failed (RuntimeError: PTX" in st.triton_reason
    torch.testing.assert_close(y, rms_norm_reference(x, (8,), w, b, 1e-5))
    torch.testing.assert_close(z, rms_norm_reference(x + r, (8,), w, b, 1e-5))
    torch.testing.assert_close(t, rms_norm_reference(x.t(), (4,), None, None, 1e-5))
    assert torch.equal(s, x + r)


def test_a_pinned_triton_path_that_fails_falls_back_too(state):
    st = state(
        native=True,
        triton=Failing(RuntimeError("out of resources: shared memory")),
        forced="triton",
    )
    with pytest.warns(RuntimeWarning, match="out of resources"):
        y = cuda.add_rms_norm_cuda(torch.ones(2, 4), torch.ones(2, 4), (4,), None, None, 0.0)[1]
    assert st.forced is None and torch.equal(y, torch.ones(2, 4))


def test_out_of_memory_is_raised_not_blamed_on_triton(state):
    st = state(native=True, triton=Failing(torch.cuda.OutOfMemoryError("CUDA out of memory")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        cuda.rms_norm_cuda(torch.randn(2, 4), (4,), None, torch.randn(4), 1e-5)
    assert st.triton is not None


def test_each_case_is_listed_with_its_path(state):
    state(native=True, triton=FakeKernels())
    assert cuda.cases() == {
        "bf16/fp16/fp32, weight only or none": "torch's F.rms_norm",
        "bf16/fp16/fp32, with a bias": "enjoyln's Triton kernel, cached launcher",
        "the residual add fused (add_rms_norm)": "enjoyln's Triton kernel, cached launcher",
        "32 MiB of input or more": "enjoyln's Triton kernel, cached launcher",
        "float64": "torch's F.rms_norm, then the bias add",
        "strided rows, or the weight in another dtype": "enjoyln's Triton kernel, cached launcher",
        "a gradient needed": "torch's F.rms_norm, then the bias add, through torch's autograd",
    }
    state(native=True, triton=FakeKernels(off="hooks"))
    assert cuda.cases()["bf16/fp16/fp32, with a bias"] == "torch's F.rms_norm, then the bias add"
    assert cuda.cases()["32 MiB of input or more"] == "enjoyln's Triton kernel, Triton's launcher"
    state(native=False, triton=None)
    assert set(cuda.cases().values()) == {
        "reference PyTorch",
        "torch's F.rms_norm, then the bias add",
        "torch's F.rms_norm, then the bias add, through torch's autograd",
    }
