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
