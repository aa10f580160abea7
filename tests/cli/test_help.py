"""``-h`` at 80 columns and piped: every option name whole, every description a whole sentence,
and docs/cli.md's tables what ``-h`` prints."""

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from enjoyln.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)  # type: ignore[attr-defined]

spec = importlib.util.spec_from_file_location("cli_options", ROOT / "scripts" / "cli_options.py")
cli_options = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli_options)


def _names(command: click.Command) -> list[str]:
    """Each parameter's first help column: ``--seq-len N``, ``-q, --quiet``, ``MODEL_DIR``."""
    with click.Context(GROUP, info_name="enjoyln", **GROUP.context_settings) as root:
        with click.Context(command, info_name=command.name, parent=root) as ctx:
            return [names for names, _ in cli_options.rows(command, ctx)]


def _assert_whole(text: str, names: list[str]) -> None:
    assert "…" not in text and "..." not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80
    listed = [
        line[2:].split("  ")[0]
        for line in text.splitlines()
        if line.startswith("  ") and not line.startswith("   ")
    ]  # the first column of each parameter's row
    for name in names:
        assert name in listed, (name, text)


@pytest.mark.parametrize("command", COMMANDS)
def test_h_at_80_columns_cuts_no_option_name(command):
    result = runner.invoke(app, [command, "-h"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    _assert_whole(result.stdout, _names(GROUP.commands[command]))  # type: ignore[attr-defined]
    assert (
        "<bool>" not in result.stdout
        and "<str>" not in result.stdout
        and "range>" not in result.stdout
    )


def test_piped_help_is_whole_too():
    """No terminal and no COLUMNS: the width click guesses (80) still cuts nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    text = subprocess.run(
        [sys.executable, "-m", "enjoyln", "rotate", "-h"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    ).stdout
    _assert_whole(text, _names(GROUP.commands["rotate"]))  # type: ignore[attr-defined]
    assert "--trust-remote-code" in text and "--keep-mean / --no-keep-mean" in text


def test_enjoyln_h_lists_each_command_with_a_whole_sentence():
    text = runner.invoke(app, ["-h"], env={"COLUMNS": "80"}).stdout
    assert (
        "..." not in text.replace("[ARGS]...", "")
        and "<bool>" not in text
        and max(len(line) for line in text.splitlines()) <= 80
    )
    commands = " ".join(text.split("Commands:")[1].split())
    for name in COMMANDS:
        sentence = cli_options.description(GROUP.commands[name])  # type: ignore[attr-defined]
        assert sentence.endswith(".") and f"{name} {sentence}" in commands, (name, commands)
    assert re.search(r"^  --version +Print the version and exit\.$", text, re.M)


def test_cli_md_tables_are_what_h_prints():
    """Regenerate with ``python scripts/cli_options.py --write`` after changing an option."""
    doc = (ROOT / "docs" / "cli.md").read_text()
    block = doc.split("<!-- cli-options:start -->\n")[1].split("<!-- cli-options:end -->")[0]
    assert block == cli_options.markdown()
    assert (
        "| `--seq-len N` | Sequence length of the short check batches. [default: 16; x>=1] |"
        in block
    )
    assert "| `-q, --quiet` | Print only the verdict and errors; no progress. |" in block
    # every option of every command has its row, its value's kind as -h shows it
    for name in COMMANDS:
        section = block.split(f"### enjoyln {name}\n")[1].split("### enjoyln")[0]
        text = runner.invoke(app, [name, "-h"], env={"COLUMNS": "80"}).stdout
        for names in _names(GROUP.commands[name]):  # type: ignore[attr-defined]
            assert f"| `{names}` |" in section and names in text


MAX_OWN_PARAMETERS = 10


def _command(name: str):
    """The function a command runs, under the wrappers (``friendly``, ``takes``) typer sees."""
    callback = next(c.callback for c in app.registered_commands if c.name == name)
    return inspect.unwrap(callback)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_declares_at_most_ten_parameters_of_its_own(command):
    """The rest come from option sets declared once (``cli.options.takes``), each one parameter."""
    own = inspect.signature(_command(command)).parameters
    assert len(own) <= MAX_OWN_PARAMETERS, (command, list(own))


def test_fold_and_rotate_share_their_option_set():
    from enjoyln.cli import options

    callbacks = {c.name: c.callback for c in app.registered_commands}
    for name in ("fold", "rotate"):
        assert options.FOLD in callbacks[name].option_sets, name
    shared = {p.name for p in options.FOLD.parameters}
    assert {"rtol", "max_shard_size", "allow_pickle", "check", "device"} <= shared
    rows = {
        name: dict(cli_options.rows(GROUP.commands[name], click.Context(GROUP.commands[name])))
        for name in ("fold", "rotate")
    }
    fold_rows = {
        k: v
        for k, v in rows["fold"].items()
        if k.split()[0].lstrip("-").replace("-", "_") in shared
    }
    assert len(fold_rows) == len(shared) and all(
        rows["rotate"][k] == v for k, v in fold_rows.items()
    )


def test_an_option_set_refuses_a_wrong_value_in_one_line(tmp_path):
    result = runner.invoke(
        app, ["fold", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "lots"]
    )
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "lots" in result.stderr, (
        result.stderr
    )
