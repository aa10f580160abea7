"""Why rotate: planted outlier features, int8 activations and low-bit weights, before and after.

Trained LLMs carry a few features in the residual stream that are tens of
times larger than the rest; every linear layer that reads a norm's output then
sees them, and quantizing its input per token spends the whole int8 range on
them. A rotation of the stream spreads them over all features.

The path, on a GPT-2-style model with random weights (perturbed away from
init) and outliers planted in three features of every stream writer:

1. ``enjoyln.fold(model, fuse_affine=True)``: weightless RMSNorms, γ and β in
   the next layers; ``enjoyln.rotate``: the same, with the stream rotated by the
   structured randomized Hadamard rotation, and by the dense one of earlier
   releases (``version=1``), side by side. All are exact (checked here).
2. The activations entering each linear layer that reads a norm: their
   max-to-RMS ratio, and the error of int8 per-token round-to-nearest.
3. The whole model with every such input quantized to int8 per token and
   its weights to int8 or int4 per output channel (round-to-nearest, no
   GPTQ): the error of its logits against the full-precision model.
   ``scripts/quantize_payoff.py`` measures the same with GPTQ, on OPT-shaped models.

With random weights a rotation cannot make the weights easier to quantize
(they are Gaussian either way), so the int4 row shows weight noise, which no
rotation removes; trained weights have outliers of their own, which it does.

    python examples/rotate_then_quantize.py [--layers 4] [--width 512] [--odd-widths 1600,4544]
    [--write]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

import enjoyln
from enjoyln.testing import perturb, tiny_model
from enjoyln.testing.quantize import OUTLIERS, input_stats, quantized, relative_error


def build(layers: int, width: int, vocab: int, seed: int = 0, scale: float = 40.0) -> nn.Module:
    """A perturbed GPT-2 whose stream writers put ``scale`` times more into a few features."""
    model = perturb(
        tiny_model(
            "gpt2",
            seed=seed,
            n_layer=layers,
            n_embd=width,
            n_head=max(1, width // 64),
            vocab_size=vocab,
            n_positions=256,
            initializer_range=0.05,
        ),
        seed=seed,
    )
    feats = [f % width for f in OUTLIERS]
    with torch.no_grad():
        t = model.transformer
        for table in (t.wte.weight, t.wpe.weight):
            table[:, feats] *= scale
        for block in t.h:  # Conv1D weights are [in, out]: the stream is the output axis
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight[:, feats] *= scale
                proj.bias[feats] *= scale
    return model.eval()


def norm_readers(model: nn.Module) -> list[nn.Module]:
    """The layers whose input is a norm's output: attention and MLP inputs, the head."""
    t = model.transformer
    return [m for b in t.h for m in (b.attn.c_attn, b.mlp.c_fc)] + [model.lm_head]


def measure(
    layers: int, width: int, vocab: int, dense: bool = True
) -> list[tuple[str, float, float, float, float]]:
    """(model, max/RMS, int8 input error, W8A8 and W4A8 logits errors) for the fused model and both
    hadamard rotations: the structured one (version 2, the default) and the dense one of earlier
    releases (version 1)."""
    torch.manual_seed(0)
    original = build(layers, width, vocab)
    ids = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(1))
    models = {
        "folded, fused (not rotated)": enjoyln.fold(copy.deepcopy(original), fuse_affine=True),
        "rotated, structured Hadamard": enjoyln.rotate(
            copy.deepcopy(original), kind="hadamard", seed=0
        ),
    }
    if dense:
        models["rotated, dense (version 1)"] = enjoyln.rotate(
            copy.deepcopy(original), kind="hadamard", seed=0, version=1
        )
    rows = []
    for name, model in models.items():
        report = enjoyln.check(original, model)
        assert report.passed, report.summary()
        print(
            f"{'fused' if name.startswith('folded') else 'rotated'}: exact against the original "
            f"(width {width}, {name}; max rel diff {report.max_rel_diff:.2g})"
        )
        ratio, err8 = input_stats(model, norm_readers, dict(input_ids=ids))
        w8, w4 = relative_error(
            original, (quantized(model, norm_readers, bits) for bits in (8, 4)), dict(input_ids=ids)
        )
        rows.append((name, ratio, err8, w8, w4))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument(
        "--odd-widths", default="", help="more widths, e.g. 1600,4544 (with --odd-layers layers)"
    )
    parser.add_argument("--odd-layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--no-dense", action="store_true", help="leave out the dense rotation of earlier releases"
    )
    parser.add_argument(
        "--write", action="store_true", help="put the table into docs/how-it-works.md"
    )
    args = parser.parse_args()

    runs = [(args.layers, args.width)] + [
        (args.odd_layers, int(w)) for w in args.odd_widths.split(",") if w
    ]
    table = {
        (layers, width): measure(layers, width, args.vocab, not args.no_dense)
        for layers, width in runs
    }
    base, rot, *dense = table[runs[0]]
    earlier = (
        f" (the dense rotation of earlier releases: {base[2] / dense[0][2]:.1f}x and "
        f"{base[3] / dense[0][3]:.1f}x)"
        if dense
        else ""
    )
    k = lambda w: w & -w  # noqa: E731
    lines = [
        f"GPT-2-style models, random perturbed weights, outliers planted in features "
        f"{', '.join(str(f) for f in OUTLIERS)} (40x) of every stream writer; 4 x 128 tokens. "
        "Inputs of the layers "
        "reading a norm (attention and MLP inputs, the head), and the logits with those inputs in "
        "int8 per token "
        "and their weights round-to-nearest per output channel:",
        "",
        "| width (2^k · odd) | layers | model | max / RMS of the inputs | int8 per-token error of "
        "the inputs "
        "| logits error, W8A8 | logits error, W4A8 |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {width} = {k(width)} · {width // k(width)} | {layers} | {n} | {r:.1f} | {e:.2%} | "
            f"{q8:.2%} | {q4:.2%} |"
            for (layers, width), rows in table.items()
            for n, r, e, q8, q4 in rows
        ),
        "",
        f"At width {args.width} the rotation lowers the int8 activation error "
        f"{base[2] / rot[2]:.1f}x and the W8A8 "
        f"logits error {base[3] / rot[3]:.1f}x{earlier}. At 4-bit weights the error is the "
        "weights' own rounding, which a rotation "
        "of random (Gaussian) weights cannot reduce. Every unquantized model computes exactly what "
        "the original does.",
        "Command: `python "
        f"examples/rotate_then_quantize.py{' --odd-widths ' + args.odd_widths if args.odd_widths else ''}"  # noqa: E501
        f"{' --odd-layers ' + str(args.odd_layers) if args.odd_widths else ''} --write`.",
    ]
    body = "\n".join(lines)
    print(body)
    if base[2] < 4 * rot[2]:
        raise SystemExit(
            f"the rotation lowered the int8 activation error only {base[2] / rot[2]:.1f}x"
        )
    if args.write:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
        from _docs import replace_section

        replace_section("outliers", body)


if __name__ == "__main__":
    main()
