"""Every command's arguments and options, as ``-h`` shows them, for docs/cli.md.

The table of each command is built from the same help records click prints for ``-h`` (names,
the kind of value, the help text with its default and range), so the page cannot drift from the
command line: tests/scripts/test_cli_options.py fails when the block differs from what this
script writes. Run with --write to update the ``cli-options`` block in docs/cli.md.

    python scripts/cli_options.py [--write]
"""

from __future__ import annotations

import argparse
import sys

import click
import typer

from enjoyln.cli.app import app

ORDER = ("inspect", "fold", "rotate", "check", "export", "bench", "demo", "env")


def description(command: click.Command) -> str:
    """The first paragraph of a command's help, on one line (its example stays in ``-h``)."""
    return " ".join((command.help or "").split("\n\n")[0].split())


def rows(command: click.Command, ctx: click.Context) -> list[tuple[str, str]]:
    """(names and value, help with its default and range) of each parameter, as ``-h`` prints
    them."""
    found = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            found.append((record[0], " ".join(record[1].split())))
    return found


def markdown() -> str:
    """The ``cli-options`` block: one heading, description and table for each command."""
    group = typer.main.get_command(app)
    parts = []
    with click.Context(group, info_name="enjoyln", **group.context_settings) as root:
        for name in ORDER:
            command = group.commands[name]  # type: ignore[attr-defined]
            with click.Context(command, info_name=name, parent=root) as ctx:
                lines = [
                    f"### enjoyln {name}",
                    "",
                    description(command),
                    "",
                    "| argument or option | what it does |",
                    "|---|---|",
                ]
                lines += [
                    f"| `{names}` | {text.replace('|', chr(92) + '|')} |"
                    for names, text in rows(command, ctx)
                ]
            parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="put the tables into docs/cli.md")
    args = parser.parse_args()
    text = markdown()
    print(text)
    if args.write:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from _docs import replace_section

        print(f"wrote {replace_section('cli-options', text)}")


if __name__ == "__main__":
    main()
