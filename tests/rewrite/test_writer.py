"""The streaming writer: a tensor centered where the early copy put it, in the output file's own
pages, has the bits ``center_`` gives it in memory."""

import os

import pytest
import torch

from enjoyln.rewrite.entries import Entry
from enjoyln.store.formats import DTYPES
from enjoyln.rewrite.writer import _center_in_file
from enjoyln.transform.tensors import center_

NAMES = {v: k for k, v in DTYPES.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape, axis, groups, blocks, scaled",
    [
        ((96, 40), 0, 1, None, False),
        ((96, 40), 1, 1, None, True),
        ((6, 48, 5), 1, 4, (1, 3), True),
        ((12, 7, 3), 2, 3, None, False),
    ],
)
def test_centering_in_the_file_gives_the_in_memory_bits(
    tmp_path, dtype, shape, axis, groups, blocks, scaled
):
    gen = torch.Generator().manual_seed(3)
    t = (torch.randn(shape, generator=gen) * 2 + 0.3).to(dtype)
    scale = torch.rand(shape[axis], generator=gen) + 0.5 if scaled else None
    raw = t.view(-1).view(torch.uint8).numpy().tobytes()
    at = 4096 * 3 + 7  # past a page, and not aligned to the element
    path = tmp_path / "shard"
    path.write_bytes(b"\x01" * at + raw + b"\x02" * 100)
    entry = Entry(
        "w", NAMES[dtype], shape, len(raw), axis=axis, groups=groups, blocks=blocks, scale=scale
    )
    fd = os.open(path, os.O_RDWR)
    try:
        assert _center_in_file(fd, at, entry)
    finally:
        os.close(fd)
    data = path.read_bytes()
    want = (
        center_(t.clone(), axis, groups, scale, blocks).view(-1).view(torch.uint8).numpy().tobytes()
    )
    assert want != raw  # something was centered
    assert data == b"\x01" * at + want + b"\x02" * 100  # and nothing beside it moved


def test_a_tensor_that_cannot_be_mapped_is_left_to_the_plain_write(tmp_path, monkeypatch):
    """Where the output cannot be mapped writable (ENODEV, or no room for its blocks), centering
    in the file says so and changes nothing; the writer then reads, centers and writes it."""
    import errno

    from enjoyln.rewrite import writer

    def refuse(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(
        writer,
        "Mapped",
        type("Refused", (), {"__init__": refuse, "available": staticmethod(lambda: True)}),
    )
    raw = torch.randn(64, 8).view(-1).view(torch.uint8).numpy().tobytes()
    path = tmp_path / "shard"
    path.write_bytes(raw)
    fd = os.open(path, os.O_RDWR)
    try:
        assert not _center_in_file(fd, 0, Entry("w", "F32", (64, 8), len(raw), axis=0))
    finally:
        os.close(fd)
    assert path.read_bytes() == raw


def test_computed_tensors_written_behind_land_where_they_belong(tmp_path, monkeypatch):
    """Small tensors are written on the second thread while the next is computed, a large one in
    turn; each lands at its offset, and a write that fails is raised when the block ends."""
    from enjoyln.rewrite import writer

    monkeypatch.setattr(writer, "WRITE_BEHIND_BYTES", 400)
    tensors = [
        torch.arange(i * 50, i * 50 + n, dtype=torch.float32)
        for i, n in enumerate((30, 200, 0, 64))
    ]
    path = tmp_path / "shard"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    at = 0
    try:
        with writer._WriteBehind(fd) as behind:
            behind_flags = []
            for t in tensors:
                behind_flags.append(behind.write(t, at))
                if not behind_flags[-1]:
                    behind.wait()
                    writer._pwrite_all(fd, memoryview(t.numpy().view("u1")), at)
                at += t.numel() * 4
    finally:
        os.close(fd)
    assert behind_flags == [True, False, True, True]  # 800 bytes is over the bound
    assert torch.equal(
        torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32), torch.cat(tensors)
    )
    read_only = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError), writer._WriteBehind(read_only) as behind:
            assert behind.write(tensors[0], 0)
    finally:
        os.close(read_only)


def test_no_write_carries_more_than_a_step(tmp_path, monkeypatch):
    """Large writes make large folios, which this writer avoids: every write() is at most
    WRITE_STEP, and the bytes land whole."""
    from enjoyln.rewrite import writer

    sizes, real = [], os.pwrite

    def spy(fd, data, at):
        sizes.append(len(data))
        return real(fd, data, at)

    monkeypatch.setattr(writer, "WRITE_STEP", 1000)
    monkeypatch.setattr(writer.os, "pwrite", spy)
    data = bytes(range(256)) * 17
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        writer._pwrite_all(fd, memoryview(data), 5)
    finally:
        os.close(fd)
    assert sizes == [1000] * 4 + [352] and path.read_bytes() == bytes(5) + data


@pytest.mark.parametrize("made", [0, 10**9])
def test_a_tensor_goes_into_the_mapping_only_where_its_pages_were_made(tmp_path, monkeypatch, made):
    """A mapping's page faults would make the pages in large folios: a computed tensor is computed
    into the file's mapping where ``made`` covers it, else written from memory; the same bytes."""
    from enjoyln.rewrite import writer

    mapped = []
    real = writer._into_file
    monkeypatch.setattr(writer, "_into_file", lambda *a: mapped.append(1) or real(*a))
    t = torch.arange(1000, dtype=torch.float32)
    e = Entry(
        "w",
        "F32",
        (1000,),
        4000,
        compute=lambda buf: t.clone(),
        into_file=lambda out: out.copy_(t),
    )
    w = writer.Writing(None, {}, lambda n: None)
    path = tmp_path / "shard.safetensors"
    if made:  # as the pages made ahead leave it
        path.write_bytes(b"\xff" * 8192)
    writer.write_shard(path, [e], w, made=made)
    assert bool(mapped) == bool(made)
    from safetensors.torch import load_file

    assert torch.equal(load_file(path)["w"], t)
