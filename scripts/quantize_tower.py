"""What rotating a vision tower does to its quantization: a LLaVA whose SigLIP tower is read at
layer -2, with outlier features planted in the tower's stream, before and after
``enjoyln.rotate``.

The tower's norms cannot fold (the projector reads the stream itself at the tap), so before the
rotation the layers that read them see the outliers; the rotation moves each norm's γ and β into its
readers and spreads the outliers over all features of the tower's stream, the projector taking Qᵀ.
Measured on the inputs of the tower's linear layers that read a norm (q, k, v, fc1) and of the
projector's first layer: their max-to-RMS ratio and int8 per-token error, and the logits with
exactly those layers quantized (inputs int8 per token, weights int8 or int4 per output channel,
round-to-nearest), against the full-precision original.

    python scripts/quantize_tower.py [--width 256] [--layers 4] [--write]    # the tower-outliers
    block
    python scripts/quantize_tower.py --llmcompressor --write    # also the tower-llmcompressor block
    (llmcompressor installed apart: docs/quantization.md)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs
from enjoyln.testing import perturb
from enjoyln.testing.quantize import OUTLIERS, input_stats, quantized, relative_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402


def build(width: int, layers: int, scale: float = 40.0) -> nn.Module:
    """A perturbed LLaVA (SigLIP tower of ``width`` read at -2, a small Llama) whose tower's stream
    writers put ``scale`` times more into a few features."""
    import transformers

    cfg = transformers.LlavaConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=max(1, width // 64),
            image_size=64,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=256,
        ),
        image_token_index=255,
        vision_feature_layer=-2,
        vision_feature_select_strategy="full",
    )
    torch.manual_seed(0)
    model = perturb(transformers.LlavaForConditionalGeneration(cfg), seed=0).eval()
    feats = [f % width for f in OUTLIERS]
    tower = model.model.vision_tower
    with torch.no_grad():
        tower.embeddings.patch_embedding.weight[feats] *= scale  # conv out channels: the stream
        tower.embeddings.patch_embedding.bias[feats] *= scale
        tower.embeddings.position_embedding.weight[:, feats] *= scale
        for layer in tower.encoder.layers:
            for proj in (layer.self_attn.out_proj, layer.mlp.fc2):
                proj.weight[feats] *= scale
                proj.bias[feats] *= scale
    return model


def readers(model: nn.Module) -> list[nn.Linear]:
    """The tower's layers that read a norm, and the projector's first layer, which reads the tapped
    stream."""
    layers = model.model.vision_tower.encoder.layers[
        :-1
    ]  # the last one feeds only the unserved last hidden state
    found = [
        m
        for layer in layers
        for m in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.mlp.fc1,
        )
    ]
    return found + [model.model.multi_modal_projector.linear_1]


def llmcompressor_rows(original: nn.Module, inputs: dict) -> list[tuple[str, int, int, float]]:
    """The original saved and ``enjoyln rotate``d on disk, each loaded with plain
    ``from_pretrained`` and quantized by llmcompressor (W8A8: int8 weights per output channel and
    int8 activations per token, round-to-nearest, every ``nn.Linear`` but the head): per model, the
    quantized linear layers of the tower and of the language model, and the logits' relative error
    against the full-precision original."""
    import subprocess
    import tempfile

    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        original.save_pretrained(f"{tmp}/original")
        subprocess.run(
            [sys.executable, "-m", "enjoyln", "rotate", f"{tmp}/original", f"{tmp}/rotated"],
            check=True,
            capture_output=True,
        )
        for name in ("original", "rotated"):
            model = transformers.LlavaForConditionalGeneration.from_pretrained(f"{tmp}/{name}")
            recipe = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])
            oneshot(model=model.eval(), recipe=recipe)
            done = [
                n
                for n, m in model.named_modules()
                if getattr(m, "quantization_scheme", None) is not None
            ]
            with torch.no_grad():
                a, b = original(**inputs).logits.double(), model(**inputs).logits.double()
            rows.append(
                (
                    name,
                    sum(".vision_tower." in f".{n}." for n in done),
                    sum(".language_model." in f".{n}." for n in done),
                    float((a - b).norm() / a.norm()),
                )
            )
    return rows


def write_llmcompressor(args: argparse.Namespace, original: nn.Module, inputs: dict) -> str:
    """The tower-llmcompressor block: llmcompressor's W8A8 of the original and the rotated
    checkpoint."""
    import llmcompressor

    rows = llmcompressor_rows(original, inputs)
    (_, t0, l0, e0), (_, t1, l1, e1) = rows
    return "\n".join(
        [
            f"The same LLaVA (SigLIP tower of width {args.width}, {args.layers} layers, read at "
            "-2, outliers planted), saved, `enjoyln rotate`d, each directory loaded with plain "
            f"`from_pretrained` and quantized by llmcompressor {llmcompressor.__version__} "
            '(`QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])`: int8 '
            "weights per output channel, int8 activations per token, round-to-nearest); the "
            f"logits against the full-precision original, 4 images; {machine()}:",
            "",
            "| checkpoint | linear layers quantized: tower | language model | logits error, W8A8 |",
            "|---|---|---|---|",
            *(f"| {n} | {t} | {lm} | {e:.2%} |" for n, t, lm, e in rows),
            "",
            f"llmcompressor quantizes the rotated tower's {t1} linear layers as it does the "
            f"language model's {l1}, and the rotated checkpoint's W8A8 logits error is "
            f"{e0 / e1:.1f}x lower ({e0:.2%} to {e1:.2%}); both include the language model's "
            "own quantization, of the same weights in the two checkpoints (its RMSNorm stream is "
            "not rotated).",
            f"Command: `python scripts/quantize_tower.py --width {args.width} --layers "
            f"{args.layers} --llmcompressor --write` (llmcompressor installed apart, as above).",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--write", action="store_true", help="put the table into docs/quantization.md"
    )
    parser.add_argument(
        "--llmcompressor",
        action="store_true",
        help="also quantize the original and the rotated checkpoint with llmcompressor (W8A8)",
    )
    args = parser.parse_args()

    original = build(args.width, args.layers)
    inputs = hf_example_inputs(original, batch=4, seed=1)
    plan = enjoyln.analyze(original, inputs, rotate=("hadamard", 0, True))
    rotated = enjoyln.rotate(copy.deepcopy(original), inputs, plan=plan)
    report = enjoyln.check(
        original, rotated, options=enjoyln.CheckOptions(skip=tuple(plan.changed_outputs))
    )
    assert report.passed, report.summary()
    rows = []
    for name, model in (
        ("original (the tower's norms cannot fold)", original),
        ("rotated", rotated),
    ):
        ratio, err8 = input_stats(model, readers, inputs)
        errors = relative_error(
            original, (quantized(model, readers, bits) for bits in (8, 4)), inputs
        )
        rows.append((name, ratio, err8, *errors))
    (_, r0, e0, a0, b0), (_, r1, e1, a1, b1) = rows
    body = "\n".join(
        [
            f"A LLaVA with a SigLIP tower of width {args.width} ({args.layers} layers, read at -2) "
            "and a small Llama, "
            "random perturbed weights, outliers planted in features "
            f"{', '.join(str(f) for f in OUTLIERS)} (40x) of "
            "every writer of the tower's stream; 4 images. The inputs of the tower's layers that "
            "read a norm and of "
            "the projector's first layer, and the logits with exactly those layers in int8 per "
            "token and their "
            f"weights round-to-nearest per output channel; {machine()}:",
            "",
            "| tower | max / RMS of the inputs | int8 per-token error of the inputs | logits "
            "error, W8A8 "
            "| logits error, W4A8 |",
            "|---|---|---|---|---|",
            *(f"| {n} | {r:.1f} | {e:.2%} | {q8:.2%} | {q4:.2%} |" for n, r, e, q8, q4 in rows),
            "",
            f"The rotation lowers the int8 activation error {e0 / e1:.1f}x and the W8A8 logits "
            f"error {a0 / a1:.1f}x. "
            f"At 4-bit weights the logits error goes from {b0:.2%} to {b1:.2%}: there it is the "
            "weights' own rounding, "
            "which a rotation of random (Gaussian) weights does not reduce, as in the GPT-2 case "
            "of "
            "docs/how-it-works.md. Unquantized, the rotated model computes the original's logits "
            "(`enjoyln.check`, "
            f"the tower's changed hidden states left out: max rel diff {report.max_rel_diff:.1e}).",
            f"Command: `python scripts/quantize_tower.py --width {args.width} --layers "
            f"{args.layers} --write`.",
        ]
    )
    print(body)
    if args.write:
        replace_section("tower-outliers", body)
    if args.llmcompressor:
        block = write_llmcompressor(args, original, inputs)
        print(block)
        if args.write:
            replace_section("tower-llmcompressor", block)


if __name__ == "__main__":
    main()
