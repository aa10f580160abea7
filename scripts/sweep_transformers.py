"""Sweep every model type registered in transformers through analyze, fold and a comparison.

For each model type: a tiny config (sub-configs shrunk too), one model class
(recorded), perturbed weights, inputs (enjoyln's own synthesis when the
forward runs on it; otherwise the sweep's explicit inputs, recorded), then
``enjoyln.analyze``, ``enjoyln.fold`` on a deep copy and a comparison of every
output on two batches against the unmodified model. ``analyze(model)`` with no
inputs is also run and recorded. Each architecture runs in its own forked
process with a time limit, two at a time.

    python scripts/sweep_transformers.py                  # all, to docs/data/sweep_results.json
    python scripts/sweep_transformers.py --only bert,gpt2 --out /tmp/s.json
    python scripts/sweep_transformers.py --write          # and the coverage block in
    docs/architectures.md python scripts/sweep_transformers.py --only olmo,sam --merge --write
        # re-sweep some types into the records already in --out, and write the docs block from all

Statuses: ``exact``; ``inexact`` (with a float64 triage); ``clean_error`` (an
EnjoylnError, its message); ``raw_error`` (any other exception, with where it
was raised); ``skipped`` (with the reason: no model class, no LayerNorm,
does not build, forward fails on every input we can make, too big, time limit).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import math
import multiprocessing as mp
import os
import re
import resource
import sys
import time
import traceback
import warnings
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Collection

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "docs" / "data"  # results are data, kept apart from the scripts
DEFAULT_OUT = DATA / "sweep_results.json"
BASELINE = DATA / "sweep_baseline.json"
RTOL = 1e-5
MAX_PARAMS = 60_000_000
BATCH, SEQ = 2, 16

# The class a user would fold, in order of preference; the first mapping that
# has the model type wins, and the result records which it was.
MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_CTC_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES",
    "MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES",
    "MODEL_FOR_BACKBONE_MAPPING_NAMES",
    "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
    "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
    "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES",
    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_TIME_SERIES_PREDICTION_MAPPING_NAMES",
)


# --- tiny configs ---------------------------------------------------------------------

LEVELS = (0, 1, 2, 3)
"""0: width 64 with 4 heads of 16; 1: width 128 with 2 heads of 64 (for rotary sections
that need wide heads); 2: only layers, vocabularies and experts cut; 3: the default config."""
LAYER_KEYS = {
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "depth",
    "decoder_depth",
    "encoder_depth",
    "decoder_num_hidden_layers",
    "num_text_layers",
    "num_vision_layers",
    "text_layers",
    "vision_layers",
    "num_stacks",
    "cross_layers",
}
WIDTH_KEYS = {
    "hidden_size",
    "d_model",
    "n_embd",
    "embed_dim",
    "dim",
    "decoder_hidden_size",
    "emb_dim",
    "encoder_hidden_size",
    "text_hidden_size",
    "vision_hidden_size",
    "d_embed",
}
HEAD_KEYS = {
    "num_attention_heads",
    "n_head",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "attention_heads",
    "n_heads",
    "decoder_num_attention_heads",
}
KV_KEYS = {"num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads"}
FFN_KEYS = {
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "n_inner",
    "mlp_dim",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_intermediate_size",
    "encoder_intermediate_size",
    "d_inner",
    "intermediate_dim",
}
SMALL = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "topk_group": 1,
    "n_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "embedding_size": 32,
    "projection_dim": 32,
    "max_source_positions": 32,
    "num_mel_bins": 16,
    "max_target_positions": 64,
    "num_frames": 4,
    "num_queries": 10,
    "codebook_size": 64,
    "image_size": 64,
    "d_kv": 16,
    "num_labels": 3,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "proj_dim": 32,
    "projection_size": 32,
    "latent_dim": 32,
    "num_latents": 8,
    "feature_size": 32,
    "xvector_output_dim": 32,
    "classifier_proj_size": 32,
    "hidden_dim": 64,
    "mlp_hidden_dim": 128,
    "rotary_dim": 8,
    "entity_vocab_size": 64,
    "hidden_size_per_layer_input": 16,
    "max_position_embeddings": 4096,
    "n_positions": 4096,
}
DEPTH_ONLY = {
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "entity_vocab_size",
    "vocab_size_per_layer_input",
    "prediction_length",
    "context_length",
    "attention_types",
    "layer_types",
    "max_position_embeddings",
    "n_positions",
}
LIST_LAYER_KEYS = {"depths", "num_layers", "stage_num_blocks", "stage_numb_of_layers", "num_blocks"}
LIST_HALF_KEYS = {
    "hidden_sizes",
    "embed_dims",
    "embed_dim",
    "conv_dim",
    "dims",
    "neck_hidden_sizes",
    "out_channels",
    "widths",
}
TOKEN_ID = re.compile(r"(_token_id|_token_index|_token_ids)$")


def _special_ids(cfg: Any, found: set[int] | None = None) -> set[int]:
    """Every token id a config names, in it and its sub-configs."""
    from transformers import PretrainedConfig

    found = set() if found is None else found
    for key, value in vars(cfg).items():
        if isinstance(value, PretrainedConfig):
            _special_ids(value, found)
        elif TOKEN_ID.search(key) or key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            values = value if isinstance(value, (list, tuple)) else [value]
            found |= {
                v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0
            }
    return found


def _is_int_list(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def shrink(cfg: Any, vocab: int, width: int, heads: int) -> dict[str, Any]:
    """Keyword overrides that make ``cfg`` small; sub-configs become dicts of their own
    overrides."""
    from transformers import PretrainedConfig

    kw: dict[str, Any] = {}
    attrs = {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
    n_heads = next((v for k, v in attrs.items() if k in HEAD_KEYS and isinstance(v, int)), None)
    head_dim = width // heads
    for key, value in attrs.items():
        if isinstance(value, PretrainedConfig):
            kw[key] = {"model_type": value.model_type, **shrink(value, vocab, width, heads)}
        elif isinstance(value, bool):
            continue
        elif value is None:
            if key == "vocab_size":  # ESM leaves it to the checkpoint
                kw[key] = vocab
            elif key == "prediction_length":  # time series models need it
                kw[key] = 4
            elif key == "pad_token_id" and attrs.get("vocab_size") is None:
                kw[key] = 1
        elif isinstance(value, int):
            if key in LAYER_KEYS and value > 2:
                kw[key] = 2
            elif key in WIDTH_KEYS and value > width:
                kw[key] = width
            elif key in HEAD_KEYS and value > heads:
                kw[key] = heads
            elif key in KV_KEYS:
                kw[key] = (
                    heads if n_heads is not None and value >= n_heads else min(value, 2, heads)
                )
            elif key in FFN_KEYS and value > 2 * width:
                kw[key] = 2 * width
            elif key == "head_dim" and "qk_rope_head_dim" in attrs:
                kw[key] = SMALL["qk_rope_head_dim"]  # DeepSeek's rotary width is its head_dim
            elif key == "head_dim" and value > head_dim:
                kw[key] = head_dim
            elif (
                key in ("vocab_size", "vocab_size_per_layer_input")
                and value != vocab
                and (value > vocab or key == "vocab_size" and value > 256)
            ):
                kw[key] = (
                    vocab  # big enough for every special token id (LLaVA's image token is 32000)
                )
            elif key == "upsample_groups" and value > width:  # Mimi: one group per channel
                kw[key] = width
            elif key == "rotary_dim" and value > head_dim:
                kw[key] = head_dim // 2
            elif key in SMALL and value > SMALL[key]:
                kw[key] = SMALL[key]
        elif _is_int_list(value):
            if key in LIST_LAYER_KEYS:
                kw[key] = [min(v, 1) for v in value]
            elif key in LIST_HALF_KEYS and max(value) > width:
                kw[key] = [max(8, v // 4) for v in value]
        elif key == "layer_types" and isinstance(value, (list, tuple)):
            n = kw.get("num_hidden_layers", attrs.get("num_hidden_layers"))
            if isinstance(n, int):
                kw[key] = list(value)[:n]
        elif (
            key == "attention_types" and isinstance(value, list) and value
        ):  # GPT-Neo: [[kinds, repeats]]
            kinds = value[0][0]
            kw[key] = [[kinds, max(1, 2 // len(kinds))]]
        elif (
            key in ("rope_parameters", "rope_scaling")
            and isinstance(value, dict)
            and (
                "mrope_section" in value
                or "mrope_section" in getattr(cfg, "ignore_keys_at_rope_validation", ())
            )
        ):
            # Qwen2-VL's multimodal rotary sections must add up to half a head (default 16+24+24)
            sections = value.get("mrope_section") or [16, 24, 24]
            kw[key] = {**value, "mrope_section": _scale_sections(sections, head_dim // 2)}
    return kw


def _scale_sections(sections: list[int], total: int) -> list[int]:
    """Split ``total`` in the proportions of ``sections`` (Qwen2-VL's rotary sections)."""
    out = [max(1, v * total // sum(sections)) for v in sections]
    out[0] += total - sum(out)
    return out


def tiny_config(model_type: str, level: int) -> Any:
    """A config of ``model_type`` at a size ``level`` (see ``LEVELS``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    if level >= 3:
        return default
    ids = _special_ids(default)
    vocab = max([512] + [i + 1 for i in ids if i < 400_000])
    kw = shrink(default, vocab, *((64, 4) if level == 0 else (128, 2)))
    if level == 2:
        kw = _only_depth(kw)
    return cls(**fit_towers(default, kw, vocab))


TEXT_WIDTH_KEYS = {"projection_dim", "out_hidden_size"}
"""A tower's output width that its language model's width must match (PaliGemma, Qwen3-VL)."""


def fit_towers(default: Any, kw: dict[str, Any], vocab: int) -> dict[str, Any]:
    """A shrunk vision-language config made consistent again: the tower's output as wide as the
    text, tapped layer indices within the shrunk depth, any-resolution grids in whole tiles, and
    an image token where the default leaves none (BLIP-2)."""
    vision, text = kw.get("vision_config"), kw.get("text_config")
    if not isinstance(vision, dict) or not isinstance(text, dict):
        return kw
    kw = {**kw, "vision_config": dict(vision)}
    vdefault = vars(default.vision_config)
    width = text.get("hidden_size")
    for cfg, base in ((kw, vars(default)), (kw["vision_config"], vdefault)):
        for key in TEXT_WIDTH_KEYS & base.keys():
            if isinstance(width, int) and isinstance(base[key], int):
                cfg[key] = width
        for key, value in base.items():  # layer indices (Mllama's taps, Qwen3-VL's DeepStack)
            if (key.endswith("_indices") or key.endswith("_indexes")) and _is_int_list(value):
                cfg[key] = list(range(min(len(value), 2)))
    depth, tdefault = text.get("num_hidden_layers"), vars(default.text_config)
    for key, value in tdefault.items():
        # the layers of a kind, by index, none within the shrunk depth (Mllama's cross-attention
        # layers, from 3): the last layer, or the image would reach no layer of the language model
        if key.endswith("_layers") and _is_int_list(value) and isinstance(depth, int):
            if min(value) >= depth:
                kw["text_config"] = {**kw["text_config"], key: [depth - 1]}
    indices = next((v for k, v in kw["vision_config"].items() if k.endswith("_indices")), None)
    if (
        "vision_output_dim" in vdefault and indices is not None
    ):  # Mllama: the last layer and each tap, side by side
        kw["vision_config"]["vision_output_dim"] = kw["vision_config"].get("hidden_size", 64) * (
            len(indices) + 1
        )
    size, tile = (
        vdefault.get("image_size"),
        kw["vision_config"].get("image_size", vdefault.get("image_size")),
    )
    pinpoints = getattr(default, "image_grid_pinpoints", None)
    if isinstance(pinpoints, list) and isinstance(size, int) and isinstance(tile, int):
        kw["image_grid_pinpoints"] = [
            [max(1, h // size) * tile, max(1, w // size) * tile] for h, w in pinpoints
        ]
    for key in ("image_token_index", "image_token_id"):
        if key in vars(default) and getattr(default, key) is None:
            kw[key] = vocab - 1
    return kw


def _only_depth(kw: dict[str, Any]) -> dict[str, Any]:
    keep = LAYER_KEYS | LIST_LAYER_KEYS | DEPTH_ONLY | {"vocab_size", "model_type"}
    out = {}
    for k, v in kw.items():
        if isinstance(v, dict) and k not in DEPTH_ONLY:
            out[k] = _only_depth(v)
        elif k in keep:
            out[k] = v
    return out


def pick_classes(model_type: str, first: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(mapping, class name) candidates for ``model_type``, the one a user would fold first.

    Encoder-decoders take their sequence-to-sequence class before a causal LM
    (``WhisperForCausalLM`` is only the decoder); encoders with a masked-LM
    head take the base model (``BertLMHeadModel`` runs BERT as a decoder).
    Any other mapping that names the type comes last; ``first`` (mapping names) goes before all.
    """
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    order = list(MAPPINGS)
    try:
        encoder_decoder = CONFIG_MAPPING[model_type]().is_encoder_decoder
    except Exception:  # noqa: BLE001 - a config that does not build reports it later
        encoder_decoder = False
    if encoder_decoder:
        order = [*MAPPINGS[1:3], MAPPINGS[0], *MAPPINGS[3:]]
    elif model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        order = [*MAPPINGS[3:], MAPPINGS[0]]
    order = [*first, *(n for n in order if n not in first)]
    order += sorted(
        n
        for n in dir(modeling_auto)
        if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES") and n not in order
    )
    out: list[tuple[str, str]] = []
    for mapping in order:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if name and name not in [n for _, n in out]:
            out.append((mapping.replace("_MAPPING_NAMES", ""), name))
    return out[:3]


def model_class(name: str) -> Any:
    import transformers

    return getattr(transformers, name)


# --- weights --------------------------------------------------------------------------


def perturb_all(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """enjoyln's perturbation, then norm gains 1 + 0.2·randn, biases 0.1·randn, noise on the
    rest."""
    from enjoyln.testing import perturb

    perturb(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen).to(t.dtype)

    done: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if "Norm" not in type(module).__name__:
                continue
            w, b = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(w, torch.nn.Parameter) and w.is_floating_point():
                w.copy_(1 + 0.2 * randn(w))
                done.add(id(w))
            if isinstance(b, torch.nn.Parameter) and b.is_floating_point():
                b.copy_(0.1 * randn(b))
                done.add(id(b))
        for p in model.parameters():
            if id(p) in done or not p.is_floating_point() or p.numel() == 0:
                continue
            spread = float(p.float().std()) if p.numel() > 1 else 0.0
            p.add_(randn(p) * max(0.02, 0.1 * spread))
    return model


# --- inputs ---------------------------------------------------------------------------


def _cfg(config: Any, *names: str) -> Any:
    from enjoyln.analysis.inputs import config_value

    return config_value(config, *names)


def _token_ids(config: Any, gen: torch.Generator, length: int) -> torch.Tensor:
    vocab = _cfg(config, "vocab_size") or 256
    special = _special_ids(config)
    high = min(int(vocab), 1000)
    ids = torch.randint(min(4, high - 1), high, (BATCH, length), generator=gen)
    safe = next(i for i in range(high - 1, -1, -1) if i not in special)
    for s in special:
        ids[ids == s] = safe
    return ids


def explicit_inputs(model: torch.nn.Module, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """Candidate inputs the sweep builds itself, by name of forward argument; tried in order."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    size = _cfg(config, "image_size", "img_size", "input_size") or 64
    size = tuple(size)[-2:] if isinstance(size, (list, tuple)) else (size, size)
    channels = _cfg(config, "num_channels", "in_channels", "input_channels", "in_chans") or 3
    frames = _cfg(config, "num_frames") or 4
    base: dict[str, Any] = {}
    if "input_ids" in params:
        base["input_ids"] = _token_ids(config, gen, SEQ)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        base["decoder_input_ids"] = _token_ids(config, gen, SEQ // 2)
    if "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        base["use_cache"] = False
    cands: list[tuple[str, dict[str, Any]]] = []
    randn = lambda *shape: torch.randn(shape, generator=gen).to(dtype)  # noqa: E731
    if "pixel_values" in params:
        cands.append(("image", {**base, "pixel_values": randn(BATCH, channels, *size)}))
        cands.append(("video", {**base, "pixel_values": randn(BATCH, frames, channels, *size)}))
        cands.append(("image 224", {**base, "pixel_values": randn(BATCH, channels, 224, 224)}))
        cands.append(("text only", dict(base)))
    if "pixel_values_videos" in params:
        cands.append(
            ("video", {**base, "pixel_values_videos": randn(BATCH, frames, channels, *size)})
        )
    if "input_values" in params:
        cands.append(("waveform", {**base, "input_values": randn(BATCH, 4000)}))
        cands.append(("waveform 1ch", {**base, "input_values": randn(BATCH, 1, 4000)}))
        cands.append(("waveform 16k", {**base, "input_values": randn(BATCH, 16000)}))
    if "input_features" in params:
        mels = (
            _cfg(
                config,
                "num_mel_bins",
                "feature_size",
                "input_feat_per_channel",
                "n_mels",
                "feature_projection_input_dim",
                "input_dim",
            )
            or 80
        )
        src = _cfg(config, "max_source_positions") or 32
        cands.append(
            ("features (mel, frames)", {**base, "input_features": randn(BATCH, mels, 2 * src)})
        )
        cands.append(
            ("features (frames, mel)", {**base, "input_features": randn(BATCH, 2 * src, mels)})
        )
        cands.append(("features 3000", {**base, "input_features": randn(BATCH, mels, 3000)}))
    if "past_values" in params:
        ctx = (_cfg(config, "context_length") or 32) + max(_cfg(config, "lags_sequence") or [0])
        chans = _cfg(config, "num_input_channels", "input_size") or 1
        cands.append(("time series", {**base, "past_values": randn(BATCH, ctx, chans)}))
        cands.append(("time series 1d", {**base, "past_values": randn(BATCH, ctx)}))
    if base or not cands:
        cands.append(("tokens", dict(base)))
    return cands


def _forward(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    with torch.no_grad():
        return model(**inputs)


class _CountNorms(torch.overrides.TorchFunctionMode):
    NAMES = {"layer_norm", "group_norm", "instance_norm"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.count += 1
        return func(*args, **(kwargs or {}))


# --- outcome helpers ------------------------------------------------------------------


def _where(exc: BaseException) -> dict[str, str]:
    frames = traceback.extract_tb(exc.__traceback__)
    out = {}
    if frames:
        f = frames[-1]
        out["raised_at"] = f"{_short(f.filename)}:{f.lineno}"
    ours = [f for f in frames if "/enjoyln/" in f.filename]
    if ours:
        out["enjoyln_frame"] = f"{_short(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})"
    return out


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/enjoyln/", "/scripts/"):
        if marker in path:
            head = marker.strip("/") if marker != "/site-packages/" else ""
            return (head + "/" if head else "") + path.split(marker, 1)[1]
    return path


def _first_line(exc: BaseException) -> str:
    return ((str(exc).strip().splitlines() or [""])[0])[:300]


def classify(exc: BaseException, stage: str) -> dict[str, Any]:
    from enjoyln.errors import EnjoylnError

    if isinstance(exc, EnjoylnError):
        return {"status": "clean_error", "stage": stage, "message": _first_line(exc)}
    return {
        "status": "raw_error",
        "stage": stage,
        "type": type(exc).__name__,
        "message": _first_line(exc),
        **_where(exc),
    }


_PATH = re.compile(r"\b(in) (?!training mode|the |a |an |\d+ groups)[A-Za-z_][\w.]*")


def normalize_reason(reason: str, norms: list[str] = ()) -> str:
    """A refusal reason without module paths, parameter names and numbers, to count across models.

    ``norms`` are the plan's entry names, which the reasons name as they are.
    """
    r = reason.split("; ")[0]
    for name in sorted(norms, key=len, reverse=True):
        r = re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w.])", "a LayerNorm", r)
    m = re.match(r"folding it needs .* centered, but that would also change (.*)", r)
    if m:
        r = "folding it needs a centering that would also change " + m.group(1)
    r = re.sub(r"`[^`]*`", "`x`", r)
    r = re.sub(
        r"\bthe (parameters of the |parameter |scalar parameter |constant |LayerNorm )[\w.]+",
        lambda mm: f"the {mm.group(1)}X",
        r,
    )
    r = re.sub(r"\bthe functional layer_norm", "the functional layer_norm", r)
    r = _PATH.sub(lambda mm: f"{mm.group(1)} M", r)
    r = re.sub(r"\b(it is a functional layer_norm call) in M\b", r"\1", r)
    r = re.sub(r"\b\d+(\.\d+)?\b", "N", r)
    r = re.sub(r"-?\d+\.\d+(e-?\d+)?", "N", r)
    return r


# --- one architecture -----------------------------------------------------------------


def prepare(
    model_type: str, first: tuple[str, ...] = ()
) -> tuple[torch.nn.Module | None, dict[str, Any]]:
    """The first class and config level whose model builds, fits and runs forward on some inputs.

    Returns the perturbed model (or None) and what was found: class, level,
    parameters, the inputs' source and names, and the number of norm calls.
    """
    info: dict[str, Any] = {"model_type": model_type}
    classes = pick_classes(model_type, first)
    if not classes:
        return None, {**info, "status": "skipped", "reason": "no model class in the auto mappings"}
    tried: list[str] = []
    for mapping, name in classes:
        try:
            cls = model_class(name)
        except Exception as exc:  # noqa: BLE001 - a missing optional dependency
            tried.append(f"{name}: not importable: {_first_line(exc)[:100]}")
            continue
        for level in LEVELS:
            model, why = _build(model_type, cls, level)
            if model is None:
                tried.append(f"{name} level {level}: {why}")
                continue
            perturb_all(model)
            source, inputs, norms = find_inputs(model)
            if source is None:
                tried.append(f"{name} level {level}: forward fails: {inputs}")
                continue
            info.update(
                {
                    "mapping": mapping,
                    "class": name,
                    "config_level": level,
                    "params": sum(p.numel() for p in model.parameters()),
                    "forward_runs": True,
                    "inputs": source,
                    "input_names": sorted(inputs),
                    "norm_calls": norms,
                }
            )
            info["_inputs"] = inputs
            return model, info
    kinds = (
        [t for t in tried if "forward fails" in t] or [t for t in tried if "too big" in t] or tried
    )
    head = (
        "forward fails on every input tried"
        if "forward fails" in kinds[0]
        else "too big"
        if "too big" in kinds[0]
        else "does not build"
    )
    return None, {
        **info,
        "class": classes[0][1],
        "status": "skipped",
        "reason": f"{head}: {kinds[0]}",
        "attempts": tried,
    }


def _build(model_type: str, cls: Any, level: int) -> tuple[torch.nn.Module | None, str]:
    try:
        config = tiny_config(model_type, level)
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(config).parameters())
        if n > MAX_PARAMS:
            return None, f"too big: {n / 1e6:.0f}M parameters"
        torch.manual_seed(0)
        return cls(config).eval(), ""
    except Exception as exc:  # noqa: BLE001 - the sweep's config guess, not enjoyln
        return None, f"{type(exc).__name__}: {_first_line(exc)[:150]}"


def find_inputs(model: torch.nn.Module) -> tuple[str, dict[str, Any], int] | tuple[None, str, int]:
    """(source, inputs, norm calls): enjoyln's synthesis if the forward runs on it, else explicit
    ones."""
    from enjoyln.analysis.inputs import hf_example_inputs

    errors = []
    cands: list[tuple[str, Any]] = []
    try:
        cands.append(("enjoyln", hf_example_inputs(model, batch=BATCH, seq_len=SEQ, seed=0)))
    except Exception as exc:  # noqa: BLE001 - recorded; the sweep tries its own inputs next
        errors.append(f"enjoyln: {_first_line(exc)[:150]}")
    cands += [(f"explicit: {name}", inputs) for name, inputs in explicit_inputs(model)]
    for source, inputs in cands:
        counter = _CountNorms()
        try:
            with counter:
                _forward(model, inputs)
        except Exception as exc:  # noqa: BLE001 - try the next candidate
            errors.append(f"{source}: {type(exc).__name__}: {_first_line(exc)[:100]}")
            continue
        return source, inputs, counter.count
    return None, "; ".join(errors), 0


def second_batch(model: torch.nn.Module, source: str, inputs: dict[str, Any]) -> dict[str, Any]:
    from enjoyln.analysis.inputs import hf_example_inputs

    if source == "enjoyln":
        return hf_example_inputs(model, batch=BATCH, seq_len=SEQ, seed=1)
    name = source.split(": ", 1)[1]
    return dict(explicit_inputs(model, seed=1))[name]


def compare(
    reference: torch.nn.Module,
    folded: torch.nn.Module,
    batches: list[dict[str, Any]],
    skip: Collection[str] = (),
) -> dict[str, Any]:
    """Worst relative difference over every output and batch but ``skip`` (those a plan changes by
    design); outputs that differ between two runs of the reference itself (sampled noise) are
    left out and counted."""
    from enjoyln.checking.running import flatten_outputs

    worst, nondet, n = 0.0, set(), 0
    for inputs in batches:
        ref = flatten_outputs(_forward(reference, inputs))
        again = flatten_outputs(_forward(reference, inputs))
        cand = flatten_outputs(_forward(folded, inputs))
        for name, r in ref.items():
            if name in skip:
                continue
            if not torch.equal(r, again[name]):
                nondet.add(name)
                continue
            c = cand.get(name)
            if c is None or c.shape != r.shape:
                return {"max_rel": math.inf, "outputs": len(ref), "mismatch": name}
            n += 1
            if not r.is_floating_point():
                worst = max(worst, 0.0 if torch.equal(r, c) else math.inf)
                continue
            rd, cd = r.double(), c.double()
            finite = torch.isfinite(rd)
            if not finite.all():  # -inf masks and the like must match exactly
                if not torch.equal(rd[~finite], cd[~finite]):
                    worst = math.inf
                rd, cd = rd[finite], cd[finite]
            scale = float(rd.abs().max()) if rd.numel() else 0.0
            diff = float((rd - cd).abs().max()) if rd.numel() else 0.0
            worst = max(worst, diff / scale if scale else (0.0 if diff == 0 else math.inf))
    return {"max_rel": worst, "outputs": n, "nondeterministic_outputs": sorted(nondet)}


def float64_triage(
    model: torch.nn.Module, plan: Any, batches: list[dict[str, Any]]
) -> dict[str, Any]:
    """Redo the fold in float64: exact there means the float32 difference is rounding."""
    import enjoyln
    from enjoyln.checking.running import flatten_outputs

    def dbl(inputs: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs.items()
        }

    ref64 = copy.deepcopy(model).double()
    fold64 = enjoyln.fold(copy.deepcopy(model).double(), plan=plan)
    rel64 = compare(ref64, fold64, [dbl(b) for b in batches], skip=plan.changed_outputs)["max_rel"]
    # the original's own float32 rounding, against its float64 self
    own = 0.0
    for inputs in batches:
        r32 = flatten_outputs(_forward(model, inputs))
        r64 = flatten_outputs(_forward(ref64, dbl(inputs)))
        for name, a in r32.items():
            if a.is_floating_point() and name in r64 and r64[name].shape == a.shape:
                b = r64[name]
                scale = float(b.abs().max()) or 1.0
                own = max(own, float((a.double() - b).abs().max()) / scale)
    return {
        "max_rel_float64": rel64,
        "original_float32_rounding": own,
        "rounding": bool(rel64 <= 1e-10),
    }


def run_one(model_type: str, first: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything the sweep records about one model type; ``first``: the mappings whose class it
    prefers."""
    import enjoyln

    start = time.perf_counter()
    warnings.filterwarnings("ignore")
    model, info = prepare(model_type, first)
    if model is None:
        return info
    info["towers"] = tower_paths(model)
    source, inputs = info["inputs"], info.pop("_inputs")
    if info["norm_calls"] == 0:
        return {**info, "status": "skipped", "reason": "no LayerNorm or GroupNorm in the forward"}

    plan = None
    try:
        plan = enjoyln.analyze(model)
        info["no_input"] = {"ok": True}
        if source != "enjoyln":  # analyze found inputs that our forward check did not
            source, inputs = "enjoyln", None
    except Exception as exc:  # noqa: BLE001 - recorded
        info["no_input"] = {"ok": False, **classify(exc, "analyze(model)")}
        if source == "enjoyln":  # the same inputs again would fail the same way
            return {
                **info,
                **{k: v for k, v in info["no_input"].items() if k != "ok"},
                "seconds": _since(start),
            }
    try:
        if plan is None:
            plan = enjoyln.analyze(model, inputs)
        if source == "enjoyln":
            from enjoyln.analysis.inputs import hf_example_inputs

            batches = [hf_example_inputs(model, batch=BATCH, seq_len=SEQ, seed=s) for s in (0, 1)]
            info["inputs"] = "enjoyln"
        else:
            batches = [inputs, second_batch(model, source, inputs)]
        info["ln_entries"] = len(plan.layer_norms)
        info["folded"] = len(plan.foldable)
        info["folded_names"] = [e.name for e in plan.foldable]
        info["refused"] = {e.name: e.reason for e in plan.layer_norms if not e.foldable}
        refusals: dict[str, int] = {}
        for e in plan.layer_norms:
            if not e.foldable:
                key = normalize_reason(e.reason, [n.name for n in plan.layer_norms])
                refusals[key] = refusals.get(key, 0) + 1
        info["refusals"] = refusals
        info["notes"] = list(plan.notes)
        stage = "fold"
        folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
        stage = "compare"
        # the outputs the model does not serve that the plan changes (a tower's hidden states)
        info["changed_outputs"] = list(plan.changed_outputs)
        result = compare(model, folded, batches, skip=plan.changed_outputs)
    except Exception as exc:  # noqa: BLE001 - recorded
        return {**info, **classify(exc, locals().get("stage", "analyze")), "seconds": _since(start)}
    info.update(result)
    if result["max_rel"] <= RTOL:
        info["status"] = "exact"
    else:
        info["status"] = "inexact"
        try:
            info["float64"] = float64_triage(model, plan, batches)
        except Exception as exc:  # noqa: BLE001 - recorded
            info["float64"] = {"error": f"{type(exc).__name__}: {_first_line(exc)}"}
    info["seconds"] = _since(start)
    return info


def tower_paths(model: torch.nn.Module) -> list[str]:
    """Where the model's vision and audio towers are: the submodules built from a vision or audio
    sub-config."""
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    subs = [
        v
        for k, v in vars(config).items()
        if isinstance(v, PretrainedConfig) and ("vision" in k or "audio" in k)
    ]
    found = [
        name
        for name, m in model.named_modules()
        if name and any(getattr(m, "config", None) is c for c in subs)
    ]
    return [n for n in found if not any(n.startswith(o + ".") for o in found)]


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 2)


# --- the pool -------------------------------------------------------------------------


def _child(model_type: str, conn: Any, quiet: bool, run: Any = run_one) -> None:
    torch.set_num_threads(1)
    if quiet:  # torch.export prints whole graphs when it fails
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = run(model_type)
    except BaseException as exc:  # noqa: BLE001 - anything the sweep itself did not foresee
        result = {"model_type": model_type, **classify(exc, "sweep"), "status": "raw_error"}
    usage = resource.getrusage(resource.RUSAGE_SELF)  # a forked child starts from zero
    result["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 2)
    conn.send(json.loads(json.dumps(result, default=str)))
    conn.close()
    os._exit(0)  # skip the interpreter's teardown of a large heap


def _warm_up() -> None:
    """Import the modeling and export stacks once, so that each forked worker starts warm."""
    import enjoyln
    from enjoyln.testing import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enjoyln.analyze(tiny_model("gpt2"))


def sweep(
    model_types: list[str],
    *,
    jobs: int = 2,
    timeout: float = 60.0,
    progress: bool = True,
    quiet: bool = True,
    log: Any = None,
    run: Any = run_one,
) -> dict[str, dict[str, Any]]:
    """Run every model type in a forked process, ``jobs`` at a time; each result is also
    written to ``log`` (a text file) as one JSON line as it arrives."""
    import transformers

    transformers.logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _warm_up()
        return _run_pool(model_types, jobs, timeout, progress, quiet, log, run)
    finally:
        torch.set_num_threads(threads)


def _run_pool(
    model_types: list[str],
    jobs: int,
    timeout: float,
    progress: bool,
    quiet: bool,
    log: Any,
    run: Any = run_one,
) -> dict[str, dict[str, Any]]:
    ctx = mp.get_context("fork")
    pending, running, results = list(model_types), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            t = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(t, send, quiet, run), daemon=True)
            proc.start()
            send.close()
            running[t] = (proc, recv, time.perf_counter())
        wait([r for _, r, _ in running.values()], timeout=1.0)
        for t, (proc, recv, started) in list(running.items()):
            elapsed = time.perf_counter() - started
            if recv.poll():
                try:
                    results[t] = recv.recv()
                except EOFError:
                    proc.join()
                    results[t] = {
                        "model_type": t,
                        "status": "raw_error",
                        "stage": "sweep",
                        "type": "crash",
                        "message": f"worker exited with code {proc.exitcode}",
                    }
            elif not proc.is_alive():
                results[t] = {
                    "model_type": t,
                    "status": "raw_error",
                    "stage": "sweep",
                    "type": "crash",
                    "message": f"worker exited with code {proc.exitcode}",
                }
            elif elapsed > timeout:
                proc.kill()
                results[t] = {
                    "model_type": t,
                    "status": "skipped",
                    "reason": f"time limit: more than {timeout:.0f} s",
                }
            else:
                continue
            proc.join()
            recv.close()
            del running[t]
            results[t].setdefault("seconds", round(elapsed, 2))
            if log is not None:
                log.write(json.dumps(results[t]) + "\n")
                log.flush()
            if progress:
                r = results[t]
                detail = (
                    r.get("reason")
                    or r.get("message")
                    or f"{r.get('folded')}/{r.get('ln_entries')}"
                )
                print(
                    f"[{len(results)}/{len(model_types)}] {t}: {r['status']} ({detail})"[:200],
                    flush=True,
                )
    return {t: results[t] for t in model_types}


# --- summary and the docs block -----------------------------------------------------------


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rs = list(results.values())
    status = {
        s: sum(r["status"] == s for r in rs)
        for s in ("exact", "inexact", "clean_error", "raw_error", "skipped")
    }
    runs = [r for r in rs if r.get("forward_runs") and r.get("norm_calls")]
    no_input = sum(bool(r.get("no_input", {}).get("ok")) for r in runs)
    reasons: dict[str, list[int]] = {}
    for r in rs:
        for reason, n in (r.get("refusals") or {}).items():
            entry = reasons.setdefault(reason, [0, 0])
            entry[0] += 1
            entry[1] += n
    inexact_rounding = sum(
        r["status"] == "inexact" and r.get("float64", {}).get("rounding", False) for r in rs
    )
    skipped: dict[str, int] = {}
    for r in rs:
        if r["status"] == "skipped":
            key = r["reason"].split(":")[0]
            skipped[key] = skipped.get(key, 0) + 1
    return {
        "model_types": len(rs),
        "cpu_seconds": round(sum(r.get("cpu_seconds", r.get("seconds", 0.0)) for r in rs)),
        "tried": sum(r["status"] != "skipped" for r in rs),
        **status,
        "inexact_float64_rounding": inexact_rounding,
        "ln_entries": sum(r.get("ln_entries", 0) for r in rs),
        "folded": sum(r.get("folded", 0) for r in rs),
        "forward_runs": len(runs),
        "no_input_ok": no_input,
        "no_input_pct": round(100 * no_input / len(runs), 1) if runs else 0.0,
        "skipped_reasons": dict(sorted(skipped.items(), key=lambda kv: -kv[1])),
        "refusals": {
            k: {"architectures": v[0], "entries": v[1]}
            for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))
        },
    }


def print_summary(s: dict[str, Any], wall: float | None = None) -> None:
    print(
        f"\n{s['model_types']} model types; {s['tried']} tried: {s['exact']} exact, {s['inexact']} "
        "inexact "
        f"({s['inexact_float64_rounding']} float32 rounding by the float64 triage), "
        f"{s['clean_error']} clean errors, {s['raw_error']} raw errors; {s['skipped']} skipped"
    )
    print(f"folded LNs: {s['folded']} of {s['ln_entries']} LN entries")
    print(
        f"analyze(model) without inputs: {s['no_input_ok']} of {s['forward_runs']} "
        f"({s['no_input_pct']}%) architectures whose forward runs"
    )
    print("skipped:", ", ".join(f"{k} {v}" for k, v in s["skipped_reasons"].items()))
    print("top refusal reasons (architectures, LN entries):")
    for reason, c in list(s["refusals"].items())[:15]:
        print(f"  {c['architectures']:4d} {c['entries']:5d}  {reason}")
    if wall is not None:
        print(f"wall time {wall:.0f} s; CPU time in the workers {s['cpu_seconds']} s")


def readme_section(s: dict[str, Any], meta: dict[str, Any], base: dict[str, Any] | None) -> str:
    """The coverage block in docs/architectures.md: this sweep beside the baseline (the same sweep
    of enjoyln before the long-tail rules, `docs/data/sweep_baseline.json`)."""
    b = base["summary"] if base else None

    def row(label: str, fmt: Any) -> str:
        return f"| {label} | {fmt(b) if b else '-'} | {fmt(s)} |"

    def skipped(x: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in x["skipped_reasons"].items())

    before = f"before (`{base['meta'].get('enjoyln_commit', '?')}`)" if base else "before"
    lines = [
        f"Every model type registered in transformers {meta['transformers']} ({s['model_types']}): "
        "tiny "
        f"configs, perturbed weights, every output on two batches. {meta['machine']}; "
        f"{meta['jobs']} workers, {meta['wall_seconds'] / 60:.0f} min wall "
        f"({s['cpu_seconds'] / 60:.0f} min of CPU time in the workers).",
        *[
            f"Re-swept since, with enjoyln `{r['enjoyln_commit']}` and transformers "
            f"{r['transformers']} "
            f"({r['wall_seconds'] / 60:.0f} min wall): {', '.join(r['model_types'])}."
            for r in meta.get("resweeps", [])
        ],
        "",
        f"| | {before} | now |",
        "|---|---|---|",
        row(
            "architectures tried (forward runs, has a LayerNorm or GroupNorm)", lambda x: x["tried"]
        ),
        row("exact", lambda x: x["exact"]),
        row(
            "inexact in float32 (of which exact in float64: the original's own rounding)",
            lambda x: f"{x['inexact']} ({x['inexact_float64_rounding']})",
        ),
        row("clean errors (`EnjoylnError`)", lambda x: x["clean_error"]),
        row("raw exceptions", lambda x: x["raw_error"]),
        row("**folded LNs** / LN entries", lambda x: f"**{x['folded']}** / {x['ln_entries']}"),
        row(
            "`analyze(model)` without inputs",
            lambda x: f"{x['no_input_ok']} of {x['forward_runs']} ({x['no_input_pct']}%)",
        ),
        "",
        f"Skipped now: {skipped(s)}.",
        "",
        "Refusal reasons now, with module paths, names and numbers taken out:",
        "",
        "| refusal reason | architectures | LN entries |",
        "|---|---|---|",
    ]
    for reason, c in list(s["refusals"].items())[:15]:
        lines.append(f"| {reason.replace('|', '/')} | {c['architectures']} | {c['entries']} |")
    lines += [
        "",
        "Command: `python scripts/sweep_transformers.py --write` (per-architecture records in "
        "`docs/data/sweep_results.json`, the run before in `docs/data/sweep_baseline.json`)"
        + (
            "; a re-sweep of some types: `python scripts/sweep_transformers.py --only TYPES "
            "--merge --write`."
            if meta.get("resweeps")
            else "."
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument(
        "--write", action="store_true", help="write the coverage block in docs/architectures.md"
    )
    ap.add_argument(
        "--enjoyln-commit", help="the enjoyln version swept, when it is not a git checkout"
    )
    ap.add_argument(
        "--from-results",
        action="store_true",
        help="do not sweep: summarise --out again (and --write docs/architectures.md from it)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="with --only: replace those types' records in --out, keep the others, and "
        "summarise them all (the meta lists what was re-swept, when and with what)",
    )
    args = ap.parse_args(argv)
    if args.merge and (not args.only or not args.out.exists()):
        raise SystemExit("--merge needs --only and an existing --out to merge into")

    import subprocess

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    import enjoyln

    if args.from_results:
        saved = json.loads(args.out.read_text())
        print_summary(saved["summary"])
        if args.write:
            write_readme(saved["summary"], saved["meta"])
        return 0
    types = args.only.split(",") if args.only else list(CONFIG_MAPPING_NAMES)
    unknown = [t for t in types if t not in CONFIG_MAPPING_NAMES]
    if unknown:
        raise SystemExit(f"unknown model types: {', '.join(unknown)}")
    start = time.perf_counter()
    with open(args.out.with_suffix(".jsonl"), "w") as log:
        results = sweep(types, jobs=args.jobs, timeout=args.timeout, log=log)
    wall = time.perf_counter() - start
    root = Path(enjoyln.__file__).resolve().parent.parent
    commit = (
        args.enjoyln_commit
        or subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    sys.path.insert(0, str(HERE))
    from _docs import machine

    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "enjoyln_commit": commit,
        "enjoyln_path": str(root),
        "machine": machine(),
        "jobs": args.jobs,
        "timeout": args.timeout,
        "wall_seconds": round(wall, 1),
    }
    if args.merge:
        saved = json.loads(args.out.read_text())
        before = {t: (saved["results"].get(t) or {}).get("folded", 0) for t in types}
        resweep = {**meta, "model_types": types}
        meta = {**saved["meta"], "resweeps": [*saved["meta"].get("resweeps", []), resweep]}
        results = {**saved["results"], **results}
        for t in types:
            now = results[t].get("folded", 0)
            if now != before[t]:
                print(f"{t}: folded {before[t]} -> {now}")
    summary = summarize(results)
    args.out.write_text(
        json.dumps({"meta": meta, "summary": summary, "results": results}, indent=1) + "\n"
    )
    print_summary(summary, wall)
    if args.write:
        write_readme(summary, meta)
    return 0


def write_readme(summary: dict[str, Any], meta: dict[str, Any]) -> None:
    sys.path.insert(0, str(HERE))
    from _docs import replace_section

    base = json.loads(BASELINE.read_text()) if BASELINE.exists() else None
    replace_section("sweep", readme_section(summary, meta, base))


if __name__ == "__main__":
    sys.exit(main())
