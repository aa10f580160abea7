"""Host time of one norm call with autograd on, for docs/performance.md: enjoyln.RMSNorm against
nn.LayerNorm.

A folded model called without ``torch.no_grad()`` (user code, training, fine-tuning) runs every norm
with gradients enabled and parameters that require grad. At 1 x 768 a call costs its host time
(dispatch, autograd bookkeeping), whatever the device, so the CPU measures what a GPU pays too. Each
candidate is timed in interleaved rounds of ``--calls`` calls, in one process on one thread; the
ratio is taken round by round (each round's RMSNorm against the same round's LayerNorm), and its
median reported with its quartiles. On CPU the clock is the calling thread's CPU time
(``time.thread_time``), so that other processes on a busy machine do not count; on a GPU, wall time
with the device waited for at the end of each round.

    python scripts/bench_grad.py [--rounds 60] [--calls 200] [--device cpu] [--write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import enjoyln
from enjoyln import ops
from enjoyln.timings import Spread

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import machine, replace_section  # noqa: E402

N = 768


def candidates(device: str) -> dict[str, Callable[[], Any]]:
    """The calls to time, LayerNorm first: each with gradients on and parameters that require
    grad."""
    x = torch.randn(1, N, device=device)
    ln = torch.nn.LayerNorm(N, device=device)
    with torch.no_grad():
        ln.weight.add_(torch.rand(N, device=device))
        ln.bias.add_(torch.randn(N, device=device))
    rms = enjoyln.RMSNorm.from_layer_norm(torch.nn.LayerNorm(N, device=device))
    weight_only = enjoyln.RMSNorm(N, bias=False, device=device)
    w, b = rms.weight, rms.bias

    def backward(module: torch.nn.Module) -> Callable[[], Any]:
        return lambda: module(x).sum().backward()

    def python_function() -> Any:
        """The call as it runs where the C++ node cannot be built: the Python autograd.Function."""
        chosen, ops._grad = ops._grad, ops._fused_or_none
        try:
            return rms(x)
        finally:
            ops._grad = chosen

    return {
        "nn.LayerNorm": lambda: ln(x),
        "enjoyln.RMSNorm": lambda: rms(x),
        "enjoyln.RMSNorm, weight only": lambda: weight_only(x),
        "enjoyln.RMSNorm through the Python autograd.Function (no C++ node)": python_function,
        "the enjoyln.rms_norm op (the earlier path)": lambda: torch.ops.enjoyln.rms_norm(
            x, [N], w, b, 1e-5
        ),
        "nn.LayerNorm, forward and backward": backward(ln),
        "enjoyln.RMSNorm, forward and backward": backward(rms),
    }


def measure(
    calls: dict[str, Callable[[], Any]],
    rounds: int,
    per_round: int,
    sync: Callable[[], None],
    clock: Callable[[], float],
) -> dict:
    """µs per call of each candidate, per round, rounds interleaved so drift hits them alike."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():  # warm: the C kernel built, autograd's first-use costs paid
        for _ in range(50):
            fn()
    sync()
    for _ in range(rounds):
        for key, fn in calls.items():
            start = clock()
            for _ in range(per_round):
                fn()
            sync()
            times[key].append((clock() - start) / per_round * 1e6)
    return times


def table(times: dict[str, list[float]]) -> list[str]:
    ln_fwd, ln_both = times["nn.LayerNorm"], times["nn.LayerNorm, forward and backward"]
    rows = [
        "| call (1 x 768, grad on, parameters requiring grad) | µs per call, median (IQR) | / "
        "nn.LayerNorm, "
        "median of the rounds' ratios (IQR) |",
        "|---|---|---|",
    ]
    for key, samples in times.items():
        base = ln_both if "backward" in key else ln_fwd
        s = Spread.of(samples)
        r = Spread.of([a / b for a, b in zip(samples, base)])
        bold = "**" if key == "enjoyln.RMSNorm" else ""
        rows.append(
            f"| {key} | {s.median:.1f} ({s.q1:.1f}-{s.q3:.1f}) | {bold}{r.median:.2f}{bold} "
            f"({r.q1:.2f}-{r.q3:.2f}) |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--write", action="store_true", help="write the grad-host block (CPU runs only)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # a host-time figure: one thread, as a GPU process's Python runs
    torch.manual_seed(0)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.device == "cpu":
        enjoyln.RMSNorm(N)(
            torch.randn(1, N)
        )  # the C++ node built (or its absence warned about) before any timing
    times = measure(
        candidates(args.device),
        args.rounds,
        args.calls,
        sync,
        time.perf_counter if cuda else time.thread_time,
    )
    notes = [w for key, samples in times.items() for w in Spread.of(samples).warnings(key, "µs")]
    path = ops.paths()["cpu" if args.device == "cpu" else "cuda"]["a gradient needed"]
    text = "\n".join(
        [
            f"{torch.cuda.get_device_name() if cuda else 'CPU'}: {machine()}. Path with a "
            f"gradient: {path}. "
            f"{args.rounds} interleaved rounds of {args.calls} calls, timed by "
            f"{'wall time' if cuda else 'the thread CPU time'}.",
            "",
            *table(times),
            *([""] + [f"- {n}" for n in notes] if notes else []),
            "",
            "Command: `python scripts/bench_grad.py --write`.",
        ]
    )
    print(text)
    if args.write and args.device == "cpu":
        replace_section("grad-host", text)


if __name__ == "__main__":
    main()
