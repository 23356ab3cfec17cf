"""Ahead-of-time compilation of many programs at once (the engine's warm-up).

Every shape bucket is its own XLA program, and compiling a real-dimension step takes tens of seconds, almost all
of it inside XLA's backend compiler, which runs without Python's global lock. So the warm-up lowers and compiles
the buckets from a pool of threads (``jit(...).lower(...).compile()``) and only then runs each bucket once: that
call finds its executable in jax's in-process compilation cache, so the run costs a trace and a launch, and it
puts the bucket on jit's dispatch fast path as before. Tracing and lowering still hold the lock (a few seconds per
program); the backend compiles overlap.

On a GPU the warm-up compiles in two waves (:func:`first_of_each`, :func:`default_staged`): one program of each
``(rows, tokens)`` shape first, then the other page-table widths of the same shapes, which hold the same GEMM
fusions and so find XLA's autotuning results in its process-wide cache instead of autotuning them again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["CompilerOptions", "compile_all", "compiler_options_key", "default_compile_threads", "default_staged",
           "first_of_each"]


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


def compile_all(jobs: Sequence[Callable[[], Any]], threads: int, on_done: Callable[[], None] | None = None) -> None:
    """Run ``jobs`` (each lowers and compiles one program, e.g. ``lambda: f.lower(*args).compile()``) on up to
    ``threads`` threads; ``on_done`` is called once per finished job (progress). The first job's exception is
    raised after the others have finished (a compile error names its program)."""
    if threads < 1:
        raise ValueError(f"compile threads must be >= 1, got {threads}")
    if threads == 1 or len(jobs) <= 1:
        for job in jobs:
            job()
            if on_done is not None:
                on_done()
        return
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="compile") as pool:
        for fut in as_completed([pool.submit(job) for job in jobs]):
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
            if on_done is not None:
                on_done()
    if errors:
        raise errors[0]


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
