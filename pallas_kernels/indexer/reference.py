"""Pure-``jnp`` reference of the indexer-score kernel's contract (the kernel's test oracle).

``index_scores_rows_ref(q, w, rows) -> scores``::

    q      [B, S, H, D]   fp32 or bf16   index queries (D = 128 in the release)
    w      [B, S, H]      fp32           per-head weights
    rows   [B, T, D/2 + D/32] uint8      index keys as stored: ``fp4_index`` rows ``[D/2 packed e2m1 | D/32 UE8M0]``
    scores [B, S, T]      fp32

    k[b,t,d]      = e2m1(code d of row t) · 2^(S_{t, d // 32} − 127)            (even d in the low nibble)
    scores[b,s,t] = Σ_h relu(Σ_d q[b,s,h,d] · k[b,t,d]) · w[b,s,h]              fp32, products exact

No causal or length mask: the caller masks rows a query may not see (rows past a sequence's compressed length hold
whatever the page holds and must not be trusted, not even to be finite after scaling — see the kernel's range).

The decode here is written out from the format's definition (not :mod:`dinfer_jax.engine.kv_formats`, which the
tests compare it with).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
FP4_GROUP = 32                     # values per UE8M0 scale
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def check_shapes(q: jax.Array, w: jax.Array, rows: jax.Array) -> tuple[int, int, int, int, int]:
    """Shape checks shared by the reference and the kernel wrapper; returns ``(B, S, H, D, T)``."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, S, H, D], got shape {q.shape}")
    b, s, h, d = q.shape
    if w.shape != (b, s, h):
        raise ValueError(f"w must be [B, S, H] = {(b, s, h)}, got {w.shape}")
    if d % FP4_GROUP:
        raise ValueError(f"index head width D={d} must be a multiple of {FP4_GROUP}")
    row_bytes = d // 2 + d // FP4_GROUP
    if rows.ndim != 3 or rows.shape[0] != b or rows.shape[2] != row_bytes:
        raise ValueError(f"rows must be uint8 [B={b}, T, {row_bytes}] (fp4_index rows of width {d}), got {rows.shape}")
    if rows.dtype != jnp.uint8:
        raise TypeError(f"rows must be uint8, got {rows.dtype}")
    return b, s, h, d, rows.shape[1]


def decode_rows(rows: jax.Array, d: int) -> jax.Array:
    """``fp4_index`` rows ``uint8 [..., D/2 + D/32]`` → keys ``fp32 [..., D]`` (exact)."""
    data, scales = rows[..., : d // 2].astype(jnp.int32), rows[..., d // 2:].astype(jnp.int32)
    codes = jnp.stack([data & 15, data >> 4], axis=-1).reshape(*rows.shape[:-1], d)
    mag = jnp.asarray(E2M1_MAGNITUDES, F32)[codes & 7]
    vals = jnp.where(codes >= 8, -mag, mag)
    scale = jnp.exp2((scales - 127).astype(F32))                        # [..., D/32]
    return (vals.reshape(*rows.shape[:-1], d // FP4_GROUP, FP4_GROUP) * scale[..., None]).reshape(vals.shape)


def index_scores_rows_ref(q: jax.Array, w: jax.Array, rows: jax.Array) -> jax.Array:
    """The contract above in fp32 (``Precision.HIGHEST``)."""
    _, _, _, d, _ = check_shapes(q, w, rows)
    k = decode_rows(rows, d)
    dots = jnp.einsum("bshd,btd->bsht", q.astype(F32), k, precision=HIGHEST)
    return jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots), w.astype(F32), precision=HIGHEST)
