"""Checkpoint round trips: directory -> fold -> directory, for every architecture."""

import json
import math
import re
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

import enjoyln
from enjoyln.analysis.inputs import hf_example_inputs, is_causal_lm
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.errors import CheckFailed
from enjoyln.store.load import load
from enjoyln.units import parse_size
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.testing import ARCHITECTURES, demo_checkpoint, perturb, tiny_model
from enjoyln.transform.tensors import center_
from conftest import assert_same_outputs
from enjoyln.options import CheckOptions, FoldOptions


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")

    def make(arch, dtype=torch.float32, **save_kwargs):
        path = root / f"{arch}-{str(dtype)[6:]}-{len(save_kwargs)}"
        if not path.exists():
            model = perturb(tiny_model(arch), seed=21).to(dtype)
            model.save_pretrained(path, **save_kwargs)
            (path / "tokenizer.json").write_text('{"fake": "tokenizer"}')
            (path / "preprocessor_config.json").write_text("{}")
        return path

    return make


def reload_plain(path):
    config = json.loads((path / "config.json").read_text())
    return getattr(transformers, config["architectures"][0]).from_pretrained(path).eval()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_round_trip(arch, saved, tmp_path):
    src = saved(arch)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    result = fold_checkpoint(src, tmp_path / "out", FoldOptions.of(check="static"))
    out = result.out_dir
    assert result.report.passed and result.report.static.centered == len(result.plan.centered)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # input untouched
    assert (out / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    assert (out / "preprocessor_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    block = config["enjoyln"]
    assert block["format_version"] == 1 and block["version"] == enjoyln.__version__
    assert block["rmsnorm"] == [e.name for e in result.plan.foldable]
    assert len(block["centered"]) == len(result.plan.centered)
    if result.plan.untied:
        assert config["tie_word_embeddings"] is False
        with safe_open(out / "model.safetensors", "pt") as f:
            assert all(u.param in f.keys() for u in result.plan.untied)
    original = reload_plain(src)
    plain, folded = reload_plain(out), load(out)
    assert sum(isinstance(m, enjoyln.RMSNorm) for m in plain.modules()) == 0
    assert sum(isinstance(m, enjoyln.RMSNorm) for m in folded.modules()) == len(
        result.plan.foldable
    )
    inputs = hf_example_inputs(original, seed=22)
    assert_same_outputs(original, plain, inputs)
    assert_same_outputs(original, folded, inputs)
    if is_causal_lm(original):
        report = enjoyln.check(original, folded)
        assert report.passed and report.generation.passed


def test_dtypes_are_kept_per_tensor(saved, tmp_path):
    src = saved("opt", torch.bfloat16)
    out = fold_checkpoint(src, tmp_path / "out").out_dir
    with (
        safe_open(src / "model.safetensors", "pt") as a,
        safe_open(out / "model.safetensors", "pt") as b,
    ):
        for key in a.keys():
            assert a.get_slice(key).get_dtype() == b.get_slice(key).get_dtype() == "BF16"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_check_passes(dtype, saved, tmp_path):
    src = saved("gpt2", dtype)
    report = fold_checkpoint(src, tmp_path / "out").report
    assert report.passed, report.summary()
    assert report.dtype == str(dtype)[6:]
    assert all(o.candidate_error is not None for o in report.outputs)


def test_sharded_input_keeps_its_shards_and_index(saved, tmp_path):
    src = saved("gpt2", torch.float32, max_shard_size="120KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    result = fold_checkpoint(src, tmp_path / "out")
    out = result.out_dir
    new_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(new_index["weight_map"].values())) == shards
    assert set(new_index["weight_map"]) == set(index["weight_map"]) | {"lm_head.weight"}
    total = parameters = 0
    for key, shard in new_index["weight_map"].items():
        with safe_open(out / shard, "pt") as f:
            assert key in f.keys()
            parameters += f.get_tensor(key).numel()
            total += f.get_tensor(key).numel() * 4
    # the input's metadata kept, its sizes the output's (the untied head adds parameters)
    assert new_index["metadata"] == {
        **index["metadata"],
        "total_size": total,
        "total_parameters": parameters,
        "enjoyln": enjoyln.__version__,
        "dtype": "float32",
    }
    assert parameters > index["metadata"]["total_parameters"]
    assert result.report.passed and result.report.static.tensors == len(new_index["weight_map"])


def test_reshard_by_max_shard_size(saved, tmp_path):
    src = saved("gpt2")
    result = fold_checkpoint(
        src, tmp_path / "out", FoldOptions.of(max_shard_size=parse_size("100KB"))
    )
    out = result.out_dir
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 4 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(p.stat().st_size < 100_000 + 70_000 for p in out.glob("*.safetensors"))
    assert result.report.passed


def test_head_saved_instead_of_embedding(saved, tmp_path):
    """A checkpoint that stored only the tied head still yields both tensors."""
    from safetensors.torch import load_file, save_file

    src = saved("gpt2")
    alt = tmp_path / "alt"
    alt.mkdir()
    for p in src.iterdir():
        (alt / p.name).write_bytes(p.read_bytes())
    sd = load_file(src / "model.safetensors")
    sd["lm_head.weight"] = sd.pop("transformer.wte.weight")
    save_file(sd, alt / "model.safetensors", metadata={"format": "pt"})
    result = fold_checkpoint(alt, tmp_path / "out", FoldOptions.of(check="static"))
    out = result.out_dir
    assert result.report.passed
    with safe_open(out / "model.safetensors", "pt") as f:
        wte, head = f.get_tensor("transformer.wte.weight"), f.get_tensor("lm_head.weight")
    assert torch.equal(head, sd["lm_head.weight"])
    assert wte.double().mean(1).abs().max() < 1e-6
    assert enjoyln.check_checkpoints(src, out).passed


def test_dry_run_writes_nothing(saved, tmp_path):
    result = fold_checkpoint(saved("bert"), tmp_path / "out", FoldOptions.of(dry_run=True))
    assert result.out_dir is None and len(result.plan.foldable) == 1
    assert not (tmp_path / "out").exists()


def test_pickle_weights_with_explicit_permission(saved, tmp_path):
    src = saved("gpt2")
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    (pkl / "config.json").write_text((src / "config.json").read_text())
    sd = reload_plain(src).state_dict()
    torch.save({k: v for k, v in sd.items() if k != "lm_head.weight"}, pkl / "pytorch_model.bin")
    with pytest.raises(enjoyln.CheckpointError, match="--allow-pickle"):
        open_checkpoint(pkl)
    result = fold_checkpoint(pkl, tmp_path / "out", FoldOptions.of(allow_pickle=True))
    out = result.out_dir
    assert (out / "model.safetensors").exists() and not (out / "pytorch_model.bin").exists()
    assert result.report.passed and result.report.static.tensors > 0


def test_progress_reports_bytes(saved, tmp_path):
    seen = []
    fold_checkpoint(
        saved("gpt2"),
        tmp_path / "out",
        FoldOptions.of(check="none"),
        progress=lambda d, t: seen.append((d, t)),
    )
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_demo_checkpoint_has_a_working_tokenizer(tmp_path):
    path = demo_checkpoint(tmp_path / "demo", layers=1, width=64, vocab=64)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok("w1 w2")["input_ids"] == [3, 4]
    out = fold_checkpoint(path, tmp_path / "out").out_dir
    assert transformers.AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"] == [3, 4]


def test_model_without_layer_norm_writes_nothing(tmp_path):
    src = tmp_path / "llama"
    tiny_model("llama").save_pretrained(src)
    result = fold_checkpoint(src, tmp_path / "out")
    assert result.plan.layer_norms == [] and result.out_dir is None
    assert not (tmp_path / "out").exists()


def _copy_with_index(src, bad):
    """A copy of the sharded directory ``src``, and its weight index to edit."""
    bad.mkdir()
    for p in src.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    return bad, json.loads((bad / "model.safetensors.index.json").read_text())


def test_index_naming_a_file_outside_the_directory_is_refused(saved, tmp_path):
    src = saved("gpt2", torch.float32, max_shard_size="120KB")
    bad, index = _copy_with_index(src, tmp_path / "bad")
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(enjoyln.CheckpointError, match="not a file in its directory"):
        fold_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_shard_not_named_as_its_weights_is_refused(saved, tmp_path):
    """transformers opens a shard whose name does not end in .safetensors with torch.load: a
    safetensors index naming chat_template.jinja was read here as safetensors, its file exempted
    from the comparison of the other files, and `check --static` passed a candidate that does not
    load and whose tokenizer reads the shard's bytes as its chat template."""
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    src = saved("gpt2", torch.float32, max_shard_size="120KB")
    bad, index = _copy_with_index(src, tmp_path / "bad")
    shard = sorted(set(index["weight_map"].values()))[-1]
    (bad / shard).rename(bad / "chat_template.jinja")
    index["weight_map"] = {
        k: "chat_template.jinja" if v == shard else v for k, v in index["weight_map"].items()
    }
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        enjoyln.CheckpointError,
        match="'chat_template.jinja', whose name does not end in .safetensors",
    ):
        fold_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, ["check", str(src), str(bad), "--static"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "chat_template.jinja" in result.stderr
    # a pickle index's shards are named as pickle weights, never as a tokenizer file or safetensors
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    (pkl / "config.json").write_text((src / "config.json").read_text())
    sd = reload_plain(src).state_dict()
    for name in ("tokenizer.json", "model-00001-of-00001.safetensors"):
        torch.save(sd, pkl / name)
        (pkl / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: name for k in sd}})
        )
        with pytest.raises(enjoyln.CheckpointError, match="not named as pickle weights"):
            open_checkpoint(pkl, allow_pickle=True)
        (pkl / name).unlink()
    torch.save(sd, pkl / "pytorch_model-00001-of-00001.bin")
    (pkl / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {k: "pytorch_model-00001-of-00001.bin" for k in sd}}
        )
    )
    assert open_checkpoint(pkl, allow_pickle=True).shards == ["pytorch_model-00001-of-00001.bin"]


def test_header_with_wrong_byte_counts_is_refused(saved, tmp_path):
    import struct

    src = saved("gpt2")
    data = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [1] + header[name]["shape"]  # one more axis, same bytes: fine
    header[name]["shape"][-1] += 1  # now the bytes do not match
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])
    with pytest.raises(enjoyln.CheckpointError, match="not what its dtype and shape need"):
        fold_checkpoint(bad, tmp_path / "out")


def test_malformed_enjoyln_block_is_a_clear_error(saved, tmp_path):
    out = fold_checkpoint(saved("gpt2"), tmp_path / "out", FoldOptions.of(check="none")).out_dir
    config = json.loads((out / "config.json").read_text())
    config["enjoyln"]["plan"] = {"layer_norms": "oops"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(enjoyln.CheckpointError, match="enjoyln block .* is malformed"):
        load(out)


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as g:
            out.update({k: g.get_tensor(k) for k in g.keys()})
    return out


@pytest.mark.parametrize("shard_size", [None, "120KB"])
def test_early_copy_gives_the_same_tensors_as_a_fresh_write(
    shard_size, saved, tmp_path, monkeypatch
):
    """The fast path (copy during analysis, then center in place) and the plain
    writer produce the same bytes for every tensor, and the same files."""
    from enjoyln.rewrite import convert
    from enjoyln.rewrite import writer

    src = saved("gpt2", torch.float32, **({"max_shard_size": shard_size} if shard_size else {}))
    assert writer.early_spans(open_checkpoint(src), None)  # the fast path applies here
    fast = fold_checkpoint(src, tmp_path / "fast", FoldOptions.of(check="static"))
    monkeypatch.setattr(convert, "early_spans", lambda ck, size: {})
    slow = fold_checkpoint(src, tmp_path / "slow", FoldOptions.of(check="none"))
    assert fast.files == slow.files and fast.bytes_written == slow.bytes_written
    a, b = _tensors(tmp_path / "fast"), _tensors(tmp_path / "slow")
    assert a.keys() == b.keys() and "lm_head.weight" in a
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    original = _tensors(src)
    centered = {c.param for c in fast.plan.centered}
    assert any(not torch.equal(a[k], original[k]) for k in centered)  # centering happened in place
    assert torch.equal(
        a["lm_head.weight"], original["transformer.wte.weight"]
    )  # the head keeps the old values
    assert (
        fast.report.passed
        and enjoyln.check_checkpoints(src, tmp_path / "slow", CheckOptions.of(mode="static")).passed
    )


@pytest.mark.parametrize("lone_shard", [False, True])
def test_centering_right_behind_a_copy_still_running(saved, tmp_path, monkeypatch, lone_shard):
    """The copy held back halfway until the centering asks for what lies past it: the
    centering waits for each tensor's bytes (never centers bytes the copy then overwrites),
    and every output tensor is the plain writer's, bit for bit. Also for a lone indexed shard,
    which keeps its name and its index."""
    import threading
    import time

    from enjoyln.rewrite import convert
    from enjoyln.rewrite import writer

    src = saved("gpt2", torch.float32)
    if lone_shard:
        src = shutil.copytree(src, tmp_path / "src")
        shard = "model-00001-of-00001.safetensors"
        (src / "model.safetensors").rename(src / shard)
        with safe_open(src / shard, "pt") as f:
            keys = list(f.keys())
        (src / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: shard for k in keys}})
        )
    asked, blocked = threading.Event(), []
    real_copy, real_wait = writer._copy_range, writer.EarlyCopy.wait

    def held_copy(src_fd, dst, start, count, at, advance, stop=None):
        half = count // 2
        real_copy(src_fd, dst, start, half, at, advance, stop)
        assert asked.wait(60)  # the rest only once the centering waits for it
        for k in range(half, count, 4096):  # in small, slow steps, so the centering follows them
            time.sleep(0.001)
            real_copy(src_fd, dst, start + k, min(4096, count - k), at + k, advance, stop)

    def wait(self, shard, upto=None):
        if upto is not None and self.reached.get(shard, -1) < upto:
            blocked.append(upto)
            asked.set()
        return real_wait(self, shard, upto)

    monkeypatch.setattr(writer, "_copy_range", held_copy)
    monkeypatch.setattr(writer.EarlyCopy, "wait", wait)
    fast = fold_checkpoint(src, tmp_path / "fast", FoldOptions.of(check="none"))
    assert fast.files == [shard if lone_shard else "model.safetensors"]
    assert (tmp_path / "fast" / "model.safetensors.index.json").exists() == lone_shard
    assert len(blocked) > 1  # centering waited on the copy, more than once
    monkeypatch.setattr(convert, "early_spans", lambda ck, size: {})
    fold_checkpoint(src, tmp_path / "slow", FoldOptions.of(check="none"))
    a, b = _tensors(tmp_path / "fast"), _tensors(tmp_path / "slow")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert enjoyln.check_checkpoints(src, tmp_path / "fast", CheckOptions.of(mode="static")).passed


def test_header_without_room_falls_back_to_a_fresh_write(saved, tmp_path, monkeypatch):
    from enjoyln.rewrite import convert
    from enjoyln.rewrite import writer

    src = saved("gpt2")
    monkeypatch.setattr(writer, "_HEADER_ROOM", 8)  # the untied head's entry cannot fit
    calls = []
    real = writer.write_shard
    monkeypatch.setattr(
        convert, "write_shard", lambda *a, **k: calls.append(a[0].name) or real(*a, **k)
    )
    result = fold_checkpoint(src, tmp_path / "out", FoldOptions.of(check="static"))
    assert calls == ["model.safetensors"]
    assert result.report.passed


def _bert_mlm(seed=31):
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return perturb(transformers.BertForMaskedLM(config).eval(), seed=seed)


@pytest.mark.parametrize("fuse_affine", [False, True])
def test_masked_lm_keeps_its_tied_decoder_bias(fuse_affine, tmp_path):
    """Untying BERT's MLM head turns tie_word_embeddings off, and transformers 5 then drops
    every declared tie, the decoder bias's too: it must be stored, or it loads at random."""
    src, out = tmp_path / "bert-mlm", tmp_path / "out"
    original = _bert_mlm()
    original.save_pretrained(src)
    result = fold_checkpoint(src, out, FoldOptions.of(fuse_affine=fuse_affine))
    assert result.report.passed, result.report.summary()
    assert result.plan.untied and result.report.static.tensors == len(
        dict(transformers.BertForMaskedLM.from_pretrained(out).state_dict())
    )
    with safe_open(out / "model.safetensors", "pt") as f:
        assert torch.equal(
            f.get_tensor("cls.predictions.decoder.bias"), f.get_tensor("cls.predictions.bias")
        )
    inputs = hf_example_inputs(original, seed=3)
    assert_same_outputs(original, reload_plain(out), inputs)
    assert_same_outputs(original, load(out), inputs)


def test_in_memory_fold_of_a_masked_lm_saves_and_reloads(tmp_path):
    import copy

    original = _bert_mlm()
    folded = enjoyln.fold(copy.deepcopy(original))
    assert folded.cls.predictions.decoder.bias is not folded.cls.predictions.bias
    folded.save_pretrained(tmp_path / "saved")
    inputs = hf_example_inputs(original, seed=4)
    assert_same_outputs(original, reload_plain(tmp_path / "saved"), inputs)


def _shared_seq2seq(cls_name, seed=41):
    """A tiny encoder-decoder whose encoder and decoder embeddings (and head) are one ``shared``
    table, which transformers 5 saves once, as ``[model.]shared.weight``."""
    cls = getattr(transformers, cls_name)
    sizes = dict(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=128,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return perturb(cls(cls.config_class(**sizes)).eval(), seed=seed)


def _centered_once(t, axis):
    """The float64 centering rounded once to ``t``'s dtype, computed here, not by enjoyln."""
    wide = t.double()
    return (wide - wide.mean(axis, keepdim=True)).to(t.dtype)


@pytest.mark.parametrize(
    "cls_name", ["BartForConditionalGeneration", "BartModel", "M2M100ForConditionalGeneration"]
)
def test_shared_embeddings_fold_through_the_file_and_in_memory(cls_name, tmp_path):
    """The plan centers encoder.embed_tokens and decoder.embed_tokens, one tensor stored under a
    third name: `enjoyln fold` must find it, and both folds must center it once (not once per
    name), so that the file fold and the in-memory fold give the same bytes and pass the gate."""
    import copy

    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    runner = CliRunner()
    src, out, mem = tmp_path / "ref", tmp_path / "out", tmp_path / "mem"
    original = _shared_seq2seq(cls_name)
    original.save_pretrained(src)
    prefix = "" if cls_name.endswith("Model") else "model."
    stored = _tensors(src)
    assert (
        f"{prefix}shared.weight" in stored and f"{prefix}encoder.embed_tokens.weight" not in stored
    )

    folded = runner.invoke(app, ["fold", str(src), str(out)])
    assert folded.exit_code == 0, folded.output
    enjoyln.fold(copy.deepcopy(original)).save_pretrained(mem)
    for cand in (out, mem):
        checked = runner.invoke(app, ["check", str(src), str(cand)])
        assert checked.exit_code == 0, checked.output

    a, b = _tensors(out), _tensors(mem)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(
            a[key].view(-1).view(torch.uint8), b[key].view(-1).view(torch.uint8)
        ), key
    table = stored[f"{prefix}shared.weight"]
    untied = "lm_head.weight" in a
    # untied, the config ties nothing, so the encoder's and decoder's copies are stored too
    names = ["shared", "encoder.embed_tokens", "decoder.embed_tokens"] if untied else ["shared"]
    assert {k for k in a if "shared" in k or "embed_tokens" in k} == {
        f"{prefix}{n}.weight" for n in names
    }
    for name in names:
        assert torch.equal(a[f"{prefix}{name}.weight"], _centered_once(table, 1)), name
    if untied:  # the logits still read the original table
        assert torch.equal(a["lm_head.weight"], table)
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    inputs = hf_example_inputs(original, seed=42)
    for cand in (reload_plain(out), load(out), reload_plain(mem)):
        assert_same_outputs(original, cand, inputs)


def test_a_fold_checks_in_another_process(tmp_path):
    """CI folds in one process and checks in another: the recorded plan (which of BART's tied
    embedding names the untied head was tied to) must not depend on the hash seed."""
    import os
    import subprocess
    import sys

    src, out = tmp_path / "ref", tmp_path / "out"
    _shared_seq2seq("BartForConditionalGeneration").save_pretrained(src)
    fold_checkpoint(src, out, FoldOptions.of(check="none"))
    for seed in ("2", "3"):  # under hash order, these two name different tied embeddings
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run(
            [sys.executable, "-m", "enjoyln", "check", str(src), str(out), "--static"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_tied_table_partly_untied_keeps_the_untied_name_as_it_was(tmp_path):
    """Where only the encoder's embedding LN folds, the decoder's name of BART's shared table
    must keep the original values: the plan unties it as it unties a head, the fold stores it
    apart, and config.json records the untie; the file and in-memory folds agree."""
    import copy
    import dataclasses

    from enjoyln.plan import Untie
    from enjoyln.transform.steps import apply_plan

    src, out, mem = tmp_path / "ref", tmp_path / "out", tmp_path / "mem"
    original = _shared_seq2seq("BartForConditionalGeneration", seed=43)
    original.save_pretrained(src)
    full = enjoyln.analyze(original)
    kept = "model.decoder.layernorm_embedding"
    assert kept in {e.name for e in full.foldable}
    nbytes = full.untied[0].nbytes
    plan = dataclasses.replace(
        full,
        layer_norms=[
            dataclasses.replace(e, foldable=False, reason="kept", centered=[])
            if e.name == kept
            else e
            for e in full.layer_norms
        ],
        untied=[
            Untie(name, "model.encoder.embed_tokens.weight", nbytes)
            for name in ("lm_head.weight", "model.decoder.embed_tokens.weight")
        ],
    )
    # the gate holds a fold to this enjoyln's own analysis of the reference, never to the plan the
    # fold was handed: this narrower plan is sound, but not what the analysis gives
    with pytest.raises(CheckFailed) as failed:
        fold_checkpoint(src, out, FoldOptions.of(plan=plan))
    assert any(
        "the recorded plan is not what this enjoyln's analysis gives" in p
        for p in failed.value.report.static.problems
    )
    result = fold_checkpoint(src, out, FoldOptions.of(plan=plan, check="none"))
    assert result.report is None and (out / "config.json").exists()
    apply_plan(copy.deepcopy(original), plan).save_pretrained(mem)
    assert enjoyln.check_checkpoints(src, mem, CheckOptions.of(mode="forward")).passed

    a, b = _tensors(out), _tensors(mem)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].view(-1).view(torch.uint8), b[key].view(-1).view(torch.uint8)), (
            key
        )
    table = _tensors(src)["model.shared.weight"]
    for name in ("model.shared.weight", "model.encoder.embed_tokens.weight"):
        assert torch.equal(a[name], _centered_once(table, 1)), name
    for name in ("model.decoder.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(a[name], table), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "model.decoder.embed_tokens.weight" in config["enjoyln"]["untied"]
    inputs = hf_example_inputs(original, seed=44)
    for cand in (reload_plain(out), load(out), reload_plain(mem)):
        assert_same_outputs(original, cand, inputs)


# --- parameters a model class builds but no checkpoint holds ----------------------------


def _bert_without_pooler(path):
    from safetensors.torch import load_file, save_file

    perturb(tiny_model("bert"), seed=5).save_pretrained(path)
    weights = {k: v for k, v in load_file(path / "model.safetensors").items() if "pooler" not in k}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_parameters_no_checkpoint_holds_are_named_and_seeded_alike(tmp_path):
    """A BertModel saved without its pooler: every load draws the pooler at random, so the
    original differs from itself. The analysis names the two parameters before anything runs,
    and the check gives them the same seeded values in every model it loads."""
    src = _bert_without_pooler(tmp_path / "src")
    first, second = (
        transformers.BertModel.from_pretrained(src).pooler.dense.weight for _ in range(2)
    )
    assert not torch.equal(first, second)  # random on every load
    plan = enjoyln.analyze_checkpoint(src)
    note = plan.note("missing parameters")
    assert (
        note
        and "2 parameters that BertModel builds (pooler.dense.weight, pooler.dense.bias)" in note
    )
    result = fold_checkpoint(src, tmp_path / "out", FoldOptions.of(allow_missing=True))
    assert result.report.passed, result.report.summary()
    assert result.report.static.missing == ["pooler.dense.weight", "pooler.dense.bias"]
    assert any("got the same seeded values" in n for n in result.report.notes)
    assert "pooler_output" in {o.name for o in result.report.outputs}
    report = enjoyln.check_checkpoints(src, tmp_path / "out", CheckOptions.of(mode="forward"))
    assert report.passed and any("got the same seeded values" in n for n in report.notes), (
        report.summary()
    )


def test_model_class_folds_weights_as_the_class_they_match(tmp_path):
    """MPNetForMaskedLM named in config.json over weights of the base model only (as a
    sentence-transformers checkpoint ships): folded as MPNetModel, nothing is missing, and the
    output's config names the class it was folded as."""
    config = transformers.MPNetConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=66,
    )
    torch.manual_seed(0)
    perturb(transformers.MPNetModel(config).eval(), seed=6).save_pretrained(tmp_path / "src")
    data = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(
        json.dumps({**data, "architectures": ["MPNetForMaskedLM"]})
    )
    assert enjoyln.analyze_checkpoint(tmp_path / "src").note("missing parameters")
    result = fold_checkpoint(
        tmp_path / "src", tmp_path / "out", FoldOptions.of(model_class="MPNetModel")
    )
    assert result.report.passed and not result.plan.note("missing parameters"), (
        result.report.summary()
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
        "MPNetModel"
    ]
    assert enjoyln.check_checkpoints(
        tmp_path / "src", tmp_path / "out", CheckOptions.of(model_class="MPNetModel")
    ).passed
    with pytest.raises(enjoyln.CheckpointError, match="checked with the same --model-class"):
        enjoyln.check_checkpoints(tmp_path / "src", tmp_path / "out")
    with pytest.raises(enjoyln.CheckpointError, match="is not a transformers model class"):
        enjoyln.analyze_checkpoint(tmp_path / "src", model_class="NoSuchModel")


def test_a_class_its_weights_do_not_match_is_refused_before_anything_is_written(tmp_path):
    """MPNetForMaskedLM over MPNetModel's weights, as a sentence-transformers MPNet ships: fold and
    rotate stop at once, even with -q, naming the class the weights match and the flag that
    chooses it; --allow-missing folds it as before, and the fold and its check count the same
    parameters (the fold's untied head also unties its bias from lm_head.bias, one tensor in the
    original, which the check once counted twice)."""
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    config = transformers.MPNetConfig(
        num_hidden_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=34,
    )
    torch.manual_seed(0)
    perturb(transformers.MPNetModel(config).eval(), seed=7).save_pretrained(tmp_path / "src")
    data = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(
        json.dumps({**data, "architectures": ["MPNetForMaskedLM"]})
    )
    runner = CliRunner()
    for command in ("fold", "rotate"):
        result = runner.invoke(
            app, [command, str(tmp_path / "src"), str(tmp_path / "out" / "x"), "-q"]
        )
        assert result.exit_code == 2 and result.stdout == "", result.output
        assert result.stderr.strip() == (
            f"error: {tmp_path / 'src'} lacks 5 parameters that MPNetForMaskedLM builds "
            "(lm_head.bias, "
            "lm_head.dense.weight, lm_head.dense.bias and 2 more), which transformers would "
            "initialise at random "
            "on every load; its weights match MPNetModel: pass --model-class MPNetModel to fold "
            "that class, or "
            "--allow-missing to fold MPNetForMaskedLM with them random; nothing was written"
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    result = runner.invoke(
        app, ["fold", str(tmp_path / "src"), str(tmp_path / "out"), "--allow-missing"]
    )
    assert result.exit_code == 0, result.output
    counts = re.findall(
        r"(\d+) parameters (?:that MPNetForMaskedLM builds|of the model class)", result.output
    )
    assert counts == ["5", "5", "5"], (
        result.output
    )  # the plan's note, the static part's and the forward part's
    report = enjoyln.check_checkpoints(
        tmp_path / "src", tmp_path / "out", CheckOptions.of(mode="forward")
    )
    assert report.passed and any(n.startswith("5 parameters") for n in report.notes), (
        report.summary()
    )


@pytest.mark.parametrize("fuse_affine", [False, True])
def test_a_head_the_checkpoint_lacks_stays_missing_when_its_tie_is_undone(fuse_affine, tmp_path):
    """A BertModel folded as BertForMaskedLM: the head's decoder is tied to the embedding, which
    the fold centers, so it is untied; its decoder bias (tied to cls.predictions.bias) is in no
    file, so the output leaves it missing too, and the check seeds it alike on both sides."""
    perturb(tiny_model("bert"), seed=9).save_pretrained(tmp_path / "src")
    result = fold_checkpoint(
        tmp_path / "src",
        tmp_path / "out",
        FoldOptions.of(model_class="BertForMaskedLM", fuse_affine=fuse_affine, allow_missing=True),
    )
    assert result.report.passed, result.report.summary()
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "cls.predictions.decoder.weight" in keys  # the untied head, written
    assert not {"cls.predictions.bias", "cls.predictions.decoder.bias"} & keys


def test_a_fold_in_another_dtype_passes_check_dtype_and_only_it(saved, tmp_path):
    """``fold --dtype bfloat16``: every floating tensor stored in bfloat16, the config saying so;
    each tensor one of the two roundings the check's rule for a cast copy accepts."""
    from typer.testing import CliRunner

    from enjoyln.cli.app import app

    src, out = saved("gpt2"), tmp_path / "bf16"
    result = fold_checkpoint(src, out, FoldOptions.of(dtype="bfloat16", check="static"))
    assert (
        result.report.passed
        and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    )
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        wte = f.get_tensor("transformer.wte.weight")
        assert result.bytes_written == sum(
            math.prod(f.get_slice(k).get_shape()) * 2 for k in f.keys()
        )
    with safe_open(
        src / "model.safetensors", "pt"
    ) as f:  # cast, then centered in float64 and rounded once
        reference = f.get_tensor("transformer.wte.weight").to(torch.bfloat16)
    assert torch.equal(wte, center_(reference.clone(), 1)) and not torch.equal(wte, reference)
    runner = CliRunner()
    assert runner.invoke(app, ["check", "--dtype", "bfloat16", str(src), str(out)]).exit_code == 0
    assert (
        runner.invoke(app, ["check", "--static", str(src), str(out)]).exit_code == 1
    )  # float32 was promised
    fused = fold_checkpoint(
        src, tmp_path / "f16", FoldOptions.of(dtype="float16", fuse_affine=True, check="static")
    )
    assert (
        fused.report.passed and enjoyln.load(tmp_path / "f16").lm_head.weight.dtype == torch.float16
    )
