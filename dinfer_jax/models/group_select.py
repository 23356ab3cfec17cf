"""Exact top-k over long rows through the maxima of small groups: two short ``lax.top_k`` calls instead of one long.

:func:`group_topk_select` has :func:`dinfer_jax.models.csa2.topk_select`'s contract (the same indices and mask on
every input, tested bit for bit in ``tests/test_group_select.py``). On a GPU, XLA runs ``lax.top_k`` with ``k`` in
the hundreds over a row of tens of thousands of scores as a sort of the whole row, and its time grows with the row
(``docs/perf/attention_h200.md``); over a few thousand entries it is fast. So:

1. **Keys.** Each score becomes an int32 whose signed order is IEEE 754's total order (the order ``lax.top_k``
   ranks floats by: −0 below +0, NaNs beyond the infinities on the side of their sign).
2. **Groups.** The row, padded with the smallest key, is cut into groups of ``g`` consecutive entries; each group
   is represented by its largest key, and ``lax.top_k`` picks the ``k`` best groups (ties: lowest group first) —
   recursively, by the same method, when the row of group maxima is itself long.
3. **Candidates.** The ``k · g`` entries of those groups, in ascending index order, hold the row's top ``k``
   (ties: lowest index first); a second ``lax.top_k`` over them picks it. Why nothing is lost: let ``b`` be the
   ``k``-th best group maximum. Every entry above ``b`` lies in a group whose maximum is above ``b``, and all such
   groups are picked. The ``s`` places left go to entries equal to ``b``, lowest index first. A group left out
   that holds an entry equal to ``b`` has maximum ``b``, so it comes after every picked group of maximum ``b``
   (step 2's tie rule), and each of those holds an entry equal to ``b`` at a lower index. There are at least
   ``s`` of them: ``k`` minus the groups with a larger maximum, which are no more than the entries above ``b``,
   ``k − s``. So the ``s`` lowest-indexed entries equal to ``b`` are all candidates.
4. **Output** as ``topk_select``: −inf and NaN picks dropped, indices ascending with −1 after them, and the mask.

Work: one pass over the row (the group maxima), then ``lax.top_k`` over ``T / g`` and over ``k · g`` entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

GROUP = 4            # entries per group (fastest of 4 / 8 / 16 on an H100 at top-512 over 16K-64K scores)
MIN_REDUCTION = 2    # recurse only where the row of group maxima (T / g) is at least this many times k · g


def int_keys(scores: jax.Array) -> jax.Array:
    """``scores [..., T]`` float → int32 keys, ``key(a) < key(b)`` iff ``a`` precedes ``b`` in IEEE 754's total
    order (``lax.top_k``'s order for floats)."""
    bits = lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    # negative floats: larger magnitude = smaller; flipping all but the sign bit reverses their order
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def top_indices(keys: jax.Array, k: int, group: int = GROUP) -> jax.Array:
    """The indices ``lax.top_k(keys, k)`` selects, as a set (ties lowest index first), in ascending order.

    ``keys [R, T]`` int32, ``1 ≤ k ≤ T``. Returns ``[R, k]`` int32."""
    rows, t = keys.shape
    if t < MIN_REDUCTION * k * group or group < 2:
        return jnp.sort(lax.top_k(keys, k)[1].astype(jnp.int32), axis=-1)
    groups = -(-t // group)
    padded = jnp.pad(keys, ((0, 0), (0, groups * group - t)), constant_values=jnp.iinfo(jnp.int32).min)
    best_groups = top_indices(padded.reshape(rows, groups, group).max(axis=-1), k, group)      # ascending
    candidates = (best_groups[:, :, None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(rows, k * group)
    picked = lax.top_k(jnp.take_along_axis(padded, candidates, axis=1), k)[1]
    # candidates ascend, so ties among them are broken by index as over the whole row; no pick is padding (k ≤ T)
    return jnp.sort(jnp.take_along_axis(candidates, picked, axis=1), axis=-1)


def selection_output(values: jax.Array, idx: jax.Array, t: int) -> tuple[jax.Array, jax.Array]:
    """The ``topk_select`` outputs from a top-``k`` pick: ``values [..., k]`` the picked scores, ``idx [..., k]``
    their columns among ``t``. Picks whose score is not above −inf (−inf, NaN) are dropped. Returns
    ``(indices [..., k] int32, mask [..., t] bool)``: the kept columns ascending, then −1; the same set as a mask."""
    idx = jnp.sort(jnp.where(values > -jnp.inf, idx.astype(jnp.int32), t), axis=-1)     # t: dropped, sorts last
    flat = idx.reshape(-1, idx.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    mask = jnp.zeros((flat.shape[0], t), bool).at[rows, flat].set(True, mode="drop")   # column t: out of range
    return jnp.where(idx == t, -1, idx), mask.reshape(*idx.shape[:-1], t)


def group_topk_select(scores: jax.Array, k: int, *, group: int = GROUP) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` over the last axis, −inf entries dropped, ties lowest index first; the contract of
    :func:`dinfer_jax.models.csa2.topk_select`.

    ``scores [..., T]`` float; ``k`` is clipped to ``T``. Returns ``(indices [..., k] int32, mask [..., T] bool)``:
    the selected indices in ascending order followed by −1, and the same selection as a mask.
    """
    lead, t = scores.shape[:-1], scores.shape[-1]
    k = min(k, t)
    flat = scores.reshape(-1, t).astype(jnp.float32)
    idx = top_indices(int_keys(flat), k, group)
    idx, mask = selection_output(jnp.take_along_axis(flat, idx, axis=1), idx, t)
    return idx.reshape(*lead, k), mask.reshape(*lead, t)


__all__ = ["GROUP", "MIN_REDUCTION", "group_topk_select", "int_keys", "selection_output", "top_indices"]
