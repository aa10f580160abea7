"""Observing what a user gets from a directory: every loader run on seeded inputs and
fingerprinted bit for bit, and the differences between two observations."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch

from enjoyln.errors import first_line
from .sources import Source, tensor_bits


_TEXTS = [
    "hello world",
    "the quick brown fox",
    "xin chào thế giới",
    "\U0001f600 \U0001f44d!",
    "<|endoftext|> a",
]


def _inputs(source: Source) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    if source.kind == "image":
        size = 16
        return [{"pixel_values": torch.randn(b, 3, size, size, generator=gen)} for b in (1, 2)]
    return [
        {"input_ids": torch.randint(0, 128, (b, t), generator=gen)}
        for b, t in ((1, 5), (2, 16), (1, 1))
    ]


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensor_bits(tensors[name]))
    return h.hexdigest()[:16]


def _attempt(fn: Callable[[], Any], directory: Path) -> Any:
    try:
        return fn()
    except Exception as exc:  # a loader that fails is an observation too
        first = first_line(exc, "").replace(str(directory), "<dir>")
        return f"error: {type(exc).__name__}: {first[:200]}"


def _outputs(model: Any, source: Source, inputs: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    obs: dict[str, Any] = {}
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for i, batch in enumerate(inputs):
            out = model(
                **{k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
            )
            tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
            obs[f"outputs[{i}]"] = tensors
        if source.kind == "lm":
            torch.manual_seed(0)  # a sampling config then samples the same way on both
            obs["generate"] = model.generate(
                inputs[0]["input_ids"],
                max_new_tokens=6,
                attention_mask=torch.ones_like(inputs[0]["input_ids"]),
            ).tolist()
    return obs


def observe(directory: str | os.PathLike, source: Source) -> dict[str, Any]:
    """What a user gets from ``directory``, bit for bit: the config transformers builds, the state
    dict and outputs (and greedy or configured generation) of ``from_pretrained`` and of
    ``enjoyln.load`` on seeded inputs, the tokenizer's ids for a few texts, the image
    processor's pixels. A loader that fails is recorded with its error."""
    import transformers

    from enjoyln.store.load import load

    root = Path(directory)
    obs: dict[str, Any] = {}
    obs["config"] = _attempt(lambda: _config_as_loaded_dir(root), root)
    obs["enjoyln.load:plan"] = _attempt(lambda: _plan_as_loaded(root), root)
    cls = getattr(transformers, source.architecture)
    for loader, make in (
        ("from_pretrained", lambda: cls.from_pretrained(root)),
        ("enjoyln.load", lambda: load(root)),
    ):
        # a parameter the checkpoint lacks is drawn from torch's generator on every load: seeded, it
        # is the same draw in two loads of the same files, and only a change of the files shows
        torch.manual_seed(0)
        model = _attempt(lambda: make().eval(), root)
        if isinstance(model, str):
            obs[loader] = model
            continue
        # transformers 5 computes on tensors mapped from the file, and a float32 matmul's last
        # bit can depend on its operands' alignment, that is, on where a tensor sits in the
        # file. What a checkpoint computes is a function of its values: fresh copies.
        for t in (*model.parameters(), *model.buffers()):
            t.data = t.data.clone()
        obs[f"{loader}:dtype"] = str(next(model.parameters()).dtype)
        obs[f"{loader}:state"] = _digest(model.state_dict())
        if source.kind == "lm":
            obs[f"{loader}:generation_config"] = json.dumps(
                model.generation_config.to_dict(), sort_keys=True, default=str
            )
        outputs = _attempt(lambda: _outputs(model, source, _inputs(source)), root)
        if isinstance(outputs, str):
            obs[f"{loader}:outputs"] = outputs
            continue
        for k, v in outputs.items():
            obs[f"{loader}:{k}"] = v
    if source.kind == "image":

        def pixels() -> str:
            proc = transformers.AutoImageProcessor.from_pretrained(root)
            image = torch.Generator().manual_seed(0)
            img = (torch.rand(20, 24, 3, generator=image) * 255).to(torch.uint8).numpy()
            pixels = _digest(
                {"pixel_values": proc(images=img, return_tensors="pt")["pixel_values"]}
            )
            return json.dumps([pixels, proc.to_dict()], sort_keys=True, default=str)

        obs["image_processor"] = _attempt(pixels, root)
    else:
        obs["tokenizer"] = _attempt(
            lambda: _tokenizer_state(transformers.AutoTokenizer.from_pretrained(root), root), root
        )
    return obs


def _tokenizer_state(tok: Any, root: Path) -> str:
    """Everything a loaded tokenizer holds that decides its ids, as text: its encodings of a few
    texts, its vocabulary and special tokens, its init arguments, the whole of a fast
    tokenizer's pipeline, and a slow tokenizer's plain-data attributes (PhoBERT's BPE ranks,
    GPT-NeoX-Japanese's emoji table)."""
    state: dict[str, Any] = {
        "class": type(tok).__name__,
        "ids": [tok(t)["input_ids"] for t in _TEXTS],
        "vocab": sorted(tok.get_vocab().items()),
        "special": tok.all_special_tokens,
        "init": tok.init_kwargs,
    }
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        state["pipeline"] = backend.to_str()
    else:
        state["attributes"] = {
            k: v
            for k, v in vars(tok).items()
            if isinstance(v, (dict, list, tuple, str, int, float, bool)) and not k.startswith("_")
        }
    return json.dumps(_plain(state), sort_keys=True, default=str).replace(str(root), "<dir>")


def _plain(o: Any) -> Any:
    """``o`` with every mapping as a sorted list of pairs (PhoBERT's BPE ranks are keyed by
    tuples)."""
    if isinstance(o, dict):
        return sorted(([repr(k), _plain(v)] for k, v in o.items()), key=lambda kv: kv[0])
    return [_plain(v) for v in o] if isinstance(o, (list, tuple)) else o


def _config_as_loaded_dir(root: Path) -> Any:
    import transformers

    d = transformers.AutoConfig.from_pretrained(root).to_dict()
    # transformers keeps the enjoyln block as an attribute it never uses: observed apart, as
    # the plan enjoyln.load reads
    for k in ("transformers_version", "_name_or_path", "enjoyln"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str)


def _plan_as_loaded(root: Path) -> str:
    """The fold plan ``enjoyln.load`` reads from the ``enjoyln`` block (None without one)."""
    from enjoyln.store.checkpoint import open_checkpoint

    plan = open_checkpoint(root).recorded_plan
    return json.dumps(plan.to_dict() if plan is not None else None, sort_keys=True)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return tensor_bits(a) == tensor_bits(b)
    return type(a) is type(b) and a == b


def differences(base: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """What ``other`` computes differently from ``base`` (two :func:`observe` results); empty
    when the two are the same bit for bit."""
    out = []
    for key in sorted(base.keys() | other.keys()):
        a, b = base.get(key), other.get(key)
        if _same(a, b):
            continue
        tensors = (
            isinstance(a, dict)
            and isinstance(b, dict)
            and all(isinstance(v, torch.Tensor) for v in (*a.values(), *b.values()))
        )
        if tensors:
            parts = []
            for name in sorted(a.keys() & b.keys()):
                x, y = a[name].double(), b[name].double()
                if x.shape != y.shape:
                    parts.append(f"{name} shape {list(x.shape)} -> {list(y.shape)}")
                elif tensor_bits(a[name]) != tensor_bits(b[name]):
                    nonfinite = int((~torch.isfinite(y) & torch.isfinite(x)).sum())
                    diff = float((x - y).abs().nan_to_num(math.inf).max()) if x.numel() else 0.0
                    parts.append(
                        f"{name} max abs diff {diff:.3g}"
                        + (f", {nonfinite} non-finite" if nonfinite else "")
                    )
            out.append(f"{key}: {'; '.join(parts) or 'other outputs'}")
        elif (
            key in ("config", "enjoyln.load:plan")
            and isinstance(a, str)
            and isinstance(b, str)
            and a.startswith("{")
            and b.startswith("{")
        ):
            x, y = json.loads(a), json.loads(b)
            keys = sorted(
                k for k in x.keys() | y.keys() if json.dumps(x.get(k)) != json.dumps(y.get(k))
            )
            out.append(
                f"{key}: "
                + ", ".join(
                    f"{k} {_short(x.get(k, '(absent)'))} -> {_short(y.get(k, '(absent)'))}"
                    for k in keys[:4]
                )
            )
        elif (
            key == "tokenizer"
            and isinstance(a, str)
            and isinstance(b, str)
            and a.startswith("[")
            and b.startswith("[")
        ):
            x, y = (
                dict(map(tuple, json.loads(a))),
                dict(map(tuple, json.loads(b))),
            )  # _plain's pairs
            keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
            out.append(f"tokenizer: its {', '.join(k.strip(chr(39)) for k in keys)} differ")
        else:
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
