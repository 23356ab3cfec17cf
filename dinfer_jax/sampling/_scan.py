"""Row-wise prefix sums as small matrix products, for the draw's vocabulary-parallel passes on accelerators.

A row is cut into blocks of ``BLOCK`` columns; the inclusive sums inside a block are one product with a triangular
0/1 matrix, and the block totals are summed the same way, recursively, then added back. It was written because
``jnp.cumsum`` lowers to a ``reduce_window`` that XLA:GPU rewrites into windows of 128 elements per level, which looked
like the cost of the certified search's five prefix sums over a [64, 129280] row block. Measured on an H200
(docs/perf/serving_h200.md, second session of 2026-12-07) the block products are *slower* than ``jnp.cumsum`` for the
whole certified draw (1.84 against 1.66 ms at batch 64; 0.90 against 0.57 ms at batch 1), so they are an option
(``random_sampling(..., prefix="blocked")``), exact on the GPU too, not the default.

``cumsum_u16`` is the tensor-core form of the integer case for values below 2**16 (the certified search's 15-bit
limbs): each value split into two bytes, integers below 256 that bf16 holds exactly, the block products taken in
bf16 with fp32 accumulation (every partial sum an integer below 2**15, exact in fp32), the block totals summed by
``jnp.cumsum`` (a ``[..., V / 128]`` array). Exact on the GPU and faster than ``jnp.cumsum`` up to 96 rows on an
H100 (docs/perf/serving_h200.md, third session of 2026-12-07), it was the accelerators' default until the two-level
search (``_fastcdf._locate_two_level``), which forms no whole-row prefix sum, took 5x less (fifth session).

Exactness:

* ``cumsum_u32``: the uint32 values are split into 16-bit halves; a block's sum of halves is < 2**16 * 128 = 2**23,
  an integer that fp32 holds exactly, and every partial sum on the way is such an integer, so the fp32 product at
  ``Precision.HIGHEST`` (true fp32 accumulation; never TF32 or bf16 passes) is exact in any order. The halves'
  sums recombine with wrapping uint32 arithmetic: the result equals ``jnp.cumsum(x, axis=1, dtype=uint32)`` bit for
  bit (both are the prefix sums mod 2**32).
* ``cumsum_u16``: bit-equal to ``jnp.cumsum(x, axis=-1, dtype=uint32)`` *only* for values below 2**16 (bits from
  16 up are not summed); the caller guarantees the range.
* ``cumsum_f32``: every output is a sum of its inputs in *some* order with fp32 rounding at each addition (the
  triangular factors are exactly 0 or 1), which is all the certified search's error bound assumes of its fp32
  prefix sum (``_fastcdf``: any order). It is not bit-equal to ``jnp.cumsum``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

from ._u64 import U32, shl32, u32

BLOCK = 128


def _block_sums(x: jnp.ndarray) -> jnp.ndarray:
    """Inclusive sums inside consecutive blocks of ``BLOCK`` columns. ``x``: [..., n·BLOCK] float32 (products at
    ``HIGHEST``) or bfloat16 (integers below 256), whose block partial sums are exact or may round (see the module
    docstring). Returns the same shape, float32."""
    lead, v = x.shape[:-1], x.shape[-1]
    tri = jnp.triu(jnp.ones((BLOCK, BLOCK), x.dtype))   # tri[i, j] = 1 for i <= j: column j sums rows 0..j
    blocks = x.reshape(-1, BLOCK)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = lax.dot(blocks, tri, precision=precision, preferred_element_type=jnp.float32)
    return out.reshape(*lead, v)


def _pad(x: jnp.ndarray) -> jnp.ndarray:
    pad = -x.shape[-1] % BLOCK
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _exclusive(totals: jnp.ndarray, incl) -> jnp.ndarray:
    """The exclusive prefix of block totals ``[..., nb]`` from ``incl`` (an inclusive prefix-sum function)."""
    shifted = jnp.concatenate([jnp.zeros_like(totals[..., :1]), totals[..., :-1]], axis=-1)
    return incl(shifted)


def _blocked_scan(x: jnp.ndarray, within: Callable[[jnp.ndarray], jnp.ndarray],
                  recurse: Callable[[jnp.ndarray], jnp.ndarray]) -> jnp.ndarray:
    """Inclusive prefix sums along the last axis of ``x`` [..., V]: ``within`` gives the sums inside each block of a
    padded [..., V'] array (same shape and dtype), ``recurse`` the inclusive prefix of the block totals [..., nb]."""
    v = x.shape[-1]
    if v <= 1:
        return x
    xp = _pad(x)
    nb = xp.shape[-1] // BLOCK
    blocked = within(xp).reshape(*xp.shape[:-1], nb, BLOCK)
    if nb > 1:
        offsets = _exclusive(blocked[..., -1], recurse)
        blocked = blocked + offsets[..., None]
    return blocked.reshape(xp.shape)[..., :v]


def _u32_block_sums(xp: jnp.ndarray) -> jnp.ndarray:
    """Wrapping uint32 sums inside blocks, exact: 16-bit halves summed in fp32 (integers < 2**23), recombined."""
    halves = jnp.stack([xp & u32(0xFFFF), xp >> u32(16)]).astype(jnp.float32)   # [2, ..., V'] values < 2**16
    sums = _block_sums(halves).astype(U32)                                        # exact integers < 2**23
    return sums[0] + shl32(sums[1], 16)                                           # mod 2**32


def cumsum_u32(x: jnp.ndarray) -> jnp.ndarray:
    """Inclusive prefix sums along the last axis of uint32 ``x`` [..., V], wrapping mod 2**32: bit-equal to
    ``jnp.cumsum(x, axis=-1, dtype=jnp.uint32)``."""
    return _blocked_scan(x.astype(U32), _u32_block_sums, cumsum_u32)


def cumsum_f32(x: jnp.ndarray) -> jnp.ndarray:
    """Inclusive prefix sums along the last axis of float32 ``x`` [..., V], each a sum of its inputs in some order
    with fp32 rounding (not bit-equal to ``jnp.cumsum``)."""
    return _blocked_scan(x.astype(jnp.float32), _block_sums, cumsum_f32)


def _u16_block_sums(xp: jnp.ndarray) -> jnp.ndarray:
    """Sums inside blocks of uint32 values below 2**16, exact: the two bytes as bf16 (integers < 256), products with
    the 0/1 triangle accumulated in fp32 (integers < 2**15), recombined as uint32."""
    bytes_ = jnp.stack([xp & u32(0xFF), (xp >> u32(8)) & u32(0xFF)]).astype(jnp.bfloat16)   # [2, ..., V']
    sums = _block_sums(bytes_).astype(U32)
    return sums[0] + (sums[1] << u32(8))


def cumsum_u16(x: jnp.ndarray) -> jnp.ndarray:
    """Inclusive prefix sums along the last axis of uint32 ``x`` [..., V] whose values are all below 2**16 (not
    checked: a traced value cannot be), wrapping mod 2**32: then bit-equal to ``jnp.cumsum(x, axis=-1,
    dtype=jnp.uint32)``."""
    return _blocked_scan(x.astype(U32), _u16_block_sums, lambda t: jnp.cumsum(t, axis=-1, dtype=U32))
