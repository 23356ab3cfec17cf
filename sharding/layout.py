"""DeepInfer's rank groups (data-, context- and expert-parallel) and the balanced context-parallel row split.

Pure integer bookkeeping, no devices: :func:`layout` gives the worker ids of every DP, CP and EP group as
DeepInfer's ``ParallelProcessGroup.create_process_groups`` builds them (``docs/spec/engine.md`` §10), and
:func:`cp_split` the prefill rows each CP rank owns (``docs/spec/engine.md`` §9).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Worker ids of each group, every group in rank order. ``worker = engine · cp + cp_rank``."""

    dp: int
    cp: int
    ep: int
    dp_groups: list[list[int]]
    cp_groups: list[list[int]]
    ep_groups: list[list[int]]

    @property
    def world(self) -> int:
        """Number of workers (devices): ``dp · cp``."""
        return self.dp * self.cp


def _check_sizes(dp: int, cp: int, ep: int) -> None:
    for name, v in (("dp", dp), ("cp", cp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    world = dp * cp
    if world % ep:
        raise ValueError(f"ep={ep} does not divide the world size dp·cp = {dp}·{cp} = {world}: EP groups are "
                         f"contiguous blocks of ep workers")


def layout(dp: int, cp: int, ep: int) -> RankLayout:
    """DeepInfer's memberships for ``dp`` engines of ``cp`` CP ranks each, with EP groups of ``ep`` workers.

    ``world = dp·cp``; worker ``e·cp + c`` is engine ``e``'s CP rank ``c``. DP groups join the same CP rank of every
    engine, CP groups are the ranks of one engine, EP groups are contiguous blocks of ``ep`` workers (they span
    ``ep/cp`` engines when ``ep > cp``). Example: DP2/CP2/EP4 gives DP ``[[0, 2], [1, 3]]``, CP ``[[0, 1], [2, 3]]``,
    EP ``[[0, 1, 2, 3]]``.

    Raises ValueError when a size is < 1 or ``ep`` does not divide ``dp·cp``.
    """
    _check_sizes(dp, cp, ep)
    world = dp * cp
    return RankLayout(
        dp=dp, cp=cp, ep=ep,
        dp_groups=[[e * cp + c for e in range(dp)] for c in range(cp)],
        cp_groups=[[e * cp + c for c in range(cp)] for e in range(dp)],
        ep_groups=[list(range(s, s + ep)) for s in range(0, world, ep)],
    )


def cp_split(num_rows: int, cp: int) -> list[list[int]]:
    """Prefill rows owned by each CP rank under DeepInfer's mirrored (zigzag) rule.

    The ``num_rows`` query rows are cut into ``2·cp`` pieces of ``ceil(num_rows / (2·cp))`` rows (the trailing
    pieces short or empty when the division is not exact); rank ``r`` takes pieces ``r`` and ``2·cp − 1 − r``, which
    balances causal attention work. Returns, per rank, its row indices in increasing order.

    Raises ValueError when ``num_rows < 0`` or ``cp < 1``.
    """
    if not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be an integer >= 0, got {num_rows!r}")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be an integer >= 1, got {cp!r}")
    piece = -(-num_rows // (2 * cp))

    def rows(j: int) -> list[int]:
        return list(range(min(j * piece, num_rows), min((j + 1) * piece, num_rows)))

    return [rows(r) + rows(2 * cp - 1 - r) for r in range(cp)]
