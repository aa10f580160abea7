"""Count foldable LayerNorms on full-size architectures, beside the paper's Table 3.

The models are built on the meta device from their default-size configs, so
nothing is allocated and nothing is downloaded. Run with --write to update the
table in docs/architectures.md.

    python scripts/architecture_table.py [--write]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import transformers

import enjoyln
from enjoyln.units import format_bytes

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _docs import replace_section  # noqa: E402

# (label, model class, config class, config overrides, paper's Table 3 total/strict/practical)
MODELS = [
    ("GPT-2 small", "GPT2LMHeadModel", "GPT2Config", {}, "25 / 0 / 25"),
    ("OPT-125m", "OPTForCausalLM", "OPTConfig", {}, "25 / 0 / 25"),
    (
        "BLOOM-560m",
        "BloomForCausalLM",
        "BloomConfig",
        dict(n_layer=24, hidden_size=1024, n_head=16),
        "6 / 5 / 6 (2 layers)",
    ),
    ("Phi (default config, Phi-1.5 size)", "PhiForCausalLM", "PhiConfig", {}, "25 / 0 / 25"),
    ("GPT-J-6B", "GPTJForCausalLM", "GPTJConfig", {}, "-"),
    ("GPT-NeoX-20B", "GPTNeoXForCausalLM", "GPTNeoXConfig", {}, "-"),
    ("Falcon-7B", "FalconForCausalLM", "FalconConfig", {}, "-"),
    ("ViT-base", "ViTForImageClassification", "ViTConfig", {}, "25 / 0 / 25"),
    ("BERT-base", "BertModel", "BertConfig", {}, "25 / 24 / 25"),
    ("CLIP ViT-B/32", "CLIPModel", "CLIPConfig", {}, "-"),
    ("Whisper (default config)", "WhisperForConditionalGeneration", "WhisperConfig", {}, "-"),
]


def analyze(
    model_cls: str, config_cls: str, overrides: dict
) -> tuple[enjoyln.FoldPlan, enjoyln.FoldPlan, float]:
    config = getattr(transformers, config_cls)(**overrides)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config).eval()
    start = time.perf_counter()
    plan = enjoyln.analyze(model)
    secs = time.perf_counter() - start
    return plan, enjoyln.analyze(model, auxiliary_centering=True), secs


def centered_summary(plan: enjoyln.FoldPlan) -> str:
    kinds = sorted(
        {c.param.rsplit(".", 2)[-2] if "." in c.param else c.param for c in plan.centered}
    )
    text = ", ".join(kinds[:6]) + (", ..." if len(kinds) > 6 else "")
    if plan.untied:
        text += "; untie " + ", ".join(
            f"{u.param} (+{format_bytes(u.nbytes)})" for u in plan.untied
        )
    return text or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="update the table in docs/architectures.md"
    )
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows = [
        "| architecture | LNs | foldable (strict) | with auxiliary centering | centered / untied "
        "(strict) "
        "| paper Table 3 (total / strict / practical) |",
        "|---|---|---|---|---|---|",
    ]
    for label, model_cls, config_cls, overrides, paper in MODELS:
        plan, aux, secs = analyze(model_cls, config_cls, overrides)
        n, k = len(plan.layer_norms), len(plan.foldable)
        if k == n:
            extra = "- (all fold already)"
        elif aux.auxiliary:
            extra = (
                f"{len(aux.foldable)} ({len(aux.auxiliary)} "
                f"centering{'s' if len(aux.auxiliary) != 1 else ''})"
            )
        else:
            extra = f"{len(aux.foldable)} (no centering pays off)"
        rows.append(f"| {label} | {n} | {k} | {extra} | {centered_summary(plan)} | {paper} |")
        print(f"{label}: {k}/{n} foldable ({secs:.2f}s)", file=sys.stderr)
    table = "\n".join(rows)
    print(table)
    if args.write:
        replace_section("arch-table", table)


if __name__ == "__main__":
    main()
