"""Where a tensor differs from what it must be: the largest difference and its index, in chunks."""

import math

import torch

from enjoyln.checking import verify
from enjoyln.checking.verify import locate


def test_the_largest_difference_and_its_index():
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cand = expected.clone()
    cand[1, 2] += 0.5
    cand[2, 3] -= 2.0
    d = locate("w", cand, expected)
    assert (d.tensor, d.max_abs_diff, d.index, d.value, d.expected, d.dtype) == (
        "w",
        2.0,
        [2, 3],
        9.0,
        11.0,
        "float32",
    )
    assert d.describe() == "max abs diff 2 at [2, 3] (9.0 where it must be 11.0)"
    assert locate("w", expected, expected.clone()) is None


def test_neighbouring_float32_values_print_apart():
    expected = torch.tensor([0.1], dtype=torch.float32)
    cand = torch.nextafter(expected, torch.tensor([1.0]))
    assert (
        locate("w", cand, expected).describe()
        == "max abs diff 7.45e-09 at [0] (0.10000001 where it must be 0.1)"
    )


def test_a_nan_is_infinitely_far_and_equal_bits_are_never_a_zero_difference():
    nan = locate("w", torch.tensor([1.0, math.nan, 3.0]), torch.tensor([1.5, 2.0, 3.0]))
    assert (nan.max_abs_diff, nan.index) == (math.inf, [1])
    sign = locate(
        "w", torch.tensor([[1.0, -0.0]]), torch.tensor([[1.0, 0.0]])
    )  # equal as values, not as bits
    assert (sign.max_abs_diff, sign.index) == (None, [0, 1])
    assert sign.describe() == "bits differ at [0, 1] (-0.0 where it must be 0.0)"


def test_chunks_keep_the_largest_across_them(monkeypatch):
    monkeypatch.setattr(verify, "CHUNK", 4)
    expected = torch.zeros(2, 5, dtype=torch.float64)
    cand = expected.clone()
    cand[0, 1], cand[1, 3] = 1.0, -3.0  # flat 1 in the first chunk, flat 8 in the third
    d = locate("b", cand, expected)
    assert (d.max_abs_diff, d.index, d.value, d.dtype) == (3.0, [1, 3], -3.0, "float64")
    ints = locate("ids", torch.tensor([4, 7]), torch.tensor([4, 5]))
    assert ints.describe() == "max abs diff 2 at [1] (7 where it must be 5)"
