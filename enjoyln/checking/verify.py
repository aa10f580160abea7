"""The static check's verdict on each tensor: bit for bit what the fold computes in the reference's
dtype, or for another ``--dtype`` exactly one of *fold, then cast* and *cast, then fold*, each
rounded to nearest (docs/checking.md)."""

from __future__ import annotations

import contextlib
import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..ops.center import same_memory
from ..ops.compare import same_bytes
from ..plan import Centering
from ..folded.stream import StreamedTensors
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
    unlike_reference: int = 0
    """Tensors that are not the reference's (``not_identical`` has a line for each)."""
    unlike_fold: int = 0
    """Tensors that are not what the plan makes (``not_folded`` has a line for each, and other
    lines)."""
    first_unlike_fold: tuple[str, Difference | None] | None = None
    """The first tensor that is not what the plan makes: its line, and where it differs."""
    first_unlike_reference: Callable[[], tuple[str, Difference | None]] | None = None
    """The same for the reference, found only when asked for (the tensor read again): every centered
    tensor of a fold differs from the reference, and that is only asked of a candidate judged as a
    copy."""


@dataclass
class Difference:
    """Where a stored tensor is furthest from what it must be, and by how much."""

    tensor: str
    max_abs_diff: float | None
    """None where they differ only in bits that compare equal (a zero's sign, a NaN's payload)."""
    index: list[int]
    """Of the largest difference (or of the first differing bits)."""
    value: float
    expected: float
    dtype: str

    def describe(self) -> str:
        """'max abs diff 0.5 at [3, 7] (0.62 where it must be 0.12)'."""
        how = (
            f"max abs diff {self.max_abs_diff:.3g}"
            if self.max_abs_diff is not None
            else "bits differ"
        )
        return (
            f"{how} at [{', '.join(map(str, self.index))}] ({_shown(self.value, self.dtype)} where "
            "it must be "
            f"{_shown(self.expected, self.dtype)})"
        )


def _how(diff: Difference | None) -> str:
    return diff.describe() if diff is not None else "it has another shape"


def _shown(x: float, dtype: str) -> str:
    """The shortest decimal that reads back as the same value of ``dtype``: two neighbouring float32
    values print apart."""
    if dtype in ("float16", "bfloat16", "float32"):
        return str(np.float32(x))
    return repr(x) if dtype.startswith("float") else repr(int(x))


CHUNK = 1 << 22
"""Elements compared at once in float64 (32 MiB), whatever the tensor's size."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def locate(name: str, cand: torch.Tensor, expected: torch.Tensor) -> Difference | None:
    """Where ``cand`` is furthest from ``expected`` (the same shape and dtype), in float64, a chunk
    at a time; NaN against a number counts as infinitely far. None if they are the same bytes."""
    c, e = cand.reshape(-1), expected.reshape(-1)
    worst, where = 0.0, -1
    for start in range(0, c.numel(), CHUNK):
        x, y = (
            c[start : start + CHUNK].to(torch.float64),
            e[start : start + CHUNK].to(torch.float64),
        )
        same = (x == y) | (x.isnan() & y.isnan())
        d = torch.where(same, 0.0, (x - y).abs().nan_to_num(math.inf, math.inf))
        i = int(d.argmax())
        if float(d[i]) > worst:
            worst, where = float(d[i]), start + i
    if where < 0:  # equal as values: find the first element whose bits differ
        bits = _BITS.get(c.element_size())
        unlike = (
            (c.view(bits) != e.view(bits)) if bits is not None else torch.zeros(0, dtype=torch.bool)
        )
        found = unlike.nonzero()
        if not found.numel():
            return None
        where = int(found[0])
    index = (
        [int(i) for i in torch.unravel_index(torch.tensor(where), tuple(cand.shape))]
        if cand.dim()
        else []
    )
    return Difference(
        name,
        worst if worst > 0 else None,
        index,
        float(c[where]),
        float(e[where]),
        str(cand.dtype).removeprefix("torch."),
    )


def center_as_planned(
    t: torch.Tensor, cs: Sequence[Centering], read: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """``t`` centered in place as ``cs`` say, by the very function the fold uses; ``read`` gives a
    LayerScale gain by parameter name."""
    for c in cs:
        center_(t, c.axis, c.groups, scale=read(c.scale) if c.scale else None, blocks=c.blocks)
    return t


def cast_allowed(ref: torch.dtype, cand: torch.dtype, dtype: str | None = None) -> bool:
    """The changes of dtype a candidate may make: a wider float, which is exact (``load_problems``
    checks the dtype it loads in), or a narrower float of the ``dtype`` the caller names."""
    wider = {
        torch.float16: (torch.float32, torch.float64),
        torch.bfloat16: (torch.float32, torch.float64),
        torch.float32: (torch.float64,),
    }
    narrower = (
        dtype is not None
        and cand == getattr(torch, dtype)
        and ref.is_floating_point
        and ref.itemsize > cand.itemsize
        and ref in (torch.float32, torch.float64)
    )
    return ref == cand or cand in wider.get(ref, ()) or narrower


def nearest(name: str, cand: torch.Tensor, makes: Sequence[Make]) -> tuple[bool, Difference | None]:
    """(whether ``cand`` is bit for bit one of the tensors ``makes`` compute, rounded to nearest,
    each made only if the one before is not; where it differs from the first, None if that has
    another shape)."""
    first = None
    for make in makes:
        expected = make()
        if expected.shape != cand.shape:
            return False, None
        rounded = expected.to(cand.dtype)
        if same_bytes(rounded, cand):
            return True, None
        first = rounded if first is None else first
        del expected
    return False, None if first is None else locate(name, cand, first)


class Verifier:
    """Each paired tensor judged, from the mapped files where that proves it, else read;
    ``expected`` computes a fused or rotated fold's tensors, ``cast_expected`` those of the
    reference cast (``run`` closes both)."""

    def __init__(
        self,
        ref: TensorReader,
        cand: TensorReader,
        read_param: Callable[[str], torch.Tensor],
        *,
        dtype: str | None,
        unrecorded: bool,
        expected: StreamedTensors | None = None,
        cast_expected: Callable[[], StreamedTensors] | None = None,
    ) -> None:
        self.ref, self.cand, self.read_param = ref, cand, read_param
        self.dtype, self.unrecorded = dtype, unrecorded
        self.expected, self.cast_expected = expected, cast_expected
        self._cast: StreamedTensors | None = None
        self.out = Verdicts()

    def run(self, pairs: list[Pair], progress: Progress | None = None) -> Verdicts:
        try:
            order = sorted(
                pairs, key=lambda p: self.cand.offset(p.cand)
            )  # the candidate's files front to back
            total = sum(self.cand.nbytes(p.cand) for p in order) if self.cand.pickled is None else 0
            done = [0]

            def advance(p: Pair) -> None:
                done[0] += self.cand.nbytes(p.cand) if self.cand.pickled is None else 0
                if progress is not None:
                    progress(done[0], total)

            # each tensor these decide moves the progress on as it is decided
            if self.expected is None:
                decided = self._mapped(order, advance)
            else:
                decided = self._one_pass(order, advance)
            for p in order:
                if p.cand in decided:
                    self._count(p, *decided[p.cand], None)
            self._read([p for p in order if p.cand not in decided], advance)
        finally:
            for streamed in (self._cast, self.expected):
                if streamed is not None:
                    streamed.close()
        return self.out

    def _count(
        self,
        p: Pair,
        identical: bool,
        folded: bool,
        why: str | None,
        diff: Difference | None = None,
    ) -> None:
        out = self.out
        out.tensors += 1
        out.identical += identical and not p.centerings
        out.centered += bool(p.centerings) and folded
        out.untied += p.untied and folded
        if not identical:
            out.unlike_reference += 1
            # a centered tensor's line (and difference) is against the fold, not the reference
            own = why is not None and (not p.centerings or diff is None)
            out.not_identical.append(
                why if own else f"{p.cand} differs from the reference's {p.ref}"
            )
            if out.first_unlike_reference is None:
                at = len(out.not_identical) - 1
                out.first_unlike_reference = (
                    (lambda: (out.not_identical[at], diff))
                    if own
                    else lambda: self._unlike_reference(p, at)
                )
        if not folded:
            out.unlike_fold += 1
            out.not_folded.append(why or f"{p.cand} differs from the reference's {p.ref}")
            if out.first_unlike_fold is None:
                out.first_unlike_fold = (out.not_folded[-1], diff)

    def _unlike_reference(self, p: Pair, at: int) -> tuple[str, Difference | None]:
        """The first tensor that is not the reference's, read again to say where (its line
        updated)."""
        t = self.cand.read(p.cand)
        diff = locate(p.cand, t, self.ref.read(p.ref).to(t.dtype))
        if diff is not None:
            self.out.not_identical[at] = (
                f"{p.cand} differs from the reference's {p.ref}: {diff.describe()}"
            )
        return self.out.not_identical[at], diff

    def _mapped(
        self, order: list[Pair], advance: Callable[[Pair], None]
    ) -> dict[str, tuple[bool, bool]]:
        """(identical, folded) for every tensor both mapped files prove right: byte for byte, or
        centered and compared in one pass of the C kernel. Anything else is left to the reading
        path, which says why."""
        ref, cand = self.ref, self.cand
        decided: dict[str, tuple[bool, bool]] = {}
        eligible = [
            p
            for p in order
            if cand.mappable(p.cand)
            and ref.mappable(p.ref)
            and ref.dtype(p.ref) == cand.dtype(p.cand)
            and ref.shape(p.ref) == cand.shape(p.cand)
            and len(p.centerings) <= 1
        ]
        for i, p in enumerate(eligible):
            if i + 1 < len(eligible):
                ref.prefetch(eligible[i + 1].ref)
                cand.prefetch(eligible[i + 1].cand)
            with contextlib.ExitStack() as mapped:
                try:
                    r, t = (
                        mapped.enter_context(ref.mapped(p.ref)),
                        mapped.enter_context(cand.mapped(p.cand)),
                    )
                except (
                    OSError
                ):  # a file system that cannot map files (FUSE direct I/O): the reading path
                    continue
                if not p.centerings:
                    same = folded = same_memory(r.address, t.address, r.nbytes)
                else:
                    c = p.centerings[0]
                    folded = centered_equal(
                        r.address,
                        t.address,
                        ref.dtype(p.ref),
                        ref.shape(p.ref),
                        c,
                        self.read_param(c.scale) if c.scale else None,
                    )
                    # is it the reference itself? Asked only without a recorded plan, to judge its
                    # form
                    same = (
                        self.unrecorded and folded and same_memory(r.address, t.address, r.nbytes)
                    )
            if folded:
                decided[p.cand] = (bool(same), True)
                advance(p)
        return decided

    def _one_pass(
        self, order: list[Pair], advance: Callable[[Pair], None]
    ) -> dict[str, tuple[bool, bool]]:
        """(identical, folded) for every computed tensor one pass of the rotation kernel proves
        right from both mapped files (``StreamedTensors.equal_in_file``); the rest, and any that
        differs, are left to the reading path, which says where."""
        decided: dict[str, tuple[bool, bool]] = {}
        into = Buffer(), Buffer()
        for p in order:
            out = self.expected.outputs.get(p.cand)
            if not (
                out is not None
                and self.cand.mappable(p.cand)
                and self.cand.dtype(p.cand) == out.dtype
                and self.cand.shape(p.cand) == out.shape
            ):
                continue
            try:
                same = self.expected.equal_in_file(
                    p.cand, functools.partial(self.cand.mapped, p.cand), into
                )
            except OSError:  # a file system that cannot map files: the reading path
                continue
            if same:
                decided[p.cand] = (False, True)
                self.out.computed += 1
                advance(p)
        return decided

    def _read(self, order: list[Pair], advance: Callable[[Pair], None]) -> None:
        """Every other tensor read (both files at once, the next pair read while one is judged) and
        judged."""
        buffers = [(Buffer(), Buffer()), (Buffer(), Buffer())]  # one pair in use, one read ahead
        side = ThreadPoolExecutor(1, thread_name_prefix="enjoyln-read")

        def wanted(p: Pair) -> tuple[bool, bool]:
            comparable = cast_allowed(
                self.ref.dtype(p.ref), self.cand.dtype(p.cand), self.dtype
            ) and self.ref.shape(p.ref) == self.cand.shape(p.cand)
            moved = self.expected is not None
            return comparable and not moved, comparable and (not moved or p.cand in self.expected)

        def load(job: tuple[int, Pair]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            i, p = job
            want_ref, want_cand = wanted(p)
            into_ref, into_cand = buffers[i % 2]
            if not (want_ref and want_cand):
                return (
                    self.ref.read(p.ref, into_ref) if want_ref else None,
                    self.cand.read(p.cand, into_cand) if want_cand else None,
                )
            theirs = side.submit(self.cand.read, p.cand, into_cand)  # the two files read at once
            return self.ref.read(p.ref, into_ref), theirs.result()

        def size(job: tuple[int, Pair]) -> int:
            want_ref, want_cand = wanted(job[1])
            return want_ref * self.ref.nbytes(job[1].ref) + want_cand * self.cand.nbytes(
                job[1].cand
            )

        try:
            for (_, p), (r, t) in read_ahead(enumerate(order), load, size):
                self._count(p, *self._judge(p, r, t))
                del r, t
                advance(p)
        finally:
            side.shutdown()

    def _judge(
        self, p: Pair, r: torch.Tensor | None, t: torch.Tensor | None
    ) -> tuple[bool, bool, str | None, Difference | None]:
        """(identical, folded, why not, where it differs) for one tensor read from both files."""
        ref_dtype, cand_dtype = self.ref.dtype(p.ref), self.cand.dtype(p.cand)
        if not cast_allowed(ref_dtype, cand_dtype, self.dtype):
            # the reference cast to int8 or float8 compares equal to a candidate that lost
            # almost everything; loaded into the model's dtype, it would run
            return (
                False,
                False,
                f"{p.cand} is stored as {cand_dtype}, but the reference's {p.ref} is {ref_dtype}",
                None,
            )
        if self.ref.shape(p.ref) != self.cand.shape(p.cand):
            return (
                False,
                False,
                (
                    f"{p.cand} has shape {list(self.cand.shape(p.cand))}, "
                    f"not {list(self.ref.shape(p.ref))}"
                ),
                None,
            )
        if self.expected is not None:
            if t is None:
                return (
                    False,
                    False,
                    f"{p.cand} is not what the plan makes of the reference: it makes none",
                    None,
                )
            folded, diff = nearest(p.cand, t, self._moved(p.cand, cand_dtype != ref_dtype))
            self.out.computed += folded
            return (
                False,
                folded,
                None
                if folded
                else (f"{p.cand} is not what the plan makes of the reference: {_how(diff)}"),
                diff,
            )
        identical = (
            same_bytes(r, t)
            if cand_dtype == ref_dtype
            else (self.unrecorded or not p.centerings) and same_bytes(r.to(cand_dtype), t)
        )
        if not p.centerings:
            diff = None if identical else locate(p.cand, t, r.to(cand_dtype))
            return (
                identical,
                identical,
                None
                if identical
                else (f"{p.cand} differs from the reference's {p.ref}: {_how(diff)}"),
                diff,
            )
        folded, diff = nearest(p.cand, t, self._centered(r, p.centerings, cand_dtype))
        return (
            identical,
            folded,
            None
            if folded
            else (
                f"{p.cand} is not {p.ref} centered along axis {p.centerings[0].axis}: {_how(diff)}"
            ),
            diff,
        )

    def _centered(
        self, r: torch.Tensor, cs: Sequence[Centering], dtype: torch.dtype
    ) -> Iterator[Make]:
        """What the fold makes of ``r``: folded then cast (the only one in ``r``'s own dtype), then
        cast and folded."""
        yield lambda: center_as_planned(r.clone() if r.dtype != dtype else r, cs, self.read_param)
        if dtype != r.dtype:
            yield lambda: center_as_planned(
                r.to(dtype), cs, lambda name: self.read_param(name).to(dtype)
            )

    def _moved(self, key: str, cast: bool) -> Iterator[Make]:
        yield lambda: self.expected.get(key)
        if cast and self.cast_expected is not None:
            if self._cast is None:  # made only when asked for: after the first is not it
                self._cast = self.cast_expected()
            yield lambda: self._cast.get(key)
