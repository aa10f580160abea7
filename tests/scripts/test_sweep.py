"""A sample of the transformers zoo through the sweep (scripts/sweep_transformers.py).

The sample covers the patterns the long-tail rules handle: post-LN encoder-decoders (BART,
mBART, FSMT), a shape-only read (BART's ``embed_positions``), LayerScale
(DINOv2, BEiT), an interpolated position table (YOLOS), masking by gather
(ViT-MAE), per-head norms (Persimmon), sinusoidal buffers (M2M-100, XGLM),
data-dependent control flow (FSMT; LED and ViLT take the same path and are left to the full
sweep), audio (wav2vec2,
HuBERT, Whisper), video (VideoMAE, TimeSformer), vision-language models that
take ``use_cache`` through ``**kwargs`` (LLaVA, InternVL), configs without the
usual size fields (CvT, GLPN, CANINE), VITS, and the classics (GPT-2, BERT).
Each runs in a forked process, two at a time, as in the full sweep.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sweep_transformers.py"
spec = importlib.util.spec_from_file_location("sweep_transformers", SCRIPT)
sweep_mod = importlib.util.module_from_spec(spec)
sys.modules["sweep_transformers"] = sweep_mod
spec.loader.exec_module(sweep_mod)

# model type -> (status, folded LNs, LN entries, analyze(model) without inputs succeeds).
EXPECTED = {
    "bart": (
        "exact",
        2,
        12,
        True,
    ),  # layernorm_embedding: embed_positions reads its input only for the shape
    "mbart": ("exact", 2, 14, True),
    "gpt_neox_japanese": (
        "exact",
        5,
        5,
        True,
    ),  # attn_bias.expand_as(residual) reads only the shape
    "dinov2": ("exact", 5, 5, True),  # LayerScale
    "beit": (
        "exact",
        0,
        5,
        True,
    ),  # BeitModel returns the raw stream (no final norm with mean pooling)
    "yolos": ("exact", 5, 5, True),  # an interpolated position table
    "vit_mae": ("exact", 5, 5, True),  # masking by gather along the sequence
    "persimmon": (
        "exact",
        9,
        9,
        True,
    ),  # per-head q/k norms: grouped centering of each head's block
    "m2m_100": ("exact", 12, 12, True),  # sinusoidal non-persistent buffer, centered in memory
    "xglm": ("exact", 5, 5, True),  # sinusoidal non-persistent buffer
    "fsmt": ("exact", 0, 10, True),  # captured by draft_export
    "wav2vec2": ("exact", 0, 7, True),  # a waveform
    "hubert": ("exact", 0, 7, True),
    "videomae": ("exact", 0, 4, True),  # 5-D video
    "timesformer": ("exact", 7, 7, True),
    # use_cache through **kwargs, image tokens in the text; the tower is read at layer -2, so its
    # post-norm is
    # never read and folds whatever its input
    "llava": ("exact", 2, 6, True),
    "internvl": ("exact", 0, 5, True),
    "cvt": ("exact", 3, 29, True),  # no image_size in the config
    "glpn": ("exact", 7, 19, True),
    "canine": ("exact", 0, 11, True),  # no vocab_size in the config
    "vits": ("exact", 12, 28, True),  # data-dependent sizes: an unknown shape, no raw error
    "gpt2": ("exact", 5, 5, True),
    "bert": ("exact", 1, 5, True),
    "whisper": ("exact", 7, 12, True),
}

SAMPLE = sorted(EXPECTED)


@pytest.fixture(scope="module")
def results():
    return sweep_mod.sweep(
        SAMPLE, jobs=2, timeout=600, progress=False
    )  # a guard against hangs only


def test_no_raw_errors(results):
    raw = {
        t: (r["type"], r.get("enjoyln_frame"))
        for t, r in results.items()
        if r["status"] == "raw_error"
    }
    assert raw == {}


@pytest.mark.parametrize("model_type", SAMPLE)
def test_status_and_counts(results, model_type):
    r = results[model_type]
    status, folded, entries, no_input = EXPECTED[model_type]
    assert r["status"] == status, r.get("message") or r.get("reason")
    if status in ("exact", "inexact"):
        assert (r["folded"], r["ln_entries"]) == (folded, entries)
        assert r["max_rel"] <= sweep_mod.RTOL or status == "inexact"
    assert bool(r.get("no_input", {}).get("ok")) == no_input, r.get("no_input")


def test_every_fold_in_the_sample_is_exact(results):
    folded = {t: r for t, r in results.items() if r.get("folded")}
    assert folded and all(r["status"] == "exact" for r in folded.values())


def test_bart_folds_the_embedding_norms_read_only_for_their_shape(results):
    assert set(results["bart"]["folded_names"]) == {
        "model.encoder.layernorm_embedding",
        "model.decoder.layernorm_embedding",
    }


# --- the sweep's own helpers ------------------------------------------------------------


def test_refusal_reasons_are_normalised_across_models():
    norms = ["model.encoder.layers.0.final_layer_norm", "ln_f"]
    a = sweep_mod.normalize_reason(
        "its input includes the output of model.encoder.layers.0.final_layer_norm, which is not "
        "zero-mean",
        norms,
    )
    b = sweep_mod.normalize_reason(
        "its input includes the output of ln_f, which is not zero-mean", norms
    )
    assert a == b == "its input includes the output of a LayerNorm, which is not zero-mean"
    c = sweep_mod.normalize_reason(
        "its input includes the output of gelu in model.layers.3.mlp, which is not zero-mean"
    )
    assert c == "its input includes the output of gelu in M, which is not zero-mean"
    d = sweep_mod.normalize_reason(
        "folding it needs the parameter wte.weight centered, but that would also "
        "change the model output `hidden_states`"
    )
    assert d == "folding it needs a centering that would also change the model output `x`"


def test_tiny_configs_shrink_nested_configs_and_keep_rotary_sections_whole():
    cfg = sweep_mod.tiny_config("qwen2_vl", 0)
    text = cfg.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (64, 2, 4)
    assert sum(text.rope_parameters["mrope_section"]) == 64 // 4 // 2
    assert cfg.vision_config.depth <= 2


def test_perturb_skips_empty_parameters():
    """DINOv3 keeps zero register tokens: an empty parameter must not break perturbation."""
    from enjoyln.testing import perturb

    class Registers(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_tokens = nn.Parameter(torch.zeros(1, 0, 8))
            self.embed = nn.Embedding(4, 8)

    model = perturb(Registers())
    assert model.register_tokens.shape == (1, 0, 8)
