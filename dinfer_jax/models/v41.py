"""DeepSeek-V4.1 forward (``model-v41.md``) on the V4 core: shifted single-pass mHC, CSA2 compressed KV shared
across layers, index keys projected from the compressed latent, candidate two-level top-k, FP8/FP4 KV fake-quant,
Engram, image rows, YOCO bounded replay, and the DSpark drafter's target features.

Full-sequence reference path (positions 0..S−1, no cache). The cross-layer values a source layer publishes
(compressed KV, index keys, top-k selections, candidate blocks) travel in a plain dict within one forward.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dinfer_jax.models.attention import (RopeTable, attend, index_scores, output_projection, query_and_window_kv,
                                         rope_tables, window_mask)
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.csa2 import candidate_blocks, pool_groups, topk_select
from dinfer_jax.models.engram import engram_gate
from dinfer_jax.models.fake_quant import maybe_fake_quant, q4e_fake, q4u_fake, q8_fake
from dinfer_jax.models.mhc import hc_collapse, hc_mixes, hc_post
from dinfer_jax.models.moe import moe
from dinfer_jax.models.ops import F32, apply_rope_tail, linear, rms_norm, rope_cos_sin
from dinfer_jax.models.qweights import take_rows
from sharding.rules import constrain

YOCO_MODES = ("off", "mask", "compact")


def source_rows(p: Mapping[str, Any], latent: jax.Array, positions: jax.Array, *, cfg: ModelConfig, dtype: Any,
                inv_freq: Any, has_index_k: bool) -> tuple[jax.Array, jax.Array | None]:
    """A KV source's compressed KV and index keys from pooled latents ``[B,T,d]`` fp32 at first-token positions
    ``positions`` (``[T]`` or ``[B,T]``): ``L = rms(latent; compressor.norm)``, ``KVc = Q4e(rope(L))``,
    ``Kidx = Q4u(rope(rms(L·wkᵀ; k_norm)))``. Shared by the full forward and the cached step. fp32 out."""
    comp = p["compressor"]
    lat = rms_norm(latent.astype(dtype), comp["norm"], cfg.norm_eps, out_dtype=F32)  # pre-RoPE latent L
    cos, sin = rope_cos_sin(positions, inv_freq)
    kvc = maybe_fake_quant(cfg.kv_fake_quant, q4e_fake, apply_rope_tail(lat, cos, sin), 16)
    kidx = None
    if has_index_k:
        ix = p["indexer"]
        k = rms_norm(linear(lat.astype(dtype), ix["wk"]), ix["k_norm"], cfg.norm_eps, out_dtype=F32)
        kidx = maybe_fake_quant(cfg.kv_fake_quant, q4u_fake, apply_rope_tail(k, cos, sin), 32)
    return kvc, kidx


def compress_source(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig, ratio: int, inv_freq: Any,
                    has_index_k: bool) -> tuple[jax.Array, jax.Array | None]:
    """A KV source's compressed KV and index keys for a sequence from position 0.

    h: ``[B,S,D]`` (the source layer's ``attn_norm`` output). Returns ``(KVc [B,T,d], Kidx [B,T,di] or None)``,
    fp32, T = S // ratio; entry j pools tokens ``[r·j, r·j + r)`` and carries RoPE at position ``r·j``.
    """
    comp = p["compressor"]
    hf = h.astype(F32)
    latent = linear(hf, comp["wkv"])  # [B,S,d]
    if ratio == 2:
        latent = pool_groups(linear(hf, comp["wgate"]), latent, 2)
    else:
        latent = latent[:, : (h.shape[1] // ratio) * ratio]
    return source_rows(p, latent, jnp.arange(latent.shape[1]) * ratio, cfg=cfg, dtype=h.dtype, inv_freq=inv_freq,
                       has_index_k=has_index_k)


def attention_v41(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig, layer: int, rope: RopeTable,
                  inv_freq: Any, shared: dict[str, Any], pos: jax.Array, win_mask: jax.Array,
                  source_input: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One V4.1 attention sublayer for rows at absolute positions ``pos`` ``[S]``.

    h: ``[B,S,D]`` normalised input; win_mask ``[S,S]`` over these rows. ``shared`` carries what source layers
    publish to their consumers (``kv``, ``index_k``, ``selected``, ``candidates``). A KV source compresses
    ``source_input`` (all rows from position 0; YOCO compact passes it when ``h`` holds only the kept rows) or h.
    ``layer`` < 0 is a DSpark draft layer (sliding only). Returns ``(out [B,S,D], aux)``.
    """
    B, S, _ = h.shape
    ratio = cfg.compress_ratios[layer] if layer >= 0 else 0
    cq, q, kv = query_and_window_kv(p, h, cfg=cfg, rope=rope)
    kv = maybe_fake_quant(cfg.kv_fake_quant, q8_fake, kv, 32)
    aux: dict[str, jax.Array] = {}
    ckv = cmask = None
    if ratio > 0:
        if layer in cfg.kv_source_layer_ids:
            has_k = layer in (cfg.index_k_source_layer_ids or cfg.kv_source_layer_ids)
            kvc, kidx = compress_source(p, h if source_input is None else source_input, cfg=cfg, ratio=ratio,
                                        inv_freq=inv_freq, has_index_k=has_k)
            shared["kv"][layer] = kvc.astype(h.dtype)
            if kidx is not None:
                shared["index_k"][layer] = kidx
        ckv = shared["kv"][cfg.kv_source(layer)]
        T = ckv.shape[1]
        visible = jnp.arange(T) < ((pos + 1) // ratio)[..., None]  # [S,T] or [B,S,T]
        cmask = jnp.broadcast_to(visible, (B, S, T))
        if layer in cfg.index_source_layer_ids and T > 0:
            scores = index_scores(p["indexer"], h, cq, shared["index_k"][cfg.index_k_source(layer)], pos, cfg=cfg,
                                  ratio=ratio, rope=rope)
            if layer == cfg.candidate_source_layer_id:
                cand_mask, cand_ids = candidate_blocks(scores, (pos + 1) // ratio, cfg.candidate_block_size,
                                                       cfg.candidate_topk_blocks)
                shared["candidates"] = cand_mask
                aux["candidate_blocks"] = cand_ids
            elif cfg.uses_candidates(layer):
                scores = jnp.where(shared["candidates"], scores, -jnp.inf)
            top_idx, selected = topk_select(scores, cfg.index_topk)
            shared["selected"][layer] = selected
            aux["indexer_topk"] = top_idx
            aux["indexer_scores"] = scores
        if T > 0:
            cmask = cmask & shared["selected"][cfg.index_source(layer)]
    o = attend(q, kv, win_mask, ckv, cmask, p["attn_sink"])
    return output_projection(p, o, cfg=cfg, rope=rope), aux


def _slice_rope(ropes: dict[str, tuple[Any, RopeTable]], start: int) -> dict[str, tuple[Any, RopeTable]]:
    return {k: (inv, RopeTable(t.cos[start:], t.sin[start:])) for k, (inv, t) in ropes.items()}


def block_v41(p: Mapping[str, Any], streams: jax.Array, premix: jax.Array, *, cfg: ModelConfig, layer: int,
              ropes: Mapping[str, tuple[Any, RopeTable]], shared: dict[str, Any], pos: jax.Array,
              win_mask: jax.Array, image_mask: jax.Array | None, engram_emb: jax.Array | None, moe_impl: str,
              sharder: Any = None, top_k: int | None = None,
              source_input: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """One V4.1 block with shifted mHC: ``streams`` ``[B,S,n,D]``, ``premix`` ``[B,S,n]`` (the previous FFN site's
    pre). Returns ``(streams, next premix, aux)``; aux includes ``attn_input_streams`` (for DSpark targets)."""
    hc_kw = dict(hc_mult=cfg.hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    ratio = cfg.compress_ratios[layer] if layer >= 0 else 0
    inv, table = ropes["main" if ratio == 0 else "compress"]
    if "engram" in p:
        streams = engram_gate(streams, engram_emb, p["engram"], norm_eps=cfg.norm_eps, image_mask=image_mask)
    attn_in = streams
    pre_a, post_a, comb_a = hc_mixes(streams, p["hc_attn"], **hc_kw)
    h = rms_norm(hc_collapse(streams, premix), p["attn_norm"], cfg.norm_eps)
    a, aux = attention_v41(p["attn"], h, cfg=cfg, layer=layer, rope=table, inv_freq=inv, shared=shared, pos=pos,
                           win_mask=win_mask, source_input=source_input)
    streams = hc_post(streams, a, post_a, comb_a)
    pre_f, post_f, comb_f = hc_mixes(streams, p["hc_ffn"], **hc_kw)
    x = rms_norm(hc_collapse(streams, pre_a), p["ffn_norm"], cfg.norm_eps)
    m, moe_aux = moe(p["ffn"], x, None, cfg=cfg, hash_routed=False, impl=moe_impl, sharder=sharder, top_k=top_k,
                     image_mask=image_mask)
    streams = hc_post(streams, m, post_f, comb_f)
    streams = constrain(sharder, streams, ("act_batch", "act_seq", None, None))
    aux.update(moe_aux)
    aux["attn_input_streams"] = attn_in
    return streams, pre_f, aux


def embed_tokens(params: Mapping[str, Any], token_ids: jax.Array, dt: jnp.dtype, image_embeds: jax.Array | None,
                 image_mask: jax.Array | None) -> jax.Array:
    """Token embeddings ``[B,S,D]``; ids outside the vocabulary embed to 0 (DeepInfer), image rows take
    ``image_embeds``."""
    V = params["embed"].shape[0]
    inside = (token_ids >= 0) & (token_ids < V)
    x = jnp.where(inside[..., None], take_rows(params["embed"], jnp.clip(token_ids, 0, V - 1), dt), 0).astype(dt)
    if image_mask is not None and image_embeds is not None:
        x = jnp.where(image_mask[..., None], image_embeds.astype(dt), x)
    return x


def forward_v41(params: Mapping[str, Any], token_ids: jax.Array, *, cfg: ModelConfig, dtype: str, options: Any,
                engram_emb: jax.Array | None = None, image_embeds: jax.Array | None = None,
                image_mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """V4.1 full-sequence forward from position 0.

    token_ids ``[B,S]``; engram_emb ``[n_engram_layers, B,S,E_in]`` (host-gathered table rows); image_embeds
    ``[B,S,D]`` and image_mask ``[B,S]`` for image rows. ``options.yoco`` = "off" (exact), "mask" or "compact"
    (keep the last ``options.yoco_keep`` rows from the first ratio-1 layer on; logits only for those rows).
    Returns ``(logits [B,S',V] fp32, intermediates)`` with S' = S, or the kept rows in compact mode.
    """
    dt = jnp.dtype(dtype)
    B, S = token_ids.shape
    n = cfg.hc_mult
    pos = jnp.arange(S)
    ropes = rope_tables(cfg, pos)
    x = embed_tokens(params, token_ids, dt, image_embeds, image_mask)
    streams = jnp.broadcast_to(x[:, :, None, :], (B, S, n, cfg.hidden_size))
    premix = jnp.broadcast_to(jax.nn.one_hot(0, n, dtype=F32), (B, S, n))
    shared: dict[str, Any] = {"kv": {}, "index_k": {}, "selected": {}}
    win = window_mask(S, cfg.sliding_window)
    mode, keep = options.yoco, options.yoco_keep
    if mode not in YOCO_MODES:
        raise ValueError(f"yoco mode must be one of {YOCO_MODES}, got {mode!r}")
    boundary = cfg.n_prefill_layer
    hidden, premixes, inter = [streams], [premix], {k: {} for k in (
        "indexer_topk", "indexer_scores", "router_indices", "router_weights", "candidate_blocks")}
    targets = []
    engram_index = {l: i for i, l in enumerate(cfg.engram_layer_ids)}
    for layer, lp in enumerate(params["layers"]):
        source_input = None
        if layer == boundary and mode != "off" and S > keep:
            start = S - keep
            if mode == "mask":
                win = win & (pos[None, :] >= start)
            else:  # compact: the source still compresses every row; everything else runs on the kept rows
                h_full = rms_norm(hc_collapse(streams, premix), lp["attn_norm"], cfg.norm_eps)
                source_input = h_full
                streams, premix, pos = streams[:, start:], premix[:, start:], pos[start:]
                ropes = _slice_rope(ropes, start)
                win = window_mask(keep, cfg.sliding_window)
                token_ids = token_ids[:, start:]
                image_mask = None if image_mask is None else image_mask[:, start:]
        emb = engram_emb[engram_index[layer]] if layer in engram_index else None
        streams, premix, aux = block_v41(lp, streams, premix, cfg=cfg, layer=layer, ropes=ropes, shared=shared,
                                         pos=pos, win_mask=win, image_mask=image_mask, engram_emb=emb,
                                         moe_impl=options.moe_impl, sharder=options.sharder,
                                         source_input=source_input)
        if layer in cfg.dspark_target_layer_ids:
            targets.append(jnp.mean(aux["attn_input_streams"].astype(F32), axis=2).astype(dt))
        if options.collect:
            hidden.append(streams)
            premixes.append(premix)
            for key in inter:
                if key in aux:
                    inter[key][layer] = aux[key]
    h = rms_norm(hc_collapse(streams, premix), params["norm"], cfg.norm_eps, out_dtype=F32)
    logits = linear(h, params["head"])
    out: dict[str, Any] = {"positions": pos}
    if targets:
        out["dspark_features"] = jnp.concatenate(targets, axis=-1)  # [B,S',n_targets·D]
    if options.collect:
        out.update(inter)
        if mode == "compact" and len({t.shape[1] for t in hidden}) > 1:
            out["hidden_states"] = hidden  # lengths differ across the boundary
        else:
            out["hidden_states"] = jnp.stack(hidden)
            out["premix"] = jnp.stack(premixes)
        out["final_hidden"] = h
    return logits, out
