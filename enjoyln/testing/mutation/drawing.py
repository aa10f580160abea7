"""Seeded mutations of a folded model directory, each with the verdict a sound gate must give.

``enjoyln check REFERENCE CANDIDATE`` is a CI gate: exit 0 must mean "CANDIDATE
computes what REFERENCE does". This module measures that. From a seed it draws
mutations of checked folds:

- a weight element (of any stored tensor, loaded or not) set to NaN, ±Inf,
  ±0 or a denormal, or nudged by one ulp or by a relative 1e-3;
- the safetensors file itself (its header's metadata, a tensor's dtype or
  shape, two tensors' names swapped, bytes added or cut);
- a config key (top level, nested, or in the ``enjoyln`` block) changed to
  another value, retyped (``1`` for ``true``), deleted, or added;
- any other file changed by a byte, truncated, replaced, edited as JSON, or
  removed, and files added;
- inert changes, which must pass: ``config.json`` re-serialised with other
  whitespace and key order, other JSON files re-spaced (every token kept), the
  ``enjoyln`` block's ``version`` string, VCS data, a FIFO, a link out of the
  directory, a file's mtime, the weights written in another tensor order or
  in two shards, and needed files served through links out of the directory
  (the Hugging Face cache layout).

Every mutation carries the verdict it must get (``"fail"``: exit non-zero;
``"pass"``: exit 0) and the reason. The policy: the gate fails every mutation
that changes what ``from_pretrained`` or ``enjoyln.load`` computes; every
weight byte is verified; ``config.json`` is compared as parsed JSON values
(a JSON value of another type is another value); the ``enjoyln`` block must be
what the confirmed plan gives, its ``version`` string aside; every other file is
compared by content, whatever its name; extra or missing files fail, except
what a fold itself skips. ``ground`` says why a "fail" is owed: the mutation
changes a loaded tensor (``weights-loaded``), a config value transformers reads
(``config-read``), the plan ``enjoyln.load`` reads (``plan-read``), a file a loader
of this directory reads (``file-read``: the change may still fall where the reader
looks past it, such as a count PhoBERT drops or two keys of a JSON object), the
directory's layout a loader needs (``layout``), or nothing shown to be read: only
the policy (``policy``).

The expectations are derived from the files (safetensors headers, JSON), never
from the gate's code. :func:`observe` loads a directory as a user would
(``from_pretrained``, ``enjoyln.load``, the tokenizer, the image processor) and
fingerprints what they compute, bit for bit: an inert mutation is one whose
fingerprint is the unmutated fold's (``tests/testing/test_mutation.py`` proves each
kind), and a claimed change is confirmed the same way.

>>> sources = build_sources("/tmp/mutation-sources")  # doctest: +SKIP
>>> results = judge_all(sources, draw(sources, n=500, seed=0), workers=2)  # doctest: +SKIP
>>> score(results)["all"]["score"]  # doctest: +SKIP
1.0
"""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import json
import math
import os
import random
import shutil
import signal
import struct
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ...errors import first_line

# --- the directories mutated ---------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A reference directory and a checked fold of it, which the mutations start from."""

    name: str
    reference: str
    candidate: str
    architecture: str
    kind: str
    """'lm' (token ids in, generates), 'encoder' (token ids in) or 'image' (pixels in)."""
    read_files: tuple[str, ...] = ()
    """Files besides the config and weights that this directory's loaders read (its tokenizer,
    image processor, generation config): a change to one of them changes what a user gets."""


_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world", "a model computes what it computes",
           "layer norm folds into rms norm", "every weight byte is verified"]


def _gpt2_reference(path: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    from .. import perturb, tiny_model

    model = perturb(tiny_model("gpt2", seed=seed, n_layer=1, n_embd=32, n_head=2, n_positions=16), seed=seed)
    # as in the hub's gpt2: a nested dict that no model reads
    model.config.task_specific_params = {"text-generation": {"do_sample": True, "max_length": 50}}
    model.save_pretrained(path)
    # Old GPT-2 checkpoints store the attention mask buffers, which transformers no longer
    # loads: tensors stored but not loaded, whose bytes the gate must still verify.
    weights = load_file(path / "model.safetensors")
    weights["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    weights["transformer.h.0.attn.bias"] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _bpe_tokenizer(path: Path) -> None:
    """A real BPE tokenizer trained on a few sentences: tokenizer.json, and vocab.json and
    merges.txt beside it, as GPT-2 repositories have."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(vocab_size=100, show_progress=False,
                                                             special_tokens=["<unk>", "<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(path)
    tok.model.save(str(path))


def _japanese_tokenizer(path: Path) -> None:
    """GPT-NeoX-Japanese's pure-Python tokenizer, which reads vocab.txt and emoji.json."""
    chars = sorted(set("".join(_CORPUS)) - {" "})
    vocab = ["<|endoftext|>", "<|startoftext|>", "<SP>", "<|emoji1|>", "<|emoji2|>", *chars,
             *[f"<|byte{i}|>" for i in range(32)]]
    (path / "vocab.txt").write_text("".join(f"{v}\n" for v in vocab), encoding="utf-8")
    emoji = {"emoji": {"\U0001F600": "<|emoji1|>", "\U0001F44D": "<|emoji2|>"},
             "emoji_inv": {"<|emoji1|>": "\U0001F600", "<|emoji2|>": "\U0001F44D"}}
    (path / "emoji.json").write_text(json.dumps(emoji, ensure_ascii=False), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPTNeoXJapaneseTokenizer"},
                                                           indent=2) + "\n")


def _phobert_tokenizer(path: Path) -> None:
    """PhoBERT's tokenizer, which reads vocab.txt and a BPE file named bpe.codes."""
    words = ["dog", "fox", "hello", "the", "world"]  # few, so that every id is within the model's vocabulary
    pieces = sorted({w[:i] for w in words for i in range(1, len(w) + 1)} | set("".join(words)))
    (path / "vocab.txt").write_text("".join(f"{p} 1\n" for p in pieces) + "".join(
        f"{p}@@ 1\n" for p in pieces), encoding="utf-8")
    merges = [f"{w[:i]} {w[i]} 1\n" for w in words for i in range(1, len(w))]
    (path / "bpe.codes").write_text("".join(dict.fromkeys(merges)), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PhobertTokenizer"}, indent=2) + "\n")


def _sentencepiece_model() -> bytes:
    """A valid sentencepiece model, built with protobuf (no sentencepiece library needed)."""
    from transformers.utils import sentencepiece_model_pb2_new as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    m.normalizer_spec.name = "identity"
    for piece, kind in (("<pad>", 3), ("</s>", 3), ("<unk>", 2)):
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, 0.0, kind
    for i, w in enumerate(sorted({"\u2581" + w for line in _CORPUS for w in line.split()})):
        p = m.pieces.add()
        p.piece, p.score, p.type = w, -float(i + 1), 1
    return m.SerializeToString()


def _run_cli(*args: str) -> None:
    from typer.testing import CliRunner

    from ...cli.app import app

    result = CliRunner().invoke(app, list(args))
    if result.exit_code != 0:
        raise RuntimeError(f"enjoyln {' '.join(args)} exited {result.exit_code}: {result.output[-2000:]}")


def build_sources(root: str | os.PathLike) -> list[Source]:
    """Tiny perturbed models and their checked folds, made with the command line.

    - ``gpt2``: a plain fold of a GPT-2 with a trained BPE tokenizer (tokenizer.json, vocab.json,
      merges.txt), a generation config, a model card, a sentencepiece model no loader here
      reads, a file in a subdirectory, and two stored tensors transformers does not load;
    - ``gpt2-fused``: ``fold --fuse-affine`` of the same reference;
    - ``gpt2-rotated``: ``rotate`` of a GPT-2 with GPT-NeoX-Japanese's tokenizer (vocab.txt,
      emoji.json);
    - ``bert``: a plain fold of a BertModel with PhoBERT's tokenizer (vocab.txt, bpe.codes) and
      sentence-transformers' files (modules.json, 1_Pooling/config.json);
    - ``vit``: a plain fold of a ViT classifier with its image processor config;
    - ``vit-bf16``: the same in bfloat16, which the gate judges by its half-precision criterion.

    >>> [s.name for s in build_sources(tmp)]  # doctest: +SKIP
    ['gpt2', 'gpt2-fused', 'gpt2-rotated', 'bert', 'vit', 'vit-bf16']
    """
    from transformers import ViTImageProcessor

    from .. import perturb, tiny_model

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    gpt2, gpt2_ja, bert, vit, vit16 = (root / n for n in ("ref-gpt2", "ref-gpt2-ja", "ref-bert", "ref-vit",
                                                          "ref-vit-bf16"))

    _gpt2_reference(gpt2, seed=1)
    _bpe_tokenizer(gpt2)
    (gpt2 / "README.md").write_text("# tiny GPT-2\n\nRandom weights, for testing.\n")
    (gpt2 / "spiece.model").write_bytes(_sentencepiece_model())
    (gpt2 / "onnx").mkdir()
    (gpt2 / "onnx" / "notes.txt").write_text("exported elsewhere\n")

    _gpt2_reference(gpt2_ja, seed=2)
    _japanese_tokenizer(gpt2_ja)

    model = perturb(tiny_model("bert", seed=3, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=16), seed=3)
    model.save_pretrained(bert)
    _phobert_tokenizer(bert)
    (bert / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], indent=2))
    (bert / "1_Pooling").mkdir()
    (bert / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}, indent=2))

    model = perturb(tiny_model("vit", seed=4, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64, image_size=16, patch_size=8, num_labels=3), seed=4)
    model.save_pretrained(vit)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(vit)
    model = perturb(tiny_model("vit", seed=5, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64, image_size=16, patch_size=8, num_labels=3), seed=5)
    model.to(torch.bfloat16).save_pretrained(vit16)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(vit16)

    _run_cli("fold", str(gpt2), str(root / "gpt2"))
    _run_cli("fold", str(gpt2), str(root / "gpt2-fused"), "--fuse-affine")
    _run_cli("rotate", str(gpt2_ja), str(root / "gpt2-rotated"))
    _run_cli("fold", str(bert), str(root / "bert"))
    _run_cli("fold", str(vit), str(root / "vit"))
    _run_cli("fold", str(vit16), str(root / "vit-bf16"))
    return [
        Source("gpt2", str(gpt2), str(root / "gpt2"), "GPT2LMHeadModel", "lm",
               ("tokenizer.json", "tokenizer_config.json", "generation_config.json")),
        Source("gpt2-fused", str(gpt2), str(root / "gpt2-fused"), "GPT2LMHeadModel", "lm",
               ("tokenizer.json", "tokenizer_config.json", "generation_config.json")),
        Source("gpt2-rotated", str(gpt2_ja), str(root / "gpt2-rotated"), "GPT2LMHeadModel", "lm",
               ("vocab.txt", "emoji.json", "tokenizer_config.json", "generation_config.json")),
        Source("bert", str(bert), str(root / "bert"), "BertModel", "encoder",
               ("vocab.txt", "bpe.codes", "tokenizer_config.json")),
        Source("vit", str(vit), str(root / "vit"), "ViTForImageClassification", "image",
               ("preprocessor_config.json",)),
        Source("vit-bf16", str(vit16), str(root / "vit-bf16"), "ViTForImageClassification", "image",
               ("preprocessor_config.json",)),
    ]


# --- reading a directory without the gate's code ------------------------------------------

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class _Tensor:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Absolute offset of the first byte in the file."""
    end: int
    loaded: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _header(file: Path) -> tuple[int, dict[str, Any]]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _weight_files(root: Path) -> list[str]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _loaded_digests(root: Path, architecture: str) -> set[str]:
    """Digests of every tensor ``from_pretrained`` loads. A stored tensor is loaded if its bytes
    are among them: transformers 5 renames checkpoint keys on load (ViT's
    ``attention.attention.query`` is ``attention.q_proj``), so names cannot say it. (A tensor
    not loaded whose bytes equal a loaded one's would count as loaded: the claim is then
    "weights-loaded" where it is "policy"; the verdict owed is the same.)"""
    import transformers

    model = getattr(transformers, architecture).from_pretrained(root)
    return {_bits_digest(t) for t in model.state_dict().values()}


def _bits_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(_bits(t)).hexdigest()


@dataclass
class _Survey:
    """What a source's fold holds: its tensors, config and other files."""

    source: Source
    tensors: list[_Tensor]
    config: dict[str, Any]
    config_text: str
    files: list[str]
    """Every regular file, relative, sorted; weights and config.json included."""
    loaded_config: str
    """The config transformers builds from config.json, as canonical JSON."""


def _relative_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def survey(source: Source) -> _Survey:
    root = Path(source.candidate)
    loaded = _loaded_digests(root, source.architecture)
    tensors = []
    for file in _weight_files(root):
        base, header = _header(root / file)
        data = (root / file).read_bytes()
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            stored = torch.frombuffer(bytearray(data[base + begin:base + end]) or bytearray(1),
                                      dtype=torch.uint8)[:end - begin].view(_DTYPES[info["dtype"]]).view(info["shape"])
            tensors.append(_Tensor(name, file, info["dtype"], tuple(info["shape"]), base + begin, base + end,
                                   _bits_digest(stored) in loaded))
    config_text = (root / "config.json").read_bytes().decode("utf-8")
    config = json.loads(config_text)
    return _Survey(source, sorted(tensors, key=lambda t: t.name), config, config_text, _relative_files(root),
                   _config_as_loaded(config))


# --- mutations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """One change to a copy of a source's fold, and the verdict a sound gate gives it."""

    source: str
    category: str
    kind: str
    target: str
    ops: tuple[tuple[Any, ...], ...]
    """What to do to the directory: see :func:`apply`."""
    expect: str
    """'fail' (the gate must exit non-zero) or 'pass' (exit 0)."""
    ground: str
    """Why: weights-loaded, config-read, plan-read (the plan enjoyln.load reads), file-read,
    layout, policy, or inert."""
    reason: str
    index: int = -1
    seed: int = 0

    def describe(self) -> str:
        return f"#{self.index} {self.source}: {self.category}/{self.kind} {self.target}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("ops")
        return d


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def apply(mutation: Mutation, directory: str | os.PathLike, outside: str | os.PathLike) -> None:
    """Apply ``mutation`` to ``directory`` (a copy of the source's fold). ``outside`` is a
    directory beside it, for files that links out of ``directory`` point to."""
    root, outside = Path(directory), Path(outside)
    outside.mkdir(parents=True, exist_ok=True)
    for op, *args in mutation.ops:
        if op == "bytes":  # (file, offset, base64): overwrite in place
            with open(root / args[0], "r+b") as f:
                f.seek(args[1])
                f.write(base64.b64decode(args[2]))
        elif op == "write":  # (file, base64): create or replace
            target = root / args[0]
            if target.is_symlink():
                target.unlink()
            _write(target, base64.b64decode(args[1]))
        elif op == "truncate":
            os.truncate(root / args[0], args[1])
        elif op == "append":
            with open(root / args[0], "ab") as f:
                f.write(base64.b64decode(args[1]))
        elif op == "delete":
            target = root / args[0]
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        elif op == "fifo":
            os.mkfifo(root / args[0])
        elif op == "link-out":  # (name, base64): a link to a new file outside the directory
            (outside / args[0].replace("/", "_")).write_bytes(base64.b64decode(args[1]))
            (root / args[0]).symlink_to(outside / args[0].replace("/", "_"))
        elif op == "move-out":  # (file): the file moved out of the directory, a link left in its place
            target = outside / args[0].replace("/", "_")
            shutil.move(root / args[0], target)
            (root / args[0]).symlink_to(target)
        elif op == "utime":
            os.utime(root / args[0], (args[1], args[1]))
        elif op == "header":  # (file, header JSON): a new safetensors header, the same data
            _rewrite_header(root / args[0], json.loads(args[1]))
        elif op == "reorder":  # (file, seed)
            _reorder(root / args[0], random.Random(args[1]))
        elif op == "reshard":  # (seed,)
            _reshard(root, random.Random(args[0]))
        elif op == "reformat":  # (file, seed)
            path = root / args[0]
            path.write_bytes(_respace_json(path.read_bytes().decode("utf-8"), random.Random(args[1])).encode("utf-8"))
        else:
            raise ValueError(f"unknown mutation op {op!r}")


def _header_bytes(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data stays 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _rewrite_header(file: Path, header: dict[str, Any]) -> None:
    base, _ = _header(file)
    data = file.read_bytes()[base:]
    file.write_bytes(_header_bytes(header) + data)


def _reorder(file: Path, rng: random.Random) -> None:
    """The same tensors and metadata, laid out in another order, the header's keys shuffled."""
    base, header = _header(file)
    data = file.read_bytes()
    names = [k for k in header if k != "__metadata__"]
    order = names[:]
    while len(order) > 1 and order == names:
        rng.shuffle(order)
    out, chunks, at = {}, [], 0
    for name in order:
        begin, end = header[name]["data_offsets"]
        chunks.append(data[base + begin:base + end])
        out[name] = {**header[name], "data_offsets": [at, at + end - begin]}
        at += end - begin
    keys = list(out) + (["__metadata__"] if "__metadata__" in header else [])
    rng.shuffle(keys)
    shuffled = {k: header["__metadata__"] if k == "__metadata__" else out[k] for k in keys}
    file.write_bytes(_header_bytes(shuffled) + b"".join(chunks))


def _reshard(root: Path, rng: random.Random) -> None:
    """model.safetensors split into two shards and an index, as ``save_pretrained`` writes them."""
    file = root / "model.safetensors"
    base, header = _header(file)
    data = file.read_bytes()
    meta = header.pop("__metadata__", None)
    names = sorted(header)
    cut = rng.randrange(1, len(names))
    weight_map, total = {}, 0
    for i, part in enumerate((names[:cut], names[cut:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        out, chunks, at = ({"__metadata__": meta} if meta is not None else {}), [], 0
        for name in part:
            begin, end = header[name]["data_offsets"]
            chunks.append(data[base + begin:base + end])
            out[name] = {**header[name], "data_offsets": [at, at + end - begin]}
            at += end - begin
            weight_map[name] = shard
        total += at
        (root / shard).write_bytes(_header_bytes(out) + b"".join(chunks))
    file.unlink()
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


# --- JSON, verbatim and edited ---------------------------------------------------------------


def _json_tokens(text: str) -> Iterator[str]:
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
            yield text[i:j + 1]
            i = j + 1
        else:
            j = i
            while j < n and text[j] not in " \t\r\n{}[]:,":
                j += 1
            yield text[i:j]
            i = j


def _same_tokens(a: bytes, b: bytes) -> bool:
    """Whether two byte strings are the same JSON tokens (whitespace between them aside)."""
    try:
        return list(_json_tokens(a.decode("utf-8"))) == list(_json_tokens(b.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, IndexError):  # not JSON text, or an unterminated string
        return False


def _respace_json(text: str, rng: random.Random) -> str:
    """``text`` with other whitespace between its tokens, and nothing else changed."""
    tokens = list(_json_tokens(text))
    while True:
        newline, indent = rng.choice(((None, ""), ("\n", "\t"), ("\r\n", " "), ("\n", "   "), ("", " ")))
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


def _json_style(obj: Any, text: str) -> Callable[[Any], str]:
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
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield prefix + (k,), v
        yield from _paths(v, prefix + (k,))


def _at(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _path_text(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else (f".{k}" if i else str(k)) for i, k in enumerate(path))


_KNOWN_VALUES = {
    "dtype": ["float16", "bfloat16", "float64"], "torch_dtype": ["float16", "bfloat16", "float64"],
    "activation_function": ["gelu", "relu", "silu"], "hidden_act": ["gelu_new", "relu", "silu"],
    "model_type": ["opt", "bert", "gpt2", "vit"], "position_embedding_type": ["relative_key", "absolute"],
    "tokenizer_class": ["GPT2Tokenizer", "BertTokenizer", "PreTrainedTokenizerFast"],
    "image_processor_type": ["CLIPImageProcessor", "ViTImageProcessorFast"], "resample": [0, 3],
}

# Keys worth adding: generation and precision settings a loader applies, and plain unknown keys.
_NEW_KEYS = {
    "do_sample": True, "temperature": 5.0, "top_k": 0, "num_beams": 2, "max_length": 3,
    "repetition_penalty": 2.0, "dtype": "float16", "torch_dtype": "bfloat16", "tie_word_embeddings": True,
    "layer_norm_epsilon": 0.1, "layer_norm_eps": 0.1, "attn_implementation": "eager",
    "output_hidden_states": True, "use_cache": False, "scale_attn_by_inverse_layer_idx": True,
    "rope_theta": 10.0, "pad_token_id": 3, "bos_token_id": 5, "decoder_start_token_id": 2,
    "problem_type": "multi_label_classification", "do_normalize": False, "do_lower_case": True,
    "model_max_length": 4, "chat_template": "{{ messages }}", "x_unused_key": "anything",
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
        return rng.choice([v for v in (value * (1 + 1e-3), value * 2, value + 1.0, 0.5) if v != value])
    if isinstance(value, str):
        return rng.choice([value + "x", value[:-1] if value else "x", value.swapcase() if value.swapcase() != value
                           else value + " "])
    if value is None:
        return rng.choice([0, 1])
    if isinstance(value, list):
        if value and rng.random() < 0.5:
            i = rng.randrange(len(value))
            return value[:i] + [_other_value(rng, None, value[i])] + value[i + 1:]
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


def _edit_json(rng: random.Random, obj: Any, op: str, protected: Callable[[tuple], bool]) -> tuple[Any, str] | None:
    """``obj`` with one edit: change, retype, delete or add. Returns the new object and what was
    done, or None when ``obj`` has nothing to edit that way."""
    obj = copy.deepcopy(obj)
    paths = [(p, v) for p, v in _paths(obj) if not protected(p)]
    if op == "add":
        dicts = [((), obj)] * (isinstance(obj, dict) and not protected(())) + [
            (p, v) for p, v in paths if isinstance(v, dict)]
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


def _config_as_loaded(config: dict[str, Any]) -> str:
    """The config transformers builds from these values, as a dict (or why it cannot)."""
    import transformers

    try:
        values = {k: v for k, v in config.items() if k != "enjoyln"}
        if "model_type" not in values:
            return "no model_type"
        d = transformers.AutoConfig.for_model(values.pop("model_type"), **values).to_dict()
    except Exception as exc:  # any failure is a change of what loads
        return f"{type(exc).__name__}: {exc}"
    for k in ("transformers_version", "_name_or_path", "enjoyln"):
        d.pop(k, None)
    # as text: 32 and 32.0, or true and 1, are equal in Python but not the same JSON value
    return json.dumps(d, sort_keys=True, default=str)


# --- drawing -------------------------------------------------------------------------------

_ELEMENT_KINDS = ("nan", "+inf", "-inf", "+0", "-0", "denormal", "ulp+", "ulp-", "rel+1e-3", "rel-1e-3")


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
        return torch.nextafter(old, torch.full((1,), math.inf if kind == "ulp+" else -math.inf, dtype=dt))
    return (x * (1 + (1e-3 if kind == "rel+1e-3" else -1e-3))).to(dt)


def _draw_weight(rng: random.Random, s: _Survey) -> Mutation | None:
    t = rng.choice([t for t in s.tensors if t.numel])
    kind = rng.choice(_ELEMENT_KINDS)
    i = rng.randrange(t.numel)
    size = _DTYPES[t.dtype].itemsize
    at = t.start + i * size
    with open(Path(s.source.candidate) / t.file, "rb") as f:
        f.seek(at)
        raw = f.read(size)
    old = torch.frombuffer(bytearray(raw), dtype=_DTYPES[t.dtype])
    new = _element_value(rng, kind, old)
    if new is None:
        return None
    new_raw = new.contiguous().view(torch.uint8).numpy().tobytes()
    if new_raw == raw:
        return None  # the draw changes no byte: drawn again
    index = list(torch.unravel_index(torch.tensor(i), t.shape)) if t.shape else []
    where = f"{t.name}[{','.join(str(int(j)) for j in index)}]"
    what = f"{float(old[0]) if old.dtype.is_floating_point else old[0].item()!r} -> " \
           f"{float(new[0]) if new.dtype.is_floating_point else new[0].item()!r}"
    if t.loaded:
        ground, reason = "weights-loaded", f"{t.name} is loaded by both loaders, and one of its elements moves"
    else:
        ground, reason = "policy", f"{t.name} is stored but not loaded: every weight byte is verified"
    return _mutation(s, "weights", kind, f"{where} ({what})", (("bytes", t.file, at, _b64(new_raw)),),
                     "fail", ground, reason)


def _draw_weight_file(rng: random.Random, s: _Survey) -> Mutation | None:
    file = rng.choice(sorted({t.file for t in s.tensors}))
    path = Path(s.source.candidate) / file
    base, header = _header(path)
    size = path.stat().st_size
    kind = rng.choice(("relabel-dtype", "reshape", "swap-names", "append-bytes", "truncate"))
    header = copy.deepcopy(header)
    names = [t.name for t in s.tensors if t.file == file and t.numel]
    if kind == "relabel-dtype":
        options = [n for n in names if header[n]["dtype"] in ("F32", "I32", "F16", "I16", "BF16")]
        if not options:
            return None
        name = rng.choice(options)
        new = {"F32": "I32", "I32": "F32", "F16": "BF16", "BF16": "F16", "I16": "F16"}[header[name]["dtype"]]
        target = f"{file} {name}: dtype {header[name]['dtype']} -> {new}"
        header[name]["dtype"] = new
        ground, reason = ("weights-loaded" if _loaded(s, name) else "policy",
                          "the same bytes read as another dtype are other values")
    elif kind == "reshape":
        options = [n for n in names if len(set(header[n]["shape"])) > 1]
        if not options:
            return None
        name = rng.choice(options)
        shape = header[name]["shape"]
        new = shape[::-1]
        target = f"{file} {name}: shape {shape} -> {new}"
        header[name]["shape"] = new
        ground, reason = ("weights-loaded" if _loaded(s, name) else "policy",
                          "a tensor of another shape does not load as the same parameter")
    elif kind == "swap-names":
        by_shape: dict[tuple, list[str]] = {}
        for n in names:
            by_shape.setdefault((header[n]["dtype"], tuple(header[n]["shape"])), []).append(n)
        pairs = [v for v in by_shape.values() if len(v) > 1]
        if not pairs:
            return None
        a, b = rng.sample(rng.choice(pairs), 2)
        path_bytes = (Path(s.source.candidate) / file).read_bytes()
        if path_bytes[base + header[a]["data_offsets"][0]:base + header[a]["data_offsets"][1]] == \
                path_bytes[base + header[b]["data_offsets"][0]:base + header[b]["data_offsets"][1]]:
            return None
        header[a], header[b] = header[b], header[a]
        target = f"{file}: {a} and {b} swap places"
        ground, reason = ("weights-loaded" if _loaded(s, a) or _loaded(s, b) else "policy",
                          "each name now holds the other tensor's values")
    elif kind == "append-bytes":
        extra = bytes(rng.randrange(256) for _ in range(rng.choice((1, 8, 64))))
        return _mutation(s, "weight-file", kind, f"{file} + {len(extra)} bytes", (("append", file, _b64(extra)),),
                         "fail", "policy", "every weight byte is verified: bytes after the last tensor")
    else:
        n = rng.randrange(base, size)
        return _mutation(s, "weight-file", kind, f"{file} cut to {n} of {size} bytes", (("truncate", file, n),),
                         "fail", "weights-loaded", "the last tensors lose their bytes")
    return _mutation(s, "weight-file", kind, target, (("header", file, json.dumps(header)),), "fail", ground, reason)


def _loaded(s: _Survey, name: str) -> bool:
    return any(t.name == name and t.loaded for t in s.tensors)


def _config_ground(s: _Survey, new: dict[str, Any], path: tuple) -> tuple[str, str]:
    if path and path[0] == "enjoyln":
        if path == ("enjoyln",):
            return "plan-read", ("without the block nothing says how the affines moved or the stream turned, "
                                 "and enjoyln.load runs the norms as LayerNorms")
        return "policy", "the enjoyln block must be exactly what the confirmed plan gives"
    if _config_as_loaded(new) != s.loaded_config:
        return "config-read", "transformers builds another config from it"
    return "policy", "config.json is compared as parsed JSON values"


def _draw_config(rng: random.Random, s: _Survey, block: bool) -> Mutation | None:
    op = rng.choice(("change", "change", "retype", "delete", "add") if not block else
                    ("change", "change", "retype", "delete", "add", "delete-block"))
    if op == "delete-block":
        new = {k: v for k, v in s.config.items() if k != "enjoyln"}
        done, path = "delete the whole enjoyln block", ("enjoyln",)
    else:
        def protected(p: tuple) -> bool:
            inside = bool(p) and p[0] == "enjoyln"
            # the version string is the one change of the block that is owed a pass: drawn as inert
            return (not inside if block else inside) or p == ("enjoyln", "version") or (block and p == ())
        edited = _edit_json(rng, s.config, op, protected)
        if edited is None:
            return None
        new, done = edited
        path = _changed_path(s.config, new)
    ground, reason = _config_ground(s, new, path)
    text = _json_style(s.config, s.config_text)(new)
    plan = s.config.get("enjoyln", {}).get("plan", {})
    moved = bool(plan.get("rotation")) or any(e.get("affine") for e in plan.get("layer_norms", []))
    if op == "delete-block" and not moved:
        # what save_pretrained of an in-memory fold writes: LayerNorms that see zero-mean inputs, which
        # compute the fold's function (to rounding) and which the gate judges as a fold without a plan
        return _mutation(s, "enjoyln-block", op, done, (("write", "config.json", _b64(text.encode())),), "pass",
                         "equivalent", "the plain folded form (enjoyln.fold then save_pretrained): enjoyln.load "
                         "runs its LayerNorms on zero-mean inputs, the fold's function to rounding")
    return _mutation(s, "enjoyln-block" if block else "config", op, done,
                     (("write", "config.json", _b64(text.encode())),), "fail", ground, reason)


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


def _other_files(s: _Survey) -> list[str]:
    weights = {t.file for t in s.tensors} | {"model.safetensors.index.json", "config.json"}
    return [f for f in s.files if f not in weights]


def _file_ground(s: _Survey, file: str) -> tuple[str, str]:
    if file in s.source.read_files:
        return "file-read", f"{file} is read by this directory's loaders"
    return "policy", "every other file is compared by content, whatever its name"


def _draw_file(rng: random.Random, s: _Survey, others: dict[str, dict[str, bytes]]) -> Mutation | None:
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
        if parsed is not None and _same_tokens(data, data[:i] + new + data[i + 1:]):
            return None  # whitespace for whitespace between tokens: drawn as inert elsewhere
        return _mutation(s, "files", kind, f"{file} byte {i}: {data[i]:#04x} -> {new[0]:#04x}",
                         (("bytes", file, i, _b64(new)),), "fail", ground, reason)
    if kind == "truncate":
        if not data:
            return None
        n = rng.randrange(len(data))
        if parsed is not None and _same_tokens(data, data[:n]):
            return None  # only trailing whitespace cut
        return _mutation(s, "files", kind, f"{file} cut to {n} of {len(data)} bytes", (("truncate", file, n),),
                         "fail", ground, reason)
    if kind == "replace":
        theirs = [d[file] for name, d in sorted(others.items()) if name != s.source.name and file in d
                  and d[file] != data]
        new = rng.choice(theirs) if theirs else bytes(rng.randrange(256) for _ in range(max(len(data), 1)))
        return _mutation(s, "files", kind, f"{file} replaced by {'another source' if theirs else 'random'}'s "
                                           f"{len(new)} bytes", (("write", file, _b64(new)),), "fail", ground, reason)
    if kind == "swap-lines":
        lines = text.splitlines(keepends=True)
        while True:
            i, j = rng.sample(range(len(lines)), 2)
            if lines[i].rstrip("\r\n") != lines[j].rstrip("\r\n"):
                break
        a, b = lines[i], lines[j]
        lines[i], lines[j] = b.rstrip("\r\n") + a[len(a.rstrip("\r\n")):], a.rstrip("\r\n") + b[len(b.rstrip("\r\n")):]
        return _mutation(s, "files", kind, f"{file} lines {i + 1} and {j + 1} swapped",
                         (("write", file, _b64("".join(lines).encode()),),), "fail", ground, reason)
    edited = _edit_json(rng, parsed, kind[5:], lambda p: False)
    if edited is None:
        return None
    new_obj, done = edited
    if kind == "json-add" or "transformers_version" in done:
        # a key the loader may not know, or the version stamp every saved config gets anew
        ground, reason = "policy", "every other file is compared by content, whatever its name"
    return _mutation(s, "files", kind, f"{file}: {done}",
                     (("write", file, _b64(_json_style(parsed, text)(new_obj).encode())),), "fail", ground, reason)


# Files a directory may gain: each read by some loader or tool (tokenizers of other models,
# sentence-transformers, remote code, other weight formats), or by none.
_EXTRA_FILES = {
    "generation_config.json": json.dumps({"do_sample": True, "temperature": 5.0, "top_k": 0}),
    "added_tokens.json": json.dumps({"<new>": 99}), "special_tokens_map.json": json.dumps({"eos_token": "<unk>"}),
    "chat_template.jinja": "{{ messages[0]['content'] }}", "chat_template.json": json.dumps({"chat_template": "x"}),
    "tokenizer.json": None, "vocab.json": json.dumps({"a": 0}), "merges.txt": "#version: 0.2\na b\n",
    "vocab.txt": "a\nb\n", "bpe.codes": "a b 1\n", "dict.txt": "a 1\n", "emoji.json": json.dumps({"emoji": {}}),
    "entity_vocab.json": json.dumps({"[PAD]": 0}), "normalizer.json": json.dumps({"colour": "color"}),
    "source.spm": None, "tokenizer.model": None, "spiece.model": None, "preprocessor_config.json":
    json.dumps({"do_normalize": True}), "processor_config.json": json.dumps({"processor_class": "X"}),
    "modules.json": json.dumps([]), "1_Pooling/config.json": json.dumps({"pooling_mode_cls_token": True}),
    "notes.txt": "hello\n", "onnx/model.onnx": None, ".hidden": "x", "modeling_custom.py": "import os\n",
    "pytorch_model.bin": None, "tf_model.h5": None, "flax_model.msgpack": None,
    "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": {}}),
    "model-00002-of-00002.safetensors": None, "model.safetensors.bak": None,
}


def _draw_extra_missing(rng: random.Random, s: _Survey, spm: bytes) -> Mutation | None:
    if rng.random() < 0.5:
        file = rng.choice(s.files)
        weights = {t.file for t in s.tensors}
        ground, reason = ("layout", f"no loader can load without {file}") if file in weights | {"config.json"} \
            else _file_ground(s, file)
        return _mutation(s, "extra-missing", "missing", f"{file} removed", (("delete", file),), "fail", ground,
                         reason if ground != "policy" else "a missing file fails")
    if rng.random() < 0.2:
        if rng.random() < 0.5:
            return _mutation(s, "extra-missing", "fifo", "a FIFO named pipe", (("fifo", "pipe"),), "fail", "policy",
                             "a special file, which a fold never writes: its name does not prove that no "
                             "loader opens it (and one that did would block)")
        name = rng.choice(("notes.txt", "LICENSE", "model-card.md", "bpe.codes"))
        if name in s.files:
            return None
        return _mutation(s, "extra-missing", "link-out", f"{name}: a link out of the directory",
                         (("link-out", name, _b64(b"x\n")),), "fail", "policy",
                         "an extra file, served through a link: a fold never writes links, and a name does not "
                         "prove that no loader reads it (bpe.codes is PhoBERT's)")
    file = rng.choice([f for f in _EXTRA_FILES if f not in s.files])
    content = _EXTRA_FILES[file]
    if content is None:
        if file.endswith("model"):
            data = spm
        elif file.endswith(".safetensors"):
            data = _header_bytes({"extra.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}) + bytes(4)
        else:
            data = bytes(rng.randrange(256) for _ in range(64))
    else:
        data = content.encode()
    return _mutation(s, "extra-missing", "extra", f"{file} added ({len(data)} bytes)", (("write", file, _b64(data)),),
                     "fail", "policy", "an extra file fails, whether or not a loader reads it")


_INERT_KINDS = ("config-reformat", "json-respace", "enjoyln-version", "vcs", "metadata", "mtime",
                "weights-reorder", "reshard", "cache-links")
# Files the README says are followed through a link out of the directory (the Hugging Face cache
# links every file to a blob): served that way, the same bytes reach every loader.
_CACHE_LINKED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "vocab.json", "vocab.txt", "merges.txt", "preprocessor_config.json")


def _draw_inert(rng: random.Random, s: _Survey) -> Mutation | None:
    kind = rng.choice(_INERT_KINDS)
    if kind == "config-reformat":
        def shuffled(o: Any) -> Any:
            if isinstance(o, dict):
                keys = list(o)
                rng.shuffle(keys)
                return {k: shuffled(o[k]) for k in keys}
            return [shuffled(v) for v in o] if isinstance(o, list) else o
        text = json.dumps(shuffled(s.config), indent=rng.choice((None, 0, 1, 3, "\t")),
                          separators=rng.choice(((",", ":"), (", ", ": "), (" ,", " :  "))),
                          ensure_ascii=rng.random() < 0.5) + rng.choice(("", "\n", "\r\n"))
        assert json.loads(text) == s.config
        return _mutation(s, "inert", kind, "config.json re-serialised: other whitespace and key order",
                         (("write", "config.json", _b64(text.encode())),), "pass", "inert",
                         "Python's json reads both texts into equal dicts; nothing reads the key order")
    if kind == "json-respace":
        files = [f for f in _other_files(s) if f.endswith(".json")]
        if not files:
            return None
        file = rng.choice(files)
        return _mutation(s, "inert", kind, f"{file} re-spaced, every token kept verbatim",
                         (("reformat", file, rng.randrange(2**31)),), "pass", "inert",
                         "whitespace between JSON tokens is not part of the value for any JSON parser")
    if kind == "enjoyln-version":
        new = copy.deepcopy(s.config)
        new["enjoyln"]["version"] = rng.choice(("0.0.1", "9.9.9", "0.1.0+local", "1.0.0rc1"))
        if new == s.config:
            return None
        text = _json_style(s.config, s.config_text)(new)
        return _mutation(s, "inert", kind, f"enjoyln.version -> {new['enjoyln']['version']}",
                         (("write", "config.json", _b64(text.encode())),), "pass", "inert",
                         "the writing tool's version: enjoyln.load reads only the plan, transformers "
                         "nothing of the block, and the policy sets it aside")
    if kind == "vcs":
        vcs = rng.choice((".git", ".hg", ".svn"))
        ops = (("write", f"{vcs}/HEAD", _b64(b"ref: refs/heads/main\n")),
               ("write", f"{vcs}/objects/ab/cdef", _b64(bytes(rng.randrange(256) for _ in range(32)))))
        return _mutation(s, "inert", kind, f"{vcs}/ added", ops, "pass", "inert",
                         "version-control data: no loader reads it, and a fold skips it")
    if kind == "metadata":
        file = rng.choice(sorted({t.file for t in s.tensors}))
        _, header = _header(Path(s.source.candidate) / file)
        header = copy.deepcopy(header)
        meta = header.setdefault("__metadata__", {})
        if rng.random() < 0.5:
            new = rng.choice([f for f in ("tf", "flax", "mlx", "np") if f != meta.get("format")])
            target, meta["format"] = f"{file} __metadata__.format -> {new}", new
        else:
            target, meta["x_note"] = f"{file} __metadata__.x_note added", "anything"
        return _mutation(s, "inert", kind, target, (("header", file, json.dumps(header)),), "pass",
                         "inert", "transformers 5 reads a safetensors header's __metadata__ only in its torchao "
                         "quantizer (which needs a quantization_config in config.json, compared like any key); "
                         "safetensors and enjoyln.load read none of it")
    if kind == "mtime":
        file = rng.choice(s.files)
        return _mutation(s, "inert", kind, f"{file} touched", (("utime", file, rng.randrange(10**9, 16 * 10**8)),),
                         "pass", "inert", "no loader reads a file's times")
    if kind == "weights-reorder":
        file = rng.choice(sorted({t.file for t in s.tensors}))
        return _mutation(s, "inert", kind, f"{file} rewritten: another tensor order and header key order",
                         (("reorder", file, rng.randrange(2**31)),), "pass", "inert",
                         "safetensors finds each tensor by name through the header's offsets")
    if kind == "reshard":
        if _weight_files(Path(s.source.candidate)) != ["model.safetensors"]:
            return None
        return _mutation(s, "inert", kind, "model.safetensors split into two shards and an index",
                         (("reshard", rng.randrange(2**31)),), "pass", "inert",
                         "both loaders read the same tensors by name through the index")
    files = [f for f in _CACHE_LINKED if f in s.files]
    chosen = rng.sample(files, rng.randint(1, len(files)))
    return _mutation(s, "inert", kind, f"{', '.join(sorted(chosen))} served through links out of the directory",
                     tuple(("move-out", f) for f in sorted(chosen)), "pass", "inert",
                     "the Hugging Face cache layout: every loader reads the same bytes through the link")


def _mutation(s: _Survey, category: str, kind: str, target: str, ops: tuple, expect: str, ground: str,
              reason: str) -> Mutation:
    return Mutation(s.source.name, category, kind, target, ops, expect, ground, reason)


CATEGORIES = {"weights": 34, "weight-file": 5, "config": 16, "enjoyln-block": 9, "files": 16, "extra-missing": 10,
              "inert": 10}
"""How often each category is drawn (relative weights)."""


def draw(sources: Sequence[Source], n: int, seed: int = 0) -> list[Mutation]:
    """``n`` mutations, the ``i``-th drawn from ``sources[i % len(sources)]`` with its own
    generator seeded by ``(seed, i)``: one mutation can be drawn again alone, and the list
    is the same on every machine for the same sources.

    >>> draw(sources, 3, seed=0)[2].describe()  # doctest: +SKIP
    '#2 gpt2-rotated: weights/nan transformer.wte.weight[17,3] (0.0132 -> nan)'
    """
    _quiet()
    surveys = [survey(s) for s in sources]
    spm = _sentencepiece_model()
    contents = {s.source.name: {f: (Path(s.source.candidate) / f).read_bytes() for f in _other_files(s)}
                for s in surveys}
    names, weights = list(CATEGORIES), list(CATEGORIES.values())
    out = []
    for i in range(n):
        s = surveys[i % len(surveys)]
        rng = random.Random(f"{seed}:{i}")
        while True:
            category = rng.choices(names, weights)[0]
            m = (_draw_weight(rng, s) if category == "weights" else
                 _draw_weight_file(rng, s) if category == "weight-file" else
                 _draw_config(rng, s, block=category == "enjoyln-block") if category in ("config", "enjoyln-block")
                 else _draw_file(rng, s, contents) if category == "files" else
                 _draw_extra_missing(rng, s, spm) if category == "extra-missing" else _draw_inert(rng, s))
            if m is not None:
                break
        out.append(Mutation(**{**m.__dict__, "index": i, "seed": seed}))
    return out


# --- observing what loaders compute ------------------------------------------------------------

_TEXTS = ["hello world", "the quick brown fox", "xin chào thế giới", "\U0001F600 \U0001F44D!", "<|endoftext|> a"]


def _inputs(source: Source) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    if source.kind == "image":
        size = 16
        return [{"pixel_values": torch.randn(b, 3, size, size, generator=gen)} for b in (1, 2)]
    return [{"input_ids": torch.randint(0, 128, (b, t), generator=gen)} for b, t in ((1, 5), (2, 16), (1, 1))]


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.dtype.__repr__().encode() + str(tuple(t.shape)).encode() + t.view(-1).view(torch.uint8).numpy().tobytes()


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(_bits(tensors[name]))
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
            out = model(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()})
            tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
            obs[f"outputs[{i}]"] = tensors
        if source.kind == "lm":
            torch.manual_seed(0)  # a sampling config then samples the same way on both
            obs["generate"] = model.generate(inputs[0]["input_ids"], max_new_tokens=6,
                                             attention_mask=torch.ones_like(inputs[0]["input_ids"])).tolist()
    return obs


def observe(directory: str | os.PathLike, source: Source) -> dict[str, Any]:
    """What a user gets from ``directory``, bit for bit: the config transformers builds, the state
    dict and outputs (and greedy or configured generation) of ``from_pretrained`` and of
    ``enjoyln.load`` on seeded inputs, the tokenizer's ids for a few texts, the image
    processor's pixels. A loader that fails is recorded with its error."""
    import transformers

    from ...store.load import load

    root = Path(directory)
    obs: dict[str, Any] = {}
    obs["config"] = _attempt(lambda: _config_as_loaded_dir(root), root)
    obs["enjoyln.load:plan"] = _attempt(lambda: _plan_as_loaded(root), root)
    cls = getattr(transformers, source.architecture)
    for loader, make in (("from_pretrained", lambda: cls.from_pretrained(root)), ("enjoyln.load", lambda: load(root))):
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
            obs[f"{loader}:generation_config"] = json.dumps(model.generation_config.to_dict(), sort_keys=True,
                                                            default=str)
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
            pixels = _digest({"pixel_values": proc(images=img, return_tensors="pt")["pixel_values"]})
            return json.dumps([pixels, proc.to_dict()], sort_keys=True, default=str)
        obs["image_processor"] = _attempt(pixels, root)
    else:
        obs["tokenizer"] = _attempt(lambda: _tokenizer_state(transformers.AutoTokenizer.from_pretrained(root), root),
                                    root)
    return obs


def _tokenizer_state(tok: Any, root: Path) -> str:
    """Everything a loaded tokenizer holds that decides its ids, as text: its encodings of a few
    texts, its vocabulary and special tokens, its init arguments, the whole of a fast
    tokenizer's pipeline, and a slow tokenizer's plain-data attributes (PhoBERT's BPE ranks,
    GPT-NeoX-Japanese's emoji table)."""
    state: dict[str, Any] = {"class": type(tok).__name__, "ids": [tok(t)["input_ids"] for t in _TEXTS],
                             "vocab": sorted(tok.get_vocab().items()), "special": tok.all_special_tokens,
                             "init": tok.init_kwargs}
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        state["pipeline"] = backend.to_str()
    else:
        state["attributes"] = {k: v for k, v in vars(tok).items()
                               if isinstance(v, (dict, list, tuple, str, int, float, bool)) and not k.startswith("_")}
    return json.dumps(_plain(state), sort_keys=True, default=str).replace(str(root), "<dir>")


def _plain(o: Any) -> Any:
    """``o`` with every mapping as a sorted list of pairs (PhoBERT's BPE ranks are keyed by tuples)."""
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
    from ...store.model_dir import open_model_dir
    from ...store.block import recorded_plan

    plan = recorded_plan(open_model_dir(root))
    return json.dumps(plan.to_dict() if plan is not None else None, sort_keys=True)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _bits(a) == _bits(b)
    return type(a) is type(b) and a == b


def differences(base: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """What ``other`` computes differently from ``base`` (two :func:`observe` results); empty
    when the two are the same bit for bit."""
    out = []
    for key in sorted(base.keys() | other.keys()):
        a, b = base.get(key), other.get(key)
        if _same(a, b):
            continue
        tensors = isinstance(a, dict) and isinstance(b, dict) and all(
            isinstance(v, torch.Tensor) for v in (*a.values(), *b.values()))
        if tensors:
            parts = []
            for name in sorted(a.keys() & b.keys()):
                x, y = a[name].double(), b[name].double()
                if x.shape != y.shape:
                    parts.append(f"{name} shape {list(x.shape)} -> {list(y.shape)}")
                elif _bits(a[name]) != _bits(b[name]):
                    nonfinite = int((~torch.isfinite(y) & torch.isfinite(x)).sum())
                    diff = float((x - y).abs().nan_to_num(math.inf).max()) if x.numel() else 0.0
                    parts.append(f"{name} max abs diff {diff:.3g}" + (f", {nonfinite} non-finite" if nonfinite else ""))
            out.append(f"{key}: {'; '.join(parts) or 'other outputs'}")
        elif key in ("config", "enjoyln.load:plan") and isinstance(a, str) and isinstance(b, str) \
                and a.startswith("{") and b.startswith("{"):
            x, y = json.loads(a), json.loads(b)
            keys = sorted(k for k in x.keys() | y.keys() if json.dumps(x.get(k)) != json.dumps(y.get(k)))
            out.append(f"{key}: " + ", ".join(f"{k} {_short(x.get(k, '(absent)'))} -> {_short(y.get(k, '(absent)'))}"
                                              for k in keys[:4]))
        elif key == "tokenizer" and isinstance(a, str) and isinstance(b, str) and a.startswith("[") \
                and b.startswith("["):
            x, y = dict(map(tuple, json.loads(a))), dict(map(tuple, json.loads(b)))  # _plain's pairs
            keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
            out.append(f"tokenizer: its {', '.join(k.strip(chr(39)) for k in keys)} differ")
        else:
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


# --- judging -------------------------------------------------------------------------------


@dataclass
class Result:
    """The gate's verdict on one mutation."""

    mutation: Mutation
    exit_code: int | None
    """0 pass, 1 fail, 2 refused as bad input; None if the gate did not finish in time."""
    message: str
    seconds: float
    effect: list[str] | None = None
    """What the mutation changes for a user (see :func:`differences`), when observed."""

    @property
    def correct(self) -> bool:
        if self.exit_code is None:
            return False
        return (self.exit_code != 0) == (self.mutation.expect == "fail")

    def describe(self) -> str:
        m = self.mutation
        said = {0: "exit 0 (pass)", 1: "exit 1 (fail)", 2: "exit 2 (refused)", None: "no verdict (timed out)"}
        lines = [f"{m.describe()}", f"    expected {'non-zero' if m.expect == 'fail' else 'exit 0'} "
                 f"[{m.ground}]: {m.reason}", f"    the gate said {said.get(self.exit_code, self.exit_code)}"
                 + (f": {self.message}" if self.message else "")]
        if self.effect is not None:
            lines.append("    what a user gets: " + ("; ".join(self.effect) if self.effect else
                                                      "the same, bit for bit, from every loader observed"))
        return "\n".join(lines)


class _Timeout(BaseException):
    """Not an Exception: the command line turns every Exception into exit 2, and a gate that
    never answers must not count as one that refused."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(*_: Any) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def gate(reference: str | os.PathLike, candidate: str | os.PathLike) -> tuple[int, str]:
    """``enjoyln check REFERENCE CANDIDATE``, the command line itself run in process: its exit
    code, and the first line of its output that says why (empty for a pass)."""
    from typer.testing import CliRunner

    from ...cli.app import app

    result = CliRunner().invoke(app, ["check", str(reference), str(candidate)])
    lines = [line.strip() for line in result.output.splitlines() if line.strip()]
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # only with ENJOYLN_DEBUG set does an exception get past the command line's handler
        exc = result.exception
        return 2, f"{type(exc).__name__} (unforeseen): {first_line(exc, '')}"
    if result.exit_code == 0:
        return 0, ""
    why = next((line for line in lines if line.startswith("error:") or "[FAIL]" in line or "DIFFERENT" in line),
               lines[0] if lines else "")
    if "ENJOYLN_DEBUG" in why:
        why = why.replace("error: ", "", 1).replace(":", " (unforeseen):", 1)
    return result.exit_code, why


_state: dict[str, Any] = {}


def _quiet() -> None:
    """Loading warnings (unexpected keys, a missing torchvision) for every mutant would bury the score."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


def _init_worker() -> None:
    torch.set_num_threads(1)  # two workers on two cores: more threads only contend
    _quiet()
    _state["tmp"] = Path(tempfile.mkdtemp(prefix="enjoyln-mutation-"))


@dataclass(frozen=True)
class Observe:
    """Which mutants are also loaded to see what the mutation changes for a user
    (``Result.effect``): wrong verdicts, mutations owed a pass (the proof that they are
    inert), these mutation indices, or all."""

    wrong: bool = True
    inert: bool = False
    indices: frozenset[int] = frozenset()
    all: bool = False

    def __call__(self, result: Result) -> bool:
        m = result.mutation
        return (self.all or (self.wrong and not result.correct) or (self.inert and m.expect == "pass")
                or m.index in self.indices)


def judge(source: Source, mutation: Mutation, *, observe: Observe = Observe(), timeout: float = 120.0) -> Result:
    """Apply ``mutation`` to a fresh copy of ``source``'s fold, run the gate on it, and observe
    the mutant if ``observe`` says so."""
    if "tmp" not in _state:
        _init_worker()
    work = _state["tmp"] / f"m{mutation.index}-{os.getpid()}"
    candidate = work / "candidate"
    try:
        shutil.copytree(source.candidate, candidate, symlinks=True)
        apply(mutation, candidate, work / "outside")
        start = time.perf_counter()
        try:
            with _deadline(timeout):
                code, message = gate(source.reference, candidate)
        except _Timeout:
            code, message = None, f"no verdict within {timeout:.0f} s"
        result = Result(mutation, code, message, time.perf_counter() - start)
        if observe(result):
            result.effect = effect(source, candidate, timeout=timeout)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def effect(source: Source, candidate: str | os.PathLike, *, timeout: float = 120.0) -> list[str]:
    """What ``candidate`` computes differently from ``source``'s unmutated fold, for a user."""
    key = f"base:{source.name}"
    try:
        with _deadline(timeout):
            if key not in _state:
                _state[key] = observe(source.candidate, source)
            return differences(_state[key], observe(candidate, source))
    except _Timeout:
        return [f"a loader did not finish within {timeout:.0f} s"]


def _judge_task(task: tuple[Source, Mutation, Observe]) -> Result:
    return judge(task[0], task[1], observe=task[2])


def judge_all(sources: Sequence[Source], mutations: Sequence[Mutation], *, workers: int = 2,
              observe: Observe = Observe(), progress: Callable[[int, int], None] | None = None) -> list[Result]:
    """Judge every mutation (see :func:`judge`), in ``workers`` processes (0: in this one), in order."""
    by_name = {s.name: s for s in sources}
    tasks = [(by_name[m.source], m, observe) for m in mutations]
    if workers <= 0:
        results = []
        for i, t in enumerate(tasks):
            results.append(_judge_task(t))
            if progress:
                progress(i + 1, len(tasks))
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent has run torch's thread pools, which a forked child can inherit locked
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker) as pool:
        results = []
        for i, r in enumerate(pool.map(_judge_task, tasks, chunksize=4)):
            results.append(r)
            if progress:
                progress(i + 1, len(tasks))
        return results


def score(results: Sequence[Result]) -> dict[str, dict[str, Any]]:
    """Per category (and ``"all"``): mutations, how many must fail and pass, how many the gate
    got wrong (false passes, false failures) and the score (the share it got right)."""
    rows: dict[str, dict[str, Any]] = {}
    for r in results:
        for key in (r.mutation.category, "all"):
            row = rows.setdefault(key, {"n": 0, "must_fail": 0, "must_pass": 0, "false_pass": 0,
                                        "false_fail": 0, "seconds": 0.0})
            row["n"] += 1
            row["must_fail" if r.mutation.expect == "fail" else "must_pass"] += 1
            if not r.correct:
                row["false_pass" if r.mutation.expect == "fail" else "false_fail"] += 1
            row["seconds"] += r.seconds
    for row in rows.values():
        row["score"] = 1 - (row["false_pass"] + row["false_fail"]) / row["n"]
    order = [c for c in CATEGORIES if c in rows] + [c for c in rows if c not in CATEGORIES and c != "all"] + ["all"]
    return {k: rows[k] for k in order}


def tree_digest(directory: str | os.PathLike) -> str:
    """A digest of every file's path and bytes under ``directory``: the gate must not change
    its inputs."""
    h = hashlib.sha256()
    root = Path(directory)
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()
