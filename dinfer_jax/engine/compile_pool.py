"""Ahead-of-time compilation of many programs at once (the engine's warm-up).

Every shape bucket is its own XLA program. Compiling a real-dimension step takes tens of seconds inside XLA's
backend compiler, which runs without Python's global lock; lowering it (tracing to a jaxpr, then StableHLO, and the
Pallas kernels' Python lowering) takes a few seconds of Python, which holds the lock. So the warm-up lowers the
programs one after another on the calling thread and compiles each on a pool of threads as soon as it is lowered
(:func:`lower_then_compile`): compiles overlap each other and the lowerings still to come. It then runs each bucket
once: that call finds its executable in jax's in-process compilation cache, so the run costs a trace and a launch,
and it puts the bucket on jit's dispatch fast path.

On a GPU the warm-up is staged (:func:`default_staged`): the programs of one ``(rows, tokens)`` shape differ only
in their page-table width and hold the same GEMM fusions, so the later ones compile after the first one
(:func:`first_of_each`) and find XLA's autotuning results in its process-wide cache instead of autotuning again.
Measured on the H200: ``docs/perf/serving_h200.md``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["CompileTiming", "CompilerOptions", "LoweringJob", "compile_programs", "compiler_options_key",
           "default_compile_threads", "default_staged", "first_of_each", "lower_then_compile"]


def default_compile_threads() -> int:
    """Threads for parallel compilation: ``DINFER_JAX_COMPILE_THREADS`` if set, else the host's cores (XLA's GPU
    compiler also threads inside one compile, but one program's passes are mostly sequential)."""
    env = os.environ.get("DINFER_JAX_COMPILE_THREADS", "").strip()
    if env:
        n = int(env)
        if n < 1:
            raise ValueError(f"DINFER_JAX_COMPILE_THREADS must be >= 1, got {n}")
        return n
    return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class CompileTiming:
    """Where one program's warm-up time went, in seconds after the warm-up began: lowering (tracing to a jaxpr and
    lowering to StableHLO: Python, holds the interpreter lock) from ``lower_start_s`` for ``lower_s``, and XLA's
    backend compile (which does not hold it) from ``compile_start_s`` for ``compile_s``."""

    program: str
    lower_start_s: float
    lower_s: float
    compile_start_s: float
    compile_s: float

    @property
    def end_s(self) -> float:
        return self.compile_start_s + self.compile_s


@dataclasses.dataclass(frozen=True)
class LoweringJob:
    """One program for :func:`lower_then_compile`: ``lower()`` returns its ``jax.stages.Lowered``; ``key``: programs
    with equal keys hold the same GEMM fusions (in a staged warm-up the later ones wait for the first's compile)."""

    program: str
    lower: Callable[[], Any]
    key: Hashable


def lower_then_compile(jobs: Sequence[LoweringJob], threads: int, staged: bool = False,
                       on_done: Callable[[], None] | None = None) -> list[CompileTiming]:
    """Lower every job on the calling thread, one after another, and compile each on a pool of ``threads`` threads
    as soon as it is lowered; returns each program's :class:`CompileTiming` in job order.

    Lowering holds Python's lock, so lowering programs on several threads only interleaves them: every program
    then finishes lowering near the end and every compile starts late. Lowered in turn, the first program's compile
    starts after one lowering and the compiles overlap the remaining lowerings. Jobs are lowered in the order given
    (put the slowest compiles first); with ``staged`` the compile of a job whose key an earlier job had waits for
    that job's compile, whose autotuning results XLA then finds in its process-wide cache (the repeat's lowering
    still overlaps that wait). ``on_done`` is called once per compiled program. The
    first exception (lowering or compiling; it names the program) is raised after the started compiles finish."""
    if threads < 1:
        raise ValueError(f"compile threads must be >= 1, got {threads}")
    origin = time.perf_counter()
    timings: dict[int, CompileTiming] = {}
    errors: list[BaseException] = []

    def compile_one(i: int, lowered: Any, lower_start: float, lower_s: float, wait_for: Future | None) -> None:
        if wait_for is not None:
            wait_for.exception()           # its failure is reported by its own future
        t0 = time.perf_counter()
        lowered.compile()
        timings[i] = CompileTiming(jobs[i].program, lower_start - origin, lower_s, t0 - origin,
                                   time.perf_counter() - t0)
        if on_done is not None:
            on_done()

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compile") as pool:
        futures: list[Future] = []
        first_compile: dict[Hashable, Future] = {}
        for i in range(len(jobs)):
            t0 = time.perf_counter()
            try:
                lowered = jobs[i].lower()
            except BaseException as exc:   # noqa: BLE001 - re-raised below, after the started compiles
                errors.append(exc)
                break
            wait_for = first_compile.get(jobs[i].key) if staged else None
            fut = pool.submit(compile_one, i, lowered, t0, time.perf_counter() - t0, wait_for)
            first_compile.setdefault(jobs[i].key, fut)
            futures.append(fut)
        # a FIFO pool starts a first compile before any repeat that waits on it, so no worker waits forever
        errors += [exc for exc in (f.exception() for f in futures) if exc is not None]
    if errors:
        raise errors[0]
    return [timings[i] for i in range(len(jobs))]


def compile_programs(jobs: Sequence[LoweringJob], threads: int, staged: bool | None = None,
                     tail: Sequence[LoweringJob] = (),
                     on_done: Callable[[], None] | None = None) -> list[CompileTiming]:
    """The engines' warm-up compile: ``jobs`` reordered so the first program of each key goes first
    (:func:`first_of_each`: their compiles autotune, the repeats then find the results cached), then ``tail`` as
    given, through :func:`lower_then_compile` (``staged`` None: :func:`default_staged`). Timings in the compile
    order."""
    first, rest = first_of_each([job.key for job in jobs])
    staged = default_staged() if staged is None else staged
    return lower_then_compile([*(jobs[i] for i in first + rest), *tail], threads, staged, on_done=on_done)


def default_staged() -> bool:
    """Whether the warm-up compiles in two waves (:func:`first_of_each`): ``DINFER_JAX_STAGED_WARMUP`` (``1`` /
    ``0``) if set, else on a GPU (where XLA autotunes its GEMMs; the CPU compiler does not)."""
    env = os.environ.get("DINFER_JAX_STAGED_WARMUP", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"DINFER_JAX_STAGED_WARMUP must be 0 or 1, got {env!r}")
        return env == "1"
    return jax.default_backend() == "gpu"


def first_of_each(keys: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    """Split job indices into the first job of each distinct key and all the others, each list in job order.

    The warm-up compiles the first list before the second on a GPU: XLA keeps the results of its GEMM autotuning
    in a process-wide cache keyed by the fusion, and the programs of one ``(rows, tokens)`` shape differ only in
    their page-table width, so they hold the same GEMM fusions. Compiled all at once, every program autotunes them
    again (the autotuning runs on the one device); compiled after one of them, they find the results cached."""
    first: list[int] = []
    rest: list[int] = []
    seen: set[Hashable] = set()
    for i, key in enumerate(keys):
        (rest if key in seen else first).append(i)
        seen.add(key)
    return first, rest


CompilerOptions = tuple[tuple[str, str | int | float | bool], ...]


def compiler_options_key(options: Mapping[str, str | int | float | bool] | None) -> CompilerOptions:
    """XLA compile options (``DebugOptions`` fields by name, e.g. ``{"xla_gpu_autotune_level": 0}``) as a sorted,
    hashable tuple, checked by compiling an empty program with them: ValueError naming the option XLA rejects.
    ``None`` or ``{}``: XLA's defaults (``()``)."""
    if not options:
        return ()
    key = []
    for name, value in sorted(dict(options).items()):
        if not isinstance(name, str) or not isinstance(value, (str, int, float, bool)):
            raise ValueError(f"compiler option {name!r}={value!r}: names are strings, values str, int, float or bool")
        key.append((name, value))
    try:
        jax.jit(lambda: jnp.zeros(()), compiler_options=dict(key)).lower().compile()
    except Exception as exc:  # XLA's INVALID_ARGUMENT names the option; keep its text
        raise ValueError(f"XLA rejects the compiler options {dict(key)}: {exc}") from exc
    return tuple(key)
