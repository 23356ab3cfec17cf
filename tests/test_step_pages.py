"""The step reads only what exists: page tables follow the batch's context, not ``max_model_len``.

A step's page table ``pages [B, P]`` has the smallest compiled page bucket covering its rows' ``start + n``; every
compressed-KV / index-key / candidate gather covers those ``P`` pages only, and serving compiles nothing after
warm-up. That greedy tokens still equal the full forward's argmax whatever page buckets a request's steps pass
through is checked by ``tests/test_engine.py::test_greedy_generation_equals_full_forward_argmax`` (two page buckets,
three models).
"""

from __future__ import annotations

import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.buckets import Buckets, page_buckets, pages_needed
from dinfer_jax.engine.runner import SAMPLER_VARIANTS
from dinfer_jax.models import load_config, random_model
from helpers import record_step_shapes


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, vocab, size=n)] for n in lengths]


def test_page_buckets_and_pages_needed():
    assert page_buckets(512, 16) == (16, 64, 256, 512)
    assert page_buckets(256, 16) == (16, 64, 256)
    assert page_buckets(8, 16) == (8,)  # max_model_len ≤ 256 tokens: one bucket
    assert page_buckets(64, 128) == (2, 8, 32, 64)
    assert page_buckets(100, 16, min_tokens=16, growth=2) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert pages_needed([], 16) == 1
    assert pages_needed([1, 16, 17], 16) == 2
    assert pages_needed([33], 16) == 3
    with pytest.raises(ValueError, match="growth"):
        page_buckets(8, 16, growth=1)


def test_buckets_resolve_and_pick():
    b = Buckets(decode_batch=(2,), prefill_batch=(2,), prefill_len=(32,))
    with pytest.raises(ValueError, match="not resolved"):
        b.shapes()
    r = b.resolve(max_pages=512, block_size=16)
    assert r.pages == (16, 64, 256, 512)
    assert r.shapes()[:4] == [(2, 1, 16), (2, 1, 64), (2, 1, 256), (2, 1, 512)]
    assert len(r.shapes()) == 8
    assert (r.pick_pages(1), r.pick_pages(16), r.pick_pages(17), r.pick_pages(512)) == (16, 16, 64, 512)
    with pytest.raises(ValueError, match="exceeds"):
        r.pick_pages(513)
    with pytest.raises(ValueError, match="does not cover"):
        Buckets((2,), (2,), (32,), pages=(1, 2)).resolve(max_pages=8, block_size=16)
    with pytest.raises(ValueError, match="increasing"):
        Buckets((2,), (2,), (32,), pages=(4, 2, 8)).resolve(max_pages=8, block_size=16)
    assert Buckets((2,), (2,), (32,), pages=(2, 8)).resolve(max_pages=8, block_size=16).pages == (2, 8)


def test_page_table_follows_context_not_max_model_len():
    """With ``max_model_len=4096`` (256 pages of 16 tokens; page buckets 16, 64, 256), short requests run with a
    16-page table, a longer one moves to 64 pages, and nothing compiles after warm-up."""
    model = random_model(load_config("tiny-v4"), seed=3, std=0.1, include_mtp=False)
    llm = LLM(model, max_num_seqs=2, max_model_len=4096, max_num_batched_tokens=64, progress=False,
              buckets=Buckets(decode_batch=(2,), prefill_batch=(2,), prefill_len=(64,)))
    assert llm.buckets.pages == (16, 64, 256)
    compiled = llm.metrics()["compilations"]   # may be below the count: same-model engines share programs
    assert llm.runner.compiled_shapes == set(llm.buckets.shapes()) and len(llm.buckets.shapes()) == 6
    assert llm.runner.compiled_samplers == {(2, f, g) for f, g in SAMPLER_VARIANTS}
    seen = record_step_shapes(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    short = llm.generate(_prompts(model.config.vocab_size, [3, 30]), greedy, use_tqdm=False)
    assert {shape for _, shape in seen} == {(2, 1, 16), (2, 64, 16)}
    seen.clear()
    long = llm.generate(_prompts(model.config.vocab_size, [300, 7], seed=1), greedy, use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in short + long)
    pages = [p for _, (_, _, p) in seen]
    assert pages[0] == 16 and pages[-1] == 64  # the first chunk needs 4 pages, the end 308 tokens = 20 pages
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"
