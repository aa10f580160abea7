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
    return _tiny("Wav2Vec2Config", "Wav2Vec2Model", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                 num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)


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
    model = _tiny("VideoMAEConfig", "VideoMAEModel", hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=16,
                  num_frames=4, tubelet_size=2)
    inputs = hf_example_inputs(model)
    assert inputs["pixel_values"].shape == (2, 4, 3, 32, 32)
    assert enjoyln.analyze(model).layer_norms


def test_config_without_image_size_gets_the_processor_default():
    model = _tiny("CvtConfig", "CvtModel", embed_dim=[16, 48, 96], num_heads=[1, 3, 6], depth=[1, 2, 3])
    assert getattr(model.config, "image_size", None) is None
    inputs = hf_example_inputs(model)
    assert inputs["pixel_values"].shape == (2, 3, 224, 224)


def test_config_without_vocab_size_gets_character_ids():
    model = _tiny("CanineConfig", "CanineModel", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, num_hash_buckets=64)
    assert getattr(model.config, "vocab_size", None) is None
    ids = hf_example_inputs(model)["input_ids"]
    assert ids.shape == (2, 16) and 0 <= int(ids.min()) and int(ids.max()) < 256
    with torch.no_grad():
        model(**hf_example_inputs(model))


def test_speech_features_layout_is_found_by_running_the_model():
    """Speech2Text takes (batch, frames, features), Whisper (batch, mels, frames)."""
    model = _tiny("Speech2TextConfig", "Speech2TextModel", vocab_size=64, d_model=32, encoder_layers=1,
                  decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, input_feat_per_channel=20, input_channels=1,
                  conv_channels=32, max_source_positions=64, max_target_positions=32)
    first = hf_example_inputs(model, seed=0)
    assert first["input_features"].shape == (2, 64, 20)
    again = hf_example_inputs(model, seed=1)  # the layout found once is kept for later seeds
    assert again["input_features"].shape == (2, 64, 20)
    assert not torch.equal(first["input_features"], again["input_features"])


def test_kwargs_forward_gets_use_cache_false():
    """LLaVA takes use_cache through **kwargs; without it the traced graph returns a cache."""
    model = _tiny("LlavaConfig", "LlavaForConditionalGeneration",
                  text_config=dict(model_type="llama", hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=64, vocab_size=128),
                  vision_config=dict(model_type="clip_vision_model", hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=16),
                  image_token_id=127)
    assert "use_cache" not in model.forward.__code__.co_varnames[:model.forward.__code__.co_argcount]
    assert wants_no_cache(model)
    inputs = hf_example_inputs(model)
    assert inputs["use_cache"] is False
    ids = inputs["input_ids"]
    # as a processor writes it: one placeholder per image feature (2x2 patches), and none in the text
    assert (ids[:, :4] == 127).all() and not (ids[:, 4:] == 127).any()
    plan = enjoyln.analyze(model)
    assert plan.model == "LlavaForConditionalGeneration"


def test_impossible_synthesis_names_the_inputs_to_pass():
    model = _tiny("DecisionTransformerConfig", "DecisionTransformerModel", state_dim=4, act_dim=2,
                  hidden_size=32, n_layer=1, n_head=2)
    with pytest.raises(enjoyln.CaptureError, match="pass example_inputs, a dict with at least states") as err:
        enjoyln.analyze(model)
    assert "\n" not in str(err.value)
