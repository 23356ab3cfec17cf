"""The Mosaic GPU expert kernel (``pallas_kernels/moe``) behind the model's MoE paths: whether it can run, the
one-device call (a token's ``k`` outputs combined) and the expert-parallel call (each (token, choice) pair's
output apart, pairs another rank computes marked and skipped) — ``docs/expert_parallel.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.qweights import is_quantized

__all__ = ["expert_choices_kernel", "experts_kernel", "kernel_unsupported"]


def kernel_unsupported(ex: Mapping[str, Any], dtype: Any) -> str | None:
    """Why the Mosaic GPU expert kernel cannot run these experts (None when it can): it needs a GPU backend,
    bf16 activations, MXFP4 expert weights and widths that fit its tiles. ``ex``: ``w1``/``w3`` ``[G, I, D]``,
    ``w2`` ``[G, D, I]``."""
    if jax.default_backend() != "gpu":
        return f"backend is {jax.default_backend()!r}, the kernel needs a GPU"
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"activations are {jnp.dtype(dtype).name}, the kernel computes in bfloat16"
    for name in ("w1", "w3", "w2"):
        w = ex[name]
        if not (is_quantized(w) and w.fmt in ("fp4", "fp4_mma")):
            return f"expert weight {name} is not MXFP4"
        if w.shape[-2] % 64 or w.shape[-1] % 128:
            return f"expert weight {name} of shape {w.shape} does not fit the kernel's 64×128 tiles"
        if w.fmt == "fp4" and w.shape[-1] % 512:
            # a row of released scales (in/32 bytes) must be a whole number of 16-byte TMA units
            return (f"expert weight {name} of shape {w.shape}: released-layout scales need an input width that is "
                    "a multiple of 512 (the fp4_mma layout has no such limit)")
    return None


def _operands(ex: Mapping[str, Any], dtype: Any, assignments: int):
    from pallas_kernels.moe.reference import ExpertWeight
    from pallas_kernels.moe.tuning import configs_for

    why = kernel_unsupported(ex, dtype)
    if why is not None:
        raise ValueError(f"the expert kernel cannot run here: {why}")
    w1, w3, w2 = (ExpertWeight(ex[n].data, ex[n].scale, ex[n].fmt) for n in ("w1", "w3", "w2"))
    up, down = configs_for(assignments, hidden=w1.shape[2], inter=w1.shape[1])
    return (w1, w3, w2), dict(up_config=up, down_config=down)


def experts_kernel(ex: Mapping[str, Any], x: jax.Array, idx: jax.Array, w: jax.Array, *,
                   swiglu_limit: float) -> jax.Array:
    """Routed experts of ``x [N, D]`` bf16 through the kernel: FP4 weights (released layout, or the ``fp4_mma``
    layout models keep on a GPU) dequantised in registers, SwiGLU fused after the gate/up GEMM, the router weight
    ``w [N, k]`` applied in fp32 after the down projection, a token's ``k`` outputs summed in choice order.
    ``idx [N, k]`` int32 expert ids. fp32 ``[N, D]``."""
    from pallas_kernels.lowering_reuse import kernel_call
    from pallas_kernels.moe.kernel_sm90 import experts_sm90

    weights, cfgs = _operands(ex, x.dtype, idx.shape[0] * idx.shape[1])
    return kernel_call(experts_sm90, x, idx, w, *weights, swiglu_limit=float(swiglu_limit), **cfgs)


def expert_choices_kernel(ex: Mapping[str, Any], x: jax.Array, slots: jax.Array, w: jax.Array, *,
                          swiglu_limit: float, ep: int = 1) -> jax.Array:
    """An expert-parallel rank's share: ``ex`` holds its ``L`` expert slots, ``x [N, D]`` the tokens it was sent,
    ``slots [N, k]`` int32 in ``[0, L]`` (``L``: the pair is computed elsewhere; it takes no kernel tile),
    ``w [N, k]`` fp32. Returns each pair's weighted output ``[N, k, D]`` fp32, zero where ``slots == L``; summed in
    choice order (after the EP exchange) it gives :func:`experts_kernel`'s bits for the same tile configuration.

    The block table is read at ``N·k / ep`` assignments, the rows a rank computes on average — for an all-gather
    dispatch of an engine's tokens over its ``ep`` copies that is the one-device call's count, so both pick the
    same tiles (and so the same accumulation order)."""
    from pallas_kernels.moe.kernel_sm90 import expert_choices_sm90

    weights, cfgs = _operands(ex, x.dtype, max(1, slots.shape[0] * slots.shape[1] // ep))
    return expert_choices_sm90(x, slots, w, *weights, swiglu_limit=float(swiglu_limit), **cfgs)
