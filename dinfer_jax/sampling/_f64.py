"""Exactly rounded, non-negative IEEE-754 binary64 arithmetic emulated with ``uint32``/``int32`` ops.

Only what DeepInfer's reference sampler needs: widening fp32 -> fp64, ``a + b`` and ``k * 2**-53 * b`` for
non-negative operands, each rounded to nearest, ties to even, exactly as IEEE hardware would (torch on CPU).

Representation (:class:`F64`): ``value = m * 2**x`` with the 53-bit mantissa ``m`` (a :class:`~._u64.U64`) either 0
or normalised to ``[2**52, 2**53)``, and ``x`` an int32 exponent; zero is ``m = 0, x = ZERO_X`` (far below any real
exponent), so ``(x, m)`` compared lexicographically orders all values, zero included. No fp64 value met here is
subnormal (fp32 inputs are >= 2**-149 and sums of <= 2**31 of them stay far from fp64's range limits), so the
emulation never needs binary64 subnormals, infinities or NaNs.

Rounding uses the textbook guard/round/sticky scheme: operands are kept with 3 extra low bits and every bit shifted
out below them is OR-ed into the lowest ("sticky") bit. For the addition of two non-negative numbers (no
cancellation) this yields the correctly rounded sum; for the product the exact 106-bit integer product is formed
first and then rounded the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from ._u64 import U32, U64, add64, add_limbs, clz_limbs, gt64, mul32_wide, shl32, shr32, shr_limbs_sticky, u32

ZERO_X = -(1 << 20)
"""Exponent that encodes the value 0 (``m`` is then 0 as well)."""


class F64(NamedTuple):
    """Non-negative binary64 values, elementwise: ``m * 2**x`` (``m`` 0 or in [2**52, 2**53))."""

    m: U64
    x: jnp.ndarray  # int32


def zeros(shape) -> F64:
    z = jnp.zeros(shape, U32)
    return F64(U64(z, z), jnp.full(shape, ZERO_X, jnp.int32))


def from_f32_bits(bits: jnp.ndarray) -> F64:
    """Exact fp32 -> fp64 widening from the raw bits (uint32) of non-negative fp32 values.

    Works on bits, never on floats, so it is exact for fp32 subnormals even where the backend flushes float
    subnormals to zero (XLA:CPU does). Values with the sign bit set (negative numbers, ``-0.0``) are read as 0.
    """
    bits = jnp.asarray(bits, U32)
    neg = (bits >> u32(31)) != 0
    e = ((bits >> u32(23)) & u32(0xFF)).astype(jnp.int32)
    f = bits & u32(0x7FFFFF)
    m = jnp.where(e == 0, f, f | u32(0x800000))
    x = jnp.where(e == 0, -149, e - 150)
    m = jnp.where(neg, u32(0), m)
    lz = lax.clz(m).astype(jnp.int32) - 8  # m < 2**24: normalise so bit 23 is set
    is_zero = m == 0
    lz = jnp.where(is_zero, 0, lz)
    m = shl32(m, lz)
    x = x - lz
    # 24-bit mantissa -> 53-bit mantissa: m * 2**29
    mant = U64(m >> u32(3), m << u32(29))
    return F64(mant, jnp.where(is_zero, ZERO_X, x - 29))


def _round_grs(s: U64, x: jnp.ndarray) -> F64:
    """Round ``s * 2**(x - 3)`` to a 53-bit mantissa, nearest-even. ``s`` is 0 or in [2**55, 2**57); its lowest
    bit is sticky."""
    over = ((s.hi >> u32(24)) & u32(1)) != 0  # bit 56 set: renormalise by one, keeping the sticky bit
    s = U64(
        jnp.where(over, s.hi >> u32(1), s.hi),
        jnp.where(over, (s.lo >> u32(1)) | (s.hi << u32(31)) | (s.lo & u32(1)), s.lo),
    )
    x = x + over.astype(jnp.int32)
    q = U64(s.hi >> u32(3), (s.lo >> u32(3)) | (s.hi << u32(29)))
    r = s.lo & u32(7)
    up = (r > 4) | ((r == 4) & ((q.lo & u32(1)) != 0))
    q = add64(q, U64(jnp.zeros_like(q.hi), up.astype(U32)))
    carry = q.hi == u32(1 << 21)  # rounded up to 2**53: becomes 2**52 with the next exponent
    q = U64(jnp.where(carry, u32(1 << 20), q.hi), q.lo)
    x = x + carry.astype(jnp.int32)
    return F64(q, x)


def add(a: F64, b: F64) -> F64:
    """``fl(a + b)``: the correctly rounded (nearest-even) sum of two non-negative values."""
    a_big = a.x >= b.x
    big_m = U64(jnp.where(a_big, a.m.hi, b.m.hi), jnp.where(a_big, a.m.lo, b.m.lo))
    sml_m = U64(jnp.where(a_big, b.m.hi, a.m.hi), jnp.where(a_big, b.m.lo, a.m.lo))
    big_x = jnp.where(a_big, a.x, b.x)
    shift = jnp.minimum(big_x - jnp.where(a_big, b.x, a.x), 63)  # 0 <= shift; >= 57 leaves only the sticky bit
    big3 = U64((big_m.hi << u32(3)) | (big_m.lo >> u32(29)), big_m.lo << u32(3))
    sml3 = U64((sml_m.hi << u32(3)) | (sml_m.lo >> u32(29)), sml_m.lo << u32(3))
    lo, hi = shr_limbs_sticky([sml3.lo, sml3.hi], shift)
    s = add64(big3, U64(hi, lo))
    return _round_grs(s, big_x)  # both zero: s = 0 rounds to m = 0 with x = ZERO_X untouched


def gt(a: F64, b: F64) -> jnp.ndarray:
    """``a > b`` (bool)."""
    return (a.x > b.x) | ((a.x == b.x) & gt64(a.m, b.m))


def mul_u53(k: U64, b: F64) -> F64:
    """``fl((k * 2**-53) * b)`` for an integer ``0 <= k < 2**53`` (so ``k * 2**-53`` is an exact fp64 in [0, 1))
    and non-negative ``b``: the exact 106-bit product ``k * b.m`` is rounded once, nearest-even."""
    m = b.m
    p00 = mul32_wide(k.lo, m.lo)
    p01 = mul32_wide(k.lo, m.hi)
    p10 = mul32_wide(k.hi, m.lo)
    p11 = mul32_wide(k.hi, m.hi)
    z = jnp.zeros_like(k.lo)
    prod = [p00.lo, p00.hi, z, z]
    prod = add_limbs(prod, [z, p01.lo, p01.hi, z])
    prod = add_limbs(prod, [z, p10.lo, p10.hi, z])
    prod = add_limbs(prod, [z, z, p11.lo, p11.hi])  # < 2**106: no carry out of limb 3
    prod8 = [shl32(prod[i], 3) | (shr32(prod[i - 1], 29) if i else z) for i in range(4)]  # 3 guard bits
    bitlen = 128 - clz_limbs(prod)
    is_zero = bitlen == 0
    sh = jnp.where(is_zero, 0, bitlen - 53)  # prod >> sh has exactly 53 bits
    r = shr_limbs_sticky(prod8, sh)
    out = _round_grs(U64(r[1], r[0]), b.x - 53 + sh)
    zx = jnp.full_like(out.x, ZERO_X)
    return F64(U64(jnp.where(is_zero, z, out.m.hi), jnp.where(is_zero, z, out.m.lo)), jnp.where(is_zero, zx, out.x))


# --- host-side helpers for tests / debugging ------------------------------------------------------------------


def to_float(v: F64):
    """Host-side: numpy float64 array of the values (for tests)."""
    import numpy as np

    m = np.asarray(v.m.hi, np.float64) * 2.0**32 + np.asarray(v.m.lo, np.float64)
    x = np.asarray(v.x, np.int64)
    return np.where(x == ZERO_X, 0.0, np.ldexp(m, np.where(x == ZERO_X, 0, x)))
