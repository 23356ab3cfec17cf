"""Block table for the expert kernel, by the number of (token, expert) assignments in the call.

Filled from ``scripts/bench_kernels.py moe`` runs on the H200 (docs/perf/moe_kernel_h200.md). Decode calls have
a few rows per expert, so the token tile is the smallest the MMA allows; prefill calls fill 64–128-row tiles.
"""

from __future__ import annotations

from pallas_kernels.moe.kernel_sm90 import TileConfig

# (max assignments, up-projection config, down-projection config); the first row that fits is used.
TABLE: tuple[tuple[int, TileConfig, TileConfig], ...] = (
    (2048, TileConfig(16, 64, 128, 4), TileConfig(16, 64, 128, 4)),
    (1 << 62, TileConfig(128, 64, 128, 4), TileConfig(128, 64, 128, 4)),
)


def configs_for(assignments: int) -> tuple[TileConfig, TileConfig]:
    """(up, down) tile configs for a call with ``assignments = tokens · top_k`` rows."""
    for limit, up, down in TABLE:
        if assignments <= limit:
            return up, down
    raise AssertionError("unreachable: the last row has no limit")


def pick_configs(assignments: int, sweep: bool) -> list[tuple[TileConfig, TileConfig]]:
    """The table's choice, plus (``sweep``) neighbouring block sizes to benchmark."""
    base = [configs_for(assignments)]
    if not sweep:
        return base
    if assignments <= 2048:
        cand = [(TileConfig(bm, bn, bk, s), TileConfig(bm, bn, bk, s))
                for bm in (16, 32) for bn in (64, 128) for bk in (128, 256) for s in (4,)]
    else:
        cand = [(TileConfig(bm, 64, bk, s), TileConfig(bm, bn2, bk, s))
                for bm in (64, 128) for bn2 in (64, 128) for bk in (128,) for s in (3, 4)]
    return base + [c for c in cand if c not in base]
