"""Row prefix sums as block products (``dinfer_jax.sampling._scan``), the certified draw's form on accelerators.

``cumsum_u32`` must equal numpy's wrapping uint32 cumulative sum bit for bit (values up to 2**32 - 1, so sums wrap;
row lengths below, at and across the 128-column block, and the vocabulary's 129,280, which recurses twice).
``cumsum_f32`` need only be *a* sum of each prefix in some order with fp32 rounding — what the certified search's
error bound assumes — so it is checked against the float64 prefix sums with the worst-case bound of any summation
order of non-negative terms, ``|error_j| <= j * 2**-24 * S_j`` (first order; ``j <= V`` here keeps it tight), and
against a deliberately wrong form (a missing block offset) the check must fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.sampling._fastcdf import certified_search
from dinfer_jax.sampling._scan import BLOCK, cumsum_f32, cumsum_u16, cumsum_u32
from dinfer_jax.sampling.random import seeds_to_u64, uniform_u53

SHAPES = [(3, 1), (3, 2), (2, BLOCK - 1), (2, BLOCK), (2, BLOCK + 1), (3, BLOCK * BLOCK + 5), (2, 129280)]


@pytest.mark.parametrize("shape", SHAPES)
def test_u32_prefix_sums_are_numpys_bit_for_bit(shape) -> None:
    rng = np.random.default_rng(shape[1])
    x = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    x[0, : shape[1] // 2] = 0xFFFFFFFF                     # wraps at nearly every step
    got = np.asarray(jax.jit(cumsum_u32)(x))
    np.testing.assert_array_equal(got, np.cumsum(x, axis=1, dtype=np.uint32))
    # leading axes of any rank (the certified search stacks its limbs)
    x3 = x[None].repeat(2, axis=0)
    np.testing.assert_array_equal(np.asarray(jax.jit(cumsum_u32)(x3))[1], np.cumsum(x, axis=1, dtype=np.uint32))


@pytest.mark.parametrize("shape", SHAPES)
def test_u16_byte_products_are_numpys_bit_for_bit_below_2_16(shape) -> None:
    """The bf16 byte form: exact for values below 2**16 (the certified search's limbs are below 2**15), half of a
    row at the largest, 0xFFFF (the widest rows' sums wrap past 2**32); a value of 2**16 or more makes it differ
    (its bits from 16 up are not summed), so the range is the contract."""
    rng = np.random.default_rng(shape[1] + 7)
    x = rng.integers(0, 2**16, shape, dtype=np.uint64).astype(np.uint32)
    x[0, : shape[1] // 2] = 0xFFFF
    want = np.cumsum(x, axis=1, dtype=np.uint32)
    np.testing.assert_array_equal(np.asarray(jax.jit(cumsum_u16)(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(cumsum_u16)(x[None].repeat(2, axis=0)))[1], want)
    if shape[1] >= 2:
        big = x.copy()
        big[:, 0] = 0x1FF01        # bit 16 set: outside the byte form's range
        assert not np.array_equal(np.asarray(jax.jit(cumsum_u16)(big)), np.cumsum(big, axis=1, dtype=np.uint32))


def _within_any_order_bound(got: np.ndarray, x: np.ndarray) -> bool:
    exact = np.cumsum(x.astype(np.float64), axis=1)
    j = np.arange(1, x.shape[1] + 1)[None, :]
    return bool((np.abs(got - exact) <= j * 2.0**-24 * exact * (1 + 2.0**-20) + 1e-300).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_f32_prefix_sums_are_a_summation_order(shape) -> None:
    rng = np.random.default_rng(shape[1] + 1)
    x = (rng.random(shape) * np.exp(rng.normal(0, 8, shape))).astype(np.float32)
    x[:, ::7] = 0.0
    got = np.asarray(jax.jit(cumsum_f32)(x), np.float64)
    assert _within_any_order_bound(got, x)
    if shape[1] > BLOCK:   # the check can fail: drop the second block's offset
        bad = got.copy()
        bad[:, BLOCK: 2 * BLOCK] -= got[:, BLOCK - 1: BLOCK]
        assert not _within_any_order_bound(bad, x)


def test_certified_search_gives_the_same_answers_with_block_products() -> None:
    """Flat and peaked rows at the full vocabulary: the two prefix-sum forms certify the same rows here and give
    the same index on every row both certify (the integer sums are the same bits; only the fp32 bound differs)."""
    rng = np.random.default_rng(5)
    n, v = 16, 129280
    logits = rng.standard_normal((n, v)) * np.linspace(0.5, 8, n)[:, None]
    probs = np.exp(logits - logits.max(1, keepdims=True)).astype(np.float32)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(probs), jnp.uint32)
    k = uniform_u53(seeds_to_u64(rng.integers(0, 2**63, n, dtype=np.uint64)), jnp.arange(n, dtype=jnp.int32), 0)
    search = jax.jit(certified_search, static_argnums=2)
    idx_x, cert_x = (np.asarray(a) for a in search(bits, k, "xla"))
    idx_b, cert_b = (np.asarray(a) for a in search(bits, k, "blocked"))
    idx_y, cert_y = (np.asarray(a) for a in search(bits, k, "bytes"))
    assert cert_x.all() and cert_b.all()
    np.testing.assert_array_equal(idx_b, idx_x)
    np.testing.assert_array_equal(cert_y, cert_x)     # the byte form's bound is jnp.cumsum's: the same bits
    np.testing.assert_array_equal(idx_y, idx_x)
    idx_t, cert_t = (np.asarray(a) for a in search(bits, k, "two_level"))
    assert cert_t.all()                               # a looser bound, still certifying every row here
    np.testing.assert_array_equal(idx_t, idx_x)
    # and the answer is the first index whose float64 prefix sum exceeds u * total (no near-boundary rows here)
    u = (np.asarray(k.hi, np.float64) * 2.0**32 + np.asarray(k.lo, np.float64)) * 2.0**-53
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    np.testing.assert_array_equal(idx_b, (cdf > (u * cdf[:, -1])[:, None]).argmax(1))


def test_unknown_prefix_form_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix must be one of"):
        certified_search(jnp.zeros((1, 4), jnp.uint32), uniform_u53(seeds_to_u64(np.zeros(1, np.uint64)),
                                                                      jnp.zeros(1, jnp.int32), 0), "cub")


def _k_for(u: np.ndarray):
    """53-bit uniform integers k (u = k * 2**-53) as the search's U64."""
    return seeds_to_u64(np.minimum(np.floor(u * 2.0**53), 2.0**53 - 1).astype(np.uint64))


@pytest.mark.parametrize("v", [129280, 1000, 257, 256, 200])
def test_two_level_search_finds_answers_at_block_edges(v: int) -> None:
    """``prefix="two_level"`` locates a block by its totals, then searches inside it: targets placed midway into
    the first and last column of blocks (and of the row) must give the sequential float64 answer (numpy's
    ``cumsum`` adds left to right, as torch's reference does) and be certified; targets on a prefix sum itself
    (where the certificate must decline or be right) may only be certified with the sequential answer. Rows with
    zero runs (filtered vocabulary) and peaked rows both."""
    from dinfer_jax.sampling._fastcdf import SEARCH_BLOCK

    rng = np.random.default_rng(v)
    blk = min(SEARCH_BLOCK, v)
    edges = sorted({j for b in range(0, v, blk) for j in (b, b + blk - 1) if j < v} | {0, v - 1})
    edges = [j for j in edges if j > 0][:24] + [0]
    n = len(edges)
    logits = rng.standard_normal((n, v)) * np.linspace(0.5, 6, n)[:, None]
    probs = np.exp(logits - logits.max(1, keepdims=True)).astype(np.float32)
    probs[::3, rng.random(v) < 0.7] = 0.0
    rows = np.arange(n)
    probs[rows, edges] = np.maximum(probs[rows, edges], 0.25)  # every target column carries mass
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    lo = np.where(np.asarray(edges) > 0, cdf[rows, np.maximum(np.asarray(edges) - 1, 0)], 0.0)
    mid = (lo + cdf[rows, edges]) / 2 / cdf[:, -1]
    bits = jax.lax.bitcast_convert_type(jnp.asarray(probs), jnp.uint32)
    search = jax.jit(certified_search, static_argnums=2)

    def sequential(u):
        t = u * cdf[:, -1]
        return (cdf > t[:, None]).argmax(1)

    k = _k_for(mid)
    u = (np.asarray(k.hi, np.float64) * 2.0**32 + np.asarray(k.lo, np.float64)) * 2.0**-53
    idx, cert = (np.asarray(a) for a in search(bits, k, "two_level"))
    assert cert.all()
    np.testing.assert_array_equal(idx, edges)
    np.testing.assert_array_equal(idx, sequential(u))
    np.testing.assert_array_equal(idx, np.asarray(search(bits, k, "xla")[0]))

    k = _k_for(lo / cdf[:, -1])  # on (or a rounding away from) the prefix sum before each target
    u = (np.asarray(k.hi, np.float64) * 2.0**32 + np.asarray(k.lo, np.float64)) * 2.0**-53
    idx, cert = (np.asarray(a) for a in search(bits, k, "two_level"))
    np.testing.assert_array_equal(idx[cert], sequential(u)[cert])
    idx_x, cert_x = (np.asarray(a) for a in search(bits, k, "xla"))
    both = cert & cert_x
    np.testing.assert_array_equal(idx[both], idx_x[both])
