"""The command line, through typer's CliRunner and through real subprocesses."""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from enjoyln.rewrite import convert
from enjoyln.checking import checkpoints
from enjoyln.rewrite import writer
from enjoyln.cli.app import app
from enjoyln.testing import perturb, tiny_model
from conftest import copy_dir

runner = CliRunner()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "gpt2"
    perturb(tiny_model("gpt2"), seed=31).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    return path


def digest(path):
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_fold_then_check(gpt2_dir, tmp_path):
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "5 of 5 LayerNorms foldable" in result.output
    assert "lm_head.weight" in result.output and "PASS" in result.output
    result = runner.invoke(app, ["check", str(gpt2_dir), str(tmp_path / "out"), "--batches", "2"])
    assert result.exit_code == 0 and "PASS" in result.output


def test_fold_json_and_dry_run(gpt2_dir, tmp_path):
    result = runner.invoke(
        app, ["fold", str(gpt2_dir), str(tmp_path / "out"), "--dry-run", "--json"]
    )
    assert result.exit_code == 0
    payload = json.loads(result.stdout)
    assert payload["out_dir"] is None and len(payload["plan"]["layer_norms"]) == 5
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out"), "--json"])
    payload = json.loads(result.stdout)
    assert payload["check"]["passed"] is True and payload["files"] == ["model.safetensors"]


def test_check_fails_with_exit_1_on_a_wrong_checkpoint(gpt2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    assert runner.invoke(app, ["fold", str(gpt2_dir), str(out), "--no-check"]).exit_code == 0
    sd = load_file(out / "model.safetensors")
    sd["transformer.h.0.ln_2.bias"] = torch.zeros_like(
        sd["transformer.h.0.ln_2.bias"]
    )  # drop a beta
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(app, ["check", str(gpt2_dir), str(out), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["passed"] is False


def test_inspect_table_json_and_graph(gpt2_dir, tmp_path):
    result = runner.invoke(app, ["inspect", str(gpt2_dir)])
    assert result.exit_code == 0 and "transformer.ln_f" in result.output
    result = runner.invoke(app, ["inspect", str(gpt2_dir), "--json"])
    assert json.loads(result.stdout)["model"] == "GPT2LMHeadModel"
    for suffix in ("html", "svg"):
        graph = tmp_path / f"g.{suffix}"
        result = runner.invoke(app, ["inspect", str(gpt2_dir), "--graph", str(graph)])
        assert result.exit_code == 0, result.output
        text = graph.read_text()
        assert "transformer.h.1.ln_2" in text and "<svg" in text
        assert text.count("#c7f0c2") >= 5  # centered leaves drawn in green
    result = runner.invoke(app, ["inspect", str(gpt2_dir), "--graph", str(tmp_path / "g.png")])
    assert result.exit_code == 2 and "must end in .html or .svg" in result.stderr


def test_inspect_bert_reasons(tmp_path):
    tiny_model("bert").save_pretrained(tmp_path / "bert")
    result = runner.invoke(app, ["inspect", str(tmp_path / "bert"), "--json"])
    plan = json.loads(result.stdout)
    reasons = [e["reason"] for e in plan["layer_norms"] if not e["foldable"]]
    assert len(reasons) == 4 and all("which is not zero-mean" in r for r in reasons)


def test_no_layer_norm_says_nothing_to_fold(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "llama")
    result = runner.invoke(app, ["fold", str(tmp_path / "llama"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: nothing to fold: LlamaForCausalLM has no LayerNorm; nothing was written"
    )
    assert not (tmp_path / "out").exists()


def test_norms_the_traced_inputs_never_reach_are_not_called_absent():
    """A model whose LayerNorms sit in a tower the meta model's inputs cannot reach (Qwen2-VL's,
    whose image grids are read as values) is not told it has none."""
    from enjoyln.cli.render import plan_sentence
    from enjoyln.plan import FoldPlan

    plan = FoldPlan("VLM", norm_modules=["visual.blocks.0.norm1", "visual.blocks.0.norm2"])
    assert plan_sentence(plan) == (
        "VLM has 2 normalization layers (visual.blocks.0.norm1, ...), but the inputs enjoyln "
        "could make for its meta model reach none of them (a tower that reads the values of its "
        "inputs cannot run there; enjoyln.fold on the loaded model can): nothing to fold."
    )
    assert plan_sentence(FoldPlan("LM")) == "LM has no LayerNorm: nothing to fold."


def test_bad_option_values(gpt2_dir, tmp_path):
    for args, message in [
        (["fold", str(gpt2_dir), str(tmp_path / "o"), "--max-shard-size", "0"], "positive size"),
        (["fold", str(gpt2_dir), str(tmp_path / "o"), "--max-shard-size", "-5"], "positive size"),
        (["bench", "--no-e2e", "--shapes", "0x64"], "positive sizes"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.stderr, args
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_dry_run_accepts_a_non_empty_out_dir(gpt2_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0 and (tmp_path / "out" / "keep.txt").read_text() == "mine"


# --- bad input: one line, exit 2, input unchanged, no OUT_DIR -------------------------------


def corrupt(src, tmp):
    d = copy_dir(src, tmp / "in")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    return d


def truncated(src, tmp):
    d = copy_dir(src, tmp / "in")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    return d


def bad_config(src, tmp):
    d = copy_dir(src, tmp / "in")
    (d / "config.json").write_text("{oops")
    return d


def no_config(src, tmp):
    d = copy_dir(src, tmp / "in")
    (d / "config.json").unlink()
    return d


def unknown_arch(src, tmp):
    d = copy_dir(src, tmp / "in")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    return d


def pickle_only(src, tmp):
    d = tmp / "in"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    return d


def empty(src, tmp):
    (tmp / "in").mkdir()
    return tmp / "in"


BAD = [
    (lambda s, t: t / "missing", "does not exist"),
    (empty, "is empty"),
    (no_config, "has no config.json"),
    (bad_config, "is not valid JSON"),
    (unknown_arch, "unknown architecture 'NoSuchModelForCausalLM'"),
    (corrupt, "is not a valid safetensors file"),
    (truncated, "truncated"),
    (pickle_only, "--allow-pickle"),
]


@pytest.mark.parametrize("make,message", BAD, ids=[m for _, m in BAD])
def test_bad_input(make, message, gpt2_dir, tmp_path):
    src = make(gpt2_dir, tmp_path)
    before = digest(src) if src.exists() else None
    out = tmp_path / "out"
    result = runner.invoke(app, ["fold", str(src), str(out)])
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert (digest(src) if src.exists() else None) == before
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("where", ["same", "inside"])
def test_out_dir_equal_to_or_inside_model_dir(where, gpt2_dir, tmp_path):
    src = copy_dir(gpt2_dir, tmp_path / "in")
    before = digest(src)
    out = src if where == "same" else src / "sub"
    result = runner.invoke(app, ["fold", str(src), str(out)])
    assert result.exit_code == 2 and "inside MODEL_DIR" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert digest(src) == before and not (src / "sub").exists()


def test_non_empty_out_dir_needs_force(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(out)])
    assert result.exit_code == 2 and "--force" in result.stderr
    assert (out / "keep.txt").read_text() == "mine"
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(out), "--force", "--no-check"])
    assert result.exit_code == 2 and "not an enjoyln output" in result.stderr  # --force spares it
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert runner.invoke(app, ["fold", str(gpt2_dir), str(out), "--no-check"]).exit_code == 0
    (out / "extra.txt").write_text("from an earlier fold")
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(out), "--force", "--no-check"])
    assert (
        result.exit_code == 0 and not (out / "extra.txt").exists()
    )  # an earlier output is replaced
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize("where", ["_copy_range", "_pwrite_all", "write_shard"])
@pytest.mark.parametrize(
    "code,message", [(errno.ENOSPC, "disk full"), (errno.EACCES, "permission denied")]
)
def test_disk_full_or_permission_denied(code, message, where, gpt2_dir, tmp_path, monkeypatch):
    # Root ignores file permissions and tmpfs quotas are not available here, so the
    # failing write is simulated where data goes to disk: the byte copy (on the
    # early-copy thread), the write of centered tensors, and the fresh-shard writer.
    def failing_write(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(convert if where == "write_shard" else writer, where, failing_write)
    if where == "write_shard":  # only used when the early copy cannot be
        monkeypatch.setattr(convert, "early_spans", lambda ck, size: {})
    before = digest(gpt2_dir)
    out = tmp_path / "out"
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(out)])
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists() and digest(gpt2_dir) == before
    assert list(tmp_path.iterdir()) == []


def test_permission_denied_creating_the_temporary_directory(gpt2_dir, tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    from enjoyln.store import transaction

    monkeypatch.setattr(transaction.tempfile, "mkdtemp", denied)
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out")])
    assert result.exit_code == 2 and "permission denied" in result.stderr


def test_check_bad_input_exits_2(gpt2_dir, tmp_path):
    result = runner.invoke(app, ["check", str(gpt2_dir), str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_allow_pickle_folds_bin_weights(gpt2_dir, tmp_path):
    import transformers

    src = tmp_path / "in"
    src.mkdir()
    (src / "config.json").write_text((gpt2_dir / "config.json").read_text())
    sd = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).state_dict()
    sd.pop("lm_head.weight")
    torch.save(sd, src / "pytorch_model.bin")
    result = runner.invoke(app, ["fold", str(src), str(tmp_path / "out"), "--allow-pickle"])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output


# --- real subprocesses ---------------------------------------------------------------------------


def run(*args):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)


def test_entry_point_subprocess(gpt2_dir, tmp_path):
    proc = run("enjoyln", "fold", str(gpt2_dir), str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["check"]["passed"] is True
    proc = run("enjoyln", "fold", str(tmp_path / "missing"), str(tmp_path / "out2"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'missing'} does not exist, and is not a Hugging "
        "Face hub id (NAME or ORG/NAME)"
    ]


def test_python_dash_m_subprocess(gpt2_dir, tmp_path):
    proc = run(sys.executable, "-m", "enjoyln", "inspect", str(gpt2_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["layer_norms"]) == 5
    proc = run(sys.executable, "-m", "enjoyln", "check", str(gpt2_dir), str(gpt2_dir))
    assert proc.returncode == 0 and "PASS" in proc.stdout


# --- output defects ----------------------------------------------------------------------------


def strict_json(text):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    assert text.isascii()
    return json.loads(text, parse_constant=refuse)


def test_json_output_is_strict(gpt2_dir, tmp_path, monkeypatch):
    """JSON has no Infinity or NaN, and no UTF-8 carries an undecodable file name's bytes."""
    from enjoyln.checking.report import CheckReport, OutputCheck

    def report(*args, **kwargs):
        return CheckReport(
            passed=False,
            max_abs_diff=float("inf"),
            max_rel_diff=float("nan"),
            outputs=[OutputCheck("logits", float("inf"), float("-inf"), False)],
            batches=1,
            dtype="float32",
            criterion="x\udcffy é",
        )

    monkeypatch.setattr(checkpoints, "check_checkpoints", report)
    result = runner.invoke(app, ["check", str(gpt2_dir), str(gpt2_dir), "--json"])
    assert result.exit_code == 1
    data = strict_json(result.stdout)
    assert (data["max_abs_diff"], data["max_rel_diff"], data["outputs"][0]["max_rel_diff"]) == (
        "inf",
        "nan",
        "-inf",
    )
    assert data["criterion"] == "x\\xffy é"


def test_a_non_utf8_out_dir_in_json_output(gpt2_dir, tmp_path):
    out = os.fsdecode(bytes(tmp_path) + b"/out\xff")
    proc = subprocess.run(
        [sys.executable, "-m", "enjoyln", "fold", str(gpt2_dir), out, "--json", "--static"],
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        strict_json(proc.stdout.decode("ascii"))["out_dir"]
        == os.fsdecode(bytes(tmp_path)) + "/out\\xff"
    )


def test_printing_after_publishing_cannot_fail_the_command(gpt2_dir, tmp_path):
    """An ASCII stdout cannot print 'é': the fold is published and checked all the same, and
    the exit code must say so."""
    out = tmp_path / "out-é"
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run(
        [sys.executable, "-m", "enjoyln", "fold", str(gpt2_dir), str(out), "--static"],
        capture_output=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.is_dir() and b"Wrote" in proc.stdout and b"out-\\xe9" in proc.stdout


def test_a_failed_fold_removes_the_folders_it_created(gpt2_dir, tmp_path, monkeypatch):
    from enjoyln.checking.report import CheckReport

    monkeypatch.setattr(
        convert,
        "check_checkpoints",
        lambda *a, **k: CheckReport(
            passed=False,
            max_abs_diff=1.0,
            max_rel_diff=1.0,
            outputs=[],
            batches=1,
            dtype="float32",
            criterion="",
        ),
    )
    (tmp_path / "kept").mkdir()
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "kept" / "a" / "b" / "out")])
    assert result.exit_code == 1
    assert os.listdir(tmp_path / "kept") == []
    result = runner.invoke(
        app, ["fold", str(gpt2_dir), str(tmp_path / "c" / "out"), "--keep-failed"]
    )
    assert result.exit_code == 1 and os.listdir(tmp_path / "c") == ["out.enjoyln-failed"]


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\u2028b", "a\x1b[31mb"])
def test_an_error_stays_one_line_whatever_the_path(tmp_path, name):
    missing = tmp_path / name
    proc = run(sys.executable, "-m", "enjoyln", "check", str(missing), str(tmp_path))
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, repr(proc.stderr)
    assert proc.stderr.startswith(f"error: {tmp_path}/a\\") and proc.stderr.rstrip().endswith(
        "b does not exist, and is not a Hugging Face hub id (NAME or ORG/NAME)"
    )


def test_check_dtype_option(gpt2_dir, tmp_path):
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out"), "--static"])
    assert result.exit_code == 0, result.output
    cand = copy_dir(tmp_path / "out", tmp_path / "half")
    config = json.loads((cand / "config.json").read_text())
    (cand / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    result = runner.invoke(app, ["check", str(gpt2_dir), str(cand), "--static"])
    assert result.exit_code == 1 and "pass --dtype float16" in result.output
    result = runner.invoke(
        app, ["check", str(gpt2_dir), str(cand), "--static", "--dtype", "float16"]
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["check", str(gpt2_dir), str(cand), "--dtype", "int8"])
    assert result.exit_code == 2
    assert result.stderr == (
        "error: cannot judge a candidate in dtype 'int8'; use one of float16, bfloat16, "
        "float32, float64\n"
    )


# --- bad input: the problem named, never a Python exception type -------------------------


def _block_edit(edit):
    def make(folded, tmp):
        cand = copy_dir(folded, tmp / "cand")
        config = json.loads((cand / "config.json").read_text())
        edit(config["enjoyln"])
        (cand / "config.json").write_text(json.dumps(config))
        return cand

    return make


BLOCKS = {  # a candidate whose block no fold writes is a wrong candidate: exit 1, saying why
    "plan not an object": (_block_edit(lambda b: b.update(plan=[])), "plan is [], not an object"),
    "centered a string": (
        _block_edit(lambda b: b["plan"]["layer_norms"][0].update(centered="abc")),
        "plan.layer_norms[0].centered is 'abc', not a list",
    ),
    "name a list": (
        _block_edit(lambda b: b["plan"]["layer_norms"][0].update(name=["x"])),
        'plan.layer_norms[0].name is ["x"], not a string',
    ),
    "scale a number": (
        _block_edit(lambda b: b["plan"]["layer_norms"][0]["centered"][0].update(scale=3)),
        "scale is 3, not a string",
    ),
    "groups 0": (
        _block_edit(lambda b: b["plan"]["layer_norms"][0]["centered"][0].update(groups=0)),
        "the recorded plan is not what this enjoyln's analysis gives",
    ),
}


@pytest.fixture(scope="module")
def folded_dir(gpt2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("folded") / "out"
    assert runner.invoke(app, ["fold", str(gpt2_dir), str(out), "--static"]).exit_code == 0
    return out


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("mode", [["--static"], ["--forward-only"]])
def test_a_block_no_fold_writes_is_a_wrong_candidate(name, mode, gpt2_dir, folded_dir, tmp_path):
    make, message = BLOCKS[name]
    result = runner.invoke(app, ["check", str(gpt2_dir), str(make(folded_dir, tmp_path)), *mode])
    assert "Error:" not in result.output and "Traceback" not in result.output
    if mode == ["--forward-only"] and name == "groups 0":
        # the static part compares the plan with the analysis; the forward part alone meets the
        # block when enjoyln.load checks the plan it would re-apply
        message = "in 0 groups, which its 64 entries along axis 1 do not fit"
    assert result.exit_code == 1 and message in result.output, result.output


BAD_OPTIONS = [
    (["check", "{ref}", "{ref}", "--seed", str(2**64)], "--seed"),
    (["rotate", "{ref}", "{tmp}/out", "--seed", "-1"], "--seed"),
    (["rotate", "{ref}", "{tmp}/out", "--seed", str(2**64)], "--seed"),
    (["fold", "{ref}", "{tmp}/out", "--max-shard-size", "²"], "cannot use the size '²'"),
    (["bench", "--dtypes", "float8_e4m3fn", "--no-e2e"], "cannot use 'float8_e4m3fn' in --dtypes"),
    (["bench", "--device", "foo"], "unknown --device 'foo'"),
    (["bench", "--plot", "{tmp}/x.txt"], "name a file ending in .png"),
    (["bench", "--shapes", "300000x300000"], "a shape may hold at most"),
    (["bench", "--threads", "100000"], "--threads"),
    (["export", "{ref}", "{tmp}/config.json"], "name a file ending in .onnx"),
]


@pytest.mark.parametrize("args,message", BAD_OPTIONS)
def test_bad_option_values_get_one_line_naming_them(args, message, gpt2_dir, tmp_path):
    args = [a.format(ref=gpt2_dir, tmp=tmp_path) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not any(
        t in result.output for t in ("TypeError", "ValueError", "AttributeError", "RuntimeError")
    )


def test_rotate_takes_any_seed(gpt2_dir, tmp_path):
    """A seed of 2**63 or more once overflowed the generator: every 64-bit seed is one (others are
    refused: BAD_OPTIONS)."""
    result = runner.invoke(
        app, ["rotate", str(gpt2_dir), str(tmp_path / "out"), "--seed", str(2**63), "--static"]
    )
    assert result.exit_code == 0, result.output


def test_an_index_that_names_a_list_as_a_shard(gpt2_dir, tmp_path):
    from safetensors import safe_open

    d = copy_dir(gpt2_dir, tmp_path / "d")
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    with safe_open(d / "model-00001-of-00001.safetensors", "pt") as f:
        keys = list(f.keys())
    weight_map = dict.fromkeys(keys, "model-00001-of-00001.safetensors") | {
        keys[0]: ["x.safetensors"]
    }
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    result = runner.invoke(app, ["inspect", str(d)])
    assert (
        result.exit_code == 2
        and "names the shard \"['x.safetensors']\", which is not a file" in result.output
    )


@pytest.mark.parametrize("value", ["foo", 5, ["float16"], "int8"])
def test_a_dtype_that_is_none_is_named(value, gpt2_dir, tmp_path):
    d = copy_dir(gpt2_dir, tmp_path / "d")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "dtype": value}))
    result = runner.invoke(app, ["fold", str(d), str(tmp_path / "out")])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert (
        "config.json" in result.output
        and "not a floating torch dtype" in result.output
        or "cannot read" in result.output
    ), result.output


def test_rotate_then_check_a_vision_language_directory(tmp_path):
    """LLaVA with a SigLIP tower read at layer -2, from its directory alone: every batch holds an
    image, the tapped tower's LNs are refused with the tap's reader named, yet its stream rotates
    (the projector takes Qᵀ), the tower's hidden states among the outputs are left out of the
    check, and the output loads with plain from_pretrained with the same logits."""
    import transformers

    from enjoyln.analysis.inputs import hf_example_inputs
    from models import llava_siglip

    src, out = tmp_path / "llava", tmp_path / "out"
    original = perturb(llava_siglip(), seed=5)
    original.save_pretrained(src)
    result = runner.invoke(app, ["rotate", str(src), str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["check"]["passed"] is True
    plan = payload["plan"]
    entries = {e["name"]: e for e in plan["layer_norms"]}
    tower = [e for name, e in entries.items() if name.startswith("model.vision_tower.encoder")]
    assert len(tower) == 4 and all(
        not e["foldable"] and "multi_modal_projector" in e["reason"] for e in tower
    )
    assert all(
        e["affine"] == "fused" and e["fused"] for e in tower
    )  # weightless LayerNorms, on a rotated stream
    rotated = {(r["param"], r["axis"]) for r in plan["rotation"]["rotated"]}
    assert {
        ("model.multi_modal_projector.linear_1.weight", 1),
        ("model.vision_tower.embeddings.patch_embedding.weight", 0),
    } <= rotated
    assert plan["changed_outputs"] == [
        "image_outputs.last_hidden_state",
        "image_outputs.hidden_states.1",
    ]
    assert any(
        "image_outputs" in o for o in json.dumps(payload["check"]).split('"')
    )  # the tower ran in the check
    result = runner.invoke(app, ["check", str(src), str(out)])
    assert result.exit_code == 0 and "PASS" in result.output, result.output
    assert "not compared: image_outputs.last_hidden_state" in result.output
    inputs = hf_example_inputs(original, seed=3)
    assert (inputs["input_ids"] == 127).sum() == 2 * 16
    with torch.no_grad():
        expected = original(**inputs).logits
        loaded = transformers.LlavaForConditionalGeneration.from_pretrained(out).eval()
        got = loaded(**inputs).logits
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(
        loaded.model.multi_modal_projector.linear_1.weight,
        original.model.multi_modal_projector.linear_1.weight,
        atol=1e-3,
    )


def test_rotate_a_directory_whose_tower_reads_its_inputs_values(tmp_path):
    """BLIP-2 from its directory alone: its tower reads its mask's values, so the meta model's
    inputs are made beside zeros standing in for its weights; the tower's stream rotates, the
    greedy decode starts from the whole prompt with its image, and OUT loads with plain
    from_pretrained with the same logits."""
    import transformers

    from enjoyln.analysis.inputs import hf_example_inputs
    from models import blip2_opt

    src, out = tmp_path / "blip2", tmp_path / "out"
    original = perturb(blip2_opt(), seed=6)
    original.save_pretrained(src)
    result = runner.invoke(app, ["rotate", str(src), str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    plan, check = payload["plan"], payload["check"]
    assert check["passed"] is True
    streams = [plan["rotation"], *plan.get("more_rotations", [])]
    assert any(
        r["param"] == "vision_model.embeddings.patch_embedding.weight"
        for s in streams
        for r in s["rotated"]
    )
    assert check["generation"]["prompt_tokens"] == 8 + 16  # the query tokens, then the text
    inputs = hf_example_inputs(original, seed=3)
    with torch.no_grad():
        expected = original(**inputs).logits
        loaded = transformers.Blip2ForConditionalGeneration.from_pretrained(out).eval()
        got = loaded(**inputs).logits
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_rotation_without_keep_mean_is_not_folded_or_rotated_again(gpt2_dir, tmp_path):
    """Its config builds LayerNorms that do not see a zero-mean stream: the analysis of that plain
    model is not the model enjoyln.load computes, and the fold of it failed only at the check."""
    nokm = tmp_path / "nokm"
    rotated = runner.invoke(
        app, ["rotate", str(gpt2_dir), str(nokm), "--no-keep-mean", "--no-check"]
    )
    assert rotated.exit_code == 0, rotated.output
    before = digest(nokm)
    for args in (
        ["rotate", str(nokm), str(tmp_path / "again")],
        ["fold", str(nokm), str(tmp_path / "again")],
        ["inspect", str(nokm)],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "was rotated without keeping the mean" in result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "again").exists() and digest(nokm) == before
    kept = runner.invoke(app, ["rotate", str(gpt2_dir), str(tmp_path / "km"), "--no-check"])
    again = runner.invoke(app, ["rotate", str(tmp_path / "km"), str(tmp_path / "km2"), "--static"])
    assert kept.exit_code == 0 and again.exit_code == 0, again.output


def test_a_check_given_in_the_wrong_order_says_so_first(gpt2_dir, folded_dir, tmp_path):
    """The fold first and the original second fails (the original holds none of the fold's
    tensors): the verdict leads with the likely cause, then the differences as given; the right
    order passes, and a failing candidate that is itself a fold gets no such guess."""
    for flags in (["--static"], []):
        result = runner.invoke(app, ["check", str(folded_dir), str(gpt2_dir), *flags, "--json"])
        assert result.exit_code == 1, result.output
        report = json.loads(result.output)
        assert report["verdict"].startswith(
            "FAIL: the reference is itself a fold by enjoyln and the candidate holds none: the "
            "two look given in the wrong order (the original comes first"
        ), report["verdict"]
        assert "; as given, the weights of the candidate are not what" in report["verdict"]
        assert report["static"]["swapped"] is True
        right = runner.invoke(app, ["check", str(gpt2_dir), str(folded_dir), *flags])
        assert right.exit_code == 0, right.output
    refolded = tmp_path / "refolded"
    shutil.copytree(folded_dir, refolded)
    from safetensors.torch import load_file, save_file

    weights = load_file(refolded / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.weight"][0, 0] += 1
    save_file(weights, refolded / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(app, ["check", str(folded_dir), str(refolded), "--static", "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 1 and report["static"]["swapped"] is False
    assert "wrong order" not in report["verdict"], report["verdict"]
    # a reference whose enjoyln block records no plan is no fold: no guess either
    blank = tmp_path / "blank"
    shutil.copytree(gpt2_dir, blank)
    config = json.loads((blank / "config.json").read_text())
    (blank / "config.json").write_text(json.dumps({**config, "enjoyln": {}}))
    result = runner.invoke(app, ["check", str(blank), str(gpt2_dir), "--static", "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 1 and report["static"]["swapped"] is False, result.output


def test_a_chain_checked_against_the_first_model_names_the_cause_first(
    gpt2_dir, folded_dir, tmp_path
):
    """A rotation of a fold records the plan of its own source, so held to the first model it is
    not confirmed: the verdict leads with that and what to do, not with the tensors it then finds
    unlike; a config changed after the fold leads likewise."""
    chain = tmp_path / "chain"
    made = runner.invoke(app, ["rotate", str(folded_dir), str(chain), "--static"])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["check", str(gpt2_dir), str(chain), "--static"])
    headline = result.output.splitlines()[0]
    assert result.exit_code == 1 and headline.startswith(
        "FAIL: the candidate does not match the plan it records: the recorded plan is not what"
    ), result.output
    assert "made from another model than this reference" in headline
    assert "--forward-only" in headline and "fold again with this version" not in headline
    assert headline.endswith("tensors differ"), headline
    assert runner.invoke(app, ["check", str(gpt2_dir), str(chain), "--forward-only"]).exit_code == 0
    config = json.loads((chain / "config.json").read_text())
    config["layer_norm_epsilon"] *= 10
    (chain / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["check", str(folded_dir), str(chain), "--static"])
    assert result.exit_code == 1 and result.output.startswith(
        "FAIL: the candidate does not match the plan it records: config.json changes "
        "layer_norm_epsilon"
    ), result.output
    # a fold's plan is confirmed whatever its config says, and its tensors judged by it: a
    # tampered tensor still leads
    from safetensors.torch import load_file, save_file

    fold = copy_dir(folded_dir, tmp_path / "fold")
    config = json.loads((fold / "config.json").read_text())
    config["layer_norm_epsilon"] *= 10
    (fold / "config.json").write_text(json.dumps(config))
    sd = load_file(fold / "model.safetensors")
    sd["transformer.h.0.ln_1.bias"] = sd["transformer.h.0.ln_1.bias"] + 1
    save_file(sd, fold / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(app, ["check", str(gpt2_dir), str(fold), "--static"])
    headline = result.output.splitlines()[0]
    assert result.exit_code == 1 and headline.startswith(
        "FAIL: the weights of the candidate are not what the fold makes of the original's: "
        "transformer.h.0.ln_1.bias"
    ), result.output
    assert headline.endswith("tensors differ; and 1 other problem)"), headline
