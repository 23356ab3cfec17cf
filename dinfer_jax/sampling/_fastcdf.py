"""Vocabulary-parallel CDF inversion with a *certificate* that it agrees with torch's sequential fp64 cumsum.

The exact emulation in ``random.py`` is sequential in the vocabulary. This module answers the same question
("first j with S_j > t", ``S`` = torch's sequentially rounded fp64 prefix sums, ``t = fl64(u * S[-1])``) with
vocabulary-parallel integer math, and says per row whether the answer is *proven* equal; rows that are not proven
go to the exact path. Notation (per row, everything non-negative):

* ``T_j``: exact real prefix sums of the fp32 inputs; ``S_j``: torch's fp64 prefix sums.
* Fixed point: ``eps = 2**(Xtop - R)`` with ``R = 60`` and every input ``< 2**Xtop``; ``F_i = floor(p_i / eps)``
  (< 2**60), ``That_j = sum F_i`` computed exactly in ``w``-bit limbs with uint32 ``cumsum`` (integer addition is
  associative, so any scan order is exact). ``0 <= T_j / eps - That_j < j + 1``.
* Rounding error of torch's sum: step i changes ``S`` by ``fl(S_{i-1} + p_i) - S_{i-1}``; its error is at most
  ``min(p_i, 2**-53 * (S_{i-1} + p_i))`` (the old value is a candidate; unit round-off), and
  ``S_{i-1} + p_i <= T_i * (1 + 2**-20)`` (the total relative error is < V * 2**-53 << 2**-20). So
  ``|S_j - T_j| <= B_j := sum_{i<=j} min(p_i, 2**-53 (1 + 2**-20) T_i)``, evaluated in fp32 with every rounding
  pushed upwards by explicit factors (fp32 cumsum in any order: relative error <= V * 2**-24 / (1 - V * 2**-24),
  covered by the factor ``1 + V * 2**-21``).
* ``that = floor(k * That_{V-1} / 2**53)`` (exact multi-limb product); ``|t / eps - that| <= Bt := V + 1 + B_{V-1}
  + 2**-52 * T'_{V-1}`` (truncation, the sum error, fp64 rounding of the product, and the floor).
* Candidate ``j* = first j with That_j > that``. It is certified when
  ``That_{j*} - that > B_{j*} + Bt`` (so ``S_{j*} > t``) and, for ``j* > 0``,
  ``that - That_{j*-1} > B_{j*-1} + j* + Bt`` (so ``S_{j*-1} <= t``, hence every earlier ``S_j <= t`` by
  monotonicity). Then ``j*`` is exactly torch's answer. An all-zero row is certified with answer 0 (the reference's
  ``argmax`` of an all-False row).

The uncertain band around each boundary is ~``V * 2**-53`` of the row total, so a row falls back with probability
of order ``V**2 * 2**-53`` at worst (~2e-6 for V = 129280, far less for concentrated distributions).
"""

from __future__ import annotations

import jax.numpy as jnp

from ._scan import cumsum_f32, cumsum_u16, cumsum_u32
from ._u64 import U32, U64, shl32, shr32, u32

R_BITS = 60
PREFIX_SUMS = ("xla", "blocked", "bytes")


def limb_width(vocab: int) -> int:
    """Bits per limb so that a uint32 cumsum of ``vocab`` limbs and the 4-term limb products cannot overflow."""
    return min(15, 32 - vocab.bit_length())


def f32_parts(bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Raw fp32 bits (uint32) -> ``(m, x)`` with value ``m * 2**x``: ``m`` uint32 < 2**24 (the implicit bit added
    for normal numbers), ``x`` int32; a set sign bit (negative values, ``-0.0``) reads as ``m = 0``."""
    neg = (bits >> u32(31)) != 0
    e = ((bits >> u32(23)) & u32(0xFF)).astype(jnp.int32)
    frac = bits & u32(0x7FFFFF)
    m = jnp.where(e == 0, frac, frac | u32(0x800000))
    return jnp.where(neg, u32(0), m), jnp.where(e == 0, -149, e - 150)


def _to_limbs64(v: U64, w: int, n: int) -> list[jnp.ndarray]:
    """Split a value < 2**(w*n) held in a U64 into n w-bit limbs."""
    out = []
    mask = u32((1 << w) - 1)
    for i in range(n):
        s = w * i
        if s >= 64:
            out.append(jnp.zeros_like(v.lo))
            continue
        if s >= 32:
            lo = shr32(v.hi, s - 32)
        else:
            lo = shr32(v.lo, s) | shl32(v.hi, 32 - s)
        out.append(lo & mask)
    return out


def _renorm(limbs: list[jnp.ndarray], w: int, extra: int = 0) -> list[jnp.ndarray]:
    """Carry-normalise limbs (each < 2**32) to w bits each, appending ``extra`` limbs for the overflow."""
    mask = u32((1 << w) - 1)
    limbs = list(limbs) + [jnp.zeros_like(limbs[0]) for _ in range(extra)]
    for i in range(len(limbs) - 1):
        c = limbs[i] >> u32(w)
        limbs[i] = limbs[i] & mask
        limbs[i + 1] = limbs[i + 1] + c
    return limbs


def _gt_limbs(a: list[jnp.ndarray], b: list[jnp.ndarray]) -> jnp.ndarray:
    """a > b for normalised limb lists (lower limbs w-bit, top limb may be wider)."""
    gt = jnp.zeros(jnp.broadcast_shapes(a[0].shape, b[0].shape), bool)
    eq = jnp.ones_like(gt)
    for x, y in zip(reversed(a), reversed(b), strict=True):
        gt = gt | (eq & (x > y))
        eq = eq & (x == y)
    return gt


def _sub_limbs(a: list[jnp.ndarray], b: list[jnp.ndarray], w: int) -> list[jnp.ndarray]:
    """a - b (a >= b) for normalised limb lists; result normalised the same way."""
    mask = (1 << w) - 1
    out, borrow = [], jnp.zeros(a[0].shape, jnp.int32)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        d = x.astype(jnp.int32) - y.astype(jnp.int32) - borrow if i < len(a) - 1 else None
        if d is None:  # top limb: wide, cannot borrow further (a >= b)
            out.append(x - y - borrow.astype(U32))
        else:
            borrow = (d < 0).astype(jnp.int32)
            out.append((d + borrow * (mask + 1)).astype(U32))
    return out


def _limbs_to_f32(limbs: list[jnp.ndarray], w: int) -> jnp.ndarray:
    """Float32 value of a normalised limb list (relative error <= len * 2**-24)."""
    acc = jnp.zeros(limbs[0].shape, jnp.float32)
    for i in reversed(range(len(limbs))):
        acc = acc + limbs[i].astype(jnp.float32) * jnp.float32(2.0 ** (w * i))
    return acc


def certified_search(bits: jnp.ndarray, k: U64, prefix: str = "xla") -> tuple[jnp.ndarray, jnp.ndarray]:
    """Vocabulary-parallel CDF inversion with a correctness certificate.

    Args:
        bits: [N, V] uint32, raw bits of fp32 probabilities (sign bit set = read as 0).
        k: [N] U64, the 53-bit uniform integers (u = k * 2**-53).
        prefix: how the row prefix sums are computed: ``"xla"`` (``jnp.cumsum``), ``"blocked"`` (fp32 block
            products, :mod:`._scan`; the integer sums are the same bits, the fp32 bound sum is another order, which
            the bound allows) or ``"bytes"`` (the integer limbs as bf16 byte products, ``_scan.cumsum_u16``; the
            fp32 bound by ``jnp.cumsum``). Speed only: a certified answer is torch's either way.
    Returns:
        (idx [N] int32, certified [N] bool): where ``certified``, ``idx`` equals the first j with
        ``S_j > fl64(u * S_{V-1})`` for torch's sequential fp64 prefix sums ``S`` (see module docstring).
    """
    n, v = bits.shape
    w = limb_width(v)
    nl = -(-R_BITS // w)  # limbs per F_i
    f32 = jnp.float32

    m, x = f32_parts(bits)
    nz = m != 0
    all_zero = ~jnp.any(nz, axis=1)
    xtop = jnp.max(jnp.where(nz, x + 24, -(1 << 20)), axis=1)
    xtop = jnp.where(all_zero, 0, xtop)
    s = x + R_BITS - xtop[:, None]  # F = floor(m * 2**s), s <= 36
    left = jnp.clip(s, 0, 36)
    right = jnp.clip(-s, 0, 31)
    m_r = jnp.where(s < -31, u32(0), shr32(m, right))
    # m << left as a U64 (left <= 36)
    f_hi = jnp.where(left >= 32, shl32(m, left - 32), shr32(m, 32 - left))
    f_lo = jnp.where(left >= 32, u32(0), shl32(m, left))
    f_hi = jnp.where(s >= 0, f_hi, u32(0))
    f_lo = jnp.where(s >= 0, f_lo, m_r)
    f = U64(f_hi, f_lo)

    # exact fixed-point prefix sums That_j, in limbs (top limb wide)
    if prefix not in PREFIX_SUMS:
        raise ValueError(f"prefix must be one of {PREFIX_SUMS}, got {prefix!r}")
    # every limb is masked to w <= 15 bits (_to_limbs64), below the 2**16 that cumsum_u16 requires
    int_cumsum = {"xla": lambda a: jnp.cumsum(a, axis=-1, dtype=U32), "blocked": cumsum_u32,
                  "bytes": cumsum_u16}[prefix]
    f32_cumsum = cumsum_f32 if prefix == "blocked" else (lambda a: jnp.cumsum(a, axis=-1))
    that = _renorm(list(int_cumsum(jnp.stack(_to_limbs64(f, w, nl)))), w)

    # target that = floor(k * That_{V-1} / 2**53)
    tot = _renorm([l[:, -1] for l in that], w, extra=-(-32 // w))
    kl = _to_limbs64(k, w, -(-53 // w))
    ncol = len(kl) + len(tot) + 1
    cols = [jnp.zeros((n,), U32) for _ in range(ncol)]
    mask = u32((1 << w) - 1)
    for i, a in enumerate(kl):
        for j, b in enumerate(tot):
            p = a * b  # < 2**30
            cols[i + j] = cols[i + j] + (p & mask)
            cols[i + j + 1] = cols[i + j + 1] + (p >> u32(w))
    prod = _renorm(cols, w)
    q, r = divmod(53, w)
    tl = []
    for i in range(len(prod) - q):
        lo = prod[i + q] >> u32(r)
        hi = ((prod[i + q + 1] << u32(w - r)) & mask) if i + q + 1 < len(prod) else jnp.zeros_like(lo)
        tl.append(lo | hi)
    # bring that's limbs to the format of That (nl limbs, top limb wide; that <= That_{V-1} fits)
    tgt = tl[: nl - 1] + [sum((tl[i] << u32(w * (i - nl + 1)) for i in range(nl - 1, len(tl)) if w * (i - nl + 1) < 32),
                             jnp.zeros_like(tl[0]))]

    above = _gt_limbs(that, [t[:, None] for t in tgt])
    found = jnp.any(above, axis=1)
    idx = jnp.argmax(above, axis=1).astype(jnp.int32)

    # --- error bounds (fp32, rounded upwards by explicit factors), in units of eps
    up = f32(1.0 + 2.0**-20)
    dn = f32(1.0 - 2.0**-20)
    j1 = jnp.arange(1, v + 1, dtype=f32)[None, :]
    that_f = (_limbs_to_f32(that, w) + j1) * up  # >= T_j / eps
    f_f = (f.hi.astype(f32) * f32(2.0**32) + f.lo.astype(f32) + 1.0) * up  # >= p_i / eps
    term = jnp.minimum(f_f, that_f * f32(2.0**-53 * (1.0 + 2.0**-18)))
    bnd = f32_cumsum(term) * f32(1.0 + v * 2.0**-21)  # >= B_j / eps (fp32 cumsum, any order)
    bt = (f32(v + 1) + bnd[:, -1] + that_f[:, -1] * f32(2.0**-52)) * up  # >= |t/eps - that|

    take = lambda a, i: jnp.take_along_axis(a, i[:, None], axis=1)[:, 0]  # noqa: E731
    prev = jnp.maximum(idx - 1, 0)
    t_at = [take(l, idx) for l in that]
    t_prev = [jnp.where(idx > 0, take(l, prev), u32(0)) for l in that]
    d1 = _limbs_to_f32(_sub_limbs(t_at, tgt, w), w) * dn
    safe_prev_ok = ~_gt_limbs(t_prev, tgt)  # guaranteed by construction of idx; guards the subtraction
    d0 = _limbs_to_f32(_sub_limbs(tgt, t_prev, w), w) * dn
    upper_ok = d1 > (take(bnd, idx) + bt) * up
    lower_ok = (idx == 0) | (safe_prev_ok & (d0 > (take(bnd, prev) + idx.astype(f32) + bt) * up))
    certified = all_zero | (found & upper_ok & lower_ok)
    idx = jnp.where(all_zero, 0, idx)
    return idx, certified
