"""The static check's verdict on each tensor: bit for bit what the fold computes in the reference's
dtype, or for another ``--dtype`` exactly one of *fold, then cast* and *cast, then fold*, each rounded
to nearest (docs/checking.md)."""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..ops.center import same_memory
from ..ops.compare import same_bytes
from ..plan import Centering
from ..rewrite.stream import StreamedTensors
from ..store.tensors import Buffer, TensorReader, read_ahead
from ..transform.tensors import center_, centered_equal
from .pairing import Pair

Progress = Callable[[int, int], None]
Make = Callable[[], torch.Tensor]


@dataclass
class Verdicts:
    """What the tensors of a candidate are, counted, with a line for each that is not."""

    tensors: int = 0
    identical: int = 0
    centered: int = 0
    untied: int = 0
    computed: int = 0
    not_identical: list[str] = field(default_factory=list)
    """Why the candidate is not the reference itself."""
    not_folded: list[str] = field(default_factory=list)
    """Why the candidate is not the plan applied to the reference."""


def center_as_planned(t: torch.Tensor, cs: Sequence[Centering], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """``t`` centered in place as ``cs`` say, by the very function the fold uses; ``read`` gives a
    LayerScale gain by parameter name."""
    for c in cs:
        center_(t, c.axis, c.groups, scale=read(c.scale) if c.scale else None, blocks=c.blocks)
    return t


def cast_allowed(ref: torch.dtype, cand: torch.dtype, dtype: str | None = None) -> bool:
    """The changes of dtype a candidate may make: a wider float, which is exact (``load_problems`` checks
    the dtype it loads in), or a narrower float of the ``dtype`` the caller names."""
    wider = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    narrower = (dtype is not None and cand == getattr(torch, dtype) and ref.is_floating_point
                and ref.itemsize > cand.itemsize and ref in (torch.float32, torch.float64))
    return ref == cand or cand in wider.get(ref, ()) or narrower


def nearest(cand: torch.Tensor, makes: Sequence[Make]) -> tuple[bool, float]:
    """(whether ``cand`` is bit for bit one of the tensors ``makes`` compute, rounded to nearest, each made
    only if the one before is not; max abs diff from the first)."""
    first = None
    for make in makes:
        expected = make()
        if expected.shape != cand.shape:
            return False, math.inf
        rounded = expected.to(cand.dtype)
        if same_bytes(rounded, cand):
            return True, 0.0
        first = rounded if first is None else first
        del expected
    if first is None or not cand.is_floating_point():
        return False, math.inf
    d = cand.to(torch.float64).sub_(first.to(torch.float64)).abs_()
    return False, float(d.nan_to_num(math.inf).max()) if d.numel() else 0.0


class Verifier:
    """Each paired tensor judged, from the mapped files where that proves it, else read; ``expected``
    computes a fused or rotated fold's tensors, ``cast_expected`` those of the reference cast (``run`` closes both)."""

    def __init__(self, ref: TensorReader, cand: TensorReader, read_param: Callable[[str], torch.Tensor], *,
                 dtype: str | None, unrecorded: bool, expected: StreamedTensors | None = None,
                 cast_expected: Callable[[], StreamedTensors] | None = None) -> None:
        self.ref, self.cand, self.read_param = ref, cand, read_param
        self.dtype, self.unrecorded = dtype, unrecorded
        self.expected, self.cast_expected = expected, cast_expected
        self._cast: StreamedTensors | None = None
        self.out = Verdicts()

    def run(self, pairs: list[Pair], progress: Progress | None = None) -> Verdicts:
        try:
            order = sorted(pairs, key=lambda p: self.cand.offset(p.cand))  # the candidate's files front to back
            total = sum(self.cand.nbytes(p.cand) for p in order) if self.cand.pickled is None else 0
            done = [0]

            def advance(p: Pair) -> None:
                done[0] += self.cand.nbytes(p.cand) if self.cand.pickled is None else 0
                if progress is not None:
                    progress(done[0], total)

            decided = self._mapped(order) if self.expected is None else {}
            for p in order:
                if p.cand in decided:
                    self._count(p, *decided[p.cand], None)
                    advance(p)
            self._read([p for p in order if p.cand not in decided], advance)
        finally:
            for streamed in (self._cast, self.expected):
                if streamed is not None:
                    streamed.close()
        return self.out

    def _count(self, p: Pair, identical: bool, folded: bool, why: str | None) -> None:
        out = self.out
        out.tensors += 1
        out.identical += identical and not p.centerings
        out.centered += bool(p.centerings) and folded
        out.untied += p.untied and folded
        if not identical:
            out.not_identical.append(why if why and " is stored as " in why else
                                     f"{p.cand} differs from the reference's {p.ref}")
        if not folded:
            out.not_folded.append(why or f"{p.cand} differs from the reference's {p.ref}")

    def _mapped(self, order: list[Pair]) -> dict[str, tuple[bool, bool]]:
        """(identical, folded) for every tensor both mapped files prove right: byte for byte, or centered and
        compared in one pass of the C kernel. Anything else is left to the reading path, which says why."""
        ref, cand = self.ref, self.cand
        decided: dict[str, tuple[bool, bool]] = {}
        eligible = [p for p in order if cand.mappable(p.cand) and ref.mappable(p.ref)
                    and ref.dtype(p.ref) == cand.dtype(p.cand) and ref.shape(p.ref) == cand.shape(p.cand)
                    and len(p.centerings) <= 1]
        for i, p in enumerate(eligible):
            if i + 1 < len(eligible):
                ref.prefetch(eligible[i + 1].ref)
                cand.prefetch(eligible[i + 1].cand)
            with contextlib.ExitStack() as mapped:
                try:
                    r, t = mapped.enter_context(ref.mapped(p.ref)), mapped.enter_context(cand.mapped(p.cand))
                except OSError:  # a file system that cannot map files (FUSE direct I/O): the reading path
                    continue
                if not p.centerings:
                    same = folded = same_memory(r.address, t.address, r.nbytes)
                else:
                    c = p.centerings[0]
                    folded = centered_equal(r.address, t.address, ref.dtype(p.ref), ref.shape(p.ref), c,
                                            self.read_param(c.scale) if c.scale else None)
                    # is it the reference itself? Asked only without a recorded plan, to judge its form
                    same = self.unrecorded and folded and same_memory(r.address, t.address, r.nbytes)
            if folded:
                decided[p.cand] = (bool(same), True)
        return decided

    def _read(self, order: list[Pair], advance: Callable[[Pair], None]) -> None:
        """Every other tensor read (both files at once, the next pair read while one is judged) and judged."""
        buffers = [(Buffer(), Buffer()), (Buffer(), Buffer())]  # one pair in use, one read ahead
        side = ThreadPoolExecutor(1, thread_name_prefix="enjoyln-read")

        def wanted(p: Pair) -> tuple[bool, bool]:
            comparable = (cast_allowed(self.ref.dtype(p.ref), self.cand.dtype(p.cand), self.dtype)
                          and self.ref.shape(p.ref) == self.cand.shape(p.cand))
            moved = self.expected is not None
            return comparable and not moved, comparable and (not moved or p.cand in self.expected)

        def load(job: tuple[int, Pair]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            i, p = job
            want_ref, want_cand = wanted(p)
            into_ref, into_cand = buffers[i % 2]
            if not (want_ref and want_cand):
                return (self.ref.read(p.ref, into_ref) if want_ref else None,
                        self.cand.read(p.cand, into_cand) if want_cand else None)
            theirs = side.submit(self.cand.read, p.cand, into_cand)  # the two files read at once
            return self.ref.read(p.ref, into_ref), theirs.result()

        def size(job: tuple[int, Pair]) -> int:
            want_ref, want_cand = wanted(job[1])
            return want_ref * self.ref.nbytes(job[1].ref) + want_cand * self.cand.nbytes(job[1].cand)

        try:
            for (_, p), (r, t) in read_ahead(enumerate(order), load, size):
                self._count(p, *self._judge(p, r, t))
                del r, t
                advance(p)
        finally:
            side.shutdown()

    def _judge(self, p: Pair, r: torch.Tensor | None, t: torch.Tensor | None) -> tuple[bool, bool, str | None]:
        """(identical, folded, why not) for one tensor read from both files."""
        ref_dtype, cand_dtype = self.ref.dtype(p.ref), self.cand.dtype(p.cand)
        if not cast_allowed(ref_dtype, cand_dtype, self.dtype):
            # the reference cast to int8 or float8 compares equal to a candidate that lost
            # almost everything; loaded into the model's dtype, it would run
            return False, False, f"{p.cand} is stored as {cand_dtype}, but the reference's {p.ref} is {ref_dtype}"
        if self.ref.shape(p.ref) != self.cand.shape(p.cand):
            return False, False, (f"{p.cand} has shape {list(self.cand.shape(p.cand))}, "
                                  f"not {list(self.ref.shape(p.ref))}")
        if self.expected is not None:
            if t is None:
                return False, False, f"{p.cand} is not what the plan makes of the reference (max abs diff inf)"
            folded, diff = nearest(t, self._moved(p.cand, cand_dtype != ref_dtype))
            self.out.computed += folded
            return False, folded, None if folded else (
                f"{p.cand} is not what the plan makes of the reference (max abs diff {diff:.3g})")
        identical = (same_bytes(r, t) if cand_dtype == ref_dtype else
                     (self.unrecorded or not p.centerings) and same_bytes(r.to(cand_dtype), t))
        if not p.centerings:
            return identical, identical, None
        folded, diff = nearest(t, self._centered(r, p.centerings, cand_dtype))
        return identical, folded, None if folded else (
            f"{p.cand} is not {p.ref} centered along axis {p.centerings[0].axis} (max abs diff {diff:.3g})")

    def _centered(self, r: torch.Tensor, cs: Sequence[Centering], dtype: torch.dtype) -> Iterator[Make]:
        """What the fold makes of ``r``: folded then cast (the only one in ``r``'s own dtype), then cast and folded."""
        yield lambda: center_as_planned(r.clone() if r.dtype != dtype else r, cs, self.read_param)
        if dtype != r.dtype:
            yield lambda: center_as_planned(r.to(dtype), cs, lambda name: self.read_param(name).to(dtype))

    def _moved(self, key: str, cast: bool) -> Iterator[Make]:
        yield lambda: self.expected.get(key)
        if cast and self.cast_expected is not None:
            if self._cast is None:  # made only when asked for: after the first is not it
                self._cast = self.cast_expected()
            yield lambda: self._cast.get(key)

