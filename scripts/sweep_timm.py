"""Sweep timm models and open_clip towers through analyze, fold and a comparison.

What ``scripts/sweep_transformers.py`` does for transformers, for timm and
open_clip: each model is built with random weights (``pretrained=False``) at
a small variant of its family, its weights perturbed (norm gains 1 + 0.2·randn,
biases 0.1·randn, noise on the rest), in eval mode. ``enjoyln.analyze(model)``
with no inputs is run first and recorded; then the analysis runs on inputs
synthesised from the model's own configuration (timm: ``pretrained_cfg
["input_size"]``; open_clip: ``visual.image_size``, and ``context_length`` and
``vocab_size`` for text towers), ``enjoyln.fold`` on a deep copy, and every
output is compared with the unfolded model on two fresh seeded batches. Each
model runs in its own forked process with a time limit, two at a time.

    python scripts/sweep_timm.py                        # all, to docs/data/sweep_timm_results.json
    python scripts/sweep_timm.py --only timm/vit_small_patch16_224,open_clip/ViT-B-32/text
    python scripts/sweep_timm.py --list                 # the sample, one key a line
    python scripts/sweep_timm.py --write                # and its block in docs/architectures.md
    (sweep-timm)

Statuses are those of the transformers sweep: ``exact`` (max relative
difference over every output ≤ 1e-5 in float32); ``inexact`` (then redone in
float64: exact there means the float32 difference is the original's own
rounding, otherwise the fold is unsound); ``clean_error`` (an EnjoylnError);
``raw_error`` (any other exception, with where it was raised); ``skipped``
(does not build, forward fails, no LayerNorm or GroupNorm, time limit).

Needs timm and open_clip_torch, which enjoyln itself never imports; the sweep
checks that. They import torchvision, and PyPI's torchvision wheel is a CUDA
build: with a CPU torch its C++ library (``torchvision/_C.so``) does not load,
and ``torchvision/_meta_registrations.py`` then fails at import on
``@torch.library.register_fake("torchvision::nms")`` (and ``qnms``) with
"operator torchvision::nms does not exist". This script works around it while
it imports torchvision, and only then: ``torch.library.register_fake`` skips a
``torchvision::`` operator that is not defined (the C++ ops it would fake are
absent anyway; no model swept calls them). With a matching torchvision build
the operators exist and nothing is skipped. The script prints what it skipped and
records it in the results' ``meta``. transformers, which enjoyln imports for
Hugging Face models, imports torchvision too when it is installed, so the
script imports torchvision this way first of all.
An environment that leaves the main one alone::

    python -m venv --system-site-packages /work/venv-timm
    /work/venv-timm/bin/pip install --no-deps torchvision==0.28.0   # the release for torch 2.13
    /work/venv-timm/bin/pip install --no-deps timm==1.0.29 open_clip_torch==3.3.0
    /work/venv-timm/bin/pip install ftfy 'setuptools>=77'            # open_clip's missing
    pure-Python deps
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import inspect
import json
import multiprocessing as mp
import os
import re
import resource
import subprocess
import sys
import time
import warnings
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sweep_transformers as st  # noqa: E402 - the same perturbation, comparison and reason grouping

DATA = HERE.parent / "docs" / "data"  # results are data, kept apart from the scripts
DEFAULT_OUT = DATA / "sweep_timm_results.json"
BASELINE = DATA / "sweep_timm_baseline.json"
RTOL = st.RTOL
BATCH = 2
ANALYSIS_SEED, COMPARE_SEEDS = 0, (1, 2)

# (family, model name, create_model keyword arguments). The smallest variant of each
# family that keeps its structure; default depth, so the LN counts are the real ones.
# Image size is cut only where the model takes ``img_size`` and its default is large;
# ``pretrained_cfg_overlay`` then says so, so the model's own config stays true.
_SMALL_IMG = {"img_size": 224, "pretrained_cfg_overlay": {"input_size": (3, 224, 224)}}
TIMM_MODELS: list[tuple[str, str, dict[str, Any]]] = [
    # plain ViT and its relatives
    ("vit", "vit_tiny_patch16_224", {}),
    ("vit", "vit_small_patch16_224", {}),
    ("vit", "vit_small_patch16_18x2_224", {}),  # ParallelThingsBlock
    ("vit", "vit_pwee_patch16_reg1_gap_256", {}),  # ParallelScalingBlock
    ("vit", "vit_wee_patch16_reg1_gap_256", {}),
    ("vit", "vit_little_patch16_reg1_gap_256", {}),
    ("vit", "vit_medium_patch16_gap_256", {}),
    ("vit", "vit_xsmall_patch16_clip_224", {}),  # norm_pre
    ("vit", "vit_base_patch32_siglip_256", {}),  # attention-pool head
    ("vit", "vit_small_patch16_rope_224", {}),
    ("vit", "vit_relpos_small_patch16_224", {}),
    ("vit", "vit_srelpos_small_patch16_224", {}),
    ("vit", "vit_tiny_r_s16_p8_224", {}),  # ResNet stem
    ("vit", "vit_small_resnet26d_224", {}),
    ("vit", "vit_pe_core_tiny_patch16_384", {}),
    ("vit", "test_vit", {}),
    ("vit", "test_vit2", {}),
    ("vit", "test_vit3", {}),
    ("vit", "test_vit4", {}),  # RmsNorm only
    ("deit", "deit_tiny_patch16_224", {}),
    ("deit", "deit_tiny_distilled_patch16_224", {}),
    ("deit", "deit3_small_patch16_224", {}),
    ("beit", "beit_base_patch16_224", {}),
    ("beit", "beitv2_base_patch16_224", {}),
    ("eva", "eva02_tiny_patch14_224", {}),
    ("eva", "eva02_small_patch14_224", {}),
    ("dinov2", "vit_small_patch14_dinov2", _SMALL_IMG),
    ("dinov2", "vit_small_patch14_reg4_dinov2", _SMALL_IMG),
    ("dinov3", "vit_small_patch16_dinov3", {}),
    ("flexivit", "flexivit_small", {}),
    ("naflexvit", "naflexvit_base_patch16_gap", {}),
    ("convit", "convit_tiny", {}),
    ("cait", "cait_xxs24_224", {}),
    ("crossvit", "crossvit_tiny_240", {}),
    ("pit", "pit_ti_224", {}),
    ("tnt", "tnt_s_patch16_224", {}),
    ("volo", "volo_d1_224", {}),
    ("xcit", "xcit_nano_12_p16_224", {}),
    ("samvit", "samvit_base_patch16_224", {}),
    ("vitamin", "vitamin_small_224", {}),
    ("hiera", "hiera_tiny_224", {}),
    ("hiera", "hieradet_small", {}),
    ("mvitv2", "mvitv2_tiny", {}),
    ("nest", "nest_tiny", {}),
    ("coat", "coat_lite_tiny", {}),
    ("coat", "coat_tiny", {}),
    # hierarchical transformers
    ("swin", "swin_tiny_patch4_window7_224", {}),
    ("swin", "swinv2_tiny_window8_256", {}),
    ("swin", "swinv2_cr_tiny_ns_224", {}),
    ("swin", "swin_s3_tiny_224", {}),
    ("pvt", "pvt_v2_b0", {}),
    ("pvt", "pvt_v2_b1", {}),
    ("twins", "twins_pcpvt_small", {}),
    ("twins", "twins_svt_small", {}),
    ("davit", "davit_tiny", {}),
    ("gcvit", "gcvit_xxtiny", {}),
    ("tiny_vit", "tiny_vit_5m_224", {}),
    ("efficientformer", "efficientformer_l1", {}),
    ("efficientformer", "efficientformerv2_s0", {}),
    ("levit", "levit_128s", {}),
    ("levit", "levit_conv_128s", {}),
    ("mobilevit", "mobilevit_xxs", {}),
    ("mobilevit", "mobilevitv2_050", {}),
    ("edgenext", "edgenext_xx_small", {}),
    # MLPs
    ("mixer", "mixer_s32_224", {}),
    ("mixer", "mixer_s16_224", {}),
    ("mixer", "gmixer_12_224", {}),
    ("gmlp", "gmlp_ti16_224", {}),
    ("resmlp", "resmlp_12_224", {}),  # an affine, no LayerNorm
    ("sequencer", "sequencer2d_s", {}),
    # ConvNeXt and other convnets with LayerNorm
    ("convnext", "convnext_atto", {}),
    ("convnext", "convnext_atto_ols", {}),
    ("convnext", "convnext_femto", {}),
    ("convnext", "convnext_nano", {}),
    ("convnext", "convnext_tiny", {}),  # conv_mlp=False: permute -> LayerNorm -> Linear
    ("convnext", "convnext_atto_rms", {}),  # RmsNorm2d only
    ("convnext", "test_convnext", {}),
    ("convnext", "test_convnext2", {}),
    ("convnext", "test_convnext3", {}),
    ("convnextv2", "convnextv2_atto", {}),
    ("convnextv2", "convnextv2_nano", {}),
    ("efficientnet", "test_efficientnet_ln", {}),
    ("efficientnet", "test_efficientnet_gn", {}),
    ("mambaout", "test_mambaout", {}),
    ("mambaout", "mambaout_femto", {}),
    ("metaformer", "convformer_s18", {}),
    ("metaformer", "caformer_s18", {}),
    ("metaformer", "poolformer_s12", {}),
    ("metaformer", "poolformerv2_s12", {}),
    ("inception_next", "inception_next_atto", {}),
    ("rdnet", "rdnet_tiny", {}),
    ("focalnet", "focalnet_tiny_srf", {}),
    ("focalnet", "focalnet_tiny_lrf", {}),
    # MaxViT / CoAtNet (maxxvit.py)
    ("coatnet", "coatnet_pico_rw_224", {}),
    ("coatnet", "coatnet_nano_rw_224", {}),
    ("coatnet", "coatnet_rmlp_nano_rw_224", {}),
    ("coatnet", "coatnet_nano_cc_224", {}),
    ("maxvit", "maxvit_nano_rw_256", {}),
    ("maxvit", "maxvit_rmlp_pico_rw_256", {}),
    ("maxvit", "maxvit_tiny_tf_224", {}),
    ("maxvit", "maxxvit_rmlp_nano_rw_256", {}),
    ("maxvit", "maxxvitv2_nano_rw_256", {}),
    # convnets with BatchNorm only, for the count of skips
    ("efficientvit", "efficientvit_b0", {}),
    ("fastvit", "fastvit_t8", {}),
    ("repvit", "repvit_m0_9", {}),
]

# (open_clip model config, tower). The text tower of a plain CLIP config is taken from
# create_model(..., force_custom_text=True), which holds it as a TextTransformer module.
OPEN_CLIP_TOWERS: list[tuple[str, str]] = [
    ("ViT-B-32", "text"),
    ("ViT-B-32", "visual"),
    ("ViT-S-16", "text"),
    ("ViT-S-16", "visual"),
    ("ViT-M-32-alt", "text"),
    ("ViT-M-32-alt", "visual"),
    ("RN50", "text"),
    ("RN50", "visual"),  # ModifiedResNet: BatchNorm only
    ("ViT-B-16-SigLIP", "text"),
    ("ViT-B-16-SigLIP", "visual"),  # vision: a timm trunk
    ("PE-Core-T-16-384", "text"),
    ("PE-Core-T-16-384", "visual"),
    ("MobileCLIP-S1", "text"),
    ("MobileCLIP-S1", "visual"),
    ("ViTamin-S", "text"),
    ("ViTamin-S", "visual"),
    ("convnext_tiny", "visual"),
    ("EVA02-B-16", "visual"),
    ("coca_ViT-B-32", "text"),
]


def all_keys() -> list[str]:
    return [f"timm/{name}" for _, name, _ in TIMM_MODELS] + [
        f"open_clip/{cfg}/{tower}" for cfg, tower in OPEN_CLIP_TOWERS
    ]


TIMM_KWARGS = {name: kw for _, name, kw in TIMM_MODELS if kw}
FAMILY = {f"timm/{name}": family for family, name, _ in TIMM_MODELS}
FAMILY.update({f"open_clip/{cfg}/{tower}": f"open_clip {tower}" for cfg, tower in OPEN_CLIP_TOWERS})


# --- the torchvision workaround -------------------------------------------------------


def import_torchvision() -> dict[str, Any]:
    """Import torchvision with the workaround; its version and the fakes skipped.

    First of all: transformers imports torchvision too (``image_utils``) when it is
    installed, so in an environment with this torchvision it must be imported this way
    before any transformers model is built.
    """
    from enjoyln.compat import skip_missing_fakes  # the same workaround `import enjoyln` installs

    with skip_missing_fakes() as skipped:
        import torchvision

    return {"torchvision": torchvision.__version__, "torchvision_fakes_skipped": list(skipped)}


def import_libraries() -> dict[str, Any]:
    """timm's and open_clip's versions (imported after ``import_torchvision``)."""
    import open_clip
    import timm

    return {"timm": timm.__version__, "open_clip": open_clip.__version__}


def check_enjoyln_imports_neither() -> None:
    """enjoyln must not import timm or open_clip: fold an HF model and a plain module before they
    are."""
    import enjoyln
    from enjoyln.testing import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enjoyln.fold(tiny_model("gpt2"))
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        enjoyln.fold(net, torch.randn(2, 8))
    found = sorted(m for m in ("timm", "open_clip") if m in sys.modules)
    if found:
        raise SystemExit(f"enjoyln imported {', '.join(found)}")


# --- one model ------------------------------------------------------------------------


def build(key: str) -> torch.nn.Module:
    """The model behind ``key`` (``timm/NAME`` or ``open_clip/CONFIG/TOWER``), random weights, eval
    mode."""
    source, rest = key.split("/", 1)
    torch.manual_seed(0)
    if source == "timm":
        import timm

        kwargs = copy.deepcopy(TIMM_KWARGS.get(rest, {}))
        return timm.create_model(rest, pretrained=False, **kwargs).eval()
    if source == "open_clip":
        import open_clip

        cfg, tower = rest.rsplit("/", 1)
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            full = open_clip.create_model(cfg, pretrained=None, force_custom_text=True)
        return getattr(full, tower).eval()
    raise ValueError(f"unknown source {source!r} in {key!r}: timm/NAME or open_clip/CONFIG/TOWER")


def config_inputs(model: torch.nn.Module, seed: int) -> tuple[dict[str, torch.Tensor], str]:
    """Inputs from the model's own configuration, keyed by the forward's first argument, and their
    source."""
    gen = torch.Generator().manual_seed(seed)
    arg = next(iter(inspect.signature(model.forward).parameters))
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and cfg.get("input_size"):
        c, h, w = cfg["input_size"]
        return {
            arg: torch.randn(BATCH, c, h, w, generator=gen)
        }, f"pretrained_cfg input_size {c}x{h}x{w}"
    if getattr(model, "image_size", None) is not None:
        size = model.image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return {arg: torch.randn(BATCH, 3, h, w, generator=gen)}, f"image_size {h}x{w}"
    if getattr(model, "context_length", None) and getattr(model, "vocab_size", None):
        n, vocab = int(model.context_length), int(model.vocab_size)
        ids = torch.randint(1, vocab, (BATCH, n), generator=gen)
        return {arg: ids}, f"context_length {n}, vocab_size {vocab}"
    raise ValueError("no input size in the model's configuration")


def norm_classes(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of each norm or scale class the model holds (the map of patterns)."""
    found = collections.Counter(
        f"{type(m).__module__}.{type(m).__name__}"
        for m in model.modules()
        if any(k in type(m).__name__ for k in ("Norm", "Scale"))
        and not type(m).__name__.endswith(("Block",))
    )
    return dict(sorted(found.items()))


def _owner_class(model: torch.nn.Module, name: str) -> str:
    """The class of the module an LN entry names (or of its closest ancestor)."""
    parts = name.split(".")
    while parts:
        with contextlib.suppress(AttributeError):
            m = model.get_submodule(".".join(parts))
            return f"{type(m).__module__}.{type(m).__name__}"
        parts.pop()
    return "(top level)"


def run_one(key: str) -> dict[str, Any]:
    """Everything the sweep records about one model."""
    import enjoyln

    start = time.perf_counter()
    warnings.filterwarnings("ignore")
    info: dict[str, Any] = {"key": key, "family": FAMILY.get(key, "")}
    try:
        model = build(key)
    except Exception as exc:  # noqa: BLE001 - the sweep's choice of model, not enjoyln
        return {
            **info,
            "status": "skipped",
            "reason": f"does not build: {type(exc).__name__}: {st._first_line(exc)[:150]}",
            "seconds": st._since(start),
        }
    st.perturb_all(model)
    info["params"] = sum(p.numel() for p in model.parameters())
    info["norm_classes"] = norm_classes(model)
    try:
        inputs, source = config_inputs(model, ANALYSIS_SEED)
    except Exception as exc:  # noqa: BLE001 - recorded
        return {**info, "status": "skipped", "reason": f"no inputs: {st._first_line(exc)}"}
    info["inputs"] = source
    counter = st._CountNorms()
    try:
        with counter:
            st._forward(model, inputs)
    except Exception as exc:  # noqa: BLE001 - recorded
        return {
            **info,
            "status": "skipped",
            "reason": f"forward fails: {type(exc).__name__}: {st._first_line(exc)[:150]}",
            "seconds": st._since(start),
        }
    info["forward_runs"] = True
    info["norm_calls"] = counter.count
    if counter.count == 0:
        return {
            **info,
            "status": "skipped",
            "reason": "no LayerNorm or GroupNorm in the forward",
            "seconds": st._since(start),
        }

    t = time.perf_counter()
    try:
        enjoyln.analyze(model)
        info["no_input"] = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - recorded
        info["no_input"] = {"ok": False, **st.classify(exc, "analyze(model)")}
    info["no_input"]["seconds"] = st._since(t)
    stage = "analyze"
    try:
        t = time.perf_counter()
        plan = enjoyln.analyze(model, inputs)
        info["analyze_seconds"] = st._since(t)
        info.update(_plan_record(model, plan))
        stage = "fold"
        folded = enjoyln.fold(copy.deepcopy(model), plan=plan)
        stage = "compare"
        batches = [config_inputs(model, s)[0] for s in COMPARE_SEEDS]
        result = st.compare(model, folded, batches)
    except Exception as exc:  # noqa: BLE001 - recorded
        return {**info, **st.classify(exc, stage), "seconds": st._since(start)}
    info.update(result)
    if result["max_rel"] <= RTOL:
        info["status"] = "exact"
    else:
        info["status"] = "inexact"
        try:
            info["float64"] = st.float64_triage(model, plan, batches)
        except Exception as exc:  # noqa: BLE001 - recorded
            info["float64"] = {"error": f"{type(exc).__name__}: {st._first_line(exc)}"}
    info["seconds"] = st._since(start)
    return info


def _plan_record(model: torch.nn.Module, plan: Any) -> dict[str, Any]:
    """LN entries, folds and refusals, by normalised reason and by the class of the norm module."""
    names = [e.name for e in plan.layer_norms]
    refusals: dict[str, int] = {}
    examples: dict[str, str] = {}
    by_class: dict[str, dict[str, Any]] = {}
    for e in plan.layer_norms:
        cls = _owner_class(model, e.name)
        c = by_class.setdefault(cls, {"entries": 0, "folded": 0, "refused": {}})
        c["entries"] += 1
        if e.foldable:
            c["folded"] += 1
            continue
        reason = st.normalize_reason(e.reason, names)
        refusals[reason] = refusals.get(reason, 0) + 1
        examples.setdefault(reason, f"{e.name}: {e.reason}"[:400])
        c["refused"][reason] = c["refused"].get(reason, 0) + 1
    return {
        "ln_entries": len(plan.layer_norms),
        "folded": len(plan.foldable),
        "group_norm_entries": sum(e.norm == "group_norm" for e in plan.layer_norms),
        "folded_names": [e.name for e in plan.foldable],
        "refusals": refusals,
        "refusal_examples": examples,
        "by_class": by_class,
        "notes": list(plan.notes),
    }


# --- the pool -------------------------------------------------------------------------


def _child(key: str, conn: Any, quiet: bool) -> None:
    torch.set_num_threads(1)
    if quiet:  # torch.export prints whole graphs when it fails
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = run_one(key)
    except BaseException as exc:  # noqa: BLE001 - anything the sweep itself did not foresee
        result = {"key": key, **st.classify(exc, "sweep"), "status": "raw_error"}
    usage = resource.getrusage(resource.RUSAGE_SELF)  # a forked child starts from zero
    result["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 2)
    conn.send(json.loads(json.dumps(result, default=str)))
    conn.close()
    os._exit(0)


def _warm_up() -> None:
    """Build and analyse one tiny timm model, so that each forked worker starts warm."""
    import enjoyln
    import timm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model("test_vit", pretrained=False).eval()
        enjoyln.analyze(model, torch.randn(1, 3, 160, 160))


def sweep(
    keys: list[str],
    *,
    jobs: int = 2,
    timeout: float = 300.0,
    progress: bool = True,
    quiet: bool = True,
    log: Any = None,
) -> dict[str, dict[str, Any]]:
    """Run every model in a forked process, ``jobs`` at a time; each result is also written to
    ``log`` as one JSON line as it arrives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _warm_up()
        return _run_pool(keys, jobs, timeout, progress, quiet, log)
    finally:
        torch.set_num_threads(threads)


def _run_pool(
    keys: list[str], jobs: int, timeout: float, progress: bool, quiet: bool, log: Any
) -> dict[str, dict[str, Any]]:
    ctx = mp.get_context("fork")
    pending, running, results = list(keys), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            k = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(k, send, quiet), daemon=True)
            proc.start()
            send.close()
            running[k] = (proc, recv, time.perf_counter())
        wait([r for _, r, _ in running.values()], timeout=1.0)
        for k, (proc, recv, started) in list(running.items()):
            elapsed = time.perf_counter() - started
            if recv.poll():
                try:
                    results[k] = recv.recv()
                except EOFError:
                    proc.join()
                    results[k] = {
                        "key": k,
                        "status": "raw_error",
                        "stage": "sweep",
                        "type": "crash",
                        "message": f"worker exited with code {proc.exitcode}",
                    }
            elif not proc.is_alive():
                results[k] = {
                    "key": k,
                    "status": "raw_error",
                    "stage": "sweep",
                    "type": "crash",
                    "message": f"worker exited with code {proc.exitcode}",
                }
            elif elapsed > timeout:
                proc.kill()
                results[k] = {
                    "key": k,
                    "status": "skipped",
                    "reason": f"time limit: more than {timeout:.0f} s",
                }
            else:
                continue
            proc.join()
            recv.close()
            del running[k]
            results[k].setdefault("family", FAMILY.get(k, ""))
            results[k].setdefault("seconds", round(elapsed, 2))
            if log is not None:
                log.write(json.dumps(results[k]) + "\n")
                log.flush()
            if progress:
                r = results[k]
                detail = (
                    r.get("reason")
                    or r.get("message")
                    or (
                        f"{r.get('folded')}/{r.get('ln_entries')}, max rel "
                        f"{r.get('max_rel', 0):.1e}"
                    )
                )
                print(
                    f"[{len(results)}/{len(keys)}] {k}: {r['status']} ({detail}; "
                    f"{r['seconds']:.0f} s)"[:220],
                    flush=True,
                )
    return {k: results[k] for k in keys}


# --- summary and the docs block -----------------------------------------------------------


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rs = list(results.values())
    status = {
        s: sum(r["status"] == s for r in rs)
        for s in ("exact", "inexact", "clean_error", "raw_error", "skipped")
    }
    runs = [r for r in rs if r.get("forward_runs") and r.get("norm_calls")]
    no_input = sum(bool(r.get("no_input", {}).get("ok")) for r in runs)
    no_input_errors = collections.Counter(
        re.sub(r"^[A-Za-z_]\w* is not", "CLASS is not", r["no_input"].get("message", ""))[:160]
        for r in runs
        if not r.get("no_input", {}).get("ok")
    )
    rounding = sum(
        r["status"] == "inexact" and r.get("float64", {}).get("rounding", False) for r in rs
    )
    reasons: dict[str, list[Any]] = {}
    for r in rs:
        for reason, n in (r.get("refusals") or {}).items():
            entry = reasons.setdefault(reason, [0, 0, r["key"]])
            entry[0] += 1
            entry[1] += n
    skipped = collections.Counter(r["reason"].split(":")[0] for r in rs if r["status"] == "skipped")
    by_source = {}
    for source in ("timm", "open_clip"):
        sub = [r for r in rs if r["key"].startswith(source + "/")]
        by_source[source] = {
            "models": len(sub),
            "tried": sum(r["status"] != "skipped" for r in sub),
            "exact": sum(r["status"] == "exact" for r in sub),
            "ln_entries": sum(r.get("ln_entries", 0) for r in sub),
            "folded": sum(r.get("folded", 0) for r in sub),
        }
    ln, folded = sum(r.get("ln_entries", 0) for r in rs), sum(r.get("folded", 0) for r in rs)
    return {
        "models": len(rs),
        "cpu_seconds": round(sum(r.get("cpu_seconds", r.get("seconds", 0.0)) for r in rs)),
        "tried": sum(r["status"] != "skipped" for r in rs),
        **status,
        "inexact_float64_rounding": rounding,
        "unsound": status["inexact"] - rounding,
        "ln_entries": ln,
        "folded": folded,
        "folded_pct": round(100 * folded / ln, 1) if ln else 0.0,
        "by_source": by_source,
        "forward_runs": len(runs),
        "no_input_ok": no_input,
        "no_input_pct": round(100 * no_input / len(runs), 1) if runs else 0.0,
        "no_input_errors": dict(no_input_errors.most_common()),
        "skipped_reasons": dict(skipped.most_common()),
        "refusals": {
            k: {"models": v[0], "entries": v[1], "example": v[2]}
            for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1][1], -kv[1][0]))
        },
    }


def print_summary(s: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
    print(
        f"\n{s['models']} models; {s['tried']} tried: {s['exact']} exact, {s['inexact']} inexact "
        f"({s['inexact_float64_rounding']} float32 rounding by the float64 triage, {s['unsound']} "
        "unsound), "
        f"{s['clean_error']} clean errors, {s['raw_error']} raw errors; {s['skipped']} skipped"
    )
    print(f"folded LNs: {s['folded']} of {s['ln_entries']} LN entries ({s['folded_pct']}%)")
    for source, b in s["by_source"].items():
        print(
            f"  {source}: {b['models']} models, {b['tried']} tried, {b['exact']} exact, "
            f"{b['folded']} of {b['ln_entries']} folded"
        )
    print(
        f"analyze(model) without inputs: {s['no_input_ok']} of {s['forward_runs']} "
        f"({s['no_input_pct']}%)"
    )
    for msg, n in s["no_input_errors"].items():
        print(f"  {n:4d}  {msg}")
    print("skipped:", ", ".join(f"{k} {v}" for k, v in s["skipped_reasons"].items()))
    print("refusal reasons (models, LN entries, example):")
    for reason, c in s["refusals"].items():
        print(f"  {c['models']:4d} {c['entries']:5d}  {reason}  [{c['example']}]"[:260])
    if meta:
        print(
            f"wall time {meta['wall_seconds']:.0f} s; CPU time in the workers {s['cpu_seconds']} "
            "s; "
            f"load average before/after {meta.get('loadavg_before')} / {meta.get('loadavg_after')}"
        )
        if meta.get("torchvision_fakes_skipped"):
            print(
                "torchvision workaround: skipped the fake registrations of "
                + ", ".join(meta["torchvision_fakes_skipped"])
                + " (its C++ ops did not load with this torch)"
            )


def _fewer_line(base: dict[str, Any], results: dict[str, Any]) -> str:
    """Which models fold fewer LNs now than in the baseline (each must be explained)."""
    fewer = [
        f"`{k}` ({b.get('folded') or 0} -> {results[k].get('folded') or 0})"
        for k, b in base["results"].items()
        if k in results and (results[k].get("folded") or 0) < (b.get("folded") or 0)
    ]
    return (
        f"Models folding fewer LNs than the baseline: {', '.join(fewer) if fewer else 'none'} "
        f"(of {sum(k in results for k in base['results'])} in both)."
    )


def readme_section(
    s: dict[str, Any],
    meta: dict[str, Any],
    base: dict[str, Any] | None,
    results: dict[str, Any] | None = None,
) -> str:
    """The block in docs/architectures.md: this sweep beside the baseline (the same sweep of enjoyln
    before norms were recognised by what they compute, `docs/data/sweep_timm_baseline.json`)."""
    same = base is None or base["meta"].get("enjoyln_commit") == meta.get("enjoyln_commit")
    cols = (
        [("now", s)]
        if same
        else [
            (f"before (`{base['meta'].get('enjoyln_commit', '?')}`)", base["summary"]),
            ("now", s),
        ]
    )
    if same:
        cols = [(f"enjoyln `{meta.get('enjoyln_commit', '?')}`", s)]

    def row(label: str, fmt: Any) -> str:
        return f"| {label} | " + " | ".join(str(fmt(x)) for _, x in cols) + " |"

    def by(source: str) -> Any:
        return lambda x: (
            f"{x['by_source'][source]['folded']} / {x['by_source'][source]['ln_entries']} "
            f"({x['by_source'][source]['exact']} of {x['by_source'][source]['tried']} exact)"
        )

    timing = (
        f"{meta['jobs']} workers, {meta['wall_seconds'] / 60:.0f} min wall "
        f"({s['cpu_seconds'] / 60:.0f} min of CPU time in the workers)"
    )
    note = f" {meta['machine_note']}" if meta.get("machine_note") else ""
    if meta.get("loadavg_before"):
        note += (
            f" Load average (1 min) {meta['loadavg_before'][0]} at the start, "
            f"{meta['loadavg_after'][0]} at the end."
        )
    lines = [
        f"{s['models']} models: {len(TIMM_MODELS)} from timm {meta['timm']} and "
        f"{len(OPEN_CLIP_TOWERS)} "
        f"open_clip {meta['open_clip']} towers; random weights, perturbed; inputs from each "
        "model's own "
        f"config; every output compared on two fresh batches. {meta['machine']}; {timing}.{note}",
        "",
        "| | " + " | ".join(label for label, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
        row(
            "models tried (builds, forward runs, has a LayerNorm or GroupNorm)",
            lambda x: x["tried"],
        ),
        row("exact (max relative difference ≤ 1e-5 in float32)", lambda x: x["exact"]),
        row(
            "inexact in float32 (of which exact in float64: the original's own rounding)",
            lambda x: f"{x['inexact']} ({x['inexact_float64_rounding']})",
        ),
        row("**unsound folds**", lambda x: f"**{x['unsound']}**"),
        row(
            "clean errors (`EnjoylnError`) / raw exceptions",
            lambda x: f"{x['clean_error']} / {x['raw_error']}",
        ),
        row(
            "**folded LNs** / LN entries",
            lambda x: f"**{x['folded']}** / {x['ln_entries']} ({x['folded_pct']}%)",
        ),
        row("timm: folded / entries", by("timm")),
        row("open_clip: folded / entries", by("open_clip")),
        row(
            "`analyze(model)` without inputs",
            lambda x: f"{x['no_input_ok']} of {x['forward_runs']} ({x['no_input_pct']}%)",
        ),
        "",
        "Skipped: " + ", ".join(f"{k} {v}" for k, v in s["skipped_reasons"].items()) + ".",
        "",
        *(
            [_fewer_line(base, results), ""]
            if not same and results is not None and "results" in base
            else []
        ),
        "Refusal reasons, with module paths, names and numbers taken out:",
        "",
        "| refusal reason | models | LN entries | e.g. |",
        "|---|---|---|---|",
    ]
    for reason, c in list(s["refusals"].items())[:15]:
        lines.append(
            f"| {reason.replace('|', '/')} | {c['models']} | {c['entries']} | `{c['example']}` |"
        )
    lines += [
        "",
        "Command: `python scripts/sweep_timm.py --write` (timm and open_clip installed; per-model "
        "records in `docs/data/sweep_timm_results.json`, the baseline in "
        "`docs/data/sweep_timm_baseline.json`)."
        " torchvision's fake registrations for `torchvision::nms` and `qnms` are skipped while it "
        "imports, "
        "because its CUDA build's C++ ops do not load with the CPU torch.",
    ]
    return "\n".join(lines)


def write_readme(
    summary: dict[str, Any], meta: dict[str, Any], out: Path, results: dict[str, Any] | None = None
) -> None:
    from _docs import replace_section

    base = (
        json.loads(BASELINE.read_text())
        if BASELINE.exists() and out.resolve() != BASELINE.resolve()
        else None
    )
    replace_section("sweep-timm", readme_section(summary, meta, base, results))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated keys (timm/NAME, open_clip/CONFIG/TOWER)")
    ap.add_argument("--list", action="store_true", help="print the sample's keys and exit")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument(
        "--write", action="store_true", help="write the block in docs/architectures.md (sweep-timm)"
    )
    ap.add_argument(
        "--machine-note",
        default="",
        help="said in the block in docs/architectures.md, e.g. that the machine was shared",
    )
    ap.add_argument(
        "--enjoyln-commit", help="the enjoyln version swept, when it is not a git checkout"
    )
    ap.add_argument(
        "--from-results",
        action="store_true",
        help="do not sweep: summarise --out again (and --write docs/architectures.md from it)",
    )
    args = ap.parse_args(argv)

    if args.list:
        print("\n".join(all_keys()))
        return 0
    if args.from_results:
        saved = json.loads(args.out.read_text())
        saved["summary"] = summarize(saved["results"])
        if args.machine_note:
            saved["meta"]["machine_note"] = args.machine_note
            args.out.write_text(json.dumps(saved, indent=1) + "\n")
        print_summary(saved["summary"], saved["meta"])
        if args.write:
            write_readme(saved["summary"], saved["meta"], args.out, saved.get("results"))
        return 0
    keys = args.only.split(",") if args.only else all_keys()
    unknown = [k for k in keys if not k.startswith(("timm/", "open_clip/"))]
    if unknown:
        raise SystemExit(
            f"unknown keys (timm/NAME or open_clip/CONFIG/TOWER): {', '.join(unknown)}"
        )

    import enjoyln

    libs = import_torchvision()
    check_enjoyln_imports_neither()
    libs.update(import_libraries())
    if libs["torchvision_fakes_skipped"]:
        print(
            "torchvision workaround: skipped the fake registrations of "
            + ", ".join(libs["torchvision_fakes_skipped"]),
            flush=True,
        )
    load_before = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    with open(args.out.with_suffix(".jsonl"), "w") as log:
        results = sweep(keys, jobs=args.jobs, timeout=args.timeout, log=log)
    wall = time.perf_counter() - start
    root = Path(enjoyln.__file__).resolve().parent.parent
    commit = (
        args.enjoyln_commit
        or subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    from _docs import machine

    meta = {
        **libs,
        "torch": torch.__version__,
        "enjoyln_commit": commit,
        "enjoyln_path": str(root),
        "machine": machine(),
        "machine_note": args.machine_note,
        "jobs": args.jobs,
        "timeout": args.timeout,
        "wall_seconds": round(wall, 1),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    summary = summarize(results)
    args.out.write_text(
        json.dumps({"meta": meta, "summary": summary, "results": results}, indent=1) + "\n"
    )
    print_summary(summary, meta)
    if args.write:
        write_readme(summary, meta, args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
