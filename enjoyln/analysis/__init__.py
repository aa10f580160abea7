"""Analysis: trace a model, decide which LayerNorms fold and what folding them needs (a ``FoldPlan``).

The modules, in the order they build on each other: ``inputs`` (example inputs),
``capture`` (the ``torch.export`` trace), ``graph`` (the indexed graph), ``rules``
(what each op does to a zero mean), ``dataflow`` and ``soundness`` (the proof),
``affine`` (fusing a norm's affine into its readers), ``rotation`` (the proof that
the residual stream can be rotated), ``driver`` (runs them into a plan),
``auxiliary`` (auxiliary centerings) and ``explain`` (pictures of the proof).
"""

from __future__ import annotations

from torch import nn

from ..plan import FoldPlan, RotationSpec
from .auxiliary import analyze_with_auxiliary
from .capture import capture
from .driver import Weights, analyze_capture
from .inputs import ExampleInputs


def analyze(model: nn.Module, example_inputs: ExampleInputs = None, *,
            auxiliary_centering: bool = False, weights: Weights = None, fuse_affine: bool = False,
            rotate: RotationSpec | tuple[str, int, bool] | None = None) -> FoldPlan:
    """Find the foldable LayerNorms of ``model`` and what folding them needs.

    A dry run: the model is traced, never modified. With
    ``auxiliary_centering``, explicit centerings are also placed where each
    makes more LNs foldable than it costs (``plan.auxiliary``). ``weights``
    gives values for parameters the model holds on the meta device, where a
    rule depends on them (a LayerScale gain with a zero entry does not fold).
    With ``fuse_affine``, each folded norm's γ and β are also moved into the
    linear layers that read its output, where that is sound (``analysis.affine``).
    With ``rotate`` (a ``RotationSpec``, or the tuple (kind, seed, keep_mean)), the
    plan also rotates the residual stream where that is proved exact
    (``analysis.rotation``), or says why not.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> analyze(net, torch.randn(2, 8)).foldable[0].name
    '1'
    """
    rotate = RotationSpec.of(rotate)
    if not auxiliary_centering:
        return analyze_capture(capture(model, example_inputs), weights=weights, fuse_affine=fuse_affine,
                               rotate=rotate)
    return analyze_with_auxiliary(model, example_inputs, weights, fuse_affine, rotate)
