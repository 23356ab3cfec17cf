"""Exact top-k selection without a sort: a radix search for the k-th largest score, then a compaction.

:func:`radix_topk_select` has :func:`dinfer_jax.models.csa2.topk_select`'s contract (the same indices and mask on
every input, tested bit for bit in ``tests/test_radix_select.py``). The point is the cost on a GPU: XLA lowers
``lax.top_k`` with ``k`` in the hundreds over rows of tens of thousands of scores to a sort of the whole row (the
indexer's top-512 over 65,536 compressed rows at batch 64 took 0.52 ms per layer on the H200, three times the
indexer kernel that computed the scores; ``docs/perf/attention_h200.md``). Here every pass reads the scores once:

1. **Order-preserving keys.** Each fp32 score becomes a uint32 whose unsigned order is IEEE 754's total order
   (sign bit set for non-negative values, all bits flipped for negative ones) — the order ``lax.top_k`` ranks by:
   −0 below +0, a positive NaN above +inf, a negative one below −inf.
2. **Radix search** for the k-th largest key, 4 bits at a time from the top (8 passes, unrolled — no while loop, so
   no host round trip per pass on a GPU). A pass counts, among the keys that share the bits chosen so far, how many
   have each of the 16 values of the next 4 bits (one reduction over the row: ``[R, T, 16]`` summed over ``T``),
   and takes the digit where the count from the top reaches the rank still sought. The result is the threshold key
   ``K*`` and ``r``, how many of the keys equal to ``K*`` belong to the top ``k`` (the first ``r`` by index, the
   ``lax.top_k`` tie rule); the keys above ``K*`` number ``k − r``.
3. **Compaction.** Inclusive running counts along the row (of the ties, to take the first ``r``; then of the
   selected entries, to place them) come from a matrix product per 128-entry chunk with a triangular 0/1 matrix
   (bf16 operands, fp32 accumulation: exact up to 128) plus the chunks' running offsets; the selected indices are
   scattered to their ranks, which lists them in ascending order with −1 after them, and −inf scores are dropped.

Like ``topk_select``, the mask drops −inf and NaN entries even when they rank in the top ``k``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

DIGIT_BITS = 4                 # default bits decided per pass: 16 counts per row and pass, 8 passes
CHUNK = 128                    # entries per running-count matrix product (counts ≤ 128 are exact in fp32)
U32 = jnp.uint32


def order_keys(scores: jax.Array) -> jax.Array:
    """``scores [..., T]`` float → uint32 keys, ``key(a) < key(b)`` iff ``a`` precedes ``b`` in IEEE 754's total
    order (``lax.top_k``'s: −0 < +0; NaNs beyond the infinities on the side of their sign)."""
    bits = lax.bitcast_convert_type(scores.astype(jnp.float32), U32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | U32(0x80000000))


def kth_largest_key(keys: jax.Array, k: int, *, digit_bits: int = DIGIT_BITS,
                    counts_minor: bool = True) -> tuple[jax.Array, jax.Array]:
    """The ``k``-th largest of each row of ``keys [R, T]`` uint32 (``1 ≤ k ≤ T``): ``(K* [R] uint32, r [R] int32)``
    with ``count(keys > K*) = k − r`` and ``1 ≤ r ≤ count(keys == K*)``.

    ``digit_bits`` (a divisor of 32) bits are decided per pass. ``counts_minor``: the per-digit counts are summed as
    ``[R, T, digits]`` over ``T`` (each key read once, the digits side by side) rather than ``[R, digits, T]`` over
    ``T`` (one row reduction per digit): the same counts; which one XLA runs faster is measured by
    ``scripts/bench_topk.py``."""
    if 32 % digit_bits:
        raise ValueError(f"digit_bits={digit_bits} must divide 32")
    rows = keys.shape[0]
    n_digits = 1 << digit_bits
    digits = jnp.arange(n_digits, dtype=U32)
    prefix = jnp.zeros((rows,), U32)
    rank = jnp.full((rows,), k, jnp.int32)                # the rank still sought among keys matching the prefix
    for shift in range(32 - digit_bits, -1, -digit_bits):
        want = (prefix >> shift)[:, None] | digits[None, :]                    # [R, digits]
        if counts_minor:
            counts = jnp.sum(((keys >> shift)[:, :, None] == want[:, None, :]).astype(jnp.int32), axis=1)
        else:
            counts = jnp.sum(((keys >> shift)[:, None, :] == want[:, :, None]).astype(jnp.int32), axis=2)
        from_top = jnp.cumsum(counts[:, ::-1], axis=1)[:, ::-1]              # keys with digit ≥ d
        # the largest digit whose count from the top reaches the rank (digit 0 always does: the prefix holds it)
        reach = from_top >= rank[:, None]
        digit = n_digits - 1 - jnp.argmax(reach[:, ::-1], axis=1)
        above = jnp.take_along_axis(from_top - counts, digit[:, None], axis=1)[:, 0]
        rank = rank - above
        prefix = prefix | (digit.astype(U32) << shift)
    return prefix, rank


def inclusive_counts(mask: jax.Array) -> jax.Array:
    """Running count along the last axis: ``mask [R, T]`` bool → int32 ``[R, T]``, entry ``t`` = number of True in
    ``mask[:, :t + 1]``. Per :data:`CHUNK` entries a product with a triangular 0/1 matrix, plus the chunks' offsets."""
    rows, t = mask.shape
    chunks = -(-t // CHUNK)
    m = jnp.pad(mask, ((0, 0), (0, chunks * CHUNK - t))).reshape(rows, chunks, CHUNK).astype(jnp.bfloat16)
    upper = (jnp.arange(CHUNK)[:, None] <= jnp.arange(CHUNK)[None, :]).astype(jnp.bfloat16)   # [c', c]: c' ≤ c
    within = jnp.einsum("rgc,cd->rgd", m, upper, preferred_element_type=jnp.float32).astype(jnp.int32)
    totals = within[:, :, -1]
    offsets = jnp.cumsum(totals, axis=1) - totals
    return (within + offsets[:, :, None]).reshape(rows, chunks * CHUNK)[:, :t]


def radix_topk_select(scores: jax.Array, k: int, *, digit_bits: int = DIGIT_BITS,
                      counts_minor: bool = True) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` over the last axis, −inf entries dropped, ties lowest index first; the contract of
    :func:`dinfer_jax.models.csa2.topk_select`. ``digit_bits``, ``counts_minor``: :func:`kth_largest_key`.

    ``scores [..., T]`` float; ``k`` is clipped to ``T``. Returns ``(indices [..., k] int32, mask [..., T] bool)``:
    the selected indices in ascending order followed by −1, and the same selection as a mask.
    """
    lead, t = scores.shape[:-1], scores.shape[-1]
    k = min(k, t)
    flat = scores.reshape(-1, t)
    rows = flat.shape[0]
    keys = order_keys(flat)
    threshold, take_equal = kth_largest_key(keys, k, digit_bits=digit_bits, counts_minor=counts_minor)
    equal = keys == threshold[:, None]
    first_equal = equal & (inclusive_counts(equal) <= take_equal[:, None])
    selected = ((keys > threshold[:, None]) | first_equal) & (flat.astype(jnp.float32) > -jnp.inf)
    place = jnp.where(selected, inclusive_counts(selected) - 1, k)             # k: out of range, dropped
    idx = jnp.full((rows, k), -1, jnp.int32).at[jnp.arange(rows)[:, None], place].set(
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t)), mode="drop")
    return idx.reshape(*lead, k), selected.reshape(*lead, t)


__all__ = ["CHUNK", "DIGIT_BITS", "inclusive_counts", "kth_largest_key", "order_keys", "radix_topk_select"]
