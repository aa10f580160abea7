"""Analysis: trace a model, decide which LayerNorms fold and what folding them needs (a
``FoldPlan``); the modules are listed in docs/contributing.md."""

from __future__ import annotations

from torch import nn

from ..plan import SERVED, FoldPlan, RotationSpec, check_exact
from .auxiliary import analyze_with_auxiliary
from .capture import capture
from .driver import Weights, analyze_capture
from .inputs import ExampleInputs


def analyze(
    model: nn.Module,
    example_inputs: ExampleInputs = None,
    *,
    auxiliary_centering: bool = False,
    weights: Weights = None,
    fuse_affine: bool = False,
    rotate: RotationSpec | tuple[str, int, bool] | None = None,
    exact_outputs: str = SERVED,
) -> FoldPlan:
    """Find the foldable LayerNorms of ``model`` and what folding them needs; a dry run, the model
    is never modified. ``auxiliary_centering`` also places explicit centerings where they pay off,
    ``weights`` gives values for parameters held on the meta device, ``fuse_affine`` moves each
    folded norm's γ and β into its readers, and ``rotate`` (a ``RotationSpec`` or (kind, seed,
    keep_mean)) plans a rotation of the residual stream. ``exact_outputs`` ``"served"`` keeps
    what the model serves exact (its logits, so its generation) and lets the fold change a
    tower's hidden states among its outputs, which the plan lists; ``"all"`` keeps every output.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> analyze(net, torch.randn(2, 8)).foldable[0].name
    '1'
    """
    rotate = RotationSpec.of(rotate)
    check_exact(exact_outputs)
    if not auxiliary_centering:
        return analyze_capture(
            capture(model, example_inputs),
            weights=weights,
            fuse_affine=fuse_affine,
            rotate=rotate,
            exact_outputs=exact_outputs,
        )
    return analyze_with_auxiliary(
        model, example_inputs, weights, fuse_affine, rotate, exact_outputs
    )
