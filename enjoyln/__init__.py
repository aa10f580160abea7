"""enjoyln: fold LayerNorm into RMSNorm with exactly the same outputs.

>>> import enjoyln, torch
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
>>> enjoyln.analyze(net, torch.randn(2, 8)).foldable[0].name
'1'
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ._version import __version__
from .compat import guard_torchvision

guard_torchvision()  # before transformers or timm can import a mismatched torchvision

# Names are imported on first use, so that `import enjoyln` (and the command
# line's entry point) does not import torch: an interrupt or a bad argument in
# the first second then gets one line, not an import traceback.
_EXPORTS = {
    "analyze": "analysis",
    "fold": "transform.steps",
    "rotate": "transform.steps",
    "check": "checking.forward",
    "CheckReport": "checking.report",
    "load": "store.load",
    "fold_checkpoint": "rewrite.convert",
    "analyze_checkpoint": "rewrite.convert",
    "check_checkpoints": "checking.checkpoints",
    "cbwc": "transform.training",
    "cbwc_remove": "transform.training",
    "RMSNorm": "modules.norm",
    "GroupRMSNorm": "modules.norm",
    "FoldPlan": "plan",
    "LayerNormEntry": "plan",
    "Centering": "plan",
    "Untie": "plan",
    "EnjoylnError": "errors",
    "CaptureError": "errors",
    "CheckpointError": "errors",
    "PlanError": "errors",
    "CheckFailed": "errors",
    "AnalysisError": "errors",
    "load_sentence_transformer": "sentence",
    "FoldOptions": "options",
    "CheckOptions": "options",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'enjoyln' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
