"""Indexer-score kernel (Mosaic GPU, ``pallas_kernels.indexer.scores_sm90``) against the contract on an H100/H200,
and the V4.1 engine with the kernel against the same engine without it. Marked ``gpu`` (excluded from CI); run with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu -q tests/test_indexer_kernel_gpu.py``.

Tolerance. Every product ``q_d · k_d`` is exact in fp32 (FP4 values times powers of two; the kernel's 2^64 / 2^-64
split is exact in its range); only the order and rounding of the fp32 additions differ from the reference. With
``A[b,s,t] = Σ_h |w_h| · Σ_d |q_hd · k_td|`` (float64), 128 additions per dot and 32–128 per head sum, each
rounding at most ``2^-24`` relative, the difference is bounded by ``(128 + 128) · 2^-24 · A ≤ 2^-16 · A``; the test
allows ``2^-14 · A`` per element (tensor-core accumulation is not IEEE round-to-nearest in every step). A wrong
permutation, scale or tile would be off by O(A).

All 15 cases passed on the H200 (jax 0.11.2, 2026-12-04): largest error 0.0012 of the bound; the two engine cases
(gathered rows with 16-token pages, the page table with 64-token pages) gave the full forward's tokens
(``docs/perf/attention_h200.md``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import gpu_device
from pallas_kernels.indexer.reference import decode_rows, index_scores_rows_ref
from pallas_kernels.indexer.scores_sm90 import index_scores_rows

pytestmark = pytest.mark.gpu


def _case(b: int, s: int, h: int, t: int, seed: int, spread: int = 20):
    from dinfer_jax.engine.kv_formats import encode
    from dinfer_jax.models.fake_quant import q4u_fake

    ks = jax.random.split(jax.random.key(seed), 4)
    mags = 2.0 ** jax.random.randint(ks[3], (b * t, 1), -spread, spread).astype(jnp.float32)
    x = jax.random.normal(ks[0], (b * t, 128), jnp.float32) * mags
    x = x.at[::11].set(0.0)                                    # all-zero rows
    data, scales = encode(x.astype(jnp.bfloat16), "fp4_index")
    rows = jnp.concatenate([data, scales], axis=-1).reshape(b, t, 68)
    q = q4u_fake(jax.random.normal(ks[1], (b, s, h, 128), jnp.float32), 32)
    w = jax.random.normal(ks[2], (b, s, h), jnp.float32) * 0.1
    return q, w, rows


def _check(b, s, h, t, seed=0, **kw):
    gpu = gpu_device()
    q, w, rows = _case(b, s, h, t, seed)
    with jax.default_device(gpu):
        got = np.asarray(index_scores_rows(*(jax.device_put(a, gpu) for a in (q, w, rows)), **kw))
    want = np.asarray(jax.jit(index_scores_rows_ref, backend="cpu")(q, w, rows))
    k = np.asarray(decode_rows(rows, 128), np.float64)
    a = np.einsum("bsh,bshd,btd->bst", np.abs(np.asarray(w, np.float64)), np.abs(np.asarray(q, np.float64)), np.abs(k))
    err = np.abs(got - want)
    ratio = float((err / (2.0 ** -14 * a + 1e-300)).max())
    print(f"B={b} S={s} H={h} T={t} {kw}: max err / bound {ratio:.3g}, max rel err "
          f"{err.max() / np.abs(want).max():.2e}")
    assert got.shape == want.shape and np.all(np.isfinite(got))
    assert np.all(err <= 2.0 ** -14 * a), ratio


@pytest.mark.parametrize("b,s,h,t", [
    (64, 1, 32, 2048),      # V4.1-Flash decode (32 index heads), 64 sequences
    (64, 1, 64, 1024),      # V4-Flash (64 index heads)
    (1, 1, 32, 64),         # one tile
    (3, 5, 32, 640),        # a verify row: 5 query tokens
    (2, 8, 64, 1000),       # 8 query tokens, T not a multiple of 64 (padded)
    (2, 2, 128, 192),
])
def test_kernel_matches_reference(b, s, h, t):
    _check(b, s, h, t, seed=b + s + h + t)


@pytest.mark.parametrize("b,s,h,rpb,n_pages,tile_rows", [
    (64, 1, 32, 64, 32, 64),    # V4.1-Flash: 128-token pages at ratio 2, 4K-token contexts
    (8, 2, 64, 32, 9, 64),      # V4-Flash (fp8 cache): ratio 4; 288 rows, padded to 320 with page 0
    (3, 5, 32, 128, 3, 64),
    (64, 1, 32, 64, 33, 128),   # 128-row tiles; 33 pages padded to 34
    (8, 2, 64, 32, 9, 256),     # 288 rows padded to 512
])
@pytest.mark.parametrize("box_bytes", [16, 128])
def test_paged_kernel_matches_reference_on_gathered_rows(b, s, h, rpb, n_pages, tile_rows, box_bytes):
    """Through the page table (pages of each sequence scattered over a pool of two layers, layer 1 read) against
    the reference on the rows ``pages_read`` gathers."""
    from dinfer_jax.models.cache_io import pages_read
    from pallas_kernels.indexer.scores_sm90 import index_scores_paged

    gpu = gpu_device()
    n_pool = b * n_pages + 1
    q, w, flat = _case(1, s, h, 2 * n_pool * rpb, seed=rpb + n_pages)
    pool = flat.reshape(2, n_pool, rpb, 68)
    perm = np.random.default_rng(0).permutation(np.arange(1, n_pool))[: b * n_pages]
    pages = jnp.asarray(perm.reshape(b, n_pages), jnp.int32)
    q, w = jnp.broadcast_to(q, (b, *q.shape[1:])), jnp.broadcast_to(w, (b, *w.shape[1:]))
    rows = pages_read(pool, jnp.int32(1), pages)
    with jax.default_device(gpu):
        got = np.asarray(index_scores_paged(*(jax.device_put(a, gpu) for a in (q, w, pool)), jnp.int32(1),
                                            jax.device_put(pages, gpu), tile_rows=tile_rows,
                                            box_bytes=box_bytes))
    want = np.asarray(jax.jit(index_scores_rows_ref, backend="cpu")(q, w, rows))
    k = np.asarray(decode_rows(rows, 128), np.float64)
    a = np.einsum("bsh,bshd,btd->bst", np.abs(np.asarray(w, np.float64)), np.abs(np.asarray(q, np.float64)), np.abs(k))
    err = np.abs(got - want)
    print(f"paged B={b} S={s} H={h} rpb={rpb} P={n_pages} tile_rows={tile_rows} box {box_bytes}: max err / bound "
          f"{float((err / (2.0 ** -14 * a + 1e-300)).max()):.3g}")
    assert got.shape == want.shape and np.all(err <= 2.0 ** -14 * a)


@pytest.mark.parametrize("kw", [dict(stages=1), dict(stages=2, splits=1), dict(splits=4), dict(stages=8),
                                dict(tile_rows=128), dict(tile_rows=128, stages=2, splits=2),
                                dict(tile_rows=256, stages=3), dict(tile_rows=256, splits=1)])
def test_kernel_configs(kw):
    _check(4, 2, 32, 1024, seed=7, **kw)


@pytest.mark.parametrize("tile_rows", [128, 256])
def test_kernel_tiles_of_several_wgmmas_on_padded_rows(tile_rows):
    """Several 64-row sub-tiles per step, with T (1000) padded to a whole number of tiles."""
    _check(2, 3, 64, 1000, seed=tile_rows, tile_rows=tile_rows)


@pytest.mark.parametrize("block_size", [16, 64])
def test_engine_greedy_with_the_kernel_equals_full_forward_argmax(block_size):
    """A random tiny V4.1 model widened so that its indexer fits the kernel (32 index heads of 128): on the GPU the
    engine's decode steps score with the kernel (asserted), the full forward (long query rows) with XLA; greedy
    tokens must equal the full forward's argmax, prompts crossing windows, compression groups and pages. 16-token
    pages (8 rows at ratio 2) go through the gathered-rows form, 64-token pages through the page table. Matmuls
    at full fp32 precision so that both sides compute the same numbers up to addition order."""
    gpu_device()
    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.models import forward_logits, load_config, random_model
    from dinfer_jax.models.attention import index_impl

    cfg = load_config("tiny-v41").replace(index_head_dim=128, index_n_heads=32)
    assert index_impl("auto", cfg, 1) == "pallas"
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, size=n)] for n in (5, 40, 90, 150)]
    with jax.default_matmul_precision("highest"):
        model = random_model(cfg, seed=3, std=0.1, include_mtp=False)
        llm = LLM(model, max_num_seqs=4, max_model_len=256, block_size=block_size, progress=False, warmup=False)
        outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                                          ignore_eos=True), use_tqdm=False)]
        seqs = [p + o for p, o in zip(prompts, outs, strict=True)]
        width = max(len(x) for x in seqs)
        logits = forward_logits(model, np.array([x + [x[-1]] * (width - len(x)) for x in seqs]))
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        want = [int(t) for t in np.asarray(logits[i, len(p) - 1: len(p) + len(o) - 1]).argmax(-1)]
        assert o == want, f"prompt {i} (len {len(p)}) diverges from the full-forward argmax"
