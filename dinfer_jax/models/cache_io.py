"""Ring and page I/O on stacked cache arrays.

Every cache array has a leading layer axis (the repeats of a scan group); ``k`` (a scalar, traced inside a scan)
picks the layer, so reads gather only the rows they need and writes scatter in place into the scan's carry.
Out-of-range scatter indices (slot ``num_slots``, page ``num_blocks``) are dropped: that is how padding rows and
invalid entries write nowhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ring_positions(start: jax.Array, size: int) -> jax.Array:
    """Positions held by a ring of ``size`` entries just before ``start`` ``[B]``: ``[B, size]`` (< 0 if none)."""
    j = jnp.arange(size)
    return start[:, None] - 1 - jnp.mod(start[:, None] - 1 - j[None, :], size)


def ring_read(ring: jax.Array, k: jax.Array, slot: jax.Array) -> jax.Array:
    """The rings of slots ``slot [B]`` of layer ``k``: ring ``[L, num_slots, R, C]`` → ``[B, R, C]``."""
    return ring[k, slot]


def ring_write(ring: jax.Array, k: jax.Array, slot: jax.Array, pos: jax.Array, n: jax.Array,
               values: jax.Array) -> jax.Array:
    """Write ``values [B,Q,C]`` of positions ``pos [B,Q]`` into layer ``k`` of ``ring [L, num_slots, R, C]`` at
    ``[slot, pos % R]``; only each row's last R valid tokens are written, padding rows nowhere."""
    R = ring.shape[2]
    Q = pos.shape[1]
    i = jnp.arange(Q)[None, :]
    keep = (i < n[:, None]) & (i >= n[:, None] - R)
    s = jnp.where(keep, slot[:, None], ring.shape[1])
    return ring.at[k, s, jnp.mod(pos, R)].set(values.astype(ring.dtype), mode="drop")


def buffer_take(ring_rows: jax.Array, new_rows: jax.Array, start: jax.Array, positions: jax.Array) -> jax.Array:
    """Values at ``positions [B, ...]`` from this step's rows (position ≥ start) or the slot's ring (earlier).

    ring_rows ``[B,R,C]`` (ring of the row's slot), new_rows ``[B,Q,C]``. Returns ``[B, ..., C]``.
    """
    B, R, C = ring_rows.shape
    Q = new_rows.shape[1]
    flat = positions.reshape(B, -1)
    rel = flat - start[:, None]
    from_new = rel >= 0
    a = jnp.take_along_axis(new_rows, jnp.clip(rel, 0, Q - 1)[..., None], axis=1)
    b = jnp.take_along_axis(ring_rows, jnp.mod(flat, R)[..., None], axis=1)
    return jnp.where(from_new[..., None], a, b).reshape(*positions.shape, C)


def pages_read(pool: jax.Array, k: jax.Array, pages: jax.Array) -> jax.Array:
    """A sequence's paged rows in order: pool ``[L, N, rpb, C]``, pages ``[B,P]`` → ``[B, P·rpb, C]``."""
    g = pool[k, pages]
    return g.reshape(pages.shape[0], -1, pool.shape[-1])


def pages_gather(pool: jax.Array, k: jax.Array, pages: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``rows [B, ...]`` (sequence row index; negative = none, read as row 0) of each sequence from layer ``k``
    of ``pool [L, N, rpb, C]`` through its page table ``pages [B,P]`` → ``[B, ..., C]``. Reads only those rows."""
    page, offset = _page_and_offset(pages, rows, pool.shape[2])
    return pool[k, page, offset].reshape(*rows.shape, pool.shape[-1])


def _page_and_offset(pages: jax.Array, rows: jax.Array, rpb: int) -> tuple[jax.Array, jax.Array]:
    """Pool page and row within it ``[B, n]`` of each sequence row ``rows [B, ...]`` through ``pages [B,P]``
    (negative rows: row 0 of the first page; rows past the table: its last page)."""
    flat = jnp.maximum(rows.reshape(rows.shape[0], -1), 0)
    page = jnp.take_along_axis(pages, jnp.clip(flat // rpb, 0, pages.shape[1] - 1), axis=1)
    return page, jnp.mod(flat, rpb)


def pool_rows(pool: jax.Array, k: jax.Array, pages: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rows :func:`pages_gather` reads, as indices into the pool viewed as one array of rows (for a kernel that
    gathers them itself): ``(pool.reshape(L·N·rpb, C), flat int32 [B, ...])`` with
    ``pool.reshape(-1, C)[flat] == pages_gather(pool, k, pages, rows)`` (negative rows read row 0 of the
    sequence's first page, as there). The reshape is free (no copy)."""
    L, N, rpb, C = pool.shape
    page, offset = _page_and_offset(pages, rows, rpb)
    index = (k * N + page) * rpb + offset
    return pool.reshape(L * N * rpb, C), index.astype(jnp.int32).reshape(rows.shape)


def take_rows(rows_all: jax.Array, idx: jax.Array) -> jax.Array:
    """``rows_all [B,T,C]`` at ``idx [B, ...]`` (negative = none, read as row 0) → ``[B, ..., C]``."""
    B = idx.shape[0]
    flat = jnp.clip(idx.reshape(B, -1), 0, rows_all.shape[1] - 1)
    return jnp.take_along_axis(rows_all, flat[..., None], axis=1).reshape(*idx.shape, rows_all.shape[-1])


def stored_rows(rows_all: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rows :func:`take_rows` reads, as indices into ``rows_all [B,T,C]`` viewed as one array of rows (for a
    kernel that gathers them itself): ``(rows_all.reshape(B·T, C), flat int32 [B, ...])`` with
    ``rows_all.reshape(-1, C)[flat] == take_rows(rows_all, idx)``."""
    B, T, C = rows_all.shape
    flat = jnp.clip(idx.reshape(B, -1), 0, T - 1) + (jnp.arange(B) * T)[:, None]
    return rows_all.reshape(B * T, C), flat.astype(jnp.int32).reshape(idx.shape)


def pages_write(pool: jax.Array, k: jax.Array, pages: jax.Array, rows: jax.Array, valid: jax.Array,
                values: jax.Array) -> jax.Array:
    """Write compressed rows ``rows [B,W]`` (sequence row index) of each sequence into layer ``k`` of
    ``pool [L, N, rpb, C]``; invalid entries are dropped.

    A write of a single row (``B·W = 1``: batch-1 decode) gets one more, invalid entry. XLA simplifies a one-index
    scatter into a dynamic-update-slice and fuses that into the gather that reads the written pool next (the step
    attends to the rows it just wrote); the fused gather then reads the old pool while the update writes the new
    one in place, so XLA copies the whole pool, twice, on every step — measured on CPU: a batch-1 decode step of
    the default model took 65 ms instead of 3 ms, copying one layer's 121 MB of pages. (An optimisation barrier
    does not prevent it: XLA's CPU pipeline removes barriers before fusion; reading the old pool and patching in
    the written rows made XLA copy every layer's pool.)"""
    rpb = pool.shape[2]
    if rows.size == 1:
        rows, valid = jnp.pad(rows, ((0, 0), (0, 1))), jnp.pad(valid, ((0, 0), (0, 1)))
        values = jnp.pad(values, ((0, 0), (0, 1)) + ((0, 0),) * (values.ndim - 2))
    page_no = jnp.clip(rows // rpb, 0, pages.shape[1] - 1)
    page = jnp.where(valid, jnp.take_along_axis(pages, page_no, axis=1), pool.shape[1])
    return pool.at[k, page, jnp.mod(rows, rpb)].set(values.astype(pool.dtype), mode="drop")


def closing_groups(start: jax.Array, n: jax.Array, ratio: int, Q: int) -> tuple[jax.Array, jax.Array]:
    """Compression groups closed by this step's tokens: ``(w [B, Q//ratio + 1], valid)``; group w closes at token
    ``(w+1)·ratio − 1``."""
    w = start[:, None] // ratio + jnp.arange(Q // ratio + 1)[None, :]
    return w, w < ((start + n) // ratio)[:, None]
