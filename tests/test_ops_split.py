"""``ops.split_bf16x3``: three bf16 pieces that sum exactly to an fp32 value (what the GPU vocabulary head relies on
to multiply fp32 hidden states by a bf16 weight with bf16 GEMMs; tests/test_head_gpu.py checks the product)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.ops import split_bf16x3


def test_three_bf16_pieces_sum_exactly_to_fp32():
    rng = np.random.default_rng(0)
    mags = 2.0 ** rng.uniform(-90, 100, 200_000)   # the documented range
    x = (rng.standard_normal(200_000) * mags).astype(np.float32)
    x[:4] = [np.float32(1 + 2 ** -23), np.float32(-(2 - 2 ** -23)), np.float32(3.0), 0.0]
    parts = np.asarray(split_bf16x3(jnp.asarray(x)).astype(jnp.float32), np.float64)
    assert parts.shape == (3, x.size)
    np.testing.assert_array_equal(parts.sum(axis=0), x.astype(np.float64))


def _fp32_product_bound(x: np.ndarray, w: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """Largest error of ``got`` against float64 ``x · wᵀ`` relative to ``Σ|x w|`` per output, and the bound an fp32
    sum of K products meets in practice (4 · sqrt(K) · 2^-24; the worst case is K · 2^-24)."""
    want = x.astype(np.float64) @ w.astype(np.float64).T
    mag = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    return float((np.abs(np.asarray(got, np.float64) - want) / mag).max()), 4 * np.sqrt(x.shape[-1]) * 2.0 ** -24


def test_split_k_fp32_projection_matches_float64():
    """The split-K form of ``linear_f32`` (forced here; the default takes it on a GPU for decode-sized calls) on
    the mHC mix's shape ``[rows, 4·4096] × [24, 4·4096]ᵀ``: fp32 products and sums, only their order changes, so
    it meets an fp32 GEMM's bound against float64. A wrong piece layout (pieces of x paired with other pieces of
    w) would be off by O(1)."""
    from dinfer_jax.models.ops import linear_f32

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 16384)).astype(np.float32)
    w = (rng.standard_normal((24, 16384)) * 0.02).astype(np.float32)
    got = linear_f32(jnp.asarray(x), jnp.asarray(w), split_k=True)
    assert got.shape == (2, 3, 24) and got.dtype == jnp.float32
    err, bound = _fp32_product_bound(x.reshape(6, -1), w, np.asarray(got).reshape(6, -1))
    assert err < bound, (err, bound)
    direct = linear_f32(jnp.asarray(x), jnp.asarray(w), split_k=False)
    err, bound = _fp32_product_bound(x.reshape(6, -1), w, np.asarray(direct).reshape(6, -1))
    assert err < bound, (err, bound)


def test_split_k_takes_bf16_weights_exactly():
    """A bf16 weight is widened exactly before the fp32 product (the compressor's and router's weights)."""
    from dinfer_jax.models.ops import linear_f32

    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 4096)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((256, 4096)) * 0.02, jnp.bfloat16)
    got = linear_f32(jnp.asarray(x), w, split_k=True)
    err, bound = _fp32_product_bound(x, np.asarray(w.astype(jnp.float32)), np.asarray(got))
    assert err < bound, (err, bound)
