"""Device cache state for serving: per-sequence rings in state slots and paged compressed KV.

Layout (``model-v4.md`` §4, ``model-v41.md`` §4, ``engine.md`` §12):

* **SWA ring** (every layer): ``swa [num_slots, W, d]``; position p of the sequence in slot s lives at
  ``swa[s, p % W]``. Slot 0 is the null slot of padding rows.
* **Compressor state ring** (layers that compress): raw per-token projections of the last ``Sm`` tokens
  (``cst_kv``/``cst_gate`` for V4, ``cst_latent``/``cst_score`` for V4.1 ratio 2) at ``[s, p % Sm]``, fp32, so a
  group split across chunks or steps is completed later. V4 CSA keeps 2m tokens (overlapping windows), HCA m.
* **Paged compressed KV**: ``ckv [num_blocks, block_size // m, d]``; compressed row w of a sequence lives in page
  ``block_table[w·m // block_size]`` at offset ``w % (block_size // m)``. V4 CSA pages its indexer keys the same
  way (``ikv``), V4.1 its index keys (``ik``). Block 0 is the null block: padding rows never write real pages.
* V4.1 Engram: ``ngram_hist [num_slots, max_ngram−1]`` holds the compressed ids of the last tokens on device, so
  n-gram rows of tokens the host has not seen yet (asynchronous decoding) are built on device.

Values are stored as the model produces them (fp32/bf16 rows; V4.1's FP8/FP4 fake-quantised values are exact in
these dtypes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.config import ATTN_CSA, ATTN_SLIDING, ModelConfig

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Pool sizes. ``block_size`` tokens per page; must be a multiple of every compression ratio."""

    num_slots: int
    num_blocks: int
    block_size: int

    def validate(self, cfg: ModelConfig) -> None:
        for r in set(cfg.compress_ratios) - {0}:
            if self.block_size % r:
                raise ValueError(f"block_size {self.block_size} must be a multiple of compression ratio {r}")
        if self.num_slots < 2 or self.num_blocks < 2:
            raise ValueError("need at least one real state slot and one real block besides the null ones")


def _layer_state_width(cfg: ModelConfig, layer: int) -> int:
    """Tokens a layer's compressor ring keeps (0 if the layer does not compress)."""
    r = cfg.compress_ratios[layer]
    if cfg.is_v41:
        return 2 if (layer in cfg.kv_source_layer_ids and r == 2) else 0
    if cfg.attn_kinds[layer] == ATTN_SLIDING:
        return 0
    return 2 * r if cfg.attn_kinds[layer] == ATTN_CSA else r


def cache_shapes(cfg: ModelConfig, cc: CacheConfig, dtype: Any) -> dict[str, Any]:
    """``jax.ShapeDtypeStruct`` pytree of the whole cache (nothing allocated)."""
    dt = jnp.dtype(dtype)
    d, di = cfg.head_dim, cfg.index_head_dim
    S, N, bs = cc.num_slots, cc.num_blocks, cc.block_size
    sds = jax.ShapeDtypeStruct
    layers = []
    for layer in range(cfg.num_layers):
        r = cfg.compress_ratios[layer]
        c: dict[str, Any] = {"swa": sds((S, cfg.sliding_window, d), dt)}
        sm = _layer_state_width(cfg, layer)
        if cfg.is_v41:
            if layer in cfg.kv_source_layer_ids:
                c["ckv"] = sds((N, bs // r, d), dt)
                if sm:
                    c["cst_latent"] = sds((S, sm, d), F32)
                    c["cst_score"] = sds((S, sm, d), F32)
                if layer in (cfg.index_k_source_layer_ids or cfg.kv_source_layer_ids):
                    c["ik"] = sds((N, bs // r, di), F32)
        elif r:
            coff = 2 if cfg.attn_kinds[layer] == ATTN_CSA else 1
            c["ckv"] = sds((N, bs // r, d), dt)
            c["cst_kv"] = sds((S, sm, coff * d), F32)
            c["cst_gate"] = sds((S, sm, coff * d), F32)
            if cfg.attn_kinds[layer] == ATTN_CSA:
                c["ikv"] = sds((N, bs // r, di), F32)
                c["ist_kv"] = sds((S, sm, 2 * di), F32)
                c["ist_gate"] = sds((S, sm, 2 * di), F32)
        layers.append(c)
    out: dict[str, Any] = {"layers": layers}
    if cfg.engram_layer_ids:
        out["ngram_hist"] = sds((S, cfg.engram_max_ngram_size - 1), jnp.int32)
    return out


def init_cache(cfg: ModelConfig, cc: CacheConfig, dtype: Any) -> dict[str, Any]:
    """Zero-filled cache on the default device."""
    cc.validate(cfg)
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, cc, dtype))


def _bytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def bytes_per_block_and_slot(cfg: ModelConfig, block_size: int, dtype: Any) -> tuple[int, int]:
    """Device bytes one page and one state slot cost (from the shapes of a 1-slot, 1-block cache)."""
    one = cache_shapes(cfg, CacheConfig(1, 1, block_size), dtype)
    two_blocks = cache_shapes(cfg, CacheConfig(1, 2, block_size), dtype)
    two_slots = cache_shapes(cfg, CacheConfig(2, 1, block_size), dtype)
    return _bytes(two_blocks) - _bytes(one), _bytes(two_slots) - _bytes(one)


def size_pools(cfg: ModelConfig, *, memory_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
               dtype: Any) -> CacheConfig:
    """Pools from a memory budget: state slots for ``max_num_seqs`` (+ the null slot), the rest in pages.

    Raises ValueError when the budget cannot hold one ``max_model_len`` sequence.
    """
    per_block, per_slot = bytes_per_block_and_slot(cfg, block_size, dtype)
    num_slots = max_num_seqs + 1
    left = memory_bytes - num_slots * per_slot
    num_blocks = left // max(per_block, 1) if per_block else 1 + max_num_seqs * -(-max_model_len // block_size)
    need = 1 + -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(f"KV memory budget {memory_bytes} B holds {max(num_blocks, 0)} pages of {block_size} tokens; "
                         f"one sequence of max_model_len={max_model_len} needs {need} (page {per_block} B, "
                         f"state slot {per_slot} B)")
    return CacheConfig(num_slots=num_slots, num_blocks=int(num_blocks), block_size=block_size)
