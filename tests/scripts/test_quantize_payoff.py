"""scripts/quantize_payoff.py and the simulated quantization it shares (enjoyln.testing.quantize):
GPTQ beats round-to-nearest where it is meant to, and a rotation pays off with planted outliers."""

import sys
from pathlib import Path

import pytest
import torch

from enjoyln.testing.quantize import gptq, quantize_rows

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import quantize_payoff as payoff  # noqa: E402 - the script beside the others


@pytest.mark.parametrize("bits", [8, 4])
def test_gptq_lowers_the_layers_output_error_on_its_calibration_data(bits):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen)
    # correlated inputs with a few large features, as a norm's readers see them
    x = torch.randn(256, 96, generator=gen) @ torch.randn(96, 96, generator=gen) / 10
    x[:, :3] *= 20
    x[:, 7] = 0  # an input that is always zero: its column is left at zero
    q = gptq(w, x.double().T @ x.double(), bits)
    rtn = quantize_rows(w, bits)
    out = lambda v: float(((w - v) @ x.T).norm())  # noqa: E731
    assert out(q) < 0.7 * out(rtn)
    # still on round-to-nearest's grid: each row's own scale, at most 2^(bits-1)-1 steps
    scale = w.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)
    steps = q / scale
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    assert float(steps.abs().max()) <= 2 ** (bits - 1) - 1 + 1e-3
    assert not torch.equal(q, rtn)
    assert not q[:, 7].any() and rtn[:, 7].any()


def test_a_rotation_lowers_the_w8a8_error_with_planted_outliers():
    settings = payoff.Settings(layers=1, vocab=64, calibration=2, length=32)
    fused, rotated = payoff.measure(64, settings, versions=(None, 3))
    assert (fused.version, rotated.version) == (None, 3)
    assert fused.exact < 1e-4 and rotated.exact < 1e-4  # each exact before it is quantized
    assert fused.ratio > 2.5 * rotated.ratio  # max / RMS of the readers' inputs: outliers spread
    assert rotated.input_error < fused.input_error / 2
    assert rotated.rtn < fused.rtn / 2 and rotated.gptq < fused.gptq / 2  # the W8A8 logits
    assert 0 < rotated.gptq < rotated.rtn  # quantized, and GPTQ better than round-to-nearest
