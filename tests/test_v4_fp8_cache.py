"""V4 with ``LLM(kv_cache_dtype="fp8")``: FlashMLA ``model1`` KV rows and Hadamard-rotated FP4 index keys, the
numerics of DeepSeek's V4 reference (``docs/spec/model-v4.md`` §3.4, §3.7).

References: the Hadamard matrix against its closed-form properties; the cache arrays' bytes against the
hand-computed per-token figure (``kv_cache.bytes_per_token``, itself tested against hand arithmetic); the engine's
greedy tokens against the argmax of the full forward of the same quantised model (the serving invariant); and the
exact model, from which the quantised one must differ (the deviation is printed and documented, not bounded).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.kv_cache import bytes_per_block_and_slot, bytes_per_token
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.models import load_config, random_model, run
from dinfer_jax.models.fake_quant import hadamard
from dinfer_jax.models.step_state import CacheConfig, cache_shapes


def _model1_tiny():
    """tiny-v4 widened so its rows have a model1 form: 64 non-RoPE dims + 8 RoPE dims, 32-wide index keys."""
    return dataclasses.replace(load_config("tiny-v4"), head_dim=72, index_head_dim=32)


def test_hadamard_is_orthonormal():
    x = jnp.eye(32, dtype=jnp.float32)
    h = np.asarray(hadamard(x))                               # rows of H / sqrt(32)
    np.testing.assert_allclose(h @ h.T, np.eye(32), atol=1e-6)
    np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(32), rtol=1e-6)          # every entry ±1/√n
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 5, 128)).astype(np.float32)
    np.testing.assert_allclose(np.sum(np.asarray(hadamard(a)) * np.asarray(hadamard(b)), -1), np.sum(a * b, -1),
                               rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(jnp.ones((3, 24)))


def test_release_cache_bytes_match_model1_figure():
    """V4-Flash with the option: a 128-token page costs 128 × bytes_per_token(fp8) (3514.25 B a token: model1 rows
    of compressed KV, fp4_index keys) and the window ring holds 584-byte rows."""
    cfg = dataclasses.replace(load_config("deepseek-v4-flash"), kv_fake_quant=True)
    per_block, per_slot = bytes_per_block_and_slot(cfg, 128, jnp.bfloat16)
    assert per_block == 128 * bytes_per_token(load_config("deepseek-v4-flash"), kv_cache_dtype="fp8") == 128 * 3514.25
    exact_block, _ = bytes_per_block_and_slot(load_config("deepseek-v4-flash"), 128, jnp.bfloat16)
    assert exact_block == 128 * bytes_per_token(load_config("deepseek-v4-flash"), dtype=jnp.bfloat16)
    ring = cache_shapes(cfg, CacheConfig(2, 2, 128), jnp.bfloat16).layers[0][0].swa
    assert ring.dtype == jnp.uint8 and ring.shape[-1] == 584


def test_model_without_a_model1_form_is_refused():
    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)   # 24 non-RoPE dims
    with pytest.raises(ValueError, match="model1"):
        LLM(model, kv_cache_dtype="fp8", warmup=False, progress=False)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model, kv_cache_dtype="int4", warmup=False, progress=False)


def test_engine_greedy_equals_quantised_forward_and_deviation_is_fp8_sized():
    """Chunked prefill + decode over the byte caches give the argmax of the full forward with the same quantisation
    (so the cache round trip is exact and chunking changes nothing); the quantised forward differs from the exact
    one. How much is reported, not bounded: FP8 rows move scores by ~2^-4 relative, but FP4 index keys change which
    rows the top-k picks and that can move a random-weight model's logits by tens of percent (measured here: up to
    23% of the largest logit; docs/kv_formats.md)."""
    cfg = _model1_tiny()
    model = random_model(cfg, seed=4, std=0.1, include_mtp=False)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 70)]
    llm = LLM(model, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64, kv_cache_dtype="fp8",
              buckets=Buckets(decode_batch=(2,), prefill_batch=(2,), prefill_len=(32, 64)), progress=False)
    assert llm.config.kv_fake_quant and llm.runner.cache.layers[0][0].swa.dtype == jnp.uint8
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    fq = dataclasses.replace(model, config=dataclasses.replace(cfg, kv_fake_quant=True))
    # one quantised forward over both final sequences, right-padded to a common length (one compile; causal: a
    # row's logits at t see only its tokens ≤ t, so row 1's first 70 positions are the forward of prompts[1])
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    S = max(len(s) for s in seqs)
    fq_logits = np.asarray(run(fq, np.asarray([s + [s[-1]] * (S - len(s)) for s in seqs])).logits)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        want = fq_logits[i, len(p) - 1: len(p) - 1 + len(o.token_ids)].argmax(-1)
        assert o.token_ids == want.tolist()
    seq = np.asarray([prompts[1]])
    exact = np.asarray(run(model, seq).logits, np.float64)
    quant = np.asarray(fq_logits[1:, :len(prompts[1])], np.float64)
    scale = np.abs(exact).max()
    dev = np.abs(quant - exact)
    print(f"fp8 vs exact logits: max {dev.max() / scale:.2e}, mean {dev.mean() / scale:.2e} of max |logit|; "
          f"top-1 agreement {np.mean(quant.argmax(-1) == exact.argmax(-1)):.3f}")
    assert np.isfinite(quant).all() and dev.max() > 0
    jax.clear_caches()
