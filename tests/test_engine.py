"""The serving engine against the full-sequence reference: greedy ``LLM.generate`` must produce exactly the tokens
of step-by-step argmax over ``forward_logits`` on the growing sequence, for V4 and V4.1, whatever the scheduling
(chunked or not, async or sync, batched or one at a time) and whatever page buckets a request's steps pass through
(a step's page table is the smallest compiled bucket covering its rows' context; the indexer top-k and candidate
blocks must see exactly the pages that exist). Also: stop conditions, errors, preemption, compilation count after
warm-up, metrics.

The reference is computed with one causal forward over each final sequence (right-padded to a common length):
logits at position t depend only on tokens ≤ t, so argmax at positions P−1 … P+G−2 is exactly the greedy
continuation of the growing sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.models import forward_logits, load_config, random_model
from helpers import engine_models, record_step_shapes

GEN = 32


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, vocab, size=n)] for n in lengths]


def _reference_continuations(model, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    S = max(len(s) for s in seqs)
    batch = np.array([s + [s[-1]] * (S - len(s)) for s in seqs])
    logits = forward_logits(model, batch)
    ref = []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        ref.append([int(t) for t in logits[i, len(p) - 1: len(p) + len(o) - 1].argmax(-1)])
    return ref


def _small_buckets(max_num_seqs: int, max_tokens: int) -> Buckets:
    """One decode and one prefill shape. The tiny-V4 engines below all use max_model_len=128 (one page bucket of
    8 pages) and the default pool: their programs are those of the greedy test's V4 engine, compiled once."""
    return Buckets(decode_batch=(max_num_seqs,), prefill_batch=(max_num_seqs,), prefill_len=(max_tokens,))


MODELS = engine_models()


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def test_greedy_generation_equals_full_forward_argmax(model):
    cfg = model.config
    # Mixed lengths: beyond the SWA window (8 / 16), spanning several compressed groups and 16-token KV pages.
    lengths = [5, 23, 41, 70]
    prompts = _prompts(cfg.vocab_size, lengths)
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    # One engine (one set of compiled buckets); scheduling switches are host-side only. Page buckets of 2 and 8 pages
    # of 16 tokens: contexts up to 70 + GEN = 102 tokens, so requests move from the small table to the large one and
    # rows of one step need different page counts; chunked prefill cuts block tables to the step's context.
    llm = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, progress=False,
              buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32, 128), pages=(2, 8)))
    compiled = llm.metrics()["compilations"]  # may be below the shape count: same-model engines share steps
    assert llm.runner.compiled_shapes == set(llm.buckets.shapes()) and len(llm.buckets.shapes()) == 6
    seen = record_step_shapes(llm)
    variants = {"async+chunked": dict(async_scheduling=True, max_num_batched_tokens=32),
                "sync+unchunked": dict(async_scheduling=False, max_num_batched_tokens=128)}
    results = {}
    for name, switches in variants.items():
        llm.configure(**switches)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert all(o.finish_reason == "length" and len(o.token_ids) == GEN for o in outs), name
        results[name] = [o.token_ids for o in outs]
    llm.configure(async_scheduling=True, max_num_batched_tokens=32)
    results["async one-at-a-time"] = [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"
    assert {p for _, (_, _, p) in seen} == {2, 8}, "steps should pass through both page buckets"
    ref = _reference_continuations(model, prompts, results["async+chunked"])
    for name, toks in results.items():
        for i, (got, want) in enumerate(zip(toks, ref, strict=True)):
            assert got == want, f"{name}: prompt {i} (len {lengths[i]}) diverges from the full-forward argmax"


def test_stop_conditions_errors_and_isolation():
    model = random_model(load_config("tiny-v4"), seed=5, std=0.1, include_mtp=False)
    llm = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, buckets=_small_buckets(4, 32))
    prompts = _prompts(model.config.vocab_size, [10, 12, 9, 11], seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    clean = llm.generate(prompts, greedy, use_tqdm=False)
    stop_tok = clean[1].token_ids[4]
    bad_requests = [
        [1, 2, model.config.vocab_size + 5],  # unknown token id
        list(range(1, 140)),  # longer than max_model_len
        [],  # empty
    ]
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_tok,), ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), greedy] + [greedy] * 3
    outs = llm.generate(prompts + bad_requests, params, use_tqdm=False)
    assert outs[0].token_ids == clean[0].token_ids and outs[0].finish_reason == "length"
    cut = clean[1].token_ids.index(stop_tok) + 1
    assert outs[1].token_ids == clean[1].token_ids[:cut] and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == clean[2].token_ids[:3] and outs[2].finish_reason == "length"
    assert outs[3].token_ids == clean[3].token_ids
    for o, needle in zip(outs[4:], ["vocab", "max_model_len", "empty"], strict=True):
        assert o.finish_reason == "error" and needle in o.error.lower(), o.error
        assert o.token_ids == []


def test_preemption_under_small_pool_does_not_corrupt_others():
    """A pool of 9 blocks × 16 tokens cannot hold four 60-token sequences: the longest-output request is preempted
    (finish_reason "preempted"); the survivors' tokens equal their unconstrained greedy runs."""
    model = random_model(load_config("tiny-v4"), seed=6, std=0.1, include_mtp=False)
    prompts = _prompts(model.config.vocab_size, [20, 18, 22, 19], seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, buckets=_small_buckets(4, 32))
    want = [o.token_ids for o in roomy.generate(prompts, greedy, use_tqdm=False)]
    tight = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, buckets=_small_buckets(4, 32),
                num_kv_blocks=9)
    outs = tight.generate(prompts, greedy, use_tqdm=False)
    reasons = [o.finish_reason for o in outs]
    assert "preempted" in reasons, reasons
    for o, w in zip(outs, want, strict=True):
        if o.finish_reason == "preempted":
            assert o.token_ids == w[: len(o.token_ids)]  # what it produced before preemption is still right
        else:
            assert o.token_ids == w
    rec = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, buckets=_small_buckets(4, 32),
              num_kv_blocks=9, preemption_mode="recompute")
    assert [o.token_ids for o in rec.generate(prompts, greedy, use_tqdm=False)] == want


def test_no_compilation_after_warmup_over_50_varied_requests():
    model = random_model(load_config("tiny-v4"), seed=7, std=0.1, include_mtp=False)
    llm = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, buckets=_small_buckets(4, 32))
    after_warmup = llm.metrics()["compilations"]
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(4, 500, size=int(n))] for n in rng.integers(1, 60, size=50)]
    params = [SamplingParams(temperature=float(t), max_tokens=int(m), seq_seed=int(s))
              for t, m, s in zip(rng.uniform(0, 1.2, 50), rng.integers(1, 24, 50), rng.integers(0, 2**62, 50),
                                 strict=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    m = llm.metrics()
    assert m["compilations"] == after_warmup
    assert m["prefill_tokens"] >= sum(len(p) for p in prompts) and m["decode_steps"] > 0
    # seeded sampling is reproducible across runs and batch compositions
    again = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_logprobs_are_returned_per_generated_token():
    """Greedy with logprobs=3: one entry per output token; the chosen token is the top-1 of the processed
    distribution, its logprob is the largest, the top-3 are sorted, and probabilities are proper (≤ 0 logprobs)."""
    model = random_model(load_config("tiny-v4"), seed=8, std=0.1, include_mtp=False)
    llm = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, buckets=_small_buckets(4, 32))
    prompts = _prompts(model.config.vocab_size, [7, 12], seed=4)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
                                  SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)], use_tqdm=False)
    lp = outs[0].logprobs
    assert lp is not None and len(lp) == len(outs[0].token_ids) == 6
    for entry, tok in zip(lp, outs[0].token_ids, strict=True):
        top = entry["top"]
        assert entry["token"] == tok and top[0][0] == tok and len(top) == 3
        assert entry["logprob"] == pytest.approx(top[0][1]) and entry["logprob"] <= 0
        assert top[0][1] >= top[1][1] >= top[2][1]
    assert outs[1].logprobs is None


def test_decode_pace_counts_only_consecutive_decode_steps():
    """``decode_paced_steps`` counts decode steps whose predecessor (in the order the host processed them) was a
    decode step too: one request at a time (``max_num_seqs=1``) with max_tokens 4 then 7 runs prefill, 3 decodes,
    prefill, 6 decodes — 2 + 5 paced pairs of 9 decode steps — synchronous or asynchronous. Their summed time lies
    within the generate call's wall time. The sampler program's host call time is counted, inside the launches'."""
    model = random_model(load_config("tiny-v4"), seed=7, std=0.1, include_mtp=False)
    prompts = _prompts(model.config.vocab_size, [5, 9], seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 7)]
    for async_scheduling in (False, True):
        llm = LLM(model, max_num_seqs=1, max_model_len=128, max_num_batched_tokens=32,
                  buckets=_small_buckets(4, 32), async_scheduling=async_scheduling)
        before = llm.metrics()
        outs = llm.generate(prompts, params, use_tqdm=False)
        m = llm.metrics()
        assert [len(o.token_ids) for o in outs] == [4, 7]
        assert m["decode_steps"] - before["decode_steps"] == 9
        assert m["prefill_steps"] - before["prefill_steps"] == 2
        assert m["decode_paced_steps"] - before["decode_paced_steps"] == 7
        paced = m["decode_paced_seconds"] - before["decode_paced_seconds"]
        assert 0.0 < paced <= m["generate_seconds"] - before["generate_seconds"]
        assert m["decode_paced_step_ms"] == pytest.approx(1e3 * paced / 7)
        intervals = llm.decode_pace_ms()
        assert intervals.shape == (7,) and (intervals > 0).all() and intervals.sum() == pytest.approx(1e3 * paced)
        assert np.array_equal(llm.decode_pace_ms(last=2), intervals[-2:]) and llm.decode_pace_ms(last=0).size == 0
        with pytest.raises(ValueError, match="last must be >= 0"):
            llm.decode_pace_ms(last=-1)
        # the plain engine samples in its own program: its calls are part of the jitted calls' host time
        sampler = m["host_sampler_launch_seconds"] - before["host_sampler_launch_seconds"]
        assert 0.0 < sampler < m["host_launch_seconds"] - before["host_launch_seconds"]
