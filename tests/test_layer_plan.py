"""Layer grouping for the scan: periods of V4 / V4.1 presets, stacking round trip, cache layout."""

import jax
import numpy as np

from dinfer_jax.models import load_config, random_model
from dinfer_jax.models.layer_plan import LayerGroup, plan_layers, segment, stack_layers, unstack_layers
from dinfer_jax.models.step_state import CacheConfig, cache_shapes


def test_segment_finds_repeating_periods():
    assert segment(list("aabcbcbcb")) == (LayerGroup(0, 1, 2), LayerGroup(2, 2, 3), LayerGroup(8, 1, 1))
    assert segment(list("abc")) == tuple(LayerGroup(i, 1, 1) for i in range(3))


def test_v4_flash_plan_has_three_bodies_for_43_layers():
    plan = plan_layers(load_config("deepseek-v4-flash"))
    assert [(g.start, g.period, g.repeats) for g in plan] == [(0, 1, 2), (2, 1, 1), (3, 2, 20)]
    assert plan[-1].stop == 43


def test_stack_unstack_roundtrip_and_cache_layout():
    cfg = load_config("tiny-v41")
    model = random_model(cfg, seed=0, include_mtp=False)
    stacked = stack_layers(cfg, model.params["layers"])
    back = unstack_layers(cfg, stacked)
    for a, b in zip(jax.tree_util.tree_leaves(model.params["layers"]), jax.tree_util.tree_leaves(back), strict=False):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cache = cache_shapes(cfg, CacheConfig(3, 5, 4), "float32")
    for g, group in zip(plan_layers(cfg), cache.layers, strict=False):
        assert len(group) == g.period
        assert all(x.shape[0] == g.repeats for x in jax.tree_util.tree_leaves(group))
