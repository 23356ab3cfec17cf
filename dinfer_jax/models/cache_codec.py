"""How cache rows are stored: as the values the model computes, or in DeepInfer's byte formats.

V4.1 (with ``kv_fake_quant``, the reference numerics) rounds its sliding-window KV to Q8, its compressed KV to Q4e
and its index keys to Q4u before caching them. Those values have exact byte forms
(:mod:`dinfer_jax.engine.kv_formats`, ``docs/kv_formats.md``), so the V4.1 caches store bytes — 528 / 288 / 68 B a
row at the release widths instead of 1024 (bf16) or 2048 (fp32) — and decode them on read: the model sees exactly
the values it computed (``decode(encode(x)) == fake_quant(x)``, tested), at DeepInfer's memory cost.

A stored row is one uint8 vector ``[data bytes | scale bytes]``. V4 (whose reference does not quantise its cache)
and V4.1 without ``kv_fake_quant`` keep plain values — on CPU, values of a float type narrower than 32 bits as
their bits (an unsigned integer of the same width): XLA:CPU has no bf16 scatter or dynamic-update-slice, and its
float normalisation widens the whole array to f32 around each write and narrows it back, so a bf16 page pool was
converted twice per step (a batch-8 decode step of a tiny V4 slice: 307 ms with a 1 GiB pool against 0.3 ms in
f32). Integer writes are done in place, and a read bit-casts only the rows it gathered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dinfer_jax.models.config import ModelConfig

U8 = jnp.uint8
# the unsigned integer of each narrow float width, for rows stored as their bits (RowCodec.bit_view)
_BITS = {1: jnp.uint8, 2: jnp.uint16}


def stores_bits(dtype: Any) -> bool:
    """Whether plain rows of ``dtype`` are stored as their bits: floats narrower than 32 bits when jax's default
    backend is the CPU (module docstring)."""
    dt = jnp.dtype(dtype)
    return jax.default_backend() == "cpu" and jnp.issubdtype(dt, np.floating) and dt.itemsize in _BITS


@dataclasses.dataclass(frozen=True)
class RowCodec:
    """Storage of one cache's rows of ``width`` values read back in ``dtype``.

    ``fmt`` None: rows stored as ``dtype`` values, or with ``bit_view`` as their bits (an unsigned integer of
    ``dtype``'s width; :func:`stores_bits`). Else a :mod:`~dinfer_jax.engine.kv_formats` format: rows stored
    as uint8 ``[row_bytes]``; :meth:`pack` takes the rows *before* the model's fake quantisation (encoding the
    already rounded values is not the same for Q4e), :meth:`unpack` returns the rounded values.
    """

    width: int
    dtype: Any
    fmt: str | None = None
    reciprocal: bool = True
    rope_dim: int = 64  # model1: trailing dims stored as bf16
    bit_view: bool = False

    @property
    def stored(self) -> tuple[int, Any]:
        """(last dimension, dtype) of the stored array."""
        if self.fmt is None:
            dt = jnp.dtype(self.dtype)
            return self.width, (jnp.dtype(_BITS[dt.itemsize]) if self.bit_view else dt)
        from dinfer_jax.engine.kv_formats import layout

        return layout(self.fmt, self.width, rope_dim=self.rope_dim).bytes_per_row, jnp.dtype(U8)

    def pack(self, x: jax.Array) -> jax.Array:
        """Rows ``[..., width]`` → stored ``[..., stored[0]]``."""
        if self.fmt is None:
            x = x.astype(self.dtype)
            return lax.bitcast_convert_type(x, self.stored[1]) if self.bit_view else x
        from dinfer_jax.engine.kv_formats import encode

        data, scales = encode(x, self.fmt, reciprocal=self.reciprocal, rope_dim=self.rope_dim)
        return jnp.concatenate([data, scales], axis=-1)

    def unpack(self, stored: jax.Array) -> jax.Array:
        """Stored ``[..., stored[0]]`` → values ``[..., width]`` in ``dtype``."""
        if self.fmt is None:
            if self.bit_view:
                return lax.bitcast_convert_type(stored, self.dtype)
            return stored.astype(self.dtype)
        from dinfer_jax.engine.kv_formats import decode, layout

        nd = layout(self.fmt, self.width, rope_dim=self.rope_dim).data_bytes
        return decode(stored[..., :nd], stored[..., nd:], self.fmt, dtype=self.dtype, rope_dim=self.rope_dim)


@dataclasses.dataclass(frozen=True)
class CacheCodecs:
    """Codecs of a model's cached rows: ``swa`` (sliding-window ring), ``ckv`` (paged compressed KV), ``ik``
    (V4.1 paged index keys) and ``ikv`` (V4 CSA paged index keys)."""

    swa: RowCodec
    ckv: RowCodec
    ik: RowCodec
    ikv: RowCodec

    @property
    def packed(self) -> bool:
        return self.swa.fmt is not None


def cache_codecs(cfg: ModelConfig, dtype: Any) -> CacheCodecs:
    """The storage of ``cfg``'s caches for activations in ``dtype``: V4.1 with ``kv_fake_quant`` in byte formats
    (``v41`` ring, ``v41_fp4`` compressed KV quantised with ``x / s`` as the model's Q4e does, ``fp4_index`` keys);
    V4 with ``kv_fake_quant`` (``LLM(kv_cache_dtype="fp8")``) in FlashMLA's ``model1`` (ring and compressed KV) and
    ``fp4_index`` (CSA index keys, Hadamard-rotated); otherwise values (KV in ``dtype``, index keys in fp32), as
    before byte caches existed — on CPU a 16-bit KV as its bits (:func:`stores_bits`)."""
    dt = jnp.dtype(dtype)
    d, di = cfg.head_dim, cfg.index_head_dim
    if cfg.is_v41 and cfg.kv_fake_quant:
        return CacheCodecs(swa=RowCodec(d, dt, "v41"), ckv=RowCodec(d, dt, "v41_fp4", reciprocal=False),
                           ik=RowCodec(di, jnp.float32, "fp4_index"), ikv=RowCodec(di, jnp.float32))
    if cfg.kv_fake_quant:
        r = cfg.rope_head_dim
        return CacheCodecs(swa=RowCodec(d, dt, "model1", rope_dim=r), ckv=RowCodec(d, dt, "model1", rope_dim=r),
                           ik=RowCodec(di, jnp.float32), ikv=RowCodec(di, jnp.float32, "fp4_index"))
    bits = stores_bits(dt)
    return CacheCodecs(swa=RowCodec(d, dt, bit_view=bits), ckv=RowCodec(d, dt, bit_view=bits),
                       ik=RowCodec(di, jnp.float32), ikv=RowCodec(di, jnp.float32))
