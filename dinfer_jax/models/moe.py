"""V4 mixture of experts (spec ``docs/spec/model-v4.md`` §3.8): sqrtsoftplus router, selection-only bias, hash routing,
renormalised and scaled weights, SwiGLU with clamp, shared expert.

Expert implementations of the same function:

* ``"ragged"``: tokens sorted by expert, grouped GEMM with ``jax.lax.ragged_dot``; work ∝ tokens·k. On the CPU
  backend, whose ``ragged_dot`` is expanded into a product over every expert anyway, the rows instead go through
  one masked batched GEMM per projection (:func:`~dinfer_jax.models.expert_ffn.masked_expert_ffn`).
* ``"pallas"``: the Mosaic GPU kernel of ``pallas_kernels.moe`` (MXFP4 experts, bf16 activations, GPU only).
* ``"auto"`` (default): ``"pallas"`` where it can run (see :func:`pallas_supported`), else ``"ragged"``.
* batch-invariant tracing (:mod:`dinfer_jax.models.invariant`) replaces ``"auto"``/``"ragged"``/``"dense"``/``"pallas"``
  by ``"dense"`` over fixed tiles of tokens.
* ``"dense"``: every expert on every token, combined with a dense ``[N, E]`` weight matrix; work ∝ tokens·E. With
  experts sharded over the ``ep`` mesh axis each device computes its own experts and XLA reduces the sum; this is
  the mesh-friendly reference.
* ``"ep"``, ``"ep_allgather"``, ``"ep_alltoall"`` (need a sharder): expert parallelism under ``shard_map``
  (:mod:`dinfer_jax.models.expert_parallel`): tokens dispatched to the EP ranks holding their experts, the grouped
  GEMM on each rank's own experts, the k outputs combined on the token's rank; ``"ep"`` picks the dispatch by
  measurement (all-gather while lossless). With an :class:`~dinfer_jax.models.eplb.ExpertMap` the experts are in
  EPLB's physical-slot layout.

``"ragged"`` and the EP paths sum a token's k expert outputs in choice order; they differ only by the fp32
rounding of GEMMs of different shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.eplb import ExpertMap
from dinfer_jax.models.expert_ffn import combine_choices, expert_rows_ffn, grouped_expert_ffn, swiglu
from dinfer_jax.models.expert_kernel import experts_kernel

# why the expert kernel cannot run (None when it can); the name the MoE switch and its tests use
from dinfer_jax.models.expert_kernel import kernel_unsupported as pallas_supported
from dinfer_jax.models.expert_parallel import ep_experts, ep_experts_manual
from dinfer_jax.models.invariant import active_tile, invariant_tracing, token_tiled
from dinfer_jax.models.ops import F32, linear, linear_f32, matmul
from dinfer_jax.models.qweights import QuantizedWeight, as_dense
from sharding.rules import Sharder, constrain

EP_IMPLS = {"ep": "auto", "ep_allgather": "allgather", "ep_alltoall": "alltoall"}
MOE_IMPLS = ("auto", "ragged", "dense", "pallas", *EP_IMPLS)
__all__ = ["EP_IMPLS", "MOE_IMPLS", "grouped_expert_ffn", "moe", "pallas_supported", "route", "shared_expert"]
Weight = jax.Array | QuantizedWeight


def route(gate: Mapping[str, jax.Array], x: jax.Array, token_ids: jax.Array | None, *, cfg: ModelConfig,
          hash_routed: bool, top_k: int | None = None,
          image_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router in fp32. x: ``[N,D]``; token_ids: ``[N]`` (hash layers); image_mask ``[N]`` bool selects V4.1's
    ``bias_vl``. Returns ``(indices [N,k] int32, weights [N,k] fp32)``; weights are renormalised over the k picks
    and multiplied by ``routed_scaling_factor``. Selection ties go to the lowest expert index."""
    logits = linear_f32(x, gate["weight"])
    if cfg.gate_temp != 1.0:
        logits = logits / cfg.gate_temp
    scores = jnp.sqrt(jax.nn.softplus(logits))
    if hash_routed:
        if token_ids is None:
            raise ValueError("hash-routed MoE layer needs the token ids")
        idx = gate["tid2eid"][token_ids].astype(jnp.int32)
    else:
        bias = gate["bias"].astype(F32)
        if image_mask is not None and "bias_vl" in gate:
            bias = jnp.where(image_mask[:, None], gate["bias_vl"].astype(F32)[None, :], bias[None, :])
        _, idx = jax.lax.top_k(scores + bias, top_k or cfg.n_activated_experts)
        idx = idx.astype(jnp.int32)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    w = w / jnp.sum(w, axis=-1, keepdims=True) * cfg.route_scale
    return idx, w


def _experts_dense(ex: Mapping[str, Weight], x: jax.Array, idx: jax.Array, w: jax.Array, *, cfg: ModelConfig,
                   sharder: Sharder | None) -> jax.Array:
    N = x.shape[0]
    dt = x.dtype
    combine = jnp.zeros((N, ex["w1"].shape[0]), F32).at[jnp.arange(N)[:, None], idx].add(w)
    combine = constrain(sharder, combine, (None, "act_experts"))
    g = matmul("nd,eid->nei", x, as_dense(ex["w1"], dt))
    u = matmul("nd,eid->nei", x, as_dense(ex["w3"], dt))
    a = (swiglu(g, u, cfg.swiglu_limit) * combine[..., None]).astype(dt)
    a = constrain(sharder, a, (None, "act_experts", None))
    return matmul("nei,edi->nd", a, as_dense(ex["w2"], dt))


def _experts_ragged(ex: Mapping[str, Weight], x: jax.Array, idx: jax.Array, w: jax.Array, *,
                    cfg: ModelConfig) -> jax.Array:
    """Every (token, choice) row through the grouped GEMM on this device, then the k outputs of a token summed in
    choice order (:func:`~dinfer_jax.models.expert_ffn.combine_choices`). fp32 ``[N, D]``."""
    N, k = idx.shape
    rows = expert_rows_ffn(ex, jnp.repeat(x, k, axis=0), idx.reshape(-1), w.reshape(-1),
                           swiglu_limit=cfg.swiglu_limit)
    return combine_choices(rows.reshape(N, k, -1))


def shared_expert(p: Mapping[str, jax.Array], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Always-on expert with the same clamp; fp32 result ``[N,D]``."""
    a = swiglu(linear(x, p["w1"], F32), linear(x, p["w3"], F32), cfg.swiglu_limit).astype(x.dtype)
    return linear(a, p["w2"], F32)


def moe(p: Mapping[str, Any], x: jax.Array, token_ids: jax.Array | None, *, cfg: ModelConfig, hash_routed: bool,
        impl: str = "auto", sharder: Sharder | None = None, top_k: int | None = None,
        image_mask: jax.Array | None = None,
        expert_map: ExpertMap | None = None, ep_manual: int = 0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """MoE sublayer. x: ``[B,S,D]`` (normalised), token_ids ``[B,S]``, image_mask ``[B,S]`` bool (V4.1).
    ``expert_map`` (EP impls only): EPLB placement tables, ``p["experts"]`` then in its physical-slot layout.
    ``ep_manual`` (EP impls only): the EP group size when the caller already runs per device inside a
    ``shard_map`` over the mesh (``p["experts"]`` are then this rank's slots; no sharder needed).
    Returns ``(y [B,S,D] in x's dtype, aux)``, aux = ``{"router_indices": [B,S,k] int32,
    "router_weights": [B,S,k] fp32}`` (logical expert ids)."""
    B, S, D = x.shape
    xf = x.reshape(B * S, D)
    tid = None if token_ids is None else token_ids.reshape(B * S)
    img = None if image_mask is None else image_mask.reshape(B * S)
    idx, w = route(p["gate"], xf, tid, cfg=cfg, hash_routed=hash_routed, top_k=top_k, image_mask=img)
    if invariant_tracing() and impl not in EP_IMPLS and expert_map is None:
        # batch-invariant: every expert on a fixed tile of tokens (work ∝ tokens · E), so a token's expert rows never
        # depend on how many other tokens chose the same expert (the grouped GEMMs' shapes do)
        impl = "invariant"
    elif impl == "auto":
        impl = "pallas" if pallas_supported(p["experts"], xf.dtype) is None else "ragged"
    if expert_map is not None and impl not in EP_IMPLS:
        raise ValueError(f"an EPLB expert map needs an expert-parallel moe_impl ({tuple(EP_IMPLS)}), got {impl!r}")
    if impl in EP_IMPLS and ep_manual:
        # already per device inside a shard_map over the mesh (DP engines): EP collectives run directly
        y = ep_experts_manual(p["experts"], xf, idx, w, ep=ep_manual, swiglu_limit=cfg.swiglu_limit,
                              expert_map=expert_map, dispatch=EP_IMPLS[impl])
    elif impl in EP_IMPLS:
        if sharder is None:
            raise ValueError(f"moe_impl={impl!r} needs a mesh (a Sharder)")
        k = idx.shape[-1]
        y, _ = ep_experts(p["experts"], xf.reshape(B, S, D), idx.reshape(B, S, k), w.reshape(B, S, k),
                          mesh=sharder.mesh, token_spec=sharder.spec(("act_batch", "act_seq"), (B, S)),
                          swiglu_limit=cfg.swiglu_limit, expert_map=expert_map, dispatch=EP_IMPLS[impl])
        y = y.reshape(B * S, D)
    elif impl == "dense":
        y = _experts_dense(p["experts"], xf, idx, w, cfg=cfg, sharder=sharder)
    elif impl == "invariant":
        def dense(x: jax.Array, i: jax.Array, r: jax.Array) -> jax.Array:
            return _experts_dense(p["experts"], x, i, r, cfg=cfg, sharder=None)

        # over fixed token tiles, unless already inside a tile's body (a layer's per-token segment)
        y = token_tiled(dense, xf, idx, w, lead=1) if active_tile() else dense(xf, idx, w)
    elif impl == "pallas":
        y = experts_kernel(p["experts"], xf, idx, w, swiglu_limit=cfg.swiglu_limit)
    elif impl == "ragged":
        y = _experts_ragged(p["experts"], xf, idx, w, cfg=cfg)
    else:
        raise ValueError(f"unknown MoE implementation {impl!r}; choose one of {MOE_IMPLS}")
    if "shared_experts" in p:
        y = y + shared_expert(p["shared_experts"], xf, cfg)
    aux = {"router_indices": idx.reshape(B, S, -1), "router_weights": w.reshape(B, S, -1)}
    return y.reshape(B, S, D).astype(x.dtype), aux
