"""Routed-expert rows (``dinfer_jax.models.expert_ffn``): the CPU path :func:`masked_expert_ffn` and the grouped
path (sort + ``ragged_dot``, :func:`grouped_expert_ffn`) against a float64 NumPy computation of each row
``y_m = ((silu(min(x·W1ᵀ, l)) · clip(x·W3ᵀ, ±l)) · w_m) · W2ᵀ`` with its own expert, and exactly 0 for rows whose slot
is ``L`` (no expert on this device).

Tolerance: fp32 products with fp32 accumulation over D = 96 and I = 40 terms against float64: relative errors of a
few 1e-7 per sum; the allowance 2e-5 × max|y| is ~30× that and far below the effect of a wrong expert, a missing
router weight or a dropped clamp (≥ 1e-2 × max|y| here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models.expert_ffn import grouped_expert_ffn, masked_expert_ffn

L, I, D, LIMIT = 6, 40, 96, 2.5


def _exact(x, slots, w, w1, w3, w2) -> np.ndarray:
    x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, w1, w3, w2))
    out = np.zeros((x.shape[0], w2.shape[1]))
    for m, e in enumerate(np.asarray(slots)):
        if e == L:
            continue
        g, u = np.minimum(x[m] @ w1[e].T, LIMIT), np.clip(x[m] @ w3[e].T, -LIMIT, LIMIT)
        out[m] = ((g / (1 + np.exp(-g))) * u * float(w[m])) @ w2[e].T
    return out


def _sorted_path(ex, x, slots, w):
    order = jnp.argsort(slots, stable=True)
    sizes = jnp.bincount(slots, length=L + 1)[:L].astype(jnp.int32)
    y = grouped_expert_ffn(x[order], sizes, ex["w1"], ex["w3"], ex["w2"], w[order], swiglu_limit=LIMIT)
    y = jnp.zeros_like(y).at[order].set(y)
    return jnp.where((slots < L)[:, None], y, 0.0)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_masked_and_grouped_rows_match_float64(rows):
    ks = jax.random.split(jax.random.key(rows), 6)
    ex = {"w1": jax.random.normal(ks[0], (L, I, D)) * 0.2, "w3": jax.random.normal(ks[1], (L, I, D)) * 0.2,
          "w2": jax.random.normal(ks[2], (L, D, I)) * 0.2}
    x = jax.random.normal(ks[3], (rows, D))
    slots = jax.random.randint(ks[4], (rows,), 0, L + 1).at[0].set(L if rows > 1 else 2)  # slot L: not here
    w = jax.random.uniform(ks[5], (rows,), minval=0.1, maxval=1.5)
    want = _exact(x, slots, w, ex["w1"], ex["w3"], ex["w2"])
    scale = np.abs(want).max()
    for got in (jax.jit(lambda *a: masked_expert_ffn(ex, *a, swiglu_limit=LIMIT))(x, slots, w),
                jax.jit(lambda *a: _sorted_path(ex, *a))(x, slots, w)):
        got = np.asarray(got, np.float64)
        err = np.abs(got - want)
        assert err.max() <= 2e-5 * scale, (err.max() / scale, err.mean() / scale)
        assert np.all(got[np.asarray(slots) == L] == 0.0)
