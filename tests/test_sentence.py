"""A sentence-transformers directory folded by the command line, loaded back with
``enjoyln.load_sentence_transformer``: the same embeddings as the original pipeline's, from a
transformer whose folded LNs are RMSNorm."""

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

import enjoyln
from enjoyln.cli.app import app
from enjoyln.store.checkpoint import open_checkpoint
from enjoyln.testing import perturb, tiny_model

st = pytest.importorskip("sentence_transformers")  # a dev dependency: CI installs it
pytest.importorskip("sentence_transformers.models")

WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "dog",
    "ran",
    "far",
]
SENTENCES = ["the cat sat on the mat", "a dog ran far", "the dog sat", "cat"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A BERT sentence-transformers pipeline (mean pooling, normalized), its weights drawn wide
    enough that different sentences get clearly different embeddings."""
    root = tmp_path_factory.mktemp("st")
    bert = perturb(tiny_model("bert"), seed=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in bert.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.2)
    bert.save_pretrained(root / "bert")
    (root / "bert" / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(root / "bert" / "vocab.txt")).save_pretrained(
        root / "bert"
    )
    body = st.models.Transformer(str(root / "bert"))
    model = st.SentenceTransformer(
        modules=[
            body,
            st.models.Pooling(body.get_word_embedding_dimension()),
            st.models.Normalize(),
        ],
        device="cpu",
    )
    model.save(str(root / "pipeline"))
    return root / "pipeline"


def test_a_folded_pipeline_gives_the_originals_embeddings(pipeline, tmp_path):
    result = CliRunner().invoke(app, ["fold", str(pipeline), str(tmp_path / "folded")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "folded" / "modules.json").is_file() and (
        tmp_path / "folded" / "1_Pooling"
    ).is_dir()

    original = st.SentenceTransformer(str(pipeline), device="cpu").encode(SENTENCES)
    loaded = enjoyln.load_sentence_transformer(tmp_path / "folded", device="cpu")
    folded = loaded.encode(SENTENCES)

    body = loaded[0].auto_model
    rms = {name for name, m in body.named_modules() if isinstance(m, enjoyln.RMSNorm)}
    recorded = open_checkpoint(tmp_path / "folded").recorded_plan
    assert rms and rms == {e.name for e in recorded.foldable}
    spread = np.abs(original[:, None] - original[None]).max()
    assert spread > 0.1  # the sentences' embeddings differ: the comparison below means something
    np.testing.assert_allclose(folded, original, atol=2e-6, rtol=0)


def test_a_pipeline_folded_as_another_class_is_refused_in_one_line(pipeline, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "fold",
            str(pipeline),
            str(tmp_path / "folded"),
            "--model-class",
            "BertForMaskedLM",
            "--allow-missing",
        ],
    )
    assert result.exit_code == 0, result.output
    with pytest.raises(
        enjoyln.CheckpointError,
        match="loads this directory as BertModel, but it was folded as "
        "BertForMaskedLM; fold the original with --model-class BertModel",
    ):
        enjoyln.load_sentence_transformer(tmp_path / "folded", device="cpu")
