"""GroupNorm: grouped CBWC where it is exact, an honest refusal where it cannot be."""

import copy

import torch
from torch import nn

import enjoyln
from enjoyln.testing import perturb
from conftest import assert_same_outputs


class MLP(nn.Module):
    """Dense layers, GroupNorm with perturbed affine, ReLU, repeated."""

    def __init__(self, groups=4, width=32):
        super().__init__()
        self.fc1, self.gn1 = nn.Linear(12, width), nn.GroupNorm(groups, width)
        self.fc2, self.gn2 = nn.Linear(width, width), nn.GroupNorm(groups, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = torch.relu(self.gn1(self.fc1(x)))
        return self.head(torch.relu(self.gn2(self.fc2(x))))


class ConvNet(nn.Module):
    """Dense conv, GroupNorm, ReLU, repeated; or a depthwise conv first."""

    def __init__(self, depthwise=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.gn1 = nn.GroupNorm(4, 16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=16 if depthwise else 1)
        self.gn2 = nn.GroupNorm(4, 16)

    def forward(self, x):
        return torch.relu(self.gn2(self.conv2(torch.relu(self.gn1(self.conv1(x))))))


def test_group_norm_after_linear_folds_exactly():
    model = perturb(MLP().eval())
    x = torch.randn(5, 12)
    plan = enjoyln.analyze(model, x)
    assert [(e.name, e.foldable, e.norm, e.groups) for e in plan.layer_norms] == [
        ("gn1", True, "group_norm", 4),
        ("gn2", True, "group_norm", 4),
    ]
    assert {(c.param, c.axis, c.groups) for c in plan.centered} == {
        ("fc1.weight", 0, 4),
        ("fc1.bias", 0, 4),
        ("fc2.weight", 0, 4),
        ("fc2.bias", 0, 4),
    }
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert isinstance(folded.gn1, enjoyln.GroupRMSNorm)
    w = folded.fc1.weight.detach().double().reshape(4, 8, 12)
    assert w.mean(1).abs().max() < 1e-6  # every group of output rows is centered
    assert_same_outputs(model, folded, x)
    assert_same_outputs(model, folded, torch.randn(7, 12) * 3)


def test_conv_net_group_norm_is_refused_with_the_reason():
    """Exact folding is impossible here: GroupNorm averages over positions, and
    no weight change shifts a conv output by a constant across positions."""
    model = perturb(ConvNet().eval())
    x = torch.randn(2, 3, 8, 8)
    plan = enjoyln.analyze(model, x)
    for e in plan.layer_norms:
        assert not e.foldable and "averages over the 64 positions" in e.reason
    assert enjoyln.fold(copy.deepcopy(model), x).gn1.__class__ is nn.GroupNorm
    # ... and the naive grouped fold really would change the outputs
    naive = copy.deepcopy(model)
    with torch.no_grad():
        for conv in (naive.conv1, naive.conv2):
            w = conv.weight.unflatten(0, (4, 4))
            w -= w.mean(1, keepdim=True)
            b = conv.bias.unflatten(0, (4, 4))
            b -= b.mean(1, keepdim=True)
    naive.gn1, naive.gn2 = (enjoyln.GroupRMSNorm.from_group_norm(g) for g in (naive.gn1, naive.gn2))
    with torch.no_grad():
        assert (model(x) - naive(x)).abs().max() > 1e-2


def test_depthwise_conv_is_refused():
    plan = enjoyln.analyze(perturb(ConvNet(depthwise=True).eval()), torch.randn(2, 3, 1, 1))
    assert plan["gn1"].foldable
    assert not plan["gn2"].foldable and "depthwise" in plan["gn2"].reason


def test_instance_norm_is_refused():
    net = nn.Sequential(
        nn.Linear(6, 8), nn.Unflatten(1, (4, 2)), nn.InstanceNorm1d(4, affine=True)
    ).eval()
    plan = enjoyln.analyze(net, torch.randn(3, 6))
    (e,) = plan.layer_norms
    assert not e.foldable and "one channel" in e.reason


def test_group_shift_cannot_reach_a_layer_norm():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.gn = nn.GroupNorm(2, 8)
            self.ln = nn.LayerNorm(8)

        def forward(self, x):
            h = self.fc(x)
            return self.gn(h), self.ln(h)

    model = perturb(Mixed().eval())
    x = torch.randn(4, 8)
    plan = enjoyln.analyze(model, x)
    # the LN needs full centering, the GroupNorm grouped centering, of the same weight
    assert plan["ln"].foldable and not plan["gn"].foldable
    assert "needs centered as a whole" in plan["gn"].reason
    folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
    assert_same_outputs(model, folded, x)


def test_group_rms_norm_module():
    gn = nn.GroupNorm(2, 6)
    rms = enjoyln.GroupRMSNorm.from_group_norm(gn)
    assert rms.state_dict().keys() == gn.state_dict().keys()
    x = torch.randn(3, 6)
    x = (x.unflatten(1, (2, 3)) - x.unflatten(1, (2, 3)).mean(-1, keepdim=True)).flatten(1)
    torch.testing.assert_close(rms(x), gn(x), atol=1e-5, rtol=1e-5)
