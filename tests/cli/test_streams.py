"""The exit code is the command's own whatever stdout and stderr are: closed, on a full disk, a pipe
whose reader is gone. One process, started with stdout closed (so enjoyln is imported with
``sys.stdout`` None), runs the commands under each state of the streams in turn: torch loads
once."""

import json
import os
import subprocess
import sys

import pytest

from enjoyln.testing import perturb, tiny_model
from conftest import copy_dir

DRIVER = r"""
import json, os, sys
stdout_at_import = repr(sys.stdout)
import enjoyln.cli.app  # every command's module, imported with no stdout: none may touch it then
from enjoyln.__main__ import main

ref, copy, out, record = sys.argv[1:5]
results = {"stdout at import": stdout_at_import}

def run(*args):
    sys.argv = ["enjoyln", *args]
    try:
        main()
    except SystemExit as exc:
        return exc.code
    return 0

def commands(state, fold=True):
    try:
        os.write(2, f"== {state}\n".encode())
    except OSError:  # stderr closed
        pass
    results[state] = {"pass": run("check", ref, copy, "--static"),
                      "fail": run("check", ref, copy, "--static", "--dtype", "bfloat16"),
                      "bad input": run("check", ref, os.path.join(out, "missing"))}
    if fold:
        results[state]["fold"] = run("fold", ref, os.path.join(out, state), "--static")

commands("stdout closed")  # as the interpreter started, so sys.stdout was None at import
os.dup2(os.open("/dev/full", os.O_WRONLY), 1)
commands("stdout full")
reader, writer = os.pipe()
os.close(reader)
os.dup2(writer, 1)
commands("stdout broken pipe")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
os.close(2)
sys.stderr = None  # what Python makes of a closed fd 2
commands("stderr closed", fold=False)
with open(record, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    perturb(tiny_model("gpt2", n_layer=1), seed=5).save_pretrained(root / "ref")
    return root / "ref", copy_dir(root / "ref", root / "copy")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_the_exit_code_holds_whatever_the_streams_are(dirs, tmp_path):
    ref, copy = dirs
    record = tmp_path / "record.json"
    proc = subprocess.run(
        [
            "sh",
            "-c",
            'exec "$@" >&-',
            "sh",
            sys.executable,
            "-c",
            DRIVER,
            str(ref),
            str(copy),
            str(tmp_path),
            str(record),
        ],
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(record.read_text())
    assert results["stdout at import"] == "None"
    for state in ("stdout closed", "stdout full", "stdout broken pipe"):
        assert results[state] == {"pass": 0, "fail": 1, "bad input": 2, "fold": 0}, state
        assert (tmp_path / state / "model.safetensors").is_file()  # published, and checked
    assert results["stderr closed"] == {"pass": 0, "fail": 1, "bad input": 2}
    logs = dict(part.split("\n", 1) for part in proc.stderr.split("== ")[1:])
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    missing = (
        f"error: {tmp_path / 'missing'} does not exist, and is not a Hugging Face hub id "
        "(NAME or ORG/NAME)"
    )
    assert (
        missing in logs["stdout closed"].splitlines()
        and missing in logs["stdout broken pipe"].splitlines()
    )
    # a full disk is worth a line; a reader that went away (| head) is not
    full = (
        "warning: cannot write to stdout (No space left on device); the rest of its output is "
        "dropped, and "
        "the exit code still gives the result"
    )
    assert (
        logs["stdout full"].splitlines().count(full) == 3
    )  # once for each command that prints a result
    assert "warning" not in logs["stdout broken pipe"] and "warning" not in logs["stdout closed"]
