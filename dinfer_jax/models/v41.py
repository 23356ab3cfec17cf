"""DeepSeek-V4.1 forward (``docs/spec/model-v41.md``) on the V4 core: shifted single-pass mHC, CSA2 compressed KV shared
across layers, index keys projected from the compressed latent, candidate two-level top-k, FP8/FP4 KV fake-quant,
Engram, image rows, YOCO bounded replay, and the DSpark drafter's target features.

This module holds the V4.1-specific building blocks (source rows, embedding); the layer itself is
:func:`dinfer_jax.models.layers.layer_v41` and the forward :func:`dinfer_jax.models.v4.forward`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.fake_quant import maybe_fake_quant, q4e_fake, q4u_fake
from dinfer_jax.models.ops import F32, apply_rope_tail, linear, rms_norm, rope_cos_sin
from dinfer_jax.models.qweights import take_rows

YOCO_MODES = ("off", "mask", "compact")


def source_rows(p: Mapping[str, Any], latent: jax.Array, positions: jax.Array, *, cfg: ModelConfig, dtype: Any,
                inv_freq: Any, has_index_k: bool
                ) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None]:
    """A KV source's compressed KV and index keys from pooled latents ``[B,T,d]`` fp32 at first-token positions
    ``positions`` (``[T]`` or ``[B,T]``): ``L = rms(latent; compressor.norm)``, ``KVc = Q4e(rope(L))``,
    ``Kidx = Q4u(rope(rms(L·wkᵀ; k_norm)))``. Returns ``(KVc, Kidx, rope(L), rope(...))``: the rounded rows the
    attention uses and the same rows before rounding, which a byte cache encodes (fp32; Kidx None without index
    keys)."""
    comp = p["compressor"]
    lat = rms_norm(latent.astype(dtype), comp["norm"], cfg.norm_eps, out_dtype=F32)  # pre-RoPE latent L
    cos, sin = rope_cos_sin(positions, inv_freq)
    kv_pre = apply_rope_tail(lat, cos, sin)
    kvc = maybe_fake_quant(cfg.kv_fake_quant, q4e_fake, kv_pre, 16)
    kidx = ik_pre = None
    if has_index_k:
        ix = p["indexer"]
        k = rms_norm(linear(lat.astype(dtype), ix["wk"]), ix["k_norm"], cfg.norm_eps, out_dtype=F32)
        ik_pre = apply_rope_tail(k, cos, sin)
        kidx = maybe_fake_quant(cfg.kv_fake_quant, q4u_fake, ik_pre, 32)
    return kvc, kidx, kv_pre, ik_pre


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
