"""Lower each distinct Mosaic GPU kernel call once per process, not once per program.

Why: jax lowers a ``pallas_call`` (Pallas → Mosaic GPU dialect → layout inference → serialized module) every time a
program containing it is lowered, and keeps no cache across programs. The engine's step programs differ only in
their bucket (rows, page-table width), so the same FP8-linear and expert kernels, at the same shapes, are lowered
again for every page width: on the H200 host, lowering the 4-layer V4-Flash slice's 8 programs took 41-45 s of its
~60 s cold warm-up, most of it in these kernels (``docs/perf/serving_h200.md``).

How: :func:`kernel_call` exports the kernel's entry point (the jitted wrapper with its XLA glue) at its call's
shapes once (``jax.export``, for the platform being lowered for) and embeds the exported module in every program
that calls it again; embedding a module takes milliseconds (``docs/perf/compile_time_gpu.md``). The kernel's code is
the same custom call either way. The model calls it at its kernel call sites
(:func:`dinfer_jax.models.linear_impl.kernel_linear`, :func:`dinfer_jax.models.expert_kernel.experts_kernel`,
:func:`dinfer_jax.models.mhc.sinkhorn`, the decode-attention call of :mod:`dinfer_jax.models.attention`),
outside any inner ``jax.jit`` (a jitted function's cached trace would not see the switch, a context variable).

Switch: on when the enclosing trace runs under :func:`reuse_kernel_lowerings` with a platform — the engine's model
step does so on a GPU unless ``DINFER_JAX_REUSE_KERNEL_LOWERINGS=0``. On by default since its measurement on the
H200 (``docs/perf/serving_h200.md``, fifth session of 2026-12-05): the 4-layer V4.1-Flash slice lowered its programs
in 21.7 s instead of 43.0 s and warmed up in 47.9 s instead of 59.0 s, with the engine's greedy tokens unchanged.
The cache holds one exported module per (kernel, static arguments, operand shapes and dtypes, platform)
for the life of the process.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import export

ENV = "DINFER_JAX_REUSE_KERNEL_LOWERINGS"
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_kernels_export_platform",
                                                                        default=None)
# custom-call targets of Mosaic GPU kernels: not on jax.export's list of targets with a stability guarantee, which
# does not matter for a module exported and embedded by the same process
_CHECKS = (export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),
           export.DisabledSafetyCheck.custom_call("mosaic_gpu"))


def platform_from_env() -> str | None:
    """``"cuda"`` when the default backend is a GPU and ``DINFER_JAX_REUSE_KERNEL_LOWERINGS`` is unset or ``1``;
    None when it is ``0`` (or any backend but a GPU). Another value is an error naming the variable."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1 (reuse kernel lowerings, the default) or 0")
    if value in ("0", "false"):
        return None
    return "cuda" if jax.default_backend() == "gpu" else None


@contextlib.contextmanager
def reuse_kernel_lowerings(platform: str | None) -> Iterator[None]:
    """Trace the enclosed code with :func:`kernel_call` exporting kernels for ``platform`` (``"cuda"``) and
    reusing them; None: kernels are called directly (lowered with each program)."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


@functools.cache
def _exported(fn: Callable[..., Any], statics: tuple[tuple[str, Any], ...], tree: Any,
              leaves: tuple[tuple[tuple[int, ...], Any], ...], platform: str) -> export.Exported:
    def flat(*arrays: jax.Array) -> Any:
        return fn(*jax.tree_util.tree_unflatten(tree, arrays), **dict(statics))

    # jax.export lowers for forward compatibility by default: Mosaic GPU then serializes the kernel at an older
    # IR version (2 instead of 6 with jax 0.10.2) than a direct lowering. The module is embedded by this very
    # process, so lower it as a program would be (the kernels then match byte for byte up to debug locations).
    flag = "jax_export_ignore_forward_compatibility"
    before = getattr(jax.config, flag)
    jax.config.update(flag, True)
    try:
        return export.export(jax.jit(flat), platforms=[platform], disabled_checks=list(_CHECKS))(
            *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in leaves))
    finally:
        jax.config.update(flag, before)


def kernel_call(fn: Callable[..., Any], *operands: Any, **statics: Any) -> Any:
    """``fn(*operands, **statics)``; under :func:`reuse_kernel_lowerings` with a platform, through the process's
    exported module of that call (exported the first time). ``operands``: arrays or pytrees of arrays (None
    allowed); ``fn`` a module-level function whose result depends only on the operands' structure, shapes and
    dtypes and the hashable ``statics``."""
    platform = _PLATFORM.get()
    if platform is None:
        return fn(*operands, **statics)
    arrays, tree = jax.tree_util.tree_flatten(operands)
    key = tuple((tuple(x.shape), jax.numpy.dtype(x.dtype)) for x in arrays)
    return _exported(fn, tuple(sorted(statics.items())), tree, key, platform).call(*arrays)


__all__ = ["ENV", "kernel_call", "platform_from_env", "reuse_kernel_lowerings"]
