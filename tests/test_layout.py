"""The guard of the package layout (docs/contributing.md): imports point one way, no cycles,
modules and functions of a readable size, and no private name used across modules.

Read with ``ast`` from the source, function-level imports included, so an import moved into
a function to dodge a cycle is still seen.
"""

from __future__ import annotations

import ast
import importlib
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "enjoyln"

LAYERS = {
    "enjoyln._version": 0,
    "enjoyln.compat": 0,
    "enjoyln.errors": 0,
    "enjoyln.units": 0,
    "enjoyln.plan": 0,
    "enjoyln.options": 0,
    "enjoyln.timings": 0,
    "enjoyln.ops": 1,
    "enjoyln.modules": 2,
    "enjoyln.analysis": 3,
    "enjoyln.transform": 4,
    "enjoyln.store": 5,
    "enjoyln.folded": 6,  # what the fold of a checkpoint must be: its plan, its config, its tensors
    "enjoyln.checking": 7,  # the gate, which holds a candidate to what folded/ says it must be
    # the fold itself: entries, writer and the fold, which checks before publishing
    "enjoyln.rewrite": 8,
    "enjoyln.export": 9,
    "enjoyln.bench": 10,
    "enjoyln.bench_compiled": 10,
    "enjoyln.testing": 10,
    "enjoyln.sentence": 10,
    "enjoyln.cli": 11,
    "enjoyln.__main__": 13,
    "enjoyln": 13,  # the entry point, and the lazy top-level API
}
"""Lowest first; a module may import from its own layer or lower ones. Every package sits on one
layer: a module's layer is its package's (or its own, for a module at the top)."""

MAX_LINES = 480
MAX_FUNCTION_LINES = 70
"""Sizes in rows a reader reads (``read_rows``), which a formatter's wrapping at 100 columns does
not change: about what 600 and 80 lines were when the code ran to 120 columns."""
MAX_PARAMETERS = 8


def read_rows(source: str) -> set[int]:
    """The rows that start a statement, hold a comment, or lie in a string of several lines (a
    docstring): not the rows a long call or expression is wrapped onto."""
    rows: set[int] = set()
    starts = True
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NEWLINE:
            starts = True
        elif token.type == tokenize.COMMENT:
            rows.add(token.start[0])
        elif token.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            if starts:
                rows.add(token.start[0])
                starts = False
            if token.type == tokenize.STRING and token.end[0] > token.start[0]:
                rows.update(range(token.start[0], token.end[0] + 1))
    return rows


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[".".join(parts[:2])]


def imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every enjoyln import in ``module``,
    at any depth; ``from . import x`` names module ``x`` where there is one."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text())
    # imports for annotations only never run, so they make no dependency (nor a cycle)
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If)
        and isinstance(block.test, ast.Name)
        and block.test.id == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [
                (a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "enjoyln"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "enjoyln":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append(
                    (sub, None, node.lineno) if sub in MODULES else (target, a.name, node.lineno)
                )
    return found


def test_every_module_imports():
    for module in MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:  # an optional dependency (triton, onnx) not installed
            if exc.name.split(".")[0] not in (
                "triton",
                "onnx",
                "onnxruntime",
                "onnxscript",
                "matplotlib",
            ):
                raise


def test_every_package_sits_on_one_layer():
    """The layer table names top-level modules and packages only: no module of a package gets a
    layer of its own, and none is left out."""
    top = {".".join(m.split(".")[:2]) for m in MODULES}
    assert all(name.count(".") <= 1 for name in LAYERS), sorted(
        n for n in LAYERS if n.count(".") > 1
    )
    assert top == set(LAYERS), (sorted(top - set(LAYERS)), sorted(set(LAYERS) - top))


def test_the_gate_imports_nothing_of_the_fold():
    """checking/ holds a candidate to what folded/ says it must be; it never reads the writer's
    code."""
    found = [
        f"{m}:{line} imports {t}"
        for m in MODULES
        if m.startswith("enjoyln.checking")
        for t, _, line in imports(m)
        if t == "enjoyln.rewrite" or t.startswith("enjoyln.rewrite.")
    ]
    assert not found, found


def test_imports_point_down():
    upward = [
        f"{m}:{line} imports {t} (layer {layer(m)} -> {layer(t)})"
        for m in MODULES
        for t, _, line in imports(m)
        if t in MODULES and layer(t) > layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = {m: {t for t, _, _ in imports(m) if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t) :] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m)


def test_modules_are_short():
    long = {m: n for m, p in MODULES.items() if (n := len(read_rows(p.read_text()))) > MAX_LINES}
    assert not long, long


def _typer_options() -> set[str]:
    """The names ``enjoyln/cli/options.py`` gives shared typer options (``ReadPickle =
    Annotated[...]``)."""
    tree = ast.parse(MODULES["enjoyln.cli.options"].read_text())
    return {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.value).startswith("Annotated[")
        for t in n.targets
        if isinstance(t, ast.Name)
    }


def _exempt(module: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A ``@triton.jit`` kernel is one GPU program whose parameters are its launch signature, shared
    by the three kernels and the AOT builder; a typer command of the CLI takes a parameter per
    option (``Annotated[..., typer.Option(...)]``), as typer reads the options from its
    signature."""
    names = {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in fn.decorator_list}
    annotations = [
        ast.unparse(a.annotation) for a in fn.args.args + fn.args.kwonlyargs if a.annotation
    ]
    return "triton.jit" in names or (
        module.startswith("enjoyln.cli")
        and any(a.startswith("Annotated[") or a in _typer_options() for a in annotations)
    )


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args
    named = [
        a.arg
        for a in args.posonlyargs + args.args + args.kwonlyargs
        if a.arg not in ("self", "cls")
    ]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def test_functions_are_short():
    """No function over ``MAX_FUNCTION_LINES`` rows (``read_rows``, its decorators to its last line)
    nor with more than ``MAX_PARAMETERS`` parameters (``*args`` and ``**kwargs`` one each; not self
    or cls)."""
    found = []
    for m, p in MODULES.items():
        source = p.read_text()
        rows = read_rows(source)
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _exempt(m, fn):
                continue
            first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
            n = sum(1 for row in rows if first <= row <= fn.end_lineno)
            if n > MAX_FUNCTION_LINES:
                found.append(f"{m}.{fn.name}:{fn.lineno} has {n} rows")
            if _parameters(fn) > MAX_PARAMETERS:
                found.append(f"{m}.{fn.name}:{fn.lineno} takes {_parameters(fn)} parameters")
    assert not found, "\n".join(found)


def test_no_private_name_crosses_modules():
    crossing = {
        (m, t, name)
        for m in MODULES
        for t, name, _ in imports(m)
        if name and name.startswith("_") and not name.startswith("__") and t != m
    }
    assert not crossing, sorted(crossing)


def test_no_module_re_exports_another_modules_names():
    """Each public name is importable from one module (and the lazy top-level ``enjoyln``): an
    ``__all__`` lists only what its module defines."""
    found = []
    for m, p in MODULES.items():
        if m == "enjoyln":
            continue
        tree = ast.parse(p.read_text())
        exported = next(
            (
                ast.literal_eval(n.value)
                for n in tree.body
                if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
            ),
            [],
        )
        imported = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }
        found += [f"{m} re-exports {name}" for name in exported if name in imported]
    assert not found, found


def test_scripts_hold_only_code():
    """Results and baselines are data: they live in docs/data/, so scripts/ reads as code alone."""
    scripts = PACKAGE.parent / "scripts"
    data = sorted(p.name for p in scripts.iterdir() if p.is_file() and p.suffix != ".py")
    assert not data, data
