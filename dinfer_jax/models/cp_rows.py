"""Balanced (mirrored) context-parallel rows inside a per-device step (``docs/spec/engine.md`` §9).

Inside the DP engines' ``shard_map`` step (:mod:`dinfer_jax.engine.dp_runner`) the ``cp`` ranks of an engine hold
the same prefill rows. :func:`cp_tokenwise` runs a per-token function (the MoE sublayer: router, routed experts
over EP, shared expert; the attention of each query over its window and compressed rows) on this CP rank's share of
every row only — DeepInfer's mirrored rule, row ``b``'s ``n[b]``
query tokens cut into ``2·cp`` pieces of ``ceil(n[b] / (2·cp))`` and rank ``r`` taking pieces ``r`` and
``2·cp − 1 − r`` (:func:`sharding.cp_split`) — and all-gathers the results over the CP group back into row order.
Each token's output is computed once in the CP group, and the EP dispatch carries each token once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sharding.mesh import GROUP_AXES


def mirror_rows(n: jax.Array, q: int, cp: int, rank: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """Rank ``rank``'s query positions of each row: ``(pos [B, 2·ceil(q/(2cp))] int32, valid bool)``, positions in
    increasing order as :func:`sharding.cp_split` gives them for ``n[b]`` rows; invalid entries point at 0."""
    ps = -(-q // (2 * cp))
    j = jnp.arange(2 * ps)
    first = j < ps
    jj = jnp.where(first, j, j - ps)
    piece = jnp.where(first, rank, 2 * cp - 1 - rank)
    psb = (n + 2 * cp - 1) // (2 * cp)  # [B]
    pos = piece[None, :] * psb[:, None] + jj[None, :]
    valid = (jj[None, :] < psb[:, None]) & (pos < n[:, None])
    return jnp.where(valid, pos, 0).astype(jnp.int32), valid


def cp_tokenwise(fn: Callable[..., Any], x: jax.Array, extras: tuple[jax.Array | None, ...], n: jax.Array,
                 cp: int) -> Any:
    """``fn(x, *extras)`` for per-token ``fn`` on ``x [B, Q, ...]`` (extras ``[B, Q, ...]`` or None; the result an
    array or a pytree of arrays ``[B, Q', ...]`` for ``Q'`` rows in, any dtype), computed on this CP rank's mirrored
    rows and all-gathered over the CP axes (must run inside a ``shard_map`` over them). Positions no rank owns
    (``≥ n[b]``, padding) come back as zeros (False, 0)."""
    axes = GROUP_AXES["cp"]
    B, Q = x.shape[:2]
    rank = jax.lax.axis_index(axes)

    def take(a: jax.Array | None, pos: jax.Array) -> jax.Array | None:
        if a is None:
            return None
        return jnp.take_along_axis(a, pos.reshape(pos.shape + (1,) * (a.ndim - 2)), axis=1)

    pos, valid = mirror_rows(n, Q, cp, rank)
    owned = [mirror_rows(n, Q, cp, r) for r in range(cp)]
    rows = jnp.arange(B)[:, None]

    def back(y: jax.Array) -> jax.Array:
        dtype = y.dtype
        if dtype == jnp.bool_:   # gathered and added as integers, exactly
            y = y.astype(jnp.int8)
        tail = (1,) * (y.ndim - 2)
        zero = jnp.zeros((), y.dtype)
        y = jnp.where(valid.reshape(valid.shape + tail), y, zero)
        ys = jax.lax.all_gather(y, axes, axis=0, tiled=False)  # [cp, B, 2ps, ...]
        out = jnp.zeros((B, Q, *y.shape[2:]), y.dtype)
        for r, (pos_r, valid_r) in enumerate(owned):  # every real position has exactly one owner: the adds are exact
            out = out.at[rows, pos_r].add(jnp.where(valid_r.reshape(valid_r.shape + tail), ys[r], zero))
        return out.astype(dtype)

    return jax.tree.map(back, fn(take(x, pos), *(take(e, pos) for e in extras)))


def group_tokenwise(fn: Callable[..., jax.Array], x: jax.Array, extras: tuple[jax.Array | None, ...], copies: int,
                    cp: int) -> jax.Array:
    """``fn(x, *extras)`` for per-token ``fn`` on ``x [B, Q, D]`` when the ``copies · cp`` devices of an engine (its
    copies along the DP mesh axes, engine ``dp_rank // copies``, times its CP ranks) hold the same tokens: the
    ``B·Q`` tokens are cut into ``copies · cp`` contiguous shares, each device computes its share, and the shares
    are all-gathered back (over the DP and CP axes; the engine's block is picked out). Runs inside a
    ``shard_map`` over the whole mesh."""
    g = copies * cp
    B, Q = x.shape[:2]
    T = B * Q
    share = -(-T // g)
    dp_rank = jax.lax.axis_index(GROUP_AXES["dp"])
    k = (dp_rank % copies) * cp + jax.lax.axis_index(GROUP_AXES["cp"])

    def mine(a: jax.Array | None) -> jax.Array | None:
        if a is None:
            return None
        flat = a.reshape(T, *a.shape[2:])
        flat = jnp.pad(flat, [(0, g * share - T)] + [(0, 0)] * (flat.ndim - 1))
        return jax.lax.dynamic_slice_in_dim(flat, k * share, share, axis=0)[None]

    y = fn(mine(x), *(mine(e) for e in extras))[0]  # [share, D]
    ys = jax.lax.all_gather(y, GROUP_AXES["dp"] + GROUP_AXES["cp"], axis=0, tiled=False)  # [dp·copies·cp, share, D]
    block = jax.lax.dynamic_slice_in_dim(ys, (dp_rank // copies) * g, g, axis=0)
    return block.reshape(g * share, -1)[:T].reshape(B, Q, -1)
