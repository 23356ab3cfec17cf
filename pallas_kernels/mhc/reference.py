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


def sinkhorn_ref(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """The projection with XLA reductions over the trailing axes (see the module docstring)."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    return c
