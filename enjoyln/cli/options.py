"""Options the commands share, declared once.

``fold`` and ``rotate`` take the same output, check and input options; a
command uses one with ``name: Force = False``, the default in the signature.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ..errors import EnjoylnError

RTOL_HELP = ("Judge the outputs with the fixed max|ref - cand| <= RTOL x max|ref| instead of the precision-aware "
             "criterion (at most 4x the original's own rounding, measured against a float64 run of it).")

MaxShardSize = Annotated[Optional[str], typer.Option(help="Re-shard the output, e.g. 2GB; default: like the input.")]
Force = Annotated[bool, typer.Option("--force", help="Replace OUT_DIR if it is an earlier enjoyln output.")]
Check = Annotated[bool, typer.Option("--check/--no-check", help="Check the result before publishing it.")]
StaticCheck = Annotated[bool, typer.Option("--static", help="Check every weight, but run no forward pass.")]
KeepFailed = Annotated[bool, typer.Option("--keep-failed", help="Keep a candidate that fails its check.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Analyse and report; write nothing.")]
JsonOnly = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]
ReadPickle = Annotated[bool, typer.Option("--allow-pickle", help="Read .bin weights (weights_only=True).")]
TrustCode = Annotated[bool, typer.Option("--trust-remote-code",
                                         help="Analyse, run and keep the directory's custom model code.")]
Batches = Annotated[Optional[int], typer.Option(
    min=1, help="Input batches for the forward check (default: 2 short ones after the weight check).")]
SeqLen = Annotated[int, typer.Option(min=1, help="Sequence length of the short check batches.")]
CheckMemory = Annotated[Optional[str], typer.Option(help="Run the check's models one at a time within this much "
                                                         "memory, e.g. 1GB (default: automatic).")]
Rtol = Annotated[Optional[float], typer.Option(min=0.0, help=RTOL_HELP)]
ModelClass = Annotated[Optional[str], typer.Option(
    help="Build the model as this transformers class instead of the one config.json names, e.g. MPNetModel "
         "for weights saved without the head MPNetForMaskedLM would add at random.")]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``--shapes 2048x768,4096x1024``."""
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise EnjoylnError(f"cannot use --shapes {text!r}; write positive sizes such as 2048x768,4096x1024")
    return shapes  # type: ignore[return-value]


def parse_dtypes(text: str) -> list[Any]:
    """``--dtypes float32,bfloat16``: torch dtypes, floating ones only."""
    import torch

    dtypes = []
    for name in text.split(","):
        dtype = getattr(torch, name.strip(), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise EnjoylnError(f"unknown floating dtype {name!r} in --dtypes")
        dtypes.append(dtype)
    return dtypes
