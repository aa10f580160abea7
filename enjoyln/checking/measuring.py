"""How the forward check judges one output: kept in memory or on disk, compared chunk by chunk, then
judged."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .report import OutputCheck, worse

FACTOR = 4.0
"""How many times the reference's own rounding error the candidate may be from the truth
(docs/checking.md)."""
FLOOR_EPS = 1.0
"""The reference's own error is at least this many epsilons of the output's scale, so that an output
it computes exactly (a copy, a sum of integers) still allows the candidate a rounding."""


class Outputs:
    """Every output of one model on every batch, kept in memory or written to a directory."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.meta: dict[tuple[int, str], tuple[torch.dtype, torch.Size, Path | None]] = {}
        if directory is not None:
            directory.mkdir()

    def put(self, batch: int, outputs: dict[str, torch.Tensor]) -> None:
        for name, t in outputs.items():
            t = t.detach().contiguous()
            file = None if self.directory is None else self.directory / f"{len(self.meta)}.bin"
            if file is None:
                self.tensors[batch, name] = t
            else:
                file.write_bytes(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
            self.meta[batch, name] = (t.dtype, t.shape, file)

    def names(self, batch: int) -> list[str]:
        return [n for b, n in self.meta if b == batch]

    def shape(self, batch: int, name: str) -> torch.Size | None:
        return self.meta.get((batch, name), (None, None))[1]

    def chunks(self, batch: int, name: str, size: int) -> Iterator[torch.Tensor]:
        """The output flattened, ``size`` elements at a time."""
        if self.directory is None:
            yield from self.tensors[batch, name].view(-1).split(size)
            return
        dtype, shape, file = self.meta[batch, name]
        step = size * dtype.itemsize
        with open(file, "rb") as f:
            while chunk := f.read(step):
                yield torch.frombuffer(bytearray(chunk), dtype=dtype)


CHUNK = 1 << 22


@dataclass
class Criterion:
    kind: str  # "precision" or "rtol"
    factor: float = FACTOR
    rtol: float = 0.0
    dtype: torch.dtype = torch.float32
    """The judged dtype, whose epsilon floors the reference's own error."""

    def describe(self, truth: torch.dtype | None, why: str = "") -> str:
        if self.kind == "precision":
            t = str(truth).replace("torch.", "")
            return (
                f"precision-aware: max|candidate - {t} original| <= {self.factor:g} x "
                f"max(max|original - {t} original|, eps x max|{t} original|) "
                "for each output"
            )
        return (
            f"fixed: max|original - candidate| <= {self.rtol:g} x max|original| for each "
            f"output{why}"
        )


@dataclass
class Stats:
    """What one output's comparison measured, over the batches seen so far."""

    floating: bool = True
    mismatch: bool = False
    """A missing output, another shape, or (integers) another value."""
    nonfinite: int = 0
    diff: float = 0.0
    scale: float = 0.0
    ref_err: float = 0.0
    cand_err: float = 0.0
    t_scale: float = 0.0
    truth: bool = False

    def merge(self, other: "Stats") -> "Stats":
        worst = [
            worse(getattr(self, f), getattr(other, f))
            for f in ("diff", "scale", "ref_err", "cand_err", "t_scale")
        ]
        return Stats(
            self.floating and other.floating,
            self.mismatch or other.mismatch,
            self.nonfinite + other.nonfinite,
            *worst,
            self.truth and other.truth,
        )


def measure(
    name: str, base: Outputs, truth: Outputs | None, batch: int, cand: torch.Tensor | None
) -> Stats:
    """One output of one batch, compared chunk by chunk (never three float64 copies of the logits).
    A truth not finite where the reference is (a float64 overflow) is replaced there by the
    reference, which only tightens the bound."""
    if cand is None or cand.shape != base.shape(batch, name):
        return Stats(mismatch=True)
    flat = cand.detach().contiguous().view(-1).split(CHUNK)
    use_truth = truth is not None and truth.shape(batch, name) == cand.shape
    t_chunks = truth.chunks(batch, name, CHUNK) if use_truth else None
    st = Stats(floating=cand.is_floating_point(), truth=use_truth)
    zero = torch.zeros((), dtype=torch.float64)
    for r, c in zip(base.chunks(batch, name, CHUNK), flat):
        if not st.floating:
            st.mismatch = st.mismatch or not bool(torch.equal(r, c))
            continue
        if not r.numel():
            continue
        rd, cd = r.double(), c.double()
        r_ok, c_ok = torch.isfinite(rd), torch.isfinite(cd)
        same = (torch.isnan(rd) & torch.isnan(cd)) | (rd == cd)
        st.nonfinite += int(((r_ok & ~c_ok) | (~r_ok & ~same)).sum())
        both = r_ok & c_ok
        st.diff = worse(st.diff, float(torch.where(both, rd - cd, zero).abs().max()))
        st.scale = worse(st.scale, float(torch.where(r_ok, rd, zero).abs().max()))
        if t_chunks is not None:
            td = next(t_chunks).double()
            td = torch.where(torch.isfinite(td) | ~r_ok, td, rd)
            st.ref_err = worse(st.ref_err, float(torch.where(r_ok, rd - td, zero).abs().max()))
            st.cand_err = worse(st.cand_err, float(torch.where(both, cd - td, zero).abs().max()))
            st.t_scale = worse(st.t_scale, float(torch.where(r_ok, td, zero).abs().max()))
    return st


def judge_output(name: str, st: Stats, crit: Criterion) -> OutputCheck:
    """The verdict on one output, over every batch: no non-finite mismatch, then the criterion."""
    diff = math.inf if st.mismatch or st.nonfinite else st.diff
    rel = diff / st.scale if st.scale else (0.0 if diff == 0 else math.inf)
    out = OutputCheck(name, diff, rel, False, nonfinite=st.nonfinite, scale=st.scale)
    if st.mismatch or not st.floating:
        out.passed = not st.mismatch
        out.tolerance = 0.0
        return out
    if crit.kind == "precision" and st.truth:
        out.reference_error, out.candidate_error = (
            st.ref_err,
            (math.inf if st.nonfinite else st.cand_err),
        )
        out.allowed = crit.factor * max(
            st.ref_err, FLOOR_EPS * torch.finfo(crit.dtype).eps * st.t_scale
        )
        measured = out.candidate_error
        out.tolerance = out.allowed + st.ref_err
    else:
        out.allowed = out.tolerance = crit.rtol * st.scale
        measured = diff
    out.passed = not st.nonfinite and measured <= out.allowed
    out.margin = (out.allowed / measured if measured else None) if math.isfinite(measured) else 0.0
    return out
