"""Unsigned 64-bit (and wider) integer arithmetic on pairs/lists of ``uint32`` arrays.

The sampler needs uint64 hashing and exactly rounded fp64 arithmetic, but library code must not turn on
``jax_enable_x64`` (it changes every default dtype), and a scoped x64 region cannot be lowered inside a 32-bit jit.
So 64-bit values travel as :class:`U64` ``(hi, lo)`` pairs of ``uint32`` arrays (value ``hi * 2**32 + lo``) and wider
ones as little-endian lists of ``uint32`` limbs. Everything here is plain elementwise ``uint32``/``int32`` XLA math
(wrapping multiply, logical shifts, compares), so it runs inside any jit on CPU, GPU or TPU and is exact by
construction (no floating point anywhere).

Shift amounts may be Python ints or ``int32``/``uint32`` arrays; amounts >= the width give 0 (guarded explicitly
rather than relying on backend shift semantics).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

U32 = jnp.uint32
MASK32 = 0xFFFFFFFF


def u32(x) -> jnp.ndarray:
    """``x`` as a ``uint32`` array (Python ints must be in [0, 2**32))."""
    return jnp.asarray(x, dtype=U32)


def shl32(x: jnp.ndarray, s) -> jnp.ndarray:
    """``x << s`` for uint32 ``x``; 0 when ``s >= 32``. ``s``: int or int array, ``s >= 0``."""
    if isinstance(s, int):
        return jnp.zeros_like(x) if s >= 32 else lax.shift_left(x, u32(s))
    s = jnp.asarray(s)
    return jnp.where(s >= 32, u32(0), lax.shift_left(x, jnp.minimum(s, 31).astype(U32)))


def shr32(x: jnp.ndarray, s) -> jnp.ndarray:
    """Logical ``x >> s`` for uint32 ``x``; 0 when ``s >= 32``."""
    if isinstance(s, int):
        return jnp.zeros_like(x) if s >= 32 else lax.shift_right_logical(x, u32(s))
    s = jnp.asarray(s)
    return jnp.where(s >= 32, u32(0), lax.shift_right_logical(x, jnp.minimum(s, 31).astype(U32)))


class U64(NamedTuple):
    """A uint64 array as two uint32 arrays of equal shape: value = ``hi * 2**32 + lo``."""

    hi: jnp.ndarray
    lo: jnp.ndarray


def const64(v: int, like: jnp.ndarray | None = None) -> U64:
    """Python int (taken mod 2**64) as a :class:`U64`, broadcast to ``like``'s shape if given."""
    v &= (1 << 64) - 1
    hi, lo = u32(v >> 32), u32(v & MASK32)
    if like is not None:
        hi, lo = jnp.broadcast_to(hi, like.shape), jnp.broadcast_to(lo, like.shape)
    return U64(hi, lo)


def from_int32(x: jnp.ndarray) -> U64:
    """Sign-extend an int32 array to 64 bits (two's complement), like ``torch.Tensor.to(torch.int64)``."""
    x = jnp.asarray(x, jnp.int32)
    lo = lax.bitcast_convert_type(x, U32)
    hi = jnp.where(x < 0, u32(MASK32), u32(0))
    return U64(hi, lo)


def add64(a: U64, b: U64) -> U64:
    """``a + b mod 2**64``."""
    lo = a.lo + b.lo
    carry = (lo < a.lo).astype(U32)
    return U64(a.hi + b.hi + carry, lo)


def sub64(a: U64, b: U64) -> U64:
    """``a - b mod 2**64``."""
    return U64(a.hi - b.hi - (a.lo < b.lo).astype(U32), a.lo - b.lo)


def xor64(a: U64, b: U64) -> U64:
    return U64(a.hi ^ b.hi, a.lo ^ b.lo)


def shr64(a: U64, n: int) -> U64:
    """Logical right shift by a static ``0 <= n < 64``."""
    if n == 0:
        return a
    if n >= 32:
        return U64(jnp.zeros_like(a.hi), shr32(a.hi, n - 32))
    return U64(shr32(a.hi, n), shr32(a.lo, n) | shl32(a.hi, 32 - n))


def shl64(a: U64, n: int) -> U64:
    """Left shift mod 2**64 by a static ``0 <= n < 64``."""
    if n == 0:
        return a
    if n >= 32:
        return U64(shl32(a.lo, n - 32), jnp.zeros_like(a.lo))
    return U64(shl32(a.hi, n) | shr32(a.lo, 32 - n), shl32(a.lo, n))


def mul32_wide(a: jnp.ndarray, b: jnp.ndarray) -> U64:
    """Full 64-bit product of two uint32 arrays, via 16-bit halves (every partial product fits in uint32)."""
    a0, a1 = a & u32(0xFFFF), a >> u32(16)
    b0, b1 = b & u32(0xFFFF), b >> u32(16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> u32(16)) + (p01 & u32(0xFFFF)) + (p10 & u32(0xFFFF))  # < 3 * 2**16
    lo = (mid << u32(16)) | (p00 & u32(0xFFFF))
    hi = p11 + (p01 >> u32(16)) + (p10 >> u32(16)) + (mid >> u32(16))
    return U64(hi, lo)


def mul64(a: U64, b: U64) -> U64:
    """``a * b mod 2**64`` (uint32 multiplies wrap mod 2**32)."""
    p = mul32_wide(a.lo, b.lo)
    return U64(p.hi + a.hi * b.lo + a.lo * b.hi, p.lo)


def gt64(a: U64, b: U64) -> jnp.ndarray:
    """Unsigned ``a > b``."""
    return (a.hi > b.hi) | ((a.hi == b.hi) & (a.lo > b.lo))


# --- little-endian limb lists (for 128-bit products) -----------------------------------------------------------


def add_limbs(a: list[jnp.ndarray], b: list[jnp.ndarray]) -> list[jnp.ndarray]:
    """``a + b`` for equal-length limb lists; the final carry is dropped (callers size the lists to avoid it)."""
    out, carry = [], None
    for x, y in zip(a, b, strict=True):
        s = x + y
        c = (s < x).astype(U32)
        if carry is not None:
            s2 = s + carry
            c = c + (s2 < s).astype(U32)
            s = s2
        out.append(s)
        carry = c
    return out


def clz_limbs(a: list[jnp.ndarray]) -> jnp.ndarray:
    """Leading zero count (int32) of a limb list; ``32 * len(a)`` for zero."""
    total = jnp.zeros(a[0].shape, jnp.int32)
    still_zero = jnp.ones(a[0].shape, bool)
    for limb in reversed(a):
        z = lax.clz(limb).astype(jnp.int32)
        total = total + jnp.where(still_zero, z, 0)
        still_zero = still_zero & (limb == 0)
    return total


def shr_limbs_sticky(a: list[jnp.ndarray], s: jnp.ndarray) -> list[jnp.ndarray]:
    """Logical right shift of a limb list by per-element ``0 <= s < 32 * len(a)`` (int32 array); bit 0 of the
    result is OR-ed with every bit shifted out ("sticky" bit for round-to-nearest-even)."""
    n = len(a)
    s = jnp.asarray(s, jnp.int32)
    ws, bs = s >> 5, s & 31
    zero = jnp.zeros_like(a[0])

    def limb_at(i: int, w_off: int) -> jnp.ndarray:
        # a[i + ws + w_off] with ws dynamic (0 outside the list)
        r = zero
        for w in range(n):
            j = i + w + w_off
            if 0 <= j < n:
                r = jnp.where(ws == w, a[j], r)
        return r

    out = [shr32(limb_at(i, 0), bs) | shl32(limb_at(i, 1), 32 - bs) for i in range(n)]
    lost = jnp.zeros(a[0].shape, bool)
    for j in range(n):
        nbits = jnp.clip(s - 32 * j, 0, 32)  # bits of limb j that fall below position s
        mask = jnp.where(nbits >= 32, u32(MASK32), shl32(u32(1), nbits) - u32(1))
        lost = lost | ((a[j] & mask) != 0)
    out[0] = out[0] | lost.astype(U32)
    return out
