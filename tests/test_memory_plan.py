"""KV pool sizing from device memory (``engine/memory_plan.py``) and the engine's weight copies.

XLA:CPU reports no device memory, so the planned path runs here through ``device_memory_bytes`` (what a user
sharing an accelerator passes); the pool must then fit the budget the plan states, and the plan's activation
figure must be the compiled step's own (its premise: temporaries do not depend on the pool's size)."""

from __future__ import annotations

import jax
import pytest

from dinfer_jax import LLM
from dinfer_jax.engine.memory_plan import temp_bytes
from dinfer_jax.models import load_config, random_model
from dinfer_jax.models.layer_plan import StackedLayers


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("tiny-v4"), seed=0, include_mtp=False)


def _tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def test_planned_pool_fits_the_budget_and_fills_it(model):
    llm = LLM(model, max_num_seqs=4, max_model_len=256, warmup=False, progress=False,
              device_memory_bytes=48 << 20, memory_utilization=0.8)
    plan = llm.memory_plan
    assert plan is not None and plan.device_bytes == 48 << 20
    # no device statistics on CPU: the weights, plus the scan-layout copy of the layers the runner makes while the
    # caller (this test) still holds the checkpoint-layout Model
    assert plan.in_use_bytes == model.param_bytes + _tree_bytes(model.params["layers"])
    assert plan.kv_bytes == int(0.8 * (48 << 20)) - plan.in_use_bytes - plan.activation_bytes
    pool = _tree_bytes(llm.runner.cache)
    assert pool <= plan.kv_bytes
    # one page more would not have fitted: the pool grows by a page's bytes per block
    per_page = pool // llm.cache_config.num_blocks
    assert pool + per_page > plan.kv_bytes - 64 * 1024    # state slots and rounding: well under one page here
    assert llm.kv_capacity_tokens == (llm.cache_config.num_blocks - 1) * llm.block_size


def test_activation_figure_is_the_served_steps_own(model):
    """The plan compiles the largest steps against a one-page-per-entry pool; the engine's own compiled step (full
    pool) must need the same temporaries (the model's program is the larger of the two a step runs here)."""
    from dinfer_jax.engine.runner import InFlight, empty_inputs, step_programs
    from dinfer_jax.models.step_state import StepInput

    llm = LLM(model, max_num_seqs=4, max_model_len=256, warmup=False, progress=False, device_memory_bytes=48 << 20)
    r = llm.runner
    (b, q, p), temp = max(llm.memory_plan.activation_by_shape.items(), key=lambda kv: kv[0][1])
    inp, feed = empty_inputs(b, q, p)
    compiled = step_programs().forward.lower(r.params, r.cache, StepInput(**inp), InFlight(**feed), r._prev_tokens,
                                             r._engram, **r._forward_static).compile()
    assert temp_bytes(compiled) == temp > 0


def test_too_little_memory_names_the_numbers(model):
    with pytest.raises(ValueError, match="no device memory left for the KV cache"):
        LLM(model, max_num_seqs=4, max_model_len=256, warmup=False, progress=False, device_memory_bytes=1 << 20)


def test_cpu_default_budget_and_single_weight_copy(model):
    llm = LLM(model, max_num_seqs=4, max_model_len=256, warmup=False, progress=False)
    assert llm.memory_plan is None                         # CPU: no device statistics, no device_memory_bytes
    assert _tree_bytes(llm.runner.cache) <= 256 << 20
    assert isinstance(llm.model.params["layers"], StackedLayers)
    assert llm.model is llm.runner.model and llm.runner.model.params is llm.runner.params


def test_draft_pools_count_in_the_budget():
    """Speculative decoding's per-slot draft state (token ids, log-prob rows over the vocabulary, the drafter's
    rings) comes out of the same budget as the pages: cache + draft state ≤ kv_cache_memory_bytes."""
    m = random_model(load_config("tiny-v4"), seed=0)                      # with its MTP block
    budget = 6 << 20
    llm = LLM(m, max_num_seqs=4, max_model_len=256, warmup=False, progress=False, kv_cache_memory_bytes=budget,
              speculative="mtp", num_speculative_tokens=2)
    spec = _tree_bytes(llm.runner.spec)
    assert spec > 0
    assert _tree_bytes(llm.runner.cache) + spec <= budget
