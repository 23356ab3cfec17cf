"""FP8 block-scaled linear layer: the contract of :mod:`pallas_kernels.linear.kernel_sm90`, in ``jnp``.

DeepSeek's released FP8 linears store ``W [N, K]`` as e4m3 codes with one UE8M0 scale (a power of two) per block
of ``bo × bi`` (V4: 128 × 128, V4.1: 32 × 32): ``W[n, k] = e4m3(codes[n, k]) · 2^(S[n // bo, k // bi] − 127)``.
The layer computes ``y = x · Wᵀ`` for bf16 activations ``x [M, K]`` with fp32 accumulation.

The dequantised weight is exact in bf16 (a 4-bit significand times a power of two, well inside bf16's range for
trained weights), so the kernel's products ``bf16(x) · bf16(W)`` are exact in fp32 and only the order of the fp32
sums differs from this reference.

The kernel's decode places the code's bits in a bf16 bit pattern (:func:`e4m3_bits_to_scaled_bf16_bits`): sign at
bit 15, the 7 exponent-and-mantissa bits at bits 10–4, i.e. the low end of bf16's 8-bit exponent field and the top
of its mantissa. That bf16 number is exactly ``e4m3(code) · 2^-120`` for every finite code — normal codes
``2^(e−7)(1 + m/8)`` become ``2^(e−127)(1 + m/8)``, subnormal codes ``2^-6 · m/8`` become the bf16 subnormal
``2^-126 · m/8`` — and the scale multiply ``2^(S − 127 + 120)`` restores it. Limits: that multiplier must be a
bf16 normal number, so ``S ≤ 134`` (block scales ≤ 2^7); e4m3's NaN codes (``0x7F``, ``0xFF``) decode to ±480
instead of NaN. Released weights' scales are far below the limit (block maxima ≪ 448 · 2^7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128           # V4's FP8 weight block: 128 output rows × 128 inputs share one scale (V4.1: 32 × 32)
SCALE_BIAS = 120      # the decoded bf16 carries 2^-120; the kernel multiplies by 2^(S − 127 + SCALE_BIAS)


def e4m3_bits_to_scaled_bf16_bits(c: jax.Array) -> jax.Array:
    """int16 bit pattern of the bf16 number ``e4m3(code) · 2^-120`` for e4m3 codes ``c`` held in int16 (0..255).

    Written with ``jnp`` integer operations only, so the same function runs on the kernel's register arrays and
    on CPU arrays (where it is tested against the format's definition)."""
    return ((c & 0x80) << 8) | ((c & 0x7F) << 4)


def ue8m0_bits(scale: jax.Array) -> jax.Array:
    """UE8M0 scale (``float8_e8m0fnu`` or its ``uint8`` bits) → the exponent bits ``S`` as ``uint8``."""
    if scale.dtype == jnp.uint8:
        return scale
    if scale.dtype != jnp.float8_e8m0fnu:
        raise ValueError(f"the FP8 linear kernel takes UE8M0 block scales, got {scale.dtype}")
    return jax.lax.bitcast_convert_type(scale, jnp.uint8)


def dequantize(codes: jax.Array, scale: jax.Array, block: tuple[int, int] = (BLOCK, BLOCK),
               dtype=jnp.float32) -> jax.Array:
    """``codes`` e4m3 ``[N, K]`` and UE8M0 ``scale`` ``[⌈N/bo⌉, ⌈K/bi⌉]`` → ``W`` ``[N, K]`` in ``dtype`` (exact)."""
    n, k = codes.shape
    s = jnp.ldexp(jnp.ones(scale.shape, jnp.float32), ue8m0_bits(scale).astype(jnp.int32) - 127)
    s = jnp.repeat(jnp.repeat(s, block[0], axis=0)[:n], block[1], axis=1)[:, :k]
    return (codes.astype(jnp.float32) * s).astype(dtype)


def fp8_linear(x: jax.Array, codes: jax.Array, scale: jax.Array,
               block: tuple[int, int] = (BLOCK, BLOCK)) -> jax.Array:
    """``x [M, K]`` (bf16 or fp32) times the dequantised ``Wᵀ`` → fp32 ``[M, N]``, fp32 accumulation."""
    w = dequantize(codes, scale, block, jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)


__all__ = ["BLOCK", "SCALE_BIAS", "dequantize", "e4m3_bits_to_scaled_bf16_bits", "fp8_linear", "ue8m0_bits"]
