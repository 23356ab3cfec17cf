"""DeepInfer's KV-cache byte formats (``docs/spec/engine.md`` §12.1, ``docs/kv_formats.md``): encode / decode.

One cache row ``x [..., D]`` becomes two uint8 arrays, ``data [..., data_bytes]`` and ``scales [..., scale_bytes]``:

========== ====================== ============================== ================================= ===============
format     used for               data (per row)                 scales (per row)                  release (D)
========== ====================== ============================== ================================= ===============
v41        V4.1 SWA ring          ``D`` e4m3 codes               ``D/32`` UE8M0 exponent bytes     512 + 16 = 528
v41_fp4    V4.1 compressed KV     ``D/2`` packed e2m1            ``D/16`` e4m3 scales              256 + 32 = 288
fp4_index  indexer keys           ``D/2`` packed e2m1            ``D/32`` UE8M0 exponent bytes      64 +  4 =  68
model1     V4 KV (FlashMLA)       ``N`` e4m3 + ``R`` bf16 (2R B) ``N/64`` UE8M0 bytes + 1 zero pad  576 +  8 = 584
========== ====================== ============================== ================================= ===============

(``model1``: ``N = D − R`` non-RoPE dims, ``R = rope_dim``, 448 + 64 in the release.) Packed e2m1 holds element
``2i`` in the low nibble of byte ``i``; bit 3 of a nibble is the sign. A UE8M0 byte ``b`` means ``2^(b − 127)``.
Where DeepInfer's row is ``[data | scales]`` (v41, v41_fp4) or its page is ``[all data rows][all scale rows]``
(fp4_index, model1) is a question of placement in a page, not of these bytes; see ``docs/kv_formats.md``.

Quantisation (``docs/spec/model-v41.md`` §2): v41 = Q8 (``a = max(amax, 1e−4)``, ``s = pow2ceil(a/448)``); fp4_index
= Q4u (``a = max(amax, 6·2^−126)``, ``s = pow2ceil(a/6)``); v41_fp4 = Q4e (``s = e4m3(min(max(amax, 6·2^−9)·(1/6),
448))``, codes of ``x·(1/s)`` like DeepInfer, or of ``x/s`` with ``reciprocal=False`` like the model's parity path);
model1 = FlashMLA's ``s = pow2ceil(max(amax/448, 1e−4))`` per 64 dims, RoPE dims copied as bf16. With the default
arguments the bytes equal DeepInfer's ``ref_cast_from_bf16`` (v41, v41_fp4, fp4_index) and FlashMLA's
``quantize_k_cache`` (model1) on bf16 input; ``decode(*encode(x))`` equals :mod:`dinfer_jax.models.fake_quant`'s
``q8_fake`` / ``q4u_fake`` / ``q4e_fake`` of ``x`` (with matching ``reciprocal``) for bf16 and fp32 input.

Division by a power-of-two scale is done on the integer fields of ``x`` (exact even for subnormal ``x`` on backends
that flush them, such as XLA:CPU). Inputs must be finite (the caches never see NaN / ±inf). UE8M0 bytes are never 0
or 255 for finite input. Pure ``jnp``; ``fmt`` and the keyword arguments are static under ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models import fake_quant as fq

F32 = jnp.float32
U8 = jnp.uint8

FORMATS = ("v41", "v41_fp4", "fp4_index", "model1")
MODEL1_TILE = 64  # non-RoPE dims per UE8M0 scale in FlashMLA's MODEL1
MODEL1_SCALE_MIN = 1e-4  # FlashMLA clamps amax/448 (not amax) at 1e-4
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code 0..7; bit 3 is the sign


@dataclasses.dataclass(frozen=True)
class ByteLayout:
    """Bytes of one row of ``width`` values in ``fmt``: ``data_bytes + scale_bytes = bytes_per_row``."""

    fmt: str
    width: int
    data_bytes: int
    scale_bytes: int
    rope_dim: int = 0  # model1 only

    @property
    def bytes_per_row(self) -> int:
        return self.data_bytes + self.scale_bytes


def _need(cond: bool, fmt: str, width: int, what: str) -> None:
    if not cond:
        raise ValueError(f"KV format {fmt!r} cannot hold rows of width {width}: {what}")


def layout(fmt: str, width: int, *, rope_dim: int = 64) -> ByteLayout:
    """The :class:`ByteLayout` of ``fmt`` for rows of ``width`` values; ValueError names what is unsupported.

    Widths: v41 a positive multiple of 32; v41_fp4 of 16; fp4_index of 32; model1 ``width − rope_dim`` a positive
    multiple of 64 with ``rope_dim`` positive (``rope_dim`` is ignored by the other formats).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"KV format {fmt!r}: row width must be a positive int, got {width!r}")
    if fmt == "v41":
        _need(width % 32 == 0, fmt, width, "needs a multiple of 32 (one UE8M0 scale per 32 e4m3 codes)")
        return ByteLayout(fmt, width, width, width // 32)
    if fmt == "v41_fp4":
        _need(width % 16 == 0, fmt, width, "needs a multiple of 16 (one e4m3 scale per 16 e2m1 codes)")
        return ByteLayout(fmt, width, width // 2, width // 16)
    if fmt == "fp4_index":
        _need(width % 32 == 0, fmt, width, "needs a multiple of 32 (one UE8M0 scale per 32 e2m1 codes)")
        return ByteLayout(fmt, width, width // 2, width // 32)
    nope = width - rope_dim
    _need(isinstance(rope_dim, int) and rope_dim > 0, fmt, width, f"rope_dim must be a positive int, got {rope_dim!r}")
    _need(nope > 0 and nope % MODEL1_TILE == 0, fmt, width,
          f"the {nope} non-RoPE dims (width − rope_dim {rope_dim}) must be a positive multiple of {MODEL1_TILE}")
    return ByteLayout(fmt, width, nope + 2 * rope_dim, nope // MODEL1_TILE + 1, rope_dim)


# --- helpers ----------------------------------------------------------------------------------------------------


def _check_input(x: jax.Array, fmt: str) -> None:
    if x.ndim < 1:
        raise ValueError(f"encode({fmt!r}): x must have a last (feature) axis, got a scalar")
    if x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(F32)):
        raise TypeError(f"encode({fmt!r}): x must be bfloat16 or float32, got {x.dtype}")


def _f32_bits(x: jax.Array) -> jax.Array:
    """fp32 bit pattern (uint32) of bf16 / fp32 ``x`` without a float operation (no denormal flushing)."""
    if x.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _exact_div(num: jax.Array, den: float) -> jax.Array:
    """IEEE ``num / den`` (fp32); the barrier stops XLA from turning it into a multiplication by ``1/den``."""
    return num / jax.lax.optimization_barrier(jnp.full(num.shape, den, F32))


def _blocks(a: jax.Array, block: int) -> jax.Array:
    return a.reshape(*a.shape[:-1], a.shape[-1] // block, block)


def _block_amax(x: jax.Array, block: int) -> jax.Array:
    """``max |x|`` per block: ``[..., D]`` → fp32 ``[..., D/block, 1]``."""
    return jnp.max(jnp.abs(_blocks(x.astype(F32), block)), axis=-1, keepdims=True)


def _div_pow2(bits: jax.Array, k: jax.Array, block: int) -> jax.Array:
    """``x · 2^−k`` in fp32 from ``x``'s fp32 bits ``[..., D]`` and exponents ``k [..., D/block, 1]`` (int32).

    ``x = ±M · 2^(e − 150)`` with integer ``M < 2^24`` is rebuilt as ``M · 2^(e − 150 − k)``, exact and never
    subnormal: results below ``2^−36`` (which round to 0 on every e4m3 / e2m1 grid) are returned as signed 0.
    """
    b = _blocks(bits, block)
    e = ((b >> 23) & 0xFF).astype(jnp.int32)
    man = (b & 0x7FFFFF).astype(jnp.int32)
    m = jnp.where(e > 0, man | 0x800000, man).astype(F32)
    t = jnp.maximum(e, 1) - 150 - k
    y = jnp.where(t < -60, 0.0, m * _exp2(jnp.clip(t, -60, 127)))
    y = jnp.where((b >> 31) != 0, -y, y)
    return y.reshape(bits.shape)


def _exp2(k: jax.Array) -> jax.Array:
    """``2^k`` (fp32) for int32 ``k`` in [−126, 127], from the exponent bits (exact, no float operation)."""
    return jax.lax.bitcast_convert_type((k + 127) << 23, F32)


def _e4m3_bytes(q: jax.Array) -> jax.Array:
    """e4m3fn codes (uint8) of fp32 values already on the e4m3 grid."""
    return jax.lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), U8)


def _e2m1_packed(q: jax.Array) -> jax.Array:
    """Packed e2m1 bytes ``[..., D/2]`` of fp32 grid values ``q [..., D]`` (even element in the low nibble)."""
    a = jnp.abs(q)
    mag = jnp.where(a < 2, 2 * a, jnp.where(a < 4, a + 2, a / 2 + 4)).astype(U8)
    code = mag | (jnp.signbit(q).astype(U8) << 3)
    pairs = code.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _e2m1_values(packed: jax.Array) -> jax.Array:
    """fp32 values ``[..., 2·B]`` of packed e2m1 bytes ``[..., B]``."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    mag = jnp.asarray(E2M1_VALUES, F32)[(codes & 7).astype(jnp.int32)]
    return jnp.where((codes & 8) != 0, -mag, mag)


def _ue8m0_scale(b: jax.Array) -> jax.Array:
    """``2^(b − 127)`` (fp32) of UE8M0 bytes ``b`` in 1 … 254."""
    return _exp2(b.astype(jnp.int32) - 127)


def _pow2_encode(x: jax.Array, block: int, amax_min: float, qmax: float, fp4: bool) -> tuple[jax.Array, jax.Array]:
    """Q8 (``fp4=False``) / Q4u (``fp4=True``) bytes of ``x [..., D]``."""
    a = jnp.maximum(_block_amax(x, block), jnp.asarray(amax_min, F32))
    k = fq.pow2ceil_exponent(_exact_div(a, qmax))  # [..., D/block, 1]
    y = _div_pow2(_f32_bits(x), k, block)
    if fp4:
        data = _e2m1_packed(fq.e2m1_rne(y))
    else:
        data = _e4m3_bytes(fq.e4m3_rne(jnp.clip(y, -qmax, qmax)))
    return data, (k[..., 0] + 127).astype(U8)


def _scaled(q: jax.Array, s: jax.Array, block: int, dtype: Any) -> jax.Array:
    """``q [..., D] · s [..., D/block]`` (exact in fp32) cast to ``dtype``."""
    return (_blocks(q, block) * s[..., None]).reshape(q.shape).astype(dtype)


# --- public API -------------------------------------------------------------------------------------------------


def encode(x: jax.Array, fmt: str, *, rope_dim: int = 64, reciprocal: bool = True) -> tuple[jax.Array, jax.Array]:
    """Rows ``x [..., D]`` (bfloat16 or float32) → ``(data [..., data_bytes], scales [..., scale_bytes])`` uint8.

    ``fmt`` ∈ :data:`FORMATS`; byte counts from :func:`layout`. ``reciprocal`` (v41_fp4 only; the other formats'
    scales are powers of two, where both divisions agree): ``True`` quantises ``x · fp32(1/s)`` as DeepInfer does,
    ``False`` quantises ``x / s`` as the model's ``q4e_fake`` does by default. ``rope_dim``: model1 only (the
    trailing dims stored as bf16; float32 input is rounded to bf16 there). Raises ValueError / TypeError for an
    unsupported width or dtype.
    """
    x = jnp.asarray(x)
    _check_input(x, fmt)
    lay = layout(fmt, x.shape[-1], rope_dim=rope_dim)
    if fmt == "v41":
        return _pow2_encode(x, 32, fq.Q8_AMAX_MIN, fq.E4M3_MAX, fp4=False)
    if fmt == "fp4_index":
        return _pow2_encode(x, 32, fq.Q4U_AMAX_MIN, fq.E2M1_MAX, fp4=True)
    if fmt == "v41_fp4":
        q, s = fq.q4e_quantize(x, 16, reciprocal=reciprocal)
        return _e2m1_packed(q), _e4m3_bytes(s)
    nope = x[..., : lay.width - lay.rope_dim]
    a = jnp.maximum(_exact_div(_block_amax(nope, MODEL1_TILE), fq.E4M3_MAX), jnp.asarray(MODEL1_SCALE_MIN, F32))
    k = fq.pow2ceil_exponent(a)
    y = _div_pow2(_f32_bits(nope), k, MODEL1_TILE)
    codes = _e4m3_bytes(fq.e4m3_rne(jnp.clip(y, -fq.E4M3_MAX, fq.E4M3_MAX)))
    rope = jax.lax.bitcast_convert_type(x[..., lay.width - lay.rope_dim:].astype(jnp.bfloat16), jnp.uint16)
    rope_bytes = jnp.stack([(rope & 0xFF).astype(U8), (rope >> 8).astype(U8)], axis=-1)
    data = jnp.concatenate([codes, rope_bytes.reshape(*rope.shape[:-1], 2 * lay.rope_dim)], axis=-1)
    scales = jnp.concatenate([(k[..., 0] + 127).astype(U8), jnp.zeros((*x.shape[:-1], 1), U8)], axis=-1)
    return data, scales


def decode(data: jax.Array, scales: jax.Array, fmt: str, *, rope_dim: int = 64,
           dtype: Any = jnp.bfloat16) -> jax.Array:
    """Inverse of :func:`encode`: uint8 ``data [..., data_bytes]``, ``scales [..., scale_bytes]`` → ``[..., D]`` in
    ``dtype`` (bfloat16 by default; every decoded value is exact in bf16 and fp32, except that backends which flush
    subnormals return 0 for fp4_index values below 2^−126). Raises ValueError on shapes that do not match ``fmt``.
    """
    data, scales = jnp.asarray(data), jnp.asarray(scales)
    if data.dtype != U8 or scales.dtype != U8:
        raise TypeError(f"decode({fmt!r}): data and scales must be uint8, got {data.dtype} and {scales.dtype}")
    if data.ndim < 1 or data.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"decode({fmt!r}): data {data.shape} and scales {scales.shape} must share leading dims")
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV format {fmt!r}; expected one of {', '.join(FORMATS)}")
    nb = data.shape[-1]
    width = {"v41": nb, "v41_fp4": 2 * nb, "fp4_index": 2 * nb}.get(fmt, nb - rope_dim)
    lay = layout(fmt, width, rope_dim=rope_dim)
    if (lay.data_bytes, lay.scale_bytes) != (nb, scales.shape[-1]):
        raise ValueError(f"decode({fmt!r}): got {nb} data and {scales.shape[-1]} scale bytes per row; width {width} "
                         f"needs {lay.data_bytes} and {lay.scale_bytes}")
    if fmt == "v41":
        q = jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn).astype(F32)
        return _scaled(q, _ue8m0_scale(scales), 32, dtype)
    if fmt == "fp4_index":
        return _scaled(_e2m1_values(data), _ue8m0_scale(scales), 32, dtype)
    if fmt == "v41_fp4":
        s = jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(F32)
        return _scaled(_e2m1_values(data), s, 16, dtype)
    n_nope = width - rope_dim
    q = jax.lax.bitcast_convert_type(data[..., :n_nope], jnp.float8_e4m3fn).astype(F32)
    nope = _scaled(q, _ue8m0_scale(scales[..., :-1]), MODEL1_TILE, dtype)
    rb = data[..., n_nope:].reshape(*data.shape[:-1], rope_dim, 2).astype(jnp.uint16)
    rope = jax.lax.bitcast_convert_type(rb[..., 0] | (rb[..., 1] << 8), jnp.bfloat16).astype(dtype)
    return jnp.concatenate([nope, rope], axis=-1)
