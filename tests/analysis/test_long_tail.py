"""The architectures behind the long-tail rules (docs/how-it-works.md), tiny and perturbed: what
folds, exactly, in memory and through a checkpoint (``fold_checkpoint``, ``enjoyln.load`` and a
plain ``from_pretrained``)."""

import copy
import json

import pytest
import torch
import transformers as T
from safetensors import safe_open

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.store.load import load
from enjoyln.testing import perturb
from conftest import assert_same_outputs

VIT = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    image_size=32,
    patch_size=8,
)
SEQ2SEQ = dict(
    encoder_layers=1,
    decoder_layers=1,
    d_model=32,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    vocab_size=128,
    max_position_embeddings=64,
)
EMBEDDING_LNS = {"encoder.layernorm_embedding", "decoder.layernorm_embedding"}
# architecture -> (config, model class, the LNs that must fold: "all" or a set, the rule it needs).
# Names, not classes: importing a model class at collection time would import triton before
# tests/ops/test_triton.py can switch it to its interpreter.
CASES = {
    "gpt_neox_japanese": (
        (
            "GPTNeoXJapaneseConfig",
            dict(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_multiple_size=2,
                vocab_size=128,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=1,
            ),
        ),
        "GPTNeoXJapaneseModel",
        "all",
    ),  # expand_as reads the stream's shape only
    "bart": (("BartConfig", SEQ2SEQ), "BartModel", EMBEDDING_LNS),  # a dead select of inputs_embeds
    "mbart": (("MBartConfig", SEQ2SEQ), "MBartModel", EMBEDDING_LNS),
    "plbart": (("PLBartConfig", SEQ2SEQ), "PLBartModel", EMBEDDING_LNS),
    "dinov2": (("Dinov2Config", VIT), "Dinov2Model", "all"),  # LayerScale
    "beit": (("BeitConfig", dict(VIT, num_labels=3)), "BeitForImageClassification", "all"),
    "yolos": (
        ("YolosConfig", dict(VIT, image_size=[32, 48], num_detection_tokens=3)),
        "YolosModel",
        "all",
    ),  # bicubic interpolation of the position table
    "vit_mae": (("ViTMAEConfig", VIT), "ViTMAEModel", "all"),  # gather of the kept positions
    "persimmon": (
        (
            "PersimmonConfig",
            dict(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                vocab_size=128,
                max_position_embeddings=64,
                qk_layernorm=True,
            ),
        ),
        "PersimmonModel",
        "all",
    ),  # per-head q/k LNs
    "m2m100": (
        ("M2M100Config", SEQ2SEQ),
        "M2M100Model",
        "all",
    ),  # sinusoidal non-persistent buffers
    "xglm": (
        (
            "XGLMConfig",
            dict(
                num_layers=2,
                d_model=32,
                attention_heads=4,
                ffn_dim=64,
                vocab_size=128,
                max_position_embeddings=64,
            ),
        ),
        "XGLMModel",
        "all",
    ),
    "ctrl": (
        (
            "CTRLConfig",
            dict(n_layer=2, n_embd=32, n_head=4, dff=64, vocab_size=128, n_positions=64),
        ),
        "CTRLModel",
        "all",
    ),  # ... which the forward also writes back to itself
    # norms that are not nn.LayerNorm modules: a non-parametric LN that upcasts
    # (an nn.Module), and a channels-first one after the patchifying convolution
    "olmo": (
        (
            "OlmoConfig",
            dict(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                vocab_size=128,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            ),
        ),
        "OlmoForCausalLM",
        "all",
    ),
    "convnextv2": (
        (
            "ConvNextV2Config",
            dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32),
        ),
        "ConvNextV2Model",
        {"embeddings.layernorm"},
    ),
}


def build(arch, seed=1):
    (config, kwargs), cls, _ = CASES[arch]
    torch.manual_seed(0)
    return perturb(getattr(T, cls)(getattr(T, config)(**kwargs)).eval(), seed=seed)


def inputs(model, seed):
    out = hf_example_inputs(model, seed=seed)
    if type(model).__name__ == "ViTMAEModel":  # the masking is random unless the noise is given
        out["noise"] = torch.rand(2, 16, generator=torch.Generator().manual_seed(seed))
    return out


def must_fold(arch, plan):
    expected = CASES[arch][2]
    return {e.name for e in plan.layer_norms} if expected == "all" else expected


@pytest.mark.parametrize("arch", list(CASES))
def test_folds_exactly_what_the_rules_allow(arch):
    model = build(arch)
    plan = enjoyln.analyze(model, inputs(model, 0))
    assert must_fold(arch, plan) <= {e.name for e in plan.foldable}, plan.summary()
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    for seed in (1, 2):
        assert_same_outputs(model, folded, inputs(model, seed), rtol=1e-5)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-tail")

    def make(arch, edit=None):
        path = root / f"{arch}-{edit.__name__ if edit else 'plain'}"
        if not path.exists():
            model = build(arch, seed=21)
            if edit:
                edit(model)
            model.save_pretrained(path)
        return path

    return make


def reload_plain(path):
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(T, arch).from_pretrained(path).eval()


@pytest.mark.parametrize(
    "arch", ["bart", "dinov2", "yolos", "persimmon", "m2m100", "olmo", "convnextv2"]
)
def test_checkpoint_round_trip(arch, saved, tmp_path):
    src = saved(arch)
    result = fold_checkpoint(src, tmp_path / "out")
    assert must_fold(arch, result.plan) <= {e.name for e in result.plan.foldable}
    block = json.loads((result.out_dir / "config.json").read_text())["enjoyln"]
    original, plain, folded = reload_plain(src), reload_plain(result.out_dir), load(result.out_dir)
    assert sum(isinstance(m, enjoyln.RMSNorm) for m in folded.modules()) == len(
        result.plan.foldable
    )
    for seed in (3, 4):
        assert_same_outputs(original, plain, inputs(original, seed))
        assert_same_outputs(original, folded, inputs(original, seed))
    unsaved = [c.param for c in result.plan.centered if not c.saved]
    assert block["center_on_load"] == unsaved
    if arch == "m2m100":  # the sinusoidal tables are not in the checkpoint; load centers them
        assert sorted(unsaved) == [
            "decoder.embed_positions.weights",
            "encoder.embed_positions.weights",
        ]
        assert folded.encoder.embed_positions.weights.double().mean(-1).abs().max() < 1e-6
        assert plain.encoder.embed_positions.weights.mean(-1).abs().max() > 1e-3
    if arch == "dinov2":  # the gain is recorded with the centering, and the saved weight honours it
        scaled = [c for c in block["centered"] if c.get("scale")]
        assert scaled and all(
            c["scale"].endswith("lambda1") for c in scaled if "attention" in c["param"]
        )
        c = next(c for c in scaled if c["param"].endswith("mlp.fc2.weight"))
        with safe_open(result.out_dir / "model.safetensors", "pt") as f:
            w, g = f.get_tensor(c["param"]), f.get_tensor(c["scale"])
        assert (w.double() * g.double()[:, None]).mean(0).abs().max() < 1e-6
    if arch in (
        "olmo",
        "convnextv2",
    ):  # the norms' forms are recorded, and enjoyln.load honours them
        forms = {
            e["name"]: (e.get("dim", -1), e.get("upcast", False))
            for e in block["plan"]["layer_norms"]
            if e["foldable"]
        }
        expected = (-1, True) if arch == "olmo" else (1, False)
        assert set(forms.values()) == {expected} and block["format_version"] == 2
        assert all(
            (m.dim, m.upcast) == expected
            for m in folded.modules()
            if isinstance(m, enjoyln.RMSNorm)
        )
    if arch == "persimmon":  # q and k blocks of one fused weight, in one pass
        fused = [
            c
            for c in block["centered"]
            if c["param"] == "layers.0.self_attn.query_key_value.weight"
        ]
        assert sorted(tuple(c["blocks"]) for c in fused) == [(0, 3, 6, 9), (1, 4, 7, 10)]


def zero_gain(model):
    with torch.no_grad():
        model.encoder.layer[1].layer_scale2.lambda1[5] = 0.0


def test_checkpoint_with_a_zero_layer_scale_gain(saved, tmp_path):
    """The meta-device analysis cannot see the gain; the checkpoint path reads it."""
    result = fold_checkpoint(saved("dinov2", zero_gain), tmp_path / "out")
    kept = {e.name: e.reason for e in result.plan.layer_norms if not e.foldable}
    assert list(kept) == ["layernorm"] and "zero entry" in kept["layernorm"]
    original, folded = reload_plain(saved("dinov2", zero_gain)), load(result.out_dir)
    assert_same_outputs(original, folded, inputs(original, 5))
