"""The engine's V4.1 SWA bounded replay (``LLM(yoco="mask" | "compact")``, DeepInfer's YOCO prefill truncation)
against the full-sequence forward's YOCO modes: a request's first sampled token and its logprob equal the forward's
``yoco="compact"`` result on the prompt (the forward's compact is its mask result, logits of the kept rows),
whatever the chunking and scheduling; short prompts (≤ keep) are untouched; bad settings are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.models import forward_logits, load_config, random_model, run

KEEP = 20          # tiny-v41's sliding window is 16: KEEP covers it, and prompts of 45–100 tokens are truncated
GEN = 6


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("tiny-v41"), seed=3, include_mtp=False)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_mask_engine_first_token_equals_forward_compact_and_short_prompts_are_exact(model):
    cfg = model.config
    assert cfg.sliding_window <= KEEP
    rng = np.random.default_rng(5)
    # 45 and 90 cross their floors (25, 70) inside a 32-token chunk; lengths of the compact test below (12, 45, 90):
    # the forward's compact programs are compiled once for both tests
    lengths = [12, 45, 90]
    prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, n)] for n in lengths]
    llm = LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, progress=False, max_logprobs=1,
              buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32, 128), pages=(8,)),
              yoco="mask", yoco_keep=KEEP)
    compiled = llm.metrics()["compilations"]
    sp = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True, logprobs=1)
    results = {}
    for name, switches in {"async+chunked": dict(async_scheduling=True, max_num_batched_tokens=32),
                           "sync+unchunked": dict(async_scheduling=False, max_num_batched_tokens=128)}.items():
        llm.configure(**switches)
        results[name] = llm.generate(prompts, sp, use_tqdm=False)
    llm.configure(async_scheduling=True, max_num_batched_tokens=32)
    results["one at a time"] = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    # greedy logprobs are those of the processed (one-hot) distribution; at temperature 1 they are log_softmax
    drawn = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1, logprobs=1, seq_seed=11),
                         use_tqdm=False)
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"

    # the exact (untruncated) forward, once over the 90-token prompt and the short prompt's final sequence
    # right-padded to it (causal: a row's logits at t see only its tokens ≤ t)
    short = lengths.index(12)
    exact_rows = [prompts[lengths.index(90)], prompts[short] + results["async+chunked"][short].token_ids]
    exact = forward_logits(model, np.asarray([r + [r[-1]] * (90 - len(r)) for r in exact_rows]))
    for i, p in enumerate(prompts):
        ids = np.asarray([p])
        compact = np.asarray(run(model, ids, yoco="compact", yoco_keep=KEEP).logits)[0, -1]
        want_tok = int(compact.argmax())
        for name, outs in results.items():
            assert outs[i].token_ids[0] == want_tok, f"{name}: prompt {i} (len {lengths[i]}) first token"
        # fp32 on both sides; the engine sums attention over cached pages and chunks in another order than the
        # one-shot forward: differences of a few fp32 ulps of the logits, far below 1e-4
        tok = drawn[i].token_ids[0]
        assert drawn[i].logprobs[0]["logprob"] == pytest.approx(float(_log_softmax(compact)[tok]), abs=1e-4)
        if len(p) == 90:
            # the truncation must matter here, else this test shows nothing: fp32 noise is ~1e-7 of the logits'
            # scale, the truncation moves them by far more (~7e-3 of it for a 70-token prompt; the logprob check
            # above is to 1e-4)
            off = exact[0, -1]
            assert np.abs(compact - off).max() > 1e-4 * np.abs(off).max()
        if len(p) <= KEEP:  # nothing to truncate: the whole continuation equals the exact forward's greedy argmax
            assert i == short
            ref = exact[1, len(p) - 1: len(p) + GEN - 1].argmax(-1)
            assert results["async+chunked"][i].token_ids == [int(t) for t in ref]
    for name, outs in results.items():   # decode after the truncated prefill: the same under every schedule
        assert [o.token_ids for o in outs] == [o.token_ids for o in results["async+chunked"]], name


def test_compact_engine_skips_the_region_below_the_floor_and_equals_forward_compact(model):
    """``yoco="compact"``: a prompt's kept suffix is its own chunk and the chunks below it run the YOCO region's
    KV sources only; first token and logprob equal the full forward's ``compact`` result (as ``mask``), greedy
    continuations equal those of ``yoco="mask"``, short prompts are exact."""
    cfg = model.config
    rng = np.random.default_rng(7)
    lengths = [12, 45, 90, 100]
    prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, n)] for n in lengths]
    kw = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, progress=False, max_logprobs=1,
              buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(64,), pages=(8,)),
              yoco_keep=KEEP)
    sp = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    compact = LLM(model, yoco="compact", **kw)
    compiled = compact.metrics()["compilations"]
    outs = compact.generate(prompts, sp, use_tqdm=False)
    alone = [compact.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    drawn = compact.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1, logprobs=1, seq_seed=11),
                             use_tqdm=False)
    m = compact.metrics()
    assert m["compilations"] == compiled, "compiled outside warm-up"
    # every prompt longer than KEEP prefilled its kept-out part in region-skipping steps (3 long prompts, 3 runs)
    assert m["yoco_skipped_steps"] >= 9
    # the reference engine has the mask test's buckets (its programs are reused; a 64-token budget fills the 128
    # bucket)
    mask = LLM(model, yoco="mask", **{**kw, "buckets": Buckets(decode_batch=(4,), prefill_batch=(4,),
                                                               prefill_len=(32, 128), pages=(8,))})
    want = mask.generate(prompts, sp, use_tqdm=False)
    for i, p in enumerate(prompts):
        ref = np.asarray(run(model, np.asarray([p]), yoco="compact", yoco_keep=KEEP).logits)[0, -1]
        assert outs[i].token_ids[0] == alone[i].token_ids[0] == int(ref.argmax()), f"prompt {i}: first token"
        tok = drawn[i].token_ids[0]
        assert drawn[i].logprobs[0]["logprob"] == pytest.approx(float(_log_softmax(ref)[tok]), abs=1e-4)
        assert outs[i].token_ids == alone[i].token_ids == want[i].token_ids, f"prompt {i}: continuation"


def test_bad_yoco_settings_are_refused(model):
    kw = dict(max_num_seqs=2, max_model_len=64, warmup=False, progress=False, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        LLM(model, yoco="compact", enable_chunked_prefill=False, **kw)
    llm = LLM(model, yoco="compact", **kw)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        llm.configure(enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="not combined with speculative"):
        LLM(random_model(load_config("tiny-v41"), seed=3), yoco="compact", speculative="dspark",
            num_speculative_tokens=2, **kw)
    with pytest.raises(ValueError, match="yoco must be"):
        LLM(model, yoco="on", **kw)
    with pytest.raises(ValueError, match=r"yoco_keep=8 .*sliding window \(16\)"):
        LLM(model, yoco="mask", yoco_keep=8, **kw)
    with pytest.raises(ValueError, match="V4.1"):
        LLM(random_model(load_config("tiny-v4"), seed=0, include_mtp=False), yoco="mask", **kw)
