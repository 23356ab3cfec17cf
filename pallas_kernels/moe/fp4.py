"""MXFP4 (e2m1 codes, UE8M0 scales per 32 inputs) as the expert kernel decodes it.

Hopper has no FP4 conversion, so the kernel reads the packed bytes as signed 4-bit integers ``t ∈ [−8, 7]`` (XLA
packs ``int4`` low nibble first, which is the release's "low nibble = even column") and decodes with a few float
operations that are exact in bf16:

* sign: ``t < 0`` (bit 3 set); magnitude code ``c = t + 8`` then, else ``t``; ``c = 2e + m``.
* ``e2m1(c) = c/2 + relu(c/2 − 2) + relu(c − 6)`` reproduces ``0, .5, 1, 1.5, 2, 3, 4, 6`` for ``c = 0..7``
  (piecewise linear through those points, all values exact in bf16).

The kernel's default decode is cheaper still (the float version above costs more than the matrix product on the
H200, measured in docs/perf/moe_kernel_h200.md): integer bit placement. Putting the code's sign at bf16 bit 15,
its two exponent bits at bits 8–7 (the low end of the exponent field) and its mantissa bit at bit 6 gives the bf16
number ``e2m1(code) · 2^-126`` exactly — for exponent 0 (codes ±0, ±0.5) a bf16 subnormal with the same scaling.
The UE8M0 scale ``2^(S−127)`` is then applied as ``2^(S−1)``: one multiply restores both (exact; it needs the
multiply to keep subnormal inputs, which the H200 test checks on every code). Limit: ``2^(S−1)`` must be a bf16
normal number, so ``S ≤ 128`` (block scales ≤ 2, i.e. block maxima ≤ 12); larger scales overflow the exponent
field. Expert weights of trained models sit far below that (|w| ≪ 1), but the kernel does not check it at run time.

``decode_signed_codes`` is written with ``jnp`` operations only so the same function runs on Mosaic GPU register
arrays and on CPU arrays (where it is tested against the format's table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_signed_codes(t: jax.Array) -> jax.Array:
    """e2m1 value of each signed 4-bit code ``t`` (any float dtype holding integers −8..7), same dtype."""
    neg = t < 0
    c = jnp.where(neg, t + 8, t)
    h = c * 0.5
    v = h + jnp.maximum(h - 2, 0) + jnp.maximum(c - 6, 0)
    return jnp.where(neg, -v, v)


def signed_codes_to_scaled_bf16_bits(c: jax.Array) -> jax.Array:
    """int16 bit pattern of the bf16 number ``e2m1(code) · 2^-126`` for signed 4-bit codes ``c`` (int16, −8..7)."""
    return ((c & 8) << 12) | ((c & 7) << 6)


def packed_to_int4(packed: jax.Array) -> jax.Array:
    """Packed e2m1 bytes ``uint8 [..., n, k/2]`` → ``int4 [..., n, k]`` (a reinterpretation: same bytes)."""
    q = jax.lax.bitcast_convert_type(packed.astype(jnp.uint8), jnp.int4)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_fp4(packed: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Reference dequantisation: ``uint8 [..., n, k/2]``, UE8M0 ``[..., n, k/32]`` → ``dtype [..., n, k]`` (exact)."""
    t = packed_to_int4(packed).astype(jnp.float32)
    v = decode_signed_codes(t)
    s = jnp.repeat(ue8m0_to_f32(scale), 32, axis=-1)
    return (v * s).astype(dtype)


def ue8m0_to_f32(scale: jax.Array) -> jax.Array:
    """UE8M0 scale (``float8_e8m0fnu`` or its ``uint8`` bits ``S``) → fp32 ``2^(S−127)``."""
    if scale.dtype == jnp.float32:
        return scale
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint8) if scale.dtype != jnp.uint8 else scale
    return jnp.ldexp(jnp.ones(bits.shape, jnp.float32), bits.astype(jnp.int32) - 127)


def scale_bits(scale: jax.Array) -> jax.Array:
    """UE8M0 scale as its raw ``uint8`` exponent bits (what the kernel reads)."""
    if scale.dtype == jnp.uint8:
        return scale
    return jax.lax.bitcast_convert_type(scale, jnp.uint8)


def packed_pair_to_scaled_bf16x2(x: int) -> int:
    """Host model of the kernel's packed decode (``kernel_sm90_ws._decode_scale_packed``) for one byte ``x`` of
    two e2m1 codes (low nibble = even column): the uint32 holding two bf16 ``e2m1(code)·2^-126``, even column in
    the low half. The same integer steps as the kernel's registers, so CPU tests check the bit arithmetic."""
    u = (x & 0x0F) | ((x & 0xF0) << 12)             # codes into bits 0-3 and 16-19
    return ((u << 6) & 0x01C001C0) | ((u << 12) & 0x80008000)
