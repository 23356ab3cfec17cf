"""DeepSeek-V4 forward: embedding → n mHC streams → blocks (attention + MoE) → HC head → norm → head; MTP block.

The full-sequence forward (positions 0..S−1, no cache) is the reference path that cached and paged paths are tested
against. Everything here is a pure function of ``(params, token_ids)`` with the config and options static.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from dinfer_jax.models.attention import RopeTable, attention_full, rope_tables
from dinfer_jax.models.config import ATTN_SLIDING, ModelConfig
from dinfer_jax.models.mhc import hc_head, hc_post, hc_pre
from dinfer_jax.models.moe import moe
from dinfer_jax.models.ops import F32, linear, rms_norm
from dinfer_jax.models.qweights import take_rows
from dinfer_jax.models.v41 import forward_v41
from sharding.rules import Sharder, constrain


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Static switches of the forward.

    collect: return per-layer intermediates (hidden streams, indexer picks and scores, router choices).
    moe_impl: ``"ragged"`` (grouped GEMM) or ``"dense"`` (all experts, mesh-friendly); same function.
    sharder: mesh + rules for activation sharding constraints, or None on one device.
    """

    collect: bool = False
    moe_impl: str = "ragged"
    sharder: Sharder | None = None
    yoco: str = "off"  # V4.1 prefill truncation: "off" (exact), "mask", "compact"
    yoco_keep: int = 140  # rows kept from the first ratio-1 layer on; must cover window + backtracking


class ForwardOutput(NamedTuple):
    """logits ``[B,S,V]`` fp32; intermediates (empty unless ``collect``):

    ``hidden_states`` ``[L+1, B,S,n,D]`` (embedding streams, then after each block), ``final_hidden``
    ``[B,S,D]`` (after HC head and norm), ``indexer_topk[l]`` ``[B,S,k]`` int32 (−1 = none),
    ``indexer_scores[l]`` ``[B,S,T]``, ``router_indices[l]`` / ``router_weights[l]`` ``[B,S,k]``.
    """

    logits: jax.Array
    intermediates: dict[str, Any]


def block_forward(p: Mapping[str, Any], streams: jax.Array, token_ids: jax.Array, *, cfg: ModelConfig, kind: str,
                  ratio: int, hash_routed: bool, ropes: Mapping[str, tuple[Any, RopeTable]],
                  options: ForwardOptions) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One V4 block on streams ``[B,S,n,D]``: mHC site → attention, mHC site → MoE. Returns new streams and aux."""
    hc_kw = dict(hc_mult=cfg.hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    inv, table = ropes["main" if kind == ATTN_SLIDING else "compress"]

    u, post, comb = hc_pre(streams, p["hc_attn"], **hc_kw)
    a, aux = attention_full(p["attn"], rms_norm(u, p["attn_norm"], cfg.norm_eps), cfg=cfg, kind=kind, ratio=ratio,
                            rope=table, inv_freq=inv, sharder=options.sharder)
    streams = hc_post(streams, a, post, comb)
    streams = constrain(options.sharder, streams, ("act_batch", "act_seq", None, None))

    u, post, comb = hc_pre(streams, p["hc_ffn"], **hc_kw)
    m, moe_aux = moe(p["ffn"], rms_norm(u, p["ffn_norm"], cfg.norm_eps), token_ids, cfg=cfg,
                     hash_routed=hash_routed, impl=options.moe_impl, sharder=options.sharder)
    streams = hc_post(streams, m, post, comb)
    streams = constrain(options.sharder, streams, ("act_batch", "act_seq", None, None))
    aux.update(moe_aux)
    return streams, aux


def logits_head(params: Mapping[str, Any], head_params: Mapping[str, Any], norm_w: jax.Array, streams: jax.Array,
                cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """HC head collapse, final RMSNorm and the vocabulary head, all in fp32. Returns ``(logits, normed hidden)``."""
    h = hc_head(streams, head_params, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    h = rms_norm(h, norm_w, cfg.norm_eps, out_dtype=F32)
    return linear(h, params["head"]), h


def forward(params: Mapping[str, Any], token_ids: jax.Array, *, cfg: ModelConfig, dtype: str = "float32",
            options: ForwardOptions = ForwardOptions(), engram_emb: jax.Array | None = None,
            image_embeds: jax.Array | None = None, image_mask: jax.Array | None = None) -> ForwardOutput:
    """Full-sequence forward from position 0. token_ids: ``[B,S]`` int. Activations in ``dtype``.

    V4.1 only: ``engram_emb`` ``[n_engram_layers,B,S,E_in]`` (host-gathered Engram rows), ``image_embeds``
    ``[B,S,D]`` + ``image_mask`` ``[B,S]``. V4.1 always returns its ``positions`` (and ``dspark_features`` when
    the config names DSpark targets) in the intermediates.
    """
    if cfg.is_v41:
        logits, inter = forward_v41(params, token_ids, cfg=cfg, dtype=dtype, options=options, engram_emb=engram_emb,
                                    image_embeds=image_embeds, image_mask=image_mask)
        return ForwardOutput(logits, inter)
    dt = jnp.dtype(dtype)
    B, S = token_ids.shape
    ropes = rope_tables(cfg, jnp.arange(S))
    x = take_rows(params["embed"], token_ids, dt)
    streams = jnp.broadcast_to(x[:, :, None, :], (B, S, cfg.hc_mult, cfg.hidden_size))
    streams = constrain(options.sharder, streams, ("act_batch", "act_seq", None, None))
    hidden = [streams]
    inter: dict[str, Any] = {"indexer_topk": {}, "indexer_scores": {}, "router_indices": {}, "router_weights": {}}
    for i, lp in enumerate(params["layers"]):
        streams, aux = block_forward(lp, streams, token_ids, cfg=cfg, kind=cfg.attn_kinds[i],
                                     ratio=cfg.compress_ratios[i], hash_routed=cfg.hash_layers[i], ropes=ropes,
                                     options=options)
        if options.collect:
            hidden.append(streams)
            for key, val in aux.items():
                inter[key][i] = val
    logits, h = logits_head(params, params["hc_head"], params["norm"], streams, cfg)
    if not options.collect:
        return ForwardOutput(logits, {})
    inter["hidden_states"] = jnp.stack(hidden)
    inter["final_hidden"] = h
    return ForwardOutput(logits, inter)


def mtp_forward(params: Mapping[str, Any], streams: jax.Array, next_ids: jax.Array, *, cfg: ModelConfig,
                depth: int = 0, dtype: str = "float32",
                options: ForwardOptions = ForwardOptions()) -> tuple[jax.Array, jax.Array]:
    """MTP block ``mtp.{depth}`` (spec §3.10), full sequence from position 0.

    streams: the main model's pre-HC-head streams ``[B,S,n,D]`` (``hidden_states[-1]`` of a collected forward);
    next_ids: ``[B,S]`` the token at position t+1 for each position t. Returns ``(logits [B,S,V] fp32,
    mtp streams [B,S,n,D])``.
    """
    p = params["mtp"][depth]
    dt = jnp.dtype(dtype)
    B, S = next_ids.shape
    ropes = rope_tables(cfg, jnp.arange(S))
    e = rms_norm(take_rows(params["embed"], next_ids, dt), p["enorm"], cfg.norm_eps)
    hn = rms_norm(streams.astype(dt), p["hnorm"], cfg.norm_eps)
    x = linear(e, p["e_proj"])[:, :, None, :] + linear(hn, p["h_proj"])
    x, _ = block_forward(p, x.astype(dt), next_ids, cfg=cfg, kind=ATTN_SLIDING, ratio=0, hash_routed=False,
                         ropes=ropes, options=options)
    logits, _ = logits_head(params, p["hc_head"], p["norm"], x, cfg)
    return logits, x


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
