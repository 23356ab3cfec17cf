"""``sampling.top_n.top_n`` is ``lax.top_k`` bit for bit: values and indices, on rows with ties, -inf entries,
NaNs of both signs, ±0, rows shorter than a chunk and vocabularies that are not a multiple of the chunk
(the reference is ``lax.top_k`` itself, a different algorithm over the whole row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.sampling.top_n import top_n


def _rows(rng: np.random.Generator, r: int, v: int, kind: str) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal((r, v)).astype(np.float32)
    if kind == "ties":                  # few distinct values: many ties across and within chunks
        return rng.integers(-3, 3, (r, v)).astype(np.float32)
    if kind == "masked":                # logprobs with most tokens filtered out (-inf), some rows almost empty
        x = np.log(rng.random((r, v))).astype(np.float32)
        x[rng.random((r, v)) < 0.999] = -np.inf
        x[0, :] = -np.inf
        x[0, v - 1] = 0.0
        return x
    x = rng.standard_normal((r, v)).astype(np.float32)   # "special": NaNs of both signs, infinities, signed zeros
    flat = x.reshape(-1)
    for val, frac in ((np.nan, 0.001), (-np.nan, 0.001), (np.inf, 0.0005), (-np.inf, 0.01), (0.0, 0.01),
                      (-0.0, 0.01)):
        flat[rng.random(flat.size) < frac] = val
    return x


@pytest.mark.parametrize("v", [129280, 1000, 1025, 300])
@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "special"])
@pytest.mark.parametrize("n", [1, 5, 20])
def test_top_n_is_lax_top_k(v, kind, n):
    rng = np.random.default_rng(v + n + len(kind))
    x = jnp.asarray(_rows(rng, 8 if v > 10000 else 64, v, kind))
    got_v, got_i = jax.jit(top_n, static_argnums=1)(x, n)
    want_v, want_i = jax.lax.top_k(x, n)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))
    assert got_i.dtype == jnp.int32
