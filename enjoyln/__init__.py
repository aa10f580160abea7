"""enjoyln: fold LayerNorm into RMSNorm with exactly the same outputs.

>>> import enjoyln, torch
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
>>> enjoyln.analyze(net, torch.randn(2, 8)).foldable[0].name
'1'
"""

from ._version import __version__
from .analysis import analyze
from .check import CheckReport, check
from .checkpoint import analyze_checkpoint, check_checkpoints, fold_checkpoint, load
from .errors import AnalysisError, CaptureError, CheckpointError, EnjoylnError, PlanError
from .norm import GroupRMSNorm, RMSNorm
from .plan import Centering, FoldPlan, LayerNormEntry, Untie
from .rewrite import fold
from .training import cbwc, cbwc_remove


__all__ = [
    "analyze", "fold", "GroupRMSNorm", "check", "CheckReport", "load", "fold_checkpoint",
    "analyze_checkpoint", "check_checkpoints", "cbwc", "cbwc_remove", "RMSNorm", "FoldPlan", "LayerNormEntry", "Centering", "Untie",
    "EnjoylnError", "AnalysisError", "CaptureError", "CheckpointError", "PlanError", "__version__",
]
