"""Repeated timings and the warnings their spread gives; plain Python, so tests judge made-up
timings."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

__all__ = ["Spread", "NOISY"]


@dataclass
class Spread:
    """Repeated timings of one thing (ms or µs, as given)."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    runs: int
    groups: list[float] = field(
        default_factory=list
    )  # centres of the groups the runs fall into (time-slicing)

    @classmethod
    def of(cls, samples: list[float]) -> "Spread":
        """
        >>> Spread.of([1.0, 2.0, 3.0, 4.0]).median
        2.5
        """
        xs = sorted(samples)
        q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
        return cls(statistics.median(xs), q[0], q[2], xs[0], xs[-1], len(xs), _groups(xs))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def warnings(self, label: str, unit: str = "ms") -> list[str]:
        """Why not to trust these timings: at the clock's resolution, in groups a scheduler step
        apart, or spread.

        >>> Spread.of([10.0, 10.1, 9.9, 10.0, 10.05, 9.95]).warnings("original")
        []
        """
        found = []
        tick = time.get_clock_info("perf_counter").resolution * (1e3 if unit == "ms" else 1e6)
        if self.median < 100 * tick:
            found.append(
                f"{label}: {self.median:.3g} {unit} is within 100x the clock's resolution "
                f"({tick:.3g} "
                f"{unit}); these timings mean little"
            )
        if len(self.groups) >= 2:
            step = statistics.median(b - a for a, b in zip(self.groups, self.groups[1:]))
            found.append(
                f"{label}: the {self.runs} runs fall into {len(self.groups)} groups about "
                f"{step:.3g} {unit} "
                "apart: the scheduler is slicing the time (more threads than free cores?), so the "
                "timings sit at its resolution"
            )
        elif self.median > 0 and self.iqr / self.median > NOISY:
            found.append(
                f"{label}: the runs spread by {self.iqr / self.median:.0%} of their median (IQR "
                f"{self.q1:.3g}-{self.q3:.3g} {unit}); the machine looks busy"
            )
        return found


NOISY = 0.10  # an interquartile range above this fraction of the median: the machine was busy


def _groups(xs: list[float]) -> list[float]:
    """Centres of the clusters sorted timings fall into, split at gaps far wider than their spacing
    and 15% of the median; [] for one cluster, clusters of one run (outliers) or as wide as their
    gaps (noise)."""
    if len(xs) < 8:
        return []
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    cut = max(0.15 * statistics.median(xs), 10 * statistics.median(gaps))
    clusters, between, current = [], [], [xs[0]]
    for gap, x in zip(gaps, xs[1:]):
        if gap > cut:
            clusters.append(current)
            between.append(gap)
            current = []
        current.append(x)
    clusters.append(current)
    real = [c for c in clusters if len(c) >= 2]
    if len(real) < 2 or max(c[-1] - c[0] for c in real) > 0.5 * min(between):
        return []
    return [statistics.median(c) for c in real]
