"""transformers' side of a model directory: its model class, meta model, load dtype and checkpoint
keys."""

from __future__ import annotations

import copy
import importlib
import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CheckpointError, first_line
from .formats import DTYPES, json_or_none, parse_json_file

if TYPE_CHECKING:
    from .checkpoint import Checkpoint


@functools.lru_cache(maxsize=1)
def transformers_names() -> frozenset[str]:
    """transformers' public names, lazy ones included, without importing the model's module
    (seconds); read directly as its lazy module's dir() is quadratic in its 6,500 names."""
    import transformers

    return frozenset(vars(transformers)) | frozenset(getattr(transformers, "__all__", ()))


def unknown_architecture(arch: Any) -> CheckpointError:
    import transformers

    return CheckpointError(
        f"unknown architecture {arch!r}: transformers {transformers.__version__} "
        "has no such model class (remote code is not run)"
    )


def model_class(checkpoint: Checkpoint) -> type:
    """The class ``from_pretrained`` would build: transformers' own, or the trusted directory's
    code."""
    import transformers

    if (
        checkpoint.custom_code
        and checkpoint.trust_remote_code
        and checkpoint.config.get("auto_map")
    ):
        refs = [
            v
            for v in checkpoint.config["auto_map"].values()
            if isinstance(v, str) and v.rpartition(".")[2] == checkpoint.architecture
        ]
        if not refs:
            raise CheckpointError(
                f"{checkpoint.path / 'config.json'}'s auto_map has no entry for "
                f"{checkpoint.architecture}"
            )
        if "--" in refs[0]:
            raise CheckpointError(
                f"{checkpoint.architecture} lives in another repository ({refs[0]}); "
                "enjoyln does not download code"
            )
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        try:
            return get_class_from_dynamic_module(refs[0], checkpoint.path, local_files_only=True)
        except Exception as exc:  # the user's own code, failing to import
            raise CheckpointError(
                f"cannot import {refs[0]} from {checkpoint.path}: {type(exc).__name__}: "
                f"{first_line(exc)}"
            ) from None
    cls = getattr(transformers, checkpoint.architecture, None)
    if not isinstance(cls, type):
        raise unknown_architecture(checkpoint.architecture)
    return cls


def auto_config(checkpoint: Checkpoint) -> Any:
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(
            checkpoint.path, trust_remote_code=checkpoint.trust_remote_code
        )
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise CheckpointError(
            f"cannot read {checkpoint.path / 'config.json'}: {first_line(exc)}"
        ) from None


def transformers_meta_model(checkpoint: Checkpoint) -> nn.Module:
    cls = model_class(checkpoint)
    config = copy.deepcopy(
        checkpoint.model_config
    )  # a model's __init__ may set fields on its config
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:
        raise CheckpointError(
            f"cannot build {checkpoint.architecture} from its config: {first_line(exc)}"
        ) from None
    return model.eval()


def transformers_meta_as_loaded(checkpoint: Checkpoint, dtype: str = "auto") -> nn.Module:
    """The model a plain ``from_pretrained`` builds for ``checkpoint`` in ``dtype``, on the meta
    device."""
    cls = model_class(checkpoint)
    kwargs = {
        "trust_remote_code": checkpoint.trust_remote_code,
        "dtype": dtype if dtype == "auto" else getattr(torch, dtype),
        "device_map": "meta",
    }
    if checkpoint.pickled:
        kwargs["use_safetensors"] = False
    try:
        # device_map="meta" alone leaves __init__'s buffers (GPT-J's sinusoid table) on the CPU, in
        # full
        with torch.device("meta"):
            return cls.from_pretrained(checkpoint.path, **kwargs).eval()
    except Exception as exc:
        raise CheckpointError(
            f"cannot load {checkpoint.path}: {type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0]}"
        ) from None


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def transformers_load_dtype(checkpoint: Checkpoint) -> tuple[str, str]:
    """The dtype (its name) a plain ``from_pretrained`` loads ``md`` in, and where from, as
    transformers 5's ``dtype="auto"`` decides: config, else index metadata, else the first weight
    file's first floating tensor."""
    value = getattr(checkpoint.model_config, "dtype", None)
    if value is not None:
        return _floating(value, checkpoint.path / "config.json"), "config.json"
    index = checkpoint.index  # several shards come with one
    if index is not None:
        metadata = parse_json_file(index, "a weight index").get("metadata")
        if isinstance(metadata, dict) and "dtype" in metadata:
            return _floating(metadata["dtype"], index), f"the metadata of {index.name}"
    if checkpoint.pickled:
        found = [
            t.dtype
            for shard, t in checkpoint.pickled_tensors.values()
            if shard == checkpoint.shards[0]
        ]
    else:  # safetensors lists the keys sorted
        found = [
            DTYPES[t.dtype]
            for _, t in sorted(checkpoint.tensors.items())
            if t.file == checkpoint.shards[0]
        ]
    floating = [d for d in found if d.is_floating_point and "float8_" not in str(d)]
    first = floating[0] if floating else found[0] if found else torch.float32
    return dtype_name(first), f"its first floating tensor (in {checkpoint.shards[0]})"


def _floating(value: Any, where: Path) -> str:
    """The name of the floating dtype ``value`` names (a torch dtype, or its name)."""
    name = dtype_name(value) if isinstance(value, (str, torch.dtype)) else None
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(
            f"{where} names the dtype {value!r}, which is not a floating torch dtype a model "
            "loads in (such as float32 or bfloat16)"
        )
    return name


def saved_names(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the key ``save_pretrained`` writes (transformers 5 renames some weights on
    save)."""
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    try:
        from transformers.modeling_utils import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(named))
    except Exception:  # an older transformers, or a converter that needs real data
        return {}
    by_id = {id(v): k for k, v in reverted.items()}
    return {name: name if name in reverted else by_id.get(id(t), name) for name, t in named.items()}


def check_shapes(checkpoint: Checkpoint) -> None:
    """Every saved tensor the meta model knows has the shape its config implies."""
    if checkpoint.pickled:
        return
    for name, t in list(checkpoint.meta.named_parameters()) + list(checkpoint.meta.named_buffers()):
        key = checkpoint.key(name)
        if key is not None and tuple(checkpoint.tensors[key].shape) != tuple(t.shape):
            raise CheckpointError(
                f"{key} has shape {list(checkpoint.tensors[key].shape)} in the checkpoint but "
                f"{list(t.shape)} in the model config.json describes"
            )


def random_when_missing(model: nn.Module) -> set[str]:
    """The names a load initialises at random when no checkpoint holds them: floating parameters (a
    buffer is built the same on every load), but those transformers expects a checkpoint to
    lack."""
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    return {
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.is_floating_point() and not any(r.search(name) for r in ignored)
    }


def missing_parameters(checkpoint: Checkpoint, model: nn.Module | None = None) -> list[str]:
    """The parameters the meta model (or ``model``, another class's) builds that no weight file
    holds under any tied name: every load initialises them at random.

    >>> missing_parameters(open_checkpoint("mpnet-dir"))  # doctest: +SKIP
    ['lm_head.dense.weight', 'lm_head.dense.bias', ...]
    """
    if checkpoint.source != "transformers" or checkpoint.pickled:
        return []
    model = checkpoint.meta if model is None else model
    by_id: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(t), []).append(name)
    random = random_when_missing(model)
    return [
        names[0]
        for names in by_id.values()
        if names[0] in random and all(checkpoint.key(n) is None for n in names)
    ]


def matching_class(checkpoint: Checkpoint) -> str | None:
    """The class AutoModel builds for this config (the model without a head) where it is not the one
    named and the weights hold every parameter it builds: what a checkpoint saved without its
    head is a checkpoint of."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(checkpoint.config.get("model_type"))
    cls = (
        getattr(importlib.import_module("transformers"), name, None)
        if isinstance(name, str)
        else None
    )
    if not isinstance(cls, type) or name == checkpoint.architecture or checkpoint.custom_code:
        return None
    try:
        with torch.device("meta"):
            model = cls(copy.deepcopy(checkpoint.model_config))
    except Exception:  # a class that does not build from this config matches nothing
        return None
    return name if not missing_parameters(checkpoint, model) else None


def transformers_generation(checkpoint: Checkpoint) -> dict[str, Any]:
    """The generation settings ``from_pretrained`` gives the model, as transformers 5 builds them:
    from generation_config.json, else config.json's raw values (which may sample)."""
    import transformers

    file = checkpoint.path / "generation_config.json"
    data = json_or_none(file, "a generation config") if file.is_file() else None
    try:
        if isinstance(data, dict):
            settings = transformers.GenerationConfig.from_dict(copy.deepcopy(data)).to_dict()
        else:
            settings = transformers.GenerationConfig.from_model_config(
                copy.deepcopy(checkpoint.config)
            ).to_dict()
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise CheckpointError(
            f"cannot read the generation config of {checkpoint.path}: {first_line(exc)}"
        ) from None
    settings.pop("transformers_version", None)  # the running transformers' version, on both sides
    return settings
