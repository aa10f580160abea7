"""Judging mutations: the gate run in process on a mutated copy (under a deadline, in worker
processes), its verdict against the one owed, the score per category."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from enjoyln.errors import first_line
from .applying import Mutation, apply
from .drawing import CATEGORIES
from .observing import differences, observe
from .sources import Source, quiet


@dataclass
class Result:
    """The gate's verdict on one mutation."""

    mutation: Mutation
    exit_code: int | None
    """0 pass, 1 fail, 2 refused as bad input; None if the gate did not finish in time."""
    message: str
    seconds: float
    effect: list[str] | None = None
    """What the mutation changes for a user (see :func:`differences`), when observed."""

    @property
    def correct(self) -> bool:
        if self.exit_code is None:
            return False
        return (self.exit_code != 0) == (self.mutation.expect == "fail")

    def describe(self) -> str:
        m = self.mutation
        said = {
            0: "exit 0 (pass)",
            1: "exit 1 (fail)",
            2: "exit 2 (refused)",
            None: "no verdict (timed out)",
        }
        lines = [
            f"{m.describe()}",
            f"    expected {'non-zero' if m.expect == 'fail' else 'exit 0'} "
            f"[{m.ground}]: {m.reason}",
            f"    the gate said {said.get(self.exit_code, self.exit_code)}"
            + (f": {self.message}" if self.message else ""),
        ]
        if self.effect is not None:
            lines.append(
                "    what a user gets: "
                + (
                    "; ".join(self.effect)
                    if self.effect
                    else "the same, bit for bit, from every loader observed"
                )
            )
        return "\n".join(lines)


class _Timeout(BaseException):
    """Not an Exception: the command line turns every Exception into exit 2, and a gate that
    never answers must not count as one that refused."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(*_: Any) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def gate(
    reference: str | os.PathLike,
    candidate: str | os.PathLike,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """``enjoyln check REFERENCE CANDIDATE [ARGS]``, the command line itself run in process: its
    exit code, and the first line of its output that says why (empty for a pass). ``env`` is set
    for this run alone: click's runner puts it into ``os.environ`` and restores every variable
    afterwards (the gate reads the environment as the command line would, so a planted cache
    must be named there, not passed in)."""
    tree = os.environ.get(GATE_TREE)
    if tree:
        return _gate_in(Path(tree), reference, candidate, args, env)
    import typer.testing
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    if not hasattr(typer.testing._get_command, "cache_info"):
        # the click command built once per worker, not on each of its hundreds of runs
        typer.testing._get_command = functools.cache(typer.testing._get_command)
    result = CliRunner().invoke(app, ["check", str(reference), str(candidate), *args], env=env)
    lines = [line.strip() for line in result.output.splitlines() if line.strip()]
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # only with ENJOYLN_DEBUG set does an exception get past the command line's handler
        exc = result.exception
        return 2, f"{type(exc).__name__} (unforeseen): {first_line(exc, '')}"
    if result.exit_code == 0:
        return 0, ""
    why = next(
        (
            line
            for line in lines
            if line.startswith("error:") or "[FAIL]" in line or "DIFFERENT" in line
        ),
        lines[0] if lines else "",
    )
    if "ENJOYLN_DEBUG" in why:
        why = why.replace("error: ", "", 1).replace(":", " (unforeseen):", 1)
    return result.exit_code, why


GATE_TREE = "ENJOYLN_MUTATION_GATE_TREE"
"""Set to a source tree (a checkout of another commit) to judge with that tree's gate instead."""


def _gate_in(
    tree: Path,
    reference: str | os.PathLike,
    candidate: str | os.PathLike,
    args: Sequence[str],
    env: dict[str, str] | None,
) -> tuple[int, str]:
    """The gate of another tree, in a process of its own run inside it (``python -m`` puts the
    working directory first on the path, ahead of an installed enjoyln)."""
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    full.pop(GATE_TREE, None)
    proc = subprocess.run(
        [sys.executable, "-m", "enjoyln", "check", str(reference), str(candidate), *args],
        env=full,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    if proc.returncode == 0:
        return 0, ""
    return proc.returncode, next(
        (
            line
            for line in lines
            if line.startswith("error:") or "[FAIL]" in line or "DIFFERENT" in line
        ),
        lines[0] if lines else "",
    )


_state: dict[str, Any] = {}


def _init_worker() -> None:
    torch.set_num_threads(1)  # two workers on two cores: more threads only contend
    quiet()
    _state["tmp"] = Path(tempfile.mkdtemp(prefix="enjoyln-mutation-"))


@dataclass(frozen=True)
class Observe:
    """Which mutants are also loaded to see what the mutation changes for a user
    (``Result.effect``): wrong verdicts, mutations owed a pass (the proof that they are
    inert), these mutation indices, or all."""

    wrong: bool = True
    inert: bool = False
    indices: frozenset[int] = frozenset()
    all: bool = False

    def __call__(self, result: Result) -> bool:
        m = result.mutation
        return (
            self.all
            or (self.wrong and not result.correct)
            or (self.inert and m.expect == "pass")
            or m.index in self.indices
        )


def judge(
    source: Source, mutation: Mutation, *, observe: Observe = Observe(), timeout: float = 120.0
) -> Result:
    """Apply ``mutation`` to a fresh copy of ``source``'s fold, run the gate on it, and observe
    the mutant if ``observe`` says so."""
    if "tmp" not in _state:
        _init_worker()
    work = _state["tmp"] / f"m{mutation.index}-{os.getpid()}"
    candidate = work / "candidate"
    try:
        shutil.copytree(source.candidate, candidate, symlinks=True)
        apply(mutation, candidate, work / "outside")
        start = time.perf_counter()
        try:
            env = {
                k: v.replace("{outside}", str(work / "outside")) for k, v in mutation.env
            } or None
            with _deadline(timeout):
                code, message = gate(source.reference, candidate, mutation.args, env)
        except _Timeout:
            code, message = None, f"no verdict within {timeout:.0f} s"
        result = Result(mutation, code, message, time.perf_counter() - start)
        if observe(result):
            result.effect = effect(source, candidate, timeout=timeout)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def effect(source: Source, candidate: str | os.PathLike, *, timeout: float = 120.0) -> list[str]:
    """What ``candidate`` computes differently from ``source``'s unmutated fold, for a user."""
    key = f"base:{source.name}"
    try:
        with _deadline(timeout):
            if key not in _state:
                _state[key] = observe(source.candidate, source)
            return differences(_state[key], observe(candidate, source))
    except _Timeout:
        return [f"a loader did not finish within {timeout:.0f} s"]


def _judge_task(task: tuple[Source, Mutation, Observe]) -> Result:
    return judge(task[0], task[1], observe=task[2])


def judge_all(
    sources: Sequence[Source],
    mutations: Sequence[Mutation],
    *,
    workers: int = 2,
    observe: Observe = Observe(),
    progress: Callable[[int, int], None] | None = None,
) -> list[Result]:
    """Judge every mutation (see :func:`judge`), in ``workers`` processes (0: in this one), in
    order."""
    by_name = {s.name: s for s in sources}
    tasks = [(by_name[m.source], m, observe) for m in mutations]
    if workers <= 0:
        results = []
        for i, t in enumerate(tasks):
            results.append(_judge_task(t))
            if progress:
                progress(i + 1, len(tasks))
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent has run torch's thread pools, which a forked child can inherit
    # locked
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
    ) as pool:
        results = []
        for i, r in enumerate(pool.map(_judge_task, tasks, chunksize=4)):
            results.append(r)
            if progress:
                progress(i + 1, len(tasks))
        return results


def score(results: Sequence[Result]) -> dict[str, dict[str, Any]]:
    """Per category (and ``"all"``): mutations, how many must fail and pass, how many the gate
    got wrong (false passes, false failures) and the score (the share it got right)."""
    rows: dict[str, dict[str, Any]] = {}
    for r in results:
        for key in (r.mutation.category, "all"):
            row = rows.setdefault(
                key,
                {
                    "n": 0,
                    "must_fail": 0,
                    "must_pass": 0,
                    "false_pass": 0,
                    "false_fail": 0,
                    "seconds": 0.0,
                },
            )
            row["n"] += 1
            row["must_fail" if r.mutation.expect == "fail" else "must_pass"] += 1
            if not r.correct:
                row["false_pass" if r.mutation.expect == "fail" else "false_fail"] += 1
            row["seconds"] += r.seconds
    for row in rows.values():
        row["score"] = 1 - (row["false_pass"] + row["false_fail"]) / row["n"]
    order = (
        [c for c in CATEGORIES if c in rows]
        + [c for c in rows if c not in CATEGORIES and c != "all"]
        + ["all"]
    )
    return {k: rows[k] for k in order}


def tree_digest(directory: str | os.PathLike) -> str:
    """A digest of every file's path and bytes under ``directory``: the gate must not change
    its inputs."""
    h = hashlib.sha256()
    root = Path(directory)
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()
