"""What rotating the stream does for GPTQ: W8A8 on an OPT-shaped model with planted outlier
features, not rotated, rotated by the dense rotation of version 1 and by the structured one of
version 2, at widths 2048 (OPT-1.3B's) and the odd widths 1600 and 4544.

Each model is an ``OPTForCausalLM`` with random weights perturbed away from init, outliers planted
(40x) in a few features of every writer of the residual stream (the embeddings, each attention's
``out_proj``, each ``fc2``), folded with fused affines (``enjoyln.fold(..., fuse_affine=True)``)
or rotated (``enjoyln.rotate``, ``version=1`` or ``2``), each checked exact before it is quantized.
Then every linear layer that reads a norm (q, k, v, fc1, the head) takes its input in int8 per token
(dynamic, round-to-nearest) and its weight in int8 per output channel, rounded to nearest (RTN) or by
GPTQ calibrated on random token batches; the logits' relative error against the unquantized
original is measured on other batches.

    python scripts/quantize_payoff.py [--widths 2048,1600,4544] [--layers 2] [--write]
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch
from torch import nn

import enjoyln
from enjoyln.testing import perturb, tiny_model
from enjoyln.testing.quantize import OUTLIERS, input_stats, quantized, relative_error
from enjoyln.transform.rotation import rotation_matrix

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402

VARIANTS = {
    "not rotated (fused)": None,
    "dense rotation (version 1)": 1,
    "structured rotation (version 2)": 2,
}


def build(layers: int, width: int, vocab: int, seed: int = 0, scale: float = 40.0) -> nn.Module:
    """A perturbed OPT of OPT-1.3B's shape ratios (64-wide heads, ``fc1`` 4x the width) whose
    stream writers put ``scale`` times more into the ``OUTLIERS`` features."""
    model = perturb(
        tiny_model(
            "opt",
            seed=seed,
            num_hidden_layers=layers,
            hidden_size=width,
            word_embed_proj_dim=width,
            num_attention_heads=width // 64,
            ffn_dim=4 * width,
            vocab_size=vocab,
            max_position_embeddings=256,
            init_std=0.05,
        ),
        seed=seed,
    )
    feats = [f % width for f in OUTLIERS]
    with torch.no_grad():
        decoder = model.model.decoder
        for table in (decoder.embed_tokens.weight, decoder.embed_positions.weight):
            table[:, feats] *= scale
        for layer in decoder.layers:  # nn.Linear weights are [out, in]: the stream is the rows
            for proj in (layer.self_attn.out_proj, layer.fc2):
                proj.weight[feats] *= scale
                proj.bias[feats] *= scale
    return model.eval()


def readers(model: nn.Module) -> list[nn.Module]:
    """The layers whose input is a norm's output (q, k, v, fc1 and the head), in the order they
    run."""
    attention = lambda layer: layer.self_attn  # noqa: E731
    return [
        m
        for layer in model.model.decoder.layers
        for m in (attention(layer).q_proj, attention(layer).k_proj, attention(layer).v_proj)
        + (layer.fc1,)
    ] + [model.lm_head]


def batches(vocab: int, count: int, seed: int, length: int = 128) -> dict:
    return dict(input_ids=torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(seed)))


def variant(original: nn.Module, version: int | None) -> nn.Module:
    if version is None:
        return enjoyln.fold(copy.deepcopy(original), fuse_affine=True)
    return enjoyln.rotate(copy.deepcopy(original), kind="hadamard", seed=0, version=version)


def coherence(width: int, version: int | None) -> float:
    """``sqrt(n) max |Q_ij|``: 1 for a Hadamard matrix, which spreads one feature evenly over all;
    the larger, the more of an outlier stays in a few features."""
    if version is None:
        return float(width) ** 0.5
    return float(rotation_matrix(width, "hadamard", 0, True, version).abs().max()) * width**0.5


def measure(layers: int, width: int, vocab: int, calibration: int) -> list[tuple]:
    """One row per variant: (name, coherence, max/RMS, int8 input error, RTN and GPTQ W8A8 logits
    errors, max rel diff unquantized, seconds)."""
    original = build(layers, width, vocab)
    calib, test = batches(vocab, calibration, seed=1), batches(vocab, 4, seed=2)
    rows = []
    for name, version in VARIANTS.items():
        start = time.perf_counter()
        model = variant(original, version)
        exact = relative_error(original, (model,), test, worst=True)[0]
        if not exact < 1e-4:  # float32 rounding leaves ~1e-6; a wrong rotation leaves ~1
            raise SystemExit(f"width {width}, {name}: not exact (max rel diff {exact:.1e})")
        ratio, err8 = input_stats(model, readers, test)
        rtn, gptq = quantized(model, readers), quantized(model, readers, calibration=calib)
        errors = relative_error(original, (rtn, gptq), test)
        seconds = time.perf_counter() - start
        rows.append((name, coherence(width, version), ratio, err8, *errors, exact, seconds))
        print(f"width {width}, {name}: exact (max rel diff {exact:.1e}); "
              f"RTN {errors[0]:.2%}, GPTQ {errors[1]:.2%} ({seconds:.0f} s)", flush=True)
        del model, rtn, gptq
        gc.collect()
    return rows


def verdict(table: dict) -> str:
    """Whether version 2 is at least as good as version 1 at each width, in words."""
    worse = [
        f"{w} ({v2[5]:.2%} against {v1[5]:.2%})"
        for w, (_, v1, v2) in table.items()
        if v2[5] > v1[5]
    ]
    if not worse:
        return "With GPTQ the structured rotation is at least as good as the dense one at every width."
    return "With GPTQ the structured rotation is worse than the dense one at width " + ", ".join(worse) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="2048,1600,4544")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--calibration", type=int, default=8, help="calibration batches of 128 tokens")
    parser.add_argument("--write", action="store_true", help="put the table into docs/quantization.md")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",") if w]
    table = {w: measure(args.layers, w, args.vocab, args.calibration) for w in widths}
    k = lambda w: w & -w  # noqa: E731
    body = "\n".join([
        f"OPT-shaped models ({args.layers} layers, 64-wide heads, fc1 4x the width, vocabulary "
        f"{args.vocab}), random perturbed weights, outliers planted in features "
        f"{', '.join(str(f) for f in OUTLIERS)} (40x) of every stream writer. Inputs of the layers "
        "reading a norm (q, k, v, fc1, the head) in int8 per token, their weights in int8 per output "
        f"channel; GPTQ calibrated on {args.calibration} x 128 random tokens, errors measured on 4 x "
        f"128 others; {machine()}:",
        "",
        "| width (2^k · odd) | model | √n max\\|Q\\| | max / RMS of the inputs | int8 error of the inputs "
        "| logits error, W8A8 RTN | logits error, W8A8 GPTQ |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {w} = {k(w)} · {w // k(w)} | {n} | {c:.1f} | {r:.1f} | {e:.2%} | {a:.2%} | {g:.2%} |"
            for w, rows in table.items()
            for n, c, r, e, a, g, *_ in rows
        ),
        "",
        verdict(table),
        f"Command: `python scripts/quantize_payoff.py --widths {args.widths} --layers {args.layers} --write`.",
    ])
    print(body)
    if args.write:
        replace_section("quantize-payoff", body)


if __name__ == "__main__":
    main()
