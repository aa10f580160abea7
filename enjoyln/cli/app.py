"""The ``enjoyln`` typer app: each command wrapped by ``failures.friendly``; ``-h``,
``--version``."""

from __future__ import annotations

import typing
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from .._version import __version__
from . import commands, tools
from .failures import NoArgsIsHelpError, UsageError, friendly, usage_error
from .render import state


class _FlagHelp:
    """``--help`` shown with no type after it (typer writes ``<bool>``)."""

    def get_help_option(self, ctx: Any) -> Optional[TyperOption]:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


def _metavar(param: TyperOption) -> str:
    """What an option's value is, in the words docs/cli.md uses: N, X, PATH or TEXT (typer writes
    ``<int range>``)."""
    descriptor = param.type_descriptor
    kinds = {
        descriptor.annotation,
        *typing.get_args(descriptor.annotation),
    }  # Optional[int] is int or None
    if descriptor.is_path:
        return "PATH"
    return "N" if int in kinds else "X" if float in kinds else "TEXT"


class _Argument(TyperArgument):
    """An argument listed by its name alone: ``MODEL_DIR``, not ``MODEL_DIR <str>``."""

    def display_type_rich(self, ctx: Any) -> Optional[str]:
        return None


class Command(_FlagHelp, TyperCommand):
    """Usage reads ``[OPTIONS] MODEL_DIR OUT_DIR`` (typer writes ``{model_dir} {out_dir}``); no type
    after a flag.

    Each command's line in ``enjoyln -h`` is the first sentence of its help, whole (click cuts it
    with ``...``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, TyperArgument):
                param.__class__ = _Argument  # typer builds its own; this one only shows less in -h
                param.metavar = param.metavar or (param.name or "").upper()
            elif isinstance(param, TyperOption):
                param.metavar = "" if param.is_flag else _metavar(param)

    def get_short_help_str(self, limit: int = 45) -> str:
        first = " ".join((self.help or "").split("\n\n")[0].split())
        return first if first.endswith(".") else first + "."

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return (
            [self.options_metavar] if self.options_metavar else []
        ) + [  # each argument's metavar set above
            p.metavar if p.required or p.metavar.startswith("[") else f"[{p.metavar}]"
            for p in self.get_params(ctx)
            if isinstance(p, TyperArgument)
        ]


class Group(_FlagHelp, TyperGroup):
    """click's usage errors in one line (``failures.usage_error``); the program is ``enjoyln``
    however started."""

    def main(self, args: Any = None, prog_name: Optional[str] = None, **extra: Any) -> Any:
        import sys

        args = list(sys.argv[1:] if args is None else args)
        extra.pop("standalone_mode", None)
        # a fresh command: nothing printed yet (a test may run several in one process)
        state.begin()
        try:
            code = super().main(args=args, prog_name="enjoyln", standalone_mode=False, **extra)
        except NoArgsIsHelpError as exc:
            typer.echo(exc.ctx.get_help() if exc.ctx is not None else "")
            code = 2
        except UsageError as exc:
            code = usage_error(exc, args)
        except typer.Abort:
            typer.echo("aborted", err=True)
            code = 1
        sys.exit(code if isinstance(code, int) else 0)


# click's plain help (rich_markup_mode=None): rich's panels cut option names (--trust-remote-co…) at
# 80 columns
app = typer.Typer(
    cls=Group,
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)  # its help: main's docstring


def _version(value: bool) -> None:
    if value:
        print(f"enjoyln {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Fold LayerNorm into RMSNorm with exactly the same outputs."""


for name, command in (
    ("fold", commands.fold),
    ("rotate", commands.rotate),
    ("inspect", commands.inspect),
    ("check", commands.check),
    ("demo", tools.demo),
    ("bench", tools.bench),
    ("export", commands.export),
    ("env", tools.env),
):
    app.command(name, cls=Command)(friendly(command))
