"""What a user of huggingface-cli or optimum-cli expects of a command line: bad input refused
before torch loads, one line (or one JSON document) per failure, -h, --version, env, -q and
--verbose, --device, and hub ids resolved through huggingface_hub's cache."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from enjoyln._version import __version__
from enjoyln.cli.app import app
from enjoyln.testing import perturb, tiny_model

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]

# Runs the command line, then says on stderr which heavy modules were imported by the end.
PROBE = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("\\nIMPORTED " + " ".join(
    m for m in ("torch", "transformers", "safetensors") if m in sys.modules) + "\\n"))
sys.argv = ["enjoyln", *sys.argv[1:]]
from enjoyln.__main__ import main
main()
"""


def probe(*args, env=None, cwd=None):
    """(exit code, stdout, stderr lines without the probe's, the heavy modules imported)."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)],
        capture_output=True,
        text=True,
        env=environ,
        cwd=cwd,
        timeout=600,
    )
    lines = proc.stderr.strip().splitlines()
    imported = (
        lines[-1].removeprefix("IMPORTED").split()
        if lines and lines[-1].startswith("IMPORTED")
        else None
    )
    return proc.returncode, proc.stdout, [line for line in lines[:-1] if line], imported


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "gpt2"
    perturb(tiny_model("gpt2"), seed=41).save_pretrained(path)
    return path


# --- fail fast: refused before torch is imported ------------------------------------------------


def _file(tmp):
    (tmp / "afile").write_text("x")
    return tmp / "afile"


def _empty(tmp):
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _no_config(tmp):
    (tmp / "noconf").mkdir()
    (tmp / "noconf" / "model.safetensors").write_bytes(b"")
    return tmp / "noconf"


def _bad_config(tmp):
    (tmp / "badconf").mkdir()
    (tmp / "badconf" / "config.json").write_text("{oops")
    return tmp / "badconf"


def _list_config(tmp):
    (tmp / "listconf").mkdir()
    (tmp / "listconf" / "config.json").write_text("[1, 2]")
    return tmp / "listconf"


def _pickled(tmp):
    (tmp / "pickled").mkdir()
    (tmp / "pickled" / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    (tmp / "pickled" / "pytorch_model.bin").write_bytes(b"not read")
    return tmp / "pickled"


def _timm_bin(tmp):
    (tmp / "timmbin").mkdir()
    (tmp / "timmbin" / "config.json").write_text(
        json.dumps({"architecture": "vit_tiny_patch16_224", "num_classes": 10})
    )
    (tmp / "timmbin" / "pytorch_model.bin").write_bytes(b"not read")
    return tmp / "timmbin"


def _foreign(tmp):
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("mine")
    return tmp / "foreign"


EARLY = [  # (args, with {m}: a model dir, {tmp}: the test's folder), what the line says
    (["fold", "{tmp}/missing", "{tmp}/out"], "does not exist, and is not a Hugging Face hub id"),
    (["fold", "{file}", "{tmp}/out"], "is not a directory"),
    (["fold", "{empty}", "{tmp}/out"], "is empty"),
    (["fold", "{noconf}", "{tmp}/out"], "has no config.json"),
    (["inspect", "{badconf}"], "is not valid JSON"),
    (["check", "{listconf}", "{m}"], "does not hold a JSON object"),
    (["check", "{m}", "{tmp}/nope"], "does not exist"),
    (["fold", "{m}", "{m}/sub"], "is inside MODEL_DIR"),
    (["fold", "{m}", "{file}"], "exists and is not a directory"),
    (["fold", "{m}", "{tmp}/out", "--device", "tpu"], "unknown --device 'tpu'"),
    (["fold", "{m}", "{tmp}/out", "--max-shard-size", "lots"], "cannot use the size 'lots'"),
    (["rotate", "{m}", "{tmp}/out", "--kind", "spin"], "unknown --kind 'spin'"),
    (
        ["rotate", "{m}", "{tmp}/out", "--exact", "logits"],
        "unknown --exact 'logits'; use served or all",
    ),
    (["inspect", "{m}", "--rotate", "spin"], "unknown --rotate 'spin'"),
    (["inspect", "{m}", "--graph", "{tmp}/g.png"], "--graph must end in .html or .svg"),
    (["check", "{m}", "{m}", "--dtype", "int8"], "cannot judge a candidate in dtype 'int8'"),
    (["check", "{m}", "{m}", "--static", "--forward-only"], "exclude each other"),
    (
        ["check", "{m}", "{m}", "--sweep-tokens", "5"],
        "--sweep-tokens sets the token sweep, which only --forward-only",
    ),
    (["bench", "--dtypes", "float8"], "cannot use 'float8' in --dtypes"),
    (["export", "{m}", "{tmp}/model.txt"], "name a file ending in .onnx"),
    (["fold", "{m}", "{tmp}/out", "--revision", "main"], "--revision applies to a hub id"),
    (["fold", "a/b/c", "{tmp}/out"], "a/b/c does not exist, and is not a Hugging Face hub id"),
    (
        ["fold", "{pickled}", "{tmp}/out"],
        "has only pickle (.bin) weights, which can run code when loaded; pass --allow-pickle",
    ),
    (["check", "{m}", "{pickled}"], "has only pickle (.bin) weights"),
    (["inspect", "{pickled}"], "has only pickle (.bin) weights"),
    (
        ["rotate", "{m}", "{foreign}", "--force"],
        "is not empty and is not an enjoyln output (it has no config.json); "
        "--force replaces only those",
    ),
    (
        ["fold", "{timmbin}", "{tmp}/out", "--allow-pickle"],
        "holds a timm model's weights as pytorch_model.bin (pickle), which enjoyln does not read, "
        "not even with "
        "--allow-pickle; re-save them as model.safetensors, then run enjoyln again: python -c "
        "'import torch; ",
    ),
]


@pytest.mark.parametrize("args,message", EARLY, ids=[m for _, m in EARLY])
def test_bad_input_is_refused_before_torch_loads(args, message, gpt2_dir, tmp_path):
    values = {
        "m": gpt2_dir,
        "tmp": tmp_path,
        "file": _file(tmp_path),
        "empty": _empty(tmp_path),
        "noconf": _no_config(tmp_path),
        "badconf": _bad_config(tmp_path),
        "listconf": _list_config(tmp_path),
        "pickled": _pickled(tmp_path),
        "timmbin": _timm_bin(tmp_path),
        "foreign": _foreign(tmp_path),
    }
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, lines, imported = probe(*[a.format(**values) for a in args])
    assert code == 2 and stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert imported == [], f"{imported} imported before refusing: {lines}"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_cuda_without_a_gpu_is_refused_before_torch_loads(gpt2_dir, tmp_path):
    if any(
        Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
    ):
        pytest.skip("a GPU driver is loaded here")
    for args in (
        ["check", gpt2_dir, gpt2_dir, "--device", "cuda"],
        ["fold", gpt2_dir, tmp_path / "o", "--device", "cuda:1"],
        ["bench", "--device", "cuda"],
    ):
        code, _, lines, imported = probe(*args)
        assert code == 2 and imported == []
        assert lines == [
            f"error: --device {args[-1]}, but CUDA is not available here (no GPU driver is loaded)"
        ]


def test_help_and_version_do_not_import_torch():
    for args in (["--help"], ["-h"], ["fold", "-h"], ["check", "--help"], ["--version"]):
        code, stdout, _, imported = probe(*args)
        assert code == 0 and imported == [], (args, imported)
        assert stdout.strip()


# --- one line, or one JSON document -----------------------------------------------------------


def test_usage_errors_are_one_line_without_a_box(gpt2_dir):
    cases = [
        (
            ["fold", "--foo", "a", "b"],
            "error: no such option: --foo; did you mean --force? (see enjoyln fold --help)",
        ),
        (["fold", str(gpt2_dir)], "error: missing argument 'OUT_DIR' (see enjoyln fold --help)"),
        (["nope"], "error: no such command 'nope' (see enjoyln --help)"),
        (["check", "a", "b", "--seed", "-1"], "error: invalid value for '--seed': "),
    ]
    for args, line in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and result.stderr.startswith(line), result.stderr
        assert "╭" not in result.stderr and "Usage:" not in result.stderr


@pytest.mark.parametrize(
    "args,code,error",
    [
        (["fold", "{tmp}/missing", "{tmp}/out", "--json"], 2, "does not exist"),
        (["check", "{m}", "{tmp}/missing", "--json"], 2, "does not exist"),
        (["inspect", "{tmp}/missing", "--json"], 2, "does not exist"),
        (["fold", "{m}", "{tmp}/out", "--bogus", "--json"], 2, "no such option: --bogus"),
        (["check", "{m}", "{m}", "--dtype", "int8", "--json"], 2, "cannot judge a candidate"),
        (
            ["fold", "{m}", "{tmp}/out", "--dtype", "int8", "--json"],
            2,
            "cannot use 'int8' in --dtype",
        ),
        (["env", "--json", "--nope"], 2, "no such option: --nope"),
    ],
)
def test_json_errors_are_one_json_document_on_stdout(args, code, error, gpt2_dir, tmp_path):
    result = runner.invoke(app, [a.format(m=gpt2_dir, tmp=tmp_path) for a in args])
    assert result.exit_code == code
    doc = json.loads(result.stdout)  # exactly one document: a second one would not parse
    assert (
        doc["exit_code"] == code and error in doc["error"] and not doc["error"].startswith("error:")
    )
    assert len(result.stderr.strip().splitlines()) == 1  # the same line for a human reading the log


def test_json_of_a_failing_check_and_of_nothing_to_fold(gpt2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    assert runner.invoke(app, ["fold", str(gpt2_dir), str(out), "--no-check"]).exit_code == 0
    sd = load_file(out / "model.safetensors")
    sd["transformer.h.1.ln_1.weight"] = sd["transformer.h.1.ln_1.weight"] * 2
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(app, ["check", str(gpt2_dir), str(out), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["exit_code"] == 1 and doc["passed"] is False
    assert doc["verdict"].startswith(
        "FAIL: the weights of the candidate are not what the fold makes of the "
        "original's: transformer.h.1.ln_1.weight"
    )
    tiny_model("llama").save_pretrained(tmp_path / "llama")
    result = runner.invoke(app, ["fold", str(tmp_path / "llama"), str(tmp_path / "o2"), "--json"])
    doc = json.loads(result.stdout)
    assert (
        result.exit_code == 2
        and doc["exit_code"] == 2
        and doc["error"].startswith("nothing to fold")
    )
    assert doc["plan"]["model"] == "LlamaForCausalLM" and not (tmp_path / "o2").exists()


def test_inspect_json_leads_with_counts(tmp_path):
    tiny_model("bert").save_pretrained(tmp_path / "bert")
    doc = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "bert"), "--json"]).stdout)
    assert list(doc)[:3] == ["foldable", "total", "not_foldable"]
    assert (doc["foldable"], doc["total"], doc["not_foldable"]) == (1, 5, 4)
    assert doc["summary"] == "BertModel: 1 of 5 LayerNorms fold, by centering 3 tensors."
    assert (
        doc["post_ln"].startswith("BertModel is a post-LN model") and len(doc["layer_norms"]) == 5
    )


def test_inspect_json_gives_centered_and_untied_one_shape_and_fold_json_an_exit_code(
    gpt2_dir, tmp_path
):
    from enjoyln.plan import FoldPlan

    doc = json.loads(runner.invoke(app, ["inspect", str(gpt2_dir), "--json"]).stdout)
    assert (
        (doc["n_centered"], doc["n_untied"], doc["n_auxiliary"])
        == (len(doc["centered"]), 1, 0)
        != (0, 1, 0)
    )
    assert doc["untied"][0]["param"] == "lm_head.weight" and doc["auxiliary"] == []
    assert {"param", "axis"} <= set(doc["centered"][0]) and {"param", "tied_to"} <= set(
        doc["untied"][0]
    )
    assert (
        FoldPlan.from_dict(doc).untied[0].param == "lm_head.weight"
    )  # the plan reads back from it
    result = runner.invoke(
        app, ["fold", str(gpt2_dir), str(tmp_path / "out"), "--json", "--static"]
    )
    doc = json.loads(result.stdout)
    assert (
        result.exit_code == 0
        and list(doc)[:2] == ["verdict", "exit_code"]
        and doc["exit_code"] == 0
    )


# --- -h, --version, env, -q, --verbose ---------------------------------------------------------


def test_h_is_help_everywhere():
    assert runner.invoke(app, ["-h"]).stdout == runner.invoke(app, ["--help"]).stdout
    for command in ("fold", "rotate", "inspect", "check", "demo", "bench", "export", "env"):
        short, long = runner.invoke(app, [command, "-h"]), runner.invoke(app, [command, "--help"])
        assert (
            short.exit_code == 0
            and short.stdout == long.stdout
            and "Usage: enjoyln " + command in short.stdout
        )


def test_help_shows_capital_metavars_and_no_bool_noise():
    text = runner.invoke(app, ["fold", "--help"], env={"COLUMNS": "200"}).stdout
    assert "Usage: enjoyln fold [OPTIONS] MODEL_DIR OUT_DIR" in text
    assert "<bool>" not in text and "{model_dir}" not in text.lower()
    assert (
        "Usage: enjoyln check [OPTIONS] REFERENCE CANDIDATE"
        in runner.invoke(app, ["check", "-h"]).stdout
    )
    assert (
        "Usage: enjoyln bench [OPTIONS] [MODEL_DIR]" in runner.invoke(app, ["bench", "-h"]).stdout
    )


def test_version_is_the_release_the_changelog_names():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"enjoyln {__version__}\n"
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[0] == __version__ == "0.1.0"


def test_env_reports_versions_backends_gpu_and_caches(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    doc = json.loads(runner.invoke(app, ["env", "--json"]).stdout)
    assert (
        doc["versions"]["enjoyln"] == __version__ and doc["versions"]["torch"] == torch.__version__
    )
    assert doc["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(doc["backends"]) == {"cpu", "cuda"} and doc["backends"]["cpu"]
    assert doc["gpus"] == ([] if not torch.cuda.is_available() else doc["gpus"]) and isinstance(
        doc["gpus"], list
    )
    assert doc["caches"]["triton"] == str(tmp_path / "triton") and doc["caches"]["huggingface hub"]
    text = runner.invoke(app, ["env"]).stdout
    assert (
        f"enjoyln: {__version__}" in text
        and "RMSNorm kernels" in text
        and f"cpu: {doc['backends']['cpu']}" in text
    )
    assert doc["paths"]["cpu"]["float64, or mixed dtypes"] == "reference PyTorch"
    assert doc["paths"]["any device"]["torch.export"] == "one enjoyln.rms_norm node per norm"
    assert "RMSNorm paths" in text and "cpu, float64, or mixed dtypes: reference PyTorch" in text


def test_quiet_prints_the_verdict_only(gpt2_dir, tmp_path):
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out"), "-q"])
    lines = result.stdout.strip().splitlines()
    assert result.exit_code == 0 and len(lines) == 2, result.stdout
    assert lines[0].startswith("PASS: the folded model computes the same outputs") and lines[
        1
    ].startswith("Wrote ")
    result = runner.invoke(app, ["check", str(gpt2_dir), str(tmp_path / "out"), "--quiet"])
    assert (
        result.exit_code == 0
        and result.stdout.count("\n") == 1
        and result.stdout.startswith("PASS: ")
    )


def test_verbose_shows_the_traceback_of_an_unexpected_error(gpt2_dir, monkeypatch):
    from enjoyln.checking import checkpoints

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(checkpoints, "check_checkpoints", broken)
    result = runner.invoke(app, ["check", str(gpt2_dir), str(gpt2_dir)])
    assert result.exit_code == 2 and result.stderr == (
        "error: RuntimeError: boom (pass --verbose or set ENJOYLN_DEBUG=1 for the traceback)\n"
    )
    result = runner.invoke(app, ["check", str(gpt2_dir), str(gpt2_dir), "--verbose"])
    assert isinstance(result.exception, RuntimeError) and str(result.exception) == "boom"
    result = runner.invoke(app, ["check", str(gpt2_dir), str(gpt2_dir) + "-nope", "--verbose"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1  # bad input stays one line


def test_device_reaches_the_check(gpt2_dir, tmp_path, monkeypatch):
    from enjoyln.checking import checkpoints

    seen = {}
    real = checkpoints.check_checkpoints

    def spy(reference, candidate, options=None, **kwargs):
        seen["device"] = options.device
        return real(reference, candidate, options, **kwargs)

    monkeypatch.setattr(checkpoints, "check_checkpoints", spy)
    result = runner.invoke(
        app, ["check", str(gpt2_dir), str(gpt2_dir), "--device", "cpu", "--static"]
    )
    assert result.exit_code == 0 and seen == {"device": "cpu"}


# --- hub ids ----------------------------------------------------------------------------------


def hub_cache(root, repo, model_dir, commit="0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face cache holding ``repo`` at ``commit`` (the ref main), laid out as
    huggingface_hub lays it out: blobs named by their hash, snapshot files linking to them."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir()
    for file in sorted(Path(model_dir).iterdir()):
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.fixture(scope="module")
def hub(gpt2_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    hub_cache(cache, "tiny-org/tiny-gpt2", gpt2_dir)
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_a_hub_id_is_read_from_the_cache_offline(hub, tmp_path):
    code, stdout, lines, _ = probe("inspect", "tiny-org/tiny-gpt2", "--json", env=hub)
    assert code == 0, lines
    assert json.loads(stdout)["model"] == "GPT2LMHeadModel"
    code, stdout, lines, _ = probe(
        "fold",
        "tiny-org/tiny-gpt2",
        tmp_path / "out",
        "--static",
        "--json",
        "--revision",
        "0123456789abcdef0123456789abcdef01234567",
        env=hub,
    )
    assert code == 0, lines
    assert (
        json.loads(stdout)["verdict"].startswith("PASS")
        and (tmp_path / "out" / "model.safetensors").is_file()
    )
    assert not (tmp_path / "out" / "model.safetensors").is_symlink()


def test_a_hub_id_not_in_the_cache_is_one_line(hub, tmp_path):
    code, stdout, lines, imported = probe("fold", "tiny-org/other", tmp_path / "out", env=hub)
    assert code == 2 and stdout == "" and imported == []
    assert lines == [
        "error: tiny-org/other is not a local path, and the hub model tiny-org/other is not in "
        "the "
        f"Hugging Face cache ({hub['HF_HUB_CACHE']}) while HF_HUB_OFFLINE is set"
    ]
    code, _, lines, _ = probe("inspect", "tiny-org/tiny-gpt2", "--revision", "v9", env=hub)
    assert (
        code == 2
        and len(lines) == 1
        and "at revision v9 is not in the Hugging Face cache" in lines[0]
    )
    assert not (tmp_path / "out").exists()


def test_a_local_path_wins_over_a_hub_id(hub, tmp_path):
    tiny_model("bert").save_pretrained(tmp_path / "tiny-org" / "tiny-gpt2")
    code, stdout, lines, _ = probe("inspect", "tiny-org/tiny-gpt2", "--json", env=hub, cwd=tmp_path)
    assert code == 0 and json.loads(stdout)["model"] == "BertModel", lines


def test_the_values_checked_before_torch_are_the_apis():
    """The command line names rotation kinds and check dtypes itself, to refuse a wrong one before
    torch loads: they must be the ones the API takes."""
    from enjoyln.checking.compare import LOAD_DTYPES
    from enjoyln.cli.options import CHECK_DTYPES, ROTATIONS
    from enjoyln.transform.rotation import KINDS

    assert ROTATIONS == KINDS and tuple(CHECK_DTYPES) == tuple(LOAD_DTYPES)


def test_quiet_inspect_prints_the_plan_in_one_sentence(gpt2_dir):
    result = runner.invoke(app, ["inspect", str(gpt2_dir), "-q"])
    assert result.exit_code == 0 and result.stdout == (
        "GPT2LMHeadModel: all 5 LayerNorms fold, by centering 10 tensors and untying 1.\n"
    )


def test_a_fold_whose_check_fails_is_one_json_document(gpt2_dir, tmp_path, monkeypatch):
    from enjoyln.checking.report import CheckReport
    from enjoyln.rewrite import convert

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
    result = runner.invoke(app, ["fold", str(gpt2_dir), str(tmp_path / "out"), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["exit_code"] == 1 and doc["out_dir"] is None
    assert (
        doc["error"].startswith("the folded model failed its check")
        and doc["check"]["passed"] is False
    )
    assert doc["verdict"] == "FAIL: the folded model does not compute the same outputs"
    assert not (tmp_path / "out").exists()
