"""The files of a model directory besides the weights: which a loader may read, which links are
followed (only to files a model needs, as in the Hugging Face cache), and copying them into an
output."""

from __future__ import annotations

import fnmatch
import shutil
import stat
from pathlib import Path
from typing import Iterator, TYPE_CHECKING

from ..errors import CheckpointError
from .formats import input_file
from .locate import WEIGHT_FILES

if TYPE_CHECKING:
    from .checkpoint import Checkpoint


# The files a model directory needs: only these are followed through a symlink out of the directory.
NEEDED = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "*.bin.index.json",
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "*processor_config.json",
    "chat_template*",
    "feature_extractor_config.json",
)

VCS_DIRS = {".git", ".hg", ".svn"}


def is_weight_file(name: str) -> bool:
    return fnmatch.fnmatch(name, "*.safetensors") or any(
        fnmatch.fnmatch(name, p)
        for p in (
            "pytorch_model*.bin",
            "*.bin.index.json",
            "*.safetensors.index.json",
            "tf_model*.h5",
            "flax_model*.msgpack",
            "model*.ckpt*",
            "*.pt",
            "*.pth",
        )
    )


def needed_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in NEEDED)


class _Walk:
    """(source, path relative to MODEL_DIR, is a directory) for everything a fold copies
    (``copy_extras``); what is left out goes to ``skipped``. A link out to a file a loader may
    read raises, unless ``foreign`` (the gate's view of a reference the user handed over)
    collects it."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        skipped: list[str],
        followed: list[str] | None,
        foreign: list[str] | None = None,
    ) -> None:
        self.ck, self.skipped, self.followed, self.foreign = checkpoint, skipped, followed, foreign
        self.root = checkpoint.path.resolve()
        self.linked: set[Path] = set()  # directories already entered through a link
        # a Hugging Face cache snapshot (<repo>/snapshots/<rev>) links every file, whatever its
        # name, to <repo>/blobs
        blobs = self.root.parent.parent / "blobs" if self.root.parent.name == "snapshots" else None
        self.blobs = (
            blobs if blobs is not None and blobs.is_dir() and not blobs.is_symlink() else None
        )

    def __iter__(self) -> Iterator[tuple[Path, Path, bool]]:
        skip = WEIGHT_FILES | set(self.ck.shards) | {"config.json"}
        for item in sorted(self.ck.path.iterdir()):
            if item.name in skip or is_weight_file(item.name):
                continue  # weights in any other format would be stale, uncentered copies
            yield from self.visit(item, Path(item.name), True, (self.root,))

    def inside(self, p: Path) -> bool:
        return p == self.root or self.root in p.parents

    def cached(self, target: Path) -> bool:
        return self.blobs is not None and target.parent == self.blobs and target.is_file()

    def visit(
        self, src: Path, rel: Path, top: bool, chain: tuple[Path, ...]
    ) -> Iterator[tuple[Path, Path, bool]]:
        # chain: the real directories being copied. Links back into one would recurse until the path
        # is
        # too long; links entered twice could copy a tree exponentially many times.
        name, skipped = str(rel), self.skipped
        if src.is_symlink() and not self.follow(src, name, top, chain):
            return
        try:
            mode = src.stat().st_mode
        except OSError as exc:
            raise CheckpointError(f"cannot read {src}: {exc.strerror or exc}") from None
        if stat.S_ISDIR(mode):
            if src.name in VCS_DIRS or src.resolve().name in VCS_DIRS:  # also through a link to one
                skipped.append(f"{name} (version-control data)")
                return
            yield src, rel, True
            for child in sorted(src.iterdir()):
                yield from self.visit(child, rel / child.name, False, (*chain, src.resolve()))
        elif stat.S_ISREG(mode) and name.endswith(".py") and not self.ck.trust_remote_code:
            # custom_code() walked the real tree; one reached only through a link was never accepted
            skipped.append(f"{name} (code, reached through a link)")
        elif stat.S_ISREG(mode):
            yield src, rel, False
        else:
            skipped.append(f"{name} (not a regular file)")

    def follow(self, src: Path, name: str, top: bool, chain: tuple[Path, ...]) -> bool:
        try:
            target = src.resolve(strict=True)
        except (OSError, RuntimeError):
            if top and needed_file(src.name):
                input_file(src)  # raises, naming the link
            self.skipped.append(f"{name} (a dangling symlink)")
            return False
        if target.is_dir() and (
            target in chain
            or target in src.parent.resolve().parents
            or target == src.parent.resolve()
        ):
            self.skipped.append(f"{name} (a symlink to a directory that contains it)")
            return False
        if target.is_dir() and target in self.linked:
            self.skipped.append(f"{name} (a second symlink to a directory already copied)")
            return False
        if not self.inside(target) and (
            (top and needed_file(src.name) and target.is_file()) or self.cached(target)
        ):
            if self.followed is not None:
                self.followed.append(f"{name} -> {target}")
        elif not self.inside(target) and _readable(src, target, self.ck.trust_remote_code):
            if self.foreign is None:
                raise CheckpointError(
                    f"{self.ck.path / name} links to {target}, outside MODEL_DIR: a loader may "
                    "read it, but a fold "
                    "copies nothing from outside MODEL_DIR; replace the link with a copy of what "
                    "it points "
                    "to (or remove it) and run again"
                )
            self.foreign.append(f"{name} -> {target}")
        # else inside, or outside but read by no loader: skipped below like its kind anywhere
        if target.is_dir():
            self.linked.add(target)
        return True


def _readable(link: Path, target: Path, trusted: bool) -> bool:
    """Whether a loader may read what a link resolves to (not special files, VCS data, or untrusted
    code)."""
    if target.is_dir():
        return link.name not in VCS_DIRS and target.name not in VCS_DIRS
    return target.is_file() and (trusted or not link.name.endswith(".py"))


def check_links(checkpoint: Checkpoint) -> None:
    """Refuse a model directory whose links leave it for what a loader may read: a fold would drop
    it."""
    for _ in _Walk(checkpoint, [], None):
        pass


def copy_extras(checkpoint: Checkpoint, dest: Path, followed: list[str] | None = None) -> list[str]:
    """Copy every file of ``md`` but the weights and config into ``dest``; return what was skipped.
    A link out is followed only to a file a model directory needs (top level) or a blob of the
    Hugging Face cache, collected in ``followed``; any other is refused. Modes follow the
    umask."""
    skipped: list[str] = []
    for src, rel, is_dir in _Walk(checkpoint, skipped, followed):
        if is_dir:
            (dest / rel).mkdir(exist_ok=True)
            continue
        try:
            shutil.copyfile(src, dest / rel)
        except OSError as exc:
            if exc.filename and Path(exc.filename) == dest / rel:
                raise
            raise CheckpointError(f"cannot read {src}: {exc.strerror or exc}") from None
    return skipped


def extra_files(checkpoint: Checkpoint) -> dict[str, Path]:
    """Relative path -> source of the files ``copy_extras`` would copy, and those reached through
    links out of ``md``: with config.json and the weights, what a copy that loads the same
    holds."""
    return {
        rel.as_posix(): src for src, rel, is_dir in _Walk(checkpoint, [], None, []) if not is_dir
    }


def loader_files(root: Path) -> tuple[dict[str, Path], list[str]]:
    """Every file under ``root`` as a loader sees it (relative path -> path), through links, and
    what no loader could read there. Version-control data is left out: no loader reads it."""
    files: dict[str, Path] = {}
    problems: list[str] = []
    entered: set[Path] = set()
    stack: list[tuple[Path, str, tuple[Path, ...]]] = [(root, "", ())]
    while stack:
        folder, prefix, chain = stack.pop()
        real = folder.resolve()
        if real in chain:
            problems.append(f"{prefix.rstrip('/')} is a symlink to a directory that contains it")
            continue
        if real in entered:
            problems.append(f"{prefix.rstrip('/')} is a second way into a directory already listed")
            continue
        entered.add(real)
        try:
            children = sorted(folder.iterdir())
        except OSError as exc:
            raise CheckpointError(f"cannot read {folder}: {exc.strerror or exc}") from None
        for child in children:
            rel = prefix + child.name
            try:
                mode = child.stat().st_mode  # through links
            except (OSError, RuntimeError):
                problems.append(f"{rel} is a dangling symlink or a symlink loop")
                continue
            if stat.S_ISDIR(mode):
                if child.name in VCS_DIRS or child.resolve().name in VCS_DIRS:
                    continue
                stack.append((child, rel + "/", (*chain, real)))
            elif stat.S_ISREG(mode):
                files[rel] = child
            else:
                problems.append(f"{rel} is not a regular file")
    return files, problems
