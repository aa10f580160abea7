"""Drawing seeded mutations of the sources' folds, per category (weights, the weight file,
config.json, the enjoyln block, other files, extra or missing files, inert changes)."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from .applying import Mutation, b64, header_bytes
from .gate_inputs import GATE_INPUT_CATEGORIES, draw_gate_input
from .json_edits import edit_json, json_style, same_tokens
from .sources import (
    SAFETENSORS_DTYPES,
    Source,
    Survey,
    config_as_loaded,
    quiet,
    read_header,
    sentencepiece_model,
    survey,
    weight_files,
)


ELEMENT_KINDS = (
    "nan",
    "+inf",
    "-inf",
    "+0",
    "-0",
    "denormal",
    "ulp+",
    "ulp-",
    "rel+1e-3",
    "rel-1e-3",
)
"""What a weight mutation sets one element to (or how it moves it)."""


def _element_value(rng: random.Random, kind: str, old: torch.Tensor) -> torch.Tensor | None:
    """The new value of one element (a 1-element tensor of its dtype), or None if the kind
    does not apply to it."""
    dt = old.dtype
    if not dt.is_floating_point:
        return (~old if dt == torch.bool else old + 1) if kind in ("ulp+", "rel+1e-3") else None
    x = old.double()
    if kind == "nan":
        return torch.full((1,), math.copysign(math.nan, rng.choice((1, -1))), dtype=dt)
    if kind in ("+inf", "-inf"):
        return torch.full((1,), math.inf if kind == "+inf" else -math.inf, dtype=dt)
    if kind in ("+0", "-0"):
        return torch.full((1,), 0.0 if kind == "+0" else -0.0, dtype=dt)
    if kind == "denormal":
        info = torch.finfo(dt)
        smallest = info.tiny * info.eps  # the smallest positive subnormal
        k = rng.randrange(1, round(info.tiny / smallest))
        return torch.full((1,), rng.choice((1, -1)) * k * smallest, dtype=dt)
    if not bool(torch.isfinite(old).all()):
        return None
    if kind in ("ulp+", "ulp-"):
        return torch.nextafter(
            old, torch.full((1,), math.inf if kind == "ulp+" else -math.inf, dtype=dt)
        )
    return (x * (1 + (1e-3 if kind == "rel+1e-3" else -1e-3))).to(dt)


def _draw_weight(rng: random.Random, s: Survey) -> Mutation | None:
    t = rng.choice([t for t in s.tensors if t.numel])
    kind = rng.choice(ELEMENT_KINDS)
    i = rng.randrange(t.numel)
    size = SAFETENSORS_DTYPES[t.dtype].itemsize
    at = t.start + i * size
    with open(Path(s.source.candidate) / t.file, "rb") as f:
        f.seek(at)
        raw = f.read(size)
    old = torch.frombuffer(bytearray(raw), dtype=SAFETENSORS_DTYPES[t.dtype])
    new = _element_value(rng, kind, old)
    if new is None:
        return None
    new_raw = new.contiguous().view(torch.uint8).numpy().tobytes()
    if new_raw == raw:
        return None  # the draw changes no byte: drawn again
    index = list(torch.unravel_index(torch.tensor(i), t.shape)) if t.shape else []
    where = f"{t.name}[{','.join(str(int(j)) for j in index)}]"
    what = (
        f"{float(old[0]) if old.dtype.is_floating_point else old[0].item()!r} -> "
        f"{float(new[0]) if new.dtype.is_floating_point else new[0].item()!r}"
    )
    if t.loaded:
        ground, reason = (
            "weights-loaded",
            f"{t.name} is loaded by both loaders, and one of its elements moves",
        )
    else:
        ground, reason = (
            "policy",
            f"{t.name} is stored but not loaded: every weight byte is verified",
        )
    return _mutation(
        s,
        "weights",
        kind,
        f"{where} ({what})",
        (("bytes", t.file, at, b64(new_raw)),),
        "fail",
        ground,
        reason,
    )


def _draw_weight_file(rng: random.Random, s: Survey) -> Mutation | None:
    file = rng.choice(sorted({t.file for t in s.tensors}))
    path = Path(s.source.candidate) / file
    base, header = read_header(path)
    size = path.stat().st_size
    kind = rng.choice(("relabel-dtype", "reshape", "swap-names", "append-bytes", "truncate"))
    header = copy.deepcopy(header)
    names = [t.name for t in s.tensors if t.file == file and t.numel]
    if kind == "relabel-dtype":
        options = [n for n in names if header[n]["dtype"] in ("F32", "I32", "F16", "I16", "BF16")]
        if not options:
            return None
        name = rng.choice(options)
        new = {"F32": "I32", "I32": "F32", "F16": "BF16", "BF16": "F16", "I16": "F16"}[
            header[name]["dtype"]
        ]
        target = f"{file} {name}: dtype {header[name]['dtype']} -> {new}"
        header[name]["dtype"] = new
        ground, reason = (
            "weights-loaded" if _loaded(s, name) else "policy",
            "the same bytes read as another dtype are other values",
        )
    elif kind == "reshape":
        options = [n for n in names if len(set(header[n]["shape"])) > 1]
        if not options:
            return None
        name = rng.choice(options)
        shape = header[name]["shape"]
        new = shape[::-1]
        target = f"{file} {name}: shape {shape} -> {new}"
        header[name]["shape"] = new
        ground, reason = (
            "weights-loaded" if _loaded(s, name) else "policy",
            "a tensor of another shape does not load as the same parameter",
        )
    elif kind == "swap-names":
        by_shape: dict[tuple, list[str]] = {}
        for n in names:
            by_shape.setdefault((header[n]["dtype"], tuple(header[n]["shape"])), []).append(n)
        pairs = [v for v in by_shape.values() if len(v) > 1]
        if not pairs:
            return None
        a, b = rng.sample(rng.choice(pairs), 2)
        path_bytes = (Path(s.source.candidate) / file).read_bytes()
        if (
            path_bytes[base + header[a]["data_offsets"][0] : base + header[a]["data_offsets"][1]]
            == path_bytes[base + header[b]["data_offsets"][0] : base + header[b]["data_offsets"][1]]
        ):
            return None
        header[a], header[b] = header[b], header[a]
        target = f"{file}: {a} and {b} swap places"
        ground, reason = (
            "weights-loaded" if _loaded(s, a) or _loaded(s, b) else "policy",
            "each name now holds the other tensor's values",
        )
    elif kind == "append-bytes":
        extra = bytes(rng.randrange(256) for _ in range(rng.choice((1, 8, 64))))
        return _mutation(
            s,
            "weight-file",
            kind,
            f"{file} + {len(extra)} bytes",
            (("append", file, b64(extra)),),
            "fail",
            "policy",
            "every weight byte is verified: bytes after the last tensor",
        )
    else:
        n = rng.randrange(base, size)
        return _mutation(
            s,
            "weight-file",
            kind,
            f"{file} cut to {n} of {size} bytes",
            (("truncate", file, n),),
            "fail",
            "weights-loaded",
            "the last tensors lose their bytes",
        )
    return _mutation(
        s,
        "weight-file",
        kind,
        target,
        (("header", file, json.dumps(header)),),
        "fail",
        ground,
        reason,
    )


def _loaded(s: Survey, name: str) -> bool:
    return any(t.name == name and t.loaded for t in s.tensors)


def _config_ground(s: Survey, new: dict[str, Any], path: tuple) -> tuple[str, str]:
    if path and path[0] == "enjoyln":
        if path == ("enjoyln",):
            return "plan-read", (
                "without the block nothing says how the affines moved or the stream turned, "
                "and enjoyln.load runs the norms as LayerNorms"
            )
        return "policy", "the enjoyln block must be exactly what the confirmed plan gives"
    if config_as_loaded(new) != s.loaded_config:
        return "config-read", "transformers builds another config from it"
    return "policy", "config.json is compared as parsed JSON values"


def _draw_config(rng: random.Random, s: Survey, block: bool) -> Mutation | None:
    op = rng.choice(
        ("change", "change", "retype", "delete", "add")
        if not block
        else ("change", "change", "retype", "delete", "add", "delete-block")
    )
    if op == "delete-block":
        new = {k: v for k, v in s.config.items() if k != "enjoyln"}
        done, path = "delete the whole enjoyln block", ("enjoyln",)
    else:

        def protected(p: tuple) -> bool:
            inside = bool(p) and p[0] == "enjoyln"
            # the version string is the one change of the block that is owed a pass: drawn as inert
            return (
                (not inside if block else inside)
                or p == ("enjoyln", "version")
                or (block and p == ())
            )

        edited = edit_json(rng, s.config, op, protected)
        if edited is None:
            return None
        new, done = edited
        path = _changed_path(s.config, new)
    ground, reason = _config_ground(s, new, path)
    text = json_style(s.config, s.config_text)(new)
    plan = s.config.get("enjoyln", {}).get("plan", {})
    moved = bool(plan.get("rotation")) or any(e.get("affine") for e in plan.get("layer_norms", []))
    if op == "delete-block" and not moved:
        # what save_pretrained of an in-memory fold writes: LayerNorms that see zero-mean inputs,
        # which
        # compute the fold's function (to rounding) and which the gate judges as a fold without a
        # plan
        return _mutation(
            s,
            "enjoyln-block",
            op,
            done,
            (("write", "config.json", b64(text.encode())),),
            "pass",
            "equivalent",
            "the plain folded form (enjoyln.fold then save_pretrained): enjoyln.load "
            "runs its LayerNorms on zero-mean inputs, the fold's function to rounding",
        )
    return _mutation(
        s,
        "enjoyln-block" if block else "config",
        op,
        done,
        (("write", "config.json", b64(text.encode())),),
        "fail",
        ground,
        reason,
    )


def _changed_path(old: Any, new: Any, prefix: tuple = ()) -> tuple:
    """The deepest path at which ``old`` and ``new`` differ."""
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
        for k in old:
            if old[k] != new[k] or type(old[k]) is not type(new[k]):
                return _changed_path(old[k], new[k], prefix + (k,))
    if isinstance(old, dict) and isinstance(new, dict):
        diff = sorted(old.keys() ^ new.keys(), key=str)
        return prefix + ((diff[0],) if diff else ())
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b or type(a) is not type(b):
                return _changed_path(a, b, prefix + (i,))
    return prefix


def _other_files(s: Survey) -> list[str]:
    weights = {t.file for t in s.tensors} | {"model.safetensors.index.json", "config.json"}
    return [f for f in s.files if f not in weights]


def _file_ground(s: Survey, file: str) -> tuple[str, str]:
    if file in s.source.read_files:
        return "file-read", f"{file} is read by this directory's loaders"
    return "policy", "every other file is compared by content, whatever its name"


def _draw_file(
    rng: random.Random, s: Survey, others: dict[str, dict[str, bytes]]
) -> Mutation | None:
    file = rng.choice(_other_files(s))
    data = (Path(s.source.candidate) / file).read_bytes()
    ground, reason = _file_ground(s, file)
    kinds = ["byte", "truncate", "replace"]
    text = None
    try:
        text = data.decode("utf-8")
        parsed = json.loads(text) if file.endswith(".json") else None
    except (UnicodeDecodeError, ValueError):
        parsed = None
    if text is not None and len(set(text.splitlines())) > 1:
        kinds.append("swap-lines")
    if isinstance(parsed, (dict, list)):
        kinds += ["json-change", "json-retype", "json-delete", "json-add"]
    kind = rng.choice(kinds)
    if kind == "byte":
        if not data:
            return None
        i = rng.randrange(len(data))
        new = bytes([data[i] ^ rng.randrange(1, 256)])
        if parsed is not None and same_tokens(data, data[:i] + new + data[i + 1 :]):
            return None  # whitespace for whitespace between tokens: drawn as inert elsewhere
        return _mutation(
            s,
            "files",
            kind,
            f"{file} byte {i}: {data[i]:#04x} -> {new[0]:#04x}",
            (("bytes", file, i, b64(new)),),
            "fail",
            ground,
            reason,
        )
    if kind == "truncate":
        if not data:
            return None
        n = rng.randrange(len(data))
        if parsed is not None and same_tokens(data, data[:n]):
            return None  # only trailing whitespace cut
        return _mutation(
            s,
            "files",
            kind,
            f"{file} cut to {n} of {len(data)} bytes",
            (("truncate", file, n),),
            "fail",
            ground,
            reason,
        )
    if kind == "replace":
        theirs = [
            d[file]
            for name, d in sorted(others.items())
            if name != s.source.name and file in d and d[file] != data
        ]
        new = (
            rng.choice(theirs)
            if theirs
            else bytes(rng.randrange(256) for _ in range(max(len(data), 1)))
        )
        return _mutation(
            s,
            "files",
            kind,
            f"{file} replaced by {'another source' if theirs else 'random'}'s {len(new)} bytes",
            (("write", file, b64(new)),),
            "fail",
            ground,
            reason,
        )
    if kind == "swap-lines":
        lines = text.splitlines(keepends=True)
        while True:
            i, j = rng.sample(range(len(lines)), 2)
            if lines[i].rstrip("\r\n") != lines[j].rstrip("\r\n"):
                break
        a, b = lines[i], lines[j]
        lines[i], lines[j] = (
            b.rstrip("\r\n") + a[len(a.rstrip("\r\n")) :],
            a.rstrip("\r\n") + b[len(b.rstrip("\r\n")) :],
        )
        return _mutation(
            s,
            "files",
            kind,
            f"{file} lines {i + 1} and {j + 1} swapped",
            (
                (
                    "write",
                    file,
                    b64("".join(lines).encode()),
                ),
            ),
            "fail",
            ground,
            reason,
        )
    edited = edit_json(rng, parsed, kind[5:], lambda p: False)
    if edited is None:
        return None
    new_obj, done = edited
    if kind == "json-add" or "transformers_version" in done:
        # a key the loader may not know, or the version stamp every saved config gets anew
        ground, reason = "policy", "every other file is compared by content, whatever its name"
    return _mutation(
        s,
        "files",
        kind,
        f"{file}: {done}",
        (("write", file, b64(json_style(parsed, text)(new_obj).encode())),),
        "fail",
        ground,
        reason,
    )


# Files a directory may gain: each read by some loader or tool (tokenizers of other models,
# sentence-transformers, remote code, other weight formats), or by none.
_EXTRA_FILES = {
    "generation_config.json": json.dumps({"do_sample": True, "temperature": 5.0, "top_k": 0}),
    "added_tokens.json": json.dumps({"<new>": 99}),
    "special_tokens_map.json": json.dumps({"eos_token": "<unk>"}),
    "chat_template.jinja": "{{ messages[0]['content'] }}",
    "chat_template.json": json.dumps({"chat_template": "x"}),
    "tokenizer.json": None,
    "vocab.json": json.dumps({"a": 0}),
    "merges.txt": "#version: 0.2\na b\n",
    "vocab.txt": "a\nb\n",
    "bpe.codes": "a b 1\n",
    "dict.txt": "a 1\n",
    "emoji.json": json.dumps({"emoji": {}}),
    "entity_vocab.json": json.dumps({"[PAD]": 0}),
    "normalizer.json": json.dumps({"colour": "color"}),
    "source.spm": None,
    "tokenizer.model": None,
    "spiece.model": None,
    "preprocessor_config.json": json.dumps({"do_normalize": True}),
    "processor_config.json": json.dumps({"processor_class": "X"}),
    "modules.json": json.dumps([]),
    "1_Pooling/config.json": json.dumps({"pooling_mode_cls_token": True}),
    "notes.txt": "hello\n",
    "onnx/model.onnx": None,
    ".hidden": "x",
    "modeling_custom.py": "import os\n",
    "pytorch_model.bin": None,
    "tf_model.h5": None,
    "flax_model.msgpack": None,
    "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": {}}),
    "model-00002-of-00002.safetensors": None,
    "model.safetensors.bak": None,
}


def _draw_extra_missing(rng: random.Random, s: Survey, spm: bytes) -> Mutation | None:
    if rng.random() < 0.5:
        file = rng.choice(s.files)
        weights = {t.file for t in s.tensors}
        ground, reason = (
            ("layout", f"no loader can load without {file}")
            if file in weights | {"config.json"}
            else _file_ground(s, file)
        )
        return _mutation(
            s,
            "extra-missing",
            "missing",
            f"{file} removed",
            (("delete", file),),
            "fail",
            ground,
            reason if ground != "policy" else "a missing file fails",
        )
    if rng.random() < 0.2:
        if rng.random() < 0.5:
            return _mutation(
                s,
                "extra-missing",
                "fifo",
                "a FIFO named pipe",
                (("fifo", "pipe"),),
                "fail",
                "policy",
                "a special file, which a fold never writes: its name does not prove that no "
                "loader opens it (and one that did would block)",
            )
        name = rng.choice(("notes.txt", "LICENSE", "model-card.md", "bpe.codes"))
        if name in s.files:
            return None
        return _mutation(
            s,
            "extra-missing",
            "link-out",
            f"{name}: a link out of the directory",
            (("link-out", name, b64(b"x\n")),),
            "fail",
            "policy",
            "an extra file, served through a link: a fold never writes links, and a name does not "
            "prove that no loader reads it (bpe.codes is PhoBERT's)",
        )
    file = rng.choice([f for f in _EXTRA_FILES if f not in s.files])
    content = _EXTRA_FILES[file]
    if content is None:
        if file.endswith("model"):
            data = spm
        elif file.endswith(".safetensors"):
            data = header_bytes(
                {"extra.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
            ) + bytes(4)
        else:
            data = bytes(rng.randrange(256) for _ in range(64))
    else:
        data = content.encode()
    return _mutation(
        s,
        "extra-missing",
        "extra",
        f"{file} added ({len(data)} bytes)",
        (("write", file, b64(data)),),
        "fail",
        "policy",
        "an extra file fails, whether or not a loader reads it",
    )


INERT_KINDS = (
    "config-reformat",
    "json-respace",
    "enjoyln-version",
    "vcs",
    "metadata",
    "mtime",
    "weights-reorder",
    "reshard",
    "cache-links",
)
"""The changes drawn as inert: each owed a pass."""

# Files the README says are followed through a link out of the directory (the Hugging Face cache
# links every file to a blob): served that way, the same bytes reach every loader.
_CACHE_LINKED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "preprocessor_config.json",
)


def _draw_inert(rng: random.Random, s: Survey) -> Mutation | None:
    kind = rng.choice(INERT_KINDS)
    if kind == "config-reformat":

        def shuffled(o: Any) -> Any:
            if isinstance(o, dict):
                keys = list(o)
                rng.shuffle(keys)
                return {k: shuffled(o[k]) for k in keys}
            return [shuffled(v) for v in o] if isinstance(o, list) else o

        text = json.dumps(
            shuffled(s.config),
            indent=rng.choice((None, 0, 1, 3, "\t")),
            separators=rng.choice(((",", ":"), (", ", ": "), (" ,", " :  "))),
            ensure_ascii=rng.random() < 0.5,
        ) + rng.choice(("", "\n", "\r\n"))
        assert json.loads(text) == s.config
        return _mutation(
            s,
            "inert",
            kind,
            "config.json re-serialised: other whitespace and key order",
            (("write", "config.json", b64(text.encode())),),
            "pass",
            "inert",
            "Python's json reads both texts into equal dicts; nothing reads the key order",
        )
    if kind == "json-respace":
        files = [f for f in _other_files(s) if f.endswith(".json")]
        if not files:
            return None
        file = rng.choice(files)
        return _mutation(
            s,
            "inert",
            kind,
            f"{file} re-spaced, every token kept verbatim",
            (("reformat", file, rng.randrange(2**31)),),
            "pass",
            "inert",
            "whitespace between JSON tokens is not part of the value for any JSON parser",
        )
    if kind == "enjoyln-version":
        new = copy.deepcopy(s.config)
        new["enjoyln"]["version"] = rng.choice(("0.0.1", "9.9.9", "0.1.0+local", "1.0.0rc1"))
        if new == s.config:
            return None
        text = json_style(s.config, s.config_text)(new)
        return _mutation(
            s,
            "inert",
            kind,
            f"enjoyln.version -> {new['enjoyln']['version']}",
            (("write", "config.json", b64(text.encode())),),
            "pass",
            "inert",
            "the writing tool's version: enjoyln.load reads only the plan, transformers "
            "nothing of the block, and the policy sets it aside",
        )
    if kind == "vcs":
        vcs = rng.choice((".git", ".hg", ".svn"))
        ops = (
            ("write", f"{vcs}/HEAD", b64(b"ref: refs/heads/main\n")),
            ("write", f"{vcs}/objects/ab/cdef", b64(bytes(rng.randrange(256) for _ in range(32)))),
        )
        return _mutation(
            s,
            "inert",
            kind,
            f"{vcs}/ added",
            ops,
            "pass",
            "inert",
            "version-control data: no loader reads it, and a fold skips it",
        )
    if kind == "metadata":
        file = rng.choice(sorted({t.file for t in s.tensors}))
        _, header = read_header(Path(s.source.candidate) / file)
        header = copy.deepcopy(header)
        meta = header.setdefault("__metadata__", {})
        if rng.random() < 0.5:
            new = rng.choice([f for f in ("tf", "flax", "mlx", "np") if f != meta.get("format")])
            target, meta["format"] = f"{file} __metadata__.format -> {new}", new
        else:
            target, meta["x_note"] = f"{file} __metadata__.x_note added", "anything"
        return _mutation(
            s,
            "inert",
            kind,
            target,
            (("header", file, json.dumps(header)),),
            "pass",
            "inert",
            "transformers 5 reads a safetensors header's __metadata__ only in its torchao "
            "quantizer (which needs a quantization_config in config.json, compared like any key); "
            "safetensors and enjoyln.load read none of it",
        )
    if kind == "mtime":
        file = rng.choice(s.files)
        return _mutation(
            s,
            "inert",
            kind,
            f"{file} touched",
            (("utime", file, rng.randrange(10**9, 16 * 10**8)),),
            "pass",
            "inert",
            "no loader reads a file's times",
        )
    if kind == "weights-reorder":
        file = rng.choice(sorted({t.file for t in s.tensors}))
        return _mutation(
            s,
            "inert",
            kind,
            f"{file} rewritten: another tensor order and header key order",
            (("reorder", file, rng.randrange(2**31)),),
            "pass",
            "inert",
            "safetensors finds each tensor by name through the header's offsets",
        )
    if kind == "reshard":
        if weight_files(Path(s.source.candidate)) != ["model.safetensors"]:
            return None
        return _mutation(
            s,
            "inert",
            kind,
            "model.safetensors split into two shards and an index",
            (("reshard", rng.randrange(2**31)),),
            "pass",
            "inert",
            "both loaders read the same tensors by name through the index",
        )
    files = [f for f in _CACHE_LINKED if f in s.files]
    chosen = rng.sample(files, rng.randint(1, len(files)))
    return _mutation(
        s,
        "inert",
        kind,
        f"{', '.join(sorted(chosen))} served through links out of the directory",
        tuple(("move-out", f) for f in sorted(chosen)),
        "pass",
        "inert",
        "the Hugging Face cache layout: every loader reads the same bytes through the link",
    )


def _mutation(
    s: Survey,
    category: str,
    kind: str,
    target: str,
    ops: tuple,
    expect: str,
    ground: str,
    reason: str,
) -> Mutation:
    return Mutation(s.source.name, category, kind, target, ops, expect, ground, reason)


_VALUE_CATEGORIES = {
    "weights": 34,
    "weight-file": 5,
    "config": 16,
    "enjoyln-block": 9,
    "files": 16,
    "extra-missing": 10,
    "inert": 10,
}

CATEGORIES = {**_VALUE_CATEGORIES, **GATE_INPUT_CATEGORIES}
"""How often each category is drawn (relative weights): the values of the files (weights, config,
other files, inert changes), then what else decides a verdict (see ``gate_inputs``)."""


def draw(sources: Sequence[Source], n: int, seed: int = 0) -> list[Mutation]:
    """``n`` mutations, the ``i``-th drawn from ``sources[i % len(sources)]`` with its own
    generator seeded by ``(seed, i)``: one mutation can be drawn again alone, and the list
    is the same on every machine for the same sources.

    >>> draw(sources, 3, seed=0)[2].describe()  # doctest: +SKIP
    '#2 gpt2-rotated: weights/nan transformer.wte.weight[17,3] (0.0132 -> nan)'
    """
    quiet()
    surveys = [survey(s) for s in sources]
    spm = sentencepiece_model()
    contents = {
        s.source.name: {f: (Path(s.source.candidate) / f).read_bytes() for f in _other_files(s)}
        for s in surveys
    }
    names, weights = list(_VALUE_CATEGORIES), list(_VALUE_CATEGORIES.values())
    others, other_weights = list(GATE_INPUT_CATEGORIES), list(GATE_INPUT_CATEGORIES.values())
    share = sum(other_weights) / sum(CATEGORIES.values())
    out = []
    for i in range(n):
        s = surveys[i % len(surveys)]
        rng = random.Random(f"{seed}:{i}")
        # the gate-input categories draw from a generator of their own: where they are not drawn,
        # mutation i of a source is the one it was before they existed
        side = random.Random(f"{seed}:{i}:gate-inputs")
        m = None
        if side.random() < share:
            for _ in range(
                16
            ):  # a source may offer none of a kind (no rotation to drop, no float32)
                m = draw_gate_input(side, s, side.choices(others, other_weights)[0])
                if m is not None:
                    break
        while m is None:
            category = rng.choices(names, weights)[0]
            m = (
                _draw_weight(rng, s)
                if category == "weights"
                else _draw_weight_file(rng, s)
                if category == "weight-file"
                else _draw_config(rng, s, block=category == "enjoyln-block")
                if category in ("config", "enjoyln-block")
                else _draw_file(rng, s, contents)
                if category == "files"
                else _draw_extra_missing(rng, s, spm)
                if category == "extra-missing"
                else _draw_inert(rng, s)
            )
        out.append(Mutation(**{**m.__dict__, "index": i, "seed": seed}))
    return out
