"""The output transaction: a temporary directory beside OUT_DIR, named after the process that
owns it, renamed into place only when complete and checked; a later run for the same OUT_DIR
removes what a killed run left behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from ..errors import CheckpointError
from .locate import small_json


def umask() -> int:
    """The process umask, read without changing it where the system allows (threads run)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_out_dir(src: Path, out: Path, force: bool, *, dry_run: bool = False) -> None:
    src, out = src.resolve(), out.resolve()
    if out == src or src in out.parents:
        raise CheckpointError(
            f"OUT_DIR {out} is inside MODEL_DIR {src}; choose a directory elsewhere"
        )
    if out in src.parents:
        raise CheckpointError(
            f"OUT_DIR {out} contains MODEL_DIR {src}; choose a directory elsewhere"
        )
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError(f"OUT_DIR {out} exists and is not a directory")
    if dry_run or not any(out.iterdir()):
        return
    if not force:
        raise CheckpointError(
            f"OUT_DIR {out} is not empty; pass --force to replace an earlier enjoyln output"
        )
    config = small_json(out / "config.json")
    if not (isinstance(config, dict) and isinstance(config.get("enjoyln"), dict)):
        why = (
            "its config.json has no enjoyln block"
            if (out / "config.json").is_file()
            else "it has no config.json"
        )
        raise CheckpointError(
            f"OUT_DIR {out} is not empty and is not an enjoyln output ({why}); --force "
            "replaces only those, so remove it yourself"
        )


OWNER_FILE = ".enjoyln-owner"


def _start_time(pid: int) -> str:
    """The kernel's start time of ``pid`` (to tell a reused pid apart), or ''."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not started or not _start_time(pid) or _start_time(pid) == started


def _owner(tmp: Path, pid: int) -> tuple[int, str]:
    try:
        with open(tmp / OWNER_FILE, "rb") as f:  # a few bytes, whatever the file holds
            recorded, _, started = f.read(64).decode().partition(" ")
        return int(recorded), started.strip()
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return pid, ""  # killed before it wrote the record, or the old output a publish moved aside


def _ours(out: Path, name: str) -> int | None:
    """The pid in ``name`` if enjoyln names OUT_DIR's temporary directories so (mkdtemp's,
    ``-PID-old``):
    a user's ``.OUT.enjoyln-backup-2024`` is not ours to remove."""
    match = re.fullmatch(re.escape(f".{out.name}.enjoyln-") + r"(\d+)-(?:old|[a-z0-9_]{8})", name)
    return int(match.group(1)) if match else None


def stale_temp_dirs(out: Path) -> tuple[list[Path], list[tuple[Path, int]]]:
    dead, live = [], []
    parent = out.parent if out.parent.is_dir() else None
    for tmp in sorted(parent.iterdir()) if parent else []:
        pid = _ours(out, tmp.name)
        if pid is None or not tmp.is_dir() or tmp.is_symlink():
            continue
        owner = _owner(tmp, pid)
        if owner[0] != os.getpid() and _alive(*owner):
            live.append((tmp, owner[0]))
        elif owner[0] != os.getpid():
            dead.append(tmp)
    return dead, live


def clean_stale(out: Path) -> list[Path]:
    """Remove what killed runs left for ``out``; refuse while another live run writes it."""
    dead, live = stale_temp_dirs(out)
    if live:
        tmp, pid = live[0]
        raise CheckpointError(
            f"another enjoyln (pid {pid}) is writing {out} (its work is in {tmp}); "
            "wait for it, or stop it"
        )
    for tmp in dead:
        shutil.rmtree(tmp, ignore_errors=True)
    return dead


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, outermost first."""
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return missing[::-1]


def remove_dirs(dirs: list[Path]) -> None:
    """Remove directories a run created, innermost first, if still empty."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:  # not empty (a kept candidate, someone else's file), or never made
            return


def temp_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.enjoyln-{os.getpid()}-", dir=out.parent))
    (tmp / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    return tmp


def publish(tmp: Path, out: Path) -> None:
    (tmp / OWNER_FILE).unlink(missing_ok=True)
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700, whatever the umask
    if not out.exists():
        os.replace(tmp, out)
        return
    trash = out.with_name(f".{out.name}.enjoyln-{os.getpid()}-old")
    with signals_held():  # never stop between the two renames, leaving no OUT_DIR at all
        os.replace(out, trash)
        os.replace(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Delay SIGINT and SIGTERM until the block is done, so a step and its cleanup's bookkeeping go
    together.

    The handlers are swapped, not the signal mask: Python runs a handler in the main thread
    whichever thread the signal reached, and torch's worker threads do not block it (a masked main
    thread still ran SIGTERM's handler between creating the temporary directory and recording
    it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved = {s: h for s, h in saved.items() if h is not None}  # None: not installed from Python
    for s in saved:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        for s in pending:
            if callable(saved[s]):
                saved[s](s, None)
            elif saved[s] == signal.SIG_DFL:
                signal.raise_signal(s)


def keep_failed(tmp: Path, out: Path) -> Path:
    (tmp / OWNER_FILE).unlink(missing_ok=True)
    os.chmod(tmp, 0o777 & ~umask())
    kept, n = out.with_name(f"{out.name}.enjoyln-failed"), 1
    while kept.exists():
        n += 1
        kept = out.with_name(f"{out.name}.enjoyln-failed-{n}")
    os.replace(tmp, kept)
    return kept
