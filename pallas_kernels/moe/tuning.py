"""Block table for the expert kernel, by the number of (token, expert) assignments in the call.

Filled from ``scripts/bench_kernels.py moe`` runs on the H200 (docs/perf/moe_kernel_h200.md). Decode calls have
a few rows per expert, so the token tile is the smallest the MMA allows; prefill calls fill 64–128-row tiles.
"""

from __future__ import annotations

from pallas_kernels.moe.kernel_sm90 import TileConfig

# (max assignments, up-projection config, down-projection config); the first row that fits is used. Both rows
# are the warp-specialised kernel (2 consumer warpgroups), measured 2026-12-01 (docs/perf/moe_kernel_h200.md) with
# released-layout and with fp4_mma weights (decode: 79% of copy bandwidth at 64 tokens; prefill: 76% of bf16 peak).
TABLE: tuple[tuple[int, TileConfig, TileConfig], ...] = (
    (2048, TileConfig(16, 128, 256, 4, 2), TileConfig(16, 128, 256, 4, 2)),
    (1 << 62, TileConfig(128, 128, 128, 3, 2), TileConfig(128, 128, 128, 3, 2)),
)
# Single-warpgroup configs for widths the table's 128-row CTAs or 256-wide K steps do not divide.
FALLBACK: tuple[tuple[int, TileConfig, TileConfig], ...] = (
    (2048, TileConfig(16, 64, 128, 4), TileConfig(16, 64, 128, 4)),
    (1 << 62, TileConfig(128, 64, 128, 4), TileConfig(128, 64, 128, 4)),
)


def _fits(c: TileConfig, n_out: int, k: int) -> bool:
    try:
        c.check(n_out, k)
    except ValueError:
        return False
    return c.consumers == 1 or n_out % c.block_n == 0


def configs_for(assignments: int, hidden: int | None = None, inter: int | None = None
                ) -> tuple[TileConfig, TileConfig]:
    """(up, down) tile configs for a call with ``assignments = tokens · top_k`` rows; with the expert shapes
    (``hidden`` D, ``inter`` I: up is ``[I, D]``, down ``[D, I]``) a table row whose tiles do not divide them is
    replaced by the single-warpgroup fallback."""
    for (limit, up, down), (_, up_fb, down_fb) in zip(TABLE, FALLBACK, strict=True):
        if assignments <= limit:
            if hidden is None or (_fits(up, inter, hidden) and _fits(down, hidden, inter)):
                return up, down
            return up_fb, down_fb
    raise AssertionError("unreachable: the last row has no limit")


def pick_configs(assignments: int, sweep: bool) -> list[tuple[TileConfig, TileConfig]]:
    """The table's choice, plus (``sweep``) neighbouring block sizes to benchmark."""
    base = [configs_for(assignments)]
    if not sweep:
        return base
    T = TileConfig
    base += [c for limit, *c in FALLBACK if assignments <= limit][:1]
    base = [tuple(c) for c in base]
    if assignments <= 2048:
        # warp-specialised (2 consumers): the block sizes that fit shared memory at K = 4096 / 2048
        cand = [(T(16, 128, 128, 4, 2), T(16, 128, 128, 4, 2)), (T(16, 128, 128, 6, 2), T(16, 128, 128, 6, 2)),
                (T(16, 128, 256, 4, 2), T(16, 128, 256, 4, 2)), (T(16, 256, 128, 4, 2), T(16, 256, 128, 4, 2)),
                (T(32, 128, 128, 4, 2), T(32, 128, 128, 4, 2)), (T(32, 128, 128, 6, 2), T(32, 128, 128, 6, 2))]
    else:
        cand = [(T(128, 128, 64, 4, 2), T(128, 128, 64, 4, 2)), (T(128, 128, 128, 3, 2), T(128, 128, 128, 3, 2)),
                (T(128, 128, 64, 3, 2), T(128, 256, 64, 3, 2)), (T(128, 256, 64, 3, 2), T(128, 256, 64, 3, 2)),
                (T(64, 256, 64, 4, 2), T(64, 256, 64, 4, 2)), (T(64, 128, 128, 4, 2), T(64, 256, 64, 4, 2)),
                (T(256, 128, 64, 2, 2), T(256, 128, 64, 2, 2)),
                (T(128, 64, 128, 4), T(128, 64, 128, 4))]
    return base + [c for c in cand if c not in base]
