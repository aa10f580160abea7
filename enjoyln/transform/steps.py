"""The steps that apply a FoldPlan to a model in place (``PIPELINE``), and the public ``fold`` and
``rotate``."""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
from torch import fx, nn

from ..modules import centering
from ..analysis import analyze
from ..analysis.norms import norm_module_paths
from ..analysis.graph import FUNCTIONAL_LN
from ..analysis.inputs import ExampleInputs
from ..errors import PlanError
from ..modules.norm import GroupRMSNorm, RMSNorm
from ..ops import rms_norm
from ..plan import (
    AFFINE_FUSED,
    AFFINE_GAIN,
    SERVED,
    TRAINING_MODE,
    FoldPlan,
    LayerNormEntry,
    RotationSpec,
    checked_seed,
)
from .rotation import KINDS, apply_rotation
from .tensors import center_all, declared_ties, fuse_, own_copy, owner_of, tensor_at, untie_config
from .trace import Op, Product, Tracer


class Transformation:
    """One step of the rewrite, its three meanings side by side: in memory (``__call__``), on a
    checkpoint's tensors (``trace``, replayed by ``folded.stream``), and on load (``on_load``)."""

    preserves_computation: bool = True
    """Applied after the steps before it, the model's outputs do not change."""

    @property
    def acts_on_load(self) -> bool:
        """Whether ``on_load`` does anything (its ``check`` then runs on the loaded model first)."""
        return type(self).on_load is not Transformation.on_load

    def check(self, model: nn.Module, plan: FoldPlan) -> None:
        """Raise PlanError if the plan does not fit the model; changes nothing."""

    def __call__(self, model: nn.Module, plan: FoldPlan) -> nn.Module:
        raise NotImplementedError

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        """Record on ``t`` the operations this step makes on each tensor, in the order it makes
        them."""
        raise NotImplementedError

    def on_load(self, model: nn.Module, plan: FoldPlan) -> None:
        """Do again, on a model loaded from a folded checkpoint, what the checkpoint cannot hold."""


class InsertCentering(Transformation):
    """Install the plan's auxiliary centerings as forward hooks."""

    def check(self, model: nn.Module, plan: FoldPlan) -> None:
        for a in plan.auxiliary:
            if a.where not in ("output", "input"):
                raise PlanError(f"unknown centering place {a.where!r} for {a.module}")
            try:
                model.get_submodule(a.module)
            except AttributeError:
                raise PlanError(
                    f"the plan centers the {a.where} of {a.module}, which this model does not have"
                ) from None

    def __call__(self, model: nn.Module, plan: FoldPlan) -> nn.Module:
        for a in plan.auxiliary:
            centering.install(model, a.module, a.where)
        return model

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        """Hooks change no tensor."""

    def on_load(self, model: nn.Module, plan: FoldPlan) -> None:
        self(model, plan)  # a hook is not in any checkpoint


class UntieParameters(Transformation):
    """Give each name in ``plan.untied`` its own copy, so centering the embedding leaves the tied
    head alone."""

    def check(self, model: nn.Module, plan: FoldPlan) -> None:
        for u in plan.untied:
            owner_of(model, u.param), owner_of(model, u.tied_to)

    def __call__(self, model: nn.Module, plan: FoldPlan) -> nn.Module:
        for u in plan.untied:
            if tensor_at(model, u.param) is tensor_at(model, u.tied_to):  # else already untied
                own_copy(model, u.param)
        if plan.untied:
            untie_config(model)
        return model

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        for u in plan.untied:
            src = t.slot(u.tied_to)
            if t.slot(u.param) is src:
                t.copy(u.param, src)


class CenterParameters(Transformation):
    """Column-based weight centering in float64, cast back to each dtype (only LN inputs see it)."""

    def check(self, model: nn.Module, plan: FoldPlan) -> None:
        for c in plan.centered:
            t = tensor_at(model, c.param)
            if not -t.dim() <= c.axis < max(t.dim(), 1):
                raise PlanError(
                    f"the plan centers {c.param} along axis {c.axis}, but it has {t.dim()} "
                    "dimensions"
                )
            n = t.shape[c.axis] if t.dim() else 1
            if c.groups < 1 or n % c.groups or any(not 0 <= b < c.groups for b in c.blocks or ()):
                raise PlanError(
                    f"the plan centers {c.param} in {c.groups} groups, which its "
                    f"{n} entries along axis {c.axis} do not fit"
                )
            if c.scale:
                s = tensor_at(model, c.scale)
                if s.numel() != n:
                    raise PlanError(
                        f"the plan scales {c.param} by {c.scale}, which has {s.numel()} entries, "
                        f"not {n}"
                    )
                if s.device.type != "meta" and not bool(s.ne(0).all()):
                    raise PlanError(
                        f"the plan centers {c.param} for the LayerScale gain {c.scale}, "
                        "which has a zero entry; analyze this model again"
                    )

    def __call__(self, model: nn.Module, plan: FoldPlan) -> nn.Module:
        center_all(model, plan.centered)
        return model

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        """LayerScale gains are read as the step starts."""
        scales = {c.scale: t.now(t.slot(c.scale)) for c in plan.centered if c.scale}
        for c in plan.centered:
            t.slot(c.param).ops.append(
                Op("center", (scales[c.scale],) if c.scale else (), centering=c)
            )

    def on_load(self, model: nn.Module, plan: FoldPlan) -> None:
        # non-persistent buffers (sinusoidal tables) are built afresh by the model: center them
        # again
        center_all(model, [c for c in plan.centered if not c.saved])


class FuseAffine(Transformation):
    """Move each folded norm's γ and β (and those of a LayerNorm on a rotated stream) into the
    linear layers that read it (the norm keeps 1 and 0, or β/γ)."""

    def check(self, model: nn.Module, plan: FoldPlan) -> None:
        for e in plan.affine_moved:
            try:
                norm = model.get_submodule(e.name)
            except AttributeError:
                raise PlanError(
                    f"the plan fuses the affine of {e.name}, which this model does not have"
                ) from None
            width = math.prod(e.normalized_shape) if e.normalized_shape else None
            for f in e.fused:
                w = tensor_at(model, f.weight)
                if (
                    not 0 <= f.axis < w.dim()
                    or f.start + f.length > w.shape[f.axis]
                    or (width is not None and f.offset + f.length > width)
                ):
                    raise PlanError(
                        f"the plan fuses {e.name} into entries {f.start}-{f.start + f.length - 1} "
                        "of "
                        f"{f.weight}'s axis {f.axis}, which it does not have"
                    )
                if (
                    f.bias
                    and e.affine == AFFINE_FUSED
                    and tensor_at(model, f.bias).numel() * w.shape[f.axis] != w.numel()
                ):
                    raise PlanError(
                        f"the plan adds to {f.bias}, whose shape does not fit {f.weight}"
                    )
            gamma = getattr(norm, "weight", None)
            if (
                e.affine == AFFINE_GAIN
                and gamma is not None
                and gamma.device.type != "meta"
                and not bool(gamma.ne(0).all())
            ):
                raise PlanError(
                    f"the plan keeps {e.name}'s bias as β/γ, but its gain has a zero entry; "
                    "analyze this model again"
                )

    def __call__(self, model: nn.Module, plan: FoldPlan) -> nn.Module:
        with torch.no_grad():
            for e in plan.affine_moved:
                norm = model.get_submodule(e.name)
                weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
                gamma = (
                    weight.detach().to(torch.float64).reshape(-1).clone()
                    if weight is not None
                    else None
                )
                beta = (
                    bias.detach().to(torch.float64).reshape(-1).clone()
                    if bias is not None
                    else None
                )
                for f in e.fused:
                    target = (
                        tensor_at(model, f.bias) if f.bias and e.affine == AFFINE_FUSED else None
                    )
                    reader = tensor_at(model, f.weight)
                    fuse_(reader, target, f, gamma, beta, plan.fixed_order_products)
                if weight is not None:
                    weight.fill_(1)
                if bias is not None:
                    kept = beta / gamma if e.affine == AFFINE_GAIN and gamma is not None else beta
                    bias.copy_(
                        kept.reshape(bias.shape)
                        if e.affine == AFFINE_GAIN
                        else torch.zeros_like(bias)
                    )
        return model

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        for e in plan.affine_moved:
            w, b = t.binding.get(f"{e.name}.weight"), t.binding.get(f"{e.name}.bias")
            gamma = t.now(t.slots[w]) if w is not None else None
            beta = t.now(t.slots[b]) if b is not None else None
            for f in e.fused:
                weight = t.slot(f.weight)
                if f.bias and e.affine == AFFINE_FUSED and beta is not None:
                    t.slot(f.bias).ops.append(Op("add_product", (Product(t.now(weight), f, beta),)))
                if gamma is not None:
                    weight.ops.append(Op("scale", (gamma,), fused=f))
            if w is not None:
                t.slots[w].ops.append(Op("fill", fill=1.0))
            if b is not None:
                gain = e.affine == AFFINE_GAIN
                reads = (beta, gamma) if gain and gamma is not None else (beta,)
                t.slots[b].ops.append(Op("set_bias", reads, gain=gain))


class SwapLayerNorms(Transformation):
    """Replace every foldable LN with ``enjoyln.RMSNorm`` (a GroupNorm with ``GroupRMSNorm``)."""

    def check(self, model: nn.Module, plan: FoldPlan) -> None:
        for e in plan.foldable:
            if e.kind == "module":
                try:
                    module = model.get_submodule(e.name)
                except AttributeError:
                    module = None
                if e.norm == "group_norm":
                    if not isinstance(module, (nn.GroupNorm, GroupRMSNorm)):
                        raise PlanError(
                            f"the plan folds {e.name}, which is not a GroupNorm in this model"
                        )
                    continue
                why = (
                    _norm_misfit(module, e)
                    if module is not None
                    else "which this model does not have"
                )
                if why:
                    raise PlanError(f"the plan folds {e.name}, {why}")
            elif not isinstance(model, fx.GraphModule) or not any(
                n.name == e.name for n in model.graph.nodes
            ):
                raise PlanError(
                    f"the plan folds the functional layer_norm {e.name}, "
                    "which this model's graph does not have"
                )

    def __call__(self, model: nn.Module, plan: FoldPlan) -> nn.Module:
        functional = False
        for e in plan.foldable:
            if e.kind == "module":
                module = model.get_submodule(e.name)
                if isinstance(module, (RMSNorm, GroupRMSNorm)):
                    continue
                cls = GroupRMSNorm if e.norm == "group_norm" else RMSNorm
                if hasattr(module, "_hf_hook"):
                    _become(module, cls, e)
                    continue
                parent_path, _, attr = e.name.rpartition(".")
                if cls is GroupRMSNorm:
                    rms = cls.from_group_norm(module)
                elif isinstance(module, nn.LayerNorm) and e.plain_form:
                    rms = cls.from_layer_norm(module)
                else:
                    rms = cls.from_module(
                        module, e.normalized_shape, e.eps, dim=e.dim, upcast=e.upcast, then=e.then
                    )
                if e.affine in (AFFINE_FUSED, AFFINE_GAIN):  # γ = 1 (and β = 0) now: drop them
                    rms.register_parameter("weight", None)
                    if e.affine == AFFINE_FUSED:
                        rms.register_parameter("bias", None)
                    rms.elementwise_affine = False
                centering.move_hooks(module, rms)
                setattr(model.get_submodule(parent_path), attr, rms)
            else:
                node = next(n for n in model.graph.nodes if n.name == e.name)
                if node.target in FUNCTIONAL_LN:
                    node.args, node.kwargs = _rms_args(node), {}
                    node.target = rms_norm
                    functional = True
        if functional:
            model.recompile()
        return model

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        for e in plan.foldable:
            if e.kind == "module" and e.affine in (AFFINE_FUSED, AFFINE_GAIN):
                t.dropped.update(
                    f"{e.name}.{leaf}"
                    for leaf in (("weight", "bias") if e.affine == AFFINE_FUSED else ("weight",))
                )

    def on_load(self, model: nn.Module, plan: FoldPlan) -> None:
        self(model, plan)  # the checkpoint holds the LayerNorms' tensors, not their new class


def _norm_misfit(module: nn.Module, e: LayerNormEntry) -> str:
    """'' if ``module`` can be replaced as the plan's entry says, else why not (a plan for another
    model)."""
    if isinstance(module, RMSNorm):
        return ""
    if isinstance(module, (nn.GroupNorm, GroupRMSNorm)):
        return "which is a GroupNorm in this model, not a LayerNorm"
    width = math.prod(e.normalized_shape) if e.normalized_shape else None
    for leaf in ("weight", "bias"):
        t = getattr(module, leaf, None)
        if t is not None and (
            not isinstance(t, torch.Tensor) or (width is not None and t.numel() != width)
        ):
            return (
                f"whose {leaf} does not fit a norm over {tuple(e.normalized_shape)}, so it is "
                "not that norm here"
            )
    missing = [child for child in e.then if child not in dict(module.named_children())]
    return f"which has no child module {missing[0]} to call after it here" if missing else ""


def _become(module: nn.Module, cls: type, e: LayerNormEntry) -> None:
    """Turn a norm module into ``cls`` in place: with offloading (accelerate's ``device_map``) a
    hook wraps its ``forward`` and holds its weights, which a new module would not have."""
    if cls is RMSNorm:
        for leaf in ("weight", "bias"):
            if not hasattr(module, leaf):  # OLMo's norm has neither
                module.register_parameter(leaf, None)
        module.normalized_shape, module.eps = tuple(e.normalized_shape), float(e.eps)
        module.elementwise_affine = module.weight is not None
        module.dim, module.upcast, module.then = e.dim, e.upcast, tuple(e.then)
    module.__class__ = cls
    if hasattr(module, "_old_forward"):
        module._old_forward = cls.forward.__get__(module)


def _rms_args(node: fx.Node) -> tuple:
    """F.layer_norm's (or aten's) arguments, as rms_norm's positional ones."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    defaults = {"weight": None, "bias": None, "eps": 1e-5}
    return tuple(
        node.args[i] if i < len(node.args) else node.kwargs.get(n, defaults.get(n))
        for i, n in enumerate(names)
    )


class RotateStream(Transformation):
    """Rotate the residual stream by ``Q`` in float64; after SwapLayerNorms, as weightless RMSNorms
    commute with it."""

    def check(self, model: nn.Module, plan: FoldPlan) -> None:
        for r in plan.rotations:
            if r.kind not in KINDS:
                raise PlanError(f"the plan rotates with the unknown kind {r.kind!r}")
            for rot in r.rotated:
                t = tensor_at(model, rot.param)
                if not 0 <= rot.axis < t.dim() or rot.start + (rot.length or 1) > t.shape[rot.axis]:
                    raise PlanError(
                        f"the plan rotates {rot.param} along axis {rot.axis}, which it does not "
                        "have"
                    )

    def __call__(
        self, model: nn.Module, plan: FoldPlan, *, unsaved_only: bool = False
    ) -> nn.Module:
        with torch.no_grad():
            for r in plan.rotations:
                for rot in r.rotated:
                    if not (unsaved_only and rot.saved):
                        apply_rotation(tensor_at(model, rot.param), rot, r)
        return model

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        for r in plan.rotations:
            for rot in r.rotated:
                t.slot(rot.param).ops.append(Op("rotate", rotated=rot, rotation=r))

    def on_load(self, model: nn.Module, plan: FoldPlan) -> None:
        self(model, plan, unsaved_only=True)  # the non-persistent buffers the model built afresh


def _has(model: nn.Module, fqn: str) -> bool:
    try:
        owner_of(model, fqn)
    except PlanError:
        return False
    return True


class SeparateTies(Transformation):
    """Give each tie that untying the head dropped its own copy: the untied config no longer re-ties
    it on load, so a reload would get it at random (BERT's MLM decoder bias). Last, after every
    change."""

    def __call__(self, model: nn.Module, plan: FoldPlan) -> nn.Module:
        if not plan.untied:
            return model  # the config still ties: the loader re-ties them
        for target, source in declared_ties(model).items():
            if (
                _has(model, target)
                and _has(model, source)
                and tensor_at(model, target) is tensor_at(model, source)
            ):
                own_copy(model, target)
        return model

    def trace(self, t: Tracer, plan: FoldPlan) -> None:
        """Final values: each name's key is written from its slot."""


PIPELINE: tuple[Transformation, ...] = (
    InsertCentering(),
    UntieParameters(),
    FuseAffine(),
    CenterParameters(),
    SwapLayerNorms(),
    RotateStream(),
    SeparateTies(),
)


def check_fits(model: nn.Module, plan: FoldPlan) -> None:
    """Refuse a plan made for another model: another class, or other norm modules (a plan for 2
    layers applied to 3 would leave the third uncentered)."""
    if plan.model and plan.model != type(model).__name__:
        raise PlanError(f"the plan was made for a {plan.model}, not a {type(model).__name__}")
    if plan.norm_modules:
        kinds = (
            set()
        )  # the classes the plan's norms have here: norm modules of other classes count too
        for path in plan.norm_modules:
            try:
                kinds.add(type(model.get_submodule(path)))
            except AttributeError:
                pass
        ours, theirs = set(norm_module_paths(model, kinds)), set(plan.norm_modules)
        if ours != theirs:
            odd = sorted(ours ^ theirs)[0]
            where = "this model has" if odd in ours else "the plan names"
            raise PlanError(
                f"the plan was made for another model ({where} {odd}, the other does not); "
                "analyze this model instead"
            )


def apply_plan(model: nn.Module, plan: FoldPlan) -> nn.Module:
    """Apply a plan in place; check it fits the model before changing anything."""
    _check(model, plan)
    for step in PIPELINE:
        step(model, plan)
    return model


def _check(model: nn.Module, plan: FoldPlan) -> None:
    check_fits(model, plan)
    for step in PIPELINE:
        step.check(model, plan)


def trace_plan(model: nn.Module, plan: FoldPlan, key: Callable[[str], str | None]) -> Tracer:
    """What the plan does to each tensor of the meta ``model``, on names alone (``key``: name ->
    checkpoint key)."""
    _check(model, plan)
    t = Tracer.of(model, key)
    for step in PIPELINE:
        step.trace(t, plan)
    return t


def reapply_on_load(model: nn.Module, plan: FoldPlan) -> nn.Module:
    """On a model loaded from a folded checkpoint, what the checkpoint cannot hold."""
    steps = [step for step in PIPELINE if step.acts_on_load]
    for step in steps:
        step.check(model, plan)
    for step in steps:
        step.on_load(model, plan)
    return model


def fold(
    model: nn.Module,
    example_inputs: ExampleInputs = None,
    *,
    plan: FoldPlan | None = None,
    auxiliary_centering: bool = False,
    fuse_affine: bool = False,
    exact_outputs: str = SERVED,
) -> nn.Module:
    """Fold every foldable LayerNorm of ``model`` into RMSNorm, in place, with the same outputs;
    ``auxiliary_centering`` inserts explicit centerings where they pay off (BLOOM, the Whisper
    encoder), ``fuse_affine`` moves each folded norm's γ and β into its readers. ``exact_outputs``
    ``"served"`` keeps what the model serves exact (its logits, so its generation) and lets the
    fold change a vision or audio tower's hidden states among its outputs (``plan.changed_outputs``
    lists them); ``"all"`` keeps every output exact. Returns ``model``.
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> type(fold(net, torch.randn(2, 8))[1]).__name__
    'RMSNorm'
    """
    if plan is None:
        plan = analyze(
            model,
            example_inputs,
            auxiliary_centering=auxiliary_centering,
            fuse_affine=fuse_affine,
            exact_outputs=exact_outputs,
        )
    note = plan.note(TRAINING_MODE)
    if note:
        warnings.warn(f"enjoyln: {note}", stacklevel=2)
    return apply_plan(model, plan)


def rotate(
    model: nn.Module,
    example_inputs: ExampleInputs = None,
    *,
    kind: str = "hadamard",
    seed: int = 0,
    keep_mean: bool = True,
    plan: FoldPlan | None = None,
    version: int = 0,
    exact_outputs: str = SERVED,
) -> nn.Module:
    """Fold ``model`` with fused affines and rotate each of its residual streams (a vision tower's,
    the language model's) by an orthogonal ``Q`` (``kind``: ``"hadamard"`` or ``"random"``), in
    place, with the same outputs; the rotation spreads outlier features. With ``keep_mean`` ``Q``
    fixes the all-ones vector, so plain LayerNorms still agree. ``version`` 0 builds the newest
    ``Q`` of the kind (for hadamard the structured one, applied in O(n log n)); 1 the dense
    matrices of earlier releases. ``exact_outputs`` ``"served"`` keeps what the model serves
    exact (its logits, so its generation) and lets the fold and rotation change a tower's hidden
    states among its outputs; ``"all"`` keeps every output exact, leaving a stream that reaches one
    unrotated.
    >>> import enjoyln
    >>> from enjoyln.testing import perturb, tiny_model
    >>> model = enjoyln.rotate(perturb(tiny_model("gpt2")))
    >>> type(model.transformer.ln_f).__name__, model.transformer.h[0].ln_1.elementwise_affine
    ('RMSNorm', False)
    """
    if any(isinstance(m, (RMSNorm, GroupRMSNorm)) for m in model.modules()):
        raise PlanError(
            "this model is already folded in memory; rotate the original model (rotate folds it "
            "too), or a folded checkpoint loaded with plain from_pretrained"
        )
    if plan is None:
        plan = analyze(
            model,
            example_inputs,
            fuse_affine=True,
            rotate=RotationSpec(
                kind, checked_seed(seed), bool(keep_mean), int(version), exact_outputs
            ),
            exact_outputs=exact_outputs,
        )
    if plan.rotation is None:
        raise PlanError(plan.not_rotated())
    return apply_plan(model, plan)
