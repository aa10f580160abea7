"""Cases where a careless analysis folds and changes outputs (found by adversarial testing).

For each, the fold must leave every output unchanged: either enjoyln refuses,
or it folds exactly.
"""

import copy

import pytest
import torch
from torch import nn

import enjoyln
from enjoyln.testing import max_relative_diff, perturb

D = 16


def exact(model, x):
    model = perturb(model.eval())
    plan = enjoyln.analyze(model, x)
    folded = enjoyln.fold(copy.deepcopy(model), x, plan=plan)
    with torch.no_grad():
        ref, out = model(x), folded(x)
    ref, out = (ref, out) if isinstance(ref, tuple) else ((ref,), (out,))
    for r, o in zip(ref, out):
        assert max_relative_diff(r, o) < 1e-5, plan.summary()
    return plan


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.ln = nn.Linear(D, D), nn.LayerNorm(D)


class SubAlpha(Base):
    def forward(self, x):  # x - 2 mean(x) is not a centering
        h = self.lin(x)
        return self.ln(torch.sub(h, h.mean(-1, keepdim=True), alpha=2.0))


class CenterOtherAxis(Base):
    def forward(self, x):  # centering over the sequence does not remove a per-token shift
        h = self.lin(x)
        return self.ln(h), h - h.mean(1, keepdim=True)


class CenterSameAxis(Base):
    def forward(self, x):  # ... but over the features it does
        h = self.lin(x)
        return self.ln(h), h - h.mean(-1, keepdim=True)


class SameModuleTwoNames(Base):
    def __init__(self):
        super().__init__()
        self.b = self.lin

    def forward(self, x):
        return self.ln(self.lin(x)), self.b(x)


class SharedModuleTwoCalls(nn.Module):
    def __init__(self):
        super().__init__()
        lin = nn.Linear(D, D)
        self.layers = nn.ModuleList([lin, lin])
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x):
        return self.ln1(self.layers[0](x)), self.ln2(self.layers[1](x * 2))


class InPlaceThroughView(Base):
    def forward(self, x):
        h = self.lin(x)
        v = h.view(2, 5, D)
        h.add_(1.0)  # v sees this too
        return self.ln(v)


class LayerNormStatistics(Base):
    def forward(self, x):
        h = self.lin(x)
        _, mean, _ = torch.native_layer_norm(h, (D,), None, None, 1e-5)
        return self.ln(h), mean


@pytest.mark.parametrize(
    "model,folds",
    [
        (SubAlpha, False),
        (CenterOtherAxis, False),
        (CenterSameAxis, True),
        (SameModuleTwoNames, False),
        (SharedModuleTwoCalls, True),
        (InPlaceThroughView, False),
        (LayerNormStatistics, False),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_fold_leaves_outputs_unchanged(model, folds):
    plan = exact(model(), torch.randn(2, 5, D))
    assert bool(plan.foldable) == folds, plan.summary()
