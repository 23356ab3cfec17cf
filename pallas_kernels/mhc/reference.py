"""Pure-``jnp`` reference of the mHC Sinkhorn projection (the model's form; ``docs/spec/model-v4.md`` §3.3).

Contract::

    sinkhorn_ref(logits, iters, eps) -> c
    logits [..., n, n] fp32   indexed [j (input stream), k (output stream)]
    c      [..., n, n] fp32   softmax over k, + eps; then a column normalisation (each column k divided by its
                              sum over j, + eps); then iters − 1 rounds of row normalisation (each row j divided by
                              its sum over k, + eps) followed by column normalisation
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sinkhorn_ref(logits: jax.Array, iters: int, eps: float, *, unroll: bool = True) -> jax.Array:
    """The projection with XLA reductions over the trailing axes (see the module docstring).

    ``unroll=False`` runs the ``iters − 1`` rounds as a ``fori_loop`` (the same operations in the same order): XLA's CPU
    fusion otherwise re-derives the whole unrolled chain inside every consumer of every round — work quadratic in
    ``iters`` — which made the default model's decode step 2–3× slower on CPU (``docs/perf/bench_generate_cpu.md``).
    """
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def one_round(c: jax.Array) -> jax.Array:
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    if not unroll:
        return jax.lax.fori_loop(0, iters - 1, lambda _, c: one_round(c), c)
    for _ in range(iters - 1):
        c = one_round(c)
    return c
