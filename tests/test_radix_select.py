"""The sort-free top-k (:mod:`dinfer_jax.models.radix_select`) against ``lax.top_k`` (through
:func:`csa2.topk_select`, the model's selection) and NumPy: the same indices and mask bit for bit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models import csa2
from dinfer_jax.models.csa2 import topk_impl, topk_select
from dinfer_jax.models.radix_select import inclusive_counts, kth_largest_key, order_keys, radix_topk_select

_sorted = jax.jit(functools.partial(topk_select, impl="sort"), static_argnums=1)
_radix = jax.jit(radix_topk_select, static_argnums=1)


def _scores(rng: np.random.Generator, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "ties":             # a handful of distinct values: the k-th falls inside a run of equal scores
        x = np.round(x * 2) / 2
    elif kind == "masked":         # invisible rows, as the indexer leaves them
        x[rng.random(shape) < 0.6] = -np.inf
    elif kind == "zeros":          # ±0 only: lax.top_k ranks −0 below +0
        x = np.where(rng.random(shape) < 0.5, np.float32(0.0), np.float32(-0.0))
    elif kind == "extremes":       # subnormals, infinities and NaNs of both signs
        x = x * np.float32(1e-41)
        for value, share in ((np.inf, 0.05), (-np.inf, 0.05), (np.nan, 0.03), (-np.nan, 0.03), (3e38, 0.02)):
            x[rng.random(shape) < share] = value
    elif kind == "all_masked":
        x[:] = -np.inf
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "zeros", "extremes", "all_masked"])
def test_equals_lax_top_k_selection(kind):
    rng = np.random.default_rng(len(kind))
    for _ in range(8):
        rows, t = int(rng.integers(1, 5)), int(rng.integers(1, 700))
        k = int(rng.integers(1, 2 * t + 2))                     # also k ≥ T (clipped to T)
        x = jnp.asarray(_scores(rng, kind, (rows, t)))
        (want_idx, want_mask), (idx, mask) = _sorted(x, k), _radix(x, k)
        assert idx.shape == want_idx.shape and idx.dtype == want_idx.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx), err_msg=f"{kind} T={t} k={k}")
        np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask), err_msg=f"{kind} T={t} k={k}")


def test_leading_dims_and_real_sizes():
    """``[B, S, T]`` scores as the model passes them, at the V4.1-Flash top-k (512) over 4,096 rows, with the
    causal −inf tail of a prefill chunk."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 4096)).astype(np.float32)
    visible = np.array([100, 600, 4096])
    x = np.where(np.arange(4096)[None, None, :] < visible[None, :, None], x, -np.inf).astype(np.float32)
    (want_idx, want_mask), (idx, mask) = _sorted(jnp.asarray(x), 512), _radix(jnp.asarray(x), 512)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask))
    assert (np.asarray(idx)[:, 0, 100:] == -1).all() and (np.asarray(idx)[:, 2] >= 0).all()


def test_keys_follow_total_order():
    values = np.array([-np.nan, -np.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, np.inf, np.nan],
                      np.float32)
    values[0] = -np.abs(values[0])                                         # a NaN with the sign bit set
    keys = np.asarray(order_keys(jnp.asarray(values)))
    assert (np.diff(keys.astype(np.int64)) > 0).all()


@pytest.mark.parametrize("digit_bits,counts_minor", [(4, True), (4, False), (2, False), (8, True)])
def test_kth_largest_key_against_numpy(digit_bits, counts_minor):
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 2**32, size=(5, 300), dtype=np.uint64).astype(np.uint32)
    keys[1, :150] = keys[1, 0]                                            # a long run of one key
    keys[2] = rng.integers(0, 4, size=300)                                # small keys: many equal top bits
    for k in (1, 2, 150, 151, 299, 300):
        key, take = map(np.asarray, kth_largest_key(jnp.asarray(keys), k, digit_bits=digit_bits,
                                                    counts_minor=counts_minor))
        want = np.sort(keys, axis=1)[:, ::-1][:, k - 1]
        np.testing.assert_array_equal(key, want)
        np.testing.assert_array_equal(take, k - (keys > want[:, None]).sum(axis=1))


def test_inclusive_counts_against_cumsum():
    mask = np.random.default_rng(4).random((3, 1000)) < 0.7                 # 1000 = 7 chunks and a partial one
    np.testing.assert_array_equal(np.asarray(inclusive_counts(jnp.asarray(mask))), np.cumsum(mask, axis=1))


def test_rejects_digit_widths_that_do_not_divide_32():
    with pytest.raises(ValueError, match="digit_bits=3 must divide 32"):
        kth_largest_key(jnp.zeros((1, 4), jnp.uint32), 1, digit_bits=3)


def test_the_model_selection_picks_radix_only_for_many_long_rows_on_a_gpu():
    """The measured crossover (H200; csa2's comment): radix from 16,384 scores a row with at least 64 rows."""
    assert topk_impl(16384, 64, "gpu") == "radix" and topk_impl(65536, 1024, "gpu") == "radix"
    assert topk_impl(16383, 64, "gpu") == "sort" and topk_impl(65536, 63, "gpu") == "sort"
    assert topk_impl(65536, 1024, "cpu") == "sort"


def test_the_model_selection_with_radix_equals_sort(monkeypatch):
    """``topk_select`` as the model calls it (``impl="auto"``) on a GPU-sized shape with the backend answering
    "gpu": the radix path is traced (its options as csa2 sets them) and gives lax.top_k's selection."""
    rng = np.random.default_rng(11)
    x = _scores(rng, "masked", (64, 1, 16384))
    x[:, :, rng.random(16384) < 0.01] = 1.5                # ~164 equal scores a row, around the 512th largest
    want = _sorted(jnp.asarray(x), 512)
    calls = []
    real = csa2.radix_topk_select
    monkeypatch.setattr(csa2, "radix_topk_select", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = topk_select(jnp.asarray(x), 512)
    assert calls == [csa2.RADIX_OPTIONS]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_topk_select_rejects_unknown_impl():
    with pytest.raises(ValueError, match="impl='heap' is not one of"):
        topk_select(jnp.zeros((2, 8)), 4, impl="heap")
