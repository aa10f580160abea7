"""What rotating the stream does for GPTQ: W8A8 on an OPT-shaped model with planted outlier
features, not rotated, rotated by the dense rotation of version 1 and by the structured one of
version 3 (the default), at width 2048 (OPT-1.3B's) and the odd widths 1600 and 4544.

Each model is an ``OPTForCausalLM`` with random weights perturbed away from init, outliers planted
(40x) in a few features of every writer of the residual stream (the embeddings, each attention's
``out_proj``, each ``fc2``), folded with fused affines (``enjoyln.fold(..., fuse_affine=True)``)
or rotated (``enjoyln.rotate``, ``version=1`` or ``3``), each checked exact before it is quantized.
Then every linear layer that reads a norm (q, k, v, fc1, the head) takes its input in int8 per token
(dynamic, round-to-nearest) and its weight in int8 per output channel, rounded to nearest (RTN) or
by GPTQ calibrated on random token batches; the logits' relative error against the unquantized
original is measured on other batches.

    python scripts/quantize_payoff.py [--widths 2048,1600,4544] [--layers 2] [--seeds 0,1,2]
        [--threads 1] [--write]

About 30 minutes for the three widths and three seeds on a shared 2-core machine, most of it at
width 4544; ``--threads 1`` there, since two threads that wait on each other on a busy core are
slower than one.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import torch
from torch import nn

import enjoyln
from enjoyln.testing import perturb, tiny_model
from enjoyln.testing.quantize import OUTLIERS, input_stats, quantized, relative_error
from enjoyln.transform.rotation import rotation_matrix

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402

VARIANTS = {
    None: "not rotated (fused)",
    1: "dense rotation (version 1)",
    3: "structured rotation (version 3)",
}
"""The rotation version of each model measured, and its name in the table."""


@dataclass(frozen=True)
class Settings:
    """The models and batches of one run (the same seeds for every variant)."""

    layers: int = 2
    vocab: int = 512
    ffn: int = 2
    """``fc1``'s width over the stream's: OPT's is 4; 2 keeps a 4544-wide model to a few minutes per
    variant here."""
    calibration: int = 8
    """Calibration batches for GPTQ."""
    length: int = 128
    """Tokens per batch."""


@dataclass(frozen=True)
class Row:
    width: int
    version: int | None
    seed: int
    coherence: float
    ratio: float
    input_error: float
    rtn: float
    gptq: float
    exact: float
    seconds: float


def build(width: int, settings: Settings, scale: float = 40.0) -> nn.Module:
    """A perturbed OPT with 64-wide heads whose stream writers put ``scale`` times more into the
    ``OUTLIERS`` features."""
    model = perturb(
        tiny_model(
            "opt",
            num_hidden_layers=settings.layers,
            hidden_size=width,
            word_embed_proj_dim=width,
            num_attention_heads=width // 64,
            ffn_dim=settings.ffn * width,
            vocab_size=settings.vocab,
            max_position_embeddings=max(256, settings.length),
            init_std=0.05,
        )
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
    found = []
    for layer in model.model.decoder.layers:
        attention = layer.self_attn
        found += [attention.q_proj, attention.k_proj, attention.v_proj, layer.fc1]
    return found + [model.lm_head]


def batches(settings: Settings, count: int, seed: int) -> dict:
    """``count`` batches of random tokens, as one input."""
    gen = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(0, settings.vocab, (count, settings.length), generator=gen))


def variant(original: nn.Module, version: int | None, seed: int) -> nn.Module:
    """The original folded with fused affines, or rotated by ``version``'s hadamard ``Q``."""
    if version is None:
        return enjoyln.fold(copy.deepcopy(original), fuse_affine=True)
    return enjoyln.rotate(copy.deepcopy(original), kind="hadamard", seed=seed, version=version)


def coherence(width: int, version: int | None, seed: int) -> float:
    """``√n max|Q_ij|``: 1 for a Hadamard matrix, which spreads each feature evenly over all; the
    larger, the more of an outlier stays in a few features (``√n`` unrotated)."""
    if version is None:
        return width**0.5
    q = rotation_matrix(width, "hadamard", seed, True, version)
    return float(q.abs().max()) * width**0.5


def measure(width: int, settings: Settings, versions=tuple(VARIANTS), seeds=(0,)) -> list[Row]:
    """One row per variant (of ``versions``) and rotation seed."""
    original = build(width, settings)
    calib, test = batches(settings, settings.calibration, 1), batches(settings, 4, 2)
    with torch.no_grad():
        expected = original(**test).logits
    rows = []
    for version in versions:
        for seed in seeds if version is not None else seeds[:1]:
            start = time.perf_counter()
            model = variant(original, version, seed)
            exact = relative_error(expected, (model,), test, worst=True)[0]
            if not exact < 1e-4:  # float32 rounding leaves ~1e-6, a wrong rotation ~1
                raise SystemExit(f"width {width}, {VARIANTS[version]}: not exact ({exact:.1e})")
            stats = input_stats(model, readers, test)
            # one quantized copy at a time: at width 4544 each holds gigabytes
            rtn, gptq = (
                relative_error(expected, (quantized(model, readers, calibration=c),), test)[0]
                for c in (None, calib)
            )
            del model
            gc.collect()
            rows.append(
                Row(
                    width,
                    version,
                    seed,
                    coherence(width, version, seed),
                    *stats,
                    rtn,
                    gptq,
                    exact,
                    time.perf_counter() - start,
                )
            )
            print(
                f"width {width}, {VARIANTS[version]}, seed {seed}: exact (max rel diff "
                f"{exact:.1e});"
                f" W8A8 RTN {rtn:.2%}, GPTQ {gptq:.2%} ({rows[-1].seconds:.0f} s)",
                flush=True,
            )
    return rows


def spread(values: list[float]) -> str:
    """The mean of ``values``, with their range where there are several."""
    if len(values) == 1:
        return f"{values[0]:.2%}"
    return f"{mean(values):.2%} ({min(values):.2%} to {max(values):.2%})"


def verdict(rows: list[Row]) -> str:
    """Whether the structured rotation (version 3, the default) is at least as good as the dense one
    (version 1) with GPTQ at each width (the mean over seeds), in words."""
    widths = list(dict.fromkeys(r.width for r in rows))
    gptq = {
        (w, v): [r.gptq for r in rows if (r.width, r.version) == (w, v)]
        for w in widths
        for v in (1, 3)
    }
    worse = [w for w in widths if mean(gptq[w, 3]) > mean(gptq[w, 1])]
    seeds = len(gptq[widths[0], 3])
    said = "; ".join(f"{w}: {mean(gptq[w, 3]):.2%} against {mean(gptq[w, 1]):.2%}" for w in widths)
    over = f", the mean over {seeds} seeds" if seeds > 1 else ""
    if not worse:
        return (
            "With GPTQ the structured rotation is at least as good as the dense one at every "
            f"width ({said}{over})."
        )
    return (
        f"With GPTQ the structured rotation is worse than the dense one at width "
        f"{', '.join(map(str, worse))} ({said}{over})."
    )


def table(rows: list[Row], settings: Settings, command: str) -> str:
    """The docs block: one line per width and model, over its seeds."""
    k = lambda w: w & -w  # noqa: E731
    groups = {}
    for r in rows:
        groups.setdefault((r.width, r.version), []).append(r)
    seeds = sorted({r.seed for r in rows})
    lines = []
    for (w, v), rs in groups.items():
        cells = [
            f"{mean(r.coherence for r in rs):.1f}",
            f"{mean(r.ratio for r in rs):.1f}",
            f"{mean(r.input_error for r in rs):.2%}",
            spread([r.rtn for r in rs]),
            spread([r.gptq for r in rs]),
        ]
        lines.append(f"| {w} = {k(w)} · {w // k(w)} | {VARIANTS[v]} | " + " | ".join(cells) + " |")
    return "\n".join(
        [
            f"OPT-shaped models ({settings.layers} layers, 64-wide heads, fc1 {settings.ffn}x the "
            f"width, vocabulary {settings.vocab}), random perturbed weights, outliers planted in "
            f"features {', '.join(map(str, OUTLIERS))} (40x) of every stream writer. Inputs of "
            "the layers reading a norm (q, k, v, fc1, the head) in int8 per token, their weights "
            f"in int8 per output channel; GPTQ calibrated on {settings.calibration} x "
            f"{settings.length} random tokens, errors measured on 4 x {settings.length} others. "
            + (
                f"Rotated models: the mean over rotation seeds {', '.join(map(str, seeds))} (the "
                "logits errors with their range beside them). "
                if len(seeds) > 1
                else f"Rotation seed {seeds[0]}. "
            )
            + f"{machine()}:",
            "",
            "| width (2^k · odd) | model | √n max\\|Q\\| | max / RMS of the inputs | int8 error "
            "of the inputs | logits error, W8A8 RTN | logits error, W8A8 GPTQ |",
            "|---|---|---|---|---|---|---|",
            *lines,
            "",
            verdict(rows)
            + " Unquantized, every model computes the original's logits (max rel diff at most "
            f"{max(r.exact for r in rows):.1e}).",
            f"Command: `{command}`.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="2048,1600,4544")
    parser.add_argument("--layers", type=int, default=Settings.layers)
    parser.add_argument(
        "--ffn", type=int, default=Settings.ffn, help="fc1's width over the stream's"
    )
    parser.add_argument("--seeds", default="0", help="rotation seeds, e.g. 0,1,2")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--write", action="store_true", help="put the table into docs/quantization.md"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Settings(layers=args.layers, ffn=args.ffn)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    rows = [r for w in args.widths.split(",") for r in measure(int(w), settings, seeds=seeds)]
    command = "python scripts/quantize_payoff.py " + " ".join(sys.argv[1:])
    body = table(rows, settings, command.replace(" --write", "") + " --write")
    print(body)
    if args.write:
        replace_section("quantize-payoff", body)


if __name__ == "__main__":
    main()
