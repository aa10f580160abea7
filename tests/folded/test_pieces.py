"""A tensor worked on a piece of whole vectors at a time gets the whole tensor's bits."""

import pytest
import torch

from enjoyln.folded.pieces import pieces
from enjoyln.ops import rotate as R
from enjoyln.transform.tensors import center_


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize(
    "shape,axis,piece_bytes",
    [
        ((64, 5), 0, 700),  # columns 2 + 3: a lone fifth column would be summed in another order
        ((7, 64), 1, 600),  # rows, two at a time, the last one alone
        ((3, 64, 6), 1, 1000),  # columns of each outer index
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_give_the_whole_tensors_bits(shape, axis, piece_bytes, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    t = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    table = R.structured(64, 5, True)
    gain = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
    whole = R.rotate_(center_(t.clone(), axis), axis, table, scale=gain)
    got = torch.empty_like(t)
    made = pieces(shape, axis, t.element_size(), piece_bytes * t.element_size() // 4)
    assert len(made) > 1 and all(p.shape[1] > 1 for p in made if p.axis == 0)
    for p in made:
        piece = p.of(t).contiguous()
        R.rotate_(center_(piece, p.axis), p.axis, table, scale=gain)
        p.of(got).copy_(piece)
        raw = got.view(-1).view(torch.uint8).numpy().tobytes()
        for offset, start, nbytes in p.runs(t.element_size()):
            ours = piece.view(-1).view(torch.uint8).numpy().tobytes()[start : start + nbytes]
            assert raw[offset : offset + nbytes] == ours
    assert torch.equal(bits(got), bits(whole))
