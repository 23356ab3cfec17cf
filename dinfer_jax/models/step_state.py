"""Pytrees at the model step's jit boundary: the step input and the per-layer cache.

Layout of the cache (``docs/spec/model-v4.md`` §4, ``docs/spec/model-v41.md`` §4, ``docs/spec/engine.md`` §12), per
layer:

Rows are stored as :mod:`~dinfer_jax.models.cache_codec` says: V4.1 (``kv_fake_quant``) in DeepInfer's byte formats
(uint8 rows ``[data | scales]``: ``swa`` 528 B, ``ckv`` 288 B, ``ik`` 68 B at the release widths), otherwise as
values (``d`` wide below).

* **SWA ring** (every layer): ``swa [num_slots, W + b, d]``; position p of the sequence in slot s lives at
  ``swa[s, p % (W + b)]``. Slot 0 is the null slot of padding rows. ``b = CacheConfig.backtrack`` (0 without
  speculative decoding) keeps rejected draft positions from evicting committed window entries.
* **Compressor state ring** (layers that compress): raw per-token projections of the last ``Sm`` tokens
  (``cst_kv``/``cst_gate`` for V4, ``cst_latent``/``cst_score`` for V4.1 ratio 2) at ``[s, p % (Sm + b)]``, fp32, so a
  group split across chunks or steps is completed later. V4 CSA keeps 2m tokens (overlapping windows), HCA m.
* **Paged compressed KV**: ``ckv [num_blocks, block_size // m, d]``; compressed row w of a sequence lives in page
  ``block_table[w·m // block_size]`` at offset ``w % (block_size // m)``. V4 CSA pages its indexer keys the same
  way (``ikv`` with state ``ist_kv``/``ist_gate``), V4.1 its index keys (``ik``). Block 0 is the null block.

The whole cache (:class:`ModelCache`) stores layers in the scan layout of :func:`layer_plan.plan_layers`:
``layers[g][j]`` is the :class:`LayerCache` of period position ``j`` of group ``g`` with every array stacked along
a leading axis of size ``repeats`` (the scan writes into it in place at ``[rep, ...]``). V4.1 Engram adds
``ngram_hist [num_slots, max_ngram−1]`` (compressed ids of each slot's last tokens, for on-device n-gram rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.config import ATTN_CSA, ModelConfig
from dinfer_jax.models.layer_plan import LayerInfo, layer_info, plan_layers, stack_tree

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """One step's rows: row b holds the tokens at positions ``start[b] … start[b] + n[b] − 1`` of the sequence in
    state slot ``slot[b]`` whose pages are ``pages[b]``; ``n = 0`` marks a padding row (it writes nowhere).

    tokens ``[B,Q]`` int32; start, n, slot, last ``[B]`` int32 (``last``: query index whose logits a serving step
    returns); pages ``[B,P]`` int32. Optional (full-sequence forward): ``image_embeds [B,Q,D]`` + ``image_mask
    [B,Q]`` bool (V4.1 image rows), ``window_floor [B]`` int32 (V4.1 YOCO "mask": from the first ratio-1 layer on,
    window keys below this position are hidden).
    """

    tokens: jax.Array
    start: jax.Array
    n: jax.Array
    slot: jax.Array
    pages: jax.Array
    last: jax.Array
    image_embeds: jax.Array | None = None
    image_mask: jax.Array | None = None
    window_floor: jax.Array | None = None

    def positions(self) -> jax.Array:
        """Absolute positions ``[B,Q]`` of the query tokens."""
        return self.start[:, None] + jnp.arange(self.tokens.shape[1])[None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's cache arrays (None where the layer kind has none); see the module docstring for shapes."""

    swa: Any = None
    ckv: Any = None
    cst_kv: Any = None
    cst_gate: Any = None
    ikv: Any = None
    ist_kv: Any = None
    ist_gate: Any = None
    cst_latent: Any = None
    cst_score: Any = None
    ik: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """The serving cache: ``layers[g][j]`` stacked :class:`LayerCache` per plan group / period position."""

    layers: tuple[tuple[LayerCache, ...], ...]
    ngram_hist: Any = None


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Pool sizes. ``block_size`` tokens per page; must be a multiple of every compression ratio."""

    num_slots: int
    num_blocks: int
    block_size: int
    backtrack: int = 0  # extra ring entries so speculative writes never evict committed state (docs/spec/engine.md §5)

    def validate(self, cfg: ModelConfig) -> None:
        for r in set(cfg.compress_ratios) - {0}:
            if self.block_size % r:
                raise ValueError(f"block_size {self.block_size} must be a multiple of compression ratio {r}")
        if self.num_slots < 2 or self.num_blocks < 2:
            raise ValueError("need at least one real state slot and one real block besides the null ones")


def state_width(cfg: ModelConfig, info: LayerInfo) -> int:
    """Tokens a layer's compressor ring keeps (0 if the layer does not compress)."""
    if cfg.is_v41:
        return 2 if (info.kv_source and info.ratio == 2) else 0
    if info.ratio == 0:
        return 0
    return 2 * info.ratio if info.kind == ATTN_CSA else info.ratio


def layer_cache_shapes(cfg: ModelConfig, info: LayerInfo, cc: CacheConfig, dtype: Any) -> LayerCache:
    """``jax.ShapeDtypeStruct`` :class:`LayerCache` of one layer (unstacked). Row storage (values, or V4.1's byte
    formats) from :func:`~dinfer_jax.models.cache_codec.cache_codecs`."""
    from dinfer_jax.models.cache_codec import cache_codecs

    codecs = cache_codecs(cfg, dtype)
    d, di = cfg.head_dim, cfg.index_head_dim
    S, N, bs, r = cc.num_slots, cc.num_blocks, cc.block_size, info.ratio
    sds = jax.ShapeDtypeStruct

    def rows(codec, *lead):
        width, dt = codec.stored
        return sds((*lead, width), dt)

    c: dict[str, Any] = {"swa": rows(codecs.swa, S, cfg.sliding_window + cc.backtrack)}
    sm = state_width(cfg, info)
    sm = sm + cc.backtrack if sm else 0
    if cfg.is_v41:
        if info.kv_source:
            c["ckv"] = rows(codecs.ckv, N, bs // r)
            if sm:
                c["cst_latent"] = sds((S, sm, d), F32)
                c["cst_score"] = sds((S, sm, d), F32)
            if info.has_index_k:
                c["ik"] = rows(codecs.ik, N, bs // r)
    elif r:
        coff = 2 if info.kind == ATTN_CSA else 1
        c["ckv"] = rows(codecs.ckv, N, bs // r)
        c["cst_kv"] = sds((S, sm, coff * d), F32)
        c["cst_gate"] = sds((S, sm, coff * d), F32)
        if info.kind == ATTN_CSA:
            c["ikv"] = rows(codecs.ikv, N, bs // r)
            c["ist_kv"] = sds((S, sm, 2 * di), F32)
            c["ist_gate"] = sds((S, sm, 2 * di), F32)
    return LayerCache(**c)


def _stacked_shape(x: jax.ShapeDtypeStruct, n: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((n, *x.shape), x.dtype)


def cache_shapes(cfg: ModelConfig, cc: CacheConfig, dtype: Any) -> ModelCache:
    """``jax.ShapeDtypeStruct`` :class:`ModelCache` of the whole cache in scan layout (nothing allocated)."""
    layers = tuple(
        tuple(jax.tree.map(lambda x, g=g: _stacked_shape(x, g.repeats),
                           layer_cache_shapes(cfg, layer_info(cfg, g.start + j), cc, dtype))
              for j in range(g.period))
        for g in plan_layers(cfg))
    hist = None
    if cfg.engram_layer_ids:
        hist = jax.ShapeDtypeStruct((cc.num_slots, cfg.engram_max_ngram_size - 1), jnp.int32)
    return ModelCache(layers, hist)


def zeros_like_shapes(tree: Any) -> Any:
    """Zero arrays for a pytree of ``ShapeDtypeStruct``."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def single_layer_cache(cfg: ModelConfig, info: LayerInfo, cc: CacheConfig, dtype: Any) -> LayerCache:
    """Zero cache of one layer stacked with a leading axis of 1 (for blocks outside the plan, e.g. MTP)."""
    return stack_tree([zeros_like_shapes(layer_cache_shapes(cfg, info, cc, dtype))])
