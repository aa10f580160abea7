"""Pages made ahead: the files at their sizes within the budget, stopped on request, silent on
failure; a rotated checkpoint written into them is the one written afresh, bit for bit."""

import dataclasses

import pytest
import torch
from safetensors import safe_open

from enjoyln.options import CheckOptions, FoldOptions
from enjoyln.rewrite import convert, pages
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.rewrite.pages import EarlyPages
from enjoyln.testing import perturb, tiny_model


def test_files_are_made_at_their_sizes_within_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(pages, "CHUNK", 1 << 16)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    made = EarlyPages([(a, 300_000), (b, 200_000), (c, 100_000)], 400_000)
    made.thread.join()  # to the end of its budget
    # a whole; b by whole chunks until the budget ran out in it; c never opened
    assert made.finish() == {a: 300_000, b: 2 << 16} and not c.exists()
    assert a.stat().st_size == 300_000 and b.stat().st_size == 200_000
    assert a.read_bytes() == bytes(300_000)


def test_finish_stops_it_between_chunks(tmp_path, monkeypatch):
    import threading

    started, go = [], threading.Event()
    real = pages._zeros

    def slow(fd, zeros, at, end):
        started.append(at)
        go.wait()
        return real(fd, zeros, at, end)

    monkeypatch.setattr(pages, "CHUNK", 1 << 16)
    monkeypatch.setattr(pages, "_zeros", slow)
    p = EarlyPages([(tmp_path / "a", 1 << 20), (tmp_path / "b", 1 << 20)], 1 << 30)
    while not started:
        pass
    p.stop.set()
    go.set()
    assert p.finish() == {tmp_path / "a": 1 << 16} and started == [0]
    assert not (tmp_path / "b").exists()


def test_zeros_land_where_asked(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\x01" * 300_000)
    with open(path, "r+b", buffering=0) as f, open("/dev/zero", "rb", buffering=0) as z:
        pages._zeros(f.fileno(), z.fileno(), 1000, 250_000)
    data = path.read_bytes()
    assert data == b"\x01" * 1000 + bytes(249_000) + b"\x01" * 50_000


def test_a_failure_only_stops_it(tmp_path):
    missing = tmp_path / "no-such-dir" / "a"
    assert EarlyPages([(missing, 1 << 20), (tmp_path / "b", 10)], 1 << 20).finish() == {}
    assert not (tmp_path / "b").exists()  # nothing after the failure either


def test_no_budget_without_files():
    assert EarlyPages.start([]) is None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("opt")
    perturb(tiny_model("opt"), seed=3).save_pretrained(path)
    return path


def _bits(path):
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k).view(torch.uint8) for k in f.keys()}, f.metadata()


def test_a_rotation_written_into_pages_made_ahead_is_the_fresh_write(ckpt, tmp_path, monkeypatch):
    options = FoldOptions.of(check="static", rotate=("hadamard", 0, True))
    made = []
    real_start = EarlyPages.start

    def spy(files):
        # one more file than the output has: it must not be published
        p = real_start(files + [(files[0][0].with_name("stray.safetensors"), 4096)])
        made.append(p)
        return p

    real_finish = EarlyPages.finish

    def garbled(self):
        # every byte the writer leaves alone would show: the files longer, and all ones
        first = not self.stop.is_set()
        done = real_finish(self)
        for path in done if first else {}:
            path.write_bytes(b"\xff" * (path.stat().st_size + 12345))
        return done

    monkeypatch.setattr(convert.EarlyPages, "start", staticmethod(spy))
    monkeypatch.setattr(EarlyPages, "finish", garbled)
    ahead = fold_checkpoint(ckpt, tmp_path / "ahead", options)
    assert made and made[0] is not None and len(made[0].made) == 2
    monkeypatch.setattr(EarlyPages, "finish", real_finish)
    monkeypatch.setattr(convert.EarlyPages, "start", staticmethod(lambda files: None))
    # the same bytes as the one that passed its check, below
    fold_checkpoint(
        ckpt, tmp_path / "fresh", dataclasses.replace(options, check=CheckOptions(mode="none"))
    )
    assert ahead.report.passed
    assert sorted(p.name for p in (tmp_path / "ahead").iterdir()) == sorted(
        p.name for p in (tmp_path / "fresh").iterdir()
    )
    a, b = _bits(tmp_path / "ahead"), _bits(tmp_path / "fresh")
    assert a[1] == b[1] and a[0].keys() == b[0].keys()
    for key in a[0]:
        assert torch.equal(a[0][key], b[0][key]), key
    assert (tmp_path / "ahead" / "model.safetensors").read_bytes() == (
        tmp_path / "fresh" / "model.safetensors"
    ).read_bytes()
