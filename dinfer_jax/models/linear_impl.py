"""Which implementation the model's FP8 linears use while a step is traced: XLA's GEMM fusion (``"xla"``) or the
Mosaic GPU kernel (``"pallas"``, :mod:`pallas_kernels.linear`); ``"auto"`` (the engine's default) is the kernel on a
GPU and XLA elsewhere (:func:`resolve_linear_impl`).

The setting is held in a context variable for the duration of tracing (as the batch-invariant tile is,
:mod:`dinfer_jax.models.invariant`), so :func:`dinfer_jax.models.ops.linear` reads it without every projection's
signature carrying it; :func:`~dinfer_jax.engine.model_step.model_step` takes it as a static argument, so programs
traced with and without the kernel are different programs.

The kernel takes a call when it can: bf16 activations, a 2-D FP8 weight with UE8M0 scales in blocks whose input
width is a multiple of 32, and a block table entry for the shape (:func:`pallas_kernels.linear.tuning.config_for`);
other calls (fp32 scales, FP4 or dense weights, shapes no tile divides) keep XLA's path.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from dinfer_jax.models.qweights import QuantizedWeight

LINEAR_IMPLS = ("auto", "xla", "pallas")
_IMPL: contextvars.ContextVar[str] = contextvars.ContextVar("dinfer_jax_linear_impl", default="xla")


def check_linear_impl(impl: str) -> str:
    """``impl`` if it names an implementation, else ValueError."""
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"linear_impl must be one of {LINEAR_IMPLS}, got {impl!r}")
    return impl


def resolve_linear_impl(impl: str, batch_invariant: bool = False, one_device: bool = True) -> str:
    """``"xla"`` or ``"pallas"`` for a setting: ``"auto"`` is the kernel on a GPU, for the one-device engine and
    outside the batch-invariant mode (whose products XLA tiles at fixed shapes), else XLA. On the H200 the kernel
    makes a real-dimension decode step 3-7% faster and prefill (XLA's GEMM above 64 tokens) is unchanged
    (``docs/perf/linear_kernel_h200.md``); it has not been run under the mesh engines' ``shard_map``."""
    if check_linear_impl(impl) != "auto":
        return impl
    return "pallas" if jax.default_backend() == "gpu" and one_device and not batch_invariant else "xla"


@contextlib.contextmanager
def linear_impl(impl: str) -> Iterator[None]:
    """Trace the enclosed model code with the FP8 linears on ``impl`` (``"auto"``: :func:`resolve_linear_impl`
    for a one-device, not batch-invariant step)."""
    token = _IMPL.set(resolve_linear_impl(impl))
    try:
        yield
    finally:
        _IMPL.reset(token)


def kernel_config(x: jax.Array, w: QuantizedWeight):
    """The kernel's tile configuration for ``x [..., K] · wᵀ`` when the kernel is on and takes this call, else
    None. The kernel takes FP8 weights with UE8M0 scales and bf16 activations of at most ``KERNEL_MAX_TOKENS``
    rows (decode steps); larger calls (prefill) keep XLA's GEMM, faster there on the H200."""
    if _IMPL.get() != "pallas" or not isinstance(w, QuantizedWeight) or w.fmt != "fp8" or w.ndim != 2:
        return None
    if x.dtype != jnp.bfloat16 or w.scale.dtype != jnp.float8_e8m0fnu or w.block[1] % 32:
        return None
    from pallas_kernels.linear.tuning import KERNEL_MAX_TOKENS, config_for

    n, k = w.shape
    tokens = math.prod(x.shape[:-1])
    if tokens > KERNEL_MAX_TOKENS:
        return None
    try:
        return config_for(tokens, n, k)
    except ValueError:
        return None


def kernel_linear(x: jax.Array, w: QuantizedWeight, config) -> jax.Array:
    """``x [..., K] · wᵀ`` → fp32 ``[..., N]`` through the kernel with ``config`` (from :func:`kernel_config`)."""
    from pallas_kernels.linear.kernel_sm90 import fp8_linear_sm90
    from pallas_kernels.lowering_reuse import kernel_call

    y = kernel_call(fp8_linear_sm90, x.reshape(-1, x.shape[-1]), w.data, w.scale, config=config, block=w.block)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def grouped_kernel_config(x: jax.Array, w: QuantizedWeight):
    """The kernel's configuration for the grouped product ``x [..., G, K]`` with ``w [G·R, K]`` (group ``g``'s
    ``[R, K]`` weight in rows ``g·R …``) when the kernel takes it — as :func:`kernel_config` for the stacked
    weight, and each group a whole number of scale blocks and weight tiles — else None."""
    if x.ndim < 2 or not isinstance(w, QuantizedWeight):
        return None
    cfg = kernel_config(x[..., 0, :], w)
    groups, n = x.shape[-2], w.shape[0]
    if cfg is None or n % groups or (n // groups) % w.block[0] or (n // groups) % cfg.block_n:
        return None
    return cfg


def kernel_grouped_linear(x: jax.Array, w: QuantizedWeight, config) -> jax.Array:
    """``y[..., g, :] = x[..., g, :] · W_gᵀ`` → fp32 ``[..., G, R]`` through the kernel's grouped form with
    ``config`` (from :func:`grouped_kernel_config`)."""
    from pallas_kernels.linear.kernel_sm90 import fp8_grouped_linear_sm90
    from pallas_kernels.lowering_reuse import kernel_call

    y = kernel_call(fp8_grouped_linear_sm90, x.reshape(-1, *x.shape[-2:]), w.data, w.scale, config=config,
                    block=w.block)
    return y.reshape(*x.shape[:-1], y.shape[-1])


__all__ = ["LINEAR_IMPLS", "check_linear_impl", "grouped_kernel_config", "kernel_config", "kernel_grouped_linear",
           "kernel_linear", "linear_impl", "resolve_linear_impl"]
