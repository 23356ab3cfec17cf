"""Device cache state for serving: allocation and sizing of the model's :class:`ModelCache`.

The layout (per-sequence rings in state slots, paged compressed KV, layers stacked in scan layout) is documented in
:mod:`dinfer_jax.models.step_state`, which defines :class:`CacheConfig`, :class:`LayerCache` and
:class:`ModelCache`. Rows are stored as :mod:`dinfer_jax.models.cache_codec` says: V4.1 in DeepInfer's byte formats
(:mod:`dinfer_jax.engine.kv_formats`), V4 as values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.engine.kv_formats import layout
from dinfer_jax.models.config import ATTN_CSA, ModelConfig
from dinfer_jax.models.layer_plan import layer_info
from dinfer_jax.models.step_state import CacheConfig, ModelCache, cache_shapes, zeros_like_shapes

__all__ = ["CacheConfig", "ModelCache", "bytes_per_block_and_slot", "bytes_per_token", "cache_shapes", "init_cache",
           "size_pools"]

KV_CACHE_DTYPES = ("auto", "fp8")


def init_cache(cfg: ModelConfig, cc: CacheConfig, dtype: Any) -> ModelCache:
    """Zero-filled :class:`ModelCache` (scan layout) on the default device."""
    cc.validate(cfg)
    return zeros_like_shapes(cache_shapes(cfg, cc, dtype))


def _bytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def bytes_per_block_and_slot(cfg: ModelConfig, block_size: int, dtype: Any, backtrack: int = 0) -> tuple[int, int]:
    """Device bytes one page and one state slot cost (from the shapes of a 1-slot, 1-block cache); ``backtrack``:
    the rings' extra entries for speculative decoding (:class:`CacheConfig`)."""
    one = cache_shapes(cfg, CacheConfig(1, 1, block_size, backtrack), dtype)
    two_blocks = cache_shapes(cfg, CacheConfig(1, 2, block_size, backtrack), dtype)
    two_slots = cache_shapes(cfg, CacheConfig(2, 1, block_size, backtrack), dtype)
    return _bytes(two_blocks) - _bytes(one), _bytes(two_slots) - _bytes(one)


def size_pools(cfg: ModelConfig, *, memory_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
               dtype: Any, backtrack: int = 0) -> CacheConfig:
    """Pools from a memory budget: state slots for ``max_num_seqs`` (+ the null slot), the rest in pages.
    ``backtrack``: extra ring entries per slot (speculative decoding), part of the slots' cost.

    Raises ValueError when the budget cannot hold one ``max_model_len`` sequence.
    """
    per_block, per_slot = bytes_per_block_and_slot(cfg, block_size, dtype, backtrack)
    num_slots = max_num_seqs + 1
    left = memory_bytes - num_slots * per_slot
    num_blocks = left // max(per_block, 1) if per_block else 1 + max_num_seqs * -(-max_model_len // block_size)
    need = 1 + -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(f"KV memory budget {memory_bytes} B holds {max(num_blocks, 0)} pages of {block_size} tokens; "
                         f"one sequence of max_model_len={max_model_len} needs {need} (page {per_block} B, "
                         f"state slot {per_slot} B)")
    return CacheConfig(num_slots=num_slots, num_blocks=int(num_blocks), block_size=block_size, backtrack=backtrack)


def bytes_per_token(cfg: ModelConfig, *, kv_cache_dtype: str = "auto", dtype: Any = jnp.bfloat16) -> float:
    """Paged cache bytes per token of sequence, summed over the backbone layers: each layer that pages compressed
    rows at ratio ``r`` adds (its row bytes) / ``r`` for its compressed KV and for its index keys. The per-sequence
    rings (sliding window, compressor state) are not counted; nor is page padding.

    V4.1 (any ``kv_cache_dtype``): compressed KV in ``v41_fp4`` (``d/2 + d/16`` B), index keys in ``fp4_index``
    (``di/2 + di/32`` B), on the KV-source / index-K-source layers (890 B for V4.1-Flash, DeepInfer's figure).
    V4 with ``kv_cache_dtype="fp8"``: compressed KV in ``model1`` (584 B a row in the release) and CSA index keys in
    ``fp4_index``; with ``"auto"``: compressed KV in ``dtype`` and index keys in fp32, as :func:`cache_shapes`
    stores them (V4.1's figure is what its cache arrays hold, tested). A float because HCA ratios (128) give
    fractions of a byte; it is exact (power-of-two denominators). Raises ValueError for an unknown
    ``kv_cache_dtype`` or a head size a format cannot hold.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    d, di = cfg.head_dim, cfg.index_head_dim
    if cfg.is_v41:
        kv_row, ik_row = layout("v41_fp4", d).bytes_per_row, layout("fp4_index", di).bytes_per_row
    elif kv_cache_dtype == "fp8":
        kv_row = layout("model1", d, rope_dim=cfg.rope_head_dim).bytes_per_row
        ik_row = layout("fp4_index", di).bytes_per_row
    else:
        kv_row, ik_row = d * jnp.dtype(dtype).itemsize, di * jnp.dtype(jnp.float32).itemsize
    total = 0.0
    for layer in range(cfg.num_layers):
        info = layer_info(cfg, layer)
        if not info.ratio:
            continue
        if cfg.is_v41:
            total += (kv_row * info.kv_source + ik_row * info.has_index_k) / info.ratio
        else:
            total += (kv_row + ik_row * (info.kind == ATTN_CSA)) / info.ratio
    return total
