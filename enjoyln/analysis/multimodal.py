"""Example images for vision-language models: pixels in each layout vision towers take (a batch of
images, images per sample, tiles with their aspect ratios, any-resolution crops with their sizes,
flattened patches with their grids), and text holding one placeholder token per image feature, as
a processor writes it.

The layouts are chosen by the names of the model's arguments and the fields of its vision config,
never by the model's class, so a new family that takes the same inputs gets them too."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

Randn = Callable[..., torch.Tensor]


def int_pair(size: Any) -> tuple[int, int] | None:
    """(height, width) from an int or the last two of a sequence of positive ints; None
    otherwise."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if (
        isinstance(size, (list, tuple))
        and len(size) >= 2
        and all(isinstance(s, int) and s > 0 for s in size[-2:])
    ):
        return int(size[-2]), int(size[-1])
    return None


def _vision_value(config: Any, *names: str) -> Any:
    """The first of ``names`` set on the vision sub-config, else on the config itself."""
    for cfg in (getattr(config, "vision_config", None), config):
        for name in names:
            value = getattr(cfg, name, None) if cfg is not None else None
            if value is not None and not isinstance(value, bool):
                return value
    return None


def _image_params(model: nn.Module) -> set[str]:
    """The argument names of ``forward`` and of ``get_image_features``: what the model reads beside
    pixels."""
    names = set(inspect.signature(model.forward).parameters)
    get = getattr(model, "get_image_features", None)
    return names | (set(inspect.signature(get).parameters) if callable(get) else set())


def _anyres_crops(size: tuple[int, int], pinpoints: list, tile: int) -> int:
    """Crops of an image of ``size`` in the any-resolution scheme: the tiles of its best grid, and
    the whole image."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(size, pinpoints)
    return -(-height // tile) * -(-width // tile) + 1


def image_layouts(
    model: nn.Module, randn: Randn, batch: int, device: torch.device
) -> list[dict[str, Any]]:
    """One image per sample, in each layout the model's arguments and vision config point to; the
    layouts that need an argument only some models take come first."""
    config, params = model.config, _image_params(model)
    size = int_pair(_vision_value(config, "image_size", "img_size")) or (224, 224)
    channels = _vision_value(config, "num_channels", "in_channels", "in_chans") or 3
    patch = _vision_value(config, "patch_size")
    layouts: list[dict[str, Any]] = []

    def ints(values: Any) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    if "image_grid_thw" in params and isinstance(patch, int):
        # flattened patches and each image's (frames, rows, columns) grid, two merged tokens a side
        merge, frames = (
            _vision_value(config, "spatial_merge_size") or 1,
            _vision_value(config, "temporal_patch_size"),
        )
        side = 2 * merge
        layouts.append(
            {
                "pixel_values": randn(
                    batch * side * side, channels * (frames or 1) * patch * patch
                ),
                "image_grid_thw": ints([[1, side, side]] * batch),
            }
        )
    tiles = _vision_value(config, "max_num_tiles")
    if "aspect_ratio_ids" in params and isinstance(tiles, int):
        # one image of one tile per sample: aspect ratio 1 (1x1), the other tiles masked out
        mask = torch.zeros(batch, 1, tiles, dtype=torch.long)
        mask[..., 0] = 1
        layouts.append(
            {
                "pixel_values": randn(batch, 1, tiles, channels, *size),
                "aspect_ratio_ids": ints([[1]] * batch),
                "aspect_ratio_mask": mask.to(device),
            }
        )
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if "image_sizes" in params and isinstance(pinpoints, list) and pinpoints:
        crops = _anyres_crops(size, pinpoints, size[0])
        pixels = randn(batch, crops, channels, *size)
        # sizes as plain ints first: the model picks its crop grid from their values, which
        # torch.export follows
        # only as constants (LLaVA-NeXT); as a tensor where the model needs one
        layouts += [
            {"pixel_values": pixels, "image_sizes": [list(size)] * batch},
            {"pixel_values": pixels, "image_sizes": ints([list(size)] * batch)},
        ]
    # a batch of images, then images per sample as a stack (Idefics takes (batch, images, C, H, W))
    image = randn(batch, channels, *size)
    return layouts + [{"pixel_values": image}, {"pixel_values": image.unsqueeze(1)}]


def features_per_image(model: nn.Module, layout: dict[str, Any], batch: int) -> int | None:
    """How many features ``get_image_features`` makes of each image of ``layout``; None if it does
    not run on it."""
    get = getattr(model, "get_image_features", None)
    params = inspect.signature(get).parameters
    extra = {
        n: getattr(model.config, n)
        for n in params
        if n.startswith("vision_feature") and getattr(model.config, n, None) is not None
    }
    try:
        with torch.no_grad():
            out = get(
                **{k: v for k, v in layout.items() if k in params or "kwargs" in params}, **extra
            )
    except Exception:  # noqa: BLE001 - not this layout (or more than pixels is needed)
        return None
    feats = (
        getattr(out, "pooler_output", None)
        if not isinstance(out, (torch.Tensor, list, tuple))
        else out
    )
    if isinstance(feats, (list, tuple)) and feats and isinstance(feats[0], torch.Tensor):
        return feats[0].shape[0] if feats[0].dim() == 2 else feats[0].shape[-2]
    if isinstance(feats, torch.Tensor) and feats.dim() >= 2:
        return feats.shape[-2] if feats.dim() == 3 else feats.shape[0] // batch
    return None


def image_text_options(
    model: nn.Module, layouts: list[dict[str, Any]], text: torch.Tensor, image_token: int
) -> list[dict[str, Any]]:
    """Each layout with text that starts with one placeholder token per image feature, the count
    from the model's own ``get_image_features``; a model without one (cross-attention to the
    image) keeps its text as it is."""
    if not callable(getattr(model, "get_image_features", None)):
        return [{**layout, "input_ids": text} for layout in layouts]
    options, forward = [], inspect.signature(model.forward).parameters
    for layout in layouts:
        per_image = features_per_image(model, layout, text.shape[0])
        if per_image is not None:
            marks = torch.full(
                (text.shape[0], int(per_image)), image_token, dtype=text.dtype, device=text.device
            )
            ids = torch.cat([marks, text], dim=1)
            # which tokens are image tokens (1) or text (0), as processors write it for multimodal
            # rotary positions
            types = (
                {"mm_token_type_ids": (ids == image_token).long()}
                if "mm_token_type_ids" in forward
                else {}
            )
            option = {**layout, "input_ids": ids, **types}
            options.append({**option, **_rope_positions(model, option)})
    return options


def _rope_positions(model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """Multimodal rotary positions, computed ahead as ``generate`` does, for a model whose
    ``get_rope_index`` derives them from the image grids: computed inside, they depend on the
    grids' values, which ``torch.export`` cannot follow (Qwen2-VL, Qwen3-VL)."""
    owner = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
    if owner is None or "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    params = inspect.signature(owner.get_rope_index).parameters
    try:
        with torch.no_grad():
            positions = owner.get_rope_index(**{k: v for k, v in inputs.items() if k in params})
    except Exception:  # noqa: BLE001 - the model computes them itself then
        return {}
    positions = positions[0] if isinstance(positions, (tuple, list)) else positions
    return {"position_ids": positions} if isinstance(positions, torch.Tensor) else {}
