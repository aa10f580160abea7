"""Options the commands share, and the parsers of values, run before torch is imported (but
``check_cuda``)."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from ..errors import EnjoylnError
from ..options import Access, CheckOptions, FoldOptions
from ..units import parse_size

MaxShardSize = Annotated[
    Optional[str], typer.Option(help="Re-shard the output, e.g. 2GB; default: like the input.")
]
Force = Annotated[
    bool, typer.Option("--force", help="Replace OUT_DIR if it is an earlier enjoyln output.")
]
Check = Annotated[
    bool, typer.Option("--check/--no-check", help="Check the result before publishing it.")
]
StaticCheck = Annotated[
    bool, typer.Option("--static", help="Check every weight, but run no forward pass.")
]
KeepFailed = Annotated[
    bool, typer.Option("--keep-failed", help="Keep a candidate that fails its check.")
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Analyse and report; write nothing.")]
JsonOnly = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]
Quiet = Annotated[
    bool, typer.Option("-q", "--quiet", help="Print only the verdict and errors; no progress.")
]
Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose",
        help="Also show the libraries' own logs and warnings, and the traceback of an unexpected "
        "error.",
    ),
]
Exact = Annotated[
    str,
    typer.Option(
        help="served: keep what the model serves exact (its logits, so its generation), letting "
        "a vision or audio tower's hidden states among its outputs change; all: keep every "
        "output exact."
    ),
]
Revision = Annotated[
    Optional[str],
    typer.Option(
        help="The revision (branch, tag or commit) of a MODEL_DIR given as a Hugging Face hub id."
    ),
]
CheckDevice = Annotated[
    str, typer.Option(help="Where the forward check runs: cpu, cuda or cuda:N.")
]
ReadPickle = Annotated[
    bool, typer.Option("--allow-pickle", help="Read .bin weights (weights_only=True).")
]
TrustCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code", help="Analyse, run and keep the directory's custom model code."
    ),
]
Batches = Annotated[
    Optional[int],
    typer.Option(
        min=1,
        help="Input batches for the forward check (default: 2 short ones after the weight check).",
    ),
]
SeqLen = Annotated[int, typer.Option(min=1, help="Sequence length of the short check batches.")]
CheckMemory = Annotated[
    Optional[str],
    typer.Option(
        help="Run the check's models one at a time within this much "
        "memory, e.g. 1GB (default: automatic)."
    ),
]
Rtol = Annotated[
    Optional[float],
    typer.Option(
        min=0.0,
        help="Judge the outputs with the fixed max|ref - cand| <= RTOL x max|ref| instead of the "
        "precision-aware "
        "criterion (at most 4x the original's own rounding, measured against a float64 run of it).",
    ),
]
ModelClass = Annotated[
    Optional[str],
    typer.Option(
        help="Build the model as this transformers class instead of the one config.json names, "
        "e.g. MPNetModel "
        "for weights saved without the head MPNetForMaskedLM would add at random."
    ),
]
AllowMissing = Annotated[
    bool,
    typer.Option(
        "--allow-missing",
        help="Fold even where the weights lack parameters the model class builds, which every load "
        "then draws at random (default: refuse, naming the class the weights match).",
    ),
]


class OptionSet:
    """Typer options declared once, as the parameters of ``build``, which makes their values into
    what a command takes; ``takes`` gives them to every command that shares them."""

    def __init__(self, build: Callable[..., Any]) -> None:
        self.build = build
        self.parameters = list(inspect.signature(build, eval_str=True).parameters.values())


def takes(
    *shared: OptionSet, **sets: OptionSet
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A typer command whose parameter ``name`` is ``sets[name]``'s built value; ``shared`` sets it
    reads no value of (``--quiet``, which the command's wrapper reads). Typer reads a command's
    options from its signature, so the one given here lists the command's own parameters with
    each set's in place of its value.

    >>> @takes(access=ACCESS)
    ... def show(path: str, access: Access) -> None: print(path, access.allow_pickle)
    >>> list(inspect.signature(show).parameters)
    ['path', 'allow_pickle', 'trust_remote_code', 'model_class']
    >>> show(path="d", allow_pickle=True, trust_remote_code=False, model_class=None)
    d True
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True)
        named = {name: [p.name for p in s.parameters] for name, s in sets.items()}

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            for s in shared:
                for p in s.parameters:
                    values.pop(p.name)
            built = {
                name: sets[name].build(**{k: values.pop(k) for k in keys})
                for name, keys in named.items()
            }
            return command(**values, **built)

        # a set's options where the command takes its value, so -h lists them in the command's
        # order; the
        # shared ones last; keyword-only, as typer calls a command, so that no order of defaults is
        # required
        spliced = [
            q
            for p in own.parameters.values()
            for q in (sets[p.name].parameters if p.name in sets else [p])
        ]
        parameters = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in spliced + [p for s in shared for p in s.parameters]
        ]
        run.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.option_sets = (*sets.values(), *shared)  # type: ignore[attr-defined]
        return run

    return decorate


def _logging(quiet: Quiet = False, verbose: Verbose = False) -> None:
    """Read by ``failures.friendly``, which wraps every command."""


def _access(
    allow_pickle: ReadPickle = False,
    trust_remote_code: TrustCode = False,
    model_class: ModelClass = None,
) -> Access:
    return Access(
        allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, model_class=model_class
    )


def _fold_check(
    check: Check = True,
    static: StaticCheck = False,
    batches: Batches = None,
    seq_len: SeqLen = 16,
    max_memory: CheckMemory = None,
    rtol: Rtol = None,
    device: CheckDevice = "cpu",
) -> CheckOptions:
    mode = "none" if not check else "static" if static else "full"
    return CheckOptions(
        mode=mode,
        max_memory=parse_size(max_memory),
        batches=batches,
        seq_len=seq_len,
        rtol=rtol,
        device=parse_device(device),
    )


LOGGING = OptionSet(_logging)
"""``--quiet`` and ``--verbose``, which every command takes."""
ACCESS = OptionSet(_access)
"""How MODEL_DIR may be opened: ``--allow-pickle``, ``--trust-remote-code``, ``--model-class``."""


@takes(access=ACCESS, check=OptionSet(_fold_check))
def _fold(
    max_shard_size: MaxShardSize = None,
    force: Force = False,
    keep_failed: KeepFailed = False,
    dry_run: DryRun = False,
    allow_missing: AllowMissing = False,
    *,
    access: Access,
    check: CheckOptions,
) -> FoldOptions:
    return FoldOptions(
        max_shard_size=parse_size(max_shard_size),
        force=force,
        keep_failed=keep_failed,
        dry_run=dry_run,
        allow_missing=allow_missing,
        check=check,
        access=access,
    )


FOLD = OptionSet(_fold)
"""What ``fold`` and ``rotate`` share: the output, how MODEL_DIR is opened, and the check before
publishing."""


MAX_SHAPE = (
    1 << 30
)  # the most elements a benchmarked tensor may hold (4 GiB in float32; several are alive at once)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [
            tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part
        ]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise EnjoylnError(
            f"cannot use --shapes {text!r}; write positive sizes such as 2048x768,4096x1024"
        )
    if any(rows * cols > MAX_SHAPE for rows, cols in shapes):
        raise EnjoylnError(
            f"cannot use --shapes {text!r}; a shape may hold at most {MAX_SHAPE:,} elements"
        )
    return shapes  # type: ignore[return-value]


BENCH_DTYPES = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
)  # float8 and float4 have no LayerNorm to compare with


def parse_dtypes(text: str, option: str = "--dtypes") -> list[str]:
    """``--dtypes float32,bfloat16``: names only (checked before torch loads)."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in BENCH_DTYPES:
            raise EnjoylnError(f"cannot use {name!r} in {option}; use {', '.join(BENCH_DTYPES)}")
    return names


def parse_device(text: str, option: str = "--device") -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``; CUDA refused at once where no GPU driver is
    loaded."""
    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        # a GPU driver torch.cuda could use (NVIDIA's, WSL's, ROCm's), looked for without torch
        if os.name != "nt" and not any(
            Path(p).exists()
            for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
        ):
            raise EnjoylnError(
                f"{option} {text}, but CUDA is not available here (no GPU driver is loaded)"
            )
        return text
    raise EnjoylnError(f"unknown {option} {text!r}; use cpu, cuda or cuda:N")


def check_cuda(device: str, option: str = "--device") -> str:
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        raise EnjoylnError(
            f"{option} {device}, but CUDA is not available to torch {torch.__version__}"
        )
    if ":" in device and int(device[5:]) >= torch.cuda.device_count():
        raise EnjoylnError(
            f"{option} {device}, but there are {torch.cuda.device_count()} CUDA devices"
        )
    return device


ROTATIONS = (
    "hadamard",
    "random",
)  # ``transform.rotation.KINDS``, here to refuse a wrong one before torch loads


def parse_rotation(text: Optional[str], option: str) -> Optional[str]:
    if text is not None and text not in ROTATIONS:
        raise EnjoylnError(f"unknown {option} {text!r}; use {' or '.join(ROTATIONS)}")
    return text


EXACT_OUTPUTS = (
    "served",
    "all",
)  # ``plan.SERVED``, ``plan.ALL_OUTPUTS``, here to refuse one before torch loads


def parse_exact(text: str) -> str:
    if text not in EXACT_OUTPUTS:
        raise EnjoylnError(f"unknown --exact {text!r}; use {' or '.join(EXACT_OUTPUTS)}")
    return text


CHECK_DTYPES = ("float16", "bfloat16", "float32", "float64")


def parse_check_dtype(text: Optional[str]) -> Optional[str]:
    if text is not None and text not in CHECK_DTYPES:
        raise EnjoylnError(
            f"cannot judge a candidate in dtype {text!r}; use one of {', '.join(CHECK_DTYPES)}"
        )
    return text


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def parse_plot(path: Any) -> Any:
    if path is not None and (path.suffix.lower() not in PLOT_SUFFIXES or path.is_dir()):
        raise EnjoylnError(
            f"cannot write the plot to {path}; name a file ending in {', '.join(PLOT_SUFFIXES)}"
        )
    return path
