"""The vocabulary head's fp32-accurate product with a bf16 weight (``ops.linear_fp32_input``) on an accelerator,
against a float64 reference. Marked ``gpu`` (excluded from CI); the exact split it relies on is tested on CPU
(``tests/test_ops_split.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models.ops import linear_fp32_input

pytestmark = pytest.mark.gpu


def test_head_product_is_fp32_accurate():
    """Error bound of an fp32 GEMM over K terms: about K · 2^-24 · Σ|x_k w_k| in the worst case, ~sqrt(K) · 2^-24 ·
    that in practice; we allow 4 · sqrt(K) · 2^-24 relative to Σ|x w| per output (K = 4096: 1.5e-5). Rounding ``x``
    to bf16 instead (the cheap mistake) gives ~2^-9 relative: 130 times over the bound."""
    if not [d for d in jax.devices() if d.platform != "cpu"]:
        pytest.skip("no accelerator backend")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((8192, 4096)) * 0.02, jnp.bfloat16)
    got = np.asarray(jax.jit(linear_fp32_input)(jnp.asarray(x), w), np.float64)
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    want = x.astype(np.float64) @ wf.T
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).T
    rel = np.abs(got - want) / mag
    assert rel.max() < 4 * np.sqrt(4096) * 2.0 ** -24, rel.max()


@pytest.mark.parametrize("rows,n,k", [(64, 24, 16384), (64, 1024, 4096), (8192, 24, 16384)])
def test_fp32_projection_is_fp32_accurate(rows, n, k):
    """``ops.linear_f32`` on the device at the model's fp32 projection shapes (mHC mix, compressor, prefill mHC
    mix): split-K for decode-sized calls, one GEMM above; both must be true fp32 products (no TF32: 2^-11 relative,
    far over the bound). Bound as in the head's test above."""
    from dinfer_jax.models.ops import linear_f32

    if not [d for d in jax.devices() if d.platform != "cpu"]:
        pytest.skip("no accelerator backend")
    rng = np.random.default_rng(rows + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    got = np.asarray(jax.jit(linear_f32)(jnp.asarray(x), jnp.asarray(w)), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    mag = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    rel = np.abs(got - want) / mag
    assert rel.max() < 4 * np.sqrt(k) * 2.0 ** -24, rel.max()
