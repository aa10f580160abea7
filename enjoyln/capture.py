"""Capture: trace a model into a ``torch.export`` graph and index it.

The analysis never looks at module boundaries, only at the traced ATen graph
: in-place adds, functional ``layer_norm`` calls and parameters
used as data are all visible there. This module owns everything that ties the
graph back to the model: parameter names, tied parameters, module paths and the
names of the model's outputs.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import CaptureError

ExampleInputs = Any
"""A tensor, a tuple of positional arguments, or a dict of keyword arguments."""


@dataclass
class Inputs:
    """Positional and keyword arguments for one call of the model."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def call(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        return [t for t in leaves if isinstance(t, torch.Tensor)]


def as_inputs(example_inputs: ExampleInputs) -> Inputs:
    """Normalise what a user passes as example inputs."""
    if isinstance(example_inputs, Inputs):
        return example_inputs
    if isinstance(example_inputs, torch.Tensor):
        return Inputs((example_inputs,), {})
    if isinstance(example_inputs, Mapping):
        return Inputs((), dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return Inputs(tuple(example_inputs), {})
    raise CaptureError(
        f"example_inputs must be a tensor, a tuple of tensors or a dict of keyword "
        f"arguments, not {type(example_inputs).__name__}"
    )


# --- Hugging Face input synthesis ------------------------------------------------

_SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def config_value(config: Any, *names: str) -> Any:
    """The first of ``names`` set on ``config`` or one of its sub-configs."""
    for cfg in (config, *(getattr(config, s, None) for s in _SUBCONFIGS)):
        if cfg is None:
            continue
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return None


def is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel)


def is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only model that can ``generate()``."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate and can_generate())


def hf_example_inputs(
    model: nn.Module, *, batch: int = 2, seq_len: int = 16, seed: int = 0
) -> dict[str, Any]:
    """Synthesize keyword inputs for a Hugging Face model from its config.

    Token ids, pixel values or audio features are chosen by what ``forward``
    accepts; encoder-decoders also get ``decoder_input_ids``; causal LMs get
    ``use_cache=False`` so the traced graph has no cache outputs.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> sorted(hf_example_inputs(GPT2LMHeadModel(GPT2Config(n_layer=1))))
    ['input_ids', 'use_cache']
    """
    config = model.config
    params = inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # a model dispatched by accelerate keeps offloaded parameters on meta but runs on the CPU
    device = (torch.device("cpu") if getattr(model, "hf_device_map", None)
              else next((p.device for p in model.parameters()), torch.device("cpu")))
    max_pos = config_value(config, "max_position_embeddings", "n_positions", "max_target_positions")
    seq = min(seq_len, max_pos) if isinstance(max_pos, int) and max_pos > 0 else seq_len
    out: dict[str, Any] = {}

    def ids(length: int) -> torch.Tensor:
        vocab = config_value(config, "vocab_size")
        return torch.randint(0, int(vocab), (batch, length), generator=gen).to(device)

    if "input_ids" in params and config_value(config, "vocab_size"):
        out["input_ids"] = ids(seq)
    if "pixel_values" in params and config_value(config, "image_size"):
        size = config_value(config, "image_size")
        size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        channels = config_value(config, "num_channels") or 3
        out["pixel_values"] = torch.randn((batch, channels, *size), generator=gen).to(device, dtype)
    if "input_features" in params and config_value(config, "num_mel_bins"):
        mels = config_value(config, "num_mel_bins")
        frames = 2 * (config_value(config, "max_source_positions") or 1500)
        out["input_features"] = torch.randn((batch, mels, frames), generator=gen).to(device, dtype)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        dec_max = config_value(config, "max_target_positions") or seq
        out["decoder_input_ids"] = ids(min(seq, dec_max))
    if not out:
        raise CaptureError(
            f"cannot build example inputs for {type(model).__name__} from its config; "
            "pass example_inputs explicitly"
        )
    if "use_cache" in params:
        out["use_cache"] = False
    return out


def resolve_inputs(model: nn.Module, example_inputs: ExampleInputs = None, *, seed: int = 0) -> Inputs:
    """The user's example inputs, or inputs synthesized for a Hugging Face model."""
    if example_inputs is not None:
        inputs = as_inputs(example_inputs)
        if is_hf_model(model) and "use_cache" in inspect.signature(model.forward).parameters:
            inputs.kwargs.setdefault("use_cache", False)
        return inputs
    if is_hf_model(model):
        return Inputs((), hf_example_inputs(model, seed=seed))
    raise CaptureError(
        f"{type(model).__name__} is not a Hugging Face model, so enjoyln cannot invent "
        "its inputs; pass example_inputs (a tensor, a tuple or a dict of keyword arguments)"
    )


# --- the captured graph -----------------------------------------------------------


@dataclass
class Capture:
    """A traced model and the maps from its graph back to the model."""

    model: nn.Module
    program: torch.export.ExportedProgram
    inputs: Inputs
    placeholder_fqn: dict[str, str]
    """Placeholder node name -> name of the parameter or saved buffer it holds."""
    constants: dict[str, str]
    """Placeholder node name -> name of a lifted constant or non-persistent buffer."""
    aliases: dict[str, tuple[str, ...]]
    """Parameter name -> every name under which the same tensor object is reachable."""
    output_names: list[str]

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph

    def module_path(self, node: torch.fx.Node) -> str:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return ""
        return next(reversed(stack.values()))[0]

    def module_of(self, node: torch.fx.Node) -> nn.Module | None:
        try:
            return self.model.get_submodule(self.module_path(node))
        except AttributeError:
            return None

    def where(self, node: torch.fx.Node) -> str:
        """A short phrase naming where a node sits, for messages."""
        path = self.module_path(node)
        return f"in {path}" if path else "at the top level of the model"

    def use_alias(self, user: torch.fx.Node, fqn: str) -> str | None:
        """The name under which ``user`` reads the parameter ``fqn``.

        Tied parameters share one placeholder in the graph; the module that
        performs the read tells which of the tied names it went through.
        """
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
    for i, child in enumerate(spec.children()):
        key = str(keys[i]) if keys is not None and i < len(keys) else str(i)
        names += _leaf_names(child, f"{prefix}.{key}" if prefix else key)
    return names


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
    return {n: tuple(names) for names in by_id.values() for n in names}


def _functional_twin(target: Any) -> Any:
    """aten.add_.Tensor -> aten.add.Tensor, or None."""
    schema = getattr(target, "_schema", None)
    packet = getattr(target, "overloadpacket", None)
    if schema is None or packet is None or not schema.is_mutable:
        return None
    name = packet.__name__
    if not name.endswith("_") or name.startswith("_"):
        return None
    twin = getattr(torch.ops.aten, name[:-1], None)
    return getattr(twin, target._overloadname, None) if twin is not None else None


def _is_view(node: torch.fx.Node) -> bool:
    if node.op == "placeholder" or node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _functionalize(graph: torch.fx.Graph) -> bool:
    """Rewrite ``x.add_(y)`` on graph intermediates as ``add(x, y)``.

    torch.export's training IR keeps in-place ops (Falcon's ``mlp += attn``);
    the dataflow needs one value per node. Later readers of the mutated tensor
    are pointed at the new node. Returns False, changing nothing, when an
    in-place op writes to a view or an input, which this cannot follow.
    """
    inplace = [(n, _functional_twin(n.target)) for n in graph.nodes if n.op == "call_function"]
    inplace = [(n, twin) for n, twin in inplace if twin is not None]
    # A write through a view, or to a tensor some view aliases, reaches values
    # this renaming cannot follow; the caller functionalises properly instead.
    if any(not isinstance(n.args[0], torch.fx.Node) or _is_view(n.args[0])
           or any(_is_view(u) for u in n.args[0].users if u is not n) for n, _ in inplace):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node, twin in inplace:
        mutated = node.args[0]
        for user in list(mutated.users):
            if order[user] > order[node]:
                user.replace_input_with(mutated, node)
        node.target = twin
    return True


def capture(model: nn.Module, example_inputs: ExampleInputs = None) -> Capture:
    """Trace ``model`` with ``torch.export`` (non-strict) and index the graph.

    The model is traced in the mode it is in: a model left in training mode
    keeps its dropout, and the analysis refuses to fold through it.

    >>> import torch
    >>> cap = capture(torch.nn.Linear(4, 4), torch.randn(2, 4))
    >>> sorted(cap.placeholder_fqn.values())
    ['bias', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    inputs = resolve_inputs(model, example_inputs)
    try:
        with torch.no_grad():
            program = torch.export.export(model, inputs.args, inputs.kwargs, strict=False)
    except Exception as exc:  # export raises many unrelated types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CaptureError(
            f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {first}"
        ) from exc

    if not _functionalize(program.graph):
        program = program.run_decompositions({})
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
        inputs=inputs,
        placeholder_fqn=placeholder_fqn,
        constants=constants,
        aliases=_aliases(model),
        output_names=output_names,
    )
