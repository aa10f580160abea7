"""Timing helpers: side-by-side latency of two models, measured in one run.

Machines are noisy, so A and B are run alternately and compared by their
medians; a ratio from one run is meaningful, an absolute time is not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .capture import ExampleInputs, as_inputs


@dataclass
class LatencyComparison:
    """Medians of alternating runs; ``speedup`` > 0 means B is faster."""

    a_ms: float
    b_ms: float
    repeats: int
    tokens: int = 0

    @property
    def ratio(self) -> float:
        return self.b_ms / self.a_ms

    @property
    def speedup(self) -> float:
        return 1.0 - self.ratio

    def tokens_per_s(self, which: str = "b") -> float:
        ms = self.b_ms if which == "b" else self.a_ms
        return self.tokens / (ms / 1e3) if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "speedup": self.speedup,
                "a_tokens_per_s": self.tokens_per_s("a"), "b_tokens_per_s": self.tokens_per_s("b")}


def compare_latency(a: nn.Module, b: nn.Module, example_inputs: ExampleInputs, *,
                    repeats: int = 20, warmup: int = 3) -> LatencyComparison:
    """Forward latency of ``a`` and ``b`` on the same inputs, alternating A, B, A, B.

    >>> import torch
    >>> net = torch.nn.Linear(8, 8)
    >>> compare_latency(net, net, torch.randn(4, 8), repeats=3).repeats
    3
    """
    inputs = as_inputs(example_inputs)
    times: dict[str, list[float]] = {"a": [], "b": []}
    with torch.inference_mode():
        for _ in range(warmup):
            inputs.call(a)
            inputs.call(b)
        for i in range(repeats):
            order = (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))
            for key, model in order:
                start = time.perf_counter()
                inputs.call(model)
                times[key].append(time.perf_counter() - start)
    ids = inputs.kwargs.get("input_ids")
    tokens = int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
    return LatencyComparison(statistics.median(times["a"]) * 1e3, statistics.median(times["b"]) * 1e3,
                             repeats, tokens)
