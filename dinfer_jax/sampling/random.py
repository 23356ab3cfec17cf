"""Deterministic, batch-invariant categorical sampling: DeepInfer's ``random_sampling_ref``, token for token.

Spec (``deepinfer/model_executor/layers/tilelang_ops/random_sampling.py``: ``random_sampling_ref``,
``_hash_to_uniform``; docs/spec/engine.md §7), all integer arithmetic mod 2**64 with logical shifts::

    seq      = (sample_position * 3 + case) * 0x9E3779B97F4A7C15      # case 0: ordinary, 1: is_nextn_predict
    z        = seq_seed + (seq ^ (seq << 13))
    z        = z + 0x9E3779B97F4A7C15                                 # SplitMix64 finaliser
    z        = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z        = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z        = z ^ (z >> 31)
    u        = (z >> 11) * 2**-53                                     # exact fp64 in [0, 1)
    cdf      = fp64 cumsum(probs)                                     # torch CPU: sequential, round each add
    token    = first j with cdf[j] > fl64(u * cdf[-1])                (0 if there is none: all-zero row)

How this port gets the same tokens without ``jax_enable_x64`` (see ``_u64`` / ``_f64``):

* the hash runs on ``(hi, lo)`` uint32 pairs (wrapping 32-bit multiplies assembled into 64-bit ones);
* ``u`` stays the 53-bit integer ``k = z >> 11``;
* the CDF is *the same sequence of IEEE binary64 roundings* as torch's: fp32 probabilities are widened exactly from
  their bits, and a ``lax.scan`` over the vocabulary applies one emulated, correctly rounded (nearest-even) binary64
  addition per column, in column order, exactly like torch's sequential CPU ``cumsum`` (``cumsum`` of a contiguous
  last dimension in ATen's CPU kernel is a plain left-to-right loop accumulating in ``double``). Every partial sum
  is therefore bit-identical to torch's ``cdf[j]``;
* the target ``fl64(u * cdf[-1])`` is the exact 106-bit product ``k * mantissa`` rounded once, nearest-even, which
  is what IEEE multiplication by ``u = k * 2**-53`` (exact) computes;
* ``cdf[j] > target`` is an exact comparison of (exponent, mantissa) pairs.

Hence the result equals the reference for every input (non-negative, finite fp32 probabilities; any seed in
[0, 2**64), any int32 position), not just with high probability. Rows are independent (each row is its own lane of
the scan, with its own seed and position), so tokens do not depend on batch size, row order or padding rows.

Speed: the exact scan is sequential in the vocabulary (``V`` emulated adds per row, vectorised over rows), so
``method="auto"`` (default) first runs a vocabulary-parallel search (``_fastcdf.certified_search``: exact integer
fixed-point prefix sums — by default only those of the one block of columns holding the answer — plus rigorous
bounds on torch's fp64 rounding error) that *proves* per row that its answer is torch's; only rows it cannot prove
(a target within ~V * 2**-53 of a CDF boundary: ~1e-6 of rows at V = 129280) are recomputed exactly, under a
``lax.cond``: by the sequential scan on CPU, and on accelerators by ``_binadecdf.binade_rows`` (bit-identical; one
vocabulary-parallel pass per binade of the running sum, over the uncertified rows only, 8 at a time; the scan's ~16K
dependent steps cost 100-250 ms there). Measured on one H200, 256 x 129280: auto 2.0-2.9 ms; the exact scan 131 ms
(block 8), binade passes over every row 45 ms (64 rows: 129 / 13 ms). On CPU (2 cores), 64 x 129280: ~0.16-0.25 s
the scan, ~1.9 s the binade passes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _f64
from ._binadecdf import binade_rows, binade_search
from ._fastcdf import PREFIX_SUMS, certified_search
from ._u64 import U32, U64, add64, clz_limbs, const64, from_int32, mul64, shl32, shl64, shr32, shr64, u32, xor64

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

CASE_SAMPLE = 0
"""RNG stream of an ordinary (fresh / bonus) sample."""
CASE_RESAMPLE = 1
"""RNG stream of the residual resample after a rejected draft (``is_nextn_predict=True``)."""


def _platform(probs: Any) -> str:
    """The platform of ``probs`` if it is a placed array, else of ``jax.default_device`` if set, else the default
    backend."""
    if isinstance(probs, jax.Array):
        try:
            return next(iter(probs.devices())).platform
        except Exception:  # a tracer: no placement known here
            pass
    dev = jax.config.jax_default_device
    return getattr(dev, "platform", dev) if dev is not None else jax.default_backend()


def default_block(probs: Any = None) -> int:
    """Columns unrolled per step of the exact scan: 1 on CPU (fastest there, and XLA:CPU compiles unrolled bodies
    slowly), 8 on accelerators (amortises the per-iteration launch cost without blowing up compile time). H200,
    256 x 129280, exact scan run / compile: block 1: 935 ms / 2.7 s; 4: 233 ms / 2.4 s; 8: 133 ms / 4.4 s;
    16: 110 ms / 15 s; 64: 59 ms / minutes. The platform is :func:`_platform`'s."""
    return 1 if _platform(probs) == "cpu" else 8


def default_fallback(probs: Any = None) -> str:
    """How ``method="auto"`` computes the rows the certified search cannot prove: ``"scan"`` (the sequential exact
    scan) on CPU, where its ``V`` small steps are cheap (64 x 129280: 0.16 s against 1.9 s), ``"binade"``
    (``_binadecdf.binade_search``, ~20 vocabulary-parallel passes) on accelerators, where each of the scan's
    steps is a launch (docs/perf/serving_h200.md). Both give the same tokens."""
    return "scan" if _platform(probs) == "cpu" else "binade"


def default_prefix(probs: Any = None) -> str:
    """The certified search's prefix sums for ``probs [N, V]``: ``"two_level"`` on every backend — block totals
    locate the one block whose prefix sums are formed, instead of a prefix sum of the whole row. Measured at V =
    129,280 (docs/perf/serving_h200.md, fifth session of 2026-12-07): on an H100 (jax 0.11.2, the jitted certified
    draw's device time by CUPTI) 0.034 / 0.060 / 0.166 / 0.305 / 0.809 ms at 1 / 16 / 64 / 128 / 384 rows, against
    0.046 / 0.248 / 1.161 / 1.219 / 4.068 for ``jnp.cumsum`` (``"xla"``) and 0.049 / 0.203 / 0.820 / 1.607 / 4.812
    for the bf16 byte products (``"bytes"``); on a 2-core CPU (jax 0.10.2, wall) 1.6 against 8.7 ms at one row and
    180 against 668 ms at 64. Every form gives the same tokens; speed only. ``probs`` is accepted for callers that
    pass it (the choice depended on the backend and rows before)."""
    del probs
    return "two_level"


# --- seeds ----------------------------------------------------------------------------------------------------


def seeds_to_u64(seq_seeds: Any) -> U64:
    """Normalise per-row 64-bit seeds to a :class:`U64` ``(hi, lo)`` pair of uint32 arrays.

    Accepted: a :class:`U64` / ``(hi, lo)`` tuple of uint32 arrays; numpy arrays or Python sequences of ints (taken
    mod 2**64, so uint64 values >= 2**63 and negative int64 values both work); jax uint64/int64 arrays (only exist
    under x64 mode); jax/numpy ``uint32`` arrays (zero-extended) and ``int32`` arrays (sign-extended, like
    ``torch.Tensor.to(torch.int64)``). Host inputs are split on the host; device inputs are split with jnp ops.
    """
    if isinstance(seq_seeds, U64) or (isinstance(seq_seeds, tuple) and len(seq_seeds) == 2
                                       and not isinstance(seq_seeds[0], (int, np.integer))):
        hi, lo = seq_seeds
        return U64(jnp.asarray(hi, U32), jnp.asarray(lo, U32))
    if isinstance(seq_seeds, jax.Array):
        dt = seq_seeds.dtype
        if dt in (jnp.uint64, jnp.int64):
            u = seq_seeds.astype(jnp.uint64)
            return U64((u >> 32).astype(U32), (u & 0xFFFFFFFF).astype(U32))
        if dt == jnp.uint32:
            return U64(jnp.zeros_like(seq_seeds), seq_seeds)
        if dt == jnp.int32:
            return from_int32(seq_seeds)
        raise TypeError(f"seq_seeds: unsupported device dtype {dt}")
    if isinstance(seq_seeds, (list, tuple, int, np.integer)):  # Python ints: reduce mod 2**64 first
        arr = np.asarray(seq_seeds, dtype=object)
    else:
        arr = np.asarray(seq_seeds)
    if arr.dtype == object or arr.dtype.kind in "iu":
        if arr.dtype == object:
            arr = np.array([int(v) & ((1 << 64) - 1) for v in arr.reshape(-1)], dtype=np.uint64).reshape(arr.shape)
        elif arr.dtype.kind == "i":
            arr = arr.astype(np.int64).view(np.uint64)
        else:
            arr = arr.astype(np.uint64)
        return U64(jnp.asarray((arr >> np.uint64(32)).astype(np.uint32)),
                   jnp.asarray((arr & np.uint64(0xFFFFFFFF)).astype(np.uint32)))
    raise TypeError(f"seq_seeds: unsupported type {type(seq_seeds)} / dtype {arr.dtype}")


def add_seed_offset(seeds: U64, offset: int) -> U64:
    """``seeds + offset mod 2**64`` (e.g. DeepInfer's draft-sampling namespace offset 1000000007)."""
    if offset == 0:
        return seeds
    return add64(seeds, const64(offset, seeds.lo))


# --- counter hash ---------------------------------------------------------------------------------------------


def splitmix64(z: U64) -> U64:
    """SplitMix64 finaliser (including the leading ``+ 0x9E3779B97F4A7C15``), mod 2**64."""
    z = add64(z, const64(GOLDEN_GAMMA, z.lo))
    z = mul64(xor64(z, shr64(z, 30)), const64(_MIX1, z.lo))
    z = mul64(xor64(z, shr64(z, 27)), const64(_MIX2, z.lo))
    return xor64(z, shr64(z, 31))


def uniform_u53(seeds: U64, sample_positions: jnp.ndarray, case: int) -> U64:
    """The 53-bit integer ``k`` with ``u = k * 2**-53`` that ``random_sampling_ref`` draws for each row.

    Args:
        seeds: [N] :class:`U64` seeds.
        sample_positions: [N] int32 RNG counters (sign-extended to 64 bits, as the reference's ``.to(int64)``).
        case: static stream selector (0 ordinary sample, 1 residual resample).
    Returns:
        [N] :class:`U64`, values in [0, 2**53).
    """
    pos = from_int32(sample_positions)
    seq = add64(mul64(pos, const64(3, pos.lo)), const64(case, pos.lo))
    seq = mul64(seq, const64(GOLDEN_GAMMA, pos.lo))
    combined = add64(seeds, xor64(seq, shl64(seq, 13)))
    return shr64(splitmix64(combined), 11)


CASE_ACCEPT = 2
"""RNG stream of the acceptance test of a draft token (speculative verification)."""


def acceptance_u53(seeds: U64, sample_positions: jnp.ndarray) -> U64:
    """The 53-bit integer ``k`` behind the acceptance-test uniform ``u = k * 2**-53`` of ``fused_sample_ref``.

    Unlike :func:`uniform_u53` the stream id is XOR-ed into the seed (no ``<< 13`` mix, no addition):
    ``k = splitmix64(seed ^ ((position * 3 + 2) * 0x9E3779B97F4A7C15)) >> 11``, all mod 2**64.

    Args:
        seeds: [N] :class:`U64` seeds (namespace offset already added).
        sample_positions: [N] int32 (sign-extended to 64 bits).
    Returns:
        [N] :class:`U64`, values in [0, 2**53).
    """
    pos = from_int32(sample_positions)
    seq = add64(mul64(pos, const64(3, pos.lo)), const64(CASE_ACCEPT, pos.lo))
    seq = mul64(seq, const64(GOLDEN_GAMMA, pos.lo))
    return shr64(splitmix64(xor64(seeds, seq)), 11)


def u53_to_f32(k: U64) -> jnp.ndarray:
    """``float32(k * 2**-53)`` rounded to nearest, ties to even, for ``0 <= k < 2**53``: exactly what torch's
    ``.to(torch.float32)`` of the fp64 uniform gives. Integer rounding to 24 significant bits, then an exact
    scaling by a power of two. [N] U64 -> [N] f32."""
    hi, lo = k.hi, k.lo
    nbits = 64 - clz_limbs([lo, hi])  # bit length, 0..53
    e = jnp.maximum(nbits - 24, 0)  # bits dropped, 0..29
    m = shr32(lo, e) | shl32(hi, 32 - e)  # k >> e, < 2**24 (fits in the low word)
    rem = lo & (shl32(u32(1), e) - u32(1))  # dropped bits (e < 32, so all in lo)
    half = shl32(u32(1), jnp.maximum(e - 1, 0))
    up = (e > 0) & ((rem > half) | ((rem == half) & ((m & u32(1)) == u32(1))))
    m = m + up.astype(U32)  # <= 2**24, exact in f32
    scale = lax.bitcast_convert_type(((e - 53 + 127) << 23).astype(jnp.int32), jnp.float32)  # 2**(e - 53)
    return m.astype(jnp.float32) * scale


# --- CDF inversion --------------------------------------------------------------------------------------------


def _sequential_cdf(bits_vn: jnp.ndarray, block: int) -> tuple[_f64.F64, _f64.F64]:
    """Torch's sequential fp64 cumsum, emulated exactly. ``bits_vn``: [V, N] uint32 fp32 bits (V a multiple of
    ``block``). Returns (all prefix sums [V, N], total [N])."""
    v, n = bits_vn.shape
    blocks = bits_vn.reshape(v // block, block, n)

    def step(acc: _f64.F64, blk: jnp.ndarray):
        outs = []
        for b in range(block):
            acc = _f64.add(acc, _f64.from_f32_bits(blk[b]))
            outs.append(acc)
        stacked = _f64.F64(
            type(acc.m)(jnp.stack([o.m.hi for o in outs]), jnp.stack([o.m.lo for o in outs])),
            jnp.stack([o.x for o in outs]),
        )
        return acc, stacked

    total, prefix = lax.scan(step, _f64.zeros((n,)), blocks)
    prefix = _f64.F64(
        type(total.m)(prefix.m.hi.reshape(v, n), prefix.m.lo.reshape(v, n)), prefix.x.reshape(v, n)
    )
    return prefix, total


def _first_above(prefix: _f64.F64, target: _f64.F64, vocab: int) -> jnp.ndarray:
    """First column j (< vocab) with prefix[j] > target, 0 if none. prefix: [V', N]; target: [N]."""
    tgt = _f64.F64(type(target.m)(target.m.hi[None], target.m.lo[None]), target.x[None])
    above = _f64.gt(prefix, tgt)[:vocab]
    return jnp.argmax(above, axis=0).astype(jnp.int32)


def _exact_search(bits: jnp.ndarray, k: U64, block: int) -> jnp.ndarray:
    """Exact CDF inversion. bits: [N, V] uint32 fp32 bits; k: [N] U64. Returns [N] int32."""
    n, v = bits.shape
    bits = bits.T  # [V, N]
    pad = (-v) % block
    if pad:
        bits = jnp.concatenate([bits, jnp.zeros((pad, n), U32)], axis=0)
    prefix, total = _sequential_cdf(bits, block)
    target = _f64.mul_u53(k, total)
    return _first_above(prefix, target, v)


METHODS = ("auto", "exact", "binade")
FALLBACKS = ("scan", "binade")


@partial(jax.jit, static_argnames=("case", "block", "method", "fallback", "prefix"))
def _random_sampling_impl(probs, seed_hi, seed_lo, positions, *, case: int, block: int, method: str,
                          fallback: str, prefix: str):
    k = uniform_u53(U64(seed_hi, seed_lo), positions, case)
    bits = lax.bitcast_convert_type(probs.astype(jnp.float32), U32)  # integers from here on
    if method == "exact":
        return _exact_search(bits, k, block)
    if method == "binade":
        return binade_search(bits, k)
    idx, certified = certified_search(bits, k, prefix)

    def exact_rows():
        exact = _exact_search(bits, k, block) if fallback == "scan" else binade_rows(bits, k, ~certified)
        return jnp.where(certified, idx, exact)

    return lax.cond(jnp.all(certified), lambda: idx, exact_rows)


def random_sampling(
    probs: jnp.ndarray,
    seq_seeds: Any,
    sample_positions: jnp.ndarray,
    is_nextn_predict: bool = False,
    *,
    method: str = "auto",
    block: int | None = None,
    fallback: str | None = None,
    prefix: str | None = None,
) -> jnp.ndarray:
    """Sample one column per row of ``probs`` exactly as DeepInfer's ``random_sampling_ref``.

    Deterministic in (seed, sample position, ``is_nextn_predict``) and independent of batch size, row order and
    other rows; zero-probability columns are never drawn. Usable eagerly (numpy inputs) and inside ``jax.jit``.

    Args:
        probs: [N, V] float32 (other float dtypes are cast), non-negative and finite; rows need not be normalised
            (the target is ``u * row_sum``). Negative values and ``-0.0`` are read as 0.
        seq_seeds: [N] per-row uint64 seeds in any form :func:`seeds_to_u64` accepts (numpy uint64, Python ints,
            a ``(hi, lo)`` uint32 pair, jax 32-bit ints, ...).
        sample_positions: [N] int32 RNG counters.
        is_nextn_predict: static; selects RNG stream case 1 (residual resample) instead of 0.
        method: static. ``"exact"``: the sequential exact emulation for every row. ``"binade"``: the exact
            binade-by-binade emulation (``_binadecdf``) for every row. ``"auto"`` (default): the
            vocabulary-parallel certified search (``_fastcdf``) for every row, and an exact emulation (under a
            ``lax.cond``, so only paid when needed) for the rows it cannot certify. All return identical tokens.
        block: static; vocabulary columns unrolled per step of the exact scan (speed only, never the result);
            default :func:`default_block` of the default backend.
        fallback: static; ``"auto"``'s exact emulation for uncertified rows, ``"scan"`` or ``"binade"`` (speed
            only, never the result); default :func:`default_fallback`.
        prefix: static; the certified search's prefix sums, ``"xla"`` (``jnp.cumsum``), ``"blocked"`` (fp32 block
            products, ``_scan``: slower on an H200 at batch 1-256, docs/perf/serving_h200.md, second session of
            2026-12-07), ``"bytes"`` (bf16 byte products for the integer limbs) or ``"two_level"`` (block totals
            locate the one block whose prefix sums are formed); speed only, never the result;
            default :func:`default_prefix`.

    Returns:
        [N] int32 sampled column indices (0 for an all-zero row, like the reference).
    """
    seeds = seeds_to_u64(seq_seeds)
    positions = jnp.asarray(sample_positions, jnp.int32)
    probs = jnp.asarray(probs)
    if probs.ndim != 2:
        raise ValueError(f"probs must be [N, V], got shape {probs.shape}")
    n = probs.shape[0]
    if seeds.lo.shape != (n,) or positions.shape != (n,):
        raise ValueError(f"seq_seeds and sample_positions must have shape ({n},), got {seeds.lo.shape} and "
                         f"{positions.shape}")
    case = CASE_RESAMPLE if is_nextn_predict else CASE_SAMPLE
    block = default_block(probs) if block is None else int(block)
    fallback = default_fallback(probs) if fallback is None else fallback
    prefix = default_prefix(probs) if prefix is None else prefix
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if prefix not in PREFIX_SUMS:
        raise ValueError(f"prefix must be one of {PREFIX_SUMS}, got {prefix!r}")
    return _random_sampling_impl(probs, seeds.hi, seeds.lo, positions, case=case, block=block, method=method,
                                 fallback=fallback, prefix=prefix)
