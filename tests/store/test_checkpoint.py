"""Model directories: strict validation, containment, and what the output looks like on disk."""

import json
import os
import stat
import struct
import time

import pytest
import torch
from typer.testing import CliRunner

from enjoyln import CheckpointError
from enjoyln.rewrite.convert import fold_checkpoint
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.cli.app import app
from enjoyln.testing import perturb, tiny_model
from conftest import copy_dir as clone
from enjoyln.options import FoldOptions

runner = CliRunner()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("md") / "gpt2"
    perturb(tiny_model("gpt2"), seed=43).save_pretrained(path)
    return path


def test_duplicate_header_keys_and_trailing_bytes_are_refused(src, tmp_path):
    data = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    bad = clone(src, tmp_path / "trailing")
    (bad / "model.safetensors").write_bytes(data + b"junk")
    with pytest.raises(CheckpointError, match="4 bytes after the last tensor"):
        open_checkpoint(bad)
    blob = data[8 : 8 + n].decode().rstrip()
    key = json.loads(blob)
    name = next(k for k in key if k != "__metadata__")
    twice = blob[:-1] + f', "{name}": ' + json.dumps(key[name]) + "}"
    twice = twice.encode() + b" " * (-len(twice) % 8)
    dup = clone(src, tmp_path / "dup")
    (dup / "model.safetensors").write_bytes(struct.pack("<Q", len(twice)) + twice + data[8 + n :])
    with pytest.raises(CheckpointError, match=f"names {name} twice"):
        open_checkpoint(dup)


def test_index_that_disagrees_with_its_shards_is_refused(src, tmp_path):
    sharded = tmp_path / "sharded"
    perturb(tiny_model("gpt2"), seed=43).save_pretrained(sharded, max_shard_size="120KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][key] = shards[1]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"puts {key} in {shards[1]}, which does not hold it"):
        open_checkpoint(sharded)


def test_errors_name_the_path_at_fault(src, tmp_path):
    model = clone(src, tmp_path / "model")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    result = runner.invoke(app, ["fold", str(model), str(tmp_path / "out")])
    assert result.exit_code == 2 and "model.safetensors is a dangling symlink" in result.stderr
    assert str(model) in result.stderr and "OUT_DIR" not in result.stderr
    model2 = clone(src, tmp_path / "model2")
    (model2 / "tokenizer.json").symlink_to(model2 / "tokenizer.json")
    result = runner.invoke(app, ["fold", str(model2), str(tmp_path / "out")])
    assert result.exit_code == 2 and "tokenizer.json is a symlink loop" in result.stderr


def test_special_files_and_dangling_extras_are_skipped(src, tmp_path):
    model = clone(src, tmp_path / "model")
    os.mkfifo(model / "pipe")  # reading it would hang
    (model / "old.txt").symlink_to(tmp_path / "nowhere")
    result = fold_checkpoint(model, tmp_path / "out", FoldOptions.of(check="none"))
    assert sorted(result.skipped) == ["old.txt (a dangling symlink)", "pipe (not a regular file)"]
    assert not (tmp_path / "out" / "pipe").exists()


def test_output_modes_follow_the_umask(src, tmp_path):
    model = clone(src, tmp_path / "model")
    (model / "tokenizer.json").write_text("{}")
    os.chmod(model / "tokenizer.json", 0o600)
    old = os.umask(0o002)
    try:
        out = fold_checkpoint(model, tmp_path / "out", FoldOptions.of(check="none")).out_dir
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o775
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o664, name


def test_throughput_counts_the_copy_not_the_analysis(src, tmp_path, monkeypatch):
    from enjoyln.folded import planning

    real = planning.analyze
    monkeypatch.setattr(planning, "analyze", lambda *a, **k: time.sleep(1.0) or real(*a, **k))
    result = fold_checkpoint(src, tmp_path / "out", FoldOptions.of(check="none"))
    assert result.seconds > 1.0 and result.stream_seconds < 0.5


def test_no_blank_line_before_an_error(src, tmp_path):
    import subprocess
    import sys

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "enjoyln", "fold", str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: OUT_DIR"), repr(proc.stderr)


def test_trusted_remote_code_is_analysed_run_and_kept(src, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    model = clone(src, tmp_path / "model")
    (model / "modeling_custom.py").write_text(
        "from transformers import GPT2LMHeadModel\n\n\nclass CustomLM(GPT2LMHeadModel):\n    pass\n"
    )
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["CustomLM"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomLM"}
    (model / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["fold", str(model), str(tmp_path / "out"), "--trust-remote-code"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert (out / "modeling_custom.py").exists() and json.loads((out / "config.json").read_text())[
        "auto_map"
    ]
    from enjoyln import load

    loaded = load(out, trust_remote_code=True)
    assert type(loaded).__name__ == "CustomLM"
    assert sum(type(m).__name__ == "RMSNorm" for m in loaded.modules()) == 5
    with pytest.raises(CheckpointError, match="--trust-remote-code"):
        load(out)


def test_only_enjoyln_temp_dir_names_are_judged_stale(tmp_path):
    """A user's own `.out.enjoyln-backup-2024` is not debris; glob characters in OUT_DIR's name
    neither hide its own debris nor match another OUT_DIR's."""
    from enjoyln.store.transaction import clean_stale, stale_temp_dirs

    mine = tmp_path / ".out.enjoyln-backup-2024"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    killed = tmp_path / ".out.enjoyln-999999999-abcd_123"  # no owner record: killed at once
    killed.mkdir()
    old = tmp_path / ".out.enjoyln-999999999-old"  # an earlier output a publish moved aside
    old.mkdir()
    assert sorted(clean_stale(tmp_path / "out")) == sorted([killed, old])
    assert (mine / "notes.txt").read_text() == "keep"

    own = tmp_path / ".m[1].enjoyln-999999999-abcdefgh"
    own.mkdir()
    other = tmp_path / f".m1.enjoyln-{os.getppid()}-abcdefgh"  # a live run for OUT_DIR m1
    other.mkdir()
    assert stale_temp_dirs(tmp_path / "m[1]") == ([own], [])


def test_a_symlinked_or_dot_out_dir_is_written_where_it_points(src, tmp_path, monkeypatch):
    """Publishing renames OUT_DIR: a link to an earlier output used to be replaced by a directory
    (the output it pointed to left stale, a `.link.enjoyln-PID-old` link left forever), and `.`
    failed with "PosixPath('.') has an empty name"."""
    real, link = tmp_path / "real", tmp_path / "link"
    assert runner.invoke(app, ["fold", str(src), str(real), "--no-check"]).exit_code == 0
    (real / "config.json").write_text(
        (real / "config.json").read_text().replace('"enjoyln": {', '"enjoyln": {"old": 1, ')
    )
    link.symlink_to(real)
    result = runner.invoke(app, ["fold", str(src), str(link), "--no-check", "--force"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and '"old": 1' not in (real / "config.json").read_text()
    assert not list(tmp_path.glob(".*enjoyln-*"))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    result = runner.invoke(app, ["fold", str(src), ".", "--no-check"])
    assert result.exit_code == 0, result.output
    assert (here / "model.safetensors").exists() and not list(tmp_path.glob(".*enjoyln-*"))


def test_directory_links_that_loop_or_fan_out_are_copied_once(src, tmp_path):
    """a/tob -> ../b and b/toa -> ../a used to recurse until 'Too many levels of symbolic links'
    failed the fold; twenty levels of two links each would have copied a file a million times."""
    from enjoyln.store.files import copy_extras

    model = clone(src, tmp_path / "model")
    (model / "a").mkdir()
    (model / "b").mkdir()
    (model / "a" / "tob").symlink_to("../b")
    (model / "b" / "toa").symlink_to("../a")
    for i in range(20):
        (model / f"d{i}").mkdir()
        for link in ("x", "y"):
            (model / f"d{i}" / link).symlink_to(f"../d{i + 1}")
    (model / "d20").mkdir()
    (model / "d20" / "leaf.txt").write_text("leaf")
    out = tmp_path / "out"
    out.mkdir()
    skipped = copy_extras(open_checkpoint(model), out)
    assert "a/tob/toa (a symlink to a directory that contains it)" in skipped
    assert (
        len(list(out.rglob("leaf.txt"))) <= 21 and (out / "d20" / "leaf.txt").read_text() == "leaf"
    )


def test_a_link_to_version_control_data_copies_none_of_it(src, tmp_path):
    """`stuff -> .git`: the .git walk that looks for custom code skips it, but the copy followed
    the link, so the fold failed its own check with "<hidden temp dir> carries custom code
    (stuff/hooks/evil.py)", and with --no-check published the repository and its hooks."""
    model = clone(src, tmp_path / "model")
    (model / ".git" / "hooks").mkdir(parents=True)
    (model / ".git" / "hooks" / "evil.py").write_text("print('ran')\n")
    (model / "stuff").symlink_to(".git")
    (model / "notes").mkdir()
    (model / "notes" / "hooks").symlink_to("../.git/hooks")  # a link to a directory of code
    out = tmp_path / "out"
    result = runner.invoke(app, ["fold", str(model), str(out), "--no-check"])
    assert result.exit_code == 0, result.output
    assert not list(out.rglob("*.py")) and not (out / "stuff").exists()
    assert "stuff (version-control data)" in result.output
    assert "notes/hooks/evil.py (code, reached through a link)" in result.output


# --- bounded reads ---------------------------------------------------------------------------


def test_a_huge_json_file_is_never_read_whole(src, tmp_path):
    """A 64 MiB junk.json was read whole (twice over, as bytes and text) by the custom-code scan;
    now it is compared streaming, and a file only the candidate has fails unread."""
    import tracemalloc

    from enjoyln.checking.static import static_check

    ref = clone(src, tmp_path / "ref")
    fold_checkpoint(ref, tmp_path / "folded", FoldOptions.of(check="none"))
    cand = tmp_path / "folded"

    def traced_peak():
        tracemalloc.start()
        try:
            report = static_check(open_checkpoint(ref), open_checkpoint(cand))
            return report, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    _, baseline = traced_peak()  # the analysis itself allocates a few MiB of Python objects
    for d in (ref, cand):
        with open(d / "junk.json", "wb") as f:
            f.truncate(64 << 20)  # sparse: no disk, all zeros
    report, peak = traced_peak()
    assert report.passed, report.summary()
    assert peak < baseline + (8 << 20), (
        f"{(peak - baseline) / 2**20:.0f} MiB more than without the file"
    )
    (ref / "junk.json").unlink()
    report = static_check(open_checkpoint(ref), open_checkpoint(cand))
    assert (
        "the candidate has junk.json, a file a fold of the reference would not hold"
        in report.problems
    )


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_an_oversized_config_is_refused_in_one_line(src, tmp_path, name):
    model = clone(src, tmp_path / "model")
    text = (model / "config.json").read_text() if name == "config.json" else "{}"
    (model / name).write_text(text + " " * (17 << 20))
    result = runner.invoke(app, ["check", str(model), str(model), "--static"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: {model / name} holds {(model / name).stat().st_size:,} bytes, "
        "more than the 16 MiB enjoyln reads for a model config"
        if name == "config.json"
        else f"error: {model / name} holds {(model / name).stat().st_size:,} bytes, "
        "more than the 16 MiB enjoyln reads for a config file"
    )


def test_deeply_nested_json_names_the_file(src, tmp_path):
    model = clone(src, tmp_path / "deep")
    (model / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = runner.invoke(app, ["inspect", str(model)])
    assert result.exit_code == 2
    assert (
        result.stderr.strip()
        == f"error: {model / 'config.json'} is nested too deeply to be a model config"
    )
    config = json.loads((src / "config.json").read_text())
    config["extra"] = json.loads(
        "[" * 80 + "]" * 80
    )  # parses, but transformers' own code recurses on it
    (model / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["inspect", str(model)])
    assert result.exit_code == 2 and "nested more than 64 levels deep" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    shard = clone(src, tmp_path / "shard")
    header = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (shard / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(
        CheckpointError, match=r"model.safetensors is not a valid safetensors file \(its header"
    ):
        open_checkpoint(shard)
    tokenizer = clone(src, tmp_path / "tok")  # a file nothing parses as a config: compared as bytes
    (tokenizer / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    open_checkpoint(tokenizer)


def test_a_link_out_to_a_file_a_loader_reads_is_refused_and_compared(src, tmp_path):
    """additional_chat_templates -> a folder shared by several model directories: a fold copied
    nothing of it (one "Not copied" line, exit 0), and the gate, whose expected files were the
    same walk, passed the fold; its tokenizer then had no "tool_use" template, and
    apply_chat_template(chat_template="tool_use") returned the literal name."""
    from enjoyln.checking.static import static_check

    shared = tmp_path / "shared-templates"
    shared.mkdir()
    (shared / "tool_use.jinja").write_text(
        "{% for m in messages %}[TOOLS]{{ m['content'] }}{% endfor %}"
    )
    ref = clone(src, tmp_path / "ref")
    (ref / "additional_chat_templates").symlink_to(shared)
    out = tmp_path / "out"
    for command in (
        ["fold", str(ref), str(out)],
        ["fold", str(ref), str(out), "--no-check", "--dry-run"],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert (
            f"additional_chat_templates links to {shared}" in result.stderr
            and "copy" in result.stderr
        )
    assert not out.exists() and not list(tmp_path.glob(".out.enjoyln-*"))
    # the gate compares what a loader reads from the reference, through its links
    plain = clone(src, tmp_path / "plain")
    fold_checkpoint(plain, tmp_path / "fold", FoldOptions.of(check="none"))
    report = static_check(open_checkpoint(ref), open_checkpoint(tmp_path / "fold"))
    assert report.problems == [
        "the candidate lacks the reference's additional_chat_templates/tool_use.jinja"
    ]
    (ref / "additional_chat_templates").unlink()  # what the message says: a copy in its place
    (ref / "additional_chat_templates").mkdir()
    (ref / "additional_chat_templates" / "tool_use.jinja").write_bytes(
        (shared / "tool_use.jinja").read_bytes()
    )
    result = fold_checkpoint(ref, out, FoldOptions.of(check="static"))
    assert result.report.passed and (out / "additional_chat_templates" / "tool_use.jinja").is_file()
    # links out that no loader reads stay a skip, as their kinds are anywhere: special files,
    # version-control data, dangling links
    inert = clone(src, tmp_path / "inert")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "repo.git").mkdir()
    (inert / "pipe").symlink_to(tmp_path / "pipe")
    (inert / ".git").symlink_to(tmp_path / "repo.git")
    (inert / "old.txt").symlink_to(tmp_path / "gone")
    result = fold_checkpoint(inert, tmp_path / "out-inert", FoldOptions.of(check="none"))
    assert sorted(result.skipped) == [
        ".git (version-control data)",
        "old.txt (a dangling symlink)",
        "pipe (not a regular file)",
    ]


def test_a_fold_reads_each_directorys_config_once(src, tmp_path, monkeypatch):
    """The Checkpoint owns what is derived from its directory: transformers' config is read once for
    the input and once for the written output, whose Checkpoint the fold hands to its check."""
    import transformers

    read = []
    real = transformers.AutoConfig.from_pretrained.__func__
    monkeypatch.setattr(
        transformers.AutoConfig,
        "from_pretrained",
        classmethod(lambda cls, path, *a, **k: read.append(str(path)) or real(cls, path, *a, **k)),
    )
    result = fold_checkpoint(src, tmp_path / "out", FoldOptions.of(check="static"))
    assert result.report.passed
    assert len(read) == 2 and read[0] == str(src) and read[1] != read[0], read


def test_the_meta_model_as_loaded_is_built_once_per_dtype(src):
    ck = open_checkpoint(src)
    auto, half = ck.meta_as_loaded(), ck.meta_as_loaded("bfloat16")
    assert (
        ck.meta_as_loaded() is auto and ck.meta_as_loaded("bfloat16") is half and auto is not half
    )
    assert (
        next(auto.parameters()).dtype == torch.float32
        and next(half.parameters()).dtype == torch.bfloat16
    )
    assert next(auto.parameters()).device.type == "meta"
