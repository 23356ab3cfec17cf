"""V4.1 compressed branch pooling and candidate two-level top-k, full-sequence form (``docs/spec/model-v41.md`` §3.4).

Positions are 0..S−1 of every sequence (prefill from position 0); the batch dimension comes first. Compressed
entry ``j`` of a ratio-``r`` layer pools tokens ``r·j … r·j + r − 1`` and is visible to the query at position
``p`` iff ``j < (p + 1) // r``.

Top-k tie rule: equal scores are taken lowest index first (``jax.lax.top_k``). DeepInfer's DeepSelect leaves the
order of exact ties unspecified (``docs/spec/engine.md`` §15.2), so selections can differ from DeepInfer only on
exact ties.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dinfer_jax.models.group_select import group_topk_select, selection_output
from dinfer_jax.models.invariant import active_tile

F32 = jnp.float32
# On a GPU, XLA's top_k over long rows sorts each whole row; selecting through the maxima of groups of 4 entries
# (two short top_k calls) beats it from 16,384 scores a row when there are at least 64 rows (H100, top-512: 1.8x at
# 16K scores, 3.0x at 32K, 5.0x at 64K, 2.8x for a 1,024-query prefill chunk over 16K) and loses below that
# (0.8-0.96x at 2K-8K scores; 0.56x for a single row of 64K). docs/perf/attention_h200.md, fifth session of 2026-12-05.
GROUP_MIN_SCORES = 16384
GROUP_MIN_ROWS = 64
TOPK_IMPLS = ("auto", "sort", "group")


def pool_groups(score: jax.Array, latent: jax.Array, ratio: int) -> jax.Array:
    """Softmax-weighted pooling of ``ratio`` consecutive tokens, per channel.

    ``score``, ``latent``: ``[B, S, dim]`` fp32 (gate logits and latents of the raw tokens). Returns
    ``[B, S // ratio, dim]`` fp32 with row ``j = Σ_i softmax_i(score[r·j + i]) ⊙ latent[r·j + i]``; a trailing
    partial group is dropped. ``ratio == 1`` returns ``latent`` unchanged (softmax of one token is exactly 1).
    The caller rounds to bf16 where the spec does (``lat_j = bf16(…)``). Exact exp as in HF and DeepInfer's
    ``_ref``; DeepInfer's TileLang kernel uses fast-math exp (``docs/spec/model-v41.md`` §6.1 row 8).
    """
    if ratio == 1:
        return latent.astype(F32)
    b, s, d = latent.shape
    g = s // ratio
    sc = score[:, : g * ratio].astype(F32).reshape(b, g, ratio, d)
    lat = latent[:, : g * ratio].astype(F32).reshape(b, g, ratio, d)
    e = jnp.exp(sc - jnp.max(sc, axis=2, keepdims=True))
    w = e / jnp.sum(e, axis=2, keepdims=True)
    return jnp.sum(w * lat, axis=2)


def _visible_len(visible_len: jax.Array, batch: int, seq: int) -> jax.Array:
    """``[S]`` or ``[B, S]`` int → ``[B, S]`` int32."""
    return jnp.broadcast_to(jnp.asarray(visible_len, jnp.int32), (batch, seq))


def topk_impl(num_scores: int, num_rows: int, backend: str) -> str:
    """The selection :func:`topk_select` runs for ``impl="auto"``: ``"group"`` on a GPU for rows of at least
    :data:`GROUP_MIN_SCORES` scores, at least :data:`GROUP_MIN_ROWS` of them; else ``"sort"`` (``lax.top_k``)."""
    if backend == "gpu" and num_scores >= GROUP_MIN_SCORES and num_rows >= GROUP_MIN_ROWS:
        return "group"
    return "sort"


def topk_select(scores: jax.Array, k: int, *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Top-``k`` over the last axis, −inf entries dropped, ties lowest index first.

    ``scores [..., T]`` float; ``k`` is clipped to ``T`` (not while tracing batch-invariantly: then ``k`` picks,
    −1 beyond ``T``). Returns ``(indices [..., k] int32, mask [..., T] bool)``:
    the selected indices in ascending order followed by −1 fill (DeepSelect's ``sorted_index`` order with −1 for
    dropped picks), and the same selection as a mask. ``impl``: ``"sort"`` (``lax.top_k``), ``"group"``
    (:func:`~dinfer_jax.models.group_select.group_topk_select`, the same result on every input) or ``"auto"``
    (:func:`topk_impl`'s choice for the shape and the default backend).
    """
    if impl not in TOPK_IMPLS:
        raise ValueError(f"topk_select: impl={impl!r} is not one of {TOPK_IMPLS}")
    t = scores.shape[-1]
    if t < k and active_tile():
        # a batch-invariant step picks exactly k rows whatever its pool's width: with k clipped to a narrower pool
        # the attention over the picks would take another shape (and summation order) in programs with fewer pages
        pad = jnp.full((*scores.shape[:-1], k - t), -jnp.inf, scores.dtype)
        idx, mask = topk_select(jnp.concatenate([scores, pad], axis=-1), k, impl=impl)
        return idx, mask[..., :t]
    if impl == "auto":
        impl = topk_impl(t, math.prod(scores.shape[:-1]), jax.default_backend())
    if impl == "group":
        return group_topk_select(scores, k)
    vals, idx = jax.lax.top_k(scores, min(k, t))
    return selection_output(vals, idx, t)


def candidate_block_scores(scores: jax.Array, visible_len: jax.Array, block_size: int) -> jax.Array:
    """Block scores of the candidate source: max over blocks of ``block_size`` compressed positions.

    ``scores [B, S, T]`` fp32, ``visible_len [S]`` or ``[B, S]`` int (entries ``t ≥ visible_len`` are ignored).
    Returns ``[B, S, ceil(T / block_size)]`` fp32: −inf for blocks with nothing visible, +inf for the block
    holding the newest visible entry ``(visible_len − 1) // block_size`` (when ``visible_len > 0``). Finite
    block maxima are capped at the largest finite fp32 so that only the forced block is +inf (DeepInfer caps at
    the bf16 maximum for the same reason; its logits are bf16).
    """
    b, s, t = scores.shape
    nb = -(-t // block_size)
    vl = _visible_len(visible_len, b, s)
    cols = jnp.arange(nb * block_size)
    padded = jnp.pad(scores.astype(F32), ((0, 0), (0, 0), (0, nb * block_size - t)), constant_values=-jnp.inf)
    padded = jnp.where(cols < vl[..., None], padded, -jnp.inf)
    block = jnp.minimum(jnp.max(padded.reshape(b, s, nb, block_size), axis=-1), jnp.finfo(F32).max)
    newest = jnp.where(vl > 0, (vl - 1) // block_size, -1)
    return jnp.where(jnp.arange(nb) == newest[..., None], jnp.inf, block)


def candidate_blocks(scores: jax.Array, visible_len: jax.Array, block_size: int,
                     topk_blocks: int) -> tuple[jax.Array, jax.Array]:
    """Candidate two-level top-k, first level: per query, the ``topk_blocks`` best blocks of compressed entries.

    ``scores [B, S, T]`` fp32 index scores (−inf where not visible), ``visible_len [S]`` or ``[B, S]`` int = number
    of visible compressed entries of each query (``(p + 1) // ratio``). Blocks are ranked by
    :func:`candidate_block_scores` (the newest visible block first, as +inf); blocks with score −inf (nothing
    visible) are never taken; ties go to the lowest block index.

    Returns ``(mask [B, S, T] bool, block_ids [B, S, topk_blocks] int32)``: ``mask`` marks the visible entries
    (``t < visible_len``) inside the selected blocks — the candidate set later index sources restrict to, and
    what DeepInfer's ``get_candidate_compact_lens`` counts; ``block_ids`` lists the selected blocks in ascending
    order, −1 filled.
    """
    b, s, t = scores.shape
    block = candidate_block_scores(scores, visible_len, block_size)
    ids, block_mask = topk_select(block, topk_blocks)
    ids = jnp.pad(ids, ((0, 0), (0, 0), (0, topk_blocks - ids.shape[-1])), constant_values=-1)
    in_block = jnp.repeat(block_mask, block_size, axis=-1)[..., :t]
    visible = jnp.arange(t) < _visible_len(visible_len, b, s)[..., None]
    return in_block & visible, ids
