"""Example inputs for vision-language models: an image in every batch, in the layout the model
takes, with one placeholder token per image feature."""

import copy

import pytest
import torch
import transformers

from enjoyln.analysis.inputs import fill_text_ids, hf_example_inputs
from models import blip2_opt, llava_siglip

_TEXT = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=128,
)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _runs(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def _image_tokens(model, inputs):
    return (inputs["input_ids"] == model.config.image_token_id).sum(dim=1).tolist()


def test_llava_gets_an_image_and_one_placeholder_per_feature_in_every_batch():
    model = llava_siglip()
    for seed in range(3):
        inputs = hf_example_inputs(model, seed=seed)
        assert inputs["pixel_values"].shape == (2, 3, 32, 32)
        assert _image_tokens(model, inputs) == [16, 16]  # (32 / 8)² patches, all kept ("full")
        assert _runs(model, inputs).image_hidden_states is not None


def test_placeholders_stay_where_text_ids_are_replaced():
    model = llava_siglip()
    ids = hf_example_inputs(model)["input_ids"]
    filled = fill_text_ids(model.config, ids, torch.arange(100, 120))  # 20 of the 32 text positions
    assert torch.equal(filled == 127, ids == 127)
    text = filled[filled != 127]
    assert text[:20].tolist() == list(range(100, 120)) and torch.equal(
        text[20:], ids[ids != 127][20:]
    )


def test_idefics3_takes_images_per_sample():
    cfg = transformers.Idefics3Config(
        vision_config=dict(_VISION, image_size=32, patch_size=8),
        text_config=_TEXT,
        image_token_id=127,
        scale_factor=2,
    )
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    inputs = hf_example_inputs(model)
    assert inputs["pixel_values"].shape == (2, 1, 3, 32, 32)
    assert _image_tokens(model, inputs) == [4, 4]  # 16 patches, merged 2 x 2
    _runs(model, inputs)


def test_llava_next_gets_its_crops_and_image_sizes():
    cfg = transformers.LlavaNextConfig(
        vision_config=dict(_VISION, model_type="clip_vision_model", image_size=32, patch_size=16),
        text_config=_TEXT,
        image_token_index=127,
        image_grid_pinpoints=[[32, 64], [64, 32]],
    )
    model = transformers.LlavaNextForConditionalGeneration(cfg).eval()
    inputs = hf_example_inputs(model)
    assert inputs["pixel_values"].shape == (
        2,
        3,
        3,
        32,
        32,
    )  # a 1 x 2 grid of tiles and the whole image
    assert inputs["image_sizes"] == [
        [32, 32],
        [32, 32],
    ]  # plain ints, which torch.export keeps as constants
    _runs(model, inputs)


def test_mllama_gets_tiles_and_aspect_ratios():
    cfg = transformers.MllamaConfig(
        vision_config=dict(
            _VISION,
            num_global_layers=1,
            image_size=28,
            patch_size=14,
            max_num_tiles=2,
            intermediate_layers_indices=[0],
            vision_output_dim=64,
            supported_aspect_ratios=[[1, 1], [1, 2]],
        ),
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=128,
            cross_attention_layers=[1],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_index=127,
    )
    model = transformers.MllamaForConditionalGeneration(cfg).eval()
    inputs = hf_example_inputs(model)
    assert inputs["pixel_values"].shape == (2, 1, 2, 3, 28, 28)
    assert inputs["aspect_ratio_ids"].tolist() == [[1], [1]]
    assert inputs["aspect_ratio_mask"].tolist() == [[[1, 0]], [[1, 0]]]
    _runs(model, inputs)


def _qwen2_vl():
    cfg = transformers.Qwen2VLConfig(
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=160,
            rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=1e4),
        ),
        image_token_id=150,
        video_token_id=151,
        vision_start_token_id=152,
    )
    return transformers.Qwen2VLForConditionalGeneration(cfg).eval()


def test_qwen2_vl_gets_flat_patches_grids_token_types_and_positions():
    model = _qwen2_vl()
    inputs = hf_example_inputs(model)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert inputs["pixel_values"].shape == (32, 3 * 2 * 4 * 4)
    assert _image_tokens(model, inputs) == [4, 4]  # 16 patches each, merged 2 x 2
    assert torch.equal(inputs["mm_token_type_ids"], (inputs["input_ids"] == 150).long())
    assert inputs["position_ids"].shape == (3, 2, inputs["input_ids"].shape[1])
    _runs(model, inputs)


@pytest.mark.parametrize("strategy, tokens", [("full", 16), ("default", 15)])
def test_the_count_follows_the_model_not_the_config_fields(strategy, tokens):
    model = llava_siglip()
    model.config.vision_feature_select_strategy = strategy  # "default" drops the first feature
    assert _image_tokens(model, hf_example_inputs(model)) == [tokens, tokens]


@pytest.mark.parametrize("build", [_qwen2_vl, blip2_opt], ids=["qwen2_vl", "blip2"])
def test_a_meta_model_gets_the_inputs_its_loaded_model_gets(build):
    """A directory is analysed as a meta model. Qwen2-VL's tower reads its image grid's values
    (``tolist``) and BLIP-2's its attention mask's (``all``), and the text's placeholder count
    comes from running the tower: zeros stand in for the meta weights meanwhile, and the inputs
    end on the meta device, shaped as for the loaded model."""
    model = build()
    want = hf_example_inputs(model)
    meta = copy.deepcopy(model).to("meta")
    before = dict(meta.named_parameters())
    got = hf_example_inputs(meta)
    assert got.keys() == want.keys() and "pixel_values" in got
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[name].is_meta and got[name].shape == value.shape, name
    assert dict(meta.named_parameters()) == before and all(p.is_meta for p in before.values())
