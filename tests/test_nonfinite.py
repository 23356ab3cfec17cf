"""Non-finite guards and cache isolation (issue 13, item 4).

A checkpoint with one NaN embedding row: every request that feeds that token must end with
``finish_reason="error"`` and a message naming the step and position (the device step reports such a row as
``NONFINITE_TOKEN``, no extra host sync); the other requests of the batch, and later requests that reuse the freed
KV pages and state slots (still holding the NaN request's values), must get exactly the tokens a fresh engine over
the clean checkpoint gives them. Before the guard the bad request emitted token 0 until ``max_tokens`` and the next
request on its pages emitted garbage (a stale row seen by a row's padding queries stayed in that row's
weighted sums, where 0 · NaN = NaN).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.buckets import Buckets
from dinfer_jax.models import load_config, load_model, random_model

BAD = 500  # the token whose embedding row is NaN


def _models(name: str):
    if name == "default":
        clean = load_model("default")
    else:
        clean = random_model(load_config("tiny-v4"), seed=3, std=0.1, include_mtp=False)
    params = dict(clean.params)
    params["embed"] = params["embed"].at[BAD].set(jnp.nan)
    return clean, dataclasses.replace(clean, params=params)


@pytest.mark.parametrize("name", ["default", "tiny-v4"])
def test_nan_embedding_row_ends_only_its_requests(name):
    clean, bad = _models(name)
    # the shapes of tests/test_default_model.py's engine: one process compiles them once
    kw = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32, progress=False,
              buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32,)))
    sp = [SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(temperature=0.8, seq_seed=2, max_tokens=8)]
    first = [[10, 11, 12, 13], [20, BAD, 22], [30, 31, 32, 33, 34], [40, 41, BAD]]
    later = [[10, 11, 12, 13], [30, 31, 32, 33, 34], [50, 51, 52], [60, 61, 62, 63, 64, 65]]
    params_first = [sp[i % 2] for i in range(len(first))]
    params_later = [sp[(i + 1) % 2] for i in range(len(later))]
    # references: fresh engines over the clean checkpoint (engines of one configuration share compiled programs)
    want_first = LLM(clean, **kw).generate(first, params_first, use_tqdm=False)
    want_later = LLM(clean, **kw).generate(later, params_later, use_tqdm=False)

    for async_scheduling in (True, False):
        engine = LLM(bad, async_scheduling=async_scheduling, **kw)
        got_first = engine.generate(first, params_first, use_tqdm=False)
        got_later = engine.generate(later, params_later, use_tqdm=False)  # on the NaN requests' freed pages, slots
        for i in (1, 3):  # the requests that feed the NaN row
            o = got_first[i]
            assert o.finish_reason == "error" and o.token_ids == [], (o.finish_reason, o.token_ids)
            assert "not finite" in o.error and "step" in o.error and "position" in o.error, o.error
        for i in (0, 2):
            assert got_first[i].token_ids == want_first[i].token_ids and got_first[i].finish_reason == "length"
        assert [o.token_ids for o in got_later] == [o.token_ids for o in want_later], async_scheduling
        assert all(o.finish_reason == "length" for o in got_later)
