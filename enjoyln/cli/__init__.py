"""The ``enjoyln`` command line: a thin typer layer over the Python API.

``app`` (the typer app), ``commands`` (one short function per command), ``options``
(the options commands share, declared once) and ``render`` (what gets printed).
"""
