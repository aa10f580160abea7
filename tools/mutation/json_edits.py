"""JSON texts verbatim and edited: their tokens as written, re-spaced without changing a token,
and one seeded edit of a value (changed, retyped, deleted or added)."""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any, Callable, Iterator


def json_tokens(text: str) -> Iterator[str]:
    """The tokens of a JSON text, each exactly as written (strings with their escapes, numbers
    with their spelling), so that re-spacing them cannot change what any parser reads."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
        elif c in "{}[]:,":
            yield c
            i += 1
        elif c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            yield text[i : j + 1]
            i = j + 1
        else:
            j = i
            while j < n and text[j] not in " \t\r\n{}[]:,":
                j += 1
            yield text[i:j]
            i = j


def same_tokens(a: bytes, b: bytes) -> bool:
    """Whether two byte strings are the same JSON tokens (whitespace between them aside)."""
    try:
        return list(json_tokens(a.decode("utf-8"))) == list(json_tokens(b.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, IndexError):  # not JSON text, or an unterminated string
        return False


def respace_json(text: str, rng: random.Random) -> str:
    """``text`` with other whitespace between its tokens, and nothing else changed."""
    tokens = list(json_tokens(text))
    while True:
        newline, indent = rng.choice(
            ((None, ""), ("\n", "\t"), ("\r\n", " "), ("\n", "   "), ("", " "))
        )
        out, depth = [], 0
        for tok in tokens:
            if tok in "}]" and newline:
                depth -= 1
                out.append(newline + indent * depth)
            out.append(tok)
            depth += tok in "{[" and bool(newline)
            if tok in "{[," and newline:
                out.append(newline + indent * depth)
            elif tok in ":," and newline is not None:
                out.append(indent)  # a space (or tab) after separators: still only whitespace
        new = "".join(out) + rng.choice(("", "\n", " \n"))
        if new != text:
            assert json.loads(new) == json.loads(text)
            return new


def json_style(obj: Any, text: str) -> Callable[[Any], str]:
    """How ``text`` was written, so that an edited copy differs from it only where it was edited."""
    for indent in (2, 4, None):
        for sort in (False, True):
            for tail in ("\n", ""):

                def dump(o: Any, indent: Any = indent, sort: bool = sort, tail: str = tail) -> str:
                    return json.dumps(o, indent=indent, sort_keys=sort, ensure_ascii=False) + tail

                if dump(obj) == text:
                    return dump
    return lambda o: json.dumps(o, indent=2, ensure_ascii=False) + "\n"


def _paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every value inside ``obj`` with its path of keys and list indices (not the root)."""
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        yield prefix + (k,), v
        yield from _paths(v, prefix + (k,))


def _at(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _path_text(path: tuple) -> str:
    return "".join(
        f"[{k}]" if isinstance(k, int) else (f".{k}" if i else str(k)) for i, k in enumerate(path)
    )


_KNOWN_VALUES = {
    "dtype": ["float16", "bfloat16", "float64"],
    "torch_dtype": ["float16", "bfloat16", "float64"],
    "activation_function": ["gelu", "relu", "silu"],
    "hidden_act": ["gelu_new", "relu", "silu"],
    "model_type": ["opt", "bert", "gpt2", "vit"],
    "position_embedding_type": ["relative_key", "absolute"],
    "tokenizer_class": ["GPT2Tokenizer", "BertTokenizer", "PreTrainedTokenizerFast"],
    "image_processor_type": ["CLIPImageProcessor", "ViTImageProcessorFast"],
    "resample": [0, 3],
}

# Keys worth adding: generation and precision settings a loader applies, and plain unknown keys.
_NEW_KEYS = {
    "do_sample": True,
    "temperature": 5.0,
    "top_k": 0,
    "num_beams": 2,
    "max_length": 3,
    "repetition_penalty": 2.0,
    "dtype": "float16",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "layer_norm_epsilon": 0.1,
    "layer_norm_eps": 0.1,
    "attn_implementation": "eager",
    "output_hidden_states": True,
    "use_cache": False,
    "scale_attn_by_inverse_layer_idx": True,
    "rope_theta": 10.0,
    "pad_token_id": 3,
    "bos_token_id": 5,
    "decoder_start_token_id": 2,
    "problem_type": "multi_label_classification",
    "do_normalize": False,
    "do_lower_case": True,
    "model_max_length": 4,
    "chat_template": "{{ messages }}",
    "x_unused_key": "anything",
}


def _other_value(rng: random.Random, key: Any, value: Any) -> Any:
    """Another value of the same JSON type (None has no other: it becomes a number)."""
    if isinstance(key, str) and key in _KNOWN_VALUES and value in _KNOWN_VALUES[key]:
        return rng.choice([v for v in _KNOWN_VALUES[key] if v != value])
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([v for v in (value + 1, value - 1, 0, 2 * value + 1, -1) if v != value])
    if isinstance(value, float):
        if not math.isfinite(value):
            return 0.5
        # never -0.0 for 0.0: both compare equal, and no one could say whether that is a change
        return rng.choice(
            [v for v in (value * (1 + 1e-3), value * 2, value + 1.0, 0.5) if v != value]
        )
    if isinstance(value, str):
        return rng.choice(
            [
                value + "x",
                value[:-1] if value else "x",
                value.swapcase() if value.swapcase() != value else value + " ",
            ]
        )
    if value is None:
        return rng.choice([0, 1])
    if isinstance(value, list):
        if value and rng.random() < 0.5:
            i = rng.randrange(len(value))
            return value[:i] + [_other_value(rng, None, value[i])] + value[i + 1 :]
        return value[:-1] if value and rng.random() < 0.5 else value + [value[-1] if value else 0]
    return {**value, "x_added": 1} if isinstance(value, dict) else value


def _retyped(value: Any) -> Any:
    """The same number or truth in another JSON type: equal in Python, another value in JSON."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def edit_json(
    rng: random.Random, obj: Any, op: str, protected: Callable[[tuple], bool]
) -> tuple[Any, str] | None:
    """``obj`` with one edit: change, retype, delete or add. Returns the new object and what was
    done, or None when ``obj`` has nothing to edit that way."""
    obj = copy.deepcopy(obj)
    paths = [(p, v) for p, v in _paths(obj) if not protected(p)]
    if op == "add":
        dicts = [((), obj)] * (isinstance(obj, dict) and not protected(())) + [
            (p, v) for p, v in paths if isinstance(v, dict)
        ]
        if not dicts:
            return None
        path, node = rng.choice(dicts)
        names = [k for k in _NEW_KEYS if k not in node]
        key = rng.choice(names) if names and rng.random() < 0.8 else f"x_{rng.randrange(16**6):06x}"
        node[key] = _NEW_KEYS.get(key, rng.choice([0, 1.5, "x", True, None, [], {}]))
        return obj, f"add {_path_text(path + (key,))} = {json.dumps(node[key])}"
    if op == "retype":
        paths = [(p, v) for p, v in paths if _retyped(v) is not None]
    if op == "change":
        paths = [(p, v) for p, v in paths if not isinstance(v, dict)]
    if not paths:
        return None
    path, value = rng.choice(paths)
    parent = _at(obj, path[:-1])
    if op == "delete":
        del parent[path[-1]]
        return obj, f"delete {_path_text(path)}"
    new = _retyped(value) if op == "retype" else _other_value(rng, path[-1], value)
    parent[path[-1]] = new
    return obj, f"{op} {_path_text(path)}: {json.dumps(value)[:60]} -> {json.dumps(new)[:60]}"
