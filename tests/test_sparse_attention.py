"""Sparse reading of compressed rows: each query attends to its gathered top-k rows (``attention.attend_selected``)
instead of masking all of a step's compressed rows (``attention.attend``).

The two compute the same function (a masked entry contributes exp(-inf) = 0 to the softmax), so the references are
the dense paths themselves, computed independently of the gather: the closed-form identity on random inputs, the
full forward in both modes (V4 CSA layers, V4.1 KV/index sources and their consumers, byte caches), and the
gathering engine's greedy tokens against the masked full forward's argmax. fp32 throughout; the only difference
is summation order (window and selected rows in two products instead of one concatenation): one attention agrees
to ~1e-6 relative; through the 7 (V4) / 12 (V4.1) layers of the tiny presets the logits differ by at most ~1e-6 of
their largest magnitude (measured 9.4e-7 / 1.1e-6, mean ~1e-7), so the forward's bound is 1e-5 of it — without
fake quantisation; with it the forward is discontinuous (see ``test_forward_sparse_equals_dense``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.models import load_config, random_model, run
from dinfer_jax.models.attention import attend, attend_selected, use_selected_rows
from dinfer_jax.models.cache_io import pages_gather, pages_read, pool_rows, stored_rows, take_rows


def test_attend_selected_equals_masked_attend():
    """Random queries, window rows with a causal mask, and per-query selections (some empty, some with −1 fill):
    gathering the selected rows gives the masked dense attention's output."""
    rng = np.random.default_rng(0)
    B, S, H, d, T, K = 2, 3, 4, 16, 20, 5
    q = jnp.asarray(rng.standard_normal((B, S, H, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((B, S, d)), jnp.float32)
    ckv = jnp.asarray(rng.standard_normal((B, T, d)), jnp.float32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    win = jnp.tril(jnp.ones((S, S), bool))
    idx = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            n = (b + s) % (K + 1)                  # 0 … K selected rows, then −1 fill
            idx[b, s, :n] = np.sort(rng.choice(T, n, replace=False))
    mask = np.zeros((B, S, T), bool)
    for b, s, j in zip(*np.nonzero(idx >= 0), strict=True):
        mask[b, s, idx[b, s, j]] = True
    want = attend(q, kv, win, ckv, jnp.asarray(mask), sink)
    rows = take_rows(ckv, jnp.asarray(idx))
    got = attend_selected(q, kv, win, rows, jnp.asarray(idx >= 0), sink)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_pages_gather_reads_the_rows_pages_read_lays_out():
    rng = np.random.default_rng(1)
    pool = jnp.asarray(rng.standard_normal((2, 9, 4, 3)), jnp.float32)   # [L, N, rows per page, C]
    pages = jnp.asarray([[3, 7, 1], [8, 2, 5]], jnp.int32)
    rows = jnp.asarray([[[0, 5, 11], [2, -1, 7]], [[4, 9, -1], [10, 1, 3]]], jnp.int32)
    k = jnp.int32(1)
    got = pages_gather(pool, k, pages, rows)
    want = take_rows(pages_read(pool, k, pages), rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pool_rows_index_the_rows_pages_gather_reads():
    """The flat indices the gathering kernel reads (``cache_io.pool_rows``) pick, from the pool viewed as one array of
    rows, exactly what ``pages_gather`` returns — other layers' pages present, −1 entries, the last page."""
    rng = np.random.default_rng(2)
    pool = jnp.asarray(rng.standard_normal((3, 9, 4, 5)), jnp.float32)   # [L, N, rows per page, C]
    pages = jnp.asarray([[3, 7, 1], [8, 2, 5]], jnp.int32)
    rows = jnp.asarray([[[0, 5, 11], [2, -1, 7]], [[4, 9, -1], [10, 1, 3]]], jnp.int32)
    for layer in range(3):
        k = jnp.int32(layer)
        flat_pool, index = pool_rows(pool, k, pages, rows)
        assert flat_pool.shape == (3 * 9 * 4, 5) and index.shape == rows.shape and index.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(flat_pool[index]), np.asarray(pages_gather(pool, k, pages, rows)))


def test_stored_rows_index_the_rows_take_rows_reads():
    rng = np.random.default_rng(3)
    rows_all = jnp.asarray(rng.integers(0, 255, (3, 7, 6)), jnp.uint8)               # [B, T, C] bytes
    idx = jnp.asarray(rng.integers(-1, 7, (3, 2, 4)), jnp.int32)                      # −1: none, read as row 0
    flat_rows, index = stored_rows(rows_all, idx)
    assert flat_rows.shape == (21, 6) and index.shape == idx.shape
    np.testing.assert_array_equal(np.asarray(flat_rows[index]), np.asarray(take_rows(rows_all, idx)))


def test_mode_rule_and_bad_mode():
    assert use_selected_rows("auto", 1, 512, 2048) and not use_selected_rows("auto", 8, 512, 2048)
    # long chunks are compute-bound: gather once the rows are at least twice the top-k
    assert use_selected_rows("auto", 64, 512, 1024) and not use_selected_rows("auto", 64, 512, 1023)
    assert not use_selected_rows("auto", 63, 512, 4096)
    assert use_selected_rows("sparse", 64, 512, 16) and not use_selected_rows("dense", 1, 8, 4096)
    with pytest.raises(ValueError, match="attention mode"):
        use_selected_rows("fast", 1, 1, 1)
    with pytest.raises(ValueError, match="attention must be"):
        LLM(random_model(load_config("tiny-v4"), seed=0, include_mtp=False), attention="fast", warmup=False,
            progress=False)
    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        LLM(dataclasses.replace(model, attention_impl="fast"), warmup=False, progress=False)
    for impl in ("pallas", "pallas_gather"):
        with pytest.raises(ValueError, match=f"attention_impl='{impl}'.*needs a GPU"):
            LLM(dataclasses.replace(model, attention_impl=impl), warmup=False, progress=False)


def test_selected_attention_rule_by_backend_and_shape():
    """Which attention the model's "auto" takes for its selected rows: on a GPU, the kernel fetching the rows from
    the cache for decode-like steps (≤ 8 queries per row, bf16, 64-head blocks); XLA for prefill chunks, other
    dtypes and off a GPU. The explicit kernel switches raise where the kernel cannot run."""
    from dinfer_jax.models.attention import selected_attention_impl

    def q(b, s, dtype=jnp.bfloat16, h=64, d=512):
        return jax.ShapeDtypeStruct((b, s, h, d), dtype)

    assert selected_attention_impl("auto", q(64, 1), backend="gpu") == "pallas_gather"
    assert selected_attention_impl("auto", q(1, 8), backend="gpu") == "pallas_gather"
    assert selected_attention_impl("auto", q(1, 9), backend="gpu") == "jnp"          # a prefill chunk
    assert selected_attention_impl("auto", q(64, 1, jnp.float32), backend="gpu") == "jnp"
    assert selected_attention_impl("auto", q(64, 1, h=32), backend="gpu") == "jnp"
    assert selected_attention_impl("auto", q(64, 1), backend="cpu") == "jnp"
    assert selected_attention_impl("pallas", q(1, 300), backend="gpu") == "pallas"
    with pytest.raises(ValueError, match="cannot run here: .*float32"):
        selected_attention_impl("pallas_gather", q(64, 1, jnp.float32), backend="gpu")


@pytest.mark.parametrize("preset,fake_quant", [("tiny-v4", None), ("tiny-v41", False), ("tiny-v41", True)])
def test_forward_sparse_equals_dense(preset, fake_quant):
    """The full forward with every query gathering its top-k rows equals the masked forward (V4: CSA layers; V4.1:
    ratio-1/2 consumers of KV and index sources; with fake quantisation, byte caches decoded after the gather).

    Without fake quantisation the two differ by fp32 summation order only: bound 1e-5 of max |logit| (measured
    ~5e-7). With it (V4.1's default, DeepSeek's reference numerics) the forward is discontinuous: a ~1e-7 rounding
    difference can move an activation across an FP8/FP4 rounding boundary (one code step: up to 1/8 of the value
    in e4m3, more in e2m1), and every later position that reads the changed row inherits it. Measured: 61% of the
    positions agree to 1e-5, the rest after one such flip by up to 1.1e-3 of max |logit|; bound 1e-2, and the
    greedy token equal at every position."""
    cfg = load_config(preset)
    if fake_quant is not None:
        cfg = dataclasses.replace(cfg, kv_fake_quant=fake_quant)
    model = random_model(cfg, seed=3, std=0.1, include_mtp=False)
    rng = np.random.default_rng(5)
    S = 96        # compressed rows > index_topk at every ratio (V4: 96 / 4 > 16, V4.1: 96 / 2 > 8): top-k drops some
    tokens = rng.integers(0, cfg.vocab_size, (2, S))
    dense = np.asarray(run(model, tokens, attention="dense").logits, np.float64)
    sparse = np.asarray(run(model, tokens, attention="sparse").logits, np.float64)
    scale = np.abs(dense).max()
    err = np.abs(sparse - dense)
    print(f"{preset}: max |sparse - dense| = {err.max() / scale:.2e}, mean {err.mean() / scale:.2e} of max |logit|")
    if fake_quant:
        assert err.max() <= 1e-2 * scale, (err.max(), err.mean(), scale)
        np.testing.assert_array_equal(sparse.argmax(-1), dense.argmax(-1))
    else:
        assert err.max() <= 1e-5 * scale, (err.max(), err.mean(), scale)


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_engine_gathering_rows_gives_the_masked_forward_tokens(preset):
    """Prefill chunks and decode steps that gather each query's top-k rows give the greedy tokens of the masked full
    forward, on prompts long enough that the indexer drops rows."""
    cfg = load_config(preset)
    model = random_model(cfg, seed=2, std=0.1, include_mtp=False)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (70, 90)]   # V4: up to 25 rows of ratio 4 > 16
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64, attention="sparse",
              buckets=Buckets(decode_batch=(2,), prefill_batch=(2,), prefill_len=(64,)), progress=False)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    # one masked forward over both final sequences, right-padded to a common length (one compile; causal: a row's
    # logits at t see only its tokens ≤ t)
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    S = max(len(s) for s in seqs)
    logits = np.asarray(run(model, np.asarray([s + [s[-1]] * (S - len(s)) for s in seqs]), attention="dense").logits)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        assert o.token_ids == logits[i, len(p) - 1: len(p) - 1 + len(o.token_ids)].argmax(-1).tolist()


@pytest.mark.parametrize("selected", [False, True])
def test_per_query_windows_equal_closed_form(selected):
    """A prefill chunk longer than the window attends through each query's own ``W`` window keys
    (``attention_invariant.window_rows`` over the ring + chunk keys): the result is the float64 softmax over the
    keys at positions ``p − W + 1 … p`` (ring entries for positions before the chunk, padding queries seeing
    nothing), plus the compressed rows and the sink, computed here from positions alone. fp32 inputs; the bound
    1e-5 of the output scale covers fp32 rounding of 3·W-term sums (measured ~1e-7)."""
    from dinfer_jax.models.attention_invariant import window_rows

    rng = np.random.default_rng(7)
    B, Q, H, d, W, R, T, K = 2, 40, 4, 16, 8, 10, 12, 3
    start = np.array([0, 23])                  # row 0: a first chunk (empty ring); row 1: ring holds 13 … 22
    n = np.array([40, 31])                     # row 1: 9 padding queries
    ring_vals = rng.standard_normal((B, R, d))
    ring_vals[0] = np.nan                      # never written: must not leak through a zero weight
    chunk = rng.standard_normal((B, Q, d))
    q = rng.standard_normal((B, Q, H, d))
    sink = rng.standard_normal(H)
    ckv = rng.standard_normal((B, T, d))
    pos = start[:, None] + np.arange(Q)[None]
    rpos = start[:, None] - 1 - np.mod(start[:, None] - 1 - np.arange(R)[None], R)
    keys = np.concatenate([ring_vals, chunk], axis=1)
    kpos = np.concatenate([rpos, pos], axis=1)
    kvalid = np.concatenate([rpos >= 0, np.arange(Q)[None] < n[:, None]], axis=1)
    real = np.arange(Q)[None] < n[:, None]
    wmask = (kvalid[:, None] & (kpos[:, None] <= pos[..., None]) & (kpos[:, None] > pos[..., None] - W)
             & real[..., None])
    cmask = (rng.random((B, Q, T)) < 0.4) & real[..., None]
    idx = np.full((B, Q, K), -1)
    for b in range(B):
        for s in range(Q):
            hit = np.nonzero(cmask[b, s])[0][:K]
            idx[b, s, :len(hit)] = hit
    if selected:
        cmask = np.zeros_like(cmask)
        for b, s, j in zip(*np.nonzero(idx >= 0), strict=True):
            cmask[b, s, idx[b, s, j]] = True

    want = np.zeros((B, Q, H, d))
    for b in range(B):
        for s in range(n[b]):
            rows = [chunk[b, p_ - start[b]] if p_ >= start[b] else ring_vals[b, p_ % R]
                    for p_ in range(max(0, pos[b, s] - W + 1), pos[b, s] + 1)]
            rows += [ckv[b, t] for t in np.nonzero(cmask[b, s])[0]]
            kk = np.stack(rows)                                   # [n_vis, d]
            logit = q[b, s] @ kk.T * d ** -0.5                    # [H, n_vis]
            mx = np.maximum(logit.max(axis=1), sink)
            e = np.exp(logit - mx[:, None])
            want[b, s] = e @ kk / (e.sum(axis=1) + np.exp(sink - mx))[:, None]

    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    wrows, wvis = window_rows(f32(keys), jnp.asarray(wmask), jnp.asarray(start), jnp.asarray(pos), W)
    assert wrows.shape == (B, Q, W, d)
    if selected:
        got = attend_selected(f32(q), wrows, wvis, take_rows(f32(ckv), jnp.asarray(idx, jnp.int32)),
                              jnp.asarray(idx >= 0), f32(sink))
    else:
        got = attend(f32(q), wrows, wvis, f32(ckv), jnp.asarray(cmask), f32(sink))
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - want)
    assert err.max() <= 1e-5 * np.abs(want).max(), (err.max(), err.mean())
