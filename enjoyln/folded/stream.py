"""The plan applied to a checkpoint tensor by tensor, without the model in memory:
``StreamedTensors`` replays each slot's trace with the functions the steps run, in the same order
and dtypes, so the bits are those of the plan applied to the loaded model."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..errors import CheckpointError, PlanError
from ..plan import Centering, FoldPlan, Fused
from ..store.checkpoint import Checkpoint
from ..store.formats import DTYPES, widened
from ..ops import rotate as structured_kernel
from ..store.tensors import Buffer, Mapped, TensorReader, return_freed_memory
from ..transform.rotation import apply_rotation, scaled_in_kernel
from ..transform.steps import trace_plan
from ..transform.tensors import (
    center_,
    center_into,
    fused_product,
    scale_inputs_,
    ties_lost_on_untie,
)
from ..transform.trace import Op, Product, Read, Ref, Slot, Tracer
from .pieces import WHOLE_BYTES, Piece, gather, pieces

STASH_BYTES = 512 << 20
"""At most this much of weights computed ahead of their request (for a fused bias's ``W β``)."""

ONE_PASS_BYTES = 1 << 30
"""The largest tensor ``get`` computes whole from its mapped file (``OnePass``): the mapping's
pages count towards the process's memory while it is open, beside the result, so a larger one is
read and rotated in place (the writer and the static check take it in pieces where they can)."""


def output_slots(t: Tracer, plan: FoldPlan, ck: Checkpoint) -> dict[str, int]:
    """The keys of the folded checkpoint, each with its slot: every name's key, an untied head, a
    dropped tie, then a changed tensor stored only under a name it no longer shares (an embedding
    saved only as the tied head)."""
    slots: dict[str, int] = {}
    names, key, saved = t.names(), ck.key, ck.saved
    for name in names:
        if (k := key(name)) is not None:
            slots.setdefault(k, t.binding[name])
    for u in plan.untied:
        if key(u.param) is None:
            slots[saved.get(u.param, u.param)] = t.binding[u.param]
    for target in ties_lost_on_untie(ck.meta, plan):
        # not one the checkpoint lacks altogether (a head's bias the model initializes): it stays
        # missing
        if key(target) is None and target in names and t.slots[t.binding[target]].base is not None:
            slots.setdefault(saved.get(target, target), t.binding[target])
    held = set(slots.values())
    for name in names:
        s = t.slots[t.binding[name]]
        if s.index not in held and s.ops and isinstance(s.base, str):
            slots[saved.get(name, name)] = s.index
            held.add(s.index)
    return slots


@dataclass
class Output:
    """How one key of the folded checkpoint is made: a slot's final value, a constant, or the stored
    bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    slot: int | None = None
    fill: float | None = None
    raw: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OnePass:
    """A key whose value is one pass of the rotation kernel over a stored tensor of its own dtype
    (a norm's gain, ``scale``, multiplied in on the way), after a centering into the output's
    memory where the plan centers it first: computed from the mapped file, or compared with a
    candidate's bytes, with no copy of the stored tensor."""

    source: str
    axis: int
    table: structured_kernel.Structured
    scale: torch.Tensor | None = None
    center: Centering | None = None
    center_scale: torch.Tensor | None = None


class StreamedTensors:
    """Every tensor of ``md`` folded by ``plan``, by key, each computed when asked for (to read, not
    to change); with ``dtype``, those of the model loaded in that dtype, then folded.

    >>> tensors = StreamedTensors(open_checkpoint(path), plan)  # doctest: +SKIP
    >>> tensors.get("lm_head.weight").shape  # doctest: +SKIP
    torch.Size([50257, 768])
    """

    def __init__(
        self,
        ck: Checkpoint,
        plan: FoldPlan,
        *,
        reader: TensorReader | None = None,
        dtype: str | None = None,
    ) -> None:
        self.ck = ck
        self.fixed_order = plan.fixed_order_products
        # else glibc keeps the freed slabs on a heap that small lasting values (W β) pin: it grows
        # by layer
        return_freed_memory()
        self.reader = reader if reader is not None else TensorReader(ck)
        self._own_reader = reader is None
        keys, key = ck.keys, ck.key
        self.trace = t = trace_plan(ck.meta_as_loaded(dtype or "auto"), plan, key)
        for s in t.slots:
            if isinstance(s.base, str) and tuple(self.reader.shape(s.base)) != s.shape:
                raise CheckpointError(
                    f"{s.base} has shape {list(self.reader.shape(s.base))} in the checkpoint, "
                    f"but {s.names[0]} loads as {list(s.shape)}"
                )
        stored = (
            self.ck.tensors
        )  # cast to the stored dtype only what a header lists, as a save of the loaded model
        self.outputs: dict[str, Output] = {}
        for k, i in output_slots(t, plan, ck).items():
            s = t.slots[i]
            if (
                s.base is None and k in keys
            ):  # a buffer the model builds itself: the stored bytes stay
                self.outputs[k] = Output(self.reader.dtype(k), tuple(self.reader.shape(k)), raw=k)
            else:
                # with ``dtype``: the model loaded in it, folded and saved, so each tensor as
                # loaded;
                # else as stored, but a changed tensor no narrower than it loads
                own = (
                    s.dtype
                    if k not in stored or dtype is not None
                    else widened(DTYPES[stored[k].dtype], s.dtype)
                    if s.ops
                    else DTYPES[stored[k].dtype]
                )
                unchanged = (
                    not s.ops
                    and isinstance(s.base, str)
                    and s.dtype == own == self.reader.dtype(s.base)
                )
                # nothing changes it: the stored bytes
                self.outputs[k] = (
                    Output(own, s.shape, raw=s.base) if unchanged else Output(own, s.shape, slot=i)
                )
        for e in plan.foldable:
            for leaf, fill in (("weight", 1.0), ("bias", 0.0)):
                k = key(f"{e.name}.{leaf}")
                if (
                    k is not None and k not in self.outputs
                ):  # dropped with the affine: 1 and 0 on disk
                    info = stored.get(k)
                    self.outputs[k] = Output(
                        DTYPES[info.dtype] if info else torch.float32,
                        tuple(info.shape) if info else tuple(e.normalized_shape),
                        fill=fill,
                    )
        for k in sorted(keys - self.outputs.keys()):  # stored but not loaded: kept as they are
            self.outputs[k] = Output(self.reader.dtype(k), tuple(self.reader.shape(k)), raw=k)
        self._pending: dict[int, set[str]] = {}
        for k, out in self.outputs.items():
            if out.slot is not None:
                self._pending.setdefault(out.slot, set()).add(k)
        self._taps: dict[tuple[int, int], list[Read]] = {}  # what others read of a slot, by version
        for s in t.slots:
            for op in s.ops:
                for r in op.reads:
                    at = r.weight if isinstance(r, Product) else r
                    self._taps.setdefault((at.slot, at.version), []).append(r)
        self._memo: dict[Read, torch.Tensor] = {}
        self._stash: dict[int, torch.Tensor] = {}

    def keys(self) -> list[str]:
        return list(self.outputs)

    def __contains__(self, key: object) -> bool:
        return key in self.outputs

    def centerings(self, key: str) -> tuple[str | None, list[Centering]]:
        """The key the output's bytes come from (through an untied copy) and the centerings applied
        on the way, in order."""
        out = self.outputs[key]
        if out.slot is None:
            return out.raw, []
        found: list[Centering] = []
        index, version = out.slot, len(self.trace.slots[out.slot].ops)
        while True:
            s = self.trace.slots[index]
            for op in reversed(s.ops[:version]):
                if op.kind != "center":
                    raise PlanError(f"the plan does more to {key} than center it ({op.kind})")
                found.insert(0, op.centering)
            if not isinstance(s.base, Ref):
                return s.base, found
            index, version = s.base.slot, s.base.version

    def get(self, key: str, into: Buffer | None = None) -> torch.Tensor:
        """The folded tensor (to read, not to change); one computed in ``into``'s memory where
        given, valid until its next use."""
        out = self.outputs[key]
        if out.raw is not None:
            return self.reader.read(out.raw, into)
        if out.fill is not None:
            return torch.full(out.shape, out.fill, dtype=out.dtype)
        s = self.trace.slots[out.slot]
        pending = self._pending[s.index]
        pending.discard(key)
        t = self._stash.get(s.index)
        if t is None and (one := self.one_pass(key)) is not None:
            t = self._from_file(s.index, one, into)
        elif t is None:
            t = self._value(s.index, len(s.ops))
            if pending and self._stashed() + s.nbytes <= STASH_BYTES:
                self._stash[s.index] = t  # another key has it too (a tie's copy)
        if not pending:
            self._stash.pop(s.index, None)
        return t.to(out.dtype) if t.dtype != out.dtype else t

    def one_pass(self, key: str, any_size: bool = False) -> OnePass | None:
        """How ``key`` is one pass of the rotation kernel over its stored tensor, where it is:
        rotated along a whole axis after a gain or a centering, from a mappable tensor of its
        dtype that nothing else reads once changed."""
        out = self.outputs[key]
        s = self.trace.slots[out.slot] if out.slot is not None else None
        source = self._stored(s) if s is not None else None
        if (
            source is None
            or out.dtype != s.dtype
            or (s.nbytes > ONE_PASS_BYTES and not any_size)
            or any((s.index, v) in self._taps for v in range(1, len(s.ops) + 1))
            or not 0 < len(s.ops) <= 2
        ):
            return None
        first, rotate = s.ops[0] if len(s.ops) == 2 else None, s.ops[-1]
        rot, r = rotate.rotated, rotate.rotation
        if rotate.kind != "rotate" or r.kind != "hadamard" or r.version < 2 or rot.start:
            return None
        if structured_kernel.library() is None or not structured_kernel.usable(s.dtype):
            return None  # the step-by-step path says why
        shape = torch.Size(s.shape)
        n = shape[rot.axis % len(shape)]
        if rot.length not in (0, n):
            return None
        table = structured_kernel.structured(n, r.seed, r.keep_mean)
        one = OnePass(source, rot.axis, table)
        if first is None:
            return one
        if first.kind == "center":
            c = first.centering
            gain = self._read(first.reads[0]) if first.reads else None
            return dataclasses.replace(one, center=c, center_scale=gain)
        # no memory: the kernel's conditions read only the shape, dtype and device
        shaped = torch.empty((), dtype=s.dtype).expand(shape)
        if first.kind == "scale" and scaled_in_kernel(shaped, rot, r, first.fused):
            return dataclasses.replace(one, scale=self._gain(first))
        return None

    def _stored(self, s: Slot) -> str | None:
        """The stored key a slot's first value is, as stored (an untied copy's too), where it can
        be mapped."""
        base = s.base
        if isinstance(base, Ref) and base.version == 0:
            copied = self.trace.slots[base.slot]
            base = copied.base if copied.dtype == s.dtype else None
        ok = isinstance(base, str) and self.reader.mappable(base)
        return base if ok and self.reader.dtype(base) == s.dtype else None

    def in_pieces(self, key: str) -> OnePass | None:
        """``one_pass`` of a tensor too large to work on whole (``pieces.WHOLE_BYTES``) whose
        centering, if any, is along its rotation: worked a piece of whole vectors at a time."""
        one = self.one_pass(key, any_size=True)
        s = self.trace.slots[self.outputs[key].slot] if one is not None else None
        if s is None or s.nbytes <= WHOLE_BYTES:
            return None
        at = one.axis % len(s.shape)
        return one if one.center is None or one.center.axis % len(s.shape) == at else None

    def pieces(self, key: str, into: Sequence[Buffer]) -> Iterator[tuple[Piece, torch.Tensor]]:
        """``get(key)`` a piece at a time (``in_pieces``), each in the memory of the buffers in
        turn until its next use: rotated from the mapped file, or gathered from it first where it
        is a block of columns or centered (the pages read dropped after each)."""
        one = self.in_pieces(key)
        s = self.trace.slots[self.outputs[key].slot]
        self._pending[s.index].discard(key)
        with self.reader.mapped(one.source) as m:
            for piece, src, t in self._piece_sources(one, s, m, into):
                yield (
                    piece,
                    structured_kernel.rotate_from(src, t, piece.axis, one.table, one.scale),
                )

    def _piece_sources(
        self, one: OnePass, s: Slot, m: Mapped, into: Sequence[Buffer]
    ) -> Iterator[tuple[Piece, int, torch.Tensor]]:
        """Each piece of ``one``'s stored tensor (mapped as ``m``), the address the kernel reads
        it from, and a tensor of the piece's shape in the memory of the next of ``into`` (where the
        writer's rotation goes): a run of rows nothing centers first is read where the file lies
        (no copy); a block of columns, or a centered piece, is gathered into that memory (and
        centered there). The pages read are dropped once the caller is done with each."""
        stored = m.tensor(s.dtype, s.shape)
        itemsize = s.dtype.itemsize
        for i, piece in enumerate(pieces(s.shape, one.axis, itemsize)):
            size = math.prod(piece.shape) * itemsize
            t = into[i % len(into)].bytes(size).view(s.dtype).view(piece.shape)
            at = piece.lies_at(itemsize) if one.center is None else None
            if at is None:
                gather(piece, stored, t, m.release)
                if one.center is not None:
                    c = one.center
                    center_(t, piece.axis, c.groups, one.center_scale, c.blocks)
            yield piece, (t.data_ptr() if at is None else m.address + at), t
            m.release()
        del stored

    def equal_in_file(
        self, key: str, cand: Callable[[], Mapped], into: tuple[Buffer, Buffer]
    ) -> bool | None:
        """Whether the candidate's bytes (``cand`` maps them) are ``get(key)``'s, compared by the
        kernel from the mapped files (a centering first written into ``into[0]``), or a piece at
        a time (a gathered piece of the reference in ``into[0]``, of the candidate in
        ``into[1]``); None where ``key`` is neither."""
        if self.outputs[key].slot is None:
            return None
        s = self.trace.slots[self.outputs[key].slot]
        if (one := self.in_pieces(key)) is not None:
            self._pending[s.index].discard(key)
            return self._equal_in_pieces(one, s, cand, into)
        one = self.one_pass(key)
        if one is None:
            return None
        self._pending[s.index].discard(key)
        with self.reader.mapped(one.source) as m, cand() as theirs:
            src = m.address
            if one.center is not None:
                src = self._centered(m, one, into[0].bytes(s.nbytes).view(s.dtype).view(s.shape))
            return structured_kernel.rotated_equal(
                src, theirs.address, s.dtype, s.shape, one.axis, one.table, scale=one.scale
            )

    def _equal_in_pieces(
        self, one: OnePass, s: Slot, cand: Callable[[], Mapped], into: tuple[Buffer, Buffer]
    ) -> bool:
        """``equal_in_file`` a piece at a time: each compared by the kernel with the candidate's
        piece, read where the file lies for a run of rows, gathered into ``into[1]`` for a block
        of columns (the candidate's pages dropped after each)."""
        itemsize = s.dtype.itemsize
        with self.reader.mapped(one.source) as m, cand() as theirs:
            stored = theirs.tensor(s.dtype, s.shape)
            for piece, src, t in self._piece_sources(one, s, m, into[:1]):
                at = piece.lies_at(itemsize)
                if at is None:  # a block of columns: gathered as the source's was
                    gathered = into[1].bytes(t.numel() * itemsize).view(s.dtype).view(piece.shape)
                    theirs_at = gather(piece, stored, gathered, theirs.release).data_ptr()
                else:
                    theirs_at = theirs.address + at
                same = structured_kernel.rotated_equal(
                    src, theirs_at, s.dtype, piece.shape, piece.axis, one.table, scale=one.scale
                )
                theirs.release()
                if not same:
                    return False
            del stored
        return True

    def _gain(self, scale: Op) -> torch.Tensor:
        f = scale.fused
        gamma = self._read(scale.reads[0]).to(torch.float64).reshape(-1)
        return gamma[f.offset : f.offset + f.length]

    def compute_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """``get(key)`` written into ``out`` (its shape and dtype, contiguous: the output file's
        own pages, mapped), where ``one_pass(key)``."""
        s = self.trace.slots[self.outputs[key].slot]
        self._pending[s.index].discard(key)
        return self._from_file(s.index, self.one_pass(key), out=out)

    def _from_file(
        self, index: int, one: OnePass, into: Buffer | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``one`` computed from the mapped stored tensor (what others read of its first value is
        read from the file too, when they ask)."""
        s = self.trace.slots[index]
        if out is None:
            out = (
                into.bytes(s.nbytes).view(s.dtype).view(s.shape)
                if into is not None
                else torch.empty(s.shape, dtype=s.dtype)
            )
        with self.reader.mapped(one.source) as m:
            src = m.address if one.center is None else self._centered(m, one, out)
            return structured_kernel.rotate_from(src, out, one.axis, one.table, one.scale)

    @staticmethod
    def _centered(m: Mapped, one: OnePass, out: torch.Tensor) -> int:
        """``one``'s centering of the mapped tensor written into ``out``; its address."""
        c = one.center
        if not center_into(m.address, out, c.axis, c.groups, one.center_scale, c.blocks):
            out.copy_(m.tensor(out.dtype, out.shape))
            center_(out, c.axis, c.groups, one.center_scale, c.blocks)
        return out.data_ptr()

    def _stashed(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stash.values())

    def _value(self, index: int, version: int) -> torch.Tensor:
        s = self.trace.slots[index]
        if isinstance(s.base, Ref):
            t = self._value(s.base.slot, s.base.version)
        elif s.base is None:
            raise CheckpointError(
                f"the checkpoint has no tensor for {s.names[0]}, which the fold needs"
            )
        else:
            t = self.reader.read(s.base).to(s.dtype)
        with torch.no_grad():
            ops, v = s.ops[:version], 0
            while v < len(ops):
                self._tap(index, v, t)
                if self._scaled_rotation(index, v, ops, t):
                    v += 2
                    continue
                self._apply(ops[v], t)
                v += 1
            self._tap(index, version, t)
        return t

    def _scaled_rotation(self, index: int, v: int, ops: list[Op], t: torch.Tensor) -> bool:
        """A fused gain and the rotation after it (``ops[v]``, ``ops[v + 1]``) applied in one pass
        of the rotation kernel, with the bits of the two steps one after the other; False where
        they cannot be, or where another slot reads the scaled weight before its rotation."""
        if v + 1 >= len(ops) or (index, v + 1) in self._taps:
            return False
        scale, rotate = ops[v], ops[v + 1]
        if (
            scale.kind != "scale"
            or rotate.kind != "rotate"
            or not scaled_in_kernel(t, rotate.rotated, rotate.rotation, scale.fused)
        ):
            return False
        f = scale.fused
        gamma = (
            self._read(scale.reads[0]).to(torch.float64).reshape(-1)[f.offset : f.offset + f.length]
        )
        apply_rotation(t, rotate.rotated, rotate.rotation, gamma)
        return True

    def _tap(self, index: int, version: int, t: torch.Tensor) -> None:
        """Keep what other slots read of this one at this version: small values, so a large one is
        never held."""
        for r in self._taps.get((index, version), ()):
            if r not in self._memo:
                self._memo[r] = (
                    fused_product(
                        t,
                        r.fused,
                        self._read(r.beta).to(torch.float64).reshape(-1),
                        self.fixed_order,
                    )
                    if isinstance(r, Product)
                    else t.clone()
                )

    def _read(self, r: Read) -> torch.Tensor:
        if r not in self._memo and self._mapped_product(r):
            return self._memo[r]
        if r not in self._memo:
            at = r.weight if isinstance(r, Product) else r
            s = self.trace.slots[at.slot]
            # a fused bias comes before its weight in the file: finish the weight while it is here
            ahead = (
                isinstance(r, Product)
                and bool(self._pending.get(at.slot))
                and at.slot not in self._stash
                and self._stashed() + s.nbytes <= STASH_BYTES
            )
            t = self._value(at.slot, len(s.ops) if ahead else at.version)
            if ahead:
                self._stash[at.slot] = t
        return self._memo[r]

    def _mapped_product(self, r: Read) -> bool:
        """``W β`` of a stored weight as it is, read from the mapped file (nothing copied, nothing
        computed ahead); False where it is not that."""
        if not isinstance(r, Product) or r.weight.version != 0:
            return False
        s = self.trace.slots[r.weight.slot]
        source = self._stored(s)
        if source is None:
            return False
        beta = self._read(r.beta).to(torch.float64).reshape(-1)
        if s.nbytes > WHOLE_BYTES and self.fixed_order:
            self._memo[r] = self._product_in_pieces(source, s, r.fused, beta)
            return True
        with self.reader.mapped(source) as m:
            w = m.tensor(s.dtype, s.shape)
            self._memo[r] = fused_product(w, r.fused, beta, self.fixed_order)
            del w
        return True

    def _product_in_pieces(
        self, source: str, s: Slot, f: Fused, beta: torch.Tensor
    ) -> torch.Tensor:
        """``fused_product`` of a large stored weight, a piece of whole vectors at a time: each
        output sums one vector in a fixed order, so the pieces give the whole's bits."""
        into, out = Buffer(), None
        with self.reader.mapped(source) as m:
            stored = m.tensor(s.dtype, s.shape)
            for piece in pieces(s.shape, f.axis, s.dtype.itemsize):
                if piece.lies_at(s.dtype.itemsize) is None:
                    t = into.bytes(math.prod(piece.shape) * s.dtype.itemsize).view(s.dtype)
                    t = gather(piece, stored, t.view(piece.shape), m.release)
                else:  # a run of rows: summed where the file lies
                    t = piece.of(stored)
                out = self._sum_piece(t, piece, f, beta, out)
                del t
                m.release()
            del stored
        return out.reshape([d for i, d in enumerate(s.shape) if i != f.axis % len(s.shape)])

    @staticmethod
    def _sum_piece(
        t: torch.Tensor, piece: Piece, f: Fused, beta: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The piece's outputs of ``fused_product`` put in their place of ``out`` ([outer, inner],
        made on the first piece)."""
        part = fused_product(t, dataclasses.replace(f, axis=piece.axis), beta, True)
        if out is None:
            out = torch.empty(piece.dims[0], piece.dims[2], dtype=part.dtype)
        place = out[piece.index[0], piece.index[2]]
        place.copy_(part.reshape(place.shape))
        return out

    def _apply(self, op: Op, t: torch.Tensor) -> None:
        """One operation, with the very code the in-memory steps run."""
        if op.kind == "fill":  # FuseAffine: γ = 1
            t.fill_(op.fill)
        elif op.kind == "set_bias":  # FuseAffine: β/γ where β stays, else 0
            beta = self._read(op.reads[0]).to(torch.float64).reshape(-1)
            if not op.gain:
                t.copy_(torch.zeros_like(t))
            elif len(op.reads) > 1:
                gamma = self._read(op.reads[1]).to(torch.float64).reshape(-1)
                if not bool(gamma.ne(0).all()):
                    raise PlanError(
                        "the plan keeps a norm's bias as β/γ, but its gain has a zero entry; "
                        "analyze this model again"
                    )
                t.copy_((beta / gamma).reshape(t.shape))
            else:
                t.copy_(beta.reshape(t.shape))
        elif op.kind == "add_product":  # fuse_: bias += W β
            t.copy_(t.to(torch.float64) + self._read(op.reads[0]).reshape(t.shape))
        elif op.kind == "scale":  # fuse_: W's block *= γ
            scale_inputs_(t, op.fused, self._read(op.reads[0]).to(torch.float64).reshape(-1))
        elif op.kind == "center":
            c = op.centering
            center_(t, c.axis, c.groups, self._read(op.reads[0]) if op.reads else None, c.blocks)
        elif op.kind == "rotate":
            apply_rotation(t, op.rotated, op.rotation)
        else:  # pragma: no cover - trace makes no other kind
            raise AssertionError(op.kind)

    def close(self) -> None:
        self._memo.clear()
        self._stash.clear()
        if self._own_reader:
            self.reader.close()
