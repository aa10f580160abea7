"""Streaming fuse-affine and rotate: every final tensor computed from the reference tensors it
depends on, bit for bit what the plan applied to the loaded model gives (``final_tensors``)."""

import pytest
import torch

from enjoyln.transform.rotation import rotate_, rotation_matrix
from enjoyln.plan import Fused
from enjoyln.transform.tensors import fuse_


def bits(t):
    """A tensor's bytes as integers, so that equal means bit for bit (NaNs and -0.0 included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _old_rotate_(t, axis, q, start=0, *, rows=1 << 16):
    """rotate_ as it was before it worked in bounded slabs (verbatim): the oracle."""
    axis = axis % t.dim()
    n = q.shape[0]
    block = t.narrow(axis, start, n)
    other = 0 if axis != 0 or t.dim() == 1 else 1
    slabs = (
        [block]
        if t.dim() == 1
        else block.split(max(1, rows * n // max(block.numel(), 1) * block.shape[other]) or 1, other)
    )
    for slab in slabs:
        wide = slab.detach().to(torch.float64).movedim(axis, -1)
        slab.copy_((wide @ q).movedim(-1, axis))
    return t


def _old_fuse_(weight, bias, f, gamma, beta):
    """fuse_ as it was before it scaled in slabs (verbatim): the oracle."""
    wide = weight.detach().to(torch.float64)
    block = wide.narrow(f.axis, f.start, f.length)
    seg = slice(f.offset, f.offset + f.length)
    if bias is not None and beta is not None:
        added = torch.tensordot(block, beta[seg].to(torch.float64), dims=([f.axis], [0]))
        bias.copy_(bias.detach().to(torch.float64) + added.reshape(bias.shape))
    if gamma is not None:
        shape = [f.length if d == f.axis else 1 for d in range(wide.dim())]
        block.mul_(gamma[seg].to(torch.float64).reshape(shape))
    weight.copy_(wide)


@pytest.mark.parametrize(
    "shape,axis,start,n",
    [
        ((2000, 64), 1, 0, 64),
        ((64, 2100), 0, 0, 64),
        ((37, 64), 1, 0, 64),
        ((64, 41), 0, 0, 64),
        ((3, 64), 1, 0, 64),
        ((2, 64), 1, 0, 64),
        ((1, 64), 1, 0, 64),
        ((29, 80), 1, 8, 64),
        ((5, 7, 64), 2, 0, 64),
        ((64, 3, 2, 2), 0, 0, 64),
        ((64,), 0, 0, 64),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slab", [1, 150, 1 << 22])
def test_rotation_in_slabs_gives_the_old_bits(shape, axis, start, n, dtype, slab):
    """Slabs give the bits of one whole product: each starts on a BLAS tile boundary. In float64
    a slab of another height (962 rows) shows a difference, so the test can fail."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = rotation_matrix(n, "random", 3, True)
    expected = _old_rotate_(t.clone(), axis, q, start)
    assert torch.equal(bits(rotate_(t, axis, q, start, slab=slab)), bits(expected))


@pytest.mark.parametrize(
    "shape,f,bias",
    [
        ((24, 16), Fused("w", 1, 0, 16), True),
        ((16, 24), Fused("w", 0, 0, 16), True),
        ((24, 32), Fused("w", 1, 8, 16, offset=0), True),
        ((24, 32), Fused("w", 1, 0, 16, offset=16), False),
        ((5, 16, 3), Fused("w", 1, 0, 16), False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fusion_in_slabs_gives_the_old_bits(shape, f, bias, dtype, monkeypatch):
    from enjoyln.transform import tensors

    monkeypatch.setattr(tensors, "_SCALE_ELEMENTS", 7)  # many slabs
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(shape, generator=gen).to(dtype)
    out = shape[1 - f.axis] if len(shape) == 2 else shape[0] * shape[2]
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    gamma, beta = (
        1 + 0.3 * torch.randn(32, generator=gen, dtype=torch.float64),
        torch.randn(32, generator=gen, dtype=torch.float64),
    )
    w2, b2 = w.clone(), b.clone() if bias else None
    _old_fuse_(w2, b2, f, gamma, beta)
    fuse_(w, b, f, gamma, beta)
    assert torch.equal(bits(w), bits(w2))
    if bias:
        assert torch.equal(bits(b), bits(b2))


# --- the streamed tensors against the plan applied in memory -----------------------------------

import contextlib
import gc
import json

import transformers
from safetensors.torch import load_file, save_file

from enjoyln.rewrite import convert
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.rewrite import writer
from enjoyln.folded.planning import analyze_dir
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.testing import perturb, tiny_model
from enjoyln.folded import stream
from enjoyln.folded.stream import Output, StreamedTensors
from enjoyln.transform.steps import trace_plan
from enjoyln.transform.trace import Ref
from enjoyln.transform.steps import apply_plan
from enjoyln.transform.tensors import ties_lost_on_untie
from enjoyln.store.formats import DTYPES
from enjoyln.store.tensors import Buffer, TensorReader
from enjoyln.options import FoldOptions


def final_tensors(ck, plan):
    """Every tensor of the folded checkpoint, by key: the model loaded from ``ck`` with the plan
    applied in memory (in float64 where it computes), in each key's own dtype, the oracle the
    streamed tensors are held to bit for bit. A folded norm whose affine moved keeps γ = 1 and
    β = 0 (or β/γ) on disk, so a plain ``from_pretrained`` still gives the original's outputs."""
    model = ck.library.load(ck, trust_remote_code=False, dtype="auto").eval()
    apply_plan(model, plan)
    saved = ck.saved
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    out = {}
    for name, t in named.items():
        key = ck.key(name)
        if key is not None:
            out.setdefault(key, t.detach())
    for u in plan.untied:
        if ck.key(u.param) is None:
            out[saved.get(u.param, u.param)] = named[u.param].detach()
    for target in ties_lost_on_untie(ck.meta, plan):
        if ck.key(target) is None and target in named:
            out.setdefault(saved.get(target, target), named[target].detach())
    for e in plan.foldable:
        for leaf, fill in (("weight", 1.0), ("bias", 0.0)):
            key = ck.key(f"{e.name}.{leaf}")
            if key is not None and key not in out:  # dropped with the affine: 1 and 0 on disk
                info = ck.tensors.get(key)
                shape = info.shape if info is not None else tuple(e.normalized_shape)
                dtype = DTYPES[info.dtype] if info is not None else torch.float32
                out[key] = torch.full(shape, fill, dtype=dtype)
    # stored but not loaded by the model (GPT-2's attn.bias masks): kept as they are
    rest = sorted(ck.keys - out.keys())
    reader = TensorReader(ck)
    try:
        for key in rest:
            out[key] = ck.pickled_tensors[key][1] if ck.pickled else reader.read(key)
    finally:
        reader.close()
    for key, t in out.items():
        info = ck.tensors.get(key)
        if info is not None and t.dtype != DTYPES[info.dtype]:
            out[key] = t.to(DTYPES[info.dtype])
    return out


def _bert_mlm():
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return perturb(transformers.BertForMaskedLM(config).eval(), seed=31)


def _dinov2():
    """LayerScale after the attention and the MLP: its centerings read the gains."""
    config = transformers.Dinov2Config(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    model = perturb(transformers.Dinov2Model(config).eval(), seed=32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda1" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=torch.Generator().manual_seed(33)))
    return model


MODELS = {
    "gpt2": lambda: perturb(tiny_model("gpt2"), seed=21),  # the head tied to the embedding
    "opt": lambda: perturb(tiny_model("opt"), seed=22),
    "bert-mlm": _bert_mlm,  # the decoder bias tied to cls.predictions.bias
    "dinov2": _dinov2,
    "bloom": lambda: perturb(tiny_model("bloom"), seed=23),
    "whisper": lambda: perturb(tiny_model("whisper"), seed=24),
    "phi": lambda: perturb(tiny_model("phi"), seed=25),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")

    def make(name, **save_kwargs):
        path = root / f"{name}-{'-'.join(f'{k}{v}' for k, v in save_kwargs.items())}"
        if not path.exists():
            MODELS[name]().save_pretrained(path, **save_kwargs)
        return path

    return make


def _streamed_and_final(path, order=None, allow_pickle=False, **options):
    ck = open_checkpoint(path, allow_pickle=allow_pickle)
    plan = analyze_dir(
        ck,
        options.get("auxiliary_centering", False),
        options.get("fuse_affine", False),
        options.get("rotate"),
    )
    streamed = StreamedTensors(ck, plan)
    keys = streamed.keys()
    got = {k: streamed.get(k) for k in (order(keys) if order else keys)}
    streamed.close()
    return plan, got, final_tensors(ck, plan)


def _assert_bit_identical(got, expected):
    assert got.keys() == expected.keys()
    for key, t in expected.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(bits(got[key]), bits(t)), key


@pytest.mark.parametrize(
    "name,options",
    [
        ("gpt2", {"fuse_affine": True}),
        ("gpt2", {"rotate": ("hadamard", 0, True)}),
        ("gpt2", {"rotate": ("random", 3, False)}),
        ("opt", {"fuse_affine": True}),
        ("opt", {"rotate": ("hadamard", 1, False)}),
        ("opt", {"rotate": ("random", 0, True)}),
        (
            "bert-mlm",
            {"fuse_affine": True},
        ),  # nothing fuses (post-LN), but the untied head and tied bias
        ("dinov2", {"fuse_affine": True}),
        ("bloom", {"fuse_affine": True, "auxiliary_centering": True}),
        ("whisper", {"fuse_affine": True, "auxiliary_centering": True}),
        ("phi", {"rotate": ("hadamard", 0, True)}),  # a head with a bias: W β added to it
    ],
)
def test_streamed_tensors_are_final_tensors_bit_for_bit(name, options, saved):
    """Each tensor computed from the reference tensors it depends on is what the plan applied
    to the whole loaded model (the in-memory path the fold used before) gives, bit for bit,
    whatever order the tensors are asked for in."""
    path = saved(name)
    plan, got, expected = _streamed_and_final(path, **options)
    if "rotate" in options:
        assert plan.rotation is not None
    _assert_bit_identical(got, expected)
    _, backwards, _ = _streamed_and_final(path, order=lambda keys: keys[::-1], **options)
    _assert_bit_identical(backwards, expected)


def test_every_kind_of_operation_is_exercised(saved):
    """The cases above reach every operation the trace records (so none is untested)."""
    kinds = set()
    for name, options in [
        ("opt", {"rotate": ("hadamard", 0, True)}),
        ("dinov2", {"fuse_affine": True}),
        ("gpt2", {"rotate": ("hadamard", 0, True)}),
    ]:
        ck = open_checkpoint(saved(name))
        plan = analyze_dir(ck, False, options.get("fuse_affine", False), options.get("rotate"))
        t = trace_plan(ck.meta_as_loaded(), plan, lambda n: n)
        kinds |= {op.kind for s in t.slots for op in s.ops}
        kinds |= {"gain" for s in t.slots for op in s.ops if op.kind == "set_bias" and op.gain}
        kinds |= {
            "scaled centering" for s in t.slots for op in s.ops if op.kind == "center" and op.reads
        }
        kinds |= {"untied" for s in t.slots if isinstance(s.base, Ref)}
    assert kinds == {
        "fill",
        "set_bias",
        "add_product",
        "scale",
        "center",
        "rotate",
        "gain",
        "scaled centering",
        "untied",
    }


def test_nothing_computed_ahead_is_still_bit_identical(saved, monkeypatch):
    """Without room to finish a fused bias's weight ahead, the weight is computed twice; same
    bits."""
    monkeypatch.setattr(stream, "STASH_BYTES", 0)
    _, got, expected = _streamed_and_final(saved("opt"), fuse_affine=True)
    _assert_bit_identical(got, expected)


def test_sharded_half_precision_and_another_load_dtype(saved, tmp_path):
    """A sharded bfloat16 checkpoint; and float32 weights that load in bfloat16 (config.json's
    dtype): the operations run in the dtype the loaded model has, then cast back, as in memory."""
    model = perturb(tiny_model("gpt2"), seed=26).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    _, got, expected = _streamed_and_final(tmp_path / "sharded", rotate=("hadamard", 0, True))
    _assert_bit_identical(got, expected)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}

    src = tmp_path / "loads-bf16"
    perturb(tiny_model("opt"), seed=27).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    _, got, expected = _streamed_and_final(src, fuse_affine=True)
    _assert_bit_identical(got, expected)
    assert (
        got["model.decoder.layers.0.fc1.weight"].dtype == torch.float32
    )  # stored dtype, bf16 values
    assert torch.equal(
        got["model.decoder.layers.0.fc1.weight"],
        got["model.decoder.layers.0.fc1.weight"].to(torch.bfloat16).float(),
    )


def test_pickled_and_unloaded_keys(tmp_path):
    """Pickle weights (allow_pickle) stream from the loaded dict; keys the model does not load
    (GPT-2's attn.masked_bias on the hub) are kept as stored."""
    model = perturb(tiny_model("gpt2", n_layer=1), seed=28)
    pkl = tmp_path / "pkl"
    model.save_pretrained(pkl)  # for its config.json
    (pkl / "model.safetensors").unlink()
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, pkl / "pytorch_model.bin")
    _, got, expected = _streamed_and_final(pkl, allow_pickle=True, rotate=("random", 0, True))
    _assert_bit_identical(got, expected)
    assert torch.equal(got["transformer.h.0.attn.masked_bias"], torch.tensor(-1e4))
    result = fold_checkpoint(
        pkl,
        tmp_path / "out",
        FoldOptions.of(allow_pickle=True, check="static", rotate=("random", 0, True)),
    )
    assert result.report.passed and result.report.static.computed == len(expected), (
        result.report.summary()
    )


# --- the fold's files against the old writer
# -------------------------------------------------------


class _InMemory:
    """The fold's tensors as the old path gave them (``final_tensors``), behind the streamed API."""

    def __init__(self, ck, plan, reader=None):
        self.ck = ck
        self.tensors = final_tensors(ck, plan)
        self.outputs = {k: Output(t.dtype, tuple(t.shape)) for k, t in self.tensors.items()}

    def keys(self):
        return list(self.tensors)

    def __contains__(self, key):
        return key in self.tensors

    def get(self, key, into=None):
        return self.tensors[key].contiguous()

    def in_pieces(self, key):
        return None

    def one_pass(self, key):
        return None

    def close(self):
        pass


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize(
    "name,options,shard",
    [
        ("gpt2", {"fuse_affine": True}, None),
        ("opt", {"rotate": ("hadamard", 0, True)}, None),
        ("gpt2", {"rotate": ("random", 0, False)}, "30KB"),
    ],
)
def test_folded_files_are_the_old_paths_byte_for_byte(
    name, options, shard, saved, tmp_path, monkeypatch
):
    src = saved(name, max_shard_size=shard) if shard else saved(name)
    new = fold_checkpoint(src, tmp_path / "new", FoldOptions.of(check="none", **options)).out_dir
    monkeypatch.setattr(convert, "StreamedTensors", _InMemory)
    old = fold_checkpoint(src, tmp_path / "old", FoldOptions.of(check="none", **options)).out_dir
    assert _files(new) == _files(old)
    if shard:
        assert len([f for f in _files(new) if f.endswith(".safetensors")]) > 1


def test_fold_and_rotate_pass_enjoyln_check(saved, tmp_path):
    """The command line's fold --fuse-affine and rotate, each checked by enjoyln check (the
    static proof recomputes every tensor the same streamed way, then the forward part)."""
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    runner = CliRunner()
    src = saved("gpt2")
    for command in (["fold", "--fuse-affine"], ["rotate", "--kind", "random", "--no-keep-mean"]):
        out = tmp_path / command[0]
        result = runner.invoke(app, [command[0], str(src), str(out), *command[1:], "--no-check"])
        assert result.exit_code == 0, result.output
        result = runner.invoke(app, ["check", str(src), str(out)])
        assert (
            result.exit_code == 0 and "PASS" in result.output and "recomputed" in result.output
        ), result.output


# --- memory: never the whole model
# ------------------------------------------------------------------


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _cpu_storages() -> dict[int, int]:
    """Every CPU tensor storage alive now, whoever holds it: data pointer -> bytes."""
    return {
        o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
        for o in gc.get_objects()
        if type(o) in _TENSOR_TYPES and o.device.type == "cpu"
    }


@pytest.mark.parametrize("options", [{"rotate": ("hadamard", 0, True)}])
def test_the_stream_never_holds_the_whole_model(options, tmp_path, monkeypatch):
    """Every time the fold writes a tensor, and every time the static check compares one, the
    tensors alive (counted by their storages, whoever holds them) are a few of the largest,
    not the model: 12 layers here, each tensor at most 1/30 of it. The plan applied in memory
    (the old path) holds all of it while it writes."""
    from enjoyln.checking import verify

    src = tmp_path / "src"
    perturb(tiny_model("gpt2", n_layer=12), seed=29).save_pretrained(src)
    ck = open_checkpoint(src)
    largest, total = max(t.nbytes for t in ck.tensors.values()), ck.nbytes
    assert 30 * largest < total
    peaks = {"write": [], "compare": []}

    def measured(where, real):
        def run(*args, **kwargs):
            calls[where] += 1
            if calls[where] % 6 == 0:  # a scan of every object takes a while: every sixth call
                peaks[where].append(sum(n for p, n in _cpu_storages().items() if p not in before))
            return real(*args, **kwargs)

        return run

    calls = {"write": 0, "compare": 0}
    monkeypatch.setattr(writer, "_pwrite_all", measured("write", writer._pwrite_all))
    # a rotated tensor is computed straight into the output file's pages
    monkeypatch.setattr(writer, "_into_file", measured("write", writer._into_file))
    monkeypatch.setattr(verify, "nearest", measured("compare", verify.nearest))
    # a rotated tensor is compared from the mapped files in one pass
    one_pass = measured("compare", StreamedTensors.equal_in_file)
    monkeypatch.setattr(StreamedTensors, "equal_in_file", one_pass)
    gc.collect()
    before = set(_cpu_storages())
    result = fold_checkpoint(src, tmp_path / "out", FoldOptions.of(check="static", **options))
    assert result.report.passed and result.report.static.computed > 0
    assert len(peaks["write"]) > 15 and len(peaks["compare"]) > 15
    assert 0 < max(peaks["write"]) <= 6 * largest, (peaks, largest, total)
    assert 0 < max(peaks["compare"]) <= 8 * largest, (peaks, largest, total)


def test_rotated_weights_come_from_the_mapped_file_in_one_pass(saved):
    """A rotated weight (centered first, or with a gain multiplied in, or the untied head made of
    the embedding's bytes) is computed from its mapped file straight into the caller's memory,
    with the bits of the step-by-step path, and no tensor of the layer is read into memory for
    it; the static check's comparison says equal for those bits and not for one bit off."""
    ck = open_checkpoint(saved("gpt2"))
    plan = analyze_dir(ck, False, True, ("hadamard", 0, True))
    streamed = StreamedTensors(ck, plan)
    one_pass = [k for k in streamed.keys() if streamed.one_pass(k) is not None]
    assert {
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "lm_head.weight",
    } <= set(one_pass)
    read = []
    real_read = streamed.reader.read
    streamed.reader.read = lambda key, into=None: read.append(key) or real_read(key, into)
    expected, into = final_tensors(ck, plan), Buffer()
    for key in one_pass:
        got = streamed.get(key, into)
        assert got.data_ptr() == into.data.data_ptr() and torch.equal(
            bits(got), bits(expected[key])
        )
        cand = expected[key].contiguous().clone()
        assert streamed.equal_in_file(key, lambda: _Held(cand), (Buffer(), Buffer())) is True
        cand.view(-1).view(torch.int32)[cand.numel() // 2] ^= 1
        assert streamed.equal_in_file(key, lambda: _Held(cand), (Buffer(), Buffer())) is False
    assert not any(k.endswith("weight") and ".ln_" not in k for k in read), read
    streamed.close()


class _Held(contextlib.AbstractContextManager):
    """A tensor in memory behind the mapped file's interface."""

    def __init__(self, t):
        self.t, self.address = t, t.data_ptr()

    def tensor(self, dtype, shape):
        return self.t.view(dtype).view(shape)

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_large_tensors_are_rotated_checked_and_summed_in_pieces(name, saved, tmp_path, monkeypatch):
    """With every tensor counted large, the rotated weights (rows of one, columns of another,
    centered or scaled first) and the fused products of the weights are computed a piece of a
    few vectors at a time: the same bytes as whole, the static check passes from the pieces, and
    one flipped bit in a piece-checked weight fails it, whether its pieces are runs of rows
    (compared where both files lie) or blocks of columns (gathered first)."""
    from enjoyln.checking.static import static_check
    from enjoyln.folded import pieces as pieces_module

    src = saved(name)
    options = FoldOptions.of(check="none", fuse_affine=True, rotate=("hadamard", 0, True))
    whole = fold_checkpoint(src, tmp_path / "whole", options).out_dir
    monkeypatch.setattr(stream, "WHOLE_BYTES", 0)
    monkeypatch.setattr(pieces_module, "PIECE_BYTES", 700)
    made, summed, checked = [], [], []
    real, real_sum = StreamedTensors.pieces, StreamedTensors._product_in_pieces
    real_check = StreamedTensors._equal_in_pieces
    monkeypatch.setattr(
        StreamedTensors,
        "_product_in_pieces",
        lambda self, *a: summed.append(a[0]) or real_sum(self, *a),
    )
    monkeypatch.setattr(
        StreamedTensors, "pieces", lambda self, key, into: made.append(key) or real(self, key, into)
    )

    def check(self, one, *args):
        checked.append(real_check(self, one, *args))
        return checked[-1]

    monkeypatch.setattr(StreamedTensors, "_equal_in_pieces", check)
    in_pieces = fold_checkpoint(src, tmp_path / "pieces", options).out_dir
    assert _files(whole) == _files(in_pieces)
    written = len(made)
    assert written >= 4 and len(summed) >= 2, (made, summed)
    ref = open_checkpoint(src)
    assert static_check(ref, open_checkpoint(in_pieces)).passed
    # the check compared the same ones a piece at a time, and found each right there (the
    # reading path, which would pass a tensor the pieces wrongly fail, was not needed)
    assert checked == [True] * written
    sd = load_file(in_pieces / "model.safetensors")
    streamed = StreamedTensors(ref, analyze_dir(ref, False, True, ("hadamard", 0, True)))
    layouts = {}  # a weight whose pieces are runs of rows, and one whose are blocks of columns
    for key in made:
        if key.endswith("weight"):
            rows = streamed.in_pieces(key).axis % sd[key].dim() == sd[key].dim() - 1
            layouts.setdefault(rows, key)
    streamed.close()
    assert set(layouts) == {True, False}, made
    for key, at in [(k, at) for k in layouts.values() for at in (3, -1)]:  # first, last piece
        flipped = {k: v.clone() for k, v in sd.items()}
        flipped[key].view(-1).view(torch.int32)[at] ^= 1
        save_file(flipped, in_pieces / "model.safetensors", metadata={"format": "pt"})
        checked.clear()
        report = static_check(ref, open_checkpoint(in_pieces))
        assert not report.passed and key in report.first_differing, (key, report.problems)
        assert checked.count(False) == 1, (key, at)


def test_a_rotated_weight_is_computed_into_the_output_files_pages(saved, tmp_path, monkeypatch):
    """Where the output file can be mapped, a rotated weight is computed straight into its pages;
    where it cannot (no writable mapping: an old kernel, a file system without it), the same
    bytes are written from memory."""
    src = saved("gpt2")
    options = FoldOptions.of(check="none", fuse_affine=True, rotate=("hadamard", 0, True))
    into, real = [], writer._into_file
    monkeypatch.setattr(writer, "_into_file", lambda *a: into.append(a[2].name) or real(*a))
    mapped = fold_checkpoint(src, tmp_path / "mapped", options).out_dir
    assert "transformer.h.0.attn.c_attn.weight" in into and len(into) >= 8

    def refused(*args, writable=False):
        if writable:
            raise OSError(22, "Invalid argument")
        return real_mapped(*args)

    real_mapped = writer.Mapped
    monkeypatch.setattr(writer, "Mapped", refused)
    written = fold_checkpoint(src, tmp_path / "written", options).out_dir
    assert _files(mapped) == _files(written)
