"""Exact CDF inversion that is vocabulary-parallel: torch's sequential fp64 cumsum, one binade at a time.

``random.py``'s exact emulation adds the vocabulary one column after another (``V`` dependent steps: a loop of
~16K iterations at V = 129280, 100-250 ms on a GPU). This module computes the same, bit-identical prefix sums with
a handful of vocabulary-parallel passes, one per binade the running sum visits. Notation (per row): fp32 inputs
``p_i >= 0`` (exact in fp64), torch's prefix sums ``S_i = fl(S_{i-1} + p_i)`` (``S_{-1} = 0``), round to nearest,
ties to even.

While the running sum stays in one binade ``[2**b, 2**(b+1))`` every value on the way is a multiple of its ulp
``u = 2**(b-52)`` and every addition rounds to that same grid, so with the integer mantissa ``M = S / u``:

* ``M_i = M_{i-1} + inc_i``, ``inc_i = round(p_i / u)``, where the rounding is decided by ``p_i`` alone
  (``floor`` plus one if the fraction is above one half) — except at an exact tie (fraction exactly one half),
  where the even neighbour wins: ``inc_i = floor + ((M_{i-1} + floor) mod 2)``, which leaves ``M_i`` even;
* so the parity of ``M`` after each column is "flip by ``inc_i``'s parity" or, at a tie, "reset to even": the
  parity before column ``i`` is the number of flips since the last tie (or since the binade's start, plus the
  starting parity), mod 2 — a cumulative sum and a cumulative maximum, both vocabulary-parallel;
* with the increments known, ``M_i`` is an exact integer prefix sum (uint32 limbs, as in ``_fastcdf``).

The first column whose mantissa would reach ``2**53`` leaves the binade (the sum reaches ``2**(b+1)``, possibly by
rounding); that one addition is emulated alone with the exact ``_f64.add``, and the next pass starts after it in
the new binade. A run of zeros before the first non-zero input is one more "pass" (its sum stays 0). A flat row
over 129,280 columns takes 19 passes for its total; adversarial rows (every exponent present, growing) visit more, never
more than the ~280 binades from 2**-149 up to ``V * 2**128`` — the loop always ends, it is only slower.

``binade_search`` runs the passes twice: once for the row total ``S_{V-1}`` (which the target ``t = fl(u *
S_{V-1})`` needs), recording where each pass started, and once for the first ``S_j > t``, starting from the last
recorded pass whose starting sum is ``<= t`` (usually a single pass). Rows are independent lanes of every pass.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import _f64
from ._fastcdf import _gt_limbs, _renorm, _to_limbs64, f32_parts, limb_width
from ._u64 import U32, U64, add64, shl32, shr32, sub64, u32

HISTORY = 48
"""Pass starts recorded by the total pass for the search pass to resume from (more passes only cost time)."""

_TWO53 = 1 << 53


def _limbs_to_u64(limbs: list[jnp.ndarray], w: int) -> U64:
    """A normalised limb list whose value is < 2**64 as a :class:`U64`."""
    hi = jnp.zeros_like(limbs[0])
    lo = jnp.zeros_like(limbs[0])
    for i, limb in enumerate(limbs):
        s = w * i
        lo = lo | shl32(limb, s)
        if s + w > 32:
            hi = hi | (shr32(limb, 32 - s) if s < 32 else shl32(limb, s - 32))
    return U64(hi, lo)


def _one_pass(m_in, x_in, bits, carry, target: _f64.F64 | None):
    """One binade pass for every row that is not done (module docstring); ``target`` None: total mode.

    ``carry``: per row [N] the next column ``a`` (int32), the sum before it ``S_{a-1}`` as mantissa hi, lo (uint32)
    and exponent (int32), done (bool), answer (int32); the pass counter (int32 scalar); the recorded pass starts
    (four [N, HISTORY] arrays: column, mantissa hi, lo, exponent)."""
    a, s_hi, s_lo, s_x, done, ans, it, hist = carry
    v = m_in.shape[1]
    w = limb_width(v)
    nl = -(-54 // w)  # increments are < 2**53 or saturated at 2**53
    col = jnp.arange(v, dtype=jnp.int32)[None, :]
    live = (col >= a[:, None]) & ~done[:, None]
    m0 = U64(s_hi, s_lo)  # 0 (sum still zero) or in [2**52, 2**53)

    # increments relative to the ulp 2**s_x (a zero sum has s_x = ZERO_X: every non-zero input saturates)
    sh = x_in - s_x[:, None]
    left = jnp.clip(sh, 0, 40)
    v_hi = jnp.where(left >= 32, shl32(m_in, left - 32), shr32(m_in, 32 - left))
    v_lo = jnp.where(left >= 32, u32(0), shl32(m_in, left))
    sat = (m_in != 0) & ((sh > 40) | (v_hi >= u32(1 << 21)))
    r = jnp.clip(-sh, 1, 31)
    small = (sh < 0) & (-sh < 25)  # below 2**-25 ulp (m < 2**24): rounds to 0, never a tie
    fl = jnp.where(small, shr32(m_in, r), u32(0))
    rem = m_in & (shl32(u32(1), r) - u32(1))
    half = shl32(u32(1), r - 1)
    up = small & (rem > half)
    tie = live & small & (rem == half)
    pos = sh >= 0
    inc_hi = jnp.where(pos, jnp.where(sat, u32(_TWO53 >> 32), v_hi), u32(0))
    inc_lo = jnp.where(pos, jnp.where(sat, u32(0), v_lo), fl + up.astype(U32))

    # parity of M before each column: flips since the last tie (or since the start, plus the starting parity)
    flip = jnp.where(live & ~tie, inc_lo & u32(1), u32(0))
    flips = jnp.cumsum(flip, axis=1, dtype=U32)
    # flips never decrease, so their value at the last tie is a running maximum (no gather)
    at_tie = lax.cummax(jnp.where(tie, flips, u32(0)), axis=1)
    seen_tie = lax.cummax(tie.astype(jnp.int32), axis=1) > 0
    parity = jnp.where(seen_tie, flips - at_tie, flips + (s_lo[:, None] & u32(1))) & u32(1)
    before = jnp.concatenate([(s_lo[:, None] & u32(1)), parity[:, :-1]], axis=1)
    inc_lo = jnp.where(tie, fl + ((before + fl) & u32(1)), inc_lo)
    inc_hi = jnp.where(live, inc_hi, u32(0))
    inc_lo = jnp.where(live, inc_lo, u32(0))

    # M_i - M_{a-1}: exact prefix sums in limbs; the first column reaching 2**53 leaves the binade
    psum = _renorm([jnp.cumsum(l, axis=1, dtype=U32) for l in _to_limbs64(U64(inc_hi, inc_lo), w, nl)], w)
    room = sub64(U64(jnp.full_like(s_hi, u32(_TWO53 >> 32)), jnp.zeros_like(s_lo)), m0)  # 2**53 - M_{a-1}
    room_m1 = sub64(room, U64(jnp.zeros_like(s_hi), jnp.ones_like(s_lo)))
    crossed = live & _gt_limbs(psum, [l[:, None] for l in _to_limbs64(room_m1, w, nl)])
    has_c = jnp.any(crossed, axis=1)
    c = jnp.where(has_c, jnp.argmax(crossed, axis=1).astype(jnp.int32), v)

    take = lambda arr, i: jnp.take_along_axis(arr, i[:, None], axis=1)[:, 0]  # noqa: E731
    last = jnp.clip(c - 1, 0, v - 1)
    before_c = _limbs_to_u64([jnp.where(c > a, take(l, last), u32(0)) for l in psum], w)
    m_end = add64(m0, before_c)  # M_{c-1} (or of the row's last column when nothing crosses)
    s_end = _f64.F64(m_end, jnp.where((m_end.hi | m_end.lo) == 0, _f64.ZERO_X, s_x))
    cc = jnp.minimum(c, v - 1)
    s_c = _f64.add(s_end, _f64.from_f32_bits(take(bits, cc)))

    if target is None:
        found_in, j_in, c_above = jnp.zeros_like(done), jnp.zeros_like(a), jnp.zeros_like(done)
    else:
        # first j in [a, c) with S_j > t: in this binade S_j > t iff M_j > t / ulp
        same = target.x == s_x
        thr = sub64(target.m, m0)  # t.m >= M_{a-1} when t is in this binade and S_{a-1} <= t
        above_t = _gt_limbs(psum, [l[:, None] for l in _to_limbs64(thr, w, nl)])
        above = live & (col < c[:, None]) & (
            (target.x < s_x)[:, None] | (same[:, None] & above_t))
        found_in = jnp.any(above, axis=1)
        j_in = jnp.argmax(above, axis=1).astype(jnp.int32)
        c_above = has_c & _f64.gt(s_c, target)

    step_done = ~done & (found_in | ~has_c | c_above | (c + 1 >= v))
    new_ans = jnp.where(found_in, j_in, jnp.where(~has_c, 0, jnp.where(c_above, c, 0)))
    # the total (or the sum where the row stopped): S_{V-1} when nothing crossed, S_c otherwise
    nxt = _f64.F64(U64(jnp.where(has_c, s_c.m.hi, m_end.hi), jnp.where(has_c, s_c.m.lo, m_end.lo)),
                   jnp.where(has_c, s_c.x, s_end.x))
    return (jnp.where(done, a, c + 1), jnp.where(done, s_hi, nxt.m.hi), jnp.where(done, s_lo, nxt.m.lo),
            jnp.where(done, s_x, nxt.x), done | step_done, jnp.where(step_done, new_ans, ans), it + 1, hist)


def _run(m_in, x_in, bits, start, target: _f64.F64 | None, record: bool):
    """Passes until every row is done; ``start``: the initial carry. With ``record`` each pass's starting state
    (column, sum) is written into the history slot of its pass number (while slots last)."""

    def body(carry):
        if record:
            a, s_hi, s_lo, s_x, done, _, it, hist = carry
            h_a, h_hi, h_lo, h_x = hist
            slot = jnp.minimum(it, HISTORY - 1)
            write = (it < HISTORY) & ~done
            put = lambda h, val: h.at[:, slot].set(jnp.where(write, val, h[:, slot]))  # noqa: E731
            carry = carry[:7] + ((put(h_a, a), put(h_hi, s_hi), put(h_lo, s_lo), put(h_x, s_x)),)
        return _one_pass(m_in, x_in, bits, carry, target)

    return lax.while_loop(lambda carry: ~jnp.all(carry[4]), body, start)


def binade_search(bits: jnp.ndarray, k: U64, active: jnp.ndarray | None = None) -> jnp.ndarray:
    """Exact CDF inversion, bit-identical to ``random._exact_search`` (torch's sequential fp64 cumsum).

    Args:
        bits: [N, V] uint32, raw bits of fp32 probabilities (sign bit set = read as 0).
        k: [N] U64, the 53-bit uniform integers (target ``t = fl(k * 2**-53 * S_{V-1})``).
        active: [N] bool, rows to compute (others return 0 and cost no passes); None: all.
    Returns:
        [N] int32: the first j with ``S_j > t`` (0 if none, and for all-zero rows).
    """
    n, v = bits.shape
    m_in, x_in = f32_parts(bits)
    done = jnp.zeros((n,), bool) if active is None else ~active
    zi = jnp.zeros((n,), jnp.int32)
    zu = jnp.zeros((n,), U32)
    zx = jnp.full((n,), _f64.ZERO_X, jnp.int32)
    hist = (jnp.zeros((n, HISTORY), jnp.int32), jnp.zeros((n, HISTORY), U32), jnp.zeros((n, HISTORY), U32),
            jnp.full((n, HISTORY), _f64.ZERO_X, jnp.int32))
    start = (zi, zu, zu, zx, done, zi, jnp.zeros((), jnp.int32), hist)
    total_carry = _run(m_in, x_in, bits, start, None, record=True)
    _, t_hi, t_lo, t_x, _, _, _, hist = total_carry
    target = _f64.mul_u53(k, _f64.F64(U64(t_hi, t_lo), t_x))

    # resume from the last recorded pass start whose sum is <= t (slot 0, a zero sum, always is)
    h_a, h_hi, h_lo, h_x = hist
    h_sum = _f64.F64(U64(h_hi, h_lo), h_x)
    tgt = _f64.F64(U64(target.m.hi[:, None], target.m.lo[:, None]), target.x[:, None])
    slots = jnp.arange(HISTORY, dtype=jnp.int32)[None, :]
    ok = ~_f64.gt(h_sum, tgt) & ((slots == 0) | (h_a > 0))
    best = jnp.max(jnp.where(ok, slots, 0), axis=1)
    pick = lambda h: jnp.take_along_axis(h, best[:, None], axis=1)[:, 0]  # noqa: E731
    start = (pick(h_a), pick(h_hi), pick(h_lo), pick(h_x), done, zi, jnp.zeros((), jnp.int32), hist)
    return _run(m_in, x_in, bits, start, target, record=False)[5]


def binade_rows(bits: jnp.ndarray, k: U64, todo: jnp.ndarray, chunk: int = 8) -> jnp.ndarray:
    """:func:`binade_search` of the rows in ``todo`` only, ``chunk`` rows at a time: the rows are compacted (in
    order) and processed in chunks while any remain, so a step with one uncertified row among 64 pays for a pass
    over ``chunk`` rows, not 64 (each pass is vocabulary-wide work on every row it is given). Args as
    :func:`binade_search` (``todo``: [N] bool); rows not in ``todo`` return 0."""
    n = bits.shape[0]
    if n <= chunk:
        return binade_search(bits, k, todo)
    count = jnp.sum(todo.astype(jnp.int32))
    slot = jnp.cumsum(todo.astype(jnp.int32)) - 1  # position of each todo row in the compacted order
    padded = -(-n // chunk) * chunk
    order = jnp.zeros((padded,), jnp.int32).at[jnp.where(todo, slot, padded)].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")

    def body(i, out):
        lanes = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        rows = lax.dynamic_slice(order, (i * chunk,), (chunk,))
        valid = lanes < count
        got = binade_search(bits[rows], U64(k.hi[rows], k.lo[rows]), valid)
        return out.at[jnp.where(valid, rows, n)].set(got, mode="drop")  # padding lanes write nothing

    return lax.fori_loop(0, (count + chunk - 1) // chunk, body, jnp.zeros((n,), jnp.int32))
