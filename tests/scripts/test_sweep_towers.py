"""scripts/sweep_towers.py: tiny vision-language configs kept consistent, and its table."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(SCRIPTS))
zoo = sys.modules.get("sweep_transformers") or _load("sweep_transformers")
towers = _load("sweep_towers")


@pytest.mark.parametrize(
    "model_type, check",
    [
        (
            "llava_next",
            lambda c: (
                c.image_grid_pinpoints == [[64, 128], [128, 64], [128, 128], [192, 64], [64, 192]]
            ),
        ),
        (
            "mllama",
            lambda c: (
                c.vision_config.intermediate_layers_indices == [0, 1]
                and c.vision_config.vision_output_dim == 64 * 3
                # a cross-attention layer within the shrunk depth, or the image reaches no logit
                and c.text_config.cross_attention_layers == [1]
                and c.text_config.num_hidden_layers == 2
            ),
        ),
        ("blip-2", lambda c: c.image_token_index == 511),
        ("paligemma", lambda c: c.projection_dim == c.text_config.hidden_size == 64),
    ],
)
def test_tiny_configs_stay_consistent_for_their_towers(model_type, check):
    assert check(zoo.tiny_config(model_type, 0))


def test_the_table_counts_tower_lns_apart():
    results = {
        "a": {
            "status": "exact",
            "class": "A",
            "ln_entries": 4,
            "folded": 3,
            "max_rel": 1e-7,
            "tower_lns": 2,
            "tower_folded": 1,
            "tower_reasons": {"its input includes the output of a LayerNorm": 1},
            "rotation": {
                "rotated": 1,
                "streams": 2,
                "tower_rotated": 1,
                "max_rel": 2e-7,
                "status": "exact",
                "why_not": ["a LayerNorm writes the residual stream"],
            },
        },
        "c": {
            "status": "exact",
            "class": "C",
            "ln_entries": 1,
            "folded": 1,
            "max_rel": 0.0,
            "tower_lns": 0,
            "tower_folded": 0,
            "rotation": {"status": "raw_error", "message": "ValueError: boom"},
        },
        "b": {"status": "skipped", "reason": "no LayerNorm or GroupNorm in the forward"},
    }
    meta = {
        "transformers": "5",
        "machine": "here",
        "jobs": 1,
        "timeout": 60,
        "wall_seconds": 120,
        "enjoyln_commit": "abc",
    }
    block = towers.docs_block(results, meta)
    assert "Tower LNs folded: **1 of 2** in 1 types" in block
    assert (
        "| a | A | 1 / 2 | 3 / 4 | 1.0e-07  | its input includes the output of a LayerNorm (1) | 1 "
        "/ 2 (1) | "
        "2.0e-07 | a LayerNorm writes the residual stream |"
    ) in block
    assert "| c | C | 0 / 0 | 1 / 1 | 0.0e+00  | - | - | raw_error | ValueError: boom |" in block
    assert (
        "of the 2 types that fold exactly: **1 of 2 streams rotated**, 1 of them a tower's; 1 "
        "exact, 0 inexact, "
        "0 clean errors, 1 raw errors"
    ) in block
    assert "skipped: no LayerNorm or GroupNorm in the forward (1)" in block
    assert towers.in_towers("model.vision_tower.x", ["model.vision_tower"])
    assert not towers.in_towers("model.vision_towers.x", ["model.vision_tower"])
