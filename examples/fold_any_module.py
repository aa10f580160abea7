"""Fold a plain PyTorch model (not from Hugging Face): pass example inputs.

python examples/fold_any_module.py
"""

import copy

import torch
from torch import nn

import enjoyln
from enjoyln.testing import perturb


class Block(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.ln_f(self.blocks(self.emb(ids))))


if __name__ == "__main__":
    model = perturb(Net().eval())
    ids = torch.randint(0, 100, (2, 16))
    plan = enjoyln.analyze(model, ids)
    print(plan.summary())
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    print(enjoyln.check(model, folded, ids).summary())
