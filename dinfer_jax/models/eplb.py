"""Expert-parallel load balancing (EPLB): where each expert's replicas live, and how a token picks one.

Port of the semantics of DeepInfer's EPLB (``docs/spec/engine.md`` §10; ``deepinfer/model_executor/eplb``).
Host-side integer and float bookkeeping in numpy, per MoE layer; the device only sees :class:`ExpertMap`.

Terms: the model has ``E`` *logical* experts; a device group of ``ep`` ranks holds ``P = E + R`` *physical* slots
(``R = num_redundant``), ``P / ep`` consecutive slots per rank (rank ``r`` holds slots ``[r·P/ep, (r+1)·P/ep)``). Each
slot holds a copy of one logical expert; every logical expert has at least one slot. A :class:`Placement` is that
assignment; the physical weights are the logical weights gathered by ``physical_to_logical``
(:func:`physical_experts`).

* :func:`initial_placement`: slots ``0..E−1`` hold experts ``0..E−1``, redundant slot ``E + i`` holds ``i mod E``.
* :func:`rebalance` (DeepInfer ``rebalance_experts_global``), from per-step per-expert token counts
  ``[steps, E]``: (1) each redundant slot in turn goes to the expert whose extra replica most reduces
  ``Σ_steps max_e load[s, e] / replicas[e]`` (ties: the lowest expert id, after DeepInfer's ``1e-4·e`` tie-break
  offset on the loads); (2) with more than one slot per rank, the replicas — heaviest per-replica load first,
  stable — are placed one at a time on the non-full rank that minimises ``Σ_steps max_rank load[s, rank]`` (ties:
  the lowest rank), each at that rank's next free slot. A replica's load is its expert's load split evenly over the
  replicas.
* Replica choice at dispatch (DeepInfer's ``moe_topk_gate``): a token with local index ``t`` on EP rank ``r`` sends its
  choice of logical expert ``e`` to replica ``(r + t·23333) mod replicas[e]`` of ``e`` (:func:`physical_slots`).

Outputs do not depend on the placement: each (token, choice) row is computed by one replica holding identical
weights and the combine sums a token's choices in a fixed order (``expert_ffn.combine_choices``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REPLICA_PRIME = 23333  # DeepInfer's moe_topk_gate large_prime_number
TIE_BREAK = 1e-4       # DeepInfer's per-expert offset that makes replica-greedy scores distinct


def resolve_num_redundant(num_experts: int, min_redundant: int, ep: int) -> int:
    """The smallest ``R ≥ min_redundant`` with ``ep | num_experts + R`` (DeepInfer ``resolve_num_extra_experts``)."""
    if min_redundant < 0 or ep < 1 or num_experts < 1:
        raise ValueError(f"need num_experts >= 1, min_redundant >= 0, ep >= 1; got {num_experts}, {min_redundant}, "
                         f"{ep}")
    return min_redundant + (-(num_experts + min_redundant) % ep)


def check_sizes(num_experts: int, num_redundant: int, ep: int) -> int:
    """Validate a layout and return the slots per rank ``(E + R) / ep``.

    Raises ValueError when ``num_redundant < 0``, ``ep < 1`` or ``ep`` does not divide ``E + R`` (the ranks would
    hold unequal numbers of slots; :func:`resolve_num_redundant` gives the next valid ``R``)."""
    for name, v, lo in (("num_experts", num_experts, 1), ("num_redundant_experts", num_redundant, 0), ("ep", ep, 1)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    total = num_experts + num_redundant
    if total % ep:
        raise ValueError(f"ep={ep} does not divide num_experts + num_redundant_experts = {num_experts} + "
                         f"{num_redundant} = {total}: every EP rank must hold the same number of expert slots "
                         f"(num_redundant_experts={resolve_num_redundant(num_experts, num_redundant, ep)} would)")
    return total // ep


@dataclasses.dataclass(frozen=True)
class Placement:
    """One MoE layer's placement over an EP group (host numpy, int32).

    physical_to_logical ``[P]``: logical expert of each slot; rank ``r`` holds slots ``[r·P/ep, (r+1)·P/ep)``.
    logical_to_physical ``[E, R+1]``: the slots of each expert, replica 0 first, ``-1`` padding.
    logical_count ``[E]``: replicas per expert. ``ep``: ranks of the group.
    """

    physical_to_logical: np.ndarray
    logical_to_physical: np.ndarray
    logical_count: np.ndarray
    ep: int

    def __post_init__(self) -> None:
        p2l, l2p, cnt = self.physical_to_logical, self.logical_to_physical, self.logical_count
        E, P = cnt.shape[0], p2l.shape[0]
        check_sizes(E, P - E, self.ep)
        if l2p.shape != (E, P - E + 1):
            raise ValueError(f"logical_to_physical has shape {l2p.shape}, expected {(E, P - E + 1)}")
        if (cnt < 1).any():
            raise ValueError(f"experts {np.flatnonzero(cnt < 1).tolist()} have no replica")
        for e in range(E):
            slots = l2p[e, :cnt[e]]
            if (slots < 0).any() or (l2p[e, cnt[e]:] != -1).any() or (p2l[slots] != e).any():
                raise ValueError(f"logical_to_physical[{e}] = {l2p[e].tolist()} disagrees with physical_to_logical")
        if cnt.sum() != P:
            raise ValueError("replica counts do not add up to the number of physical slots")

    @property
    def num_logical(self) -> int:
        return int(self.logical_count.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.shape[0])

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep

    def rank_experts(self) -> list[list[int]]:
        """Logical expert of each slot, per rank."""
        L = self.slots_per_rank
        return [self.physical_to_logical[r * L:(r + 1) * L].tolist() for r in range(self.ep)]

    def expert_map(self) -> ExpertMap:
        """The device-side tables that dispatch reads."""
        return ExpertMap(jnp.asarray(self.logical_to_physical, jnp.int32), jnp.asarray(self.logical_count, jnp.int32))


def _from_p2l_order(p2l: np.ndarray, num_logical: int, ep: int) -> Placement:
    """Placement whose replica order is slot order (replica 0 = the expert's lowest slot)."""
    E, P = num_logical, p2l.shape[0]
    l2p = np.full((E, P - E + 1), -1, np.int32)
    cnt = np.zeros(E, np.int32)
    for slot, e in enumerate(p2l):
        l2p[e, cnt[e]] = slot
        cnt[e] += 1
    return Placement(p2l.astype(np.int32), l2p, cnt, ep)


def initial_placement(num_experts: int, num_redundant: int, ep: int) -> Placement:
    """Identity slots, then redundant slot ``E + i`` = expert ``i mod E`` (DeepInfer's start-up layout).
    Raises ValueError for sizes :func:`check_sizes` rejects."""
    check_sizes(num_experts, num_redundant, ep)
    p2l = np.concatenate([np.arange(num_experts), np.arange(num_redundant) % num_experts])
    return _from_p2l_order(p2l, num_experts, ep)


def _as_steps(tokens_per_expert: Any) -> np.ndarray:
    t = np.asarray(tokens_per_expert, np.float64)
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[0] < 1:
        raise ValueError(f"tokens_per_expert must be [E] or [steps, E], got shape {np.shape(tokens_per_expert)}")
    if (t < 0).any() or not np.isfinite(t).all():
        raise ValueError("tokens_per_expert must be finite and >= 0")
    return t


def replicate(tokens_per_expert: Any, num_redundant: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 1 of :func:`rebalance`: which experts get the redundant slots.

    tokens_per_expert ``[steps, E]`` (or ``[E]``). Returns ``(physical_to_logical [E+R], logical_to_physical
    [E, R+1], logical_count [E])`` with slots ``0..E−1`` = identity and slot ``E + i`` the i-th replica chosen.
    """
    t = _as_steps(tokens_per_expert)
    E = t.shape[1]
    offset = t + np.arange(E) * TIE_BREAK
    p2l = np.concatenate([np.arange(E), np.zeros(num_redundant, np.int64)])
    l2p = np.full((E, num_redundant + 1), -1, np.int64)
    l2p[:, 0] = np.arange(E)
    cnt = np.ones(E, np.int64)
    steps = np.arange(t.shape[0])
    for i in range(num_redundant):
        score = offset / cnt                     # per-replica load now [steps, E]
        top = score.argmax(-1)                   # the expert that sets each step's peak
        peak = score[steps, top]
        # Replicating expert j changes step s's peak only when j is that step's argmax.
        lowered = score.copy()
        lowered[steps, top] = t[steps, top] / (cnt[top] + 1)
        values = np.broadcast_to(peak[:, None], score.shape).copy()
        values[steps, top] = lowered.max(-1)
        e = int(values.sum(0).argmin())
        p2l[E + i] = e
        l2p[e, cnt[e]] = E + i
        cnt[e] += 1
    return p2l.astype(np.int32), l2p.astype(np.int32), cnt.astype(np.int32)


def place(tokens_per_expert: Any, physical_to_logical: np.ndarray, logical_count: np.ndarray,
          slots_per_rank: int) -> np.ndarray:
    """Step 2 of :func:`rebalance`: a permutation ``indices [P]`` of the slots; new slot ``j`` holds old slot
    ``indices[j]``, ranks filled ``slots_per_rank`` at a time. Greedy over replicas by decreasing per-replica load
    (stable): each goes to the non-full rank minimising ``Σ_steps max(peak[s], load[rank, s] + replica[s])``."""
    t = _as_steps(tokens_per_expert)
    P = physical_to_logical.shape[0]
    ranks = P // slots_per_rank
    vectors = (t / logical_count).T[physical_to_logical]                       # [P, steps]
    order = np.argsort(-(t.sum(0) / logical_count)[physical_to_logical], kind="stable")
    loads = np.zeros((ranks, t.shape[0]))
    peaks = np.zeros(t.shape[0])
    fill = np.zeros(ranks, np.int64)
    indices = np.empty(P, np.int64)
    for slot in order:
        v = vectors[slot]
        scores = np.maximum(loads + v, peaks).sum(-1)
        scores[fill == slots_per_rank] = np.inf
        r = int(scores.argmin())
        indices[r * slots_per_rank + fill[r]] = slot
        fill[r] += 1
        loads[r] += v
        peaks = np.maximum(peaks, loads[r])
    return indices


def rebalance(tokens_per_expert: Any, num_redundant: int, ep: int) -> Placement:
    """A new placement from measured loads ``[steps, E]`` (or ``[E]``): :func:`replicate`, then (more than one
    slot per rank) :func:`place`. Raises ValueError for sizes :func:`check_sizes` rejects or bad loads."""
    t = _as_steps(tokens_per_expert)
    L = check_sizes(t.shape[1], num_redundant, ep)
    p2l, l2p, cnt = replicate(t, num_redundant)
    if L > 1:
        indices = place(t, p2l, cnt, L)
        new_of_old = np.argsort(indices)
        p2l = p2l[indices]
        l2p = np.where(l2p >= 0, new_of_old[np.maximum(l2p, 0)], -1).astype(np.int32)
    return Placement(p2l, l2p, cnt, ep)


def rank_loads(placement: Placement, tokens_per_expert: Any) -> np.ndarray:
    """Per-rank load ``[steps, ep]`` when each expert's tokens are split evenly over its replicas (the model
    :func:`rebalance` optimises; the dispatch rule splits them nearly evenly)."""
    t = _as_steps(tokens_per_expert)
    per_slot = (t / placement.logical_count)[:, placement.physical_to_logical]
    return per_slot.reshape(t.shape[0], placement.ep, placement.slots_per_rank).sum(-1)


def balance(placement: Placement, tokens_per_expert: Any) -> float:
    """DeepInfer's ``rank_balance``: mean rank load / mean over steps of the peak rank load (1 = perfect)."""
    loads = rank_loads(placement, tokens_per_expert)
    return float(loads.mean() / loads.max(-1).mean())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertMap:
    """Device tables of a placement (a pytree: a rebalance changes values, not shapes, so nothing recompiles).

    logical_to_physical ``[E, R+1]`` int32 (``-1`` padding); logical_count ``[E]`` int32."""

    logical_to_physical: jax.Array
    logical_count: jax.Array


def identity_map(num_experts: int) -> ExpertMap:
    """No redundancy: expert ``e`` lives in slot ``e``."""
    return ExpertMap(jnp.arange(num_experts, dtype=jnp.int32)[:, None], jnp.ones((num_experts,), jnp.int32))


def physical_slots(expert_map: ExpertMap, idx: jax.Array, ep_rank: jax.Array | int) -> jax.Array:
    """Physical slot of every choice. idx ``[n, k]`` int32 logical experts of this rank's ``n`` tokens; returns
    ``[n, k]`` int32: replica ``(ep_rank + t·23333) mod replicas[e]`` of expert ``e`` for token ``t`` (uint32
    arithmetic; equal to DeepInfer's int32 rule while ``t·23333`` fits)."""
    n = idx.shape[0]
    t = jnp.arange(n, dtype=jnp.uint32)[:, None]
    cnt = expert_map.logical_count[idx].astype(jnp.uint32)
    rep = ((jnp.asarray(ep_rank).astype(jnp.uint32) + t * jnp.uint32(REPLICA_PRIME)) % cnt).astype(jnp.int32)
    return expert_map.logical_to_physical[idx, rep]


def expert_loads(idx: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
    """Tokens routed to each logical expert: idx ``[..., k]`` int32, valid ``[...]`` bool (padding rows False).
    Returns ``[E]`` int32 — one step's row of the ``tokens_per_expert`` that :func:`rebalance` takes."""
    flat = idx.reshape(-1, idx.shape[-1])
    ones = jnp.ones(flat.shape, jnp.int32)
    if valid is not None:
        ones = ones * valid.reshape(-1, 1).astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[flat.reshape(-1)].add(ones.reshape(-1))


def physical_experts(experts: Mapping[str, Any], placement: Placement, sharding: Any = None) -> dict[str, Any]:
    """The physical-slot weights: every leaf (dense arrays, a quantised weight's codes and scales) of the logical
    experts ``[E, ...]`` gathered along axis 0 by ``physical_to_logical`` → ``[P, ...]``. ``sharding``: a
    function ``leaf → Sharding`` (e.g. split axis 0 over the EP axes) to place the result, or None."""
    p2l = jnp.asarray(placement.physical_to_logical)

    def gather(leaf: jax.Array) -> jax.Array:
        out = jnp.take(leaf, p2l, axis=0)
        return out if sharding is None else jax.device_put(out, sharding(out))

    return {name: jax.tree_util.tree_map(gather, w) for name, w in experts.items()}


def rebalance_layers(tokens: Any, num_redundant: int, ep: int) -> Sequence[Placement]:
    """:func:`rebalance` for every MoE layer of ``tokens [steps, layers, E]`` (layers are independent)."""
    t = np.asarray(tokens)
    if t.ndim != 3:
        raise ValueError(f"tokens must be [steps, layers, E], got shape {t.shape}")
    return [rebalance(t[:, layer], num_redundant, ep) for layer in range(t.shape[1])]
