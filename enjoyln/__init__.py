"""enjoyln: fold LayerNorm into RMSNorm with exactly the same outputs.

>>> import enjoyln, torch
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
>>> enjoyln.analyze(net, torch.randn(2, 8)).foldable[0].name
'1'
"""

from .analysis import analyze
from .check import CheckReport, check
from .errors import CaptureError, CheckpointError, EnjoylnError, PlanError
from .norm import RMSNorm
from .plan import Centering, FoldPlan, LayerNormEntry, Untie
from .rewrite import fold

__version__ = "0.1.0"

__all__ = [
    "analyze", "fold", "check", "CheckReport", "RMSNorm", "FoldPlan", "LayerNormEntry", "Centering", "Untie",
    "EnjoylnError", "CaptureError", "CheckpointError", "PlanError", "__version__",
]
