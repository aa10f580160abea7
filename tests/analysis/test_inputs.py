"""Input synthesis for Hugging Face models beyond token ids: audio, video, configs without
the usual size fields, ``**kwargs`` forwards, and the error when nothing can be made."""

import pytest
import torch
import transformers

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs, wants_no_cache


def _tiny(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw)).eval()


def wav2vec2():
    return _tiny(
        "Wav2Vec2Config",
        "Wav2Vec2Model",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )


def test_waveform_length_fits_the_conv_feature_encoder():
    """Strides 5, 2 and kernels 10, 3: 170 samples make exactly 16 frames."""
    model = wav2vec2()
    inputs = hf_example_inputs(model, batch=2, seq_len=16)
    assert inputs["input_values"].shape == (2, 170)
    with torch.no_grad():
        assert model(**inputs).last_hidden_state.shape[:2] == (2, 16)
    plan = enjoyln.analyze(model)
    assert len(plan.layer_norms) >= 2


def test_video_pixel_values_are_five_dimensional():
    model = _tiny(
        "VideoMAEConfig",
        "VideoMAEModel",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=16,
        num_frames=4,
        tubelet_size=2,
    )
    inputs = hf_example_inputs(model)
    assert inputs["pixel_values"].shape == (2, 4, 3, 32, 32)
    assert enjoyln.analyze(model).layer_norms


def test_config_without_image_size_gets_the_processor_default():
    model = _tiny(
        "CvtConfig", "CvtModel", embed_dim=[16, 48, 96], num_heads=[1, 3, 6], depth=[1, 2, 3]
    )
    assert getattr(model.config, "image_size", None) is None
    inputs = hf_example_inputs(model)
    assert inputs["pixel_values"].shape == (2, 3, 224, 224)


def test_config_without_vocab_size_gets_character_ids():
    model = _tiny(
        "CanineConfig",
        "CanineModel",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_hash_buckets=64,
    )
    assert getattr(model.config, "vocab_size", None) is None
    ids = hf_example_inputs(model)["input_ids"]
    assert ids.shape == (2, 16) and 0 <= int(ids.min()) and int(ids.max()) < 256
    with torch.no_grad():
        model(**hf_example_inputs(model))


def test_speech_features_layout_is_found_by_running_the_model():
    """Speech2Text takes (batch, frames, features), Whisper (batch, mels, frames)."""
    model = _tiny(
        "Speech2TextConfig",
        "Speech2TextModel",
        vocab_size=64,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        input_feat_per_channel=20,
        input_channels=1,
        conv_channels=32,
        max_source_positions=64,
        max_target_positions=32,
    )
    first = hf_example_inputs(model, seed=0)
    assert first["input_features"].shape == (2, 64, 20)
    again = hf_example_inputs(model, seed=1)  # the layout found once is kept for later seeds
    assert again["input_features"].shape == (2, 64, 20)
    assert not torch.equal(first["input_features"], again["input_features"])


def test_kwargs_forward_gets_use_cache_false():
    """LLaVA takes use_cache through **kwargs; without it the traced graph returns a cache."""
    model = _tiny(
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        text_config=dict(
            model_type="llama",
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=128,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=32,
            patch_size=16,
        ),
        image_token_id=127,
    )
    assert (
        "use_cache" not in model.forward.__code__.co_varnames[: model.forward.__code__.co_argcount]
    )
    assert wants_no_cache(model)
    inputs = hf_example_inputs(model)
    assert inputs["use_cache"] is False
    ids = inputs["input_ids"]
    # as a processor writes it: one placeholder per image feature (2x2 patches), and none in the
    # text
    assert (ids[:, :4] == 127).all() and not (ids[:, 4:] == 127).any()
    plan = enjoyln.analyze(model)
    assert plan.model == "LlavaForConditionalGeneration"


def test_impossible_synthesis_names_the_inputs_to_pass():
    model = _tiny(
        "DecisionTransformerConfig",
        "DecisionTransformerModel",
        state_dim=4,
        act_dim=2,
        hidden_size=32,
        n_layer=1,
        n_head=2,
    )
    with pytest.raises(
        enjoyln.CaptureError, match="pass example_inputs, a dict with at least states"
    ) as err:
        enjoyln.analyze(model)
    assert "\n" not in str(err.value)


# --- models that record their own input sizes (timm, open_clip), mirrored in plain PyTorch -----

import copy  # noqa: E402

from torch import nn  # noqa: E402

from conftest import assert_same_outputs  # noqa: E402
from enjoyln.analysis.inputs import described_inputs  # noqa: E402
from enjoyln.testing import perturb  # noqa: E402


class PatchNet(nn.Module):
    """timm's pattern: ``pretrained_cfg["input_size"]`` says (C, H, W); the patch embedding
    refuses any other size, as timm's does."""

    def __init__(self, img: int = 32, cfg_img: int | None = None, chans: int = 3):
        super().__init__()
        self.pretrained_cfg = {
            "input_size": (chans, cfg_img or img, cfg_img or img),
            "num_classes": 10,
        }
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(chans, 16, 8, 8)
        self.patch_embed.img_size = (img, img)
        self.norm1, self.fc, self.norm, self.head = (
            nn.LayerNorm(16),
            nn.Linear(16, 16),
            nn.LayerNorm(16),
            nn.Linear(16, 10),
        )

    def forward(self, x):
        if tuple(x.shape[-2:]) != self.patch_embed.img_size:
            raise ValueError(
                f"input size {tuple(x.shape[-2:])} does not match the model's "
                f"{self.patch_embed.img_size}"
            )
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = x + self.fc(self.norm1(x))
        return self.head(self.norm(x)).mean(1)


class ResNetTower(nn.Module):
    """open_clip's ModifiedResNet: ``image_size`` is an int; the channels are its first conv's."""

    def __init__(self, image_size=24, chans: int = 3):
        super().__init__()
        self.image_size = image_size
        self.conv, self.ln = nn.Conv2d(chans, 8, 3, padding=1), nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(self.conv(x).mean((2, 3)))


class TextTower(nn.Module):
    """open_clip's TextTransformer: ``context_length`` and ``vocab_size``."""

    def __init__(self, vocab: int = 40, ctx: int = 12, d: int = 16):
        super().__init__()
        self.context_length, self.vocab_size = ctx, vocab
        self.token_embedding = nn.Embedding(vocab, d)
        self.positional_embedding = nn.Parameter(torch.randn(ctx, d) * 0.1)
        self.ln, self.proj, self.ln_final = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, text):
        x = self.token_embedding(text) + self.positional_embedding
        x = x + self.proj(self.ln(x))
        return self.ln_final(x).mean(1)


class ClipLike(nn.Module):
    """open_clip's CLIP: a ``visual`` tower with ``image_size``, the text's length and vocabulary
    on the model, and ``forward(image, text)``."""

    def __init__(self):
        super().__init__()
        self.visual = ResNetTower(image_size=(16, 20))
        self.visual.image_size = (16, 20)
        self.text = TextTower()
        self.context_length, self.vocab_size = self.text.context_length, self.text.vocab_size

    def forward(self, image=None, text=None):
        return {"image_features": self.visual(image), "text_features": self.text(text)}


def _folds_without_inputs(model, expected_folded):
    """analyze() and fold() with no inputs; the fold computes what the model did (perturbed)."""
    model = perturb(model.eval())
    plan = enjoyln.analyze(model)
    assert sorted(e.name for e in plan.foldable) == expected_folded
    inputs = described_inputs(model, seed=3)
    folded = enjoyln.fold(copy.deepcopy(model))
    assert_same_outputs(model, folded, inputs)
    return plan


def test_timm_pattern_analyses_and_folds_without_inputs():
    model = PatchNet()
    inputs = described_inputs(model)
    assert len(inputs.args) == 1 and not inputs.kwargs
    assert inputs.args[0].shape == (2, 3, 32, 32) and inputs.args[0].dtype == torch.float32
    _folds_without_inputs(PatchNet(), ["norm", "norm1"])
    model = perturb(model.eval())
    rotated = enjoyln.rotate(copy.deepcopy(model))
    assert_same_outputs(model, rotated, described_inputs(model, seed=4))
    assert enjoyln.check(model, rotated).passed  # the check needs no inputs either


def test_timm_default_cfg_and_channels_come_from_the_config():
    model = PatchNet(chans=1)
    model.default_cfg = model.pretrained_cfg
    del model.pretrained_cfg
    assert described_inputs(model).args[0].shape == (2, 1, 32, 32)


def test_size_the_patch_embedding_was_built_for_wins_when_the_config_size_does_not_run():
    """``create_model(name, img_size=64)`` leaves pretrained_cfg's 224: the model runs only on
    64."""
    model = PatchNet(img=16, cfg_img=32)
    assert described_inputs(model).args[0].shape == (2, 3, 16, 16)
    _folds_without_inputs(PatchNet(img=16, cfg_img=32), ["norm", "norm1"])


def test_open_clip_image_tower_with_int_and_tuple_image_size():
    assert described_inputs(ResNetTower(image_size=24, chans=4)).args[0].shape == (2, 4, 24, 24)
    tower = ResNetTower(image_size=(16, 20))
    assert described_inputs(tower).args[0].shape == (2, 3, 16, 20)
    _folds_without_inputs(tower, ["ln"])


def test_open_clip_text_tower_gets_ids_of_its_context_length_within_its_vocabulary():
    model = TextTower(vocab=40, ctx=12)
    ids = described_inputs(model, batch=64).args[0]
    assert ids.shape == (64, 12) and ids.dtype == torch.long
    assert int(ids.min()) >= 1 and int(ids.max()) < 40  # 0 is SigLIP's padding id
    _folds_without_inputs(TextTower(), ["ln", "ln_final"])


def test_clip_model_gets_image_and_text():
    model = ClipLike()
    inputs = described_inputs(model)
    assert not inputs.args and set(inputs.kwargs) == {"image", "text"}
    assert inputs.kwargs["image"].shape == (2, 3, 16, 20) and inputs.kwargs["text"].shape == (2, 12)
    _folds_without_inputs(ClipLike(), ["text.ln", "text.ln_final", "visual.ln"])


def test_text_length_and_vocabulary_may_sit_on_the_text_tower():
    """CoCa keeps ``vocab_size`` on its text tower only."""
    model = ClipLike()
    del model.vocab_size
    assert described_inputs(model).kwargs["text"].shape == (2, 12)


def test_a_module_that_records_no_input_size_names_what_enjoyln_looked_for():
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    with pytest.raises(
        enjoyln.CaptureError, match=r"pretrained_cfg\['input_size'\].*pass example_inputs"
    ) as err:
        enjoyln.analyze(net)
    assert "\n" not in str(err.value)
    with pytest.raises(enjoyln.CaptureError, match="records no input size"):
        enjoyln.check(net, net)
