"""DeepSeek-V4 forward: embedding → n mHC streams → blocks (attention + MoE) → HC head → norm → head; MTP block.

The full-sequence forward (positions 0..S−1) is the serving step's layer scan on a fresh cache (one implementation of
the layer math, :mod:`dinfer_jax.models.layers`). Everything here is a pure function of ``(params, token_ids)`` with
the config and options static.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dinfer_jax.models.backbone import head_logits, rope_for, run_backbone
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.layer_plan import SLIDING_INFO
from dinfer_jax.models.layers import LayerOptions, StepContext, layer_v4
from dinfer_jax.models.ops import F32, linear, rms_norm
from dinfer_jax.models.qweights import take_rows
from dinfer_jax.models.step_state import (
    CacheConfig,
    ModelCache,
    StepInput,
    cache_shapes,
    single_layer_cache,
    zeros_like_shapes,
)
from dinfer_jax.models.v41 import YOCO_MODES, embed_tokens
from sharding.rules import Sharder


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Static switches of the forward.

    collect: return per-layer intermediates (hidden streams, indexer picks and scores, router choices).
    moe_impl: ``"auto"`` (the GPU kernel where it can run, else ``"ragged"``), ``"ragged"`` (grouped GEMM),
      ``"pallas"`` (GPU kernel), ``"dense"`` (all experts, mesh-friendly) or ``"ep"`` / ``"ep_allgather"`` /
      ``"ep_alltoall"`` (expert parallelism over the mesh's EP group, needs ``sharder``); same function.
    sharder: mesh + rules for activation sharding constraints, or None on one device.
    """

    collect: bool = False
    moe_impl: str = "auto"
    sharder: Sharder | None = None
    yoco: str = "off"  # V4.1 prefill truncation: "off" (exact), "mask", "compact"
    yoco_keep: int = 140  # rows kept from the first ratio-1 layer on; must cover window + backtracking
    attention: str = "auto"  # compressed rows: "auto" / "sparse" (gather each query's top-k) / "dense" (mask all)
    mhc_impl: str = "auto"  # the mHC Sinkhorn: "auto", "jnp" (XLA) or "pallas" (Mosaic GPU kernel; mhc.sinkhorn)


class ForwardOutput(NamedTuple):
    """logits ``[B,S,V]`` fp32; intermediates (empty unless ``collect``):

    ``hidden_states`` ``[L+1, B,S,n,D]`` (embedding streams, then after each block), ``final_hidden``
    ``[B,S,D]`` (after HC head and norm), ``indexer_topk[l]`` ``[B,S,k]`` int32 (−1 = none),
    ``indexer_scores[l]`` ``[B,S,T]``, ``router_indices[l]`` / ``router_weights[l]`` ``[B,S,k]``.
    """

    logits: jax.Array
    intermediates: dict[str, Any]


def _forward_cache(cfg: ModelConfig, B: int, S: int, dtype: str) -> tuple[ModelCache, jax.Array]:
    """A fresh cache for ``B`` sequences of ``S`` tokens from position 0 (slot b+1, one page b+1 each holding
    every compressed row) and the page table ``[B,1]``."""
    ratios = [r for r in cfg.compress_ratios if r] or [1]
    unit = math.lcm(*ratios)
    cc = CacheConfig(num_slots=B + 1, num_blocks=B + 1, block_size=max(unit, -(-S // unit) * unit))
    return zeros_like_shapes(cache_shapes(cfg, cc, dtype)), jnp.arange(1, B + 1, dtype=jnp.int32)[:, None]


def _collect(cfg: ModelConfig, S: int, per_layer: list[dict[str, jax.Array]], embed_carry: Any) -> dict[str, Any]:
    """Per-layer intermediates in the forward's documented layout. The cache pages of a full forward hold
    ``block_size // ratio ≥ S // ratio`` rows; indexer outputs are cut back to the ``S // ratio`` real ones."""
    keys = ["indexer_topk", "indexer_scores", "router_indices", "router_weights"]
    if cfg.is_v41:
        keys.append("candidate_blocks")
    inter: dict[str, Any] = {k: {} for k in keys}
    for layer, aux in enumerate(per_layer):
        T = S // cfg.compress_ratios[layer] if cfg.compress_ratios[layer] else 0
        for key in keys:
            if key not in aux:
                continue
            v = aux[key]
            if key == "indexer_scores":
                if T == 0:
                    continue
                v = v[..., :T]
            elif key == "indexer_topk":
                if T == 0:
                    continue
                v = v[..., :min(cfg.index_topk, T)]
            inter[key][layer] = v
    inter["hidden_states"] = jnp.stack([embed_carry["streams"]] + [a["hidden_states"] for a in per_layer])
    if cfg.is_v41:
        inter["premix"] = jnp.stack([embed_carry["premix"]] + [a["premix"] for a in per_layer])
    return inter


def forward(params: Mapping[str, Any], token_ids: jax.Array, *, cfg: ModelConfig, dtype: str = "float32",
            options: ForwardOptions = ForwardOptions(), engram_emb: jax.Array | None = None,
            image_embeds: jax.Array | None = None, image_mask: jax.Array | None = None) -> ForwardOutput:
    """Full-sequence forward from position 0. token_ids: ``[B,S]`` int. Activations in ``dtype``.

    The serving step's layers on a fresh cache (every row starts at position 0), so the reference forward and the
    cached step share one implementation. ``params["layers"]`` may be in checkpoint layout (stacked here, a copy
    of the layer weights per call) or already stacked (:func:`layer_plan.stack_params`).

    V4.1 only: ``engram_emb`` ``[n_engram_layers,B,S,E_in]`` (host-gathered Engram rows), ``image_embeds``
    ``[B,S,D]`` + ``image_mask`` ``[B,S]``, ``options.yoco``: "off" (exact), "mask" (from the first ratio-1 layer
    on, window keys before the last ``yoco_keep`` rows are hidden) or "compact" (the mask result, logits of the
    kept rows only). V4.1 always returns its ``positions`` (and ``dspark_features`` when the config names DSpark
    targets) in the intermediates.
    """
    dt = jnp.dtype(dtype)
    B, S = token_ids.shape
    mode, keep = options.yoco, options.yoco_keep
    if mode not in YOCO_MODES:
        raise ValueError(f"yoco mode must be one of {YOCO_MODES}, got {mode!r}")
    truncate = cfg.is_v41 and mode != "off" and S > keep
    cache, pages = _forward_cache(cfg, B, S, dtype)
    full = jnp.full((B,), S, jnp.int32)
    inp = StepInput(tokens=token_ids.astype(jnp.int32), start=jnp.zeros((B,), jnp.int32), n=full,
                    slot=pages[:, 0], pages=pages, last=full - 1, image_embeds=image_embeds, image_mask=image_mask,
                    window_floor=jnp.full((B,), S - keep, jnp.int32) if truncate else None)
    opts = LayerOptions(moe_impl=options.moe_impl, sharder=options.sharder, collect=options.collect,
                        attention=options.attention, mhc_impl=options.mhc_impl)
    embed_carry = None
    if options.collect:
        x = embed_tokens(params, inp.tokens, dt, image_embeds, image_mask)
        embed_carry = {"streams": jnp.broadcast_to(x[:, :, None, :], (B, S, cfg.hc_mult, cfg.hidden_size)),
                       "premix": jnp.broadcast_to(jax.nn.one_hot(0, cfg.hc_mult, dtype=F32), (B, S, cfg.hc_mult))}
    carry, _, per_layer = run_backbone(params, cache, inp, cfg=cfg, dtype=dtype, opts=opts, engram=engram_emb)
    logits, h = head_logits(params, carry, cfg)
    inter: dict[str, Any] = {}
    if options.collect:
        inter = _collect(cfg, S, per_layer, embed_carry)
        inter["final_hidden"] = h
    if not cfg.is_v41:
        return ForwardOutput(logits, inter)
    pos = jnp.arange(S)
    targets = [a["dspark_feature"] for a in per_layer if "dspark_feature" in a]
    if targets:
        inter["dspark_features"] = jnp.concatenate(targets, axis=-1)  # [B,S,n_targets·D]
    if mode == "compact" and truncate:
        rows = slice(S - keep, S)
        logits, pos = logits[:, rows], pos[rows]
        if targets:
            inter["dspark_features"] = inter["dspark_features"][:, rows]
        if options.collect:
            inter["final_hidden"] = h[:, rows]
    inter["positions"] = pos
    return ForwardOutput(logits, inter)


def mtp_forward(params: Mapping[str, Any], streams: jax.Array, next_ids: jax.Array, *, cfg: ModelConfig,
                depth: int = 0, dtype: str = "float32",
                options: ForwardOptions = ForwardOptions()) -> tuple[jax.Array, jax.Array]:
    """MTP block ``mtp.{depth}`` (``docs/spec/model-v4.md`` §3.10), full sequence from position 0: a sliding-only V4
    layer
    (:func:`layers.layer_v4` on a fresh cache).

    streams: the main model's pre-HC-head streams ``[B,S,n,D]`` (``hidden_states[-1]`` of a collected forward);
    next_ids: ``[B,S]`` the token at position t+1 for each position t. Returns ``(logits [B,S,V] fp32,
    mtp streams [B,S,n,D])``.
    """
    p = params["mtp"][depth]
    dt = jnp.dtype(dtype)
    B, S = next_ids.shape
    e = rms_norm(take_rows(params["embed"], next_ids, dt), p["enorm"], cfg.norm_eps)
    hn = rms_norm(streams.astype(dt), p["hnorm"], cfg.norm_eps)
    x = (linear(e, p["e_proj"])[:, :, None, :] + linear(hn, p["h_proj"])).astype(dt)
    pages = jnp.arange(1, B + 1, dtype=jnp.int32)[:, None]
    lc = single_layer_cache(cfg, SLIDING_INFO, CacheConfig(B + 1, B + 1, 1), dtype)
    full = jnp.full((B,), S, jnp.int32)
    inp = StepInput(tokens=next_ids.astype(jnp.int32), start=jnp.zeros((B,), jnp.int32), n=full, slot=pages[:, 0],
                    pages=pages, last=full - 1)
    pos = inp.positions()
    ctx = StepContext(inp, pos, rope_for(cfg, pos))
    opts = LayerOptions(moe_impl=options.moe_impl, sharder=options.sharder, mhc_impl=options.mhc_impl)
    carry, _, _ = layer_v4(p, {"streams": x}, lc, jnp.int32(0), jnp.int32(-1), ctx, cfg=cfg, info=SLIDING_INFO,
                           opts=opts)
    logits, _ = head_logits({"hc_head": p["hc_head"], "norm": p["norm"], "head": params["head"]}, carry, cfg)
    return logits, carry["streams"]


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "options"))
def forward_jit(params: Mapping[str, Any], token_ids: jax.Array, *, cfg: ModelConfig, dtype: str = "float32",
                options: ForwardOptions = ForwardOptions(), engram_emb: jax.Array | None = None,
                image_embeds: jax.Array | None = None, image_mask: jax.Array | None = None) -> ForwardOutput:
    """Jitted :func:`forward` (params are an argument, never closed over)."""
    return forward(params, token_ids, cfg=cfg, dtype=dtype, options=options, engram_emb=engram_emb,
                   image_embeds=image_embeds, image_mask=image_mask)


@functools.partial(jax.jit, static_argnames=("cfg", "depth", "dtype", "options"))
def mtp_forward_jit(params: Mapping[str, Any], streams: jax.Array, next_ids: jax.Array, *, cfg: ModelConfig,
                    depth: int = 0, dtype: str = "float32",
                    options: ForwardOptions = ForwardOptions()) -> tuple[jax.Array, jax.Array]:
    return mtp_forward(params, streams, next_ids, cfg=cfg, depth=depth, dtype=dtype, options=options)
