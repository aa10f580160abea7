"""timm and open_clip as model sources: timm hub-format directories through inspect, fold, check
and enjoyln.load, and analysis without example inputs on real timm and open_clip models.

CI has neither library, so most of this runs against a plain-PyTorch stand-in for timm that
implements the little enjoyln uses (``is_model``, ``create_model`` with
``pretrained_cfg_overlay=dict(file=...)``, loading ``model.safetensors`` strictly), put in
``sys.modules`` for the test. The same tests with the real timm and open_clip run where they
import, and are skipped with the reason where they do not.
"""

import importlib.machinery
import importlib.util
import json
import shlex
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

import enjoyln
from conftest import assert_same_outputs
from enjoyln.analysis.inputs import described_inputs
from enjoyln.cli.app import app
from enjoyln.testing import perturb

runner = CliRunner()


# --- a stand-in for timm -----------------------------------------------------------------------


class StandInViT(nn.Module):
    """A pre-norm ViT as timm builds it: patch embedding, blocks of LN -> linear, final norm, head;
    ``pretrained_cfg`` says its input size."""

    def __init__(self, pretrained_cfg, num_classes=10, depth=2, embed_dim=16, img_size=32):
        super().__init__()
        self.pretrained_cfg, self.num_classes = pretrained_cfg, num_classes
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, embed_dim, 8, 8)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"norm1": nn.LayerNorm(embed_dim, eps=1e-6), "fc": nn.Linear(embed_dim, embed_dim)}
            )
            for _ in range(depth)
        )
        self.norm, self.head = nn.LayerNorm(embed_dim, eps=1e-6), nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = x + block["fc"](torch.relu(block["norm1"](x)))
        return self.head(self.norm(x)).mean(1)


def fake_timm():
    """The part of timm's API enjoyln uses, over ``StandInViT``."""
    default_cfg = {
        "architecture": "standin_vit",
        "input_size": (3, 32, 32),
        "num_classes": 10,
        "hf_hub_id": "nobody/never-downloaded",
        "mean": (0.5, 0.5, 0.5),
    }
    module = types.ModuleType("timm")
    module.__spec__ = importlib.machinery.ModuleSpec("timm", None)  # find_spec("timm") asks for it
    module.__version__ = "0+stand-in"
    module.loaded = []

    def create_model(name, pretrained=False, pretrained_cfg_overlay=None, **kwargs):
        assert name == "standin_vit"
        cfg = {**default_cfg, **(pretrained_cfg_overlay or {})}
        model = StandInViT(cfg, **kwargs)
        if pretrained:  # as timm: the overlay's file when its source is not the hub; strict
            assert cfg.get("source") != "hf-hub" and cfg.get("file"), cfg
            model.load_state_dict(load_file(cfg["file"]), strict=True)
            module.loaded.append(cfg["file"])
        return model

    module.create_model = create_model
    module.is_model = lambda name: name == "standin_vit"
    return module


@pytest.fixture
def standin(monkeypatch):
    module = fake_timm()
    monkeypatch.setitem(sys.modules, "timm", module)
    return module


def save_hub_dir(model, path, model_args):
    """A directory as ``timm.models.save_for_hf(..., safe_serialization=True)`` writes it."""
    path.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors"
    )
    cfg = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in model.pretrained_cfg.items()
        if k not in ("hf_hub_id", "architecture")
    }
    config = {
        "architecture": "standin_vit",
        "num_classes": model.num_classes,
        "num_features": 16,
        "global_pool": "avg",
        "model_args": model_args,
        "pretrained_cfg": cfg,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture
def hub_dir(standin, tmp_path):
    torch.manual_seed(0)
    model = perturb(standin.create_model("standin_vit", depth=3).eval(), seed=7)
    return save_hub_dir(model, tmp_path / "vit", {"depth": 3}), model


def test_timm_directory_inspect_fold_check_and_load(hub_dir, standin, tmp_path):
    src, original = hub_dir
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    result = runner.invoke(app, ["inspect", str(src)])
    assert result.exit_code == 0, result.output
    assert "StandInViT: 4 of 4 LayerNorms foldable" in result.output
    out = tmp_path / "out"
    result = runner.invoke(app, ["fold", str(src), str(out)])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and "timm.create_model" in result.output
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # the input is never modified
    config = json.loads((out / "config.json").read_text())
    assert config["enjoyln"]["rmsnorm"] == [
        "blocks.0.norm1",
        "blocks.1.norm1",
        "blocks.2.norm1",
        "norm",
    ]
    assert {k: v for k, v in config.items() if k != "enjoyln"} == json.loads(before["config.json"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    inputs = described_inputs(original, batch=3, seed=11)
    # the loading recipe a timm user has: the folded file through create_model, LNs unchanged
    plain = standin.create_model(
        "standin_vit",
        pretrained=True,
        depth=3,
        pretrained_cfg_overlay=dict(file=str(out / "model.safetensors")),
    ).eval()
    assert_same_outputs(original, plain, inputs)
    assert not torch.equal(
        plain.patch_embed.proj.weight, original.patch_embed.proj.weight
    )  # centered on disk
    loaded = enjoyln.load(out)
    assert (
        type(loaded.norm).__name__ == "RMSNorm"
        and type(loaded.blocks[0]["norm1"]).__name__ == "RMSNorm"
    )
    assert_same_outputs(original, loaded, inputs)
    assert standin.loaded[-1] == str(out / "model.safetensors")

    result = runner.invoke(app, ["check", str(src), str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["paths"] == ["enjoyln.load", "timm.create_model"]
    assert report["static"]["centered"] == 8 and report["static"]["problems"] == []


def test_a_changed_weight_fails_the_check_of_a_timm_directory(hub_dir, tmp_path):
    src, _ = hub_dir
    out = tmp_path / "out"
    assert runner.invoke(app, ["fold", str(src), str(out)]).exit_code == 0
    tensors = load_file(out / "model.safetensors")
    tensors["head.bias"][0] += 1e-3
    save_file(tensors, out / "model.safetensors")
    result = runner.invoke(app, ["check", str(src), str(out)])
    assert result.exit_code == 1 and "head.bias" in result.output


def test_fold_with_fused_affine_goes_through_the_in_memory_path(hub_dir, tmp_path):
    src, original = hub_dir
    out = tmp_path / "fused"
    result = runner.invoke(app, ["fold", str(src), str(out), "--fuse-affine"])
    assert result.exit_code == 0, result.output
    loaded = enjoyln.load(out)
    assert not loaded.norm.elementwise_affine and torch.equal(loaded.norm.weight, torch.ones(16))
    assert_same_outputs(original, loaded, described_inputs(original, seed=5))


@pytest.mark.parametrize(
    "args, message",
    [
        (["fold", "{src}", "{out}", "--max-shard-size", "1KB"], "timm loads one weight file"),
        (
            ["fold", "{src}", "{out}", "--dtype", "bfloat16"],
            "timm builds its models in float32 whatever the file",
        ),
    ],
)
def test_timm_directory_refusals(hub_dir, tmp_path, args, message):
    src, _ = hub_dir
    result = runner.invoke(app, [a.format(src=src, out=tmp_path / "out") for a in args])
    assert (
        result.exit_code == 2
        and message in result.output
        and len(result.output.strip().splitlines()) == 1
    )
    assert not (tmp_path / "out").exists()


def test_unknown_timm_architecture_and_missing_weights(hub_dir, tmp_path):
    src, _ = hub_dir
    bad = shutil.copytree(src, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architecture": "no_such_net"}))
    result = runner.invoke(app, ["inspect", str(bad)])
    assert (
        result.exit_code == 2
        and "unknown architecture 'no_such_net': timm 0+stand-in" in result.output
    )
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").unlink()
    result = runner.invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 2 and "has no model.safetensors" in result.output


def test_a_timm_bin_directory_gets_a_resave_line_that_works(hub_dir, tmp_path):
    """timm would unpickle pytorch_model.bin itself, so even --allow-pickle refuses it, with the one
    line that re-saves it as safetensors; run as given, that line makes the directory fold."""
    src, _ = hub_dir
    pickled = shutil.copytree(src, tmp_path / "pickled vit")  # a space: the line quotes the path
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    result = runner.invoke(app, ["fold", str(pickled), str(tmp_path / "out"), "--allow-pickle"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "holds a timm model's weights as pytorch_model.bin (pickle)" in result.stderr
    line = result.stderr.split("then run enjoyln again: ")[1].strip()
    program, flag, code = shlex.split(line)
    assert (program, flag) == ("python", "-c") and "weights_only=True" in code
    exec(code, {})  # what the shell would run, in this process
    result = runner.invoke(app, ["fold", str(pickled), str(tmp_path / "out"), "--static"])
    assert result.exit_code == 0, result.output


def test_a_timm_directory_is_read_from_its_own_file_whatever_its_config_says(
    hub_dir, standin, tmp_path
):
    """A directory is untrusted: its pretrained_cfg may name the hub, another file or a custom
    loader, and its model_args may name a checkpoint; timm must load the directory's own weights."""
    src, original = hub_dir
    bad = shutil.copytree(src, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["pretrained_cfg"].update(
        source="hf-hub",
        hf_hub_id="someone/else",
        file=str(tmp_path / "other.pth"),
        url="https://example.invalid/w.pth",
        custom_load=True,
    )
    (bad / "config.json").write_text(json.dumps(config))
    loaded = enjoyln.load(bad)
    assert standin.loaded[-1] == str(bad / "model.safetensors")
    assert_same_outputs(original, loaded, described_inputs(original, seed=1))
    config["model_args"]["checkpoint_path"] = str(tmp_path / "evil.pth")
    (bad / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 2 and "model_args set checkpoint_path" in result.output


def test_without_timm_a_timm_directory_is_one_clear_line(hub_dir, monkeypatch, tmp_path):
    src, _ = hub_dir
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    for args in (
        ["inspect", str(src)],
        ["fold", str(src), str(tmp_path / "out")],
        ["check", str(src), str(src)],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "timm model directory" in lines[0] and "install timm" in lines[0]
    assert not (tmp_path / "out").exists()


# --- the real timm and open_clip, where they import ----------------------------------------------


def _real_libraries():
    """timm and open_clip, imported with the sweep's torchvision workaround; skip where they do
    not."""
    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("open_clip") is None:
        pytest.skip(
            "timm or open_clip is not installed (CI has neither; see scripts/sweep_timm.py for an "
            "environment)"
        )
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        import sweep_timm

        sweep_timm.import_torchvision()
        import open_clip
        import timm
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason to skip, stated
        pytest.skip(f"timm or open_clip does not import here ({type(exc).__name__}: {exc})")
    finally:
        sys.path.remove(str(scripts))
    return timm, open_clip


def test_real_timm_and_open_clip_analyse_without_inputs():
    timm, open_clip = _real_libraries()
    torch.manual_seed(0)
    models = {
        "vit_relpos": timm.create_model("vit_relpos_small_patch16_224", depth=2),
        "vit img_size=64": timm.create_model("vit_small_patch16_224", depth=1, img_size=64),
        "convnext": timm.create_model("convnext_atto"),
    }
    clip = open_clip.create_model("ViT-B-32", pretrained=None)
    siglip = open_clip.create_model("ViT-B-16-SigLIP", pretrained=None)
    models.update(
        {
            "clip": clip,
            "clip visual": clip.visual,
            "siglip text": siglip.text,
            "siglip visual (timm trunk)": siglip.visual,
        }
    )
    for name, model in models.items():
        plan = enjoyln.analyze(model.eval())
        assert plan.layer_norms, name
    assert len(enjoyln.analyze(models["vit_relpos"]).foldable) == 5
    model = perturb(models["vit_relpos"])
    folded = enjoyln.fold(__import__("copy").deepcopy(model))
    assert_same_outputs(model, folded, described_inputs(model, seed=2))


def test_real_timm_hub_directory_folds_checks_and_reloads_exactly(tmp_path):
    timm, _ = _real_libraries()
    from timm.models import save_for_hf

    args = {"depth": 2, "embed_dim": 64, "num_heads": 2}
    torch.manual_seed(0)
    original = perturb(timm.create_model("vit_relpos_small_patch16_224", **args).eval(), seed=3)
    save_for_hf(original, tmp_path / "vit", model_args=args, safe_serialization=True)
    (tmp_path / "vit" / "pytorch_model.bin").unlink(missing_ok=True)
    out = tmp_path / "out"
    result = runner.invoke(app, ["fold", str(tmp_path / "vit"), str(out)])
    assert result.exit_code == 0, result.output
    assert "5 of 5 LayerNorms foldable" in result.output and "PASS" in result.output
    result = runner.invoke(app, ["check", str(tmp_path / "vit"), str(out)])
    assert result.exit_code == 0 and "PASS" in result.output, result.output
    inputs = described_inputs(original, batch=2, seed=9)
    reloaded = timm.create_model(
        "vit_relpos_small_patch16_224",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(out / "model.safetensors")),
        **args,
    ).eval()
    assert_same_outputs(original, reloaded, inputs)
    loaded = enjoyln.load(out)
    assert type(loaded.fc_norm).__name__ == "RMSNorm"
    assert_same_outputs(original, loaded, inputs)
