"""Compile the Triton kernels ahead of time for real GPUs, with no GPU present.

Triton ships ``ptxas``, so ``triton.compile`` can take each kernel variant down
to PTX and a cubin for a given architecture on any machine. The interpreter
(``TRITON_INTERPRET=1``) accepts code the real compiler may reject, and says
nothing about registers; this module is what the test suite and
``scripts/compile_triton.py`` use to keep every variant compiling for sm_80 and
sm_90 without spilling to local memory.

Compilation runs in fresh processes: Triton builds its standard library for
the interpreter when it is first imported with ``TRITON_INTERPRET=1`` (as the
interpreter tests do), and ``triton.compile`` cannot use that build.

>>> from tools.triton_aot import builds, compile_all
>>> results = compile_all(builds())              # doctest: +SKIP
>>> sum(r.spills for r in results)               # doctest: +SKIP
0
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

ARCHS = (80, 90)
DTYPES = ("fp32", "fp16", "bf16")
AFFINE = ((True, True), (True, False), (False, True), (False, False))  # (weight, bias) present
KERNEL_ARGS = 13  # X, R, S, W, B, Y, four strides, M, N, eps; the constexpr flags follow


@dataclass(frozen=True)
class Variant:
    """One specialisation the launcher can produce."""

    # "rows" (several short rows a program), "row" (one in registers), "looped" (two passes)
    kernel: str
    dtype: str  # Triton's name: fp32, fp16, bf16
    residual: bool
    weight: bool
    bias: bool
    block: int
    warps: int
    aligned: bool  # pointers, strides and N divisible by 16, as Triton's JIT specialises them
    rows: int = 1  # rows per program

    @property
    def name(self) -> str:
        shape = f"{self.rows}x{self.block}" if self.rows > 1 else str(self.block)
        parts = [
            self.kernel,
            self.dtype,
            "res" if self.residual else "plain",
            "w" if self.weight else "-",
            "b" if self.bias else "-",
            f"{shape}/{self.warps}w",
            "aligned" if self.aligned else "unaligned",
        ]
        return " ".join(parts)


@dataclass(frozen=True)
class Compiled:
    """What ``ptxas`` reports for one variant on one architecture."""

    variant: Variant
    arch: int
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame (local memory)
    shared: int  # bytes of shared memory Triton allocates (the reduction scratch)
    ptx_local: bool  # a `.local` state space in the PTX: an array LLVM already put in memory

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def _variant(
    config, dtype: str, residual: bool, weight: bool, bias: bool, aligned: bool
) -> Variant:  # noqa: ANN001
    return Variant(
        config.kernel,
        dtype,
        residual,
        weight,
        bias,
        config.block,
        config.warps,
        aligned,
        config.rows,
    )


def builds(full: bool = False) -> list[tuple[Variant, int]]:
    """The (variant, architecture) pairs to compile.

    By default a covering set, cheap enough for the test suite: each kernel at its largest
    launch (the most registers a thread) in every dtype and every (residual, weight, bias)
    combination, so each constexpr branch compiles, on sm_90; the heaviest form (residual,
    weight and bias) in every dtype, aligned and not, on both architectures, where spills
    would start; and every other launch the launcher picks in the heaviest form (fp32,
    unaligned) on both. ``full``: every combination at the largest launches, aligned and not,
    on both architectures, and the other launches as above.
    """
    from enjoyln.ops import triton_launch as launch

    configs = launch.all_configs()
    largest = {c.kernel: c for c in configs}  # all_configs is sorted by block: the last wins
    out: list[tuple[Variant, int]] = []
    combos = [(d, res, w, b) for d in DTYPES for res in (False, True) for w, b in AFFINE]
    for config in largest.values():
        for dtype, residual, weight, bias in combos:
            for aligned in (True, False):
                for arch in ARCHS:
                    heaviest = residual and weight and bias
                    if full or (arch == 90 and not aligned) or heaviest:
                        out.append((_variant(config, dtype, residual, weight, bias, aligned), arch))
    for config in configs:
        if config not in largest.values():
            out += [(_variant(config, "fp32", True, True, True, False), arch) for arch in ARCHS]
    return out


def variants() -> list[Variant]:
    """Every distinct variant ``builds(full=True)`` compiles."""
    return list(dict.fromkeys(v for v, _ in builds(full=True)))


@lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    """A private copy of ``triton_kernels`` compiled as JIT functions.

    With ``TRITON_INTERPRET=1`` the imported module's kernels are interpreter
    functions, which ``triton.compile`` cannot take; and importing it here with the
    interpreter off would hand JIT kernels to a later interpreter test.
    """
    from triton import knobs

    import enjoyln.ops

    path = Path(enjoyln.ops.__file__).with_name("triton_kernels.py")
    spec = importlib.util.spec_from_file_location("enjoyln.ops._triton_kernels_aot", path)
    module = importlib.util.module_from_spec(spec)
    with knobs.runtime.scope():
        knobs.runtime.interpret = False
        spec.loader.exec_module(module)
    return module


def _signature(v: Variant) -> tuple[dict[str, str], dict[str, object], dict]:
    ptr = "*" + v.dtype
    signature = {
        "X": ptr,
        "R": ptr,
        "S": ptr,
        "W": ptr if v.weight else "constexpr",
        "B": ptr if v.bias else "constexpr",
        "Y": ptr,
        "stride_x": "i64",
        "stride_r": "i64",
        "stride_s": "i64",
        "stride_y": "i64",
        "M": "i32",
        "N": "i32",
        "eps": "fp32",
        "HAS_RES": "constexpr",
        "HAS_W": "constexpr",
        "HAS_B": "constexpr",
        "BLOCK": "constexpr",
        "ROWS": "constexpr",
    }
    constexprs: dict[str, object] = {
        "HAS_RES": v.residual,
        "HAS_W": v.weight,
        "HAS_B": v.bias,
        "BLOCK": v.block,
        "ROWS": v.rows,
    }
    if not v.weight:
        constexprs["W"] = None
    if not v.bias:
        constexprs["B"] = None
    names = list(signature)
    attrs = {}
    if v.aligned:  # what the JIT does when a pointer or integer is a multiple of 16 (not M: never
        # specialised; nor eps)
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, name in enumerate(names[: KERNEL_ARGS - 1])
            if signature[name] != "constexpr" and name != "M"
        }
    return signature, constexprs, attrs


def _field(pattern: str, log: str) -> int:
    match = re.search(pattern, log)
    if match is None:
        raise RuntimeError(f"no {pattern!r} in the ptxas log:\n{log}")
    return int(match.group(1))


def compile_variant(v: Variant, arch: int, cache_dir: str | None = None) -> Compiled:
    """Compile ``v`` for ``sm_{arch}`` and read registers and spills from ptxas' log.

    Needs a process whose Triton was not imported for the interpreter; ``compile_all``
    provides one."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = _kernels()
    fn = kernels.KERNELS[v.kernel]
    signature, constexprs, attrs = _signature(v)
    log = io.StringIO()
    with contextlib.ExitStack() as stack:
        for group in (knobs.nvidia, knobs.compilation, knobs.cache, knobs.runtime):
            stack.enter_context(group.scope())
        knobs.runtime.interpret = False
        knobs.nvidia.dump_ptxas_log = True  # ptxas runs with -v; its log is printed
        knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
        if cache_dir is not None:
            knobs.cache.dir = cache_dir
        stack.enter_context(contextlib.redirect_stdout(log))
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": v.warps},
        )
    text = log.getvalue()
    return Compiled(
        v,
        arch,
        registers=_field(r"Used (\d+) registers", text),
        spill_stores=_field(r"(\d+) bytes spill stores", text),
        spill_loads=_field(r"(\d+) bytes spill loads", text),
        stack=_field(r"(\d+) bytes stack frame", text),
        shared=int(compiled.metadata.shared or 0),
        ptx_local=re.search(r"\.local\b", compiled.asm["ptx"]) is not None,
    )


def compile_all(
    pairs: list[tuple[Variant, int]], cache_dir: str | None = None, workers: int = 2
) -> list[Compiled]:
    """``compile_variant`` for each (variant, arch), in ``workers`` fresh processes.

    Spawned, not forked: the caller may hold torch's thread pools, which a forked
    child must not touch, or a Triton imported for the interpreter."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max(1, workers), mp_context=context, initializer=_without_interpreter
    ) as pool:
        return list(pool.map(compile_variant, *zip(*pairs), [cache_dir] * len(pairs), chunksize=4))


def _without_interpreter() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # before this worker first imports Triton


def ptxas_missing() -> str | None:
    """Why ahead-of-time compilation cannot run here, or None; imports nothing from Triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return "triton is not installed (pip install 'enjoyln[triton]')"
    bin_dir = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin"
    for name, env in (
        ("ptxas", "TRITON_PTXAS_PATH"),
        ("ptxas-blackwell", "TRITON_PTXAS_BLACKWELL_PATH"),
    ):
        paths = [
            p for p in (os.environ.get(env), str(bin_dir / name)) if p
        ]  # as Triton looks for it
        if not any(os.access(p, os.X_OK) for p in paths):
            return f"triton has no {name} at {paths[-1]} (a build without the NVIDIA backend?)"
    return None
