"""The ``enjoyln`` typer app: the commands of ``commands``, each wrapped by ``render.friendly`` so
that any failure is one line and an exit code (0 ok, 1 check failed, 2 bad input)."""

from __future__ import annotations

import typer

from . import commands
from .render import friendly

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fold LayerNorm into RMSNorm with exactly the same outputs.")

for name, command in (("fold", commands.fold), ("rotate", commands.rotate), ("inspect", commands.inspect),
                      ("check", commands.check), ("demo", commands.demo), ("bench", commands.bench),
                      ("export", commands.export)):
    app.command(name)(friendly(command))
