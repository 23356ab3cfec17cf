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
