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

from typing import NamedTuple

import jax.numpy as jnp

from ._scan import cumsum_f32, cumsum_u16, cumsum_u32
from ._u64 import U32, U64, shl32, shr32, u32

R_BITS = 60
PREFIX_SUMS = ("xla", "blocked", "bytes", "two_level")
SEARCH_BLOCK = 256
"""Columns per block of ``prefix="two_level"``'s search (about the square root of the V4 vocabulary)."""


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


def _fixed_point(bits: jnp.ndarray, xtop: jnp.ndarray) -> U64:
    """``F_i = floor(p_i / eps)`` (< 2**60) as a U64, with ``eps = 2**(xtop - R_BITS)`` per row. bits: [N, ...]
    uint32 fp32 bits; xtop: [N] int32, every input ``< 2**xtop``."""
    m, x = f32_parts(bits)
    s = x + R_BITS - xtop.reshape(xtop.shape + (1,) * (bits.ndim - 1))  # F = floor(m * 2**s), s <= 36
    left = jnp.clip(s, 0, 36)
    right = jnp.clip(-s, 0, 31)
    m_r = jnp.where(s < -31, u32(0), shr32(m, right))
    # m << left as a U64 (left <= 36)
    f_hi = jnp.where(left >= 32, shl32(m, left - 32), shr32(m, 32 - left))
    f_lo = jnp.where(left >= 32, u32(0), shl32(m, left))
    return U64(jnp.where(s >= 0, f_hi, u32(0)), jnp.where(s >= 0, f_lo, m_r))


def _fp_upper(f: U64) -> jnp.ndarray:
    """fp32 upper bound of ``p_i / eps`` (the truncated ``F_i`` plus one, rounded upwards)."""
    return (f.hi.astype(jnp.float32) * jnp.float32(2.0**32) + f.lo.astype(jnp.float32) + 1.0) * _UP


_UP = float(1.0 + 2.0**-20)
_DN = float(1.0 - 2.0**-20)
_SUM_ERR = float(2.0**-53 * (1.0 + 2.0**-18))  # torch's fp64 unit round-off, with the (1 + 2**-20) slack


def _target(tot: list[jnp.ndarray], k: U64, w: int, nl: int) -> list[jnp.ndarray]:
    """``that = floor(k * That_{V-1} / 2**53)`` in the limb format of ``That`` (nl limbs, top limb wide), from the
    normalised total ``tot`` ([N] limbs) and the 53-bit uniform integers ``k`` [N]."""
    n = k.lo.shape[0]
    tot = _renorm(tot, w, extra=-(-32 // w))
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
    # that <= That_{V-1} fits nl limbs with a wide top limb
    return tl[: nl - 1] + [sum((tl[i] << u32(w * (i - nl + 1)) for i in range(nl - 1, len(tl))
                                if w * (i - nl + 1) < 32), jnp.zeros_like(tl[0]))]


class _Located(NamedTuple):
    """What the certificate needs from a search: per row [N], limb lists normalised like ``That``."""

    idx: jnp.ndarray        # int32 candidate j* (first j with That_j > that; 0 when none)
    found: jnp.ndarray      # bool: some That_j > that
    tgt: list               # that
    t_at: list              # That_{j*}
    t_prev: list            # That_{j*-1} (0 where j* = 0)
    bnd_at: jnp.ndarray     # fp32 >= B_{j*} / eps
    bnd_prev: jnp.ndarray   # fp32 >= B_{j*-1} / eps
    bnd_all: jnp.ndarray    # fp32 >= B_{V-1} / eps
    tot_f: jnp.ndarray      # fp32 >= T_{V-1} / eps


def _take(a: jnp.ndarray, i: jnp.ndarray) -> jnp.ndarray:
    return jnp.take_along_axis(a, i[:, None], axis=1)[:, 0]


def _locate_full(f: U64, k: U64, w: int, nl: int, prefix: str) -> _Located:
    """Every prefix sum ``That_j`` of the row (one scan over [limbs, N, V]), then the first above the target."""
    v = f.lo.shape[1]
    f32 = jnp.float32
    # every limb is masked to w <= 15 bits (_to_limbs64), below the 2**16 that cumsum_u16 requires
    int_cumsum = {"xla": lambda a: jnp.cumsum(a, axis=-1, dtype=U32), "blocked": cumsum_u32,
                  "bytes": cumsum_u16}[prefix]
    f32_cumsum = cumsum_f32 if prefix == "blocked" else (lambda a: jnp.cumsum(a, axis=-1))
    that = _renorm(list(int_cumsum(jnp.stack(_to_limbs64(f, w, nl)))), w)
    tgt = _target([l[:, -1] for l in that], k, w, nl)

    above = _gt_limbs(that, [t[:, None] for t in tgt])
    found = jnp.any(above, axis=1)
    idx = jnp.argmax(above, axis=1).astype(jnp.int32)

    # error bounds (fp32, rounded upwards by explicit factors), in units of eps
    j1 = jnp.arange(1, v + 1, dtype=f32)[None, :]
    that_f = (_limbs_to_f32(that, w) + j1) * f32(_UP)  # >= T_j / eps
    term = jnp.minimum(_fp_upper(f), that_f * f32(_SUM_ERR))
    bnd = f32_cumsum(term) * f32(1.0 + v * 2.0**-21)  # >= B_j / eps (fp32 cumsum, any order)
    prev = jnp.maximum(idx - 1, 0)
    return _Located(idx, found, tgt, [_take(l, idx) for l in that],
                    [jnp.where(idx > 0, _take(l, prev), u32(0)) for l in that],
                    _take(bnd, idx), _take(bnd, prev), bnd[:, -1], that_f[:, -1])


def _locate_two_level(bits: jnp.ndarray, xtop: jnp.ndarray, k: U64, w: int, nl: int) -> _Located:
    """The same candidate without the row's full prefix sums: exact integer totals of blocks of ``SEARCH_BLOCK``
    columns and their prefix sums (a scan over V / block entries) find the block holding ``j*``; only that block's
    prefix sums are formed. The rounding bound of columns in earlier blocks uses their block's end sum in place of
    their own ``That_i`` (an upper bound, as ``That`` does not decrease), so the certificate stays sound and the
    bound grows by less than one block's share."""
    n, v = bits.shape
    blk = min(SEARCH_BLOCK, v)
    nb = -(-v // blk)
    vp = nb * blk
    f32 = jnp.float32
    bits_p = jnp.pad(bits, ((0, 0), (0, vp - v)))  # zero columns: F = 0, never the candidate (see below)
    f = _fixed_point(bits_p, xtop)
    limbs = jnp.stack(_to_limbs64(f, w, nl)).reshape(nl, n, nb, blk)
    sums = jnp.sum(limbs, axis=-1, dtype=U32)  # < blk * 2**w: exact
    incl_raw = jnp.cumsum(sums, axis=-1, dtype=U32)  # < V * 2**w <= 2**32 (limb_width): exact, unnormalised
    excl_raw = incl_raw - sums
    incl = _renorm(list(incl_raw), w)
    tgt = _target([l[:, -1] for l in incl], k, w, nl)

    # the block holding j*: the first whose inclusive sum exceeds the target
    above_b = _gt_limbs(incl, [t[:, None] for t in tgt])
    found = jnp.any(above_b, axis=1)
    b = jnp.argmax(above_b, axis=1).astype(jnp.int32)
    # inside it: the block's own prefix sums, offset by the sum of the blocks before it
    local_bits = jnp.take_along_axis(bits_p.reshape(n, nb, blk), b[:, None, None], axis=1)[:, 0]
    local_f = _fixed_point(local_bits, xtop)  # recomputed from [N, block] bits: no [N, V] array is kept
    local = jnp.stack(_to_limbs64(local_f, w, nl))
    base_raw = jnp.take_along_axis(excl_raw, b[None, :, None], axis=2)[..., 0]  # [nl, N]
    that_blk = _renorm(list(jnp.cumsum(local, axis=-1, dtype=U32) + base_raw[..., None]), w)
    above = _gt_limbs(that_blk, [t[:, None] for t in tgt])
    j = jnp.argmax(above, axis=1).astype(jnp.int32)  # some column is above wherever the block is
    idx = b * blk + j
    # zero padding columns carry That_{V-1}, which only a found block's real columns can precede: idx < V there
    base = _renorm(list(base_raw), w)
    jp = jnp.maximum(j - 1, 0)
    t_prev = [jnp.where(j > 0, _take(l, jp), bl) for l, bl in zip(that_blk, base, strict=True)]

    # bounds: columns of earlier blocks with their block's end sum (>= their own), the found block's exactly
    ends = jnp.arange(1, nb + 1, dtype=f32)[None, :] * f32(blk)  # >= i + 1 for every column i of the block
    end_f = (_limbs_to_f32(incl, w) + ends) * f32(_UP)  # >= T_i / eps for every column of the block
    fp = _fp_upper(f).reshape(n, nb, blk)
    block_terms = jnp.sum(jnp.minimum(fp, end_f[..., None] * f32(_SUM_ERR)), axis=-1)  # [N, nb]
    before = jnp.cumsum(block_terms, axis=-1)  # any summation order is covered by the factor below
    before = jnp.concatenate([jnp.zeros((n, 1), f32), before[:, :-1]], axis=1)  # exclusive, no subtraction
    cols = (b * blk)[:, None] + jnp.arange(1, blk + 1, dtype=jnp.int32)[None, :]
    that_f = (_limbs_to_f32(that_blk, w) + cols.astype(f32)) * f32(_UP)  # >= T_i / eps inside the block
    in_blk = jnp.cumsum(jnp.minimum(_fp_upper(local_f), that_f * f32(_SUM_ERR)), axis=-1)
    scale = f32(1.0 + vp * 2.0**-21)
    start = _take(before, b)
    bnd_at = (start + _take(in_blk, j)) * scale
    bnd_prev = jnp.where(j > 0, start + _take(in_blk, jp), start) * scale
    bnd_all = jnp.sum(block_terms, axis=-1) * scale
    tot_f = (_limbs_to_f32([l[:, -1] for l in incl], w) + f32(vp)) * f32(_UP)
    return _Located(idx, found, tgt, [_take(l, j) for l in that_blk], t_prev, bnd_at, bnd_prev, bnd_all, tot_f)


def certified_search(bits: jnp.ndarray, k: U64, prefix: str = "xla") -> tuple[jnp.ndarray, jnp.ndarray]:
    """Vocabulary-parallel CDF inversion with a correctness certificate.

    Args:
        bits: [N, V] uint32, raw bits of fp32 probabilities (sign bit set = read as 0).
        k: [N] U64, the 53-bit uniform integers (u = k * 2**-53).
        prefix: how the row prefix sums are formed: ``"xla"`` (``jnp.cumsum``), ``"blocked"`` (fp32 block
            products, :mod:`._scan`; the integer sums are the same bits, the fp32 bound sum is another order, which
            the bound allows), ``"bytes"`` (the integer limbs as bf16 byte products, ``_scan.cumsum_u16``; the
            fp32 bound by ``jnp.cumsum``) or ``"two_level"`` (block totals, then the prefix sums of the one block
            holding the answer: :func:`_locate_two_level`). Speed only: a certified answer is torch's either way.
    Returns:
        (idx [N] int32, certified [N] bool): where ``certified``, ``idx`` equals the first j with
        ``S_j > fl64(u * S_{V-1})`` for torch's sequential fp64 prefix sums ``S`` (see module docstring).
    """
    if prefix not in PREFIX_SUMS:
        raise ValueError(f"prefix must be one of {PREFIX_SUMS}, got {prefix!r}")
    v = bits.shape[1]
    w = limb_width(v)
    nl = -(-R_BITS // w)  # limbs per F_i
    f32 = jnp.float32

    m, x = f32_parts(bits)
    nz = m != 0
    all_zero = ~jnp.any(nz, axis=1)
    xtop = jnp.max(jnp.where(nz, x + 24, -(1 << 20)), axis=1)
    xtop = jnp.where(all_zero, 0, xtop)
    if prefix == "two_level":
        loc = _locate_two_level(bits, xtop, k, w, nl)
    else:
        loc = _locate_full(_fixed_point(bits, xtop), k, w, nl, prefix)

    idx, tgt = loc.idx, loc.tgt
    bt = (f32(v + 1) + loc.bnd_all + loc.tot_f * f32(2.0**-52)) * f32(_UP)  # >= |t/eps - that|
    d1 = _limbs_to_f32(_sub_limbs(loc.t_at, tgt, w), w) * f32(_DN)
    safe_prev_ok = ~_gt_limbs(loc.t_prev, tgt)  # guaranteed by construction of idx; guards the subtraction
    d0 = _limbs_to_f32(_sub_limbs(tgt, loc.t_prev, w), w) * f32(_DN)
    upper_ok = d1 > (loc.bnd_at + bt) * f32(_UP)
    lower_ok = (idx == 0) | (safe_prev_ok & (d0 > (loc.bnd_prev + idx.astype(f32) + bt) * f32(_UP)))
    certified = all_zero | (loc.found & upper_ok & lower_ok)
    idx = jnp.where(all_zero, 0, idx)
    return idx, certified
