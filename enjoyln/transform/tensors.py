"""The tensor math of a fold (``center_``, ``fuse_``, in float64, in place) and its lookups; the
steps, the streamed writer and the static check share it, so all three give the same bits."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Collection, Iterator, Sequence

import torch
from torch import nn

from ..errors import PlanError
from ..ops import center as centering_kernel
from ..ops.rotate import RotationUnavailable, dot_vectors
from ..plan import Centering, FoldPlan, Fused
from .rotation import slabs


def owner_of(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module holding the tensor ``fqn`` names, and its attribute name; PlanError if none."""
    path, _, attr = fqn.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise PlanError(f"the plan names {fqn}, which this model does not have") from None
    if not isinstance(getattr(module, attr, None), torch.Tensor):
        raise PlanError(f"the plan names {fqn}, which this model does not have")
    return module, attr


def tensor_at(model: nn.Module, fqn: str) -> torch.Tensor:
    module, attr = owner_of(model, fqn)
    return getattr(module, attr)


def own_copy(model: nn.Module, fqn: str) -> None:
    """Give the name ``fqn`` a copy of its tensor of its own (a tied name keeps the old one)."""
    module, attr = owner_of(model, fqn)
    old = getattr(module, attr)
    copy = old.detach().clone()
    setattr(
        module,
        attr,
        nn.Parameter(copy, old.requires_grad) if isinstance(old, nn.Parameter) else copy,
    )


def untie_config(model: nn.Module) -> None:
    """Turn ``tie_word_embeddings`` off in ``model``'s config (and its text config), so a reload
    does not re-tie."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    for cfg in (config, get_text() if callable(get_text) else None):
        if hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False


def declared_ties(model: nn.Module) -> dict[str, str]:
    """Every tie (target -> source) the model's classes declare, whether or not its config applies
    them now."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if not callable(expand):
        return {}
    configs = {
        id(m.config): m.config
        for m in model.modules()
        if hasattr(getattr(m, "config", None), "tie_word_embeddings")
    }
    saved = {key: cfg.tie_word_embeddings for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg.tie_word_embeddings = True
        return dict(expand(all_submodels=True))
    except (
        Exception
    ):  # a model whose declared ties do not expand: it declares none that we can keep
        return {}
    finally:
        for key, cfg in configs.items():
            cfg.tie_word_embeddings = saved[key]


def tie_groups(model: nn.Module, separate: Collection[str] = ()) -> dict[str, tuple[str, ...]]:
    """Every parameter and buffer name -> all the names of its tensor, in the model's order; names
    in ``separate`` (the plan's untied heads) stand alone.

    >>> emb = nn.Embedding(4, 2); net = nn.ModuleDict({"a": emb, "b": emb})
    >>> tie_groups(net)["b.weight"]
    ('a.weight', 'b.weight')
    """
    by_id: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        if name not in separate:
            by_id.setdefault(id(t), []).append(name)
    groups = {n: tuple(names) for names in by_id.values() for n in names}
    return groups | {n: (n,) for n in separate}


def merge_centerings(centerings: Sequence[Centering], ndim: int | None = None) -> list[Centering]:
    """The centerings of one tensor, each applied once (twice would round twice); those differing
    only in their blocks joined. ``ndim`` (the tensor's) makes axis -1 and axis ndim-1 one
    axis."""
    merged: dict[tuple, Centering] = {}
    for c in centerings:
        axis = c.axis % ndim if ndim else c.axis
        how = (axis, c.groups, c.scale, c.saved)
        prev = merged.get(how)
        if prev is None:
            merged[how] = dataclasses.replace(c, axis=axis)
        elif prev.blocks is not None:
            blocks = None if c.blocks is None else tuple(sorted({*prev.blocks, *c.blocks}))
            merged[how] = dataclasses.replace(prev, blocks=blocks)
    return list(merged.values())


def ties_lost_on_untie(model: nn.Module, plan: FoldPlan) -> dict[str, str]:
    """The ties (target -> source) that untying the plan's heads also drops: transformers 5 applies
    every tie only while ``tie_word_embeddings`` is on, so BERT's MLM decoder bias would load at
    random."""
    if not plan.untied:
        return {}
    planned = {(u.param, u.tied_to) for u in plan.untied} | {
        (u.tied_to, u.param) for u in plan.untied
    }
    return {
        t: s
        for t, s in declared_ties(model).items()
        if (t, s) not in planned and t not in {u.param for u in plan.untied}
    }


def center_(
    t: torch.Tensor,
    axis: int,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    blocks: Sequence[int] | None = None,
) -> torch.Tensor:
    """Subtract ``t``'s mean along ``axis``, in place, in float64: with ``groups``, each block on
    its own (``blocks``: only those); with ``scale`` (a LayerScale γ), ``γ·t`` becomes zero-mean.
    The arithmetic is ``enjoyln.ops.center``'s, in a fixed order, so every machine gives the same
    bits.
    >>> w = torch.tensor([[1., 2.], [3., 6.]])
    >>> center_(w, 0, scale=torch.tensor([1., 2.])) * torch.tensor([[1.], [2.]])
    tensor([[-2.5000, -5.0000],
            [ 2.5000,  5.0000]])
    """
    with _as_plan_error():
        return centering_kernel.center_(t, axis, groups, scale, blocks)


def center_into(
    src: int,
    dst: torch.Tensor,
    axis: int,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    blocks: Sequence[int] | None = None,
) -> bool:
    """``center_`` of the tensor at address ``src`` written into ``dst``; see
    ``enjoyln.ops.center``."""
    with _as_plan_error():
        return centering_kernel.center_into(src, dst, axis, groups, scale, blocks)


def centered_equal(
    src: int,
    cand: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    c: Centering,
    scale: torch.Tensor | None = None,
) -> bool | None:
    """Whether the tensor at ``cand`` is bit for bit ``center_`` of the one at ``src``; see
    ``enjoyln.ops.center``."""
    with _as_plan_error():
        return centering_kernel.centered_equal(
            src, cand, dtype, shape, c.axis, c.groups, scale, c.blocks
        )


@contextlib.contextmanager
def _as_plan_error() -> Iterator[None]:
    """A centering the plan asks for but that cannot be done is the plan's error."""
    try:
        yield
    except centering_kernel.CenteringError as exc:
        raise PlanError(str(exc)) from None


def center_all(model: nn.Module, centerings: Sequence[Centering]) -> None:
    """Apply ``centerings`` in place, each tensor once however many of its tied names the plan
    lists."""
    scales = {c.scale: tensor_at(model, c.scale).detach().clone() for c in centerings if c.scale}
    by_tensor: dict[int, tuple[torch.Tensor, list[Centering]]] = {}
    for c in centerings:
        t = tensor_at(model, c.param)
        by_tensor.setdefault(id(t), (t, []))[1].append(c)
    with torch.no_grad():
        for t, cs in by_tensor.values():
            for c in merge_centerings(cs, t.dim()):
                center_(t, c.axis, c.groups, scales.get(c.scale), c.blocks)


def fuse_(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    f: Fused,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    fixed_order: bool = False,
) -> None:
    """Move a norm's affine into a linear layer that reads it, in place: ``bias += W β``, then W's
    block ``*= γ``; ``fixed_order``: see ``fused_product``."""
    if bias is not None and beta is not None:
        product = fused_product(weight, f, beta, fixed_order)
        bias.copy_(bias.detach().to(torch.float64) + product.reshape(bias.shape))
    if gamma is not None:
        scale_inputs_(weight, f, gamma)


def fused_product(
    weight: torch.Tensor, f: Fused, beta: torch.Tensor, fixed_order: bool = False
) -> torch.Tensor:
    """``W β`` over the block of ``weight`` that reads the norm, in float64. ``fixed_order`` (a
    plan's ``fixed_order_products``): summed in one order on every machine, reading the weight in
    its own dtype. Otherwise the whole weight is widened first, as it always was, so the product's
    bits (a BLAS reduction) stay what earlier folds wrote."""
    segment = beta[f.offset : f.offset + f.length]
    if fixed_order:
        try:
            return dot_vectors(weight, f.axis, segment, f.start)
        except RotationUnavailable as exc:
            raise PlanError(str(exc)) from None
    block = weight.detach().to(torch.float64).narrow(f.axis, f.start, f.length)
    return torch.tensordot(block, segment.to(torch.float64), dims=([f.axis], [0]))


_SCALE_ELEMENTS = 1 << 22
"""Elements widened to float64 at a time when a weight's block is scaled by γ (32 MiB)."""


def scale_inputs_(weight: torch.Tensor, f: Fused, gamma: torch.Tensor) -> None:
    """W's block that reads the norm ``*= γ``, in place, each element rounded once from float64; in
    slabs of the other axis, never widening the whole weight (an embedding-sized head would need
    twice its size)."""
    seg = gamma[f.offset : f.offset + f.length].to(torch.float64)
    block = weight.detach().narrow(f.axis, f.start, f.length)
    g = seg.reshape([f.length if d == f.axis else 1 for d in range(block.dim())])
    for piece in slabs(block, f.axis, _SCALE_ELEMENTS):
        piece.copy_(piece.to(torch.float64).mul_(g))
