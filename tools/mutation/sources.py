"""The directories mutations start from: tiny perturbed models and their checked folds, made
with the command line, and a survey of what each fold holds, read from its files without the
gate's code."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


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


_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "a model computes what it computes",
    "layer norm folds into rms norm",
    "every weight byte is verified",
]


def _gpt2_reference(path: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    from enjoyln.testing import perturb, tiny_model

    model = perturb(
        tiny_model("gpt2", seed=seed, n_layer=1, n_embd=32, n_head=2, n_positions=16), seed=seed
    )
    # as in the hub's gpt2: a nested dict that no model reads
    model.config.task_specific_params = {"text-generation": {"do_sample": True, "max_length": 50}}
    model.save_pretrained(path)
    # Old GPT-2 checkpoints store the attention mask buffers, which transformers no longer
    # loads: tensors stored but not loaded, whose bytes the gate must still verify.
    weights = load_file(path / "model.safetensors")
    weights["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    weights["transformer.h.0.attn.bias"] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _bert_without_pooler(path: Path, seed: int) -> None:
    """A BertModel whose checkpoint lacks ``pooler.dense.*`` (as all-mpnet-base-v2's lacks the
    masked-LM head its config names): every load of it initialises those at random."""
    from safetensors.torch import load_file, save_file

    from enjoyln.testing import perturb, tiny_model

    model = perturb(
        tiny_model(
            "bert",
            seed=seed,
            num_hidden_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
        ),
        seed=seed,
    )
    model.save_pretrained(path)
    weights = {
        k: v
        for k, v in load_file(path / "model.safetensors").items()
        if not k.startswith("pooler.")
    }
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _bpe_tokenizer(path: Path) -> None:
    """A real BPE tokenizer trained on a few sentences: tokenizer.json, and vocab.json and
    merges.txt beside it, as GPT-2 repositories have."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        _CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=100, show_progress=False, special_tokens=["<unk>", "<|endoftext|>"]
        ),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    ).save_pretrained(path)
    tok.model.save(str(path))


def _japanese_tokenizer(path: Path) -> None:
    """GPT-NeoX-Japanese's pure-Python tokenizer, which reads vocab.txt and emoji.json."""
    chars = sorted(set("".join(_CORPUS)) - {" "})
    vocab = [
        "<|endoftext|>",
        "<|startoftext|>",
        "<SP>",
        "<|emoji1|>",
        "<|emoji2|>",
        *chars,
        *[f"<|byte{i}|>" for i in range(32)],
    ]
    (path / "vocab.txt").write_text("".join(f"{v}\n" for v in vocab), encoding="utf-8")
    emoji = {
        "emoji": {"\U0001f600": "<|emoji1|>", "\U0001f44d": "<|emoji2|>"},
        "emoji_inv": {"<|emoji1|>": "\U0001f600", "<|emoji2|>": "\U0001f44d"},
    }
    (path / "emoji.json").write_text(json.dumps(emoji, ensure_ascii=False), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPTNeoXJapaneseTokenizer"}, indent=2) + "\n"
    )


def _phobert_tokenizer(path: Path) -> None:
    """PhoBERT's tokenizer, which reads vocab.txt and a BPE file named bpe.codes."""
    words = [
        "dog",
        "fox",
        "hello",
        "the",
        "world",
    ]  # few, so that every id is within the model's vocabulary
    pieces = sorted({w[:i] for w in words for i in range(1, len(w) + 1)} | set("".join(words)))
    (path / "vocab.txt").write_text(
        "".join(f"{p} 1\n" for p in pieces) + "".join(f"{p}@@ 1\n" for p in pieces),
        encoding="utf-8",
    )
    merges = [f"{w[:i]} {w[i]} 1\n" for w in words for i in range(1, len(w))]
    (path / "bpe.codes").write_text("".join(dict.fromkeys(merges)), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PhobertTokenizer"}, indent=2) + "\n"
    )


def sentencepiece_model() -> bytes:
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

    from enjoyln.cli.app import app

    result = CliRunner().invoke(app, list(args))
    if result.exit_code != 0:
        raise RuntimeError(
            f"enjoyln {' '.join(args)} exited {result.exit_code}: {result.output[-2000:]}"
        )


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
    - ``vit-bf16``: the same in bfloat16, which the gate judges by its half-precision criterion;
    - ``bert-nopooler``: a plain fold of a BertModel saved without ``pooler.dense.*``, which its
      class builds and transformers then initialises at random on every load.

    >>> [s.name for s in build_sources(tmp)]  # doctest: +SKIP
    ['gpt2', 'gpt2-fused', 'gpt2-rotated', 'bert', 'vit', 'vit-bf16', 'bert-nopooler']
    """
    from transformers import ViTImageProcessor

    from enjoyln.testing import perturb, tiny_model

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    gpt2, gpt2_ja, bert, vit, vit16, bert_np = (
        root / n
        for n in (
            "ref-gpt2",
            "ref-gpt2-ja",
            "ref-bert",
            "ref-vit",
            "ref-vit-bf16",
            "ref-bert-nopooler",
        )
    )

    _gpt2_reference(gpt2, seed=1)
    _bpe_tokenizer(gpt2)
    (gpt2 / "README.md").write_text("# tiny GPT-2\n\nRandom weights, for testing.\n")
    (gpt2 / "spiece.model").write_bytes(sentencepiece_model())
    (gpt2 / "onnx").mkdir()
    (gpt2 / "onnx" / "notes.txt").write_text("exported elsewhere\n")

    _gpt2_reference(gpt2_ja, seed=2)
    _japanese_tokenizer(gpt2_ja)

    model = perturb(
        tiny_model(
            "bert",
            seed=3,
            num_hidden_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
        ),
        seed=3,
    )
    model.save_pretrained(bert)
    _phobert_tokenizer(bert)
    (bert / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ],
            indent=2,
        )
    )
    (bert / "1_Pooling").mkdir()
    (bert / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}, indent=2)
    )

    model = perturb(
        tiny_model(
            "vit",
            seed=4,
            num_hidden_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
            num_labels=3,
        ),
        seed=4,
    )
    model.save_pretrained(vit)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(vit)
    model = perturb(
        tiny_model(
            "vit",
            seed=5,
            num_hidden_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
            num_labels=3,
        ),
        seed=5,
    )
    model.to(torch.bfloat16).save_pretrained(vit16)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(vit16)

    _bert_without_pooler(bert_np, seed=6)
    _phobert_tokenizer(bert_np)

    _run_cli("fold", str(gpt2), str(root / "gpt2"))
    _run_cli("fold", str(gpt2), str(root / "gpt2-fused"), "--fuse-affine")
    _run_cli("rotate", str(gpt2_ja), str(root / "gpt2-rotated"))
    _run_cli("fold", str(bert), str(root / "bert"))
    _run_cli("fold", str(vit), str(root / "vit"))
    _run_cli("fold", str(vit16), str(root / "vit-bf16"))
    _run_cli("fold", str(bert_np), str(root / "bert-nopooler"), "--allow-missing")
    return [
        Source(
            "gpt2",
            str(gpt2),
            str(root / "gpt2"),
            "GPT2LMHeadModel",
            "lm",
            ("tokenizer.json", "tokenizer_config.json", "generation_config.json"),
        ),
        Source(
            "gpt2-fused",
            str(gpt2),
            str(root / "gpt2-fused"),
            "GPT2LMHeadModel",
            "lm",
            ("tokenizer.json", "tokenizer_config.json", "generation_config.json"),
        ),
        Source(
            "gpt2-rotated",
            str(gpt2_ja),
            str(root / "gpt2-rotated"),
            "GPT2LMHeadModel",
            "lm",
            ("vocab.txt", "emoji.json", "tokenizer_config.json", "generation_config.json"),
        ),
        Source(
            "bert",
            str(bert),
            str(root / "bert"),
            "BertModel",
            "encoder",
            ("vocab.txt", "bpe.codes", "tokenizer_config.json"),
        ),
        Source(
            "vit",
            str(vit),
            str(root / "vit"),
            "ViTForImageClassification",
            "image",
            ("preprocessor_config.json",),
        ),
        Source(
            "vit-bf16",
            str(vit16),
            str(root / "vit-bf16"),
            "ViTForImageClassification",
            "image",
            ("preprocessor_config.json",),
        ),
        Source(
            "bert-nopooler",
            str(bert_np),
            str(root / "bert-nopooler"),
            "BertModel",
            "encoder",
            ("vocab.txt", "bpe.codes", "tokenizer_config.json"),
        ),
    ]


def quiet() -> None:
    """Silence transformers' loading warnings and progress bars: for every mutant, they (unexpected
    keys, a missing torchvision) would bury the score."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


# --- reading a directory without the gate's code ------------------------------------------

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""The torch dtype of each safetensors dtype name, read here without the gate's own table."""


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


def read_header(file: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's data offset and its header, parsed."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def weight_files(root: Path) -> list[str]:
    """The safetensors files of a directory: the index's shards, or the one file."""
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
    return hashlib.sha256(tensor_bits(t)).hexdigest()


@dataclass
class Survey:
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
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
    )


def survey(source: Source) -> Survey:
    """What ``source``'s fold holds, read from its files (which stored tensors load, from
    their bytes)."""
    root = Path(source.candidate)
    loaded = _loaded_digests(root, source.architecture)
    tensors = []
    for file in weight_files(root):
        base, header = read_header(root / file)
        data = (root / file).read_bytes()
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            stored = torch.frombuffer(
                bytearray(data[base + begin : base + end]) or bytearray(1), dtype=torch.uint8
            )
            stored = (
                stored[: end - begin].view(SAFETENSORS_DTYPES[info["dtype"]]).view(info["shape"])
            )
            tensors.append(
                _Tensor(
                    name,
                    file,
                    info["dtype"],
                    tuple(info["shape"]),
                    base + begin,
                    base + end,
                    _bits_digest(stored) in loaded,
                )
            )
    config_text = (root / "config.json").read_bytes().decode("utf-8")
    config = json.loads(config_text)
    return Survey(
        source,
        sorted(tensors, key=lambda t: t.name),
        config,
        config_text,
        _relative_files(root),
        config_as_loaded(config),
    )


def config_as_loaded(config: dict[str, Any]) -> str:
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


def tensor_bits(t: torch.Tensor) -> bytes:
    """A tensor's dtype, shape and bytes: equal for two tensors that are the same bit for bit."""
    t = t.detach().contiguous().cpu()
    return (
        t.dtype.__repr__().encode()
        + str(tuple(t.shape)).encode()
        + t.view(-1).view(torch.uint8).numpy().tobytes()
    )
