"""Batch-invariant attention and indexer scores (:mod:`dinfer_jax.models.invariant`).

The same functions as :func:`~dinfer_jax.models.attention.attend`, :func:`~dinfer_jax.models.attention.attend_selected`
and the indexer's score contraction, computed so that a query's result depends only on its own query and visible
keys, never on the step's shapes:

* **window keys in position order.** A step's window keys are the slot's ring (positions modulo its size) followed
  by this step's rows, so where a key sits depends on how the prompt was chunked. Each query gathers its own
  ``W`` window keys, positions ``p − W + 1 … p`` (:func:`window_rows`), with the step's mask entries for them.
* **fixed key blocks, online softmax.** The window block (``W`` keys), then the compressed keys: a query's
  selected rows (top-k, ascending row order, a fixed ``k``) or all of a sequence's rows in blocks of
  :data:`~dinfer_jax.models.invariant.KV_BLOCK` (their number follows the step's page bucket). Each block is one
  batched product per query (``[H, d] · [c, d]ᵀ``, batch = the queries of a tile), then the running max / sum /
  accumulator update in fp32, starting from the sink (max = sink, sum = 1, accumulator 0). A block without a
  visible key leaves all three exactly unchanged, so trailing empty blocks cost time, not bits.
* queries run in fixed tiles (:func:`~dinfer_jax.models.invariant.token_tiled`).

Numerics against the default path: the same softmax with the sink, accumulated blockwise (rescaled partial sums)
instead of one normalisation; in fp32 the two differ by a few ulps. Probabilities are rounded to the activation
dtype before the ``P·V`` product as in the default path (there before normalisation, here after).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.models.invariant import KV_BLOCK, token_tiled
from dinfer_jax.models.ops import F32, matmul

_HIGHEST = jax.lax.Precision.HIGHEST


def window_rows(keys: jax.Array, mask: jax.Array, start: jax.Array, pos: jax.Array,
                window: int, ring: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Each query's window keys in position order.

    keys ``[B, R+C, d]`` (the slot's ring of ``R`` entries, position ``j`` at ``j mod R``, then this step's ``C``
    rows from position ``start [B]``), mask ``[B, Q, R+C]`` (which of them each query sees), pos ``[B, Q]`` the
    query positions. ``ring``: ``R``, by default ``R+C − Q`` (the queries are the step's rows; a CP rank passes it
    with its own subset of them). Returns ``(rows [B, Q, W, d], visible [B, Q, W])``: entry ``i`` is position
    ``pos − W + 1 + i`` (its mask entry from ``mask``; positions below 0 are never visible)."""
    B, Q = pos.shape
    R = keys.shape[1] - Q if ring is None else ring
    C = keys.shape[1] - R
    j = pos[..., None] - (window - 1) + jnp.arange(window)                           # [B,Q,W]
    rel = j - start[:, None, None]
    idx = jnp.where(rel >= 0, R + jnp.clip(rel, 0, C - 1), jnp.mod(j, R))
    rows = jnp.take_along_axis(keys[:, None], idx.reshape(B, Q, window, 1), axis=2)  # [B,Q,W,d]
    visible = jnp.take_along_axis(mask, idx, axis=2) & (j >= 0)
    return rows, visible


def _online_block(state: tuple[jax.Array, jax.Array, jax.Array], q: jax.Array, k: jax.Array, visible: jax.Array,
                  scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block of the online softmax: q ``[m,H,d]``, k ``[m,c,d]``, visible ``[m,c]``; state (max ``[m,H]``,
    sum ``[m,H]``, accumulator ``[m,H,d]``) fp32."""
    mx, den, acc = state
    dt = q.dtype
    k = jnp.where(visible[..., None], k.astype(dt), jnp.zeros((), dt))   # select: stale rows never enter a sum
    s = jnp.where(visible[:, None, :], matmul("mhd,mcd->mhc", q, k) * scale, -jnp.inf)
    new = jnp.maximum(mx, jnp.max(s, axis=-1))
    alpha = jnp.exp(mx - new)
    p = jnp.exp(s - new[..., None])
    den = den * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + matmul("mhc,mcd->mhd", p.astype(dt), k)
    return new, den, acc


def _attend_tile(q: jax.Array, wrows: jax.Array, wvis: jax.Array, crows: jax.Array | None,
                 cvis: jax.Array | None, sink: jax.Array) -> jax.Array:
    """Attention of ``m`` queries over their window block and their compressed rows ``crows [m, C, d]`` (C a
    multiple of the block size, or ≤ it) in blocks. Returns ``[m, H, d]`` in q's dtype."""
    m, H, d = q.shape
    scale = d ** -0.5
    state = (jnp.broadcast_to(sink.astype(F32)[None, :], (m, H)), jnp.ones((m, H), F32), jnp.zeros((m, H, d), F32))
    state = _online_block(state, q, wrows, wvis, scale)
    if crows is not None and crows.shape[1] > 0:
        C = crows.shape[1]
        c = min(C, KV_BLOCK)
        nb = C // c
        kb = jnp.moveaxis(crows.reshape(m, nb, c, d), 1, 0)
        vb = jnp.moveaxis(cvis.reshape(m, nb, c), 1, 0)
        state, _ = jax.lax.scan(lambda st, blk: (_online_block(st, q, *blk, scale), None), state, (kb, vb))
    _, den, acc = state
    return (acc / den[..., None]).astype(q.dtype)


def _pad_rows(x: jax.Array, axis: int, multiple: int, value) -> jax.Array:
    n = x.shape[axis]
    if n <= multiple or n % multiple == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, multiple - n % multiple)
    return jnp.pad(x, pad, constant_values=value)


def attend_invariant(q: jax.Array, keys: jax.Array, win_mask: jax.Array, start: jax.Array, pos: jax.Array,
                     window: int, sink: jax.Array, *, rows: jax.Array | None = None,
                     row_mask: jax.Array | None = None, ckv: jax.Array | None = None,
                     cmask: jax.Array | None = None) -> jax.Array:
    """Batch-invariant sink attention (module docstring). q ``[B,Q,H,d]``; keys ``[B,R+Q,d]`` and win_mask
    ``[B,Q,R+Q]`` as the window step builds them; compressed rows either per query (``rows [B,Q,K,d]``,
    ``row_mask [B,Q,K]``: selected rows) or shared by a sequence's queries (``ckv [B,T,d]``, ``cmask [B,Q,T]``).
    Returns o ``[B,Q,H,d]`` in q's dtype."""
    B, Q, H, d = q.shape
    wm = jnp.broadcast_to(win_mask, (B, Q, keys.shape[1]))
    wrows, wvis = window_rows(keys, wm, start, pos, window)
    if rows is not None:
        rows = _pad_rows(rows, 2, KV_BLOCK, 0)
        row_mask = _pad_rows(row_mask, 2, KV_BLOCK, False)
        return token_tiled(lambda q, wr, wv, r, rv: _attend_tile(q, wr, wv, r, rv, sink),
                           q, wrows, wvis, rows, row_mask, lead=2)
    if ckv is None:
        return token_tiled(lambda q, wr, wv: _attend_tile(q, wr, wv, None, None, sink), q, wrows, wvis, lead=2)
    ckv = _pad_rows(ckv, 1, KV_BLOCK, 0)
    cmask = _pad_rows(jnp.broadcast_to(cmask, (B, Q, cmask.shape[-1])), 2, KV_BLOCK, False)
    b = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, Q))
    return token_tiled(lambda q, wr, wv, bi, cv: _attend_tile(q, wr, wv, ckv[bi], cv, sink),
                       q, wrows, wvis, b, cmask, lead=2)


def index_dots_invariant(q: jax.Array, w: jax.Array, k_rows: jax.Array) -> jax.Array:
    """The indexer's ``Σ_h relu(q_h · k_t) · w_h`` batch-invariantly: q ``[B,S,Hi,di]`` fp32, w ``[B,S,Hi]``,
    k_rows ``[B,T,di]``. Per query, keys in blocks of :data:`KV_BLOCK` (one batched ``[Hi,di]·[c,di]ᵀ`` product
    per query and block), the head sum a reduction of a fixed axis. Returns ``[B,S,T]`` fp32 (unmasked)."""
    B, S, Hi, di = q.shape
    T = k_rows.shape[1]
    kp = _pad_rows(k_rows.astype(F32), 1, KV_BLOCK, 0)
    Tp = kp.shape[1]
    c = min(Tp, KV_BLOCK)
    b = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, S))

    def tile(q: jax.Array, w: jax.Array, bi: jax.Array) -> jax.Array:
        m = q.shape[0]
        k = kp[bi].reshape(m, Tp // c, c, di)
        dots = jnp.einsum("mhd,mncd->mnhc", q, k, precision=_HIGHEST)
        return jnp.sum(jax.nn.relu(dots) * w[:, None, :, None], axis=2).reshape(m, Tp)

    return token_tiled(tile, q.astype(F32), w.astype(F32), b, lead=2)[..., :T]


__all__ = ["attend_invariant", "index_dots_invariant", "window_rows"]
