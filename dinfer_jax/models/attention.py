"""V4 attention for the full-sequence reference path (positions 0..S−1, no cache): spec ``model-v4.md`` §3.4–3.7.

Every layer attends to a sliding window of raw KV rows; CSA layers (m = 4, overlapping compressor + lightning
indexer top-k) and HCA layers (m large, all closed windows) add compressed KV rows. K = V = one 512-wide latent
shared by all heads, learned per-head sink, inverse RoPE on the output, grouped low-rank output projection.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dinfer_jax.models.config import ATTN_CSA, ATTN_SLIDING, ModelConfig
from dinfer_jax.models.ops import F32, apply_rope_tail, linear, matmul, rms_norm, rope_cos_sin, rope_inv_freq
from dinfer_jax.models.qweights import as_dense
from sharding.rules import Sharder, constrain


@dataclasses.dataclass(frozen=True)
class RopeTable:
    """cos/sin ``[S, r/2]`` (fp32) for the query positions and for compressed-row positions ``w·m``."""

    cos: jax.Array
    sin: jax.Array


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> dict[str, tuple[Any, RopeTable]]:
    """``{"main": (inv_freq, table), "compress": (inv_freq, table)}`` for ``positions [S]``: main = plain
    ``rope_theta`` (sliding-only layers, MTP), compress = ``compress_rope_theta`` with YaRN (compressed layers)."""
    out = {}
    for name, theta, yarn in (("main", cfg.rope_theta, None), ("compress", cfg.compress_rope_theta, cfg.yarn)):
        inv = rope_inv_freq(cfg.rope_head_dim, theta, yarn)
        cos, sin = rope_cos_sin(positions, inv)
        out[name] = (inv, RopeTable(cos, sin))
    return out


def compress_full(p: Mapping[str, jax.Array], h: jax.Array, *, ratio: int, dim: int, overlap: bool,
                  inv_freq: Any, norm_eps: float) -> jax.Array:
    """Compressor over all closed windows of a sequence starting at position 0 (fp32 throughout).

    h: ``[B,S,D]``. Returns ``[B, T, dim]`` fp32 with ``T = S // ratio``; row w pools tokens
    ``[w·m, (w+1)·m)`` (overlap: plus the first half-channels of window w−1) and carries RoPE at position ``w·m``.
    A trailing partial window produces no row (no query of this sequence could see it).
    """
    B, S, _ = h.shape
    T = S // ratio
    if T == 0:
        return jnp.zeros((B, 0, dim), F32)
    hf = h[:, :T * ratio].astype(F32)
    kv = linear(hf, p["wkv"]).reshape(B, T, ratio, -1)
    gate = linear(hf, p["wgate"]).reshape(B, T, ratio, -1) + p["ape"].astype(F32)
    if overlap:
        prev_kv = jnp.pad(kv[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_gate = jnp.pad(gate[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
        kv = jnp.concatenate([prev_kv, kv[..., dim:]], axis=2)  # [B,T,2m,dim]
        gate = jnp.concatenate([prev_gate, gate[..., dim:]], axis=2)
    weights = jax.nn.softmax(gate, axis=2)
    pooled = jnp.sum(kv * weights, axis=2)
    pooled = rms_norm(pooled, p["norm"], norm_eps, out_dtype=F32)
    cos, sin = rope_cos_sin(jnp.arange(T) * ratio, inv_freq)
    return apply_rope_tail(pooled, cos, sin)


def index_scores(p: Mapping[str, Any], h: jax.Array, cq: jax.Array, k_rows: jax.Array, pos: jax.Array, *,
                 cfg: ModelConfig, ratio: int, rope: RopeTable) -> jax.Array:
    """Lightning-indexer scores ``[B,S,T]`` fp32: ``Σ_h relu(q_h · k_j) · w_h`` with −inf where ``j ≥ (p+1)//m``.

    h ``[B,S,D]``, cq ``[B,S,q_lora]``, k_rows ``[B,T,di]`` (index keys, RoPE'd), pos ``[S]`` or ``[B,S]`` absolute
    positions of the query rows, rope the query positions' table. V4.1 (``kv_fake_quant``) rounds the index query
    to FP4 (Q4u); V4's Hadamard + FP4 is reference-only and orthonormal, so it is omitted (as transformers does).
    """
    from dinfer_jax.models.fake_quant import maybe_fake_quant, q4u_fake

    B, S, _ = h.shape
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    q = linear(cq, p["wq_b"]).reshape(B, S, Hi, di)
    q = apply_rope_tail(q, rope.cos[..., None, :], rope.sin[..., None, :]).astype(F32)
    q = maybe_fake_quant(cfg.kv_fake_quant, q4u_fake, q, 32)
    w = linear(h.astype(F32), p["weights_proj"]) * (di ** -0.5) * (Hi ** -0.5)  # [B,S,Hi]
    dots = jnp.einsum("bshd,btd->bsht", q, k_rows.astype(F32), precision=jax.lax.Precision.HIGHEST)
    scores = jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots), w, precision=jax.lax.Precision.HIGHEST)
    visible = jnp.arange(k_rows.shape[1]) < ((pos + 1) // ratio)[..., None]  # [S,T] or [B,S,T]
    return jnp.where(visible, scores, -jnp.inf)


def indexer_select(p: Mapping[str, Any], h: jax.Array, cq: jax.Array, *, cfg: ModelConfig, ratio: int,
                   rope: RopeTable, inv_freq: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """V4 lightning indexer over a sequence from position 0: top-k compressed rows per query.

    h: ``[B,S,D]``, cq: ``[B,S,q_lora]``. Returns ``(indices [B,S,k] int32 with −1 for an invalid pick,
    selected [B,S,T] bool, scores [B,S,T] fp32 with −inf on rows the query cannot see)``, k = min(index_topk, T).
    Ties are broken towards the lowest row index (``jax.lax.top_k``).
    """
    from dinfer_jax.models.csa2 import topk_select

    k_rows = compress_full(p["compressor"], h, ratio=ratio, dim=cfg.index_head_dim, overlap=True, inv_freq=inv_freq,
                           norm_eps=cfg.norm_eps)  # [B,T,di] fp32
    scores = index_scores(p, h, cq, k_rows, jnp.arange(h.shape[1]), cfg=cfg, ratio=ratio, rope=rope)
    top_idx, selected = topk_select(scores, cfg.index_topk)
    return top_idx, selected, scores


def query_and_window_kv(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig,
                        rope: RopeTable) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q low-rank path and the shared K=V latent. h: ``[B,S,D]``. Returns ``(cq [B,S,q_lora], q [B,S,H,d] with
    RoPE, kv [B,S,d] with RoPE)``. V4 normalises each q head (unweighted RMS); V4.1 does not."""
    B, S, _ = h.shape
    eps = cfg.norm_eps
    cq = rms_norm(linear(h, p["wq_a"]), p["q_norm"], eps)
    q = linear(cq, p["wq_b"]).reshape(B, S, cfg.num_heads, cfg.head_dim)
    if cfg.use_qnorm:
        q = rms_norm(q, None, eps)
    q = apply_rope_tail(q, rope.cos[..., None, :], rope.sin[..., None, :])
    kv = rms_norm(linear(h, p["wkv"]), p["kv_norm"], eps)
    kv = apply_rope_tail(kv, rope.cos, rope.sin)
    return cq, q, kv


def window_mask(S: int, window: int) -> jax.Array:
    """``[S(q), S(k)]`` bool: key positions max(0, t−W+1)…t for query t."""
    pos = jnp.arange(S)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


def attend(q: jax.Array, kv: jax.Array, win_mask: jax.Array, ckv: jax.Array | None, cmask: jax.Array | None,
           sink: jax.Array) -> jax.Array:
    """Sink softmax attention over window rows plus compressed rows, K = V.

    q ``[B,S,H,d]``; kv ``[B,S,d]`` with ``win_mask`` ``[S,S]`` (or ``[B,S,S]``); ckv ``[B,T,d]`` with cmask
    ``[B,S,T]``; sink ``[H]`` fp32 logits that only enlarge the denominator. Returns o ``[B,S,H,d]`` (q's dtype);
    a query with no visible key gets 0.
    """
    B, S, H, d = q.shape
    dt = q.dtype
    scale = d ** -0.5
    wm = win_mask if win_mask.ndim == 3 else win_mask[None]
    logits = matmul("bshd,btd->bhst", q, kv) * scale
    logits = jnp.where(wm[:, None], logits, -jnp.inf)
    values = [kv]
    if ckv is not None and ckv.shape[1] > 0:
        c_logits = matmul("bshd,btd->bhst", q, ckv.astype(dt)) * scale
        logits = jnp.concatenate([logits, jnp.where(cmask[:, None], c_logits, -jnp.inf)], axis=-1)
        values.append(ckv.astype(dt))
    sink_col = jnp.broadcast_to(sink.astype(F32)[None, :, None, None], (B, H, S, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink_col], axis=-1), axis=-1)[..., :-1]
    v = jnp.concatenate(values, axis=1)
    return matmul("bhst,btd->bshd", probs.astype(dt), v).astype(dt)


def output_projection(p: Mapping[str, Any], o: jax.Array, *, cfg: ModelConfig, rope: RopeTable) -> jax.Array:
    """Inverse RoPE at the query position, then the grouped low-rank output. o ``[B,S,H,d]`` → ``[B,S,D]``."""
    B, S, H, d = o.shape
    G, R = cfg.o_groups, cfg.o_lora_rank
    dt = o.dtype
    o = apply_rope_tail(o, rope.cos[..., None, :], rope.sin[..., None, :], inverse=True)
    wo_a = as_dense(p["wo_a"], dt).reshape(G, R, H * d // G)
    z = matmul("bsgi,gri->bsgr", o.reshape(B, S, G, H * d // G), wo_a).astype(dt)
    return linear(z.reshape(B, S, G * R), p["wo_b"])


def attention_full(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig, kind: str, ratio: int, rope: RopeTable,
                   inv_freq: Any, sharder: Sharder | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One V4 attention sublayer over a whole sequence from position 0.

    h: ``[B,S,D]`` (already RMS-normalised), activation dtype. Returns ``(out [B,S,D], aux)`` where ``aux`` holds
    ``indexer_topk`` ``[B,S,k]`` and ``indexer_scores`` ``[B,S,T]`` on CSA layers.
    """
    B, S, _ = h.shape
    cq, q, kv = query_and_window_kv(p, h, cfg=cfg, rope=rope)
    q = constrain(sharder, q, ("act_batch", "act_seq", "act_heads", None))
    aux: dict[str, jax.Array] = {}
    ckv = cmask = None
    if kind != ATTN_SLIDING:
        ckv = compress_full(p["compressor"], h, ratio=ratio, dim=cfg.head_dim, overlap=kind == ATTN_CSA,
                            inv_freq=inv_freq, norm_eps=cfg.norm_eps).astype(h.dtype)  # [B,T,d]
        T = ckv.shape[1]
        pos = jnp.arange(S)
        cmask = jnp.broadcast_to((jnp.arange(T)[None, :] < ((pos + 1) // ratio)[:, None])[None], (B, S, T))
        if kind == ATTN_CSA and T > 0:
            top_idx, selected, scores = indexer_select(p["indexer"], h, cq, cfg=cfg, ratio=ratio, rope=rope,
                                                       inv_freq=inv_freq)
            cmask = cmask & selected
            aux["indexer_topk"] = top_idx
            aux["indexer_scores"] = scores
    o = attend(q, kv, window_mask(S, cfg.sliding_window), ckv, cmask, p["attn_sink"])
    return output_projection(p, o, cfg=cfg, rope=rope), aux
