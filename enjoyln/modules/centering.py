"""Auxiliary centering: ``x - x.mean(-1)`` at a module's output or input, as hooks: code and state
dict stay."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import PlanError

CENTERING_MARK = "_enjoyln_centering"


def center_last(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True)


def _center_output(module: nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return center_last(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (
            center_last(output[0]),
            *output[1:],
        )  # (hidden_states, extras...), as HF modules return
    raise RuntimeError(
        f"enjoyln: the centering at the output of {type(module).__name__} expects a "
        f"tensor, got {type(output).__name__}"
    )


def _center_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (center_last(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": center_last(kwargs["hidden_states"])}
    raise RuntimeError(
        f"enjoyln: the centering at the input of {type(module).__name__} found no tensor "
        "as its first argument or as hidden_states"
    )


def install(model: nn.Module, module_path: str, where: str) -> None:
    """Center the output (or the first input) of ``model.<module_path>``; idempotent."""
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        raise PlanError(
            f"the plan centers the {where} of {module_path}, which this model does not have"
        ) from None
    if getattr(module, CENTERING_MARK, None):
        return
    if where == "output":
        handle = module.register_forward_hook(_center_output)
    elif where == "input":
        handle = module.register_forward_pre_hook(_center_input, with_kwargs=True)
    else:
        raise PlanError(f"unknown centering place {where!r}; expected 'output' or 'input'")
    setattr(module, CENTERING_MARK, (where, handle.id))


def remove(model: nn.Module, module_path: str) -> None:
    module = model.get_submodule(module_path)
    mark = getattr(module, CENTERING_MARK, None)
    if mark:
        for table in ("_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
            getattr(module, table).pop(mark[1], None)
        delattr(module, CENTERING_MARK)


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Carry every forward hook (a centering included) over to a replacing module."""
    for table in (
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
    ):
        if hasattr(old, table):
            getattr(new, table).update(getattr(old, table))
    if hasattr(old, CENTERING_MARK):
        setattr(new, CENTERING_MARK, getattr(old, CENTERING_MARK))
