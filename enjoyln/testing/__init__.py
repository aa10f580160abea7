"""A zoo of tiny HF models, and ``perturb``: fresh LN gains of 1 and zero biases hide most folding
mistakes.

>>> model = perturb(tiny_model("gpt2"))
>>> float(model.transformer.ln_f.bias.abs().sum()) > 0
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..store.quiet import quiet

# Small configs: 2 layers, width 64, and nothing the tracer cannot see.
_VOCAB = 128
_LAYERS = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
_MLP = dict(_LAYERS, intermediate_size=128)
_ZOO: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=_VOCAB,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=1,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            _LAYERS,
            ffn_dim=128,
            vocab_size=_VOCAB,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
        ),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(n_layer=2, hidden_size=64, n_head=4, vocab_size=_VOCAB),
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(_MLP, vocab_size=_VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=1),
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=_VOCAB,
            n_positions=64,
            rotary_dim=8,
            bos_token_id=0,
            eos_token_id=1,
        ),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(_MLP, vocab_size=_VOCAB, max_position_embeddings=64),
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(_LAYERS, vocab_size=_VOCAB, bos_token_id=0, eos_token_id=1),
    ),
    "vit": (
        "ViTConfig",
        "ViTForImageClassification",
        dict(_MLP, image_size=32, patch_size=8, num_labels=5),
    ),
    "bert": ("BertConfig", "BertModel", dict(_MLP, vocab_size=_VOCAB, max_position_embeddings=64)),
    "clip": (
        "CLIPConfig",
        "CLIPModel",
        dict(
            text_config=dict(
                _MLP,
                vocab_size=_VOCAB,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            ),
            vision_config=dict(_MLP, image_size=32, patch_size=8),
            projection_dim=32,
        ),
    ),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        dict(
            vocab_size=_VOCAB,
            num_mel_bins=16,
            encoder_layers=2,
            decoder_layers=2,
            d_model=64,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_source_positions=32,
            max_target_positions=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=3,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        ),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_MLP, vocab_size=_VOCAB, max_position_embeddings=64),
    ),
}

ARCHITECTURES = tuple(k for k in _ZOO if k != "llama")  # those with LayerNorms


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A small ``transformers`` config for ``arch`` (a key of the zoo)."""
    import transformers

    if arch not in _ZOO:
        raise KeyError(f"unknown architecture {arch!r}; choose from {', '.join(_ZOO)}")
    config_cls, _, kwargs = _ZOO[arch]
    return getattr(transformers, config_cls)(**{**kwargs, **overrides})


def tiny_model(arch: str, *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A small randomly initialised model of ``arch``, in eval mode."""
    import transformers

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    return getattr(transformers, _ZOO[arch][1])(config).eval()


def perturb(model: nn.Module, seed: int = 0, *, scale: float = 1.0) -> nn.Module:
    """Move norm gains (~N(1, 0.3)), biases (~N(0, 0.2)) and embedding means (a common offset plus a
    per-row shift, on the scale of the table's spread) away from init, in place; returns
    ``model``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(t: torch.Tensor, std: float) -> torch.Tensor:
        return (torch.randn(t.shape, generator=gen) * std * scale).to(t.dtype)

    def offset(t: torch.Tensor) -> torch.Tensor:
        # relative to the table's spread: visible, but not swamping the rows (one token would win
        # every argmax)
        spread = float(t.float().std()) if t.numel() > 1 else 1.0
        return randn(t[(0,) * (t.dim() - 1)], spread) + randn(
            t[..., :1], 0.5 * spread
        )  # common, then per row

    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
    with torch.no_grad():
        seen: set[int] = set()
        for module in model.modules():
            if isinstance(module, norms):
                if getattr(module, "weight", None) is not None:
                    module.weight.copy_(1 + randn(module.weight, 0.3))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(randn(module.bias, 0.2))
                seen.update(id(p) for p in module.parameters(recurse=False))
            elif isinstance(module, nn.Embedding) and module.weight.numel():
                module.weight.add_(offset(module.weight))
                seen.add(id(module.weight))
        for name, p in model.named_parameters():
            if id(p) in seen or not p.is_floating_point() or p.numel() == 0:
                continue
            leaf = name.rpartition(".")[2]
            if leaf == "bias" or leaf.endswith("_bias"):
                p.copy_(randn(p, 0.2))
            elif any(k in leaf for k in ("embedding", "token", "position")) and p.dim() >= 1:
                p.add_(offset(p))
    return model


def max_relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|a|``: the error relative to the output's scale."""
    a, b = a.detach().double(), b.detach().double()
    scale = a.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((a - b).abs().max() / scale)


def model_outputs(model: nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    from ..analysis.inputs import as_inputs
    from ..checking.running import flatten_outputs

    with torch.no_grad():
        return flatten_outputs(as_inputs(inputs).call(model))


@quiet
def demo_checkpoint(
    path: Any, *, layers: int = 4, width: int = 256, vocab: int = 512, seed: int = 0
) -> Any:
    """Write a perturbed random GPT-2 with a word-level tokenizer to ``path``; nothing is
    downloaded."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    model = tiny_model(
        "gpt2",
        seed=seed,
        n_layer=layers,
        n_embd=width,
        n_head=max(1, width // 64),
        vocab_size=vocab,
        n_positions=1024,
        initializer_range=0.2,
    )
    perturb(model, seed=seed)
    model.save_pretrained(path)
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(vocab - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(path)
    return path
