"""Fine-tune a small GPT-2-style model on synthetic text, three ways.

1. LN: the original LayerNorm model.
2. RMSNorm swap: every LN replaced by RMSNorm, weights left as they are
   (not equivalent: the model starts from a different function).
3. CBWC + RMSNorm: ``enjoyln.cbwc``, which trains exactly like the LN model
   when dropout is off (the paper's Prop. 3.2).

The text comes from a random Markov chain, so there is structure to learn.
Reports the median step time and the losses, and saves a PNG of the curves. It trains
three models for --steps steps each (450 training steps at the default 150): minutes on a
laptop CPU. After the first steps it prints how long the whole run will take there.

    pip install 'enjoyln[plot]'
    python examples/finetune_cbwc.py [--steps 150] [--dropout 0.0] [--out loss_curves.png]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import enjoyln
from enjoyln.testing import perturb, tiny_model


def markov_text(
    steps: int, batch: int, length: int, vocab: int, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    transition = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 3, dim=-1)
    batches = []
    for _ in range(steps):
        ids = torch.empty(batch, length, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(1, length):
            ids[:, t] = torch.multinomial(transition[ids[:, t - 1]], 1, generator=gen).squeeze(1)
        batches.append(ids)
    return batches


def train(
    model: torch.nn.Module, data: list[torch.Tensor], lr: float, estimate_for: int = 0
) -> tuple[list[float], float]:
    """With ``estimate_for`` (the steps of every run together), say after 3 steps how long they will
    take."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses, times = [], []
    for ids in data:
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if estimate_for and len(times) == min(3, len(data)):
            total = statistics.median(times) * estimate_for
            print(
                f"{len(times)} steps took {sum(times):.1f} s: the {estimate_for} steps of the "
                "three runs take "
                f"about {total / 60:.1f} min here",
                flush=True,
            )
    return losses, statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="loss_curves.png")
    args = parser.parse_args()
    vocab = 128
    base = tiny_model(
        "gpt2",
        n_layer=4,
        n_embd=128,
        n_head=4,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        tie_word_embeddings=False,
        vocab_size=vocab,
    )
    perturb(base)
    data = markov_text(args.steps, batch=8, length=64, vocab=vocab)

    swapped = copy.deepcopy(base)
    for name, module in list(swapped.named_modules()):
        if isinstance(module, torch.nn.LayerNorm):
            parent, _, attr = name.rpartition(".")
            setattr(swapped.get_submodule(parent), attr, enjoyln.RMSNorm.from_layer_norm(module))
    variants = {
        "LN": copy.deepcopy(base),
        "RMSNorm swap": swapped,
        "CBWC + RMSNorm": enjoyln.cbwc(copy.deepcopy(base)),
    }
    curves = {}
    for name, model in variants.items():
        torch.manual_seed(0)  # same dropout masks where there is dropout
        losses, step_ms = train(
            model, data, args.lr, estimate_for=0 if curves else len(variants) * args.steps
        )
        curves[name] = losses
        print(f"{name:15s} step {step_ms:6.1f} ms   loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    gap = max(abs(a - b) / a for a, b in zip(curves["LN"], curves["CBWC + RMSNorm"]))
    print(
        f"largest relative loss gap, CBWC vs LN: {gap:.2e}"
        + ("" if args.dropout else " (dropout 0: exact up to rounding)")
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install 'enjoyln[plot]' for the plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(losses, label=name, lw=1.5, ls="--" if name.startswith("CBWC") else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT-2-style model on Markov text (dropout {args.dropout})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
