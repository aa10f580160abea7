"""The gate and the file handling, tried as an adversary would.

Every test here changes something the user was not told about (one weight
anywhere, a malformed header, a planted symlink, custom code, a signal) and
expects enjoyln to notice: exit 1 for a candidate that is not the fold, exit
2 with one line and nothing written for bad input.
"""

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from enjoyln.cli.app import app
from enjoyln.testing import perturb, tiny_model
from conftest import copy_dir

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A GPT-2 with more token ids and positions than a handful of random batches reach,
    and its fold, made once."""
    root = tmp_path_factory.mktemp("adv")
    src = root / "gpt2"
    model = perturb(
        tiny_model("gpt2", n_embd=32, n_head=2, n_layer=1, vocab_size=1000, n_positions=256), seed=5
    )
    model.save_pretrained(src)
    result = runner.invoke(app, ["fold", str(src), str(root / "folded"), "--no-check"])
    assert result.exit_code == 0, result.output
    return src, root / "folded"


def header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), 8 + n


def change_one_element(path, key, index, rel=1e-3):
    """Add rel * max|t| to one element of ``key``, in place in the file's bytes."""
    head, base = header(path)
    info = head[key]
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[info["dtype"]]
    with safe_open(path, "pt") as f:
        t = f.get_tensor(key)
    flat = t.reshape(-1).clone()
    flat[index] += rel * float(t.abs().max())
    raw = flat.to(dtype).view(torch.uint8).numpy().tobytes()
    lo, hi = info["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(base + lo)
        f.write(raw)
    assert len(raw) == hi - lo


def draws(folded, n=50, seed=0):
    """(key, flat index) pairs: any tensor, and embedding rows and positions that a few
    random batches of 2 x 16 tokens would not reach."""
    head, _ = header(folded / "model.safetensors")
    keys = sorted(k for k in head if k != "__metadata__")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            key = rng.choice(keys)
            out.append((key, rng.randrange(max(1, int(torch.tensor(head[key]["shape"]).prod())))))
        elif kind == 1:  # a token row: 1000 ids, the old default drew about 96 of them
            width = head["transformer.wte.weight"]["shape"][1]
            out.append(
                ("transformer.wte.weight", rng.randrange(500, 1000) * width + rng.randrange(width))
            )
        else:  # a position beyond the 16 the old default fed
            width = head["transformer.wpe.weight"]["shape"][1]
            out.append(
                ("transformer.wpe.weight", rng.randrange(16, 256) * width + rng.randrange(width))
            )
    return out


def test_unchanged_candidate_passes(dirs):
    src, folded = dirs
    result = runner.invoke(app, ["check", str(src), str(folded)])
    assert result.exit_code == 0, result.output
    assert (
        "identical" in result.output
        and "--thorough" in result.output
        and "positions 0-" not in result.output
    )
    result = runner.invoke(app, ["check", str(src), str(folded), "--thorough"])
    assert result.exit_code == 0, result.output
    assert "positions 0-255 of 256" in result.output and "identical" in result.output


def test_one_changed_element_anywhere_fails_the_check(dirs, tmp_path):
    src, folded = dirs
    failures = []
    for i, (key, index) in enumerate(draws(folded)):
        cand = copy_dir(folded, tmp_path / f"c{i}")
        change_one_element(cand / "model.safetensors", key, index)
        result = runner.invoke(app, ["check", str(src), str(cand), "--json"])
        if result.exit_code != 1 or json.loads(result.stdout)["passed"] is not False:
            failures.append((key, index, result.exit_code))
        elif key not in result.stdout:
            failures.append((key, index, "the report does not name the tensor"))
    assert not failures, failures


def test_the_forward_check_alone_reaches_every_position(dirs, tmp_path):
    """Without the weight check, the coverage batch still sees a change at position 200."""
    src, folded = dirs
    cand = copy_dir(folded, tmp_path / "cand")
    width = header(folded / "model.safetensors")[0]["transformer.wpe.weight"]["shape"][1]
    change_one_element(
        cand / "model.safetensors", "transformer.wpe.weight", 200 * width + 3, rel=0.05
    )
    result = runner.invoke(app, ["check", str(src), str(cand), "--forward-only"])
    assert result.exit_code == 1, result.output


def rewrite_header(src_file, dst_file, edit):
    head, base = header(src_file)
    body = src_file.read_bytes()[base:]
    body = edit(head, body)
    blob = json.dumps(head).encode()
    blob += b" " * (-len(blob) % 8)
    dst_file.write_bytes(struct.pack("<Q", len(blob)) + blob + body)


def ordered(head):
    return sorted(
        (k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][0]
    )


def full_overlap(head, body):
    a, b = [k for k in ordered(head) if k.endswith("ln_1.bias") or k.endswith("ln_2.bias")][:2]
    head[b]["data_offsets"] = list(head[a]["data_offsets"])  # two biases on the same bytes
    return body + b"\0" * 0


def partial_overlap(head, body):
    keys = ordered(head)
    k = next(k for k in keys[1:] if head[k]["data_offsets"][1] - head[k]["data_offsets"][0] >= 8)
    lo, hi = head[k]["data_offsets"]
    head[k]["data_offsets"] = [lo - 4, hi - 4]  # shifted halfway into its neighbour
    return body


def gap(head, body):
    keys = ordered(head)
    cut = head[keys[1]]["data_offsets"][0]
    for k in keys[1:]:
        head[k]["data_offsets"] = [v + 16 for v in head[k]["data_offsets"]]
    return body[:cut] + b"\0" * 16 + body[cut:]


def out_of_order(head, body):
    k = ordered(head)[2]
    lo, hi = head[k]["data_offsets"]
    head[k]["data_offsets"] = [hi, lo]
    return body


def float_offsets(head, body):
    """Tiles exactly, but safetensors refuses 0.0 where it expects an integer: nothing could load
    it."""
    for k in ordered(head):
        head[k]["data_offsets"] = [float(v) for v in head[k]["data_offsets"]]
    return body


@pytest.mark.parametrize(
    "edit,words",
    [
        (full_overlap, "overlaps"),
        (partial_overlap, "overlaps"),
        (gap, "belong to no tensor"),
        (out_of_order, "out of order"),
        (float_offsets, "must be lists of integers"),
    ],
)
def test_malformed_offsets_are_refused(edit, words, dirs, tmp_path):
    src, _ = dirs
    bad = copy_dir(src, tmp_path / "bad")
    rewrite_header(src / "model.safetensors", bad / "model.safetensors", edit)
    before = {p.name: p.read_bytes() for p in bad.iterdir()}
    for command in (
        ["fold", str(bad), str(tmp_path / "out")],
        ["inspect", str(bad)],
        ["fold", str(bad), str(tmp_path / "out"), "--no-check"],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
            result.stderr
        )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.enjoyln-*"))
    assert {p.name: p.read_bytes() for p in bad.iterdir()} == before


def test_symlinks_out_of_the_model_dir_are_not_followed(dirs, tmp_path):
    src, _ = dirs
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "passwd").write_text("root:x:0:0")
    (secret / "data").mkdir()
    (secret / "data" / "keys.txt").write_text("private")
    cache = tmp_path / "blobs"  # the Hugging Face cache layout: weights are links to blobs
    cache.mkdir()
    (cache / "abc123").write_bytes((src / "model.safetensors").read_bytes())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((src / "config.json").read_text())
    (model / "model.safetensors").symlink_to(cache / "abc123")
    (model / "tokenizer.json").symlink_to(
        cache / "abc123"
    )  # a needed file, followed wherever it goes
    (model / "passwd").symlink_to(secret / "passwd")
    (model / "data").symlink_to(secret / "data")
    (model / "notes").mkdir()
    (model / "notes" / "inner").symlink_to(secret / "passwd")
    (model / "notes" / "readme.txt").write_text("kept")
    (model / "README.md").symlink_to(model / "notes" / "readme.txt")  # inside: followed
    out = tmp_path / "out"
    # a file a loader may read, outside MODEL_DIR: never copied, and never silently dropped either
    # (the fold would load otherwise), so the fold is refused, naming each link in turn
    for link in ("data", "notes/inner", "passwd"):
        result = runner.invoke(app, ["fold", str(model), str(out)])
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert f"{model / link} links to" in result.stderr and "root:x" not in result.stderr
        assert not out.exists() and not list(tmp_path.glob(".out.enjoyln-*"))
        (model / link).unlink()
    result = runner.invoke(app, ["fold", str(model), str(out)])
    assert result.exit_code == 0, result.output
    assert not any("root:x" in p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file())
    assert (out / "notes" / "readme.txt").read_text() == "kept" and (
        out / "README.md"
    ).read_text() == "kept"
    assert (out / "tokenizer.json").stat().st_size == (src / "model.safetensors").stat().st_size
    assert (
        f"tokenizer.json -> {cache / 'abc123'}" in result.output
    )  # followed out of MODEL_DIR, and said


def test_a_hugging_face_cache_snapshot_keeps_every_file(dirs, tmp_path):
    """In the cache every file of a snapshot is a link to the repository's blobs, whatever its
    name: a tokenizer file with an unusual name (PhoBERT's bpe.codes) must reach OUT_DIR, and the
    gate must compare it, or the fold ships a model whose tokenizer is gone."""
    import hashlib

    src, _ = dirs
    repo = tmp_path / "models--someone--gpt2"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    (snapshot / "sub").mkdir(parents=True)
    files = {
        "config.json": (src / "config.json").read_bytes(),
        "model.safetensors": (src / "model.safetensors").read_bytes(),
        "bpe.codes": b"h e 1\nhe l 2\n",
        "README.md": b"# card\n",
        "sub/notes.txt": b"kept\n",
    }
    for name, data in files.items():
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(
            Path("../" * name.count("/")) / ".." / ".." / "blobs" / blob.name
        )
    (tmp_path / "secret").write_text("private")
    (snapshot / "stray.txt").symlink_to(tmp_path / "secret")  # out of the repository: never copied
    result = runner.invoke(app, ["fold", str(snapshot), str(tmp_path / "out")])
    assert result.exit_code == 2 and "stray.txt links to" in result.stderr, result.output
    # the gate reads it from the reference, through its link: a copy without it is not the reference
    result = runner.invoke(app, ["check", str(snapshot), str(snapshot), "--static"])
    assert result.exit_code == 0, result.output
    (snapshot / "stray.txt").unlink()
    result = runner.invoke(app, ["fold", str(snapshot), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    for name in ("bpe.codes", "README.md", "sub/notes.txt"):
        assert (out / name).read_bytes() == files[name] and not (out / name).is_symlink()
    assert not (out / "stray.txt").exists()
    import shutil

    bad = Path(shutil.copytree(out, tmp_path / "bad"))
    (bad / "bpe.codes").write_bytes(b"h e 1\n")
    result = runner.invoke(app, ["check", str(snapshot), str(bad), "--static"])
    assert result.exit_code == 1 and "bpe.codes differs" in result.output, result.output


def test_custom_code_needs_the_flag(dirs, tmp_path):
    src, _ = dirs
    model = copy_dir(src, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.GPT2LMHeadModel"}
    (model / "config.json").write_text(json.dumps(config))
    for command in (
        ["fold", str(model), str(tmp_path / "out")],
        ["inspect", str(model)],
        ["check", str(src), str(model)],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 2 and "--trust-remote-code" in result.stderr, result.output
    assert not (tmp_path / "out").exists()
    config.pop("auto_map")
    (model / "config.json").write_text(json.dumps(config))
    (model / "modeling_evil.py").write_text(
        "raise SystemExit('ran')\n"
    )  # code files alone count too
    result = runner.invoke(app, ["fold", str(model), str(tmp_path / "out")])
    assert result.exit_code == 2 and "modeling_evil.py" in result.stderr


def test_force_spares_a_directory_that_is_not_an_enjoyln_output(dirs, tmp_path):
    src, _ = dirs
    out = tmp_path / "project"
    (out / ".git").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "src").mkdir()
    (out / "src" / "main.py").write_text("print('mine')\n")
    result = runner.invoke(app, ["fold", str(src), str(out), "--force"])
    assert result.exit_code == 2 and "not an enjoyln output" in result.stderr
    assert (out / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert (out / "src" / "main.py").read_text() == "print('mine')\n"


def test_a_fold_that_fails_its_check_is_not_published(dirs, tmp_path, monkeypatch):
    """A deliberately broken fold: the writer centers one tensor wrongly."""
    from enjoyln.rewrite import writer as checkpoint

    src, _ = dirs
    real, real_into = checkpoint.center_, checkpoint.center_into

    def spoil(t):
        if t.dim() == 2 and t.shape[0] == 256:  # the position table
            t[100, 0] += 1e-3 * float(t.abs().max())

    def broken(t, axis, *args, **kwargs):
        real(t, axis, *args, **kwargs)
        spoil(t)
        return t

    def broken_into(src, dst, axis, *args, **kwargs):  # the early copy's path: centered in the file
        done = real_into(src, dst, axis, *args, **kwargs)
        spoil(dst)
        return done

    monkeypatch.setattr(checkpoint, "center_", broken)
    monkeypatch.setattr(checkpoint, "center_into", broken_into)
    out = tmp_path / "out"
    result = runner.invoke(app, ["fold", str(src), str(out)])
    assert result.exit_code == 1, result.output
    assert "transformer.wpe.weight" in result.output and "was not written" in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.enjoyln-*"))
    result = runner.invoke(app, ["fold", str(src), str(out), "--keep-failed"])
    assert result.exit_code == 1 and not out.exists()
    kept = tmp_path / "out.enjoyln-failed"
    assert kept.is_dir() and str(kept) in result.stderr and (kept / "model.safetensors").exists()


def _python(*args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "enjoyln", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def _wait_for_temp_dir(parent, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(parent.glob(".out.enjoyln-*"))
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the fold ended before it was interrupted: {proc.communicate()}")
        time.sleep(0.02)
    raise AssertionError("no temporary directory appeared")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_fold_leaves_nothing_after_a_rerun(sig, dirs, tmp_path):
    src, _ = dirs
    out = tmp_path / "out"
    proc = _python("fold", str(src), str(out))
    _wait_for_temp_dir(tmp_path, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and stderr.strip() == "terminated", stderr
        assert not list(tmp_path.glob(".out.enjoyln-*"))  # cleaned up at once
    else:
        assert proc.returncode == -signal.SIGKILL and list(tmp_path.glob(".out.enjoyln-*"))
    assert not out.exists()
    result = runner.invoke(app, ["fold", str(src), str(out), "--no-check"])
    assert result.exit_code == 0, result.output
    assert ("Removed 1 temporary directory" in result.output) == (sig == signal.SIGKILL)
    assert not list(tmp_path.glob(".out.enjoyln-*")) and (out / "model.safetensors").exists()


# The command line with an import hook: when torch is first imported, it says so on stdout and
# waits there, so the interrupt lands inside that import, whatever the machine's speed. SIGINT is
# first given Python's usual handler, as in a terminal: run as a background job, the suite (and so
# the child) inherits SIGINT ignored, which the command rightly keeps ignoring.
_AT_IMPORT = """
import importlib.abc, signal, sys, time

signal.signal(signal.SIGINT, signal.default_int_handler)

class Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("importing torch", flush=True)
            time.sleep(60)
        return None

sys.meta_path.insert(0, Hold())
sys.argv = ["enjoyln", *sys.argv[1:]]
from enjoyln.__main__ import main
main()
"""


def test_interrupt_at_start_up_is_one_line(dirs, tmp_path):
    """SIGINT while torch is being imported."""
    src, _ = dirs
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _AT_IMPORT, "inspect", str(src)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout.readline() == "importing torch\n"  # the state the interrupt must find
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stderr.strip() == "interrupted", stderr


def test_a_live_run_is_not_disturbed(dirs, tmp_path):
    """A temporary directory owned by a running process is neither removed nor raced."""
    src, _ = dirs
    tmp = tmp_path / f".out.enjoyln-{os.getppid()}-abcdefgh"
    tmp.mkdir()
    result = runner.invoke(app, ["fold", str(src), str(tmp_path / "out")])
    assert result.exit_code == 2 and f"pid {os.getppid()}" in result.stderr
    assert tmp.exists() and not (tmp_path / "out").exists()


# --- found in review ----------------------------------------------------------------------


def test_a_stale_index_beside_a_single_weight_file_is_refused(dirs, tmp_path):
    """transformers loads model.safetensors and ignores the index: checking the shards the index
    names would vouch for weights that nothing loads."""
    src, folded = dirs
    cand = copy_dir(folded, tmp_path / "cand")
    shard = "model-00001-of-00001.safetensors"
    (cand / shard).write_bytes((folded / "model.safetensors").read_bytes())
    keys = [k for k in header(folded / "model.safetensors")[0] if k != "__metadata__"]
    (cand / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: shard for k in keys}})
    )
    width = header(folded / "model.safetensors")[0]["transformer.wte.weight"]["shape"][1]
    change_one_element(cand / "model.safetensors", "transformer.wte.weight", 900 * width, rel=0.05)
    for command in (["check", str(src), str(cand)], ["check", str(src), str(cand), "--static"]):
        result = runner.invoke(app, command)
        assert (
            result.exit_code == 2
            and "holds both model.safetensors and model.safetensors.index.json" in result.stderr
        ), result.output
        assert len(result.stderr.strip().splitlines()) == 1
