"""Where a model directory's model comes from: transformers or timm (imported only for a timm
directory)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CheckpointError
from .locate import SAFE_WEIGHTS
from .hf import (
    model_class,
    transformers_generation,
    transformers_load_dtype,
    transformers_meta_as_loaded,
    transformers_meta_model,
    transformers_names,
    unknown_architecture,
)

if TYPE_CHECKING:
    from .checkpoint import Checkpoint


class Source:
    """What a model directory's library does for enjoyln. Each library gives ``architecture(root,
    config, remote)`` (config.json's model, refused unless it knows it),
    ``meta_model(checkpoint)`` (built on the meta device, in eval mode),
    ``meta_as_loaded(checkpoint, dtype)`` (the meta model its loader gives in ``dtype``),
    ``load(checkpoint, ...)`` (its own loader's model, LayerNorms unchanged) and
    ``load_dtype(checkpoint)`` (that model's dtype name, and where from)."""

    name = ""
    bounded_loading = False
    """Whether it can load within a memory budget, offloading weights (only transformers' loader
    can)."""
    shards = True
    """Whether its loader reads sharded weights."""
    loader = ""
    """The plain loader's name, for the check's report."""

    def other_class(self, root: Path, name: str) -> str:
        """``name``, a class to build instead of config.json's (``--model-class``), if the library
        has it."""
        raise CheckpointError(
            f"--model-class applies to transformers model directories; {root} is a {self.name} one"
        )

    def check_weights(self, root: Path, present: set[str]) -> None:
        """Refuse weight files this library would not load as a fold writes them."""

    def generation(self, checkpoint: "Checkpoint") -> dict[str, Any]:
        """The generation settings the loaded model carries (compared by the static check)."""
        return {}


class Transformers(Source):
    """transformers' own classes (``from_pretrained``), or the directory's code when trusted."""

    name = "transformers"
    bounded_loading = True
    loader = "from_pretrained"

    def architecture(self, root: Path, config: dict[str, Any], remote: bool) -> str:
        arch = config["architectures"][0]
        if not isinstance(arch, str) or (not remote and arch not in transformers_names()):
            raise unknown_architecture(arch)
        return arch

    def other_class(self, root: Path, name: str) -> str:
        if name not in transformers_names() or not name[:1].isupper() or name.endswith("Config"):
            raise CheckpointError(
                f"--model-class {name!r} is not a transformers model class (such as MPNetModel)"
            )
        return name

    meta_model = staticmethod(transformers_meta_model)
    meta_as_loaded = staticmethod(transformers_meta_as_loaded)
    load_dtype = staticmethod(transformers_load_dtype)
    generation = staticmethod(transformers_generation)

    def load(
        self,
        checkpoint: "Checkpoint",
        *,
        trust_remote_code: bool = False,
        max_memory: int | None = None,
        offload_dir: Any = None,
        **kwargs: Any,
    ) -> nn.Module:
        cls = model_class(checkpoint)
        kwargs["trust_remote_code"] = trust_remote_code
        if checkpoint.pickled:
            kwargs.setdefault("use_safetensors", False)
        if max_memory is not None:
            if offload_dir is None:
                raise CheckpointError(
                    "loading within a memory budget needs a directory for offloaded weights"
                )
            kwargs.update(
                device_map="auto",
                max_memory={"cpu": max(int(max_memory), 1)},
                offload_folder=str(offload_dir),
            )
        return cls.from_pretrained(checkpoint.path, **kwargs)


def import_timm() -> Any:
    """timm, or one clear error: it is not a dependency."""
    try:
        return importlib.import_module("timm")
    except (
        Exception
    ) as exc:  # ImportError, or what a broken install raises (a CUDA torchvision on a CPU torch)
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(
            f'this is a timm model directory (config.json names an "architecture"), but timm '
            f"cannot be imported here ({type(exc).__name__}: {why}); install timm to inspect, "
            "fold, check or load it"
        ) from None


_LOADING_ARGS = frozenset(
    {"pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "cache_dir"}
)
"""``create_model``'s arguments that say where weights come from, which ``model_args`` may not
set."""


class Timm(Source):
    """timm's hub format, loaded by ``create_model(architecture, pretrained=True,
    pretrained_cfg_overlay= dict(file=.../model.safetensors))``; timm builds its models in
    float32 and copies the weights in."""

    name = "timm"
    shards = False
    loader = "timm.create_model"

    def architecture(self, root: Path, config: dict[str, Any], remote: bool) -> str:
        arch = config["architecture"]
        if not isinstance(arch, str) or not arch:
            raise CheckpointError(
                f"{root / 'config.json'} names the architecture {arch!r}, which is not a model name"
            )
        for key, kind in (("model_args", dict), ("pretrained_cfg", dict), ("num_classes", int)):
            if key in config and not isinstance(config[key], kind):
                what = "an object" if kind is dict else "an integer"
                raise CheckpointError(f"{root / 'config.json'}'s {key} is not {what}")
        loading = sorted(set(config.get("model_args") or {}) & _LOADING_ARGS)
        if loading:
            # create_model would load (or fetch) weights from elsewhere than the directory's file
            raise CheckpointError(
                f"{root / 'config.json'}'s model_args set {', '.join(loading)}, which say where "
                "timm loads weights from, not what the model is; enjoyln reads only the "
                "directory's model.safetensors"
            )
        timm = import_timm()
        if not timm.is_model(arch):
            raise CheckpointError(
                f"unknown architecture {arch!r}: timm {timm.__version__} has no such model"
            )
        return arch

    def check_weights(self, root: Path, present: set[str]) -> None:
        if SAFE_WEIGHTS not in present:
            raise CheckpointError(
                f"{root} has no {SAFE_WEIGHTS}; enjoyln reads a timm model directory's weights "
                "from that one file, which is what timm loads first"
            )

    def _build(self, checkpoint: "Checkpoint", pretrained: bool) -> nn.Module:
        timm = import_timm()
        cfg = checkpoint.config
        overlay = dict(cfg.get("pretrained_cfg") or {})
        # the directory's own file and nothing else: no hub, no URL, no custom loader
        overlay.update(
            file=str(checkpoint.path / SAFE_WEIGHTS), source="", state_dict=None, custom_load=False
        )
        kwargs = dict(cfg.get("model_args") or {})
        if "num_classes" in cfg:
            kwargs["num_classes"] = cfg["num_classes"]
        if (
            "num_classes" in kwargs
        ):  # as the model's head: else timm drops the stored head and loads the rest
            overlay["num_classes"] = kwargs["num_classes"]
        return timm.create_model(
            checkpoint.architecture, pretrained=pretrained, pretrained_cfg_overlay=overlay, **kwargs
        )

    def meta_model(self, checkpoint: "Checkpoint") -> nn.Module:
        try:
            with torch.device("meta"):
                model = self._build(checkpoint, pretrained=False)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"cannot build {checkpoint.architecture} from {checkpoint.path / 'config.json'}: "
                f"{(str(exc).splitlines() or [''])[0]}"
            ) from None
        return model.eval()

    def meta_as_loaded(self, checkpoint: "Checkpoint", dtype: str = "auto") -> nn.Module:
        # timm builds in float32 and copies the weights in: its meta model is what it loads
        model = self.meta_model(checkpoint)
        return model if dtype == "auto" else model.to(getattr(torch, dtype))

    def load(
        self,
        checkpoint: "Checkpoint",
        *,
        trust_remote_code: bool = False,
        max_memory: int | None = None,
        offload_dir: Any = None,
        dtype: Any = None,
        **kwargs: Any,
    ) -> nn.Module:
        if max_memory is not None:
            raise CheckpointError(
                "timm loads a model whole, so it cannot run within a memory budget; pass --static "
                "to prove every weight without running the model"
            )
        if kwargs:
            raise CheckpointError(
                f"a timm model directory loads without {', '.join(sorted(kwargs))}"
            )
        model = self._build(checkpoint, pretrained=True)
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        return model

    def load_dtype(self, checkpoint: "Checkpoint") -> tuple[str, str]:
        return "float32", "timm, which builds its models in float32"


TRANSFORMERS, TIMM = Transformers(), Timm()
SOURCES = {s.name: s for s in (TRANSFORMERS, TIMM)}


def source_for(config: dict[str, Any]) -> Source | None:
    """The library a config.json is written for, or None if it names no architecture."""
    if config.get("architectures"):
        return TRANSFORMERS
    if "architecture" in config and "architectures" not in config:
        return TIMM
    return None
