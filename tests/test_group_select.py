"""The group-maxima top-k (:mod:`dinfer_jax.models.group_select`) against ``lax.top_k`` through
:func:`csa2.topk_select` (``impl="sort"``): the same indices and mask bit for bit, on inputs that stress the tie
rule and the total order, with group sizes small enough that the rows recurse through several levels of group
maxima; and the model's choice between the two (``csa2.topk_impl``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models import csa2
from dinfer_jax.models.csa2 import topk_impl, topk_select
from dinfer_jax.models.group_select import group_topk_select, int_keys, top_indices

_sorted = jax.jit(functools.partial(topk_select, impl="sort"), static_argnums=1)
_group = jax.jit(group_topk_select, static_argnums=1, static_argnames="group")


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


def _levels(t: int, k: int, group: int) -> int:
    """How many levels of group maxima ``top_indices`` goes through for a row of ``t``."""
    levels = 0
    while t >= 2 * k * group:
        t, levels = -(-t // group), levels + 1
    return levels


# (T, k): three and two levels of group maxima at every group size tested, one level, none (T < 2·k·g), and k > T
SHAPES = [(1499, 1), (1000, 5), (700, 40), (300, 299), (50, 60)]


@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "zeros", "extremes", "all_masked"])
@pytest.mark.parametrize("group", [2, 3, 8])
def test_equals_lax_top_k_selection(kind, group):
    rng = np.random.default_rng(len(kind) + 10 * group)
    for t, k in SHAPES:
        x = jnp.asarray(_scores(rng, kind, (3, t)))
        (want_idx, want_mask), (idx, mask) = _sorted(x, k), _group(x, k, group=group)
        assert idx.shape == want_idx.shape and idx.dtype == want_idx.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx), err_msg=f"{kind} T={t} k={k}")
        np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask), err_msg=f"{kind} T={t} k={k}")


def test_the_shapes_cover_every_depth():
    """At each group size of the test above, SHAPES include a plain top_k (no level) and rows that recurse through
    at least three levels of group maxima (so the recursion and the padding of partial groups are exercised)."""
    for group in (2, 3, 8):
        levels = {_levels(t, min(k, t), group) for t, k in SHAPES}
        assert 0 in levels and max(levels) >= 3, (group, levels)


def test_ties_across_groups_pick_the_lowest_indices():
    """The case the tie argument is about: the k-th best group maximum shared by many groups, and entries equal to
    it inside groups with a larger maximum (which sit at lower or higher indices)."""
    t, k, group = 4096, 16, 4
    x = np.zeros((3, t), np.float32)
    x[0, ::7] = 1.0                          # 586 groups of maximum 1; the top 16 are the first 16 ones
    x[1, 100:4096:4] = 1.0
    x[1, [3000, 3500]] = 2.0                 # two groups above the tie, each also holding a 1 at a lower index
    x[1, [2999, 3499]] = 1.0
    x[2] = np.round(np.random.default_rng(5).standard_normal(t))   # a handful of values, long runs of ties
    (want_idx, want_mask), (idx, mask) = _sorted(jnp.asarray(x), k), _group(jnp.asarray(x), k, group=group)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask))


def test_real_sizes_and_leading_dims():
    """``[B, S, T]`` as the model passes them: the V4.1-Flash top-k (512) over 16,384 and 65,536 scores (one and two
    levels of maxima at the default group of 8), with short visible prefixes (−inf tails)."""
    rng = np.random.default_rng(9)
    for t in (16384, 65536):
        x = rng.standard_normal((2, 2, t)).astype(np.float32)
        visible = np.array([300, t])
        x = np.where(np.arange(t)[None, None, :] < visible[None, :, None], x, -np.inf).astype(np.float32)
        (want_idx, want_mask), (idx, mask) = _sorted(jnp.asarray(x), 512), _group(jnp.asarray(x), 512)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
        np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask))
        assert (np.asarray(idx)[:, 0, 300:] == -1).all() and (np.asarray(idx)[:, 1] >= 0).all()


def test_int_keys_follow_total_order():
    values = np.array([-np.nan, -np.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, np.inf, np.nan],
                      np.float32)
    values[0] = -np.abs(values[0])                                         # a NaN with the sign bit set
    assert (np.diff(np.asarray(int_keys(jnp.asarray(values))).astype(np.int64)) > 0).all()


def test_top_indices_is_lax_top_k_as_a_set():
    keys = np.random.default_rng(2).integers(-2**31, 2**31, size=(4, 5000), dtype=np.int64).astype(np.int32)
    keys[1] = keys[1] % 3                                                  # heavy ties
    got = np.asarray(top_indices(jnp.asarray(keys), 40, group=4))
    want = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(keys), 40)[1]), axis=-1)
    np.testing.assert_array_equal(got, want)


def test_k_beyond_the_row_is_clipped():
    x = jnp.asarray([[0.5, -jnp.inf, 2.0, 1.0, jnp.nan]], jnp.float32)
    for got, want in zip(_group(x, 9), _sorted(x, 9), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_model_selection_picks_groups_only_for_many_long_rows_on_a_gpu():
    """The measured crossover (csa2's comment): groups from 16,384 scores a row with at least 64 rows."""
    assert topk_impl(16384, 64, "gpu") == "group" and topk_impl(65536, 1024, "gpu") == "group"
    assert topk_impl(16383, 64, "gpu") == "sort" and topk_impl(65536, 63, "gpu") == "sort"
    assert topk_impl(65536, 1024, "cpu") == "sort"


def test_the_model_selection_with_groups_equals_sort(monkeypatch):
    """``topk_select`` as the model calls it (``impl="auto"``) on a GPU-sized shape with the backend answering
    "gpu": the group path is traced and gives lax.top_k's selection, ties at the threshold included."""
    rng = np.random.default_rng(11)
    x = _scores(rng, "masked", (64, 1, 16384))
    x[:, :, rng.random(16384) < 0.01] = 1.5                # ~164 equal scores a row, around the 512th largest
    want = _sorted(jnp.asarray(x), 512)
    calls = []
    real = csa2.group_topk_select
    monkeypatch.setattr(csa2, "group_topk_select", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = topk_select(jnp.asarray(x), 512)
    assert calls == [512]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_topk_select_rejects_unknown_impl():
    with pytest.raises(ValueError, match="impl='heap' is not one of"):
        topk_select(jnp.zeros((2, 8)), 4, impl="heap")
