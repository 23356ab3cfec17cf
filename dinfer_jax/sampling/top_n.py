"""The top-n logprobs of long rows as two short ``lax.top_k`` calls, exactly ``lax.top_k``'s result.

On a GPU, XLA runs ``lax.top_k`` with a small ``n`` as its TopK kernel, one thread block per row: the engine's
batch-64 top-5 over a 129,280-token vocabulary took 0.13 ms a decode step on an H100, most of the sampler's time
(``docs/perf/serving_h200.md``, kernel map of the seventh session of 2026-12-07). Cut into chunks of
:data:`CHUNK` entries, the same work is one ``lax.top_k`` over many short rows, then one over the ``n`` best of
every chunk.

Why it is exact (values and indices, ties lowest index first, as ``lax.top_k``): every entry of the row's top
``n`` is among the top ``n`` of its own chunk (a chunk's entries it beats are entries it beats in the row), so
the candidates hold the answer. The candidates are laid out chunk after chunk, each chunk's in ``lax.top_k``'s
order, so among equal values a lower candidate position is a lower index; the second ``lax.top_k`` breaks ties by
position. The row is padded with the smallest float of ``lax.top_k``'s order (IEEE 754 total order: a negative
NaN with every payload bit set), so a padding entry comes after every real entry it ties with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CHUNK = 256          # entries per chunk: 129,280 = 505 chunks
MIN_CHUNKS = 4       # shorter rows keep one lax.top_k
_LOWEST = float(np.array(0xFFFFFFFF, np.uint32).view(np.float32))   # -NaN, all payload bits: last in total order


def top_n(x: jax.Array, n: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, n)`` for ``x [R, V]`` float32: values ``[R, n]`` and int32 indices ``[R, n]``, bit for bit."""
    rows, v = x.shape
    if n > chunk or v < MIN_CHUNKS * chunk:
        vals, idx = lax.top_k(x, n)
        return vals, idx.astype(jnp.int32)
    chunks = -(-v // chunk)
    padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, chunks * chunk - v)), constant_values=_LOWEST)
    vals, idx = lax.top_k(padded.reshape(rows, chunks, chunk), n)                     # [R, chunks, n]
    idx = idx.astype(jnp.int32) + (jnp.arange(chunks, dtype=jnp.int32) * chunk)[:, None]
    best, pos = lax.top_k(vals.reshape(rows, chunks * n), n)
    return best, jnp.take_along_axis(idx.reshape(rows, chunks * n), pos, axis=1)


__all__ = ["CHUNK", "top_n"]
