"""Expert parallelism (``docs/spec/engine.md`` §10): routed experts split over the EP group under ``jax.shard_map``.

Each EP rank holds ``L = P / ep`` consecutive physical expert slots (``P = E`` without EPLB, ``E + R`` with
``R`` redundant replicas, see :mod:`dinfer_jax.models.eplb`) and its own tokens (the model's ``act_batch`` /
``act_seq`` split). Per layer, inside one ``shard_map`` over the whole mesh:

1. every (token, choice) row gets its physical slot from the logical expert (replica choice
   :func:`~dinfer_jax.models.eplb.physical_slots`); slot ``s`` lives on EP rank ``s // L`` as local slot ``s % L``;
2. *dispatch* brings each row to the rank holding its slot:

   * ``"allgather"``: every rank gathers all tokens, slots and router weights of its EP group and computes the rows
     whose slot it holds (the others are exact zeros); a ``psum_scatter`` over the group returns each rank's rows
     ``[n, k, D]`` (one non-zero term per row, so the sum is exact);
   * ``"alltoall"``: each rank packs its rows per destination rank into a fixed buffer ``[ep, C, D]`` (``C`` =
     ``capacity``, default ``n·k``: no row can overflow), ``all_to_all`` sends them, the expert rows come back with
     a second ``all_to_all``. A smaller ``capacity`` drops the rows beyond it (counted, contributing 0).
     (``jax.lax.ragged_all_to_all`` would send only the real rows, but XLA:CPU does not implement it in jax 0.10.2:
     ``UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter``.)

3. the local experts run on the rows they received: the Mosaic GPU expert kernel where it can run
   (:func:`~dinfer_jax.models.expert_kernel.expert_choices_kernel`: pairs of other ranks marked ``L`` take no
   tile), else :func:`~dinfer_jax.models.expert_ffn.expert_rows_ffn` (``ragged_dot``);
4. *combine*: each token's ``k`` outputs are summed in choice order ``0..k−1``
   (:func:`~dinfer_jax.models.expert_ffn.combine_choices`) on the token's own rank, in fp32.

A row is computed by exactly one replica, and the combine order does not depend on which rank or slot computed
it, so the output does not depend on the placement (a rebalance leaves it bit-identical) as long as the grouped
GEMM gives a row the same bits wherever it sits among the rows of one shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from dinfer_jax.models.eplb import ExpertMap, identity_map, physical_slots
from dinfer_jax.models.expert_ffn import combine_choices, expert_rows_ffn
from dinfer_jax.models.expert_kernel import expert_choices_kernel, kernel_unsupported
from dinfer_jax.models.ops import F32
from sharding.mesh import GROUP_AXES, MESH_AXES

DISPATCHES = ("allgather", "alltoall")
EXPERT_IMPLS = ("auto", "pallas", "jnp")


def pick_dispatch(capacity: int | None) -> str:
    """The dispatch ``"auto"`` uses. Lossless (``capacity`` None), both dispatches run the same GEMM rows
    (``ep·n·k``) and all-gather moves fewer bytes (each token once, not k times); measured on 8 CPU devices at
    8–4096 tokens per EP group (``scripts/bench_ep.py``, docs/expert_parallel.md) they are within noise of each
    other, so ``"auto"`` takes all-gather. With a bounded ``capacity`` only all-to-all gets smaller (and can drop
    rows), so a given capacity selects it."""
    return "allgather" if capacity is None else "alltoall"


def _local_rows(ex: Mapping[str, Any], x: jax.Array, slots: jax.Array, w: jax.Array, *, swiglu_limit: float,
                ep: int, expert_impl: str) -> jax.Array:
    """This rank's weighted expert outputs of every (token, choice) pair it received: ``x [N, D]``, ``slots
    [N, k]`` in ``[0, L]`` (``L``: computed elsewhere), ``w [N, k]`` fp32 → ``[N, k, D]`` fp32, zero where
    ``slots == L``. ``expert_impl``: ``"pallas"`` (the Mosaic GPU kernel, ``dinfer_jax/models/expert_kernel.py``),
    ``"jnp"`` (the grouped GEMM of :func:`expert_rows_ffn`) or ``"auto"`` (the kernel where it can run)."""
    if expert_impl not in EXPERT_IMPLS:
        raise ValueError(f"unknown expert implementation {expert_impl!r}; choose one of {EXPERT_IMPLS}")
    if expert_impl == "pallas" or (expert_impl == "auto" and kernel_unsupported(ex, x.dtype) is None):
        return expert_choices_kernel(ex, x, slots, w, swiglu_limit=swiglu_limit, ep=ep)
    n, k = slots.shape
    rows = expert_rows_ffn(ex, jnp.repeat(x, k, axis=0), slots.reshape(-1), w.reshape(-1), swiglu_limit=swiglu_limit)
    return rows.reshape(n, k, -1)


def _allgather(ex: Mapping[str, Any], x: jax.Array, slot: jax.Array, w: jax.Array, *, axes: tuple[str, ...],
               ep: int, swiglu_limit: float, expert_impl: str) -> tuple[jax.Array, jax.Array]:
    n, k = slot.shape
    L = ex["w1"].shape[0]
    rank = jax.lax.axis_index(axes)
    gather = partial(jax.lax.all_gather, axis_name=axes, axis=0, tiled=True)
    xs, slots, ws = gather(x), gather(slot), gather(w)                      # [ep·n, D], [ep·n, k], [ep·n, k]
    local = jnp.where(slots // L == rank, slots % L, L)
    rows = _local_rows(ex, xs, local, ws, swiglu_limit=swiglu_limit, ep=ep, expert_impl=expert_impl)
    y = jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)  # [n, k, D]
    return y, jnp.zeros((), jnp.int32)


def _alltoall(ex: Mapping[str, Any], x: jax.Array, slot: jax.Array, w: jax.Array, *, axes: tuple[str, ...],
              ep: int, swiglu_limit: float, capacity: int | None, expert_impl: str) -> tuple[jax.Array, jax.Array]:
    n, k = slot.shape
    D = x.shape[-1]
    L = ex["w1"].shape[0]
    C = capacity or n * k
    flat = slot.reshape(-1)
    dest, lslot = flat // L, flat % L
    # Position of each row in its destination's block: rows to one rank keep their (token, choice) order.
    pos = jnp.take_along_axis(jnp.cumsum(dest[:, None] == jnp.arange(ep)[None, :], axis=0, dtype=jnp.int32),
                              dest[:, None], axis=1)[:, 0] - 1
    keep = pos < C
    at = (dest, jnp.where(keep, pos, C))                                   # column C is out of range: dropped
    send_x = jnp.zeros((ep, C, D), x.dtype).at[at].set(jnp.repeat(x, k, axis=0), mode="drop")
    send_s = jnp.full((ep, C), L, jnp.int32).at[at].set(lslot, mode="drop")
    send_w = jnp.zeros((ep, C), F32).at[at].set(w.reshape(-1), mode="drop")
    a2a = partial(jax.lax.all_to_all, axis_name=axes, split_axis=0, concat_axis=0, tiled=True)
    recv_x, recv_s, recv_w = a2a(send_x), a2a(send_s), a2a(send_w)         # block s = rows from rank s
    rows = _local_rows(ex, recv_x.reshape(ep * C, D), recv_s.reshape(-1, 1), recv_w.reshape(-1, 1),
                       swiglu_limit=swiglu_limit, ep=ep, expert_impl=expert_impl)
    back = a2a(rows.reshape(ep, C, D))                                    # block d = my rows computed on rank d
    y = jnp.where(keep[:, None], back[dest, jnp.minimum(pos, C - 1)], 0.0)
    return y.reshape(n, k, D), jnp.sum(~keep).astype(jnp.int32)


def _ep_local(ex: Mapping[str, Any], emap: ExpertMap, x: jax.Array, idx: jax.Array, w: jax.Array, *, ep: int,
              dispatch: str, capacity: int | None, swiglu_limit: float,
              expert_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """One rank's part of the EP layer (inside a ``shard_map`` whose EP axes are manual): its tokens ``[*T, D]``
    in, their combined expert outputs ``[*T, D]`` fp32 and the dropped-row count out."""
    axes = GROUP_AXES["ep"]
    lead, D, k = x.shape[:-1], x.shape[-1], idx.shape[-1]
    x, idx, w = x.reshape(-1, D), idx.reshape(-1, k), w.reshape(-1, k).astype(F32)
    slot = physical_slots(emap, idx, jax.lax.axis_index(axes))
    if dispatch == "allgather":
        y, dropped = _allgather(ex, x, slot, w, axes=axes, ep=ep, swiglu_limit=swiglu_limit, expert_impl=expert_impl)
    else:
        y, dropped = _alltoall(ex, x, slot, w, axes=axes, ep=ep, swiglu_limit=swiglu_limit, capacity=capacity,
                               expert_impl=expert_impl)
    return combine_choices(y).reshape(*lead, D), dropped


def ep_experts_manual(experts: Mapping[str, Any], x: jax.Array, idx: jax.Array, w: jax.Array, *, ep: int,
                      swiglu_limit: float, expert_map: ExpertMap | None = None, dispatch: str = "auto",
                      capacity: int | None = None, expert_impl: str = "auto") -> jax.Array:
    """:func:`ep_experts` for code that already runs per device inside a ``shard_map`` over the whole mesh (the
    DP engines' step, :mod:`dinfer_jax.engine.dp_runner`): ``experts`` are this rank's ``L = P / ep`` slots,
    ``x``/``idx``/``w`` its own tokens; the collectives run over the EP axes directly. Returns ``y [*T, D]`` fp32.
    """
    L = experts["w1"].shape[0]
    emap = identity_map(L * ep) if expert_map is None else expert_map
    E, width = emap.logical_to_physical.shape
    if E + width - 1 != L * ep:
        raise ValueError(f"expert map describes E + R = {E + width - 1} slots, the EP group holds {L}·{ep}")
    if dispatch == "auto":
        dispatch = pick_dispatch(capacity)
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown EP dispatch {dispatch!r}; choose one of {DISPATCHES} or 'auto'")
    y, _ = _ep_local(experts, emap, x, idx, w, ep=ep, dispatch=dispatch, capacity=capacity,
                     swiglu_limit=swiglu_limit, expert_impl=expert_impl)
    return y


def ep_experts(experts: Mapping[str, Any], x: jax.Array, idx: jax.Array, w: jax.Array, *, mesh: Mesh,
               token_spec: PartitionSpec, swiglu_limit: float, expert_map: ExpertMap | None = None,
               dispatch: str = "auto", capacity: int | None = None,
               expert_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Routed experts over the EP group of ``mesh`` (axes ``GROUP_AXES["ep"]``).

    experts: ``w1``/``w3`` ``[P, I, D]``, ``w2`` ``[P, D, I]`` in physical-slot order (dense or
    :class:`~dinfer_jax.models.qweights.QuantizedWeight`), split along ``P`` over the EP axes. x ``[*T, D]``
    (activation dtype), idx ``[*T, k]`` int32 logical experts, w ``[*T, k]`` fp32 router weights, all with leading
    token dims ``T`` laid out by ``token_spec`` (a PartitionSpec of ``len(T)`` entries). expert_map: the
    placement's tables (None: identity, ``P = E``). dispatch: ``"allgather"``, ``"alltoall"`` or ``"auto"``
    (:func:`pick_dispatch`). capacity: all-to-all rows per (source, destination)
    pair (None: ``n·k``, lossless). expert_impl: how a rank computes its rows — ``"pallas"`` (the Mosaic GPU
    kernel), ``"jnp"`` (``ragged_dot``) or ``"auto"`` (the kernel where it can run: a GPU, bf16, MXFP4 experts).

    Returns ``(y [*T, D] fp32, dropped [devices] int32)``: dropped = rows each device could not send (always 0 for
    all-gather and the default capacity). Raises ValueError when ``ep`` does not divide ``P`` or the map and the
    weights disagree on ``P``.
    """
    axes = GROUP_AXES["ep"]
    ep = math.prod(mesh.shape[a] for a in axes)
    P = experts["w1"].shape[0]
    if P % ep:
        raise ValueError(f"{P} expert slots cannot be split over an EP group of {ep} ranks")
    emap = identity_map(P) if expert_map is None else expert_map
    E, width = emap.logical_to_physical.shape
    if E + width - 1 != P:
        raise ValueError(f"expert map describes {E} experts with up to {width - 1} redundant replicas each "
                         f"(E + R = {E + width - 1} slots), the expert weights have {P} slots")
    if len(token_spec) != x.ndim - 1:
        raise ValueError(f"token_spec {token_spec} must have one entry per token dim of x {x.shape}")
    if dispatch == "auto":
        dispatch = pick_dispatch(capacity)
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown EP dispatch {dispatch!r}; choose one of {DISPATCHES} or 'auto'")

    def body(ex: Mapping[str, Any], emap: ExpertMap, x: jax.Array, idx: jax.Array,
             w: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, dropped = _ep_local(ex, emap, x, idx, w, ep=ep, dispatch=dispatch, capacity=capacity,
                               swiglu_limit=swiglu_limit, expert_impl=expert_impl)
        return y, dropped[None]

    tok = PartitionSpec(*token_spec, None)
    # check_vma=False: where the tokens are not split over an EP axis (too few to divide), every rank on it holds
    # and computes the same tokens, and the output spec takes any one copy; the copies are equal (see above).
    fn = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(axes), PartitionSpec(), tok, tok, tok),
                       out_specs=(tok, PartitionSpec(MESH_AXES)), check_vma=False)
    return fn(experts, emap, x, idx, w)
