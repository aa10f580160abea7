"""A model directory, opened once and validated as untrusted (every safetensors header, custom code
refused unless trusted), then what its library makes of it, each built when first needed and
kept."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, first_line
from ..plan import FoldPlan
from .files import VCS_DIRS, is_weight_file
from .formats import (
    JSON_LIMIT,
    TensorInfo,
    input_file,
    json_or_none,
    read_json,
    read_safetensors_header,
)
from .hf import auto_config, missing_parameters, saved_names
from .locate import (
    PT_INDEX,
    PT_WEIGHTS,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    WEIGHT_FILES,
    model_directory,
    pickle_refusal,
    precheck_weights,
)
from .memory import built_bytes
from .sources import SOURCES, Source, source_for

if TYPE_CHECKING:
    from torch import nn


@dataclass(eq=False)
class Checkpoint:
    """A validated model directory (Hugging Face's or timm's hub format): open it once per command
    and hand it on.

    >>> checkpoint = open_checkpoint("gpt2-dir")  # doctest: +SKIP
    >>> checkpoint.architecture, checkpoint.load_dtype[0], checkpoint.key("lm_head.weight")  # doctest: +SKIP
    ('GPT2LMHeadModel', 'float32', 'transformer.wte.weight')
    """  # noqa: E501

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
    def library(self) -> Source:
        return SOURCES[self.source]

    @property
    def index(self) -> Path | None:
        path = self.path / (PT_INDEX if self.pickled else SAFE_INDEX)
        return path if path.exists() else None

    @property
    def nbytes(self) -> int:
        if self.pickled:
            return sum((self.path / s).stat().st_size for s in self.shards)
        return sum(t.nbytes for t in self.tensors.values())

    _as_loaded: dict[str, nn.Module] = field(default_factory=dict, init=False, repr=False)

    @functools.cached_property
    def model_config(self) -> Any:
        """transformers' config object (``AutoConfig``), read once; ``config`` is the raw JSON."""
        return auto_config(self)

    @functools.cached_property
    def meta(self) -> nn.Module:
        """The model its config builds, on the meta device."""
        return self.library.meta_model(self)

    def meta_as_loaded(self, dtype: str = "auto") -> nn.Module:
        """The model its library's loader gives in ``dtype`` (``"auto"``: as stored), on the meta
        device; built once per dtype. Read it, never change it: every caller shares it."""
        if dtype not in self._as_loaded:
            self._as_loaded[dtype] = self.library.meta_as_loaded(self, dtype)
        return self._as_loaded[dtype]

    @functools.cached_property
    def saved(self) -> dict[str, str]:
        return saved_names(self.meta)

    @functools.cached_property
    def load_dtype(self) -> tuple[str, str]:
        return self.library.load_dtype(self)

    @functools.cached_property
    def pickled_tensors(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Key -> (shard, tensor) of pickle weights, loaded with ``weights_only``, plain tensors
        only."""
        tensors: dict[str, tuple[str, torch.Tensor]] = {}
        for shard in self.shards:
            try:
                part = torch.load(self.path / shard, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(
                    f"cannot load {self.path / shard} with weights_only=True: {first_line(exc)}"
                ) from None
            tensors.update({k: (shard, v) for k, v in part.items() if isinstance(v, torch.Tensor)})
        return tensors

    @functools.cached_property
    def keys(self) -> set[str]:
        return set(self.pickled_tensors) if self.pickled else set(self.tensors)

    def key(self, name: str) -> str | None:
        """The checkpoint key for a parameter name: as saved, maybe without the base prefix."""
        keys, prefix, saved = (
            self.keys,
            getattr(self.meta, "base_model_prefix", "") or "",
            self.saved,
        )
        for base in dict.fromkeys((name, saved.get(name, name))):
            for candidate in (
                base,
                base.removeprefix(prefix + ".") if prefix else base,
                f"{prefix}.{base}" if prefix else base,
            ):
                if candidate in keys:
                    return candidate
        return None

    @functools.cached_property
    def built(self) -> tuple[int, int]:
        return built_bytes(self.meta, self.load_dtype[0])

    @functools.cached_property
    def missing(self) -> list[str]:
        return missing_parameters(self)

    @functools.cached_property
    def recorded_plan(self) -> FoldPlan | None:
        """The plan recorded in its ``enjoyln`` block, or None."""
        block = self.config.get("enjoyln")
        if block is None:
            return None
        if not isinstance(block, dict) or "plan" not in block:
            raise CheckpointError(
                f"the enjoyln block in {self.path / 'config.json'} is malformed: it holds no plan"
            )
        try:
            return FoldPlan.from_dict(block["plan"])
        except ValueError as exc:
            raise CheckpointError(
                f"the enjoyln block in {self.path / 'config.json'} is malformed: {exc}"
            ) from None


def _index(index_file: Path) -> dict[str, str]:
    """A weight index's map, naming only files inside the directory, each named as the weights its
    loader reads it as (transformers opens a shard as safetensors only by its name, else with
    ``torch.load``)."""
    weight_map = read_json(index_file, "a weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file} has no weight_map")
    safe = index_file.name == SAFE_INDEX
    for shard in sorted({v if isinstance(v, str) else repr(v) for v in weight_map.values()}):
        if shard not in weight_map.values() or Path(shard).name != shard or shard.startswith("."):
            raise CheckpointError(
                f"{index_file} names the shard {shard!r}, which is not a file in its directory"
            )
        if safe and not shard.endswith(".safetensors"):
            raise CheckpointError(
                f"{index_file} names the shard {shard!r}, whose name does not end in .safetensors "
                "(transformers would open it with torch.load, not as safetensors)"
            )
        if not safe and (
            shard.endswith((".safetensors", ".json"))
            or not (shard.endswith(".bin") or is_weight_file(shard))
        ):
            raise CheckpointError(
                f"{index_file} names the shard {shard!r}, which is not named as pickle weights "
                "(such as pytorch_model-00001-of-00002.bin)"
            )
    return weight_map


def custom_code(root: Path, config: dict[str, Any]) -> list[str]:
    """What in ``root`` would run code that is not part of transformers; a top-level JSON file too
    large to parse is refused if its name says it is a config (only those carry ``auto_map``)."""
    found = []
    if config.get("auto_map"):
        found.append("auto_map in config.json")
    for item in sorted(root.iterdir()):
        if item.suffix == ".json" and item.name != "config.json" and item.is_file():
            if item.stat().st_size > JSON_LIMIT and not item.name.endswith("config.json"):
                continue
            data = json_or_none(
                item, "a config file"
            )  # not JSON: nothing reads an auto_map from it
            if isinstance(data, dict) and "auto_map" in data:
                found.append(f"auto_map in {item.name}")
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in VCS_DIRS)
        found += [
            str((Path(folder) / f).relative_to(root)) for f in sorted(files) if f.endswith(".py")
        ]
    return found


def open_checkpoint(
    path: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    model_class: str | None = None,
) -> Checkpoint:
    """Validate a model directory (config, architecture, custom code, every weight header); nothing
    is loaded. ``model_class`` names a class to build instead of config.json's (``MPNetModel``).

    >>> open_checkpoint("gpt2-dir").architecture  # doctest: +SKIP
    'GPT2LMHeadModel'
    """
    root = model_directory(Path(path))
    config = read_json(root / "config.json", "a model config")
    source = source_for(config)
    if source is None or (
        source.name == "transformers" and not isinstance(config["architectures"], list)
    ):
        raise CheckpointError(
            f'{root / "config.json"} names no architecture ("architectures" is missing)'
        )
    precheck_weights(
        root, config, allow_pickle=allow_pickle
    )  # before timm or the model's code is imported
    code = custom_code(root, config)
    if code and not trust_remote_code:
        raise CheckpointError(
            f"{root} carries custom code ({', '.join(code[:3])}); enjoyln analyses only "
            f"{source.name}'s own model classes and never writes code it did not analyse; "
            "pass --trust-remote-code to analyse, run and keep that code"
        )
    arch = source.architecture(root, config, remote=bool(code) and bool(config.get("auto_map")))
    if model_class is not None and model_class != arch:
        arch = source.other_class(root, model_class)
    checkpoint = Checkpoint(
        root,
        config,
        arch,
        [],
        custom_code=code,
        trust_remote_code=trust_remote_code,
        source=source.name,
    )
    _read_headers(checkpoint, _weight_files(checkpoint, source, allow_pickle))
    return checkpoint


def _weight_files(
    checkpoint: Checkpoint, source: Source, allow_pickle: bool
) -> dict[str, str] | None:
    """Set ``checkpoint.shards`` (and ``pickled``) from the weight files the loader reads; return
    the index's map."""
    root = checkpoint.path
    present = {n for n in WEIGHT_FILES if (root / n).exists() or (root / n).is_symlink()}
    source.check_weights(root, present)
    for single, index_name in ((SAFE_WEIGHTS, SAFE_INDEX), (PT_WEIGHTS, PT_INDEX)):
        if {single, index_name} <= present:
            # transformers loads the single file and ignores the index; a check that read the
            # shards would vouch for weights that nothing loads
            raise CheckpointError(
                f"{root} holds both {single} and {index_name}, so one of them is stale "
                f"(transformers would load {single}); remove the other"
            )
    if SAFE_INDEX in present:
        index = _index(root / SAFE_INDEX)
        checkpoint.shards = sorted(set(index.values()))
        return index
    if SAFE_WEIGHTS in present:
        checkpoint.shards = [SAFE_WEIGHTS]
        return None
    if present & {PT_INDEX, PT_WEIGHTS}:
        if not allow_pickle:
            raise pickle_refusal(root)
        checkpoint.pickled = True
        checkpoint.shards = (
            sorted(set(_index(root / PT_INDEX).values())) if PT_INDEX in present else [PT_WEIGHTS]
        )
        return None
    raise CheckpointError(f"{root} has no weights (model.safetensors or {SAFE_INDEX})")


def _read_headers(checkpoint: Checkpoint, index: dict[str, str] | None) -> None:
    """Every shard readable, every header valid, and an index naming exactly what its shards
    hold."""
    root = checkpoint.path
    for shard in checkpoint.shards:
        file = root / shard
        if not (file.exists() or file.is_symlink()):
            raise CheckpointError(f"{root} lacks the weight shard {shard} named by its index")
        input_file(file)
        if checkpoint.pickled:
            continue
        tensors, _ = read_safetensors_header(file)
        for name in tensors.keys() & checkpoint.tensors.keys():
            raise CheckpointError(
                f"{name} is stored twice, in {checkpoint.tensors[name].file} and in {shard}"
            )
        checkpoint.tensors.update(tensors)
    if index is None:
        return
    for name, shard in index.items():
        if name not in checkpoint.tensors or checkpoint.tensors[name].file != shard:
            raise CheckpointError(
                f"{root / SAFE_INDEX} puts {name} in {shard}, which does not hold it"
            )
    extra = sorted(checkpoint.tensors.keys() - index.keys())
    if extra:
        raise CheckpointError(
            f"{checkpoint.tensors[extra[0]].file} holds {extra[0]}, which {root / SAFE_INDEX} does "
            "not list"
        )
