"""Capture: trace a model into a ``torch.export`` graph (the ATen ops, not module boundaries) and
tie it back to the model: parameter names, tied parameters, module paths, output names."""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import CaptureError, first_line
from .inputs import ExampleInputs, Inputs, resolve_inputs


# --- the captured graph -----------------------------------------------------------


@dataclass
class Capture:
    """A traced model and the maps from its graph back to the model."""

    model: nn.Module
    program: torch.export.ExportedProgram
    placeholder_fqn: dict[
        str, str
    ]  # placeholder node name -> the parameter or saved buffer it holds
    constants: dict[str, str]  # placeholder node name -> a lifted constant or non-persistent buffer
    aliases: dict[
        str, tuple[str, ...]
    ]  # parameter name -> every name reaching the same tensor object
    output_names: list[str]
    specialized: list[str] = field(default_factory=list)
    """Branches ``draft_export`` took as the example's values dictated; empty when ``torch.export``
    traced it."""
    patched: bool = False
    """Traced under transformers' export patches (``transformers.exporters``)."""

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph

    def module_path(self, node: torch.fx.Node) -> str:
        stack = node.meta.get("nn_module_stack")
        return next(reversed(stack.values()))[0] if stack else ""

    def submodule(self, path: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return None

    def module_of(self, node: torch.fx.Node) -> nn.Module | None:
        return self.submodule(self.module_path(node))

    def where(self, node: torch.fx.Node) -> str:
        """A short phrase naming where a node sits, for messages."""
        path = self.module_path(node)
        return f"in {path}" if path else "at the top level of the model"

    def use_alias(self, user: torch.fx.Node, fqn: str) -> str | None:
        """The name ``user`` reads ``fqn`` by: tied parameters share one placeholder, the reading
        module tells which."""
        names = self.aliases.get(fqn, (fqn,))
        if len(names) == 1:
            return names[0]
        path = self.module_path(user)
        owned = [n for n in names if n.rpartition(".")[0] == path]
        return owned[0] if len(owned) == 1 else None


def _leaf_names(spec: pytree.TreeSpec, prefix: str = "") -> list[str]:
    if spec.is_leaf():
        return [prefix or "output"]
    keys = spec.context if isinstance(spec.context, (list, tuple)) else None
    names: list[str] = []
    # ``children()`` from torch 2.10; before, the ``children_specs`` field (deprecated since)
    for i, child in enumerate(
        spec.children() if hasattr(spec, "children") else spec.children_specs
    ):
        key = str(keys[i]) if keys is not None and i < len(keys) else str(i)
        names += _leaf_names(child, f"{prefix}.{key}" if prefix else key)
    return names


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_id.setdefault(id(t), []).append(name)
    return {n: tuple(names) for names in by_id.values() for n in names}


def _functional_twin(target: Any) -> Any:
    """aten.add_.Tensor -> aten.add.Tensor, or None."""
    schema = getattr(target, "_schema", None)
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    if schema is None or not schema.is_mutable or not name.endswith("_") or name.startswith("_"):
        return None
    twin = getattr(torch.ops.aten, name[:-1], None)
    return getattr(twin, target._overloadname, None) if twin is not None else None


def _is_view(node: torch.fx.Node) -> bool:
    if node.op == "placeholder" or node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _functionalize(graph: torch.fx.Graph) -> bool:
    """Rewrite ``x.add_(y)`` on graph intermediates as ``add(x, y)``, as the dataflow needs one
    value per node (Falcon's ``mlp += attn``). False, changing nothing, for a write to a view or
    an input."""
    inplace = [(n, _functional_twin(n.target)) for n in graph.nodes if n.op == "call_function"]
    inplace = [(n, twin) for n, twin in inplace if twin is not None]
    # the renaming cannot follow a write through a view, or to a tensor a view aliases
    if any(
        not isinstance(n.args[0], torch.fx.Node)
        or _is_view(n.args[0])
        or any(_is_view(u) for u in n.args[0].users if u is not n)
        for n, _ in inplace
    ):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node, twin in inplace:
        mutated = node.args[0]
        for user in list(mutated.users):
            if order[user] > order[node]:
                user.replace_input_with(mutated, node)
        node.target = twin
    return True


# --- tracing --------------------------------------------------------------------------


def _origin(exc: BaseException) -> str:
    """Where in the model's own code tracing stopped, as `` (at file:line: `code`)``, or ''."""
    skip = (
        os.path.dirname(torch.__file__),
        os.path.dirname(__file__),
        sysconfig.get_paths()["stdlib"],
        "<",
    )
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    frame = frames[-1]
    code = (frame.line or "").strip()
    where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
    return f" (at {where}" + (f": `{code[:100]}`)" if code else ")")


def _data_dependent(exc: BaseException) -> bool:
    """Did tracing stop at Python control flow on a tensor's values (``if mask.any():``)?"""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(
            exc,
            (
                GuardOnDataDependentSymNode,
                DataDependentOutputException,
                DynamicOutputShapeException,
            ),
        ) or "data-dependent" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def _no_partial_graph() -> Iterator[None]:
    """torch.export prints the code of the graph it had traced to stderr when it fails (hundreds of
    lines), even where the caller goes on to another way of tracing: what the block writes there
    is held back, dropped if it fails and passed on if it does not."""
    held = io.StringIO()
    with contextlib.redirect_stderr(held):
        yield
    sys.stderr.write(held.getvalue())


@contextlib.contextmanager
def _lean_trace() -> Iterator[None]:
    """torch.export without two costs nothing here needs, together about half its time on a
    transformer: the Python stack it records and symbolizes for every node (draft_export's report,
    which names the source of each specialization, keeps them), and the Python code it generates
    for the whole graph after each of its passes (made when the graph module is first called)."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", False)
    config.do_not_emit_stack_traces = True
    try:
        with _lazy_graph_modules():
            yield
    finally:
        config.do_not_emit_stack_traces = before


def _lazy_graph_modules() -> contextlib.AbstractContextManager[Any]:
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # a torch without it generates the code eagerly, as before
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def _quiet_logs(*names: str) -> Iterator[None]:
    """draft_export logs a banner and each specialization as warnings; the plan reports them."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _specializations(program: torch.export.ExportedProgram) -> list[str]:
    """One phrase per value-dependent decision in a draft_export report."""
    report = getattr(program, "_report", None)
    if report is None:
        return []
    # file names are interned process-wide, and only the first trace to meet one logs it
    from torch._logging.structured import INTERN_TABLE

    files = {**{i: f for f, i in INTERN_TABLE.items()}, **getattr(report, "str_to_filename", {})}
    out: list[str] = []
    for failure in report.failures:
        data, kind = failure.data, str(failure.failure_type)
        if kind in ("MISSING_FAKE_KERNEL", "MISMATCHED_FAKE_KERNEL"):
            out.append(
                f"the custom op {data.get('op')} has no exact shape rule, so its output shapes "
                "are those of the example"
            )
            continue
        frame = (data.get("user_stack") or [{}])[-1]
        where = files.get(frame.get("filename"), "?").split("site-packages/")[-1]
        code = frame.get("loc") or data.get("expr", "?")
        phrase = (
            f"`{code}` ({where}:{frame.get('line', '?')}) as on the example "
            f"({data.get('expr')} = {data.get('result')})"
        )
        if phrase not in out:
            out.append(phrase)
    return out


@contextlib.contextmanager
def _export_patches(model: nn.Module) -> Iterator[bool]:
    """transformers' own patches for ``torch.export`` (``transformers.exporters``: a packed vision
    attention over equal-length images in ops it can follow, in place of a split by lengths read
    from the grids), installed for the block; yields False, installing nothing, where this
    transformers has none or ``model`` is not one of its models."""
    try:
        from transformers import PreTrainedModel
        from transformers.exporters import exporter_dynamo  # noqa: F401 - registers the patches
        from transformers.exporters.utils import apply_patches
    except ImportError:
        yield False
        return
    if not isinstance(model, PreTrainedModel):
        yield False
        return
    with apply_patches("dynamo"):
        yield True


def _export_patched(model: nn.Module, inputs: Inputs) -> torch.export.ExportedProgram | None:
    """``torch.export`` under transformers' export patches; None where there are none, or it
    still stops at control flow on data."""
    with _export_patches(model) as patched:
        if not patched:
            return None
        try:
            with torch.no_grad(), _no_partial_graph(), _lean_trace():
                return torch.export.export(model, inputs.args, inputs.kwargs, strict=False)
        except Exception as exc:  # noqa: BLE001 - draft_export is tried next, or it is reported
            if _data_dependent(exc):
                return None
            raise


def export(
    model: nn.Module, inputs: Inputs
) -> tuple[torch.export.ExportedProgram, list[str], bool]:
    """``torch.export`` (non-strict); where control flow depends on data, ``torch.export`` again
    under transformers' export patches, then ``draft_export``; also the branches ``draft_export``
    fixed to the example's values, and whether the patches were on. Either failure is a one-line
    CaptureError."""
    name = type(model).__name__
    try:
        with torch.no_grad(), _no_partial_graph(), _lean_trace():
            return torch.export.export(model, inputs.args, inputs.kwargs, strict=False), [], False
    except Exception as exc:  # export raises many unrelated types
        if not _data_dependent(exc):
            raise CaptureError(
                f"torch.export could not trace {name}: {type(exc).__name__}: "
                f"{first_line(exc)}{_origin(exc)}"
            ) from exc
        first = exc
    try:
        program = _export_patched(model, inputs)
    except Exception as exc:  # noqa: BLE001 - reported with the first failure
        raise CaptureError(
            f"torch.export could not trace {name}: {type(first).__name__}: {first_line(first)}"
            f"{_origin(first)}; under transformers' export patches: {type(exc).__name__}: "
            f"{first_line(exc)}{_origin(exc)}"
        ) from exc
    if program is not None:
        return program, [], True
    try:
        with torch.no_grad(), _quiet_logs("torch.export", "torch.fx.experimental.symbolic_shapes"):
            program = torch.export.draft_export(model, inputs.args, inputs.kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - reported with the first failure
        raise CaptureError(
            f"torch.export could not trace {name}: {type(first).__name__}: {first_line(first)}"
            f"{_origin(first)}; draft_export, which fixes such branches to the example's values, "
            "also "
            f"failed: {type(exc).__name__}: {first_line(exc)}{_origin(exc)}"
        ) from exc
    return program, _specializations(program), False


def capture(model: nn.Module, example_inputs: ExampleInputs = None) -> Capture:
    """Trace ``model`` as it is (in training mode its dropout blocks folding) and index the graph;
    where control flow depends on tensor values, ``draft_export`` takes the example's branches.
    >>> import torch
    >>> cap = capture(torch.nn.Linear(4, 4), torch.randn(2, 4))
    >>> sorted(cap.placeholder_fqn.values())
    ['bias', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    inputs = resolve_inputs(model, example_inputs)
    program, specialized, patched = export(model, inputs)
    if not _functionalize(program.graph):
        try:
            program = program.run_decompositions({})
        except (
            Exception
        ) as exc:  # retracing a draft_export program can disagree with the example's values
            raise CaptureError(
                f"torch.export could not functionalize the graph of {type(model).__name__}: "
                f"{type(exc).__name__}: {first_line(exc)}"
            ) from exc
    sig = program.graph_signature
    persistent = set(program.state_dict)
    placeholder_fqn: dict[str, str] = dict(sig.inputs_to_parameters)
    constants: dict[str, str] = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}))
    for node_name, fqn in sig.inputs_to_buffers.items():
        (placeholder_fqn if fqn in persistent else constants)[node_name] = fqn
    out_spec = program.call_spec.out_spec
    output_names = _leaf_names(out_spec) if out_spec is not None else []
    return Capture(
        model=model,
        program=program,
        placeholder_fqn=placeholder_fqn,
        constants=constants,
        aliases=_aliases(model),
        output_names=output_names,
        specialized=specialized,
        patched=patched,
    )
