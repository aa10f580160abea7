"""Where a model directory is (a local path, or a Hugging Face hub id through huggingface_hub's
cache), and the checks a path can get without torch. No torch or transformers here: the command
line calls these first, so a mistyped path is refused in a fraction of a second; what is found is
validated in full later.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

__all__ = [
    "resolve_model_dir",
    "model_directory",
    "precheck_model_dir",
    "precheck_weights",
    "is_hub_id",
    "resave_command",
    "pickle_refusal",
    "small_json",
    "SKIPPED_ON_DOWNLOAD",
    "SAFE_WEIGHTS",
    "SAFE_INDEX",
    "PT_WEIGHTS",
    "PT_INDEX",
    "WEIGHT_FILES",
]

_HUB_ID = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}$")

SKIPPED_ON_DOWNLOAD = (
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.tflite",
    "*.onnx",
    "*.onnx_data",
    "onnx/*",
    "*.gguf",
    "*.mlmodel",
    "coreml/*",
    "openvino/*",
    "*.ckpt",
)
"""Files of a hub repository no fold reads (other frameworks' weights): not downloaded."""

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")
"""Pickle weights: downloaded only when the user allows reading them."""


def is_hub_id(text: str) -> bool:
    """Whether ``text`` can name a hub repository (``NAME`` or ``ORG/NAME``), by huggingface_hub's
    rules.

    >>> is_hub_id("gpt2"), is_hub_id("openai-community/gpt2"), is_hub_id("./gpt2"), is_hub_id("a/b/c")
    (True, True, False, False)
    """  # noqa: E501
    if not _HUB_ID.match(text) or "--" in text or ".." in text or text.endswith(".git"):
        return False
    return not any(
        part.startswith((".", "-")) or part.endswith((".", "-")) for part in text.split("/")
    )


def model_directory(root: Path) -> Path:
    """``root`` if it is an existing, non-empty directory; else one line saying what it is."""
    if not root.exists():
        raise CheckpointError(f"{root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    if not any(root.iterdir()):
        raise CheckpointError(f"{root} is empty")
    return root


SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
PT_WEIGHTS, PT_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = {SAFE_WEIGHTS, SAFE_INDEX, PT_WEIGHTS, PT_INDEX}
"""The weight files a loader looks for in a model directory (here, so that they are checked before
torch loads)."""


def pickle_refusal(root: Path) -> CheckpointError:
    return CheckpointError(
        f"{root} has only pickle (.bin) weights, which can run code when loaded; pass "
        "--allow-pickle to load them with weights_only=True"
    )


def resave_command(root: Path) -> str:
    """A shell line that writes ``root``'s pytorch_model.bin as model.safetensors, read with
    weights_only.

    >>> resave_command(Path("vit")).startswith("python -c 'import torch; from safetensors.torch import save_file")
    True
    """  # noqa: E501
    where = json.dumps(
        str(root)
    )  # a Python string literal without single quotes, for the shell's quoting
    code = (
        f"import torch; from safetensors.torch import save_file; d = {where}; save_file({{k: "
        "v.contiguous() "
        f'for k, v in torch.load(d + "/{PT_WEIGHTS}", weights_only=True).items()}}, d + '
        f'"/{SAFE_WEIGHTS}")'
    )
    return f"python -c {shlex.quote(code)}"


def precheck_weights(root: Path, config: dict[str, Any], *, allow_pickle: bool = False) -> None:
    """The weight files' refusals that need no weight read: pickle weights alone without
    ``allow_pickle``, and a timm directory with ``pytorch_model.bin`` (with the command that
    re-saves it as safetensors)."""
    present = {n for n in WEIGHT_FILES if (root / n).exists() or (root / n).is_symlink()}
    timm = (
        "architecture" in config and "architectures" not in config
    )  # as sources.source_for tells them
    if timm and SAFE_WEIGHTS not in present and PT_WEIGHTS in present:
        # timm would unpickle the file itself, beyond enjoyln's weights_only reading: even
        # --allow-pickle
        # cannot vouch for it, but a one-line re-save can
        raise CheckpointError(
            f"{root} holds a timm model's weights as {PT_WEIGHTS} (pickle), which enjoyln does "
            f"not read, not even with --allow-pickle; re-save them as {SAFE_WEIGHTS}, then run "
            f"enjoyln again: {resave_command(root)}"
        )
    safe, pickled = present & {SAFE_WEIGHTS, SAFE_INDEX}, present & {PT_WEIGHTS, PT_INDEX}
    if not timm and pickled and not safe and not allow_pickle:
        raise pickle_refusal(root)


JSON_LIMIT = 16 << 20
"""The largest JSON file enjoyln parses (``formats``); larger files are compared byte for byte,
streaming."""


def small_json(path: Path) -> Any:
    """A small JSON file's value read without torch, or None where it is missing, too large or not
    JSON."""
    try:
        if not path.is_file() or path.stat().st_size > JSON_LIMIT:
            return None
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def precheck_model_dir(path: str | os.PathLike, *, allow_pickle: bool = False) -> Path:
    """The checks a model directory gets before torch loads: a non-empty directory with a
    ``config.json`` holding a JSON object, and weights enjoyln may read (``precheck_weights``).

    >>> precheck_model_dir("/no/such/dir")
    Traceback (most recent call last):
    enjoyln.errors.CheckpointError: /no/such/dir does not exist
    """
    root = model_directory(Path(path))
    config = root / "config.json"
    if not config.exists():
        if config.is_symlink():
            raise CheckpointError(
                f"{config} is a dangling symlink (it points to {os.readlink(config)})"
            )
        raise CheckpointError(f"{root} has no config.json")
    if not config.is_file():
        raise CheckpointError(f"{config} is not a regular file")
    try:
        if config.stat().st_size > JSON_LIMIT:
            return root  # refused, with its size, by the full check
        data = json.loads(config.read_bytes().decode("utf-8-sig"))
    except OSError as exc:
        raise CheckpointError(f"cannot read {config}: {exc.strerror or exc}") from None
    except RecursionError:
        return root  # named by the full check
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{config} is not valid JSON ({exc.__class__.__name__}: {exc})"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{config} does not hold a JSON object (a model config)")
    precheck_weights(root, data, allow_pickle=allow_pickle)
    return root


def resolve_model_dir(
    spec: str | os.PathLike,
    *,
    revision: str | None = None,
    allow_pickle: bool = False,
    role: str = "MODEL_DIR",
) -> Path:
    """The local directory ``spec`` names: the path itself where it exists, else the snapshot of the
    hub repository ``spec`` at ``revision``, from huggingface_hub's cache or downloaded into it
    (pickle weights only with ``allow_pickle``, other frameworks' never).

    >>> resolve_model_dir("/no/such/dir")
    Traceback (most recent call last):
    enjoyln.errors.CheckpointError: /no/such/dir does not exist, and is not a Hugging Face hub id (NAME or ORG/NAME)
    """  # noqa: E501
    path = Path(spec)
    text = os.fspath(spec)
    if path.exists() or path.is_symlink():
        if revision is not None:
            raise CheckpointError(
                f"--revision applies to a hub id, but {role} {path} is a local path"
            )
        return path
    if not isinstance(spec, str) or not is_hub_id(text):
        raise CheckpointError(
            f"{text} does not exist, and is not a Hugging Face hub id (NAME or ORG/NAME)"
        )
    return _snapshot(text, revision, allow_pickle)


def _snapshot(repo_id: str, revision: str | None, allow_pickle: bool) -> Path:
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # pragma: no cover - transformers requires huggingface_hub
        raise CheckpointError(
            f"{repo_id} does not exist here, and huggingface_hub is not installed to fetch it "
            "from the hub"
        ) from None
    at = f" at revision {revision}" if revision else ""
    ignore = list(SKIPPED_ON_DOWNLOAD) + ([] if allow_pickle else list(PICKLE_PATTERNS))
    try:
        found = snapshot_download(
            repo_id, revision=revision, repo_type="model", ignore_patterns=ignore
        )
    except RevisionNotFoundError:
        raise CheckpointError(
            f"{repo_id} is not a local path, and the hub repository has no revision {revision}"
        ) from None
    except GatedRepoError:
        raise CheckpointError(
            f"{repo_id} is not a local path, and the hub repository is gated: accept its "
            "terms on the hub and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id} is not a local path, nor a model on the Hugging Face hub (or it is "
            "private: log in with hf auth login)"
        ) from None
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        )
        raise CheckpointError(
            f"{repo_id} is not a local path, and the hub model {repo_id}{at} is not in the "
            f"Hugging Face cache ({constants.HF_HUB_CACHE}) while {why}"
        ) from None
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{repo_id} is not a local path, and fetching it from the Hugging Face hub "
            f"failed: {first}"
        ) from None
    return Path(found)
