"""Example inputs: what a user passes, or what enjoyln synthesizes from a model's configuration (a
Hugging Face config, or the sizes timm and open_clip record on the model); docs/how-it-works.md."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..errors import CaptureError
from .multimodal import image_layouts, image_text_options, int_pair

ExampleInputs = Any
"""A tensor, a tuple of positional arguments, or a dict of keyword arguments."""


@dataclass
class Inputs:
    """Positional and keyword arguments for one call of the model."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def call(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)


def as_inputs(example_inputs: ExampleInputs) -> Inputs:
    """Normalise what a user passes as example inputs."""
    if isinstance(example_inputs, Inputs):
        return example_inputs
    if isinstance(example_inputs, torch.Tensor):
        return Inputs((example_inputs,), {})
    if isinstance(example_inputs, Mapping):
        return Inputs((), dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return Inputs(tuple(example_inputs), {})
    raise CaptureError(
        f"example_inputs must be a tensor, a tuple of tensors or a dict of keyword arguments, "
        f"not {type(example_inputs).__name__}"
    )


# --- reading a Hugging Face config ----------------------------------------------------

_SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def config_value(config: Any, *names: str) -> Any:
    """The first of ``names`` set on ``config`` or one of its sub-configs."""
    for cfg in (config, *(getattr(config, s, None) for s in _SUBCONFIGS)):
        if cfg is None:
            continue
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return None


def is_hf_model(model: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only model that can ``generate()``."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate and can_generate())


def wants_no_cache(model: nn.Module) -> bool:
    """Does ``forward`` take ``use_cache``, by name or through ``**kwargs`` of a caching config?
    Such a model returns a cache object without ``use_cache=False``, which ``torch.export``
    cannot return."""
    params = inspect.signature(model.forward).parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return "use_cache" in params or (
        var_kw and config_value(getattr(model, "config", None), "use_cache") is not None
    )


# --- synthesis ------------------------------------------------------------------------

_KEPT_TOKENS = {
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "unk_token_id",
}


def placeholder_ids(config: Any) -> set[int]:
    """Token ids that stand for an image, a video or audio: random text must not contain them."""
    found: set[int] = set()
    for cfg in (config, *(getattr(config, s, None) for s in _SUBCONFIGS)):
        for key, value in vars(cfg).items() if cfg is not None else ():
            if key in _KEPT_TOKENS or not (
                key.endswith("_token_id") or key.endswith("_token_index")
            ):
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                found.add(value)
    return found


def fill_text_ids(config: Any, ids: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``ids`` with its text positions filled in order from ``fill``, as far as it goes; the image's
    placeholder tokens stay where they are, as many as the image has features."""
    marks = placeholder_ids(config)
    flat = ids.reshape(-1).clone()
    text = (
        ~torch.isin(flat, torch.tensor(sorted(marks), device=flat.device))
        if marks
        else torch.ones_like(flat, dtype=torch.bool)
    )
    where = text.nonzero().squeeze(1)[: len(fill)]
    flat[where] = fill[: len(where)].to(flat)
    return flat.view(ids.shape)


def _audio_length(config: Any, frames: int) -> int:
    """Samples a convolutional feature encoder turns into ``frames`` frames (wav2vec2: 320 per
    frame)."""
    kernels, strides = config_value(config, "conv_kernel"), config_value(config, "conv_stride")
    if (
        isinstance(kernels, (list, tuple))
        and isinstance(strides, (list, tuple))
        and len(kernels) == len(strides)
    ):
        length = frames
        for k, s in zip(reversed(kernels), reversed(strides)):
            length = (length - 1) * s + k
        return length
    rate = config_value(config, "sampling_rate")
    return int(rate) // 4 if isinstance(rate, int) and rate > 0 else 4000


def _image_size(config: Any) -> tuple[int, int]:
    # 224: what image processors produce when the config does not say (CvT, GLPN)
    return int_pair(config_value(config, "image_size", "img_size", "input_size")) or (224, 224)


def _candidates(model: nn.Module, batch: int, seq_len: int, seed: int) -> list[dict[str, Any]]:
    """Possible keyword inputs, the most likely first; the same random draws for each."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    gen = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # a model dispatched by accelerate keeps offloaded parameters on meta but runs on the CPU
    target = (
        torch.device("cpu")
        if getattr(model, "hf_device_map", None)
        else next((p.device for p in model.parameters()), torch.device("cpu"))
    )
    # a meta model's inputs are made on the CPU, where code that reads their values can run, and
    # moved to meta at the end
    device = torch.device("cpu") if target.type == "meta" else target
    max_pos = config_value(config, "max_position_embeddings", "n_positions", "max_target_positions")
    seq = min(seq_len, max_pos) if isinstance(max_pos, int) and max_pos > 0 else seq_len
    vocab = config_value(config, "vocab_size")
    placeholders = placeholder_ids(config)

    def ids(length: int) -> torch.Tensor:
        high = int(vocab) if vocab else 256  # no vocabulary: characters or bytes (CANINE)
        out = torch.randint(0, high, (batch, length), generator=gen)
        if placeholders:
            plain = next(i for i in range(high) if i not in placeholders)
            out[torch.isin(out, torch.tensor(sorted(placeholders)))] = plain
        return out.to(device)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device, dtype)

    text: dict[str, Any] = {}
    if "input_ids" in params and (vocab or main == "input_ids"):
        text["input_ids"] = ids(seq)
    options: list[dict[str, Any]] = []
    image_token = config_value(config, "image_token_id", "image_token_index")
    if (
        "pixel_values" in params
        and text
        and isinstance(image_token, int)
        and hasattr(config, "vision_config")
    ):
        # a vision-language model: an image in every sample, the text holding its placeholder tokens
        with _evaluating(model), _on_cpu(model) if device != target else contextlib.nullcontext():
            options += image_text_options(
                model, image_layouts(model, randn, batch, device), text["input_ids"], image_token
            )
        options.append({})  # else the text alone
    elif "pixel_values" in params and (
        main == "pixel_values" or config_value(config, "image_size")
    ):
        options += _pixel_options(config, randn, batch)
    if "pixel_values_videos" in params and main == "pixel_values_videos":
        frames = config_value(config, "frames_per_clip", "num_frames") or 4
        size, channels = _image_size(config), config_value(config, "num_channels") or 3
        options.append({"pixel_values_videos": randn(batch, frames, channels, *size)})
    if "input_values" in params and main == "input_values":
        options += _waveform_options(config, randn, batch, seq_len)
    if "input_features" in params and (
        main == "input_features" or config_value(config, "num_mel_bins")
    ):
        options += _feature_options(config, randn, batch)
    if "past_values" in params and main == "past_values":
        options += _series_options(config, params, randn, batch)
    tail: dict[str, Any] = {}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        dec_max = config_value(config, "max_target_positions") or seq
        tail["decoder_input_ids"] = ids(min(seq, dec_max))
    extra = {"use_cache": False} if wants_no_cache(model) else {}
    cands = [{**c, **extra} for c in ({**text, **o, **tail} for o in (options or [{}])) if c]
    return [{k: _moved(v, target) for k, v in c.items()} for c in cands]


def _moved(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _pixel_options(config: Any, randn: Any, batch: int) -> list[dict[str, Any]]:
    size, channels = _image_size(config), config_value(config, "num_channels", "in_channels") or 3
    frames = config_value(config, "num_frames")
    image = randn(batch, channels, *size)
    if isinstance(frames, int) and frames > 0:  # video: (batch, frames, channels, height, width)
        return [{"pixel_values": randn(batch, frames, channels, *size)}, {"pixel_values": image}]
    # an image, then one image per sample as a stack (Idefics takes (batch, images, C, H, W))
    return [{"pixel_values": image}, {"pixel_values": image.unsqueeze(1)}]


def _waveform_options(config: Any, randn: Any, batch: int, frames: int) -> list[dict[str, Any]]:
    mels, max_len = config_value(config, "num_mel_bins"), config_value(config, "max_length")
    if mels and max_len and not config_value(config, "conv_stride"):  # a spectrogram (AST)
        return [{"input_values": randn(batch, int(max_len), int(mels))}]
    wave = randn(batch, _audio_length(config, frames))
    channels = config_value(config, "audio_channels", "channels")
    mono = {"input_values": wave.unsqueeze(1)}
    if isinstance(channels, int) and channels > 1:
        return [{"input_values": wave.unsqueeze(1).expand(-1, channels, -1).contiguous()}, mono]
    return [{"input_values": wave}, mono]


def _feature_options(config: Any, randn: Any, batch: int) -> list[dict[str, Any]]:
    src = config_value(config, "max_source_positions")
    mels = config_value(config, "num_mel_bins")
    if mels and src:  # Whisper: (batch, mels, 2 x positions), exactly
        return [{"input_features": randn(batch, int(mels), 2 * int(src))}]
    per_channel, channels = (
        config_value(config, "input_feat_per_channel"),
        config_value(config, "input_channels"),
    )
    dims = [
        per_channel * channels if per_channel and channels else None,
        config_value(config, "feature_projection_input_dim"),
        config_value(config, "feature_size"),
        mels,
        config_value(config, "input_dim", "n_mels", "num_mel_bins_per_frame"),
    ]
    dim = next((int(d) for d in dims if isinstance(d, int) and d > 0), 80)
    frames = 64
    return [
        {"input_features": randn(batch, frames, dim)},
        {"input_features": randn(batch, dim, frames)},
    ]


def _series_options(config: Any, params: Any, randn: Any, batch: int) -> list[dict[str, Any]]:
    context = config_value(config, "context_length") or 32
    lags = config_value(config, "lags_sequence") or [0]
    length = int(context) + int(max(lags))
    channels = config_value(config, "num_input_channels", "input_size") or 1
    out = {
        "past_values": randn(batch, length, channels).squeeze(-1)
        if channels == 1
        else randn(batch, length, channels)
    }
    time_features = config_value(config, "num_time_features")
    if "past_time_features" in params and isinstance(time_features, int):
        out["past_time_features"] = randn(batch, length, time_features)
    if "past_observed_mask" in params:
        out["past_observed_mask"] = torch.ones_like(out["past_values"])
    return [out, {"past_values": randn(batch, length, channels)}]


_CHOICE: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode and no grad, the modes restored after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode


@contextlib.contextmanager
def _on_cpu(model: nn.Module) -> Iterator[None]:
    """Each meta tensor of ``model`` stood in for, while inside, by zeros on the CPU broadcast from
    one element: a tower that reads its inputs' values (an image grid's ``tolist``, a padding
    mask's ``all``) runs, its shapes are the real ones, and the weights cost no memory."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    zeros: dict[int, torch.Tensor] = {}  # tied tensors stay tied
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    zero = torch.zeros((), dtype=t.dtype).expand(t.shape)
                    swapped.append((table, name, t))
                    table[name] = zeros.setdefault(id(t), zero)
    try:
        yield
    finally:
        for table, name, t in swapped:
            table[name] = t


def _runs(model: nn.Module, inputs: "dict[str, Any] | Inputs") -> bool:
    try:
        with _evaluating(model):
            inputs.call(model) if isinstance(inputs, Inputs) else model(**inputs)
        return True
    except Exception as exc:  # noqa: BLE001 - any failure rules the candidate out
        # on the meta device data-dependent code cannot run; the shapes got that far
        return "meta" in str(exc) and any(p.is_meta for p in model.parameters())


def _first_that_runs(model: nn.Module, cands: list[Any], default: int | None = None) -> int | None:
    """The index of the first candidate the model runs on, remembered for later seeds."""
    choice = _CHOICE.get(model)
    if choice is None or choice >= len(cands):
        choice = next((i for i, c in enumerate(cands) if _runs(model, c)), default)
        if choice is not None:
            _CHOICE[model] = choice
    return choice


def hf_example_inputs(
    model: nn.Module, *, batch: int = 2, seq_len: int = 16, seed: int = 0
) -> dict[str, Any]:
    """Synthesize keyword inputs for a Hugging Face model from its config, chosen by ``forward``'s
    signature and ``main_input_name``; of several possible layouts, the first the model runs on.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> sorted(hf_example_inputs(GPT2LMHeadModel(GPT2Config(n_layer=1))))
    ['input_ids', 'use_cache']
    """
    cands = _candidates(model, batch, seq_len, seed)
    if not cands:
        raise CaptureError(
            _cannot_synthesize(model, "enjoyln does not know how to make its inputs")
        )
    choice = 0 if len(cands) == 1 else _first_that_runs(model, cands)
    if choice is None:
        tried = ", ".join(
            " + ".join(f"{k} {list(v.shape)}" for k, v in c.items() if isinstance(v, torch.Tensor))
            for c in cands
        )
        raise CaptureError(
            _cannot_synthesize(
                model, f"it runs on none of the {len(cands)} input layouts enjoyln tried ({tried})"
            )
        )
    return cands[choice]


def _cannot_synthesize(model: nn.Module, why: str) -> str:
    params = inspect.signature(model.forward).parameters
    named = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = [n for n in named if params[n].default is inspect.Parameter.empty]
    needs = required or ([getattr(model, "main_input_name", None) or named[0]] if named else [])
    return (
        f"cannot build example inputs for {type(model).__name__} from its config: {why}; pass "
        f"example_inputs, a dict with at least {', '.join(needs) or 'its inputs'}"
    )


# --- models that describe their own inputs: timm and open_clip (neither imported: what they
# record on the model is read as plain attributes, so any module that records the same is alike)


def _timm_input_size(model: nn.Module) -> tuple[int, int, int] | None:
    """(C, H, W) from timm's ``pretrained_cfg["input_size"]`` (``default_cfg`` in older timm)."""
    for name in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, name, None)
        size = cfg.get("input_size") if isinstance(cfg, Mapping) else None
        if (
            isinstance(size, (list, tuple))
            and len(size) == 3
            and all(isinstance(s, int) and s > 0 for s in size)
        ):
            return int(size[0]), int(size[1]), int(size[2])
    return None


def _channels(model: nn.Module) -> int:
    """Image channels: the model's ``in_chans``, else its first 2-D convolution's, else 3 (RGB)."""
    chans = getattr(model, "in_chans", None)
    if isinstance(chans, int) and chans > 0:
        return chans
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return conv.in_channels if conv is not None else 3


def _text_shape(model: nn.Module) -> tuple[int, int] | None:
    """(context length, vocabulary size) of an open_clip text tower or CLIP model."""
    owners = (model, getattr(model, "text", None))
    length, vocab = (
        next((getattr(o, n) for o in owners if isinstance(getattr(o, n, None), int)), None)
        for n in ("context_length", "vocab_size")
    )
    return (length, vocab) if length and length > 0 and vocab and vocab > 1 else None


def _image_sizes(model: nn.Module) -> list[tuple[int, int, int]]:
    """(C, H, W) candidates for an image model: the configured one first, then the size its patch
    embedding was built for, which ``create_model(..., img_size=...)`` sets without updating
    ``pretrained_cfg``."""
    timm_size = _timm_input_size(model)
    sizes = [timm_size] if timm_size is not None else []
    own = int_pair(getattr(model, "image_size", None))
    if own is not None:
        sizes.append((_channels(model), *own))
    patch = int_pair(getattr(getattr(model, "patch_embed", None), "img_size", None))
    if patch is not None:
        sizes.append((sizes[0][0] if sizes else _channels(model), *patch))
    return list(dict.fromkeys(sizes))


def described_inputs(model: nn.Module, *, batch: int = 2, seed: int = 0) -> Inputs | None:
    """Inputs from what a timm or open_clip model records about itself (an image size, a text
    tower's context length and vocabulary, or both for a CLIP model); None if it records nothing.

    >>> class Tower(torch.nn.Module):
    ...     pretrained_cfg = {"input_size": (3, 32, 32)}
    ...     def forward(self, x): return x.mean()
    >>> described_inputs(Tower()).args[0].shape
    torch.Size([2, 3, 32, 32])
    """
    gen = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    text = _text_shape(model)
    visual = getattr(model, "visual", None)
    params = inspect.signature(model.forward).parameters

    def ids() -> torch.Tensor:
        length, vocab = text
        return torch.randint(1, vocab, (batch, length), generator=gen).to(device)

    def image(size: tuple[int, int, int]) -> torch.Tensor:
        return torch.randn((batch, *size), generator=gen).to(device, dtype)

    if isinstance(visual, nn.Module) and text is not None and {"image", "text"} <= params.keys():
        sizes = _image_sizes(visual)
        return Inputs((), {"image": image(sizes[0]), "text": ids()}) if sizes else None
    sizes = _image_sizes(model)
    if sizes:
        cands = [Inputs((image(size),), {}) for size in sizes]
        return cands[0 if len(cands) == 1 else _first_that_runs(model, cands, 0)]
    return Inputs((ids(),), {}) if text is not None else None


def resolve_inputs(
    model: nn.Module, example_inputs: ExampleInputs = None, *, seed: int = 0
) -> Inputs:
    """The user's example inputs, or inputs synthesized from a Hugging Face config or
    ``described_inputs``."""
    if example_inputs is not None:
        inputs = as_inputs(example_inputs)
        if is_hf_model(model) and wants_no_cache(model):
            inputs.kwargs.setdefault("use_cache", False)
        return inputs
    if is_hf_model(model):
        return Inputs((), hf_example_inputs(model, seed=seed))
    described = described_inputs(model, seed=seed)
    if described is not None:
        return described
    raise CaptureError(
        f"{type(model).__name__} is not a Hugging Face model and records no input size enjoyln can "
        "read (timm's pretrained_cfg['input_size'], or open_clip's image_size, or context_length "
        "and "
        "vocab_size), so enjoyln cannot invent its inputs; pass example_inputs (a tensor, a tuple "
        "or "
        "a dict of keyword arguments)"
    )


def inputs_like(inputs: Inputs, seed: int) -> Inputs:
    """Fresh random inputs with the shapes, dtypes and integer ranges of ``inputs``."""
    gen = torch.Generator().manual_seed(seed)

    def fresh(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dtype == torch.bool:
            return x
        if x.is_floating_point():
            return torch.randn(x.shape, generator=gen).to(x.dtype).to(x.device)
        lo, hi = int(x.min()), int(x.max())
        return torch.randint(lo, hi + 1, x.shape, generator=gen).to(x.dtype).to(x.device)

    return Inputs(
        tuple(fresh(a) for a in inputs.args), {k: fresh(v) for k, v in inputs.kwargs.items()}
    )
