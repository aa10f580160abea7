"""Reading a checkpoint's tensors: copied into memory (``read``) or mapped from the file
(``mapped``), the same bytes either way."""

import ctypes
import json
import struct

import pytest
import torch

from enjoyln.errors import CheckpointError
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.store.tensors import TensorReader


def _write(path, tensors):
    """A safetensors file by hand, tensors back to back, so that offsets are not aligned."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        blob = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.fixture
def model_dir(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a": torch.randint(0, 255, (3,), dtype=torch.uint8),
        "b": torch.randn(5000, 7).to(torch.bfloat16),
        "c": torch.randn(1300, 9),
    }
    _write(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    return tmp_path, tensors


def test_mapped_tensors_are_the_bytes_read_at_any_offset(model_dir):
    path, tensors = model_dir
    reader = TensorReader(open_checkpoint(path))
    try:
        for key, t in tensors.items():
            assert reader.mappable(key)
            want = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            with reader.mapped(key) as m:
                assert m.nbytes == len(want)
                assert ctypes.string_at(m.address, m.nbytes) == want
            assert reader.read(key).view(-1).view(torch.uint8).numpy().tobytes() == want
            reader.prefetch(key)  # a hint, nothing to see
        assert reader.bytes_read == 2 * sum(
            len(t.view(-1).view(torch.uint8)) for t in tensors.values()
        )
    finally:
        reader.close()


def test_a_file_cut_short_after_it_was_opened_is_refused_not_mapped(model_dir):
    path, _ = model_dir
    reader = TensorReader(open_checkpoint(path))
    try:
        file = path / "model.safetensors"
        data = file.read_bytes()
        file.write_bytes(data[:-100])  # the header still promises the last 100 bytes of "c"
        with pytest.raises(CheckpointError, match="ended early"):
            reader.mapped("c")
    finally:
        reader.close()


def test_a_pickled_checkpoint_is_not_mappable(model_dir):
    path, tensors = model_dir
    (path / "model.safetensors").unlink()
    torch.save(tensors, path / "pytorch_model.bin")
    reader = TensorReader(open_checkpoint(path, allow_pickle=True))
    assert not reader.mappable("c") and torch.equal(reader.read("c"), tensors["c"])


def test_a_writable_mapping_whose_pages_cannot_be_made_writable_raises(model_dir, monkeypatch):
    """Made writable up front or refused with OSError (a full disk, an old kernel), never a
    mapping whose first store might end the process with SIGBUS; the file is left as it was."""
    import os

    from enjoyln.store import tensors

    path, _ = model_dir
    before = (path / "model.safetensors").read_bytes()
    monkeypatch.setattr(tensors, "_MADV_POPULATE_WRITE", 12345)  # an advice no kernel knows: EINVAL
    fd = os.open(path / "model.safetensors", os.O_RDWR)
    try:
        with pytest.raises(OSError):
            tensors.Mapped(fd, 100, 1000, writable=True)
    finally:
        os.close(fd)
    assert (path / "model.safetensors").read_bytes() == before
