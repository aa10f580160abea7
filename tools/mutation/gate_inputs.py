"""Drawing mutations of what decides a verdict besides the tensors' values and the files' bytes:
a plan cache planted where older enjoyln read one, the tensor order and index metadata that decide
the dtype a model loads in, rounding under ``--dtype``, and parameters missing from the checkpoint.

Each category is drawn from a source's fold like the others (see ``drawing.draw``); the verdict
owed comes from the files and from what transformers 5 reads (``_get_dtype`` in its
``modeling_utils``: config.json's ``dtype``, else the index metadata's ``dtype``, else the first
floating tensor of the first shard by sorted name), never from the gate's code.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch

from .applying import Mutation, b64, rounded
from .json_edits import json_style
from .sources import SAFETENSORS_DTYPES, Survey, read_header, weight_files


GATE_INPUT_CATEGORIES = {
    "plan-cache": 2,
    "load-dtype": 3,
    "index-metadata": 4,
    "cast-rounding": 5,
    "missing-params": 2,
}
"""How often each of these categories is drawn, on the scale of ``drawing.CATEGORIES``."""

KINDS = {
    "plan-cache": {"dropped-centering": 1, "edited-axis": 1},
    "load-dtype": {"first-widened": 1, "widened": 2, "dtype-deleted": 1},
    "index-metadata": {
        "metadata-dropped": 1,
        "metadata-dtype": 1,
        "metadata-dtype-no-config": 1,
        "total-size": 1,
    },
    "cast-rounding": {
        "nearest": 2,
        "directed-up": 1,
        "directed-down": 1,
        "directed-zero": 1,
        "ulp": 1,
    },
    "missing-params": {"missing": 1},
}
"""The kinds each category draws, with their relative weights (those owed a pass drawn more
often where a category has one pass kind among several)."""

INDEX = "model.safetensors.index.json"
_FLOAT_NAMES = ("F64", "F32", "F16", "BF16")


def draw_gate_input(rng: random.Random, s: Survey, category: str) -> Mutation | None:
    """One mutation of ``category`` (a key of ``GATE_INPUT_CATEGORIES``) of ``s``'s fold, or
    None where this source offers none of the kind drawn."""
    kind = rng.choices(list(KINDS[category]), list(KINDS[category].values()))[0]
    draw = {
        "plan-cache": _plan_cache,
        "load-dtype": _load_dtype,
        "index-metadata": _index_metadata,
        "cast-rounding": _cast_rounding,
        "missing-params": _missing,
    }[category]
    return draw(rng, s, kind)


def _made(
    s: Survey,
    category: str,
    kind: str,
    target: str,
    ops: tuple,
    expect: str,
    ground: str,
    reason: str,
    **extra: Any,
) -> Mutation:
    return Mutation(s.source.name, category, kind, target, ops, expect, ground, reason, **extra)


def _write_config(s: Survey, new: dict[str, Any]) -> tuple:
    return ("write", "config.json", b64(json_style(s.config, s.config_text)(new).encode()))


def _without_dtype(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}


def _values(root: Path, file: str, name: str) -> torch.Tensor:
    """A stored tensor's values, read from its file's header and bytes."""
    base, header = read_header(root / file)
    info = header[name]
    begin, end = info["data_offsets"]
    with open(root / file, "rb") as f:
        f.seek(base + begin)
        raw = bytearray(f.read(end - begin))
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    return torch.frombuffer(raw or bytearray(dtype.itemsize), dtype=dtype)[
        : (end - begin) // dtype.itemsize
    ].reshape(info["shape"])


def _reference_tensors(s: Survey) -> dict[str, tuple[str, str, list[int]]]:
    """name -> (file, safetensors dtype, shape) of every tensor of the reference."""
    root = Path(s.source.reference)
    out = {}
    for file in weight_files(root):
        _, header = read_header(root / file)
        out.update(
            {n: (file, h["dtype"], h["shape"]) for n, h in header.items() if n != "__metadata__"}
        )
    return out


# --- a plan cache planted where enjoyln up to 0.1.0 read one ------------------------------


@functools.cache
def _source_digest() -> str:
    """What enjoyln up to 0.1.0 put into a plan cache key for its own code: every ``.py`` file of
    the package, by relative path and bytes (here, the code the gate runs)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def old_cache_key(config: dict[str, Any], options: dict[str, Any]) -> str:
    """The file name (less ``.json``) under which enjoyln up to 0.1.0 looked up the plan of a
    model with this ``config.json`` and these analysis options in ``$ENJOYLN_CACHE/plans``:
    public data only, so anyone could plant an entry."""
    import transformers

    text = json.dumps(
        {
            "config": config,
            "architecture": config["architectures"][0],
            "options": options,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "enjoyln": _source_digest(),
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _planted(s: Survey, plan: dict[str, Any]) -> tuple[tuple, ...]:
    """Ops planting ``plan`` under every key the old check could have looked up for this
    reference: the options it read from the recorded plan (and the same with auxiliary
    centering, which it tried next), and those of a plain fold or of no recorded plan."""
    reference = json.loads((Path(s.source.reference) / "config.json").read_text())
    recorded = {
        "auxiliary_centering": bool(plan.get("auxiliary")),
        "fuse_affine": any(e.get("affine") for e in plan["layer_norms"]),
        "rotate": None,
    }
    options = [
        recorded,
        {**recorded, "auxiliary_centering": True},
        {"auxiliary_centering": False, "fuse_affine": False, "rotate": None},
        {"auxiliary_centering": False},
    ]
    keys = dict.fromkeys(old_cache_key(reference, o) for o in options)
    data = b64(json.dumps(plan).encode())
    return tuple(("plant", f"cache/plans/{k}.json", data) for k in keys)


_PLAN_CACHE_ENV = (("ENJOYLN_CACHE", "{outside}/cache"), ("ENJOYLN_PLAN_CACHE", "1"))


def _plan_cache(rng: random.Random, s: Survey, kind: str) -> Mutation | None:
    block = s.config.get("enjoyln")
    if not block or block["plan"].get("rotation"):
        return None  # a rotated tensor's bytes without its centering are no tensor of the reference
    plan = block["plan"]
    fused = {
        f.get(k)
        for e in plan["layer_norms"]
        for f in e.get("fused", ())
        for k in ("weight", "bias")
    }
    ref = _reference_tensors(s)
    cand = {t.name: t for t in s.tensors}
    # centerings of a tensor stored under its parameter's name in both, and moved by nothing else
    options = [
        c
        for c in block["centered"]
        if c["param"] in cand
        and c["param"] in ref
        and c["param"] not in fused
        and ref[c["param"]][1:] == (cand[c["param"]].dtype, list(cand[c["param"]].shape))
        and not c.get("scale")
        and not c.get("blocks")
        and c.get("groups", 1) == 1
    ]
    if kind == "edited-axis":
        options = [
            c
            for c in options
            if any(n > 1 for a, n in enumerate(cand[c["param"]].shape) if a != c["axis"])
        ]
    if not options:
        return None
    c = rng.choice(options)
    name, t = c["param"], cand[c["param"]]
    original = _values(Path(s.source.reference), ref[name][0], name)
    new = copy.deepcopy(s.config)
    lists = [new["enjoyln"]["centered"]] + [
        e["centered"] for e in new["enjoyln"]["plan"]["layer_norms"]
    ]
    norms = [
        e["name"] for e in plan["layer_norms"] if any(x["param"] == name for x in e["centered"])
    ]
    if kind == "dropped-centering":
        for lst in lists:
            lst[:] = [x for x in lst if x["param"] != name]
        values, target = (
            original,
            f"{name}'s centering dropped from the plan and the cache, its bytes the reference's",
        )
        reason = (
            f"{', '.join(norms)} still run as RMSNorms in enjoyln.load, on inputs {name} no longer "
            "makes zero-mean; a planted cache entry agreeing with the block decides nothing"
        )
    else:
        axis = rng.choice([a for a, n in enumerate(t.shape) if a != c["axis"] and n > 1])
        for lst in lists:
            for x in lst:
                if x["param"] == name:
                    x["axis"] = axis
        wide = original.to(torch.float64)
        values = (wide - wide.mean(axis, keepdim=True)).to(original.dtype)
        target = (
            f"{name} centered along axis {axis}, not {c['axis']}, in the plan, the cache and "
            "the bytes"
        )
        reason = (
            f"{name} made zero-mean along another axis: {', '.join(norms)} run as RMSNorms in "
            "enjoyln.load on inputs that are not zero-mean; a planted cache entry agreeing decides "
            "nothing"
        )
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()
    ops = (
        _write_config(s, new),
        ("bytes", t.file, t.start, b64(raw)),
        *_planted(s, new["enjoyln"]["plan"]),
    )
    # half judged by the static part alone, where the old cache decided: the forward part would
    # catch many of these by their outputs (not a bfloat16 ViT's, within its tolerance)
    args = ("--static",) if rng.random() < 0.5 else ()
    return _made(
        s,
        "plan-cache",
        kind,
        target,
        ops,
        "fail",
        "plan-read",
        reason,
        env=_PLAN_CACHE_ENV,
        args=args,
    )


# --- the dtype a model loads in --------------------------------------------------------------


def _first_floating(s: Survey) -> Any:
    """The tensor whose dtype transformers loads in when nothing names one: the first floating
    tensor of the first shard, by name (safetensors lists a file's keys sorted)."""
    first_file = weight_files(Path(s.source.candidate))[0]
    return next((t for t in s.tensors if t.file == first_file and t.dtype in _FLOAT_NAMES), None)


def _load_dtype(rng: random.Random, s: Survey, kind: str) -> Mutation | None:
    dtype = s.config.get("dtype")
    first = _first_floating(s)
    if dtype is None or first is None:
        return None
    if kind == "first-widened":
        ops = (
            _write_config(s, _without_dtype(s.config)),
            ("retype", first.file, json.dumps({"cast": {first.name: ["F64", "nearest"]}})),
        )
        return _made(
            s,
            "load-dtype",
            kind,
            f"config.json's dtype deleted, {first.name} widened to float64",
            ops,
            "fail",
            "config-read",
            f"with no dtype in config.json transformers loads in the first "
            f"floating tensor's dtype, {first.name}'s, now float64 where it was {dtype}",
        )
    if kind == "widened":
        t = rng.choice([t for t in s.tensors if t.dtype in ("F32", "F16", "BF16") and t.numel])
        ops = (("retype", t.file, json.dumps({"cast": {t.name: ["F64", "nearest"]}})),)
        return _made(
            s,
            "load-dtype",
            kind,
            f"{t.name} widened to float64, config.json's dtype kept",
            ops,
            "pass",
            "inert",
            f"config.json's dtype ({dtype}) decides what every tensor loads in, and "
            f"float64 holds each {t.dtype} value exactly: the same values load",
        )
    if str(SAFETENSORS_DTYPES[first.dtype]) != f"torch.{dtype}":
        return None
    return _made(
        s,
        "load-dtype",
        kind,
        "config.json's dtype deleted",
        (_write_config(s, _without_dtype(s.config)),),
        "fail",
        "policy",
        f"the model still loads in {dtype}, its first floating tensor's dtype, but "
        "config.json is compared as JSON values: a deleted key fails",
    )


def _index_metadata(rng: random.Random, s: Survey, kind: str) -> Mutation | None:
    if weight_files(Path(s.source.candidate)) != ["model.safetensors"] or "dtype" not in s.config:
        return None
    shards = (
        "reshard",
        rng.randrange(2**31),
    )  # the two shards and the index save_pretrained writes
    dtype = s.config["dtype"]
    other = rng.choice([d for d in ("float16", "bfloat16", "float32", "float64") if d != dtype])
    if kind == "metadata-dropped":
        return _made(
            s,
            "index-metadata",
            kind,
            "in two shards, the index's metadata removed",
            (shards, ("json-delete", INDEX, ["metadata"])),
            "fail",
            "layout",
            "from_pretrained reads the index's metadata and fails without it",
        )
    if kind == "metadata-dtype":
        return _made(
            s,
            "index-metadata",
            kind,
            f"in two shards, the index's metadata.dtype {other}",
            (shards, ("json-set", INDEX, ["metadata", "dtype"], other)),
            "pass",
            "inert",
            "transformers reads the index's dtype only where config.json names none, and it names "
            f"{dtype}",
        )
    if kind == "metadata-dtype-no-config":
        ops = (
            _write_config(s, _without_dtype(s.config)),
            shards,
            ("json-set", INDEX, ["metadata", "dtype"], other),
        )
        return _made(
            s,
            "index-metadata",
            kind,
            f"in two shards, config.json's dtype moved to the index as {other}",
            ops,
            "fail",
            "config-read",
            f"with no dtype in config.json transformers loads in the index "
            f"metadata's, {other}, where the fold loads in {dtype}",
        )
    size = rng.choice((0, 1, 10**12, rng.randrange(2, 10**6)))
    return _made(
        s,
        "index-metadata",
        kind,
        f"in two shards, the index's metadata.total_size {size}",
        (shards, ("json-set", INDEX, ["metadata", "total_size"], size)),
        "pass",
        "inert",
        "no loader reads total_size: shards are found through the weight map, tensors by their "
        "headers",
    )


# --- rounding under --dtype ------------------------------------------------------------------


def _cast_then_centered(
    original: torch.Tensor, c: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    """The reference rounded to ``dtype`` and then centered as ``c`` says in float64 (this
    harness's own arithmetic: the fold's may differ where a value sits on a rounding tie)."""
    x = original.to(dtype).to(torch.float64).movedim(c["axis"], -1)
    shape = x.shape
    g = c.get("groups", 1)
    x = x.reshape(*shape[:-1], g, shape[-1] // g)
    return (x - x.mean(-1, keepdim=True)).reshape(shape).movedim(-1, c["axis"]).to(dtype)


_TOWARD = {
    "directed-up": ("up", "toward +inf"),
    "directed-down": ("down", "toward -inf"),
    "directed-zero": ("zero", "toward zero"),
}


def _cast_rounding(rng: random.Random, s: Survey, kind: str) -> Mutation | None:
    if s.config.get("dtype") != "float32" or not s.config.get("enjoyln"):
        return None  # the fold of a float32 reference, cast to bfloat16 for --dtype bfloat16
    cand, ref = Path(s.source.candidate), Path(s.source.reference)
    refs = _reference_tensors(s)
    config = {**s.config, "dtype": "bfloat16"}
    extra = {"args": ("--dtype", "bfloat16")}
    nearest = {"*": ["BF16", "nearest"]}
    # the tensors the fold computed: no reference tensor of their name holds their bytes
    folded = [
        t
        for t in s.tensors
        if t.loaded
        and t.dtype == "F32"
        and t.numel
        and (
            t.name not in refs
            or not torch.equal(_values(cand, t.file, t.name), _values(ref, refs[t.name][0], t.name))
        )
    ]
    if kind == "nearest":
        return _made(
            s,
            "cast-rounding",
            kind,
            "every floating tensor cast to bfloat16 (nearest), config dtype bfloat16",
            (
                _write_config(s, config),
                ("retype", "model.safetensors", json.dumps({"cast": nearest})),
            ),
            "pass",
            "equivalent",
            "the fold then cast, rounded to nearest: what save_pretrained writes of "
            "the fold loaded and cast to bfloat16, which --dtype bfloat16 accepts",
            **extra,
        )
    if kind in _TOWARD:
        if not folded:
            return None
        mode, words = _TOWARD[kind]
        chosen = folded if rng.random() < 0.5 else [rng.choice(folded)]
        moved = sum(
            int((rounded(x, torch.bfloat16, mode) != x.to(torch.bfloat16)).sum())
            for x in (_values(cand, t.file, t.name) for t in chosen)
        )
        if moved < 4:  # so few that another correct rounding could hold them
            return None
        names = (
            ", ".join(t.name for t in chosen)
            if len(chosen) == 1
            else f"all {len(chosen)} folded tensors"
        )
        spec = {"cast": {**nearest, **{t.name: ["BF16", mode] for t in chosen}}}
        return _made(
            s,
            "cast-rounding",
            kind,
            f"cast to bfloat16, {names} rounded {words} ({moved} elements one ulp from nearest)",
            (_write_config(s, config), ("retype", "model.safetensors", json.dumps(spec))),
            "fail",
            "weights-loaded",
            f"{moved} elements load one bfloat16 ulp from the round-to-nearest "
            "value of the fold's result: neither fold-then-cast nor cast-then-fold rounds that way",
            **extra,
        )
    return _one_ulp(rng, s, folded, config, nearest, extra)


def _one_ulp(
    rng: random.Random,
    s: Survey,
    folded: list[Any],
    config: dict[str, Any],
    nearest: dict[str, Any],
    extra: dict[str, Any],
) -> Mutation | None:
    cand, ref = Path(s.source.candidate), Path(s.source.reference)
    t = rng.choice([t for t in s.tensors if t.loaded and t.dtype == "F32" and t.numel])
    i, step = rng.randrange(t.numel), rng.choice((1, -1))
    if t in folded:
        # a folded tensor may also be cast then folded, which rounds elsewhere: the mutant must
        # not be that result either (computed here for a plainly centered tensor, else not drawn)
        c = [c for c in s.config["enjoyln"]["centered"] if c["param"] == t.name]
        refs = _reference_tensors(s)
        if len(c) != 1 or c[0].get("scale") or c[0].get("blocks") or t.name not in refs:
            return None
        mutant = _values(cand, t.file, t.name).to(torch.bfloat16).reshape(-1).clone()
        mutant[i] = torch.nextafter(
            mutant[i], torch.tensor(float("inf") * step, dtype=torch.bfloat16)
        )
        other = _cast_then_centered(_values(ref, refs[t.name][0], t.name), c[0], torch.bfloat16)
        if torch.equal(other.reshape(-1), mutant):
            return None
    spec = {"cast": nearest, "ulp": [t.name, i, step]}
    return _made(
        s,
        "cast-rounding",
        "ulp",
        f"cast to bfloat16, {t.name} element {i} one ulp "
        f"{'up' if step > 0 else 'down'} from nearest",
        (_write_config(s, config), ("retype", "model.safetensors", json.dumps(spec))),
        "fail",
        "weights-loaded",
        "a loaded element one bfloat16 ulp from every round-to-nearest result of the fold",
        **extra,
    )


# --- parameters missing from the checkpoint --------------------------------------------------


def _missing(rng: random.Random, s: Survey, kind: str) -> Mutation | None:
    t = rng.choice([t for t in s.tensors if t.loaded])
    values = _values(Path(s.source.candidate), t.file, t.name)
    # a constant tensor (a fused norm's γ of ones, β of zeros) may be what initialisation gives
    constant = values.numel() <= 1 or bool((values == values.reshape(-1)[0]).all())
    ground, reason = (
        (
            "policy",
            "a tensor every fold holds is missing (its values may be what initialisation gives)",
        )
        if constant
        else (
            "weights-loaded",
            "transformers initialises a parameter the checkpoint lacks, on every "
            "load, to other values than the fold's",
        )
    )
    return _made(
        s,
        "missing-params",
        kind,
        f"{t.name} removed from {t.file} (header and bytes)",
        (("retype", t.file, json.dumps({"drop": [t.name]})),),
        "fail",
        ground,
        reason,
    )
