"""Model directories: read and validate one, contain it, and publish a new one.

A model directory comes from somewhere else, so it is treated as untrusted:

- every safetensors header is validated as strictly as the format requires
  before anything is written;
- symlinks are followed only for the files a model directory needs (weights,
  index, config, tokenizer, processor, generation config), wherever they
  resolve, as in the Hugging Face cache; nothing else that resolves outside
  the directory is copied, and a directory with such a link to a file a
  loader may read is refused (a fold without it could load differently);
- custom code (``auto_map``, ``*.py``) is refused unless the user trusts it,
  so an output never carries code that the analysis did not see.

Output goes to a temporary directory beside OUT_DIR, named after the process
that owns it, and is renamed into place only when complete and checked. A
later run for the same OUT_DIR removes what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
import math
import os
import re
import shutil
import signal
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import CheckpointError, first_line

SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
PT_WEIGHTS, PT_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = {SAFE_WEIGHTS, SAFE_INDEX, PT_WEIGHTS, PT_INDEX}

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
}
CODES = {v: k for k, v in DTYPES.items() if v is not None}

# The files a model directory needs: only these are followed through a symlink
# that leaves the directory (the Hugging Face cache links every file to a blob).
NEEDED = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
          "pytorch_model*.bin", "*.bin.index.json", "tokenizer*", "vocab*", "merges.txt", "*.model",
          "*.tiktoken", "special_tokens_map.json", "added_tokens.json", "preprocessor_config.json",
          "*processor_config.json", "chat_template*", "feature_extractor_config.json")
_VCS = {".git", ".hg", ".svn"}


# --- reading ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes sit in a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class ModelDir:
    """A validated model directory: Hugging Face's format, or timm's hub format."""

    path: Path
    config: dict[str, Any]
    architecture: str
    shards: list[str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    pickled: bool = False
    custom_code: list[str] = field(default_factory=list)
    """What makes this a remote-code model (``auto_map``, ``.py`` files); empty if none."""
    trust_remote_code: bool = False
    source: str = "transformers"
    """The library that builds and loads the model (``sources.SOURCES``): transformers or timm."""

    @property
    def nbytes(self) -> int:
        if self.pickled:
            return sum((self.path / s).stat().st_size for s in self.shards)
        return sum(t.nbytes for t in self.tensors.values())


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the header names {key} twice")
        seen[key] = value
    return seen


def read_safetensors_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header, as strictly as the format requires.

    Every tensor's byte count matches its dtype and shape, and the tensors
    tile the data section exactly: sorted by offset they start at 0, each
    begins where the one before ends (no overlap, no gap) and the last ends
    at the end of the file. A file that breaks this is refused, naming the
    tensors, because an overlap would otherwise come out of a fold as two
    independent copies of the same bytes.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ValueError("shorter than a header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise ValueError("header length beyond the end of the file")
            if header_len > 100 << 20:
                raise ValueError("header larger than 100 MiB")
            # safetensors parses the header as UTF-8 (serde_json): Python's json.loads of bytes
            # would also take a byte-order mark or UTF-16, and vouch for a file nothing loads
            header = json.loads(f.read(header_len).decode("utf-8"), object_pairs_hook=_no_duplicates)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        base = 8 + header_len
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("__metadata__ must map strings to strings")
        tensors = {}
        for name, info in header.items():
            offsets, shape = info["data_offsets"], info["shape"]
            # safetensors itself refuses 0.0, "12" or true where it expects an unsigned integer;
            # int() would take them, and vouch for a file nothing can load
            if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(shape, list)
                    and all(type(v) is int for v in offsets + shape)):
                raise ValueError(f"{name}'s data_offsets and shape must be lists of integers")
            start, end = offsets
            shape = tuple(shape)
            if DTYPES.get(info["dtype"]) is None:
                raise ValueError(f"{name} has the unknown dtype {info['dtype']!r}")
            if start < 0 or end < start:
                raise ValueError(f"{name}'s data offsets [{start}, {end}] are out of order")
            if any(s < 0 for s in shape):
                raise ValueError(f"{name} has a negative size in its shape {list(shape)}")
            if end - start != math.prod(shape) * DTYPES[info["dtype"]].itemsize:
                raise ValueError(f"{name} holds {end - start} bytes, not what its dtype and shape need")
            tensors[name] = TensorInfo(name, info["dtype"], shape, file.name, base + start, base + end)
        pos, last = base, None
        for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
            if t.start < pos:
                raise ValueError(f"{t.name} overlaps {last} (bytes {t.start - base}-{pos - base} of the data)")
            if t.start > pos:
                where = f"after {last}" if last else "before the first tensor"
                raise ValueError(f"{t.start - pos} bytes {where} belong to no tensor (a gap before {t.name})")
            pos, last = t.end, t.name
        if pos > size:
            raise ValueError("truncated: tensor data runs past the end of the file")
        if pos < size:
            raise ValueError(f"{size - pos} bytes after the last tensor belong to no tensor")
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not a valid safetensors file ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{file} is not a valid safetensors file (its header is nested too deeply)") from None
    return tensors, metadata


def input_file(path: Path) -> Path:
    """``path`` if it is a readable regular file (through symlinks); else a clear error naming it."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:
            raise CheckpointError(f"{path} is a symlink loop") from None
        except OSError:
            raise CheckpointError(f"{path} is a dangling symlink (it points to {os.readlink(path)})") from None
    if not path.exists():
        raise CheckpointError(f"{path.parent} has no {path.name}")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file")
    return path


JSON_LIMIT = 16 << 20
"""The largest JSON file enjoyln parses (configs, indexes, and the JSON files it compares by
value); a larger config is refused, and larger files are compared byte for byte, streaming."""
JSON_DEPTH = 64
"""The deepest nesting accepted in a config or index (real ones stay under 10): deeper
structures would exhaust Python's recursion in transformers' own config code."""


def _depth_exceeds(data: Any, limit: int) -> bool:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return False


def loader_text(raw: bytes) -> str:
    """A JSON file's bytes as transformers reads them (``open(..., encoding="utf-8")``): strict
    UTF-8, a byte-order mark kept as a character, which ``json.loads`` then refuses. Python's
    ``json.loads`` of the bytes would skip the mark and also take UTF-16 or UTF-32, so a file
    transformers cannot read (for generation_config.json: silently ignores) would parse."""
    return raw.decode("utf-8")


def parse_json_file(path: Path, what: str) -> Any:
    """A JSON file's value, read only if it is at most ``JSON_LIMIT`` bytes; else one clear error."""
    try:
        size = input_file(path).stat().st_size
        if size > JSON_LIMIT:
            raise CheckpointError(f"{path} holds {size:,} bytes, more than the {JSON_LIMIT >> 20} MiB enjoyln "
                                  f"reads for {what}")
        with open(path, "rb") as f:
            raw = f.read(JSON_LIMIT + 1)  # the file may have grown since
        if len(raw) > JSON_LIMIT:
            raise CheckpointError(f"{path} grew past {JSON_LIMIT >> 20} MiB while it was being read")
        data = json.loads(loader_text(raw))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.__class__.__name__}: {exc})") from None
    if _depth_exceeds(data, JSON_DEPTH):
        raise CheckpointError(f"{path} is nested more than {JSON_DEPTH} levels deep, too deep to be {what}")
    return data


def read_json(path: Path, what: str) -> dict[str, Any]:
    data = parse_json_file(path, what)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object ({what})")
    return data


def _index(index_file: Path) -> dict[str, str]:
    """A weight index's map, naming only plain files inside the directory, each named as the
    weights its loader reads it as.

    transformers opens a shard with safetensors only if its name ends in ``.safetensors``, and
    anything else with ``torch.load``: a safetensors index naming ``chat_template.jinja`` would
    be read here as safetensors (and the file exempted from the comparison of the other files)
    while the model fails to load and the tokenizer reads the same bytes as its template. A
    pickle index's shards likewise carry a weight file's name, never a safetensors one.
    """
    weight_map = read_json(index_file, "a weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file} has no weight_map")
    safe = index_file.name == SAFE_INDEX
    for shard in sorted(set(weight_map.values()), key=repr):
        if not isinstance(shard, str) or Path(shard).name != shard or shard.startswith("."):
            raise CheckpointError(f"{index_file} names the shard {shard!r}, which is not a file in its directory")
        if safe and not shard.endswith(".safetensors"):
            raise CheckpointError(f"{index_file} names the shard {shard!r}, whose name does not end in .safetensors "
                                  "(transformers would open it with torch.load, not as safetensors)")
        if not safe and (shard.endswith((".safetensors", ".json")) or not (shard.endswith(".bin")
                                                                            or is_weight_file(shard))):
            raise CheckpointError(f"{index_file} names the shard {shard!r}, which is not named as pickle weights "
                                  "(such as pytorch_model-00001-of-00002.bin)")
    return weight_map


def custom_code(root: Path, config: dict[str, Any]) -> list[str]:
    """What in ``root`` would run code that is not part of transformers.

    transformers reads ``auto_map`` from config files only (config.json,
    tokenizer_config.json, the processor configs), so a top-level JSON file too
    large to parse is refused if its name says it is a config, and otherwise
    skipped: nothing reads code references from it.
    """
    found = []
    if config.get("auto_map"):
        found.append("auto_map in config.json")
    for item in sorted(root.iterdir()):
        if item.suffix == ".json" and item.name != "config.json" and item.is_file():
            if item.stat().st_size > JSON_LIMIT and not item.name.endswith("config.json"):
                continue
            try:
                data = parse_json_file(item, "a config file")
            except CheckpointError:
                if item.stat().st_size > JSON_LIMIT:
                    raise
                continue  # not JSON: nothing reads an auto_map from it
            if isinstance(data, dict) and "auto_map" in data:
                found.append(f"auto_map in {item.name}")
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _VCS)
        found += [str((Path(folder) / f).relative_to(root)) for f in sorted(files) if f.endswith(".py")]
    return found


def open_model_dir(path: str | os.PathLike, *, allow_pickle: bool = False,
                   trust_remote_code: bool = False) -> ModelDir:
    """Validate a model directory: config, architecture, custom code and every weight header.

    Nothing is loaded; a corrupt or malformed shard is reported here, before
    any output is written.

    >>> open_model_dir("gpt2-dir").architecture  # doctest: +SKIP
    'GPT2LMHeadModel'
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    if not any(root.iterdir()):
        raise CheckpointError(f"{root} is empty")
    config = read_json(root / "config.json", "a model config")
    from .sources import source_for

    source = source_for(config)
    if source is None or (source.name == "transformers" and not isinstance(config["architectures"], list)):
        raise CheckpointError(f"{root / 'config.json'} names no architecture (\"architectures\" is missing)")
    code = custom_code(root, config)
    if code and not trust_remote_code:
        raise CheckpointError(f"{root} carries custom code ({', '.join(code[:3])}); enjoyln analyses only "
                              f"{source.name}'s own model classes and never writes code it did not analyse; "
                              "pass --trust-remote-code to analyse, run and keep that code")
    arch = source.architecture(root, config, remote=bool(code) and bool(config.get("auto_map")))
    md = ModelDir(root, config, arch, [], custom_code=code, trust_remote_code=trust_remote_code, source=source.name)
    index: dict[str, str] | None = None
    present = {n for n in WEIGHT_FILES if (root / n).exists() or (root / n).is_symlink()}
    source.check_weights(root, present)
    for single, index_name in ((SAFE_WEIGHTS, SAFE_INDEX), (PT_WEIGHTS, PT_INDEX)):
        if {single, index_name} <= present:
            # transformers loads the single file and ignores the index; a check that read the
            # shards would vouch for weights that nothing loads
            raise CheckpointError(f"{root} holds both {single} and {index_name}, so one of them is stale "
                                  f"(transformers would load {single}); remove the other")
    if SAFE_INDEX in present:
        index = _index(root / SAFE_INDEX)
        md.shards = sorted(set(index.values()))
    elif SAFE_WEIGHTS in present:
        md.shards = [SAFE_WEIGHTS]
    elif present & {PT_INDEX, PT_WEIGHTS}:
        if not allow_pickle:
            raise CheckpointError(f"{root} has only pickle (.bin) weights, which can run code when "
                                  "loaded; pass --allow-pickle to load them with weights_only=True")
        md.pickled = True
        md.shards = sorted(set(_index(root / PT_INDEX).values())) if PT_INDEX in present else [PT_WEIGHTS]
    else:
        raise CheckpointError(f"{root} has no weights (model.safetensors or {SAFE_INDEX})")
    for shard in md.shards:
        file = root / shard
        if not (file.exists() or file.is_symlink()):
            raise CheckpointError(f"{root} lacks the weight shard {shard} named by its index")
        input_file(file)
        if md.pickled:
            continue
        tensors, _ = read_safetensors_header(file)
        for name in tensors.keys() & md.tensors.keys():
            raise CheckpointError(f"{name} is stored twice, in {md.tensors[name].file} and in {shard}")
        md.tensors.update(tensors)
    if index is not None and not md.pickled:
        for name, shard in index.items():
            if name not in md.tensors or md.tensors[name].file != shard:
                raise CheckpointError(f"{root / SAFE_INDEX} puts {name} in {shard}, which does not hold it")
        extra = sorted(md.tensors.keys() - index.keys())
        if extra:
            raise CheckpointError(f"{md.tensors[extra[0]].file} holds {extra[0]}, which "
                                  f"{root / SAFE_INDEX} does not list")
    return md


@functools.lru_cache(maxsize=1)
def _transformers_names() -> frozenset[str]:
    """transformers' public names. dir() lists its lazy names without importing the model's
    module, which alone can take seconds (meta_model imports it and checks it is a class),
    but it costs half a second itself, so it is asked once."""
    import transformers

    return frozenset(dir(transformers))


def unknown_architecture(arch: Any) -> CheckpointError:
    import transformers

    return CheckpointError(f"unknown architecture {arch!r}: transformers {transformers.__version__} "
                           "has no such model class (remote code is not run)")


def model_class(md: ModelDir) -> type:
    """The class ``from_pretrained`` would build for ``md``: transformers' own, or,
    only when the user trusts it, the directory's custom code."""
    import transformers

    if md.custom_code and md.trust_remote_code and md.config.get("auto_map"):
        refs = [v for v in md.config["auto_map"].values() if isinstance(v, str)
                and v.rpartition(".")[2] == md.architecture]
        if not refs:
            raise CheckpointError(f"{md.path / 'config.json'}'s auto_map has no entry for {md.architecture}")
        if "--" in refs[0]:
            raise CheckpointError(f"{md.architecture} lives in another repository ({refs[0]}); "
                                  "enjoyln does not download code")
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        try:
            return get_class_from_dynamic_module(refs[0], md.path, local_files_only=True)
        except Exception as exc:  # the user's own code, failing to import
            raise CheckpointError(f"cannot import {refs[0]} from {md.path}: {type(exc).__name__}: "
                                  f"{first_line(exc)}") from None
    cls = getattr(transformers, md.architecture, None)
    if not isinstance(cls, type):
        raise unknown_architecture(md.architecture)
    return cls


def auto_config(md: ModelDir) -> Any:
    """The config ``from_pretrained`` builds for ``md``."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(md.path, trust_remote_code=md.trust_remote_code)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise CheckpointError(f"cannot read {md.path / 'config.json'}: "
                              f"{first_line(exc)}") from None


def meta_model(md: ModelDir) -> nn.Module:
    """The model of ``md`` built on the meta device by its library: graph and names, no weights."""
    from .sources import source_of

    return source_of(md).meta_model(md)


def transformers_meta_model(md: ModelDir) -> nn.Module:
    """The transformers model class of ``md`` built on the meta device."""
    cls = model_class(md)
    config = auto_config(md)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:
        raise CheckpointError(f"cannot build {md.architecture} from its config: "
                              f"{first_line(exc)}") from None
    return model.eval()


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def load_dtype(md: ModelDir) -> tuple[str, str]:
    """The dtype the library's own loader gives ``md`` (its name), and where it comes from."""
    from .sources import source_of

    return source_of(md).load_dtype(md)


def transformers_load_dtype(md: ModelDir) -> tuple[str, str]:
    """The dtype a plain ``from_pretrained`` loads ``md`` in (its name), and where it comes from.

    transformers 5 loads with ``dtype="auto"`` by default (``modeling_utils._get_dtype``): the
    config's ``dtype`` (``torch_dtype`` is its old name); without one, for a sharded checkpoint,
    the index metadata's ``dtype``; else the first floating tensor of the first weight file, in
    the order its loader lists the keys. Every sub-config then gets that dtype.
    """
    value = getattr(auto_config(md), "dtype", None)
    if value is not None:
        return dtype_name(value), "config.json"
    index = md.path / (PT_INDEX if md.pickled else SAFE_INDEX)
    if len(md.shards) > 1 or index.exists():
        metadata = parse_json_file(index, "a weight index").get("metadata")
        if isinstance(metadata, dict) and "dtype" in metadata:
            return dtype_name(metadata["dtype"]), f"the metadata of {index.name}"
    if md.pickled:
        from ..convert import _load_pickled

        found = [t.dtype for shard, t in _load_pickled(md).values() if shard == md.shards[0]]
    else:  # safetensors lists the keys sorted
        found = [DTYPES[t.dtype] for _, t in sorted(md.tensors.items()) if t.file == md.shards[0]]
    floating = [d for d in found if d.is_floating_point and "float8_" not in str(d)]
    first = floating[0] if floating else found[0] if found else torch.float32
    return dtype_name(first), f"its first floating tensor (in {md.shards[0]})"


def saved_names(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the key ``save_pretrained`` writes for it.

    transformers 5 renames some weights on save (ViT's ``layers.0.attention.
    k_proj`` is saved as ``encoder.layer.0.attention.attention.key``). Its own
    reverse conversion, run on meta tensors, tells which key holds which
    tensor, matched by identity.
    """
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    try:
        from transformers.modeling_utils import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(named))
    except Exception:  # an older transformers, or a converter that needs real data
        return {}
    by_id = {id(v): k for k, v in reverted.items()}
    return {name: name if name in reverted else by_id.get(id(t), name) for name, t in named.items()}


def checkpoint_key(name: str, keys: set[str], prefix: str, saved: dict[str, str]) -> str | None:
    """The checkpoint key for a parameter name: as saved, maybe without the base prefix."""
    for base in dict.fromkeys((name, saved.get(name, name))):
        for candidate in (base, base.removeprefix(prefix + ".") if prefix else base,
                          f"{prefix}.{base}" if prefix else base):
            if candidate in keys:
                return candidate
    return None


def check_shapes(md: ModelDir, model: nn.Module) -> None:
    """Every saved tensor the model knows has the shape its config implies, so a
    mismatched checkpoint is refused before anything is written."""
    if md.pickled:
        return
    saved = saved_names(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys = set(md.tensors)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = checkpoint_key(name, keys, prefix, saved)
        if key is not None and tuple(md.tensors[key].shape) != tuple(t.shape):
            raise CheckpointError(f"{key} has shape {list(md.tensors[key].shape)} in the checkpoint but "
                                  f"{list(t.shape)} in the model config.json describes")


# --- copying the other files ------------------------------------------------------------


def is_weight_file(name: str) -> bool:
    return fnmatch.fnmatch(name, "*.safetensors") or any(fnmatch.fnmatch(name, p) for p in (
        "pytorch_model*.bin", "*.bin.index.json", "*.safetensors.index.json", "tf_model*.h5",
        "flax_model*.msgpack", "model*.ckpt*", "*.pt", "*.pth"))


def needed_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in NEEDED)


def _extras(md: ModelDir, skipped: list[str], followed: list[str] | None,
            foreign: list[str] | None = None) -> Iterator[tuple[Path, Path, bool]]:
    """(source, path relative to MODEL_DIR, is a directory) for everything a fold copies: every
    entry of ``md`` but the weights and config.json, by the rules ``copy_extras`` states;
    what is left out goes to ``skipped`` with the reason.

    A link that leaves the directory to a file or folder a loader may read (any but a needed
    file, a cache blob, version-control data, or code nobody trusted) raises, naming it: a fold
    copies nothing from outside MODEL_DIR, and without it the copy could load otherwise. With
    ``foreign`` (the gate's view of what a loader reads from the reference, which the user
    handed over) such links are followed instead, and listed there."""
    root = md.path.resolve()
    skip = WEIGHT_FILES | set(md.shards) | {"config.json"}
    linked: set[Path] = set()  # directories already entered through a link

    def inside(p: Path) -> bool:
        return p == root or root in p.parents

    # A Hugging Face cache snapshot (<repo>/snapshots/<revision>) links every file, whatever its
    # name (a PhoBERT bpe.codes, an emoji.json), to <repo>/blobs: those are the snapshot's own.
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    blobs = blobs if blobs is not None and blobs.is_dir() and not blobs.is_symlink() else None

    def cached(target: Path) -> bool:
        return blobs is not None and target.parent == blobs and target.is_file()

    def visit(src: Path, rel: Path, top: bool, chain: tuple[Path, ...]) -> Iterator[tuple[Path, Path, bool]]:
        # chain: the real directories being copied, outermost first. Links that lead back into
        # one of them would recurse until the path is too long; links entered twice could
        # copy a tree exponentially many times.
        name = str(rel)
        if src.is_symlink():
            try:
                target = src.resolve(strict=True)
            except (OSError, RuntimeError):
                if top and needed_file(src.name):
                    input_file(src)  # raises, naming the link
                skipped.append(f"{name} (a dangling symlink)")
                return
            if target.is_dir() and (target in chain or target in src.parent.resolve().parents
                                    or target == src.parent.resolve()):
                skipped.append(f"{name} (a symlink to a directory that contains it)")
                return
            if target.is_dir() and target in linked:
                skipped.append(f"{name} (a second symlink to a directory already copied)")
                return
            if not inside(target) and ((top and needed_file(src.name) and target.is_file()) or cached(target)):
                if followed is not None:
                    followed.append(f"{name} -> {target}")
            elif not inside(target) and _readable(src, target, md.trust_remote_code):
                if foreign is None:
                    raise CheckpointError(
                        f"{md.path / name} links to {target}, outside MODEL_DIR: a loader may read it, but a fold "
                        "copies nothing from outside MODEL_DIR; replace the link with a copy of what it points "
                        "to (or remove it) and run again")
                foreign.append(f"{name} -> {target}")
            # else inside, or outside but read by no loader: skipped below like its kind anywhere
            if target.is_dir():
                linked.add(target)
        try:
            mode = src.stat().st_mode
        except OSError as exc:
            raise CheckpointError(f"cannot read {src}: {exc.strerror or exc}") from None
        if stat.S_ISDIR(mode):
            if src.name in _VCS or src.resolve().name in _VCS:  # also through a link to one
                skipped.append(f"{name} (version-control data)")
                return
            yield src, rel, True
            for child in sorted(src.iterdir()):
                yield from visit(child, rel / child.name, False, (*chain, src.resolve()))
        elif stat.S_ISREG(mode) and name.endswith(".py") and not md.trust_remote_code:
            # custom_code() walked the real tree; one reached only through a link was never accepted
            skipped.append(f"{name} (code, reached through a link)")
        elif stat.S_ISREG(mode):
            yield src, rel, False
        else:
            skipped.append(f"{name} (not a regular file)")

    for item in sorted(md.path.iterdir()):
        if item.name in skip or is_weight_file(item.name):
            continue  # weights in any other format would be stale, uncentered copies
        yield from visit(item, Path(item.name), True, (root,))


def _readable(link: Path, target: Path, trusted: bool) -> bool:
    """Whether a loader may read what a link resolves to. What a fold skips wherever it lies is
    not: special files, version-control data, code without --trust-remote-code."""
    if target.is_dir():
        return link.name not in _VCS and target.name not in _VCS
    return target.is_file() and (trusted or not link.name.endswith(".py"))


def check_links(md: ModelDir) -> None:
    """Refuse, before anything is written, a model directory whose links leave it for a file or
    folder a loader may read (see ``_extras``): a fold would have to drop it."""
    for _ in _extras(md, [], None):
        pass


def copy_extras(md: ModelDir, dest: Path, followed: list[str] | None = None) -> list[str]:
    """Copy every file of ``md`` but the weights and config into ``dest``; return what was skipped.

    ``followed`` collects the needed files copied through a link that leaves the
    directory (``name -> target``), so that the caller can say so.

    A symlink is followed when it resolves inside the directory, when it is a
    file a model directory needs (top level only), or when the directory is a
    Hugging Face cache snapshot and it resolves to one of that repository's
    blobs (any file, at any depth). Any other link that resolves outside the
    directory to a file or folder is refused (``check_links`` says so before
    anything is written); special files, version-control data and dangling
    links are skipped; modes follow the umask, not the source.
    """
    skipped: list[str] = []
    for src, rel, is_dir in _extras(md, skipped, followed):
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


def extra_files(md: ModelDir) -> dict[str, Path]:
    """The files (not directories) ``copy_extras`` would copy from ``md``, and those reached
    through links out of it, which a fold refuses to drop: relative path -> source. With
    config.json and the weights, this is what a copy of ``md`` that loads the same holds."""
    return {rel.as_posix(): src for src, rel, is_dir in _extras(md, [], None, []) if not is_dir}


def loader_files(root: Path) -> tuple[dict[str, Path], list[str]]:
    """Every file under ``root`` as a loader sees it (relative path -> path), through links
    wherever they lead, and what no loader could read there (a dangling link, a special file,
    a link into a directory it is in). Version-control data is left out: no loader reads it."""
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
                if child.name in _VCS or child.resolve().name in _VCS:
                    continue
                stack.append((child, rel + "/", (*chain, real)))
            elif stat.S_ISREG(mode):
                files[rel] = child
            else:
                problems.append(f"{rel} is not a regular file")
    return files, problems


# --- the output directory ------------------------------------------------------------------


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


def is_enjoyln_output(path: Path) -> bool:
    try:
        config = parse_json_file(path / "config.json", "a model config")
    except CheckpointError:
        return False
    return isinstance(config, dict) and isinstance(config.get("enjoyln"), dict)


def check_out_dir(src: Path, out: Path, force: bool, *, dry_run: bool = False) -> None:
    """Refuse an OUT_DIR that would overlap MODEL_DIR, or that ``--force`` must not delete."""
    src, out = src.resolve(), out.resolve()
    if out == src or src in out.parents:
        raise CheckpointError(f"OUT_DIR {out} is inside MODEL_DIR {src}; choose a directory elsewhere")
    if out in src.parents:
        raise CheckpointError(f"OUT_DIR {out} contains MODEL_DIR {src}; choose a directory elsewhere")
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError(f"OUT_DIR {out} exists and is not a directory")
    if dry_run or not any(out.iterdir()):
        return
    if not force:
        raise CheckpointError(f"OUT_DIR {out} is not empty; pass --force to replace an earlier enjoyln output")
    if not is_enjoyln_output(out):
        raise CheckpointError(f"OUT_DIR {out} is not empty and is not an enjoyln output (its config.json has "
                              "no enjoyln block); --force replaces only those, so remove it yourself")


_OWNER = ".enjoyln-owner"


def _start_time(pid: int) -> str:
    """The kernel's start time of ``pid`` (to tell a reused pid apart), or '' where unknown."""
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
    """(pid, start time) of the process that made a temporary directory."""
    try:
        with open(tmp / _OWNER, "rb") as f:  # a few bytes, whatever the file holds
            recorded, _, started = f.read(64).decode().partition(" ")
        return int(recorded), started.strip()
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return pid, ""  # killed before it wrote the record, or the old output a publish moved aside


def _ours(out: Path, name: str) -> int | None:
    """The pid in ``name`` if it is one of the names enjoyln gives OUT_DIR's temporary
    directories (``.OUT.enjoyln-PID-XXXXXXXX`` from mkdtemp, ``.OUT.enjoyln-PID-old``), else None:
    a user's ``.OUT.enjoyln-backup-2024`` is not ours to remove."""
    match = re.fullmatch(re.escape(f".{out.name}.enjoyln-") + r"(\d+)-(?:old|[a-z0-9_]{8})", name)
    return int(match.group(1)) if match else None


def stale_temp_dirs(out: Path) -> tuple[list[Path], list[tuple[Path, int]]]:
    """Temporary directories for ``out`` left by runs that died, and those a live run owns."""
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
        raise CheckpointError(f"another enjoyln (pid {pid}) is writing {out} (its work is in {tmp}); "
                              "wait for it, or stop it")
    for tmp in dead:
        shutil.rmtree(tmp, ignore_errors=True)
    return dead


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, outermost first: what making it creates."""
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return missing[::-1]


def remove_dirs(dirs: list[Path]) -> None:
    """Remove directories a run created (``missing_dirs``), innermost first, if still empty."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:  # not empty (a kept candidate, someone else's file), or never made
            return


def temp_dir(out: Path) -> Path:
    """A fresh directory beside OUT_DIR, owned by this process, renamed into place when done."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.enjoyln-{os.getpid()}-", dir=out.parent))
    (tmp / _OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Move the finished temporary directory to ``out``, replacing an earlier output."""
    (tmp / _OWNER).unlink(missing_ok=True)
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
    """Delay SIGINT and SIGTERM until the block is done (where the platform allows), so that
    a step and the bookkeeping that lets cleanup undo it happen together or not at all."""
    held = {signal.SIGINT, signal.SIGTERM}
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    mask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        mask(signal.SIG_UNBLOCK, held)


def keep_failed(tmp: Path, out: Path) -> Path:
    """Move a candidate that failed its check beside OUT_DIR, for inspection."""
    (tmp / _OWNER).unlink(missing_ok=True)
    os.chmod(tmp, 0o777 & ~umask())
    kept = out.with_name(f"{out.name}.enjoyln-failed")
    n = 1
    while kept.exists():
        n += 1
        kept = out.with_name(f"{out.name}.enjoyln-failed-{n}")
    os.replace(tmp, kept)
    return kept
