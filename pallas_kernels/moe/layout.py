"""Token layout for the grouped expert GEMM: rows sorted by expert, each expert's rows padded to whole tiles.

The kernel works on tiles of ``block_m`` rows that each belong to exactly one expert, so every tile is a dense
GEMM against one expert's weights and every store is a full tile (no ragged edges). Rows are laid out
expert-major; expert ``g`` owns rows ``[start[g], start[g] + round_up(count[g], block_m))`` of a padded buffer
whose static length bounds every routing (``num_rows(...)``). Everything here is integer arithmetic on
``[N·k]``/``[G]``/``[T]`` vectors: no Python loop over experts, so trace size does not grow with ``G``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def num_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Static padded row count: enough for any routing of ``num_assignments`` (token, expert) pairs.

    Each non-empty expert wastes fewer than ``block_m`` rows and at most ``min(G, N·k)`` experts are non-empty.
    """
    waste = min(num_experts, num_assignments) * (block_m - 1)
    return -(-(num_assignments + waste) // block_m) * block_m


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedLayout:
    """Where each (token, choice) pair lives in the padded, expert-sorted row buffer.

    Attributes:
      row: ``[N, k]`` int32, padded row of token n's j-th expert choice.
      tile_group: ``[T]`` int32, expert of tile t (``T = rows / block_m``), −1 for tiles past the last expert.
      group_sizes: ``[G]`` int32, assignments per expert (unpadded).
      num_tiles: scalar int32, tiles in use (``Σ_g ceil(count_g / block_m)``).
    """

    row: jax.Array
    tile_group: jax.Array
    group_sizes: jax.Array
    num_tiles: jax.Array


def grouped_layout(expert_ids: jax.Array, num_experts: int, block_m: int) -> GroupedLayout:
    """Layout for routing ``expert_ids [N, k]`` int32 with tiles of ``block_m`` rows.

    Values are in ``[0, G]``; ``G`` means "no expert here" (an expert-parallel rank's view of a row another rank
    computes): such a pair gets row ``rows`` (one past the buffer), occupies no tile and combines to zero.
    Within an expert, pairs keep their flat order ``n·k + j`` (stable), like a stable sort by expert.
    """
    n, k = expert_ids.shape
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    rows = num_rows(n * k, num_experts, block_m)
    # length G + 1: the dropped pairs get a group of their own, past the last expert, that owns no tile
    counts_all = jnp.bincount(flat, length=num_experts + 1).astype(jnp.int32)
    counts = counts_all[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    start = jnp.concatenate([jnp.cumsum(padded) - padded, jnp.full((1,), rows, jnp.int32)])  # padded starts
    first = jnp.cumsum(counts_all) - counts_all               # unpadded start (rank base)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = jnp.arange(n * k, dtype=jnp.int32) - first[sorted_e]
    row = jnp.zeros((n * k,), jnp.int32).at[order].set(
        jnp.where(sorted_e < num_experts, start[sorted_e] + rank, rows))
    tiles = rows // block_m
    tile_start = jnp.arange(tiles, dtype=jnp.int32) * block_m
    ends = jnp.cumsum(padded)
    # compare_all: one fused comparison of every tile start with every end; the default binary search is a while
    # loop whose ~9 rounds launch two tiny GPU kernels each, per MoE layer (docs/perf/serving_h200.md)
    g = jnp.searchsorted(ends, tile_start, side="right", method="compare_all").astype(jnp.int32)
    tile_group = jnp.where(tile_start < ends[-1], g, -1)
    return GroupedLayout(row=row.reshape(n, k), tile_group=tile_group, group_sizes=counts,
                         num_tiles=(ends[-1] // block_m).astype(jnp.int32))


def gather_rows_t(x: jax.Array, layout: GroupedLayout, rows: int) -> jax.Array:
    """Expert-sorted, padded, transposed activations: ``x [N, D]`` → ``[D, rows]`` (padding columns zero).

    A gather (each padded column reads its token, padding reads a zero column), not a scatter into zeros."""
    n, k = layout.row.shape
    # dropped pairs (row == rows) fall outside the buffer: mode="drop" leaves them out
    src = jnp.full((rows,), n, jnp.int32).at[layout.row.reshape(-1)].set(
        jnp.repeat(jnp.arange(n, dtype=jnp.int32), k), mode="drop")
    xz = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)], axis=0)
    return jnp.take(xz.T, src, axis=1)


def choice_rows_t(y_t: jax.Array, layout: GroupedLayout, weights: jax.Array) -> jax.Array:
    """Each (token, choice) pair's weighted expert output: ``y_t [D, rows]``, weights ``[N, k]`` → fp32
    ``[N, k, D]``, exactly zero for dropped pairs (id ``G``; their padded columns may hold anything).

    Transposes once (a contiguous pass) and then gathers whole rows."""
    rows = y_t.shape[1]
    valid = layout.row < rows
    picked = jnp.take(y_t.T, jnp.minimum(layout.row, rows - 1), axis=0).astype(jnp.float32)   # [N, k, D]
    return jnp.where(valid[..., None], picked * weights.astype(jnp.float32)[..., None], 0.0)


def combine_rows_t(y_t: jax.Array, layout: GroupedLayout, weights: jax.Array) -> jax.Array:
    """Weighted sum over each token's k expert outputs: ``y_t [D, rows]``, weights ``[N, k]`` → fp32 ``[N, D]``.

    The sum runs in choice order, ``((w₀y₀ + w₁y₁) + w₂y₂) + …`` with explicit adds: the order an expert-parallel
    combine uses too (``dinfer_jax/models/expert_ffn.py``), so a token gets the same bits on one device and with
    its choices computed on several."""
    r = choice_rows_t(y_t, layout, weights)
    acc = r[:, 0]
    for j in range(1, r.shape[1]):
        acc = acc + r[:, j]
    return acc
