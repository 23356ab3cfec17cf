"""One jitted model step over the serving cache: chunked prefill or decode rows for V4 and V4.1.

A step processes ``B`` rows (sequences) of up to ``Q`` query tokens each: row b holds the tokens at absolute
positions ``start[b] … start[b] + n[b] − 1`` of the sequence in state slot ``slot[b]`` whose pages are
``pages[b]``. Rows with ``n = 0`` are padding: they write nowhere (out-of-range scatter indices are dropped) and
their outputs are ignored. Every query sees exactly what the full-sequence forward would show it: the window of
raw KV rows (from the slot's ring plus this step's rows), the compressed rows closed so far (this step's new rows
included), the indexer's top-k among them.

The math is the model's (``dinfer_jax.models``); this module only supplies cached keys, compressor state and
page I/O around the same building blocks.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dinfer_jax.models.attention import (RopeTable, attend, index_scores, output_projection, query_and_window_kv,
                                         rope_inv_freq)
from dinfer_jax.models.config import ATTN_CSA, ATTN_SLIDING, ModelConfig
from dinfer_jax.models.csa2 import candidate_blocks, topk_select
from dinfer_jax.models.engram import engram_gate
from dinfer_jax.models.fake_quant import maybe_fake_quant, q8_fake
from dinfer_jax.models.mhc import hc_collapse, hc_head, hc_mixes, hc_post, hc_pre
from dinfer_jax.models.moe import moe
from dinfer_jax.models.ops import F32, apply_rope_tail, linear, rms_norm, rope_cos_sin
from dinfer_jax.models.v41 import embed_tokens, source_rows

NEG_INF = -jnp.inf


# ---------------------------------------------------------------------------------------------------------------
# ring and page I/O


def ring_positions(start: jax.Array, size: int) -> jax.Array:
    """Positions held by a ring of ``size`` entries just before ``start`` ``[B]``: ``[B, size]`` (−k if none)."""
    j = jnp.arange(size)
    return start[:, None] - 1 - jnp.mod(start[:, None] - 1 - j[None, :], size)


def ring_write(ring: jax.Array, slot: jax.Array, pos: jax.Array, n: jax.Array, values: jax.Array) -> jax.Array:
    """Write ``values [B,Q,...]`` of positions ``pos [B,Q]`` into ``ring [num_slots, R, ...]`` at
    ``[slot, pos % R]``; only each row's last R valid tokens are written, padding rows nowhere."""
    R = ring.shape[1]
    Q = pos.shape[1]
    i = jnp.arange(Q)[None, :]
    keep = (i < n[:, None]) & (i >= n[:, None] - R)
    s = jnp.where(keep, slot[:, None], ring.shape[0])
    return ring.at[s, jnp.mod(pos, R)].set(values.astype(ring.dtype), mode="drop")


def buffer_take(ring_rows: jax.Array, new_rows: jax.Array, start: jax.Array, positions: jax.Array) -> jax.Array:
    """Values at ``positions [B, ...]`` from this step's rows (position ≥ start) or the slot's ring (earlier).

    ring_rows ``[B,R,C]`` (ring of the row's slot), new_rows ``[B,Q,C]``. Returns ``[B, ..., C]``.
    """
    B, R, C = ring_rows.shape
    Q = new_rows.shape[1]
    flat = positions.reshape(B, -1)
    rel = flat - start[:, None]
    from_new = rel >= 0
    a = jnp.take_along_axis(new_rows, jnp.clip(rel, 0, Q - 1)[..., None], axis=1)
    b = jnp.take_along_axis(ring_rows, jnp.mod(flat, R)[..., None], axis=1)
    return jnp.where(from_new[..., None], a, b).reshape(*positions.shape, C)


def pages_read(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """A sequence's paged rows in order: pool ``[N, rpb, C]``, pages ``[B,P]`` → ``[B, P·rpb, C]``."""
    g = pool[pages]
    return g.reshape(pages.shape[0], -1, pool.shape[-1])


def pages_write(pool: jax.Array, pages: jax.Array, rows: jax.Array, valid: jax.Array, values: jax.Array) -> jax.Array:
    """Write compressed row ``rows [B,W]`` (sequence row index) of each sequence; invalid entries are dropped."""
    rpb = pool.shape[1]
    page_no = jnp.clip(rows // rpb, 0, pages.shape[1] - 1)
    page = jnp.where(valid, jnp.take_along_axis(pages, page_no, axis=1), pool.shape[0])
    return pool.at[page, jnp.mod(rows, rpb)].set(values.astype(pool.dtype), mode="drop")


# ---------------------------------------------------------------------------------------------------------------
# compressors over (ring state + this step's tokens)


def _closing_groups(start: jax.Array, n: jax.Array, ratio: int, Q: int) -> tuple[jax.Array, jax.Array]:
    """Groups closed by this step's tokens: ``(w [B, Q//ratio + 1], valid)``; group w closes at token
    ``(w+1)·ratio − 1``."""
    w = start[:, None] // ratio + jnp.arange(Q // ratio + 1)[None, :]
    return w, w < ((start + n) // ratio)[:, None]


def compress_step_v4(p: Mapping[str, Any], h: jax.Array, st_kv: jax.Array, st_gate: jax.Array, start: jax.Array,
                     n: jax.Array, *, ratio: int, dim: int, overlap: bool, inv_freq: Any,
                     norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """V4 compressor step. h ``[B,Q,D]``; st_* ``[B,Sm,coff·dim]`` (the row's slot ring, gate incl. APE).

    Returns ``(rows [B,W,dim] fp32, w [B,W], valid [B,W], kv [B,Q,coff·dim], gate [B,Q,coff·dim])`` — the
    projections of this step's tokens, for the caller to write into the ring.
    """
    B, Q, _ = h.shape
    hf = h.astype(F32)
    pos = start[:, None] + jnp.arange(Q)[None, :]
    kv = linear(hf, p["wkv"])
    gate = linear(hf, p["wgate"]) + p["ape"].astype(F32)[jnp.mod(pos, ratio)]
    w, valid = _closing_groups(start, n, ratio, Q)
    if overlap:
        tok = w[..., None] * ratio - ratio + jnp.arange(2 * ratio)  # [B,W,2m]
        kv_t, g_t = buffer_take(st_kv, kv, start, tok), buffer_take(st_gate, gate, start, tok)
        first = jnp.arange(2 * ratio) < ratio
        kv_sel = jnp.where(first[:, None], kv_t[..., :dim], kv_t[..., dim:])
        g_sel = jnp.where(first[:, None], g_t[..., :dim], g_t[..., dim:])
        before_start = (tok < 0)[..., None]
        kv_sel = jnp.where(before_start, 0.0, kv_sel)
        g_sel = jnp.where(before_start, NEG_INF, g_sel)
    else:
        tok = w[..., None] * ratio + jnp.arange(ratio)
        kv_sel, g_sel = buffer_take(st_kv, kv, start, tok), buffer_take(st_gate, gate, start, tok)
    pooled = jnp.sum(kv_sel * jax.nn.softmax(g_sel, axis=2), axis=2)
    pooled = rms_norm(pooled, p["norm"], norm_eps, out_dtype=F32)
    cos, sin = rope_cos_sin(w * ratio, inv_freq)
    return apply_rope_tail(pooled, cos, sin), w, valid, kv, gate


# ---------------------------------------------------------------------------------------------------------------
# attention sublayers


def _window(lc: Mapping[str, Any], kv: jax.Array, inp: Mapping[str, jax.Array], pos: jax.Array,
            W: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Window keys ``[B, W+Q, d]`` (ring then this step's rows), their mask ``[B,Q,W+Q]``, updated ring."""
    ring = lc["swa"][inp["slot"]]
    rpos = ring_positions(inp["start"], W)
    keys = jnp.concatenate([ring.astype(kv.dtype), kv], axis=1)
    kpos = jnp.concatenate([rpos, pos], axis=1)
    Q = pos.shape[1]
    kvalid = jnp.concatenate([rpos >= 0, jnp.arange(Q)[None, :] < inp["n"][:, None]], axis=1)
    mask = kvalid[:, None, :] & (kpos[:, None, :] <= pos[:, :, None]) & (kpos[:, None, :] > pos[:, :, None] - W)
    new_ring = ring_write(lc["swa"], inp["slot"], pos, inp["n"], kv)
    return keys, mask, new_ring


def attention_step_v4(p: Mapping[str, Any], h: jax.Array, lc: dict[str, Any], inp: Mapping[str, jax.Array], *,
                      cfg: ModelConfig, layer: int, rope: RopeTable, inv_freq: Any,
                      pos: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    kind, ratio = cfg.attn_kinds[layer], cfg.compress_ratios[layer]
    """V4 attention sublayer over cached state. Returns ``(out [B,Q,D], updated layer cache)``."""
    cq, q, kv = query_and_window_kv(p, h, cfg=cfg, rope=rope)
    new_lc = dict(lc)
    keys, wmask, new_lc["swa"] = _window(lc, kv, inp, pos, cfg.sliding_window)
    ckv = cmask = None
    if kind != ATTN_SLIDING:
        slot, start, n, pages = inp["slot"], inp["start"], inp["n"], inp["pages"]
        overlap = kind == ATTN_CSA
        rows, w, valid, kvp, gate = compress_step_v4(
            p["compressor"], h, lc["cst_kv"][slot], lc["cst_gate"][slot], start, n, ratio=ratio, dim=cfg.head_dim,
            overlap=overlap, inv_freq=inv_freq, norm_eps=cfg.norm_eps)
        new_lc["cst_kv"] = ring_write(lc["cst_kv"], slot, pos, n, kvp)
        new_lc["cst_gate"] = ring_write(lc["cst_gate"], slot, pos, n, gate)
        new_lc["ckv"] = pages_write(lc["ckv"], pages, w, valid, rows)
        ckv = pages_read(new_lc["ckv"], pages)
        T = ckv.shape[1]
        cmask = jnp.arange(T) < ((pos + 1) // ratio)[..., None]  # [B,Q,T]
        if overlap:
            ix = p["indexer"]
            irows, iw, ivalid, ikv, igate = compress_step_v4(
                ix["compressor"], h, lc["ist_kv"][slot], lc["ist_gate"][slot], start, n, ratio=ratio,
                dim=cfg.index_head_dim, overlap=True, inv_freq=inv_freq, norm_eps=cfg.norm_eps)
            new_lc["ist_kv"] = ring_write(lc["ist_kv"], slot, pos, n, ikv)
            new_lc["ist_gate"] = ring_write(lc["ist_gate"], slot, pos, n, igate)
            new_lc["ikv"] = pages_write(lc["ikv"], pages, iw, ivalid, irows)
            scores = index_scores(ix, h, cq, pages_read(new_lc["ikv"], pages), pos, cfg=cfg, ratio=ratio, rope=rope)
            _, selected = topk_select(scores, cfg.index_topk)
            cmask = cmask & selected
    o = attend(q, keys, wmask, ckv, cmask, p["attn_sink"])
    return output_projection(p, o, cfg=cfg, rope=rope), new_lc


def compress_step_v41(p: Mapping[str, Any], h: jax.Array, lc: Mapping[str, Any], inp: Mapping[str, jax.Array], *,
                      ratio: int, norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """V4.1 CSA2 compressor step: groups of ``ratio`` ∈ {1, 2} tokens, softmax-gated (ratio 2), no overlap/APE.

    Returns ``(latent [B,W,d] fp32 pre-norm, w [B,W], valid [B,W], ring updates)``.
    """
    B, Q, _ = h.shape
    hf = h.astype(F32)
    start, n, slot = inp["start"], inp["n"], inp["slot"]
    pos = start[:, None] + jnp.arange(Q)[None, :]
    latent = linear(hf, p["wkv"])
    w, valid = _closing_groups(start, n, ratio, Q)
    updates: dict[str, jax.Array] = {}
    if ratio == 1:
        return latent, w[:, :Q], valid[:, :Q], updates
    score = linear(hf, p["wgate"])
    tok = w[..., None] * ratio + jnp.arange(ratio)
    lat_t = buffer_take(lc["cst_latent"][slot], latent, start, tok)
    sc_t = buffer_take(lc["cst_score"][slot], score, start, tok)
    pooled = jnp.sum(lat_t * jax.nn.softmax(sc_t, axis=2), axis=2)
    updates["cst_latent"] = ring_write(lc["cst_latent"], slot, pos, n, latent)
    updates["cst_score"] = ring_write(lc["cst_score"], slot, pos, n, score)
    return pooled, w, valid, updates


def attention_step_v41(p: Mapping[str, Any], h: jax.Array, cache_layers: list[dict[str, Any]],
                       inp: Mapping[str, jax.Array], shared: dict[str, Any], *, cfg: ModelConfig, layer: int,
                       rope: RopeTable, inv_freq: Any, pos: jax.Array) -> jax.Array:
    """V4.1 attention sublayer over cached state; updates ``cache_layers[layer]`` (and reads source layers' pages)
    in place of the list. ``shared`` carries this step's top-k selections and candidate blocks across layers."""
    ratio = cfg.compress_ratios[layer] if layer >= 0 else 0
    lc = dict(cache_layers[layer])
    cq, q, kv = query_and_window_kv(p, h, cfg=cfg, rope=rope)
    kv = maybe_fake_quant(cfg.kv_fake_quant, q8_fake, kv, 32)
    keys, wmask, lc["swa"] = _window(lc, kv, inp, pos, cfg.sliding_window)
    ckv = cmask = None
    if ratio > 0:
        pages = inp["pages"]
        if layer in cfg.kv_source_layer_ids:
            latent, w, valid, upd = compress_step_v41(p["compressor"], h, lc, inp, ratio=ratio,
                                                      norm_eps=cfg.norm_eps)
            lc.update(upd)
            kvc, k = source_rows(p, latent, w * ratio, cfg=cfg, dtype=h.dtype, inv_freq=inv_freq,
                                 has_index_k="ik" in lc)
            lc["ckv"] = pages_write(lc["ckv"], pages, w, valid, kvc)
            if k is not None:
                lc["ik"] = pages_write(lc["ik"], pages, w, valid, k)
        cache_layers[layer] = lc
        src = cache_layers[cfg.kv_source(layer)]
        ckv = pages_read(src["ckv"], pages)
        T = ckv.shape[1]
        cmask = jnp.arange(T) < ((pos + 1) // ratio)[..., None]
        if layer in cfg.index_source_layer_ids:
            kidx = pages_read(cache_layers[cfg.index_k_source(layer)]["ik"], pages)
            scores = index_scores(p["indexer"], h, cq, kidx, pos, cfg=cfg, ratio=ratio, rope=rope)
            if layer == cfg.candidate_source_layer_id:
                shared["candidates"], _ = candidate_blocks(scores, (pos + 1) // ratio, cfg.candidate_block_size,
                                                           cfg.candidate_topk_blocks)
            elif cfg.uses_candidates(layer):
                scores = jnp.where(shared["candidates"], scores, NEG_INF)
            _, shared[layer] = topk_select(scores, cfg.index_topk)
        cmask = cmask & shared[cfg.index_source(layer)]
    else:
        cache_layers[layer] = lc
    o = attend(q, keys, wmask, ckv, cmask, p["attn_sink"])
    return output_projection(p, o, cfg=cfg, rope=rope)


# ---------------------------------------------------------------------------------------------------------------
# the step


def _rope_table(cfg: ModelConfig, pos: jax.Array, compress: bool) -> tuple[Any, RopeTable]:
    inv = rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta if compress else cfg.rope_theta,
                        cfg.yarn if compress else None)
    cos, sin = rope_cos_sin(pos, inv)
    return inv, RopeTable(cos, sin)


def _engram_rows_device(cache: dict[str, Any], tokens: jax.Array, inp: Mapping[str, jax.Array],
                        cfg: ModelConfig, cmap: jax.Array) -> tuple[jax.Array, jax.Array]:
    """N-gram rows ``[B,Q,M]`` of compressed ids (row r = token at p−r) from this step's tokens and the slot's
    history; returns the rows and the updated history ``[num_slots, M−1]``."""
    M = cfg.engram_max_ngram_size
    B, Q = tokens.shape
    pad = cmap[cfg.engram_pad_id]
    comp = cmap[jnp.clip(tokens, 0, cmap.shape[0] - 1)]
    hist = cache["ngram_hist"][inp["slot"]]  # [B, M-1]: hist[:, r-1] = token at start - r
    hist = jnp.where((inp["start"] == 0)[:, None], pad, hist)
    seq = jnp.concatenate([hist[:, ::-1], comp], axis=1)  # positions start-(M-1) … start+Q-1
    idx = (M - 1) + jnp.arange(Q)[:, None] - jnp.arange(M)[None, :]  # [Q, M]
    rows = seq[:, idx]  # [B,Q,M]
    # history after this row: the last M-1 valid tokens
    last = (M - 1) + inp["n"][:, None] - 1 - jnp.arange(M - 1)[None, :]
    new_hist_rows = jnp.take_along_axis(seq, jnp.clip(last, 0, seq.shape[1] - 1), axis=1)
    keep = inp["n"] > 0
    s = jnp.where(keep, inp["slot"], cache["ngram_hist"].shape[0])
    new_hist = cache["ngram_hist"].at[s].set(new_hist_rows, mode="drop")
    return rows, new_hist


def model_step(params: Mapping[str, Any], cache: dict[str, Any], inp: Mapping[str, jax.Array], *, cfg: ModelConfig,
               dtype: str, moe_impl: str = "ragged",
               engram_fn: Callable[[jax.Array], jax.Array] | None = None,
               cmap: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """Run the model on one step's rows.

    inp: ``tokens [B,Q]`` int32, ``start [B]``, ``n [B]`` (0 = padding row), ``slot [B]``, ``pages [B,P]``,
    ``last [B]`` (query index whose logits are returned). Returns ``(logits [B,V] fp32 at each row's ``last``
    token, updated cache)``. V4.1 Engram rows come from ``engram_fn`` (host gather of hashed n-grams, run through
    ``jax.pure_callback``) with ``cmap`` the raw → compressed id table on device.
    """
    dt = jnp.dtype(dtype)
    tokens = inp["tokens"]
    B, Q = tokens.shape
    pos = inp["start"][:, None] + jnp.arange(Q)[None, :]
    ropes = {c: _rope_table(cfg, pos, c) for c in (False, True)}
    cache = dict(cache)
    layers = list(cache["layers"])
    x = embed_tokens(params, tokens, dt, None, None)
    n = cfg.hc_mult
    streams = jnp.broadcast_to(x[:, :, None, :], (B, Q, n, cfg.hidden_size))
    hc_kw = dict(hc_mult=n, sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    engram = None
    if cfg.engram_layer_ids:
        rows, cache["ngram_hist"] = _engram_rows_device(cache, tokens, inp, cfg, cmap)
        engram = engram_fn(rows).astype(dt)  # [n_engram, B, Q, E_in]
    premix = jnp.broadcast_to(jax.nn.one_hot(0, n, dtype=F32), (B, Q, n))
    shared: dict[Any, Any] = {}
    for layer, lp in enumerate(params["layers"]):
        compressed = cfg.compress_ratios[layer] > 0
        inv, table = ropes[compressed]
        if not cfg.is_v41:
            u, post, comb = hc_pre(streams, lp["hc_attn"], **hc_kw)
            a, layers[layer] = attention_step_v4(lp["attn"], rms_norm(u, lp["attn_norm"], cfg.norm_eps), layers[layer],
                                                 inp, cfg=cfg, layer=layer, rope=table, inv_freq=inv, pos=pos)
            streams = hc_post(streams, a, post, comb)
            u, post, comb = hc_pre(streams, lp["hc_ffn"], **hc_kw)
            m, _ = moe(lp["ffn"], rms_norm(u, lp["ffn_norm"], cfg.norm_eps), tokens, cfg=cfg,
                       hash_routed=cfg.hash_layers[layer], impl=moe_impl)
            streams = hc_post(streams, m, post, comb)
            continue
        if "engram" in lp:
            streams = engram_gate(streams, engram[cfg.engram_layer_ids.index(layer)], lp["engram"],
                                  norm_eps=cfg.norm_eps)
        pre_a, post_a, comb_a = hc_mixes(streams, lp["hc_attn"], **hc_kw)
        h = rms_norm(hc_collapse(streams, premix), lp["attn_norm"], cfg.norm_eps)
        a = attention_step_v41(lp["attn"], h, layers, inp, shared, cfg=cfg, layer=layer, rope=table, inv_freq=inv,
                               pos=pos)
        streams = hc_post(streams, a, post_a, comb_a)
        pre_f, post_f, comb_f = hc_mixes(streams, lp["hc_ffn"], **hc_kw)
        m, _ = moe(lp["ffn"], rms_norm(hc_collapse(streams, pre_a), lp["ffn_norm"], cfg.norm_eps), None, cfg=cfg,
                   hash_routed=False, impl=moe_impl)
        streams = hc_post(streams, m, post_f, comb_f)
        premix = pre_f
    last = jnp.take_along_axis(streams, inp["last"][:, None, None, None], axis=1)[:, 0]  # [B,n,D]
    if cfg.is_v41:
        lp_pre = jnp.take_along_axis(premix, inp["last"][:, None, None], axis=1)[:, 0]
        h = rms_norm(hc_collapse(last, lp_pre), params["norm"], cfg.norm_eps, out_dtype=F32)
    else:
        h = rms_norm(hc_head(last, params["hc_head"], hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps), params["norm"],
                     cfg.norm_eps, out_dtype=F32)
    logits = linear(h, params["head"])
    cache["layers"] = layers
    return logits, cache
