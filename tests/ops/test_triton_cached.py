"""The cached launcher, against fakes of Triton's launch protocol (no GPU here, none in CI).

A fake kernel behaves as ``triton.jit`` functions do: ``kernel[grid](*args, num_warps=...)``
calls its compiled kernel's launcher with the nine leading arguments and then the kernel's
own (all of them, as Triton 3.3+ passes them, or the runtime ones only, as 3.0-3.2 did), and
returns the compiled kernel, whose ``run`` is a property (3.3+) or an attribute (before).
The real kernels run through the launcher under the interpreter in test_triton.py.
"""

import pytest
import torch

from enjoyln.ops import triton_cached
from enjoyln.ops.triton_cached import CachedLauncher

STREAM = 1234
# a launcher turned off warns (once per process): what the tests of that assert, the others need not
# show
pytestmark = pytest.mark.filterwarnings(
    "ignore:enjoyln. the Triton kernel's cached launcher:RuntimeWarning"
)


class NewCompiled:
    """Triton 3.3+: ``run`` reads ``_run``."""

    def __init__(self, launcher):
        self._run = launcher

    @property
    def run(self):
        return self._run


class OldCompiled:
    """Triton 3.0-3.2: ``run`` is an attribute."""

    def __init__(self, launcher):
        self.run = launcher


class FakeKernel:
    """``Y = X * SCALE``; arguments (X, Y, n, SCALE), SCALE a constexpr."""

    def __init__(
        self,
        all_args=True,
        old=False,
        hooks=None,
        direct_scale=None,
        direct_raises=False,
        returns=True,
        kwargs=None,
        devices=None,
    ):
        self.all_args, self.hooks, self.returns, self.kwargs = (
            all_args,
            hooks,
            returns,
            kwargs or {},
        )
        self.direct_scale, self.direct_raises = direct_scale, direct_raises
        self.compiled = (OldCompiled if old else NewCompiled)(self._launcher)
        self.jit_launches, self.direct_calls, self._in_jit = 0, [], False
        self.devices, self.launched_on = devices, []  # the device current at each launch

    def _launcher(self, gx, gy, gz, stream, function, packed, meta, enter, exit_, *args, **kwargs):
        assert (function, packed) == ("function", "packed")
        if self.devices is not None:
            self.launched_on.append(self.devices.current)
        x, y, n = args[:3]
        scale = args[3] if len(args) > 3 else 2.0  # before 3.3 the constexpr is compiled in
        if not self._in_jit:
            self.direct_calls.append((gx, gy, gz, stream, len(args)))
            if self.direct_raises:
                raise TypeError("function takes 13 arguments")
            scale = self.direct_scale or scale
        y.copy_(x * scale)  # a kernel writes all of its output

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            self.jit_launches += 1
            tail = args if self.all_args else args[:3]
            self._in_jit = True
            try:
                stream = (
                    STREAM if self.devices is None else STREAM + self.devices.current
                )  # its current stream
                self.compiled.run(
                    grid[0],
                    1,
                    1,
                    stream,
                    "function",
                    "packed",
                    None,
                    self.hooks,
                    self.hooks,
                    *tail,
                    **self.kwargs,
                )
            finally:
                self._in_jit = False
            return self.compiled if self.returns else None

        return launch


class Devices:
    """The process's current GPU, as torch.cuda.device switches it."""

    def __init__(self):
        self.current, self.switches = 0, []

    def exchange(self, device):
        before, self.current = self.current, device
        self.switches.append(device)
        return before


@pytest.fixture(autouse=True)
def not_capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        triton_cached, "_warned", []
    )  # each test starts in a process that has not warned


def make(kernel):
    return CachedLauncher(
        kernel, runtime_args=3, stream=lambda device: STREAM, current_device=lambda: 0
    )


def call(launcher, key=("k",), n=6, grid=3):
    x, y = torch.arange(8.0), torch.zeros(8)
    launcher(key, grid, (x, y, n, 2.0), 4, 0, (y,))
    return x, y


@pytest.mark.parametrize("old", [False, True], ids=["run-property", "run-attribute"])
@pytest.mark.parametrize("all_args", [True, False], ids=["all-args", "runtime-args"])
def test_verified_once_then_launched_directly(old, all_args):
    kernel = FakeKernel(all_args=all_args, old=old)
    launcher = make(kernel)
    x, y = call(launcher)
    assert torch.equal(y, x * 2) and launcher.disabled is None and launcher.verified == 1
    assert kernel.jit_launches == 2  # the result, then the launch watched
    assert len(kernel.direct_calls) == 1  # the verification
    for _ in range(3):
        x, y = call(launcher)
        assert torch.equal(y, x * 2)
    assert kernel.jit_launches == 2  # Triton's dispatch skipped from the second call
    assert kernel.direct_calls[-1] == (3, 1, 1, STREAM, 4 if all_args else 3)
    assert (
        isinstance(type(kernel.compiled).__dict__.get("run"), property) != old
    )  # the spy put back
    assert kernel.compiled.run == kernel._launcher


def test_each_key_is_verified_on_its_first_use():
    kernel = FakeKernel()
    launcher = make(kernel)
    call(launcher, key=("a",))
    call(launcher, key=("b",), n=5)
    call(launcher, key=("a",))
    assert launcher.verified == 2 and kernel.jit_launches == 4 and len(kernel.direct_calls) == 3


@pytest.mark.parametrize(
    "fake, reason",
    [
        (dict(direct_scale=3.0), "other bits"),
        (dict(direct_raises=True), "raised TypeError"),
        (dict(hooks=print), "launch hooks"),
        (dict(kwargs={"xcd_metadata": 1}), "keyword arguments"),
        (dict(returns=False), "no compiled kernel"),
    ],
)
def test_anything_unexpected_turns_it_off_and_the_result_stays_triton_s(fake, reason):
    kernel = FakeKernel(**fake)
    launcher = make(kernel)
    x, y = call(launcher)
    assert reason in launcher.disabled and launcher.verified == 0
    assert torch.equal(y, x * 2)  # the first call's output is Triton's launch's
    before = kernel.jit_launches
    x, y = call(launcher, key=("other",))
    assert kernel.jit_launches == before + 1 and torch.equal(y, x * 2)  # Triton's, from now on


def test_an_unknown_argument_layout_turns_it_off():
    kernel = FakeKernel()
    launcher = CachedLauncher(
        kernel, runtime_args=2, stream=lambda d: STREAM, current_device=lambda: 0
    )
    kernel.all_args = False  # Triton passes 3 of the 4 arguments; the launcher expects 4 or 2
    call(launcher)
    assert "3 kernel arguments" in launcher.disabled


def test_another_stream_turns_it_off():
    launcher = CachedLauncher(
        FakeKernel(), runtime_args=3, stream=lambda d: 99, current_device=lambda: 0
    )
    call(launcher)
    assert "another stream" in launcher.disabled


def test_nothing_is_verified_while_a_graph_is_captured(monkeypatch):
    kernel = FakeKernel()
    launcher = make(kernel)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x, y = call(launcher)
    assert torch.equal(y, x * 2) and kernel.jit_launches == 1 and not kernel.direct_calls
    assert launcher.disabled is None and launcher.verified == 0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    call(launcher)
    assert launcher.verified == 1  # verified on the first call outside the capture


def test_a_tensor_on_another_device_is_verified_then_launched_directly_on_it():
    """With ``device_map="auto"`` most tensors are on a GPU other than the current one: each launch,
    the first (Triton's) and the direct ones, runs with that GPU current and on its stream, then
    switches back."""
    devices = Devices()
    kernel = FakeKernel(devices=devices)
    launcher = CachedLauncher(
        kernel,
        runtime_args=3,
        stream=lambda device: STREAM + device,
        current_device=lambda: devices.current,
        exchange_device=devices.exchange,
    )
    x, y = torch.arange(8.0), torch.zeros(8)
    for _ in range(3):
        y.zero_()
        launcher(("k", 1), 3, (x, y, 6, 2.0), 4, 1, (y,))  # device 1, the current one is 0
        assert torch.equal(y, x * 2) and devices.current == 0
    assert launcher.verified == 1 and launcher.disabled is None
    assert kernel.jit_launches == 2  # Triton's dispatch on the first call only
    assert kernel.launched_on == [1] * 5  # 2 of Triton's, the check, 2 direct
    assert [call[3] for call in kernel.direct_calls] == [STREAM + 1] * 3
    assert devices.switches == [1, 0] * 3


def test_the_first_launcher_turned_off_warns_once():
    with pytest.warns(RuntimeWarning) as caught:
        call(make(FakeKernel(direct_scale=3.0)))
        call(make(FakeKernel(hooks=print)))  # another launcher (kernel), turned off too
        call(make(FakeKernel()))
    assert [str(w.message) for w in caught] == [
        "enjoyln: the Triton kernel's cached launcher is off for this process (a direct launch "
        "gave other bits "
        "than Triton's launcher); Triton's own launcher runs instead, with more host time per call"
    ]


def test_an_output_with_nan_proves_nothing_and_waits_for_another_call():
    """The direct launch writes into outputs cleared to NaN: were Triton's result NaN, a launch
    that wrote nothing would pass. Such a call is not used to verify."""
    kernel = FakeKernel(
        direct_scale=3.0
    )  # a direct launch that would be wrong: it is never used here
    launcher = make(kernel)
    x, y = torch.full((8,), float("nan")), torch.zeros(8)
    launcher(("k",), 3, (x, y, 8, 2.0), 4, 0, (y,))
    assert launcher.verified == 0 and launcher.disabled is None and not kernel.direct_calls
    call(launcher)  # finite values: verified now, and the wrong direct launch is caught
    assert "other bits" in launcher.disabled


def test_the_installed_triton_reads_the_launcher_where_the_spy_goes():
    """On this Triton, ``CompiledKernel.run`` is a property that returns ``_run`` once set: the
    slot the launcher puts its spy in (earlier Triton 3.x set ``run`` itself, the other slot)."""
    import inspect

    pytest.importorskip("triton")
    from triton.compiler import CompiledKernel

    assert isinstance(inspect.getattr_static(CompiledKernel, "run"), property)
    kernel = CompiledKernel.__new__(CompiledKernel)
    kernel.module = None  # nothing loaded: what its __del__ checks
    kernel._run = marker = object()
    assert kernel.run is marker
