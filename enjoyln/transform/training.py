"""Training with CBWC + RMSNorm, the same optimisation as the LayerNorm model
(docs/how-it-works.md):
``cbwc`` parametrizes each centered weight, ``cbwc_remove`` bakes the centering in."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..analysis import analyze
from ..analysis.inputs import ExampleInputs
from ..plan import FoldPlan
from .steps import InsertCentering, SeparateTies, SwapLayerNorms, UntieParameters
from .tensors import center_, own_copy, owner_of, tensor_at, untie_config


class Centered(nn.Module):
    """The CBWC parametrisation: ``V - V.mean(axis)`` per group (``blocks``: only those), or ``V -
    mean(γV) / γ`` for a LayerScale gain ``γ`` (read live, so it may train too)."""

    def __init__(
        self,
        axis: int,
        groups: int = 1,
        blocks: tuple[int, ...] | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.axis, self.groups, self.blocks = axis, groups, blocks
        self._scale = [scale]  # a reference, not a parameter of this module

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        axis = self.axis % v.dim()
        n = v.shape[axis]
        scale = self._scale[0]
        s = (
            1
            if scale is None
            else scale.reshape(-1).reshape([n if d == axis else 1 for d in range(v.dim())])
        )
        parts = (v * s).unflatten(axis, (self.groups, n // self.groups))
        shift = parts.mean(axis + 1, keepdim=True).expand_as(parts).flatten(axis, axis + 1) / s
        if self.blocks is not None:
            keep = torch.zeros(self.groups, dtype=v.dtype, device=v.device)
            keep[list(self.blocks)] = 1
            shift = shift * keep.repeat_interleave(n // self.groups).reshape(
                [n if d == axis else 1 for d in range(v.dim())]
            )
        return v - shift

    def extra_repr(self) -> str:
        return (
            f"axis={self.axis}, groups={self.groups}"
            + (f", blocks={self.blocks}" if self.blocks else "")
            + (", scaled" if self._scale[0] is not None else "")
        )


def cbwc(
    model: nn.Module,
    example_inputs: ExampleInputs = None,
    *,
    plan: FoldPlan | None = None,
    auxiliary_centering: bool = False,
) -> nn.Module:
    """Prepare ``model`` for training or fine-tuning with CBWC + RMSNorm, in place; the plan is
    computed in eval mode (the structure, not the dropout, decides what folds).

    >>> model = cbwc(model)            # doctest: +SKIP
    >>> train(model); cbwc_remove(model)  # doctest: +SKIP
    """
    if plan is None:
        was_training = model.training
        model.eval()
        try:
            plan = analyze(model, example_inputs, auxiliary_centering=auxiliary_centering)
        finally:
            model.train(was_training)
    drops = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
    dropout = [name for name, m in model.named_modules() if isinstance(m, drops) and m.p > 0]
    if dropout:
        warnings.warn(
            f"enjoyln: {len(dropout)} dropout layers (e.g. {dropout[0]}) are active in training "
            "mode; between a centered layer and its LN they break the exact equivalence with the "
            "LayerNorm model (dropping entries shifts the mean the centering removed). Set their p "
            "to 0 "
            "for an exact trajectory.",
            stacklevel=2,
        )
    for step in (InsertCentering(), UntieParameters(), SwapLayerNorms()):
        step.check(model, plan)
    InsertCentering()(model, plan)
    # tied weights stay tied: the parametrisation goes on the module that needs the centering (the
    # embedding), while the tied head reads the raw tensor, so both train one tensor as in the LN
    # model
    for c in plan.centered:
        module, attr = owner_of(model, c.param)
        scale = tensor_at(model, c.scale) if c.scale else None
        # a tensor centered for two norms (q and k blocks of one projection) stacks two
        if isinstance(getattr(module, attr), nn.Parameter) or parametrize.is_parametrized(
            module, attr
        ):
            parametrize.register_parametrization(
                module, attr, Centered(c.axis, c.groups, c.blocks, scale)
            )
        else:  # a buffer does not train: center it once
            with torch.no_grad():
                center_(getattr(module, attr), c.axis, c.groups, scale, c.blocks)
    SwapLayerNorms()(model, plan)
    model._enjoyln_cbwc_plan = plan
    return model


def cbwc_remove(model: nn.Module) -> nn.Module:
    """Replace every CBWC parametrisation by its current centered value, in place."""
    for module in model.modules():
        if not parametrize.is_parametrized(module):
            continue
        for attr in list(module.parametrizations.keys()):
            if any(isinstance(p, Centered) for p in module.parametrizations[attr]):
                _detach_tied_readers(model, module.parametrizations[attr].original)
                parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
    plan = model.__dict__.pop("_enjoyln_cbwc_plan", None)
    if plan is not None and plan.untied:
        untie_config(model)  # the head now holds the raw tensor, the embedding the centered one
        SeparateTies()(
            model, plan
        )  # other declared ties (BERT's decoder bias) are no longer re-tied on load
    return model


def _detach_tied_readers(model: nn.Module, original: nn.Parameter) -> None:
    """Give modules that read the raw tensor (a tied head) their own copy: baking writes into
    ``original``."""
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if p is original and ".parametrizations." not in name:
            own_copy(model, name)


__all__ = ["cbwc", "cbwc_remove", "Centered"]
