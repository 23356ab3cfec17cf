"""Pure-``jnp`` reference of the decode-attention kernel's contract (the kernel's test oracle).

``sparse_decode_attention_ref(q, kv, valid, sink, *, scale) -> o``::

    q     [N, H, d]  bf16     one decode query token n per row, H heads
    kv    [N, L, d]  bf16     the L rows query n attends over (K = V: the value rows are the key rows)
    valid [N, L]     bool     False: padding / outside the window, contributes exactly 0
    sink  [H]        fp32     per-head logit that only enlarges the softmax denominator (finite)
    o     [N, H, d]  bf16

    s[n,h,l] = scale · <q[n,h], kv[n,l]>                               fp32 (bf16 products are exact in fp32)
    p[n,h,:] = softmax({s[n,h,l] : valid[n,l]} ∪ {sink[h]}) without the sink's entry     fp32
    o[n,h]   = bf16( Σ_l bf16(p[n,h,l]) · kv[n,l] )                    fp32 accumulation

The probabilities are rounded to bf16 before the P·V product, as the model's XLA path
(``dinfer_jax.models.attention.attend_selected``) does. A query with no valid row puts all its mass on the sink and
gets ``o = 0`` exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def check_shapes(q: jax.Array, kv: jax.Array, valid: jax.Array, sink: jax.Array) -> tuple[int, int, int, int]:
    """Shape checks shared by the reference and the kernel wrapper; returns ``(N, H, d, L)``."""
    if q.ndim != 3:
        raise ValueError(f"q must be [N, H, d], got shape {q.shape}")
    n, h, d = q.shape
    if kv.ndim != 3 or kv.shape[0] != n or kv.shape[2] != d:
        raise ValueError(f"kv must be [N={n}, L, d={d}], got shape {kv.shape}")
    rows = kv.shape[1]
    if valid.shape != (n, rows):
        raise ValueError(f"valid must be [N={n}, L={rows}], got shape {valid.shape}")
    if valid.dtype != jnp.bool_:
        raise ValueError(f"valid must be bool, got {valid.dtype}")
    if sink.shape != (h,):
        raise ValueError(f"sink must be [H={h}], got shape {sink.shape}")
    return n, h, d, rows


def sparse_decode_attention_ref(q: jax.Array, kv: jax.Array, valid: jax.Array, sink: jax.Array, *,
                                scale: float) -> jax.Array:
    """The contract of the module docstring in fp32 (explicit sink column in the softmax).

    Args:
      q: ``[N, H, d]`` (bf16 for the contract; any float dtype is computed in fp32).
      kv: ``[N, L, d]``, the key rows and the value rows.
      valid: ``bool [N, L]``.
      sink: ``fp32 [H]``.
      scale: logit scale (``d ** -0.5`` in the model).
    Returns:
      ``o [N, H, d]`` in q's dtype.
    """
    n, h, _, _ = check_shapes(q, kv, valid, sink)
    q32, kv32 = q.astype(F32), kv.astype(F32)
    logits = jnp.einsum("nhd,nld->nhl", q32, kv32, precision=HIGHEST) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    sink_col = jnp.broadcast_to(sink.astype(F32)[None, :, None], (n, h, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink_col], axis=-1), axis=-1)[..., :-1]
    probs = probs.astype(jnp.bfloat16).astype(F32)
    o = jnp.einsum("nhl,nld->nhd", probs, kv32, precision=HIGHEST)
    return o.astype(q.dtype)
