"""Pure-``jnp`` reference of the expert kernel's contract (the CPU path and the kernel's test oracle).

``experts(x, expert_ids, route_weights, w1, w3, w2)`` for one MoE layer's routed experts:

    a_(n,j) = bf16( silu(min(x_n·W1[e]ᵀ, L)) ⊙ clip(x_n·W3[e]ᵀ, −L, L) )        e = expert_ids[n, j]
    y_n     = Σ_j route_weights[n, j] · (a_(n,j) · W2[e]ᵀ)                          fp32

Products accumulate in fp32; the SwiGLU output is rounded to the activation dtype once (as the kernel stores it);
the routing weight is applied in fp32 after the down projection. Weights are ``ExpertWeight``s: bf16/fp32 arrays,
or MXFP4 (packed codes + UE8M0 scales) dequantised exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.moe.fp4 import dequantize_fp4

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeight:
    """One stacked expert matrix ``[G, out, in]`` as the kernel reads it.

    ``fmt="fp4"``: ``data`` uint8 ``[G, out, in/2]`` (two e2m1 codes per byte, low nibble first), ``scale`` UE8M0
    (``float8_e8m0fnu`` or ``uint8`` bits) ``[G, out, in/32]``. ``fmt="bf16"``: ``data`` ``[G, out, in]``
    (bf16, or fp32 for the reference only), ``scale`` None. ``fmt="fp4_mma"``: the fp4 bits rearranged for the
    Hopper kernel's registers (:mod:`pallas_kernels.moe.fp4_mma`), ``data`` int32 ``[G, out/64, in/16, 128]``,
    ``scale`` int32 ``[G, out/64, in/64, 32]``.
    """

    data: jax.Array
    scale: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True), default="bf16")

    @property
    def shape(self) -> tuple[int, int, int]:
        if self.fmt == "fp4_mma":
            g, ob, i16, _ = self.data.shape
            return g, ob * 64, i16 * 16
        g, o, i = self.data.shape
        return (g, o, i * 2) if self.fmt == "fp4" else (g, o, i)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def dense(self, dtype=F32) -> jax.Array:
        """Exact dequantisation ``[G, out, in]`` in ``dtype``."""
        if self.fmt == "fp4":
            return dequantize_fp4(self.data, self.scale, dtype)
        if self.fmt == "fp4_mma":
            from pallas_kernels.moe.fp4_mma import from_mma_layout

            return from_mma_layout(self).dense(dtype)
        if self.fmt == "bf16":
            return self.data.astype(dtype)
        raise ValueError(f"unknown expert weight format {self.fmt!r}; expected 'fp4', 'fp4_mma' or 'bf16'")


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """``silu(min(g, L)) · clip(u, −L, L)`` in fp32."""
    g = jnp.minimum(g.astype(F32), limit)
    u = jnp.clip(u.astype(F32), -limit, limit)
    return jax.nn.silu(g) * u


def experts(x: jax.Array, expert_ids: jax.Array, route_weights: jax.Array, w1: ExpertWeight, w3: ExpertWeight,
            w2: ExpertWeight, *, swiglu_limit: float) -> jax.Array:
    """Routed-expert output ``fp32 [N, D]`` for ``x [N, D]`` (bf16 or fp32), ``expert_ids [N, k]`` int32,
    ``route_weights [N, k]`` fp32. Grouped GEMMs via ``jax.lax.ragged_dot`` over expert-sorted rows."""
    n, k = expert_ids.shape
    g_count = w1.shape[0]
    dt = x.dtype
    prec = jax.lax.Precision.HIGHEST
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    xs = x[token].astype(F32)
    sizes = jnp.bincount(flat, length=g_count).astype(jnp.int32)
    w1d = jnp.swapaxes(w1.dense(dt), 1, 2).astype(F32)
    w3d = jnp.swapaxes(w3.dense(dt), 1, 2).astype(F32)
    w2d = jnp.swapaxes(w2.dense(dt), 1, 2).astype(F32)
    g = jax.lax.ragged_dot(xs, w1d, sizes, precision=prec, preferred_element_type=F32)
    u = jax.lax.ragged_dot(xs, w3d, sizes, precision=prec, preferred_element_type=F32)
    a = swiglu(g, u, swiglu_limit).astype(dt).astype(F32)
    y = jax.lax.ragged_dot(a, w2d, sizes, precision=prec, preferred_element_type=F32)
    y = y * route_weights.reshape(-1)[order][:, None].astype(F32)
    return jnp.zeros((n, x.shape[1]), F32).at[token].add(y)
