"""A launcher for a Triton kernel that skips Triton's Python dispatch (35 µs a call) on every call
but the first: on a key's first use it records the launch Triton makes, repeats it into fresh
outputs and compares them bit for bit, and anything unexpected turns it off for the process
(docs/performance.md). The caller's key must tell apart whatever Triton specialises on (dtypes,
16-byte alignment, integer classes, device)."""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any, Callable, Hashable, Sequence

import torch

from .compare import same_bytes

# grid x, y, z, stream, function, packed and launch metadata, enter and exit hooks: then the
# kernel's
PREFIX = 9


class CachedLauncher:
    """Launches ``kernel`` through its compiled launcher once verified; ``runtime_args``: its
    non-constexpr ones.

    >>> launcher = CachedLauncher(kernel, runtime_args=13)                    # doctest: +SKIP
    >>> launcher(key, grid, args, num_warps=4, device=0, outputs=(y,))       # doctest: +SKIP
    """

    def __init__(
        self,
        kernel: Any,
        runtime_args: int,
        *,
        stream: Callable[[int], int] | None = None,
        current_device: Callable[[], int] | None = None,
        exchange_device: Callable[[int], int] | None = None,
    ) -> None:
        self.kernel = kernel
        self.runtime_args = runtime_args
        self._stream = stream
        self._current_device = current_device
        self._exchange_device = exchange_device  # makes a device current, returns the one that was
        self._fast: dict[Hashable, tuple[Any, Any, Any, int | None]] = {}
        self._keep: list[Any] = []
        self._lock = threading.Lock()
        self.disabled: str | None = None  # why the launcher is off for this process, or None

    @property
    def verified(self) -> int:
        return len(self._fast)

    def __call__(
        self,
        key: Hashable,
        grid: int,
        args: Sequence[Any],
        num_warps: int,
        device: int,
        outputs: Sequence[torch.Tensor],
    ) -> None:
        """Launch ``grid`` programs with ``args`` on GPU ``device``; ``outputs`` are the tensors the
        kernel writes."""
        fast = self._fast.get(key)
        if fast is not None:
            run, function, packed, cut = fast
            current = self._current_device()
            if device == current:
                run(
                    grid,
                    1,
                    1,
                    self._stream(device),
                    function,
                    packed,
                    None,
                    None,
                    None,
                    *(args if cut is None else args[:cut]),
                )
                return
            # another GPU (device_map="auto"): its kernel was loaded with that device current, and
            # is launched so, as Triton would; switching costs two driver calls, not Triton's
            # dispatch
            self._exchange_device(device)
            try:
                run(
                    grid,
                    1,
                    1,
                    self._stream(device),
                    function,
                    packed,
                    None,
                    None,
                    None,
                    *(args if cut is None else args[:cut]),
                )
            finally:
                self._exchange_device(current)
            return
        if device < 0:  # CPU tensors: Triton's interpreter
            self.jit(grid, args, num_warps, device)
            return
        self._bind()
        current = self._current_device()
        if device != current:
            self._exchange_device(device)
        try:
            self._first_use(key, grid, args, num_warps, device, outputs)
        finally:
            if device != current:
                self._exchange_device(current)

    def jit(self, grid: int, args: Sequence[Any], num_warps: int, device: int) -> Any:
        if device >= 0:  # below: CPU tensors, Triton's interpreter
            self._bind()
        if device < 0 or device == self._current_device():
            return self.kernel[(grid,)](*args, num_warps=num_warps)
        with torch.cuda.device(device):  # Triton launches on the current device
            return self.kernel[(grid,)](*args, num_warps=num_warps)

    def _first_use(
        self,
        key: Hashable,
        grid: int,
        args: Sequence[Any],
        num_warps: int,
        device: int,
        outputs: Sequence[torch.Tensor],
    ) -> None:
        """Triton's launch, and on a key's first use the check of the direct one; ``device`` is
        current."""
        if self.disabled is not None or torch.cuda.is_current_stream_capturing():
            self.jit(grid, args, num_warps, device)
            return
        with self._lock:
            if key in self._fast or self.disabled is not None:
                self.jit(grid, args, num_warps, device)
                return
            compiled = self.jit(grid, args, num_warps, device)  # compiles if need be; the result
            expected = [o.clone() for o in outputs]  # every other launch must match
            if any(bool(torch.isnan(e).any()) for e in expected):
                # a direct launch that wrote nothing would leave NaN too: verify on a later call
                return
            fast = None
            try:
                fast = self._learn(compiled, grid, args, num_warps, device)
                if fast is not None:
                    self._verify(fast, grid, args, device, outputs, expected)
            except Exception as exc:  # noqa: BLE001 - whatever went wrong, Triton's launcher is right
                self.disabled = f"the direct launch raised {type(exc).__name__}: {exc}"
            if self.disabled is not None:
                _warn_once(self.disabled)
            elif fast is not None:
                self._fast[key] = fast
                self._keep.append(
                    compiled
                )  # its module must stay loaded while its function is used
            for out, want in zip(outputs, expected):
                out.copy_(want)  # the call returns Triton's result, whatever happened above

    def _learn(
        self, compiled: Any, grid: int, args: Sequence[Any], num_warps: int, device: int
    ) -> tuple[Any, Any, Any, int | None] | None:
        """Watch Triton launch ``compiled`` once more to learn how it calls the launcher."""
        if compiled is None or not hasattr(compiled, "run"):
            self.disabled = "Triton's launch returned no compiled kernel (the interpreter?)"
            return None
        run = compiled.run
        calls: list[tuple[tuple, dict]] = []

        def spy(*a: Any, **kw: Any) -> Any:
            calls.append((a, kw))
            return run(*a, **kw)

        # Triton 3.3+ reads the launcher through a property backed by ``_run``; earlier 3.x
        # set an instance attribute ``run``.
        slot = (
            "_run"
            if isinstance(inspect.getattr_static(type(compiled), "run", None), property)
            else "run"
        )
        setattr(compiled, slot, spy)
        try:
            self.jit(grid, args, num_warps, device)
        finally:
            setattr(compiled, slot, run)
        if len(calls) != 1:
            self.disabled = (
                f"Triton's launch called the compiled launcher {len(calls)} times, not once"
            )
            return None
        return self._layout(run, calls[0], grid, args, device)

    def _layout(
        self, run: Any, call: tuple[tuple, dict], grid: int, args: Sequence[Any], device: int
    ) -> tuple[Any, Any, Any, int | None] | None:
        a, kw = call
        tail = a[PREFIX:]
        if kw:
            self.disabled = f"Triton's launcher takes keyword arguments here ({sorted(kw)})"
        elif len(a) < PREFIX or tuple(a[:3]) != (grid, 1, 1):
            self.disabled = "Triton's launcher takes its arguments in an unknown order"
        elif a[3] != self._stream(device):
            self.disabled = "Triton launches on another stream than torch's current one"
        elif any(h is not None for h in a[6:PREFIX]):
            self.disabled = (
                "Triton launch hooks are set (a profiler?); they would not see direct launches"
            )
        elif _same_args(tail, args):
            return run, a[4], a[5], None  # Triton 3.3+: every argument, constexprs included
        elif _same_args(tail, args[: self.runtime_args]):
            return run, a[4], a[5], self.runtime_args  # before 3.3: the runtime arguments alone
        else:
            self.disabled = (
                f"Triton's launcher takes {len(tail)} kernel arguments, not {len(args)} "
                f"or {self.runtime_args}"
            )
        return None

    def _verify(
        self,
        fast: tuple[Any, Any, Any, int | None],
        grid: int,
        args: Sequence[Any],
        device: int,
        outputs: Sequence[torch.Tensor],
        expected: list[torch.Tensor],
    ) -> None:
        """Launch directly into the outputs, cleared to NaN, and compare with Triton's launch."""
        for out in outputs:
            out.fill_(float("nan"))
        run, function, packed, cut = fast
        run(
            grid,
            1,
            1,
            self._stream(device),
            function,
            packed,
            None,
            None,
            None,
            *(args if cut is None else args[:cut]),
        )
        for out, want in zip(outputs, expected):
            if not same_bytes(out, want):
                self.disabled = "a direct launch gave other bits than Triton's launcher"
                return

    def _bind(self) -> None:
        """Bind torch's CUDA getters here: CPU-only builds lack them."""
        if self._stream is None:
            self._stream = torch._C._cuda_getCurrentRawStream
        if self._current_device is None:  # torch.cuda.current_device less its lazy-init check:
            torch.cuda.init()  # a CUDA tensor exists, so CUDA is initialised
            self._current_device = torch._C._cuda_getDevice
        if self._exchange_device is None:  # torch.cuda.device's own switch
            self._exchange_device = getattr(torch._C, "_cuda_exchangeDevice", None)


_warned: list[str] = []  # the launcher's one warning in this process, once given


def _warn_once(reason: str) -> None:
    """The first launcher turned off in this process says so; the others (same cause) stay quiet."""
    if not _warned:
        _warned.append(reason)
        warnings.warn(
            f"enjoyln: the Triton kernel's cached launcher is off for this process ({reason}); "
            "Triton's own launcher runs instead, with more host time per call",
            RuntimeWarning,
            stacklevel=5,
        )


def _same_args(got: Sequence[Any], want: Sequence[Any]) -> bool:
    """The same objects (tensors, None) or equal plain values of the same type."""
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g is w:
            continue
        if (
            isinstance(g, torch.Tensor)
            or isinstance(w, torch.Tensor)
            or type(g) is not type(w)
            or g != w
        ):
            return False
    return True
