"""GPU benchmark for docs/performance.md: enjoyln's RMSNorm on CUDA beside LayerNorm, alone and in
models.

Parts (``--parts``, all by default):

- ``env``: the GPU, its driver, CUDA, torch and Triton, the path each call takes
  (``ops.status()``), and the device's copy bandwidth (the floor for any norm);
- ``host``: time per call on a 1 x 768 tensor, where a call costs its host time
  (launch-bound): ``F.layer_norm``, ``F.rms_norm``, ``ops.rms_norm`` with weight and
  bias, weight only and weightless, and the launch candidates for a norm with a bias
  side by side: enjoyln's cached launcher, Triton's own launcher, ``F.rms_norm`` then
  the add, the same kernel behind ``torch.library.triton_op``, and Liger-Kernel where
  it is installed;
- ``kernels``: kernel time (``triton.testing.do_bench`` medians) per shape and dtype:
  LayerNorm, enjoyln (with a bias, and weight only), ``F.rms_norm``, a copy of the
  input, Liger where installed; the fused add + norm against the add then LayerNorm;
  enjoyln's share of the copy bandwidth; ulps against float64;
- ``e2e``: GPT-2, BERT (512 tokens, its longest), OPT, BLOOM with auxiliary centering,
  Phi-1.5 and ViT-B in the paper's setting (batch 2 x 1024 tokens; ViT batch 8 at
  224 x 224), random perturbed weights folded on the CPU in float32, in fp32, bf16 and
  fp16, eager and compiled, original and folded alternating in one process (CUDA
  events), median and interquartile range; how far each is from the float32 original;
  and the folded model captured in a CUDA graph and replayed.

    python scripts/bench_gpu.py [--parts env,host,kernels,e2e] [--models gpt2,opt] [--json OUT.json]
    [--write] python scripts/bench_gpu.py --dry-run   # on the CPU, tiny sizes, a few seconds (the
    test suite runs it)

``--write`` (on a GPU only) replaces the ``gpu`` block of docs/performance.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import enjoyln
from enjoyln import ops
from enjoyln.testing import perturb, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import replace_section  # noqa: E402

SHAPES = [
    (2048, 768),
    (16384, 768),
    (16384, 1024),
    (8192, 2048),
    (8192, 4096),
    (4096, 8192),
    (2048, 16384),
    (1024, 32768),
]
MODELS = ("gpt2", "bert", "opt", "bloom", "phi", "vit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Bench:
    """Where and how long to measure: a GPU, or the CPU for a dry run."""

    def __init__(self, dry_run: bool) -> None:
        self.cuda = not dry_run
        self.device = "cuda" if self.cuda else "cpu"
        self.dry = dry_run

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def per_call_us(self, fn: Callable[[], Any], calls: int) -> float:
        """µs per call over ``calls`` back to back, waited for once: the host time of a
        launch-bound call."""
        for _ in range(max(5, calls // 20)):
            fn()
        self.sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        self.sync()
        return (time.perf_counter() - start) / calls * 1e6

    def kernel_us(self, fn: Callable[[], Any]) -> float:
        """Median µs of one call's kernels (do_bench clears the L2 cache between runs)."""
        if self.cuda:
            import triton.testing

            return (
                float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
            )
        return statistics.median(self.per_call_us(fn, 3) for _ in range(3))


def side_by_side(
    bench: Bench, calls: dict[str, Callable[[], Any]], measure: Callable, rounds: int
) -> dict:
    """Each candidate measured in ``rounds`` interleaved rounds, so drift hits them alike: medians.
    A candidate that raises is reported as its error, not measured."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for key, fn in calls.items():
            if key in errors:
                continue
            try:
                times[key].append(measure(fn))
            except Exception as exc:  # noqa: BLE001 - a broken candidate must not lose the others
                errors[key] = (
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                )
    return {k: (statistics.median(v) if v else errors[k]) for k, v in times.items()}


# --- env ------------------------------------------------------------------------------------------


def part_env(bench: Bench) -> dict:
    d: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "paths": ops.status(),
        "enjoyln": enjoyln.__version__,
    }
    try:
        import triton

        d["triton"] = triton.__version__
    except ImportError:
        d["triton"] = None
    if not bench.cuda:
        return d
    props = torch.cuda.get_device_properties(0)
    d.update(gpu=props.name, sms=props.multi_processor_count, driver=_driver())
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB read, 1 GiB written
    b = torch.empty_like(a)
    us = bench.kernel_us(lambda: b.copy_(a))
    d["copy_gbps"] = 2 * a.numel() / (us * 1e-6) / 1e9
    a = b = None  # the 2 GiB back before the kernels run
    torch.cuda.empty_cache()
    return d


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


# --- host time and the launch candidates ----------------------------------------------------------


_TRITON_OPS: dict[int, Callable] = {}


def _triton_op(n: int) -> Callable | None:
    """enjoyln's kernel behind ``torch.library.triton_op`` (torch 2.6+), for comparison only:
    one op per row length, registered once."""
    if not hasattr(torch.library, "triton_op"):
        return None
    if n in _TRITON_OPS:
        return _TRITON_OPS[n]
    from enjoyln.ops.triton_kernels import KERNELS
    from enjoyln.ops.triton_launch import launch_config

    cfg = launch_config(n)

    @torch.library.triton_op(f"enjoyln_bench::rms_norm_{n}", mutates_args=())
    def rms_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        y = torch.empty_like(x)
        rows = x.numel() // n
        torch.library.wrap_triton(KERNELS[cfg.kernel])[(-(-rows // cfg.rows),)](
            x,
            x,
            y,
            w,
            b,
            y,
            n,
            n,
            n,
            n,
            rows,
            n,
            eps,
            False,
            True,
            True,
            cfg.block,
            cfg.rows,
            num_warps=cfg.warps,
        )
        return y

    _TRITON_OPS[n] = rms_norm
    return rms_norm


def _liger() -> tuple[Any, Any]:
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:  # noqa: BLE001 - not installed, or not importable here
        return None, None
    return LigerRMSNormFunction, LigerLayerNormFunction


def part_host(bench: Bench, dtypes: list[str]) -> dict:
    n, calls, out = 768, 200 if bench.dry else 2000, {}
    liger_rms, _ = _liger()
    for name in dtypes:
        dtype = DTYPES[name]
        x = torch.randn(1, n, device=bench.device, dtype=dtype)
        w, b = (
            torch.ones(n, device=bench.device, dtype=dtype),
            torch.zeros(n, device=bench.device, dtype=dtype),
        )
        cands: dict[str, Callable[[], Any]] = {
            "F.layer_norm": lambda: F.layer_norm(x, (n,), w, b, 1e-5),
            "F.rms_norm (no bias)": lambda: F.rms_norm(x, (n,), w, 1e-5),
            "ops.rms_norm, weight and bias": lambda: ops.rms_norm(x, (n,), w, b, 1e-5),
            "ops.rms_norm, weight": lambda: ops.rms_norm(x, (n,), w, None, 1e-5),
            "ops.rms_norm, weightless": lambda: ops.rms_norm(x, (n,), None, None, 1e-5),
            "F.rms_norm then the bias add": lambda: F.rms_norm(x, (n,), w, 1e-5).add_(b),
        }
        if bench.cuda and ops.status()["cuda"] != "not available":
            from enjoyln.ops import triton_kernels as tk

            cands["Triton kernel, enjoyln's cached launcher"] = lambda: tk.rms_norm_triton(
                x, w, b, 1e-5
            )
            cands["Triton kernel, Triton's launcher"] = lambda: tk.rms_norm_triton(
                x, w, b, 1e-5, cached=False
            )
            if (op := _triton_op(n)) is not None:
                cands["Triton kernel, torch.library.triton_op"] = lambda: op(x, w, b, 1e-5)
        if liger_rms is not None and bench.cuda:
            cands["Liger RMSNorm (no bias)"] = lambda: liger_rms.apply(x, w, 1e-5)
        with torch.inference_mode():
            out[name] = side_by_side(bench, cands, lambda fn: bench.per_call_us(fn, calls), 5)
        out[name]["path (weight and bias)"] = ops.backend(x, w, b)
    return out


# --- kernels
# ----------------------------------------------------------------------------------------


def _ulps(y: torch.Tensor, truth: torch.Tensor) -> float:
    return float(
        (y.double() - truth).abs().max()
        / truth.abs().max().clamp_min(1.0)
        / torch.finfo(y.dtype).eps
    )


def _kernel_row(bench: Bench, m: int, n: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g, dtype=torch.float64) * 2
    x = (x - x.mean(-1, keepdim=True)).to(
        bench.device, dtype
    )  # a folded model's input: zero-mean rows
    r = torch.randn(m, n, generator=g).to(bench.device, dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(bench.device, dtype)
    b = torch.randn(n, generator=g).to(bench.device, dtype)
    calls = {
        "layer_norm": lambda: F.layer_norm(x, (n,), w, b, 1e-5),
        "enjoyln": lambda: ops.rms_norm(x, (n,), w, b, 1e-5),
        "enjoyln_weight_only": lambda: ops.rms_norm(x, (n,), w, None, 1e-5),
        "torch_rms_norm": lambda: F.rms_norm(x, (n,), w, 1e-5),
        "copy": lambda: x.clone(),
        "add_then_layer_norm": lambda: F.layer_norm(x + r, (n,), w, b, 1e-5),
        "enjoyln_add_norm": lambda: ops.add_rms_norm(x, r, (n,), w, b, 1e-5),
    }
    liger_rms, liger_ln = _liger()
    if liger_rms is not None and bench.cuda:
        calls["liger_rms_norm"] = lambda: liger_rms.apply(x, w, 1e-5)
        calls["liger_layer_norm"] = lambda: liger_ln.apply(x, w, b, 1e-5)
    with torch.inference_mode():
        us = side_by_side(bench, calls, bench.kernel_us, 1 if bench.dry else 3)
        truth = F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        row = {
            "shape": f"{m}x{n}",
            "dtype": str(dtype).removeprefix("torch."),
            "us": us,
            "path": ops.backend(x, w, b),
            "bytes": 2 * m * n * x.element_size(),
            "enjoyln_ulps": _ulps(ops.rms_norm(x, (n,), w, b, 1e-5), truth),
            "layer_norm_ulps": _ulps(F.layer_norm(x, (n,), w, b, 1e-5), truth),
        }
        s, _ = ops.add_rms_norm(x, r, (n,), w, b, 1e-5)
        row["add_sum_exact"] = bool(torch.equal(s, x + r))
    return row


def part_kernels(bench: Bench, dtypes: list[str]) -> list[dict]:
    shapes = [(64, 96), (32, 1024)] if bench.dry else SHAPES
    rows = []
    for name in dtypes:
        for m, n in shapes:
            rows.append(_kernel_row(bench, m, n, DTYPES[name]))
            print(
                f"  kernels {rows[-1]['shape']} {name}: "
                + ", ".join(
                    f"{k} {v:.1f}" for k, v in rows[-1]["us"].items() if isinstance(v, float)
                ),
                flush=True,
            )
            if bench.cuda:
                torch.cuda.empty_cache()
    return rows


# --- end to end
# -------------------------------------------------------------------------------------


def build(name: str, dry: bool) -> torch.nn.Module:
    """The model at its real size (random weights), or the test zoo's tiny one for a dry run."""
    if dry:
        return tiny_model(name)
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config())
    if name == "bert":
        return tf.BertModel(tf.BertConfig(), add_pooling_layer=False)
    if name == "opt":
        return tf.OPTForCausalLM(
            tf.OPTConfig(
                hidden_size=768,
                num_hidden_layers=12,
                num_attention_heads=12,
                ffn_dim=3072,
                word_embed_proj_dim=768,
                max_position_embeddings=2048,
            )
        )
    if name == "bloom":
        return tf.BloomForCausalLM(tf.BloomConfig(n_layer=24, hidden_size=1024, n_head=16))
    if name == "phi":
        return tf.PhiForCausalLM(
            tf.PhiConfig(
                num_hidden_layers=24,
                hidden_size=2048,
                num_attention_heads=32,
                intermediate_size=8192,
                max_position_embeddings=2048,
            )
        )
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(), add_pooling_layer=False)
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")


def inputs_for(name: str, model: torch.nn.Module, dry: bool) -> dict[str, torch.Tensor]:
    """The paper's setting: batch 2 x 1024 tokens (BERT: 512, its longest); ViT batch 8."""
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        size = model.config.image_size
        return {"pixel_values": torch.randn(2 if dry else 8, 3, size, size, generator=g)}
    seq = 16 if dry else 512 if name == "bert" else 1024
    return {"input_ids": torch.randint(0, model.config.vocab_size, (2, seq), generator=g)}


def _output(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _rel(y: torch.Tensor, truth: torch.Tensor) -> float:
    return float((y.double() - truth).abs().max() / truth.abs().max().clamp_min(1e-30))


def alternate(bench: Bench, a: Callable, b: Callable, rounds: int, per: int) -> dict:
    """Blocks of ``per`` forwards of A and of B, in alternating order; ms per forward: medians and
    IQR."""
    times: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(2):
        a(), b()
    bench.sync()
    for i in range(rounds):
        for key, fn in (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a)):
            start_t = time.perf_counter()
            if bench.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            for _ in range(per):
                fn()
            if bench.cuda:
                end.record()
                end.synchronize()
                times[key].append(start.elapsed_time(end) / per)
            else:
                times[key].append((time.perf_counter() - start_t) * 1e3 / per)
    out = {}
    for key, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        out[f"{key}_ms"], out[f"{key}_iqr_ms"] = statistics.median(ts), q[2] - q[0]
    out["speedup_pct"] = 100 * (out["a_ms"] - out["b_ms"]) / out["a_ms"]
    return out


def _graph_replay(bench: Bench, model: torch.nn.Module, inp: dict, want: torch.Tensor) -> str:
    """Capture one forward of ``model`` in a CUDA graph, replay it, compare with the eager
    output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up on a side stream, as capture requires: compiles and verifies
            model(**inp)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _output(model(**inp))
    graph.replay()
    bench.sync()
    return "ok" if torch.equal(out, want) else f"replay differs by {_rel(out, want.double()):.1e}"


def _try(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the timings stand
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _key(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _one_dtype(
    bench: Bench,
    name: str,
    ref: torch.nn.Module,
    folded: torch.nn.Module,
    inp_cpu: dict,
    dtype: torch.dtype,
    truth: torch.Tensor | None,
    args: argparse.Namespace,
) -> tuple[dict, torch.Tensor]:
    a = copy.deepcopy(ref).to(
        bench.device, dtype
    )  # from the float32 masters, never a cast of a cast
    b = copy.deepcopy(folded).to(bench.device, dtype)
    inp = {
        k: (v.to(bench.device, dtype) if v.is_floating_point() else v.to(bench.device))
        for k, v in inp_cpu.items()
    }
    row: dict[str, Any] = {}
    with torch.inference_mode():
        ya, yb = _output(a(**inp)), _output(b(**inp))
        # float32 is judged against the float32 original; bf16 and fp16, both models, against it too
        row["rel_original"] = _rel(ya, truth) if truth is not None else 0.0
        row["rel_folded"] = _rel(yb, truth if truth is not None else ya.double())
        rounds, per = (2, 1) if bench.dry else (9, 8)
        row["eager"] = alternate(bench, lambda: a(**inp), lambda: b(**inp), rounds, per)
        if bench.cuda and args.graphs:  # the original too: a failure there is the model's own code
            row["cuda_graph"] = {
                label: _try(lambda m=m, y=y: _graph_replay(bench, m, inp, y))
                for label, m, y in (("original", a, ya), ("folded", b, yb))
            }
        compiling = name in args.compile_models and _key(dtype) in args.compile_dtypes
        for mode in args.compile_modes if compiling else []:
            torch._dynamo.reset()
            ca, cb = torch.compile(a, mode=mode), torch.compile(b, mode=mode)
            row[f"compiled_{mode}"] = alternate(
                bench, lambda: ca(**inp), lambda: cb(**inp), rounds, per
            )
            row[f"compiled_{mode}"]["rel_folded_vs_eager_original"] = _rel(
                _output(cb(**inp)), ya.double()
            )
    return row, ya


def e2e_model(bench: Bench, name: str, dtypes: list[str], args: argparse.Namespace) -> dict:
    ref = perturb(build(name, bench.dry)).eval()
    folded = copy.deepcopy(ref)
    start = time.time()
    # BLOOM folds its norms only with auxiliary centering
    enjoyln.fold(folded, auxiliary_centering=name == "bloom", fuse_affine=args.fuse_affine)
    out: dict[str, Any] = {
        "model": name,
        "fold_s": time.time() - start,
        "layer_norms": sum(isinstance(m, torch.nn.LayerNorm) for m in ref.modules()),
        "folded": sum(isinstance(m, enjoyln.RMSNorm) for m in folded.modules()),
    }
    inp = inputs_for(name, ref, bench.dry)
    truth = None
    for key in sorted(
        dtypes, key=lambda d: d != "fp32"
    ):  # float32 first: the others are judged by it
        row, y = _one_dtype(bench, name, ref, folded, inp, DTYPES[key], truth, args)
        if key == "fp32":
            truth = y.double()
        out[key] = row
        print(f"  e2e {name} {key}: {json.dumps(row, default=str)[:300]}", flush=True)
        if bench.cuda:
            torch.cuda.empty_cache()
    return out


def part_e2e(
    bench: Bench, models: list[str], dtypes: list[str], args: argparse.Namespace
) -> list[dict]:
    rows = []
    for name in models:
        try:
            rows.append(e2e_model(bench, name, dtypes, args))
        except Exception as exc:  # noqa: BLE001 - one model failing must not lose the others
            rows.append(
                {"model": name, "error": repr(exc), "traceback": traceback.format_exc()[-2000:]}
            )
            print(f"  e2e {name} FAILED: {exc!r}", flush=True)
    return rows


# --- the report
# -------------------------------------------------------------------------------------


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else "-"


def _x(v: Any, base: Any) -> str:
    return f"{v / base:.2f}x" if isinstance(v, float) and isinstance(base, float) else "-"


def host_table(host: dict) -> list[str]:
    names = list(host)
    rows = [
        f"| call (1 x 768) | {' | '.join(f'{n} µs | x F.layer_norm' for n in names)} |",
        "|---|" + "---|---|" * len(names),
    ]
    keys = [k for k in host[names[0]] if k != "path (weight and bias)"]
    for key in keys:
        cells = " | ".join(
            f"{_us(host[n].get(key))} | {_x(host[n].get(key), host[n].get('F.layer_norm'))}"
            for n in names
        )
        rows.append(f"| {key} | {cells} |")
    paths = " | ".join(f"{host[n]['path (weight and bias)']} | " for n in names)
    rows.append(f"| the path `ops.rms_norm` took with a bias | {paths}|")
    return rows


def kernel_table(kernels: list[dict], copy_gbps: float | None) -> list[str]:
    rows = [
        "| shape | dtype | path | LayerNorm µs | **enjoyln µs** | **x LN** | weight only µs | "
        "F.rms_norm µs "
        "| copy µs | enjoyln % of copy bandwidth | add + norm: enjoyln / (add, LN) | ulps: "
        "enjoyln, LN |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in kernels:
        us = r["us"]
        share = (
            f"{100 * r['bytes'] / (us['enjoyln'] * 1e-6) / 1e9 / copy_gbps:.0f}%"
            if copy_gbps and isinstance(us.get("enjoyln"), float)
            else "-"
        )
        rows.append(
            f"| {r['shape']} | {r['dtype']} | {r['path']} | {_us(us.get('layer_norm'))} "
            f"| **{_us(us.get('enjoyln'))}** | **{_x(us.get('enjoyln'), us.get('layer_norm'))}** "
            f"| {_us(us.get('enjoyln_weight_only'))} | {_us(us.get('torch_rms_norm'))} | "
            f"{_us(us.get('copy'))} "
            f"| {share} | {_x(us.get('enjoyln_add_norm'), us.get('add_then_layer_norm'))} "
            f"| {r['enjoyln_ulps']:.2f}, {r['layer_norm_ulps']:.2f} |"
        )
    return rows


def _timing(t: dict | None) -> str:
    if not t:
        return "- | - | -"
    return (
        f"{t['a_ms']:.2f} ± {t['a_iqr_ms'] / 2:.2f} | {t['b_ms']:.2f} ± {t['b_iqr_ms'] / 2:.2f} "
        f"| **{t['speedup_pct']:+.1f}%**"
    )


def e2e_table(e2e: list[dict], dtypes: list[str]) -> list[str]:
    rows = [
        "| model | LNs folded | dtype | eager original ms | eager folded ms | **eager speedup** "
        "| compiled original ms | compiled folded ms | **compiled speedup** | from the fp32 "
        "original: original, "
        "folded | captured in a CUDA graph and replayed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in e2e:
        if "error" in m:
            rows.append(f"| {m['model']} | failed: {m['error'][:120]} |" + " |" * 9)
            continue
        for key in dtypes:
            r = m.get(key, {})
            rel = f"{r['rel_original']:.1e}, {r['rel_folded']:.1e}" if "rel_original" in r else "-"
            graph = r.get("cuda_graph", {})
            graphs = f"original {graph['original']}, folded {graph['folded']}" if graph else "-"
            rows.append(
                f"| {m['model']} | {m['folded']}/{m['layer_norms']} | {key} | "
                f"{_timing(r.get('eager'))} "
                f"| {_timing(r.get('compiled_default'))} | {rel} | {graphs} |"
            )
    return rows


def targets(res: dict) -> list[str]:
    """The targets enjoyln set itself, each with what this run measured."""
    lines = []
    host = res.get("host", {}).get("bf16", {})
    ln = host.get("F.layer_norm")
    for key in (
        "ops.rms_norm, weight and bias",
        "ops.rms_norm, weight",
        "ops.rms_norm, weightless",
    ):
        v = host.get(key)
        if isinstance(v, float) and isinstance(ln, float):
            lines.append(
                f"- host time, {key}: {v / ln:.2f}x F.layer_norm's (target <= 1.0): "
                f"{'met' if v <= ln else 'not met'}"
            )
    worst = [
        (r["us"]["enjoyln"] / r["us"]["layer_norm"], r["shape"], r["dtype"])
        for r in res.get("kernels", [])
        if isinstance(r["us"].get("enjoyln"), float)
        and isinstance(r["us"].get("layer_norm"), float)
    ]
    if worst:
        ratio, shape, dtype = max(worst)
        lines.append(
            f"- kernel time against LayerNorm's, worst: {ratio:.2f}x at {shape} {dtype} (target <= "
            "1.0): "
            f"{'met' if ratio <= 1 else 'not met'}"
        )
    for m in res.get("e2e", []):
        for key in ("fp32", "bf16", "fp16"):
            t = m.get(key, {}).get("eager")
            if t:
                need = 3.0 if key == "bf16" and m["model"] in ("gpt2", "opt", "vit") else 0.0
                lines.append(
                    f"- {m['model']} {key} eager: {t['speedup_pct']:+.1f}% (target >= "
                    f"{need:+.0f}%): "
                    f"{'met' if t['speedup_pct'] >= need else 'not met'}"
                )
    return lines


def report(res: dict, args: argparse.Namespace) -> str:
    env = res.get("env", {})
    where = (
        f"{env.get('gpu')} ({env.get('sms')} SMs), driver {env.get('driver')}, CUDA "
        f"{env.get('cuda')}"
        if env.get("gpu")
        else "the CPU (a dry run: tiny sizes, not a measurement)"
    )
    copy_gbps = env.get("copy_gbps")
    parts = [
        f"Measured on {where}; torch {env.get('torch')}, Triton {env.get('triton')}, enjoyln "
        f"{env.get('enjoyln')}"
        + (f"; device-to-device copy {copy_gbps:.0f} GB/s" if copy_gbps else "")
        + ".",
        f"CUDA paths: {env.get('paths', {}).get('cuda')}.",
    ]
    if res.get("host"):
        parts += [
            "",
            "**Host time per call** (1 x 768, launch-bound: a call costs its host time):",
            "",
            *host_table(res["host"]),
        ]
    if res.get("kernels"):
        parts += [
            "",
            "**Kernels** (`triton.testing.do_bench` medians, L2 cleared; inputs zero-mean, as a "
            "folded model's are):",
            "",
            *kernel_table(res["kernels"], copy_gbps),
        ]
    if res.get("e2e"):
        how = "with `fuse_affine=True`, " if args.fuse_affine else ""
        parts += [
            "",
            f"**End to end** (random perturbed weights, folded {how}on the CPU in float32; medians "
            "± half the "
            "interquartile range of alternating blocks of forwards; compiled: `torch.compile`, "
            "default mode):",
            "",
            *e2e_table(res["e2e"], args.dtypes),
        ]
    lines = targets(res) if env.get("gpu") else []  # a dry run's figures judge nothing
    if lines:
        parts += ["", "Against the targets:", "", *lines]
    flags = " --fuse-affine" if args.fuse_affine else ""
    parts += ["", f"Command: `python scripts/bench_gpu.py{flags} --write`."]
    return "\n".join(parts)


# --- main
# ---------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="env,host,kernels,e2e")
    p.add_argument(
        "--models",
        default=None,
        help=f"comma-separated, of {','.join(MODELS)} (dry run: gpt2,bloom)",
    )
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument(
        "--compile-models",
        default=None,
        help="models also compiled (default gpt2,opt; dry run: none)",
    )
    p.add_argument(
        "--compile-modes",
        default="default",
        help="torch.compile modes, e.g. default,reduce-overhead",
    )
    p.add_argument("--compile-dtypes", default="bf16", help="dtypes the compiled models run in")
    p.add_argument(
        "--no-graphs", dest="graphs", action="store_false", help="skip the CUDA graph capture"
    )
    p.add_argument(
        "--fuse-affine", action="store_true", help="fold with fuse_affine=True (weightless norms)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU at tiny sizes: checks the script, measures nothing",
    )
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument(
        "--write", action="store_true", help="replace the gpu block of docs/performance.md"
    )
    args = p.parse_args(argv)
    args.parts, args.dtypes = args.parts.split(","), args.dtypes.split(",")
    args.models = (args.models or ("gpt2,bloom" if args.dry_run else ",".join(MODELS))).split(",")
    compiled = (
        args.compile_models
        if args.compile_models is not None
        else ("" if args.dry_run else "gpt2,opt")
    )
    args.compile_models, args.compile_modes = (
        [m for m in compiled.split(",") if m],
        args.compile_modes.split(","),
    )
    args.compile_dtypes = args.compile_dtypes.split(",")
    if args.write and args.dry_run:
        p.error("--write needs a GPU run, not a dry run")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or pass --dry-run")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    threads = torch.get_num_threads()
    if args.dry_run:
        torch.set_num_threads(1)  # tiny tensors: threads only add noise
    try:
        return run(args, Bench(args.dry_run))
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, bench: Bench) -> dict:
    res: dict[str, Any] = {}
    steps = {
        "env": lambda: part_env(bench),
        "host": lambda: part_host(bench, args.dtypes[:2]),
        "kernels": lambda: part_kernels(bench, args.dtypes),
        "e2e": lambda: part_e2e(bench, args.models, args.dtypes, args),
    }
    for name in ["env", *[p for p in args.parts if p != "env"]]:
        print(f"== {name}", flush=True)
        res[name] = steps[name]()
        if args.json:
            args.json.write_text(json.dumps(res, indent=1, default=str))
    text = report(res, args)
    print(text)
    if args.write:
        replace_section("gpu", text)
    return res


if __name__ == "__main__":
    main()
