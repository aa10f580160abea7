"""torch.compile side by side: both models compiled, compared with the eager original, their
kernels counted."""

import copy

import torch

from enjoyln.bench_compiled import compiled_comparison
from enjoyln.testing import perturb, tiny_model
from enjoyln.transform.steps import fold


def test_the_compiled_fold_computes_the_original_and_its_norm_kernels_are_counted():
    original = perturb(tiny_model("gpt2"), seed=3).eval()
    folded = fold(copy.deepcopy(original))
    inputs = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(0))
    r = compiled_comparison(original, folded, inputs, repeats=3)
    assert r.max_rel_diff < 1e-5
    assert r.kernels[0] > 0 and r.kernels[1] > 0
    # a tiny GPT-2's norms (two per block and the final one) compile to kernels on both sides
    assert 0 < r.norm_kernels[0] <= r.kernels[0] and 0 < r.norm_kernels[1] <= r.kernels[1]
    assert r.fused_add_norms <= r.norm_kernels[1]
    assert r.latency.ratio > 0 and all(s > 0 for s in r.compile_s)
    # a folded model that computes something else is caught
    with torch.no_grad():
        next(p for n, p in folded.named_parameters() if n.endswith("c_fc.weight")).mul_(1.5)
    assert compiled_comparison(original, folded, inputs, repeats=3).max_rel_diff > 1e-3
