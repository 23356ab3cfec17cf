"""The routed-expert FFN on rows of (token, choice) pairs, shared by the one-device and the expert-parallel paths.

A *row* is one (token, choice) pair: the token's activation, the expert slot it goes to and its router weight.
:func:`expert_rows_ffn` computes every row's expert output with the grouped GEMM (:func:`grouped_expert_ffn`) and
returns it in the rows' own order; :func:`combine_choices` sums a token's ``k`` outputs in choice order
``0, 1, …, k−1``. Both paths (``moe._experts_ragged`` on one device, ``expert_parallel`` over the ``ep`` group) go
through these two functions, so a token's result depends only on its own rows, never on where the rows were
computed or in which order they reached the expert.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dinfer_jax.models.invariant import ordered_sum
from dinfer_jax.models.ops import F32, f32_accumulating, matmul_precision
from dinfer_jax.models.qweights import QuantizedWeight, as_dense

Weight = jax.Array | QuantizedWeight


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """Clamped SwiGLU in fp32: ``silu(min(g, limit)) · clip(u, −limit, limit)``."""
    g = jnp.minimum(g.astype(F32), limit)
    u = jnp.clip(u.astype(F32), -limit, limit)
    return jax.nn.silu(g) * u


def grouped_expert_ffn(x_sorted: jax.Array, group_sizes: jax.Array, w1: Weight, w3: Weight, w2: Weight,
                       row_weights: jax.Array, *, swiglu_limit: float) -> jax.Array:
    """Routed-expert FFN over rows sorted by expert: the one entry point a GPU grouped-GEMM kernel replaces.

    x_sorted ``[M, D]`` (activation dtype; rows of expert 0 first, then expert 1, ...), group_sizes ``[E]`` int32
    (rows per expert, summing to at most M), w1/w3 ``[E, I, D]`` and w2 ``[E, D, I]`` (dense, or
    :class:`QuantizedWeight` decoded here to the activation dtype), row_weights ``[M]`` fp32 (router weight of each
    row, applied between the SwiGLU and the down projection). Returns ``[M, D]`` fp32. CPU path:
    ``jax.lax.ragged_dot`` with fp32 accumulation.
    """
    dt = x_sorted.dtype
    prec = matmul_precision(dt)

    def gemm(a: jax.Array, w: Weight) -> jax.Array:
        wt = jnp.swapaxes(as_dense(w, dt), 1, 2)  # [E, in, out]
        return jax.lax.ragged_dot(*f32_accumulating(a, wt), group_sizes, precision=prec, preferred_element_type=F32)

    a = (swiglu(gemm(x_sorted, w1), gemm(x_sorted, w3), swiglu_limit) * row_weights[:, None]).astype(dt)
    return gemm(a, w2)


def masked_expert_ffn(experts: Mapping[str, Weight], x_rows: jax.Array, slot_rows: jax.Array, w_rows: jax.Array, *,
                      swiglu_limit: float) -> jax.Array:
    """:func:`expert_rows_ffn` as one batched GEMM per projection over the expert slots: slot ``e`` multiplies every
    row with the rows of other slots zeroed, and a row's output is the sum over slots, in slot order, of one
    non-zero term and exact zeros. Shapes and result as :func:`expert_rows_ffn`; work and activation memory
    ∝ rows · L (an ``[L, M, max(D, I)]`` operand).

    The CPU path: XLA's CPU ``ragged_dot`` is expanded into the same rows · L product, plus a transposed copy of
    every expert weight per call and the sort; without those one expert GEMM of 2–1024 rows of the default model
    ran 1.8–3.5× faster (``docs/perf/bench_generate_cpu.md``)."""
    dt = x_rows.dtype
    prec = matmul_precision(dt)
    L = experts["w1"].shape[0]
    mine = slot_rows[None, :] == jnp.arange(L, dtype=slot_rows.dtype)[:, None]  # [L, M]
    x = jnp.where(mine[:, :, None], x_rows[None], jnp.zeros((), dt))  # [L, M, D]

    def gemm(a: jax.Array, w: Weight) -> jax.Array:  # [L, M, in] × [L, out, in] → [L, M, out] fp32
        return jnp.einsum("emk,enk->emn", *f32_accumulating(a, as_dense(w, dt)), precision=prec,
                          preferred_element_type=F32)

    a = (swiglu(gemm(x, experts["w1"]), gemm(x, experts["w3"]), swiglu_limit) * w_rows[None, :, None]).astype(dt)
    return ordered_sum(gemm(a, experts["w2"]), axis=0)


def expert_rows_ffn(experts: Mapping[str, Weight], x_rows: jax.Array, slot_rows: jax.Array, w_rows: jax.Array, *,
                    swiglu_limit: float) -> jax.Array:
    """Expert outputs of independent rows, in the rows' order.

    experts: ``w1``/``w3`` ``[L, I, D]``, ``w2`` ``[L, D, I]`` (the L expert slots this device holds); x_rows
    ``[M, D]`` (activation dtype); slot_rows ``[M]`` int32 in ``[0, L]`` — the slot of each row, ``L`` for a row
    that has no expert here (padding, or a row another device computes); w_rows ``[M]`` fp32 router weights.
    Returns ``[M, D]`` fp32, exactly 0 on rows with slot ``L``. Rows are sorted by slot (stable), run through
    :func:`grouped_expert_ffn` and put back in place; on the CPU backend :func:`masked_expert_ffn` instead.
    """
    if jax.default_backend() == "cpu":
        return masked_expert_ffn(experts, x_rows, slot_rows, w_rows, swiglu_limit=swiglu_limit)
    L = experts["w1"].shape[0]
    order = jnp.argsort(slot_rows, stable=True)
    sizes = jnp.bincount(slot_rows, length=L + 1)[:L].astype(jnp.int32)
    y_sorted = grouped_expert_ffn(x_rows[order], sizes, experts["w1"], experts["w3"], experts["w2"], w_rows[order],
                                  swiglu_limit=swiglu_limit)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    return jnp.where((slot_rows < L)[:, None], y, jnp.zeros_like(y))


def combine_choices(y: jax.Array) -> jax.Array:
    """Sum each token's expert outputs in choice order. y ``[N, k, D]`` fp32 → ``[N, D]`` fp32,
    ``((y₀ + y₁) + y₂) + …`` — explicit adds, so the order is fixed whatever the placement of the experts."""
    acc = y[:, 0]
    for j in range(1, y.shape[1]):
        acc = acc + y[:, j]
    return acc
