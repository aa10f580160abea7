"""Progress on stderr, on a terminal only: a spinner naming the phase, and byte bars. Totals never
jump (an unknown one shows a count, no bar); rates show only once a second has passed (a burst
gives none)."""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

MIN_RATE_SECONDS = 1.0


def honest_rate(moved: float, seconds: float) -> float | None:
    """Bytes per second, or None where the interval is too short to mean anything.

    >>> honest_rate(480e9, 0.001) is None, honest_rate(100e6, 2.0)
    (True, 50000000.0)
    """
    return None if seconds < MIN_RATE_SECONDS or moved <= 0 else moved / seconds


class _Bytes(ProgressColumn):
    """'12.3 MB of 45.6 MB', or '12.3 MB' while the total is not known; nothing for a phase."""

    def render(self, task: Task) -> Text:
        if task.fields.get("phase"):
            return Text("")
        done = f"{task.completed / 1e6:.1f} MB"
        return Text(
            done if not task.total else f"{done} of {task.total / 1e6:.1f} MB",
            style="progress.download",
        )


class _Rate(ProgressColumn):
    """The bytes moved from the bar's first move to its latest, over the time between."""

    def render(self, task: Task) -> Text:
        first, last = task.fields.get("moved_at"), task.fields.get("last")
        if task.fields.get("phase") or first is None or last is None:
            return Text("")
        rate = honest_rate(last[0] - first[0], last[1] - first[1])
        return Text(
            f"{rate / 1e6:.0f} MB/s" if rate is not None else "", style="progress.data.speed"
        )


class _Bar(BarColumn):
    def render(self, task: Task) -> Any:
        if task.fields.get("phase") or not task.total:
            return Text("")
        return super().render(task)


class Display:
    """``stage(words)`` names the phase, ``phase(name)`` gives a byte bar's callback; off a
    terminal, nothing."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled and console.is_terminal
        self.bar: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.phase_task: Any = None

    def _progress(self) -> Progress:
        if self.bar is None:
            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("[progress.description]{task.description}"),
                _Bar(),
                _Bytes(),
                _Rate(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self.bar.start()
        return self.bar

    def stage(self, words: str) -> None:
        if not self.enabled:
            return
        bar = self._progress()
        if self.phase_task is not None:  # a new phase: its own elapsed time
            bar.remove_task(self.phase_task)
        self.phase_task = bar.add_task(words, total=None, phase=True)

    def phase(self, name: str) -> Callable[[int, int], None]:
        """The callback of the byte bar ``name``: (bytes done, bytes total or 0)."""

        def update(done: int, total: int) -> None:
            if not self.enabled:
                return
            bar = self._progress()
            if name not in self.tasks:
                self.tasks[name] = bar.add_task(name, total=None, moved_at=None)
            task_id, now = self.tasks[name], time.monotonic()
            task = next(t for t in bar.tasks if t.id == task_id)
            if task.fields.get("moved_at") is None and done > 0:  # the rate counts from here
                bar.update(task_id, moved_at=(done, now))
            # a finished bar is taken away: the phase after it has its own line
            bar.update(
                task_id,
                completed=done,
                total=total or None,
                last=(done, now),
                visible=not (total and done >= total),
            )

        return update

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar, self.tasks, self.phase_task = None, {}, None

    def __enter__(self) -> "Display":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
