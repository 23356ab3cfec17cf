"""mHC stream mixing (``dinfer_jax.models.mhc``) against float64 closed forms: the collapse ``Σ_j pre_j X_j``, the
expansion ``X'_k = post_k y + Σ_j comb[j,k] X_j`` (index order matters: a transposed comb is off by O(1)); the
head's collapse is the same sum. Sums of four fp32 products: the bound is 4 · 2^-24 relative to ``Σ|terms|``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.mhc import hc_collapse, hc_post


def _rel_err(got: np.ndarray, want: np.ndarray, mag: np.ndarray) -> float:
    return float((np.abs(np.asarray(got, np.float64) - want) / mag).max())


def test_collapse_and_expansion_match_float64():
    rng = np.random.default_rng(0)
    B, S, n, D = 2, 3, 4, 64
    x = rng.standard_normal((B, S, n, D)).astype(np.float32)
    pre = rng.uniform(0, 1, (B, S, n)).astype(np.float32)
    post = rng.uniform(0, 2, (B, S, n)).astype(np.float32)
    comb = rng.uniform(0, 1, (B, S, n, n)).astype(np.float32)
    y = rng.standard_normal((B, S, D)).astype(np.float32)
    x64 = x.astype(np.float64)

    got = hc_collapse(jnp.asarray(x), jnp.asarray(pre))
    want = np.einsum("bsj,bsjd->bsd", pre.astype(np.float64), x64)
    mag = np.einsum("bsj,bsjd->bsd", np.abs(pre.astype(np.float64)), np.abs(x64))
    assert got.dtype == jnp.float32 and _rel_err(got, want, mag) < 4 * 2.0 ** -24

    got = hc_post(jnp.asarray(x), jnp.asarray(y), jnp.asarray(post), jnp.asarray(comb))
    py = post.astype(np.float64)[..., None] * y.astype(np.float64)[..., None, :]
    want = py + np.einsum("bsjk,bsjd->bskd", comb.astype(np.float64), x64)
    mag = np.abs(py) + np.einsum("bsjk,bsjd->bskd", comb.astype(np.float64), np.abs(x64))
    assert got.shape == (B, S, n, D) and _rel_err(got, want, mag) < 5 * 2.0 ** -24
