"""Timing helpers. Machines are noisy: A and B run alternately and compare by medians, a ratio, not
a time."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from . import ops
from .analysis.inputs import ExampleInputs, as_inputs
from .checking.running import flatten_outputs
from .store.load import load, load_plain
from .options import Access
from .errors import EnjoylnError
from .modules.norm import RMSNorm
from .store.checkpoint import open_checkpoint
from .store.quiet import quiet
from .testing import max_relative_diff, perturb
from .timings import Spread
from .transform.steps import fold


@dataclass
class LatencyComparison:
    """Medians of alternating runs (``speedup`` > 0: B is faster), every run kept for their
    spread."""

    a_ms: float
    b_ms: float
    repeats: int
    tokens: int = 0
    a_iqr_ms: float = 0.0
    b_iqr_ms: float = 0.0
    a_runs_ms: list[float] = field(default_factory=list)
    b_runs_ms: list[float] = field(default_factory=list)

    @classmethod
    def of(
        cls, a_runs_ms: list[float], b_runs_ms: list[float], tokens: int = 0
    ) -> "LatencyComparison":
        a, b = Spread.of(a_runs_ms), Spread.of(b_runs_ms)
        return cls(
            a.median,
            b.median,
            len(a_runs_ms),
            tokens,
            a.iqr,
            b.iqr,
            list(a_runs_ms),
            list(b_runs_ms),
        )

    @property
    def ratio(self) -> float:
        return self.b_ms / self.a_ms

    @property
    def speedup(self) -> float:
        return 1.0 - self.ratio

    @property
    def pair_ratios(self) -> Spread | None:
        """B over A, run by run (each pair ran back to back, so drift cancels); None without
        runs."""
        pairs = [b / a for a, b in zip(self.a_runs_ms, self.b_runs_ms) if a > 0]
        return Spread.of(pairs) if pairs else None

    def direction(self) -> str:
        """``faster``, ``slower`` or ``same``: ``b`` against ``a``, claimed only where the middle
        half of the run-by-run ratios lies on one side of 1 (``same`` without runs to judge
        by)."""
        r = self.pair_ratios
        if r is None or r.q1 <= 1.0 <= r.q3:
            return "same"
        return "faster" if r.q3 < 1.0 else "slower"

    def difference(self, a: str = "original", b: str = "folded") -> str:
        """One direction in words, with how much and the evidence; the medians of each model are not
        compared (they can point the other way when the machine drifts), only the pairs that ran
        back to back.

        >>> LatencyComparison.of([10.0, 10.1, 9.9], [10.0, 9.9, 10.1]).difference().split(" (")[0]
        'no measurable difference between folded and original'
        >>> LatencyComparison.of([10.0, 10.1, 9.9, 10.0], [9.0, 9.1, 8.9, 9.0]).difference()
        'folded 10.0% faster than original, measurably (the middle half of 4 run-by-run ratios, 0.899-0.901, lies below 1)'
        """  # noqa: E501
        r = self.pair_ratios
        if r is None:
            return f"{b} against {a}: not measured (no runs)"
        evidence = f"the middle half of {r.runs} run-by-run ratios, {r.q1:.3f}-{r.q3:.3f}"
        way = self.direction()
        if way == "same":
            return f"no measurable difference between {b} and {a} ({evidence}, spans 1)"
        return (
            f"{b} {abs(1 - r.median):.1%} {way} than {a}, measurably ({evidence}, lies "
            f"{'below' if way == 'faster' else 'above'} 1)"
        )

    def warnings(self, a: str = "original", b: str = "folded") -> list[str]:
        return (
            Spread.of(self.a_runs_ms).warnings(a) + Spread.of(self.b_runs_ms).warnings(b)
            if self.a_runs_ms
            else []
        )

    def tokens_per_s(self, which: str = "b") -> float:
        ms = self.b_ms if which == "b" else self.a_ms
        return self.tokens / (ms / 1e3) if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        r = self.pair_ratios
        return {
            **asdict(self),
            "ratio": self.ratio,
            "speedup": self.speedup,
            "pair_ratio_median": r.median if r else None,
            "pair_ratio_q1": r.q1 if r else None,
            "pair_ratio_q3": r.q3 if r else None,
            "direction": self.direction(),
            "difference": self.difference(),
            "warnings": self.warnings(),
            "a_tokens_per_s": self.tokens_per_s("a"),
            "b_tokens_per_s": self.tokens_per_s("b"),
        }


def synchronizer(*models: Any) -> Any:
    """``torch.cuda.synchronize`` where a model is on CUDA (a call returns before its kernels
    finish)."""
    for model in models:
        params = getattr(model, "parameters", None)
        tensors = itertools.chain(params(), model.buffers()) if callable(params) else ()
        if any(t.is_cuda for t in tensors):
            return torch.cuda.synchronize
    return lambda: None


WARMUP = 3  # pairs of forwards before ``compare_latency`` times any
MAX_REPEATS = 2000  # pairs ``compare_latency`` times at most, whatever ``seconds`` asks
SHARE_RUNS = 3  # forwards the profiler watches in ``layer_norm_share``
NORM_RUNS = 6  # forwards of each model (and the copy floor) in ``norm_time_ms``


def forward_seconds(model: nn.Module, example_inputs: ExampleInputs) -> float:
    """The wall time of one forward of ``model``: the first, so one-time costs make it an upper
    estimate."""
    inputs = as_inputs(example_inputs)
    sync = synchronizer(model)
    with torch.inference_mode():
        start = time.perf_counter()
        inputs.call(model)
        sync()
    return time.perf_counter() - start


def latency_seconds(forward_s: float, repeats: int, seconds: float | None = None) -> float:
    """Roughly how long ``compare_latency`` runs when a forward of either model takes ``forward_s``.

    >>> latency_seconds(0.5, repeats=20), latency_seconds(0.01, repeats=20, seconds=5)
    (23.0, 5.06)
    """
    timed = 2 * forward_s * repeats
    if seconds:
        timed = max(timed, min(seconds, 2 * forward_s * MAX_REPEATS))
    return round(2 * forward_s * WARMUP + timed, 6)


def end_to_end_seconds(forward_s: float, repeats: int, seconds: float | None = None) -> float:
    """Roughly how long ``end_to_end`` runs: ``compare_latency``, the profiler's forwards, and those
    timed inside the norms (a warm-up and ``NORM_RUNS`` for the original, the folded model and
    its copy floor).

    >>> end_to_end_seconds(1.0, repeats=20)  # 6 + 40 timed, 4 profiled, 21 inside the norms
    71.0
    """
    return latency_seconds(forward_s, repeats, seconds) + forward_s * (
        (1 + SHARE_RUNS) + 3 * (1 + NORM_RUNS)
    )


def compare_latency(
    a: nn.Module,
    b: nn.Module,
    example_inputs: ExampleInputs,
    *,
    repeats: int = 20,
    warmup: int = WARMUP,
    seconds: float | None = None,
    max_repeats: int = MAX_REPEATS,
) -> LatencyComparison:
    """Forward latency of ``a`` and ``b``, alternating; with ``seconds``, more pairs until that much
    time passed.

    >>> net = torch.nn.Linear(8, 8)
    >>> compare_latency(net, net, torch.randn(4, 8), repeats=3).repeats
    3
    """
    inputs = as_inputs(example_inputs)
    sync = synchronizer(a, b)
    times: dict[str, list[float]] = {"a": [], "b": []}
    with torch.inference_mode():
        for _ in range(warmup):
            inputs.call(a)
            inputs.call(b)
        sync()
        start_all, i = time.perf_counter(), 0
        while i < repeats or (
            seconds is not None and time.perf_counter() - start_all < seconds and i < max_repeats
        ):
            order = (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))
            for key, model in order:
                start = time.perf_counter()
                inputs.call(model)
                sync()
                times[key].append((time.perf_counter() - start) * 1e3)
            i += 1
    ids = inputs.kwargs.get("input_ids")
    tokens = int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
    return LatencyComparison.of(times["a"], times["b"], tokens)


@dataclass
class KernelResult:
    rows: int
    cols: int
    dtype: str
    device: str
    threads: int
    backend: str
    layer_norm_us: float
    rms_norm_us: float
    torch_rms_norm_us: float
    copy_us: float
    bytes_moved: int
    warnings: list[str] = field(default_factory=list)  # from ``timings.Spread.warnings``

    @property
    def ratio(self) -> float:
        return self.rms_norm_us / self.layer_norm_us

    @property
    def torch_ratio(self) -> float:
        return self.torch_rms_norm_us / self.layer_norm_us

    def gbps(self, us: float) -> float:
        return self.bytes_moved / (us * 1e-6) / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ratio": self.ratio,
            "torch_ratio": self.torch_ratio,
            "layer_norm_gbps": self.gbps(self.layer_norm_us),
            "rms_norm_gbps": self.gbps(self.rms_norm_us),
        }


def _median_time(fn: Any, repeats: int, sync: Any, batch: int = 1) -> list[float]:
    """µs per call, each run's; ``batch`` calls per sample waited for once: on CUDA the steady cost
    of a call in a stream of them (what a model sees), not the latency of one call waited for
    alone."""
    for _ in range(max(3, repeats // 10)):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        times.append((time.perf_counter() - start) / batch * 1e6)
    return times


def kernel_benchmark(
    shapes: list[tuple[int, int]],
    dtypes: list[torch.dtype],
    *,
    device: str = "cpu",
    repeats: int = 200,
    seed: int = 0,
) -> list[KernelResult]:
    """Time LN, enjoyln RMSNorm, ``F.rms_norm`` + bias and a ``clone`` (the floor), interleaved, per
    shape and dtype."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    gpu = torch.device(device).type == "cuda"  # cuda:1 too
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    results = []
    with torch.inference_mode():
        for rows, cols in shapes:
            for dtype in dtypes:
                x = torch.randn(rows, cols, generator=gen).to(device, dtype)
                w = (torch.rand(cols, generator=gen) + 0.5).to(device, dtype)
                b = torch.randn(cols, generator=gen).to(device, dtype)
                calls = {
                    "ln": lambda: F.layer_norm(x, (cols,), w, b, 1e-5),
                    "rms": lambda: ops.rms_norm(x, (cols,), w, b, 1e-5),
                    "torch": lambda: F.rms_norm(x, (cols,), w, 1e-5) + b,
                    "copy": lambda: x.clone(),
                }
                # interleave rounds so drift hits every candidate alike
                rounds: dict[str, list[float]] = {k: [] for k in calls}
                runs: dict[str, list[float]] = {k: [] for k in calls}
                for _ in range(5):
                    for key, fn in calls.items():
                        times = _median_time(fn, max(1, repeats // 5), sync, batch=20 if gpu else 1)
                        rounds[key].append(statistics.median(times))
                        runs[key] += times
                t = {k: statistics.median(v) for k, v in rounds.items()}
                name = f"{rows}x{cols} {str(dtype).replace('torch.', '')}"
                noise = Spread.of(runs["ln"]).warnings(f"{name} LayerNorm", "µs") + Spread.of(
                    runs["rms"]
                ).warnings(f"{name} RMSNorm", "µs")
                size = x.element_size()
                results.append(
                    KernelResult(
                        rows,
                        cols,
                        str(dtype).replace("torch.", ""),
                        device,
                        torch.get_num_threads(),
                        ops.backend(x, w, b),
                        t["ln"],
                        t["rms"],
                        t["torch"],
                        t["copy"],
                        rows * cols * 2 * size + cols * 2 * size,
                        noise,
                    )
                )
    return results


@dataclass
class EndToEndResult:
    latency: LatencyComparison
    layer_norm_share: float
    batch: int
    seq_len: int
    threads: int
    norm_ms: tuple[float, float, float] = (
        0.0,
        0.0,
        0.0,
    )  # ``norm_time_ms``; zeros on CUDA, not measured

    @property
    def share_captured(self) -> float:
        return self.latency.speedup / self.layer_norm_share if self.layer_norm_share else 0.0

    @property
    def best_possible_speedup(self) -> float:
        """The whole-forward speedup if each folded norm cost only a copy of its input."""
        ln, _, copy = self.norm_ms
        return (ln - copy) / self.latency.a_ms if self.latency.a_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "latency": self.latency.to_dict(),
            "layer_norm_share": self.layer_norm_share,
            "norm_ms": dict(zip(("layer_norm", "folded", "copy_floor"), self.norm_ms)),
            "best_possible_speedup": self.best_possible_speedup,
            "share_captured": self.share_captured,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "threads": self.threads,
        }


@contextlib.contextmanager
def quiet_fds() -> Any:
    """Silence the profiler's C++ start/stop lines, which bypass Python's streams."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, devnull = [os.dup(1), os.dup(2)], os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
        yield
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
        for fd in (*saved, devnull):
            os.close(fd)


def layer_norm_share(
    model: nn.Module, example_inputs: ExampleInputs, *, runs: int = SHARE_RUNS
) -> float:
    """Fraction of the model's self time (on CUDA, device time) in LayerNorm, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    inputs = as_inputs(example_inputs)
    sync = synchronizer(model)
    cuda = sync is torch.cuda.synchronize
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with torch.inference_mode():
        inputs.call(model)
        sync()
        with quiet_fds(), profile(activities=[activity]) as prof:
            for _ in range(runs):
                inputs.call(model)
            sync()
    events = prof.key_averages()
    own = (
        (lambda e: getattr(e, "self_device_time_total", 0))
        if cuda
        else (lambda e: e.self_cpu_time_total)
    )
    total = sum(own(e) for e in events)
    ln = sum(own(e) for e in events if "layer_norm" in e.key)
    return ln / total if total else 0.0


def norm_time_ms(
    a: nn.Module, b: nn.Module, example_inputs: ExampleInputs, *, runs: int = NORM_RUNS
) -> tuple[float, float, float]:
    """Median wall time per forward inside the norm modules of ``a``, of ``b``, and of ``b`` with
    each RMSNorm only copying its input (the floor). Timed inside the running model, where caches
    hold what the layers around each norm left: far less noisy than whole forwards when norms are
    a small share."""
    inputs = as_inputs(example_inputs)

    def timed(model: nn.Module) -> float:
        spent, handles, totals = [0.0], [], []
        for module in model.modules():
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                handles.append(
                    module.register_forward_pre_hook(
                        lambda m, i: m.__dict__.__setitem__("_t0", time.perf_counter())
                    )
                )
                handles.append(
                    module.register_forward_hook(
                        lambda m, i, o: spent.__setitem__(
                            0, spent[0] + time.perf_counter() - m.__dict__.pop("_t0")
                        )
                    )
                )
        try:
            with torch.inference_mode():
                inputs.call(model)
                for _ in range(runs):
                    spent[0] = 0.0
                    inputs.call(model)
                    totals.append(spent[0] * 1e3)
        finally:
            for h in handles:
                h.remove()
        return statistics.median(totals)

    ln_ms, rms_ms = timed(a), timed(b)
    swapped = [m for m in b.modules() if isinstance(m, RMSNorm)]
    for m in swapped:  # later layers see unnormalised values: same shapes, same cost
        m.forward = torch.Tensor.clone
    try:
        copy_ms = timed(b)
    finally:
        for m in swapped:
            del m.forward
    return ln_ms, rms_ms, copy_ms


def end_to_end(
    original: nn.Module,
    folded: nn.Module,
    example_inputs: ExampleInputs,
    *,
    repeats: int = 20,
    seconds: float | None = None,
) -> EndToEndResult:
    """``compare_latency`` of the two models, the original's LN share, and the time inside their
    norms."""
    inputs = as_inputs(example_inputs)
    latency = compare_latency(original, folded, inputs, repeats=repeats, seconds=seconds)
    share = layer_norm_share(original, inputs)
    ids = inputs.kwargs.get("input_ids")
    batch, seq = tuple(ids.shape) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else (0, 0)
    cuda = synchronizer(original) is torch.cuda.synchronize  # hooks cannot time queued kernels
    return EndToEndResult(
        latency,
        share,
        batch,
        seq,
        torch.get_num_threads(),
        (0.0, 0.0, 0.0) if cuda else norm_time_ms(original, folded, inputs),
    )


def plot_results(kernels: list[KernelResult], e2e: EndToEndResult | None, path: Any) -> None:
    """A bar chart of time ratios (RMSNorm / LayerNorm) at ``path``; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EnjoylnError("--plot needs matplotlib: pip install 'enjoyln[plot]'") from None
    bars = [
        (f"{r.rows}x{r.cols}\n{r.dtype}", r.ratio, r.torch_ratio, r.copy_us / r.layer_norm_us)
        for r in kernels
    ]
    if e2e is not None:
        bars.append(("end to end", e2e.latency.ratio, float("nan"), float("nan")))
    labels, ours, theirs, floor = (
        (list(column) for column in zip(*bars)) if bars else ([], [], [], [])
    )
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    xs = range(len(labels))
    ax.bar([x - 0.27 for x in xs], ours, 0.27, label="enjoyln RMSNorm")
    ax.bar(xs, theirs, 0.27, label="F.rms_norm + bias")
    ax.bar([x + 0.27 for x in xs], floor, 0.27, label="copy of the input (floor)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("time / native LayerNorm")
    ax.set_yscale("log")
    noise = [w for r in kernels for w in r.warnings] + (
        e2e.latency.warnings() if e2e is not None else []
    )
    if noise:  # a plot outlives the terminal that printed the warnings
        ax.set_title(
            f"{len(noise)} timing warning{'s' if len(noise) > 1 else ''}: the machine was noisy, "
            "see the report",
            color="red",
            fontsize=9,
        )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@quiet
def models_to_compare(
    model_dir: str | os.PathLike | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    access: Access = Access(),
) -> tuple[nn.Module, nn.Module]:
    """(original, folded) from a folded or an original directory, or a random GPT-2 small; folded,
    then cast.

    >>> original, folded = models_to_compare()  # doctest: +SKIP
    """
    if model_dir is None:
        import transformers

        original = perturb(transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval())
    elif (checkpoint := open_checkpoint(model_dir, **asdict(access))).config.get(
        "enjoyln"
    ):  # folded already
        return load_plain(checkpoint).to(device, dtype), load(checkpoint).to(device, dtype)
    else:
        original = load(checkpoint)
    folded = fold(copy.deepcopy(original))
    return original.to(device, dtype), folded.to(device, dtype)
