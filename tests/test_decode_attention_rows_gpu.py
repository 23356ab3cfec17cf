"""The decode-attention kernel that gathers its rows by index (``sparse_decode_attention_rows``: ``cp.async`` copies
from the pool into the swizzled tiles, ``pallas_kernels.attention.row_gather_sm90``) on an H100/H200. Marked ``gpu``
(excluded from CI); run with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu -q tests/test_decode_attention_rows_gpu.py``.

The compute warpgroup is the code of ``sparse_decode_attention``'s ``split_cta`` kernel; only the fetch differs. So
the oracle is exact: the result must equal ``sparse_decode_attention(q, pool[rows], valid, sink)`` bit for bit (a
unit copied to the wrong place in a swizzled tile, a wrong row, a stage announced before it landed or refilled
while read all change some output). Each case also checks the contract's error bound against float64
(``test_decode_attention_gpu._check``'s bound) so that the two kernels cannot agree on a wrong answer.

Pools hold more rows than are read (the rest huge, so reading one changes the output), indices repeat, run
backwards and jump across the pool; invalid entries point at huge rows too and must contribute exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import gpu_device
from pallas_kernels.attention.decode_sm90 import sparse_decode_attention, sparse_decode_attention_rows
from test_decode_attention_gpu import HUGE_SINK_HEAD, _exact, _mask

pytestmark = pytest.mark.gpu


def _rows_case(n: int, h: int, d: int, length: int, pool_rows: int, mask: str, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, h, d)).astype(ml_dtypes.bfloat16)
    pool = np.full((pool_rows, d), 3e4, ml_dtypes.bfloat16)        # rows never validly read: huge, finite
    used = rng.choice(pool_rows, size=min(pool_rows // 2, n * length), replace=False)
    pool[used] = rng.standard_normal((len(used), d)).astype(ml_dtypes.bfloat16)
    rows = used[rng.integers(0, len(used), (n, length))].astype(np.int32)
    rows[0, : length // 2] = rows[0, length // 2:][::-1]            # backwards and repeated
    valid = _mask(mask, n, length, rng)
    huge = np.setdiff1d(np.arange(pool_rows), used)
    rows[~valid] = huge[rng.integers(0, len(huge), int((~valid).sum()))]
    sink = rng.standard_normal(h).astype(np.float32)
    sink[HUGE_SINK_HEAD] = 1e4
    return q, pool, rows, valid, sink


def _check_rows(n, h, d, length, mask, pool_rows=8192, seed=0, window=0, **kw):
    """``window``: the first ``window`` of the ``length`` rows come from a separate ``[N, window, d]`` source (their
    ``rows`` entries are ignored), the rest from the pool."""
    dev = gpu_device()
    q, pool, rows, valid, sink = _rows_case(n, h, d, length, pool_rows, mask, seed)
    win = pool[rows[:, :window]]                     # a window source holding other copies of pool rows
    scale = d ** -0.5
    with jax.default_device(dev):
        qd, pd, rd, vd, sd, wd = (jax.device_put(jnp.asarray(x), dev) for x in (q, pool, rows, valid, sink, win))
        got = sparse_decode_attention_rows(qd, pd, rd[:, window:], vd, sd, scale=scale,
                                           window=wd if window else None, **kw)
        got = np.asarray(got.astype(jnp.float32))
        want = np.asarray(sparse_decode_attention(qd, pd[rd], vd, sd, scale=scale, **kw).astype(jnp.float32))
    assert got.shape == (n, h, d)
    differ = got != want
    assert not differ.any(), (f"{int(differ.sum())} of {differ.size} outputs differ from the kernel on pool[rows] "
                              f"(first at {np.argwhere(differ)[0].tolist()})")
    empty = ~valid.any(axis=1)
    assert (got[empty] == 0).all() and (got[:, HUGE_SINK_HEAD] == 0).all()
    if empty.all():
        return
    exact, a = _exact(q, pool[rows], valid, sink, scale)
    ratio = np.abs(got - exact) / (2.0 ** -7 * a + 2.0 ** -14 * a.max())
    print(f"N={n} H={h} d={d} L={length} {mask} {kw}: bit-equal to the kernel on pool[rows]; max err/bound "
          f"{ratio.max():.3f} vs exact")
    assert (ratio <= 1).all()


@pytest.mark.parametrize("mask", ["random", "prefix"])
@pytest.mark.parametrize("n,h,length", [(1, 64, 640), (64, 64, 640), (8, 128, 64)])
def test_gathered_kernel_equals_kernel_on_gathered_rows(n, h, length, mask):
    """The real size (d = 512 in two column halves, 640 rows = ten KV steps over two stages, so every stage is
    refilled several times), one query, 64 queries, and one KV step with two head blocks."""
    _check_rows(n, h, 512, length, mask, seed=n + length)


@pytest.mark.parametrize("d,kw", [
    (512, dict(early_release=True)),                 # the other CTA's chunk refilled after the QK product
    (512, dict(v_split=4)),                          # four 128-column chunks: 16 row copies per thread and chunk
    (512, dict(v_split=4, early_release=True)),
    (256, dict(v_split=1, num_stages=3)),            # one 256-column chunk, three stages
    (256, dict(block_kv=128, num_stages=1)),         # 128-row tiles, no pipelining (every step waits for its copy)
    (128, dict(v_split=1)),                          # 64-byte pieces of a row per warp: 4 rows per warp pass
    (512, dict(block_kv=32, num_stages=4, early_release=True)),   # 32-row steps: 64-byte swizzled tiles, 4 stages
    (512, dict(block_kv=32, num_stages=3)),
    (512, dict(organisation="shared_qk", l_split=10, num_stages=1)),   # few queries: one KV step per CTA
    (512, dict(organisation="shared_qk", num_stages=1)),               # one CTA walking all ten steps
], ids=["d512-early", "d512-split4", "d512-split4-early", "d256-split1-3stages", "d256-bkv128-1stage", "d128",
        "d512-bkv32-4stages-early", "d512-bkv32-3stages", "d512-sharedqk-l10", "d512-sharedqk-l1"])
def test_gathered_kernel_configs(d, kw):
    _check_rows(8, 128, d, 640, "random", seed=d, **kw)


@pytest.mark.parametrize("n,kw", [(64, dict(early_release=True)), (3, dict(num_stages=1)), (8, dict(v_split=4)),
                                  (1, dict(organisation="shared_qk", l_split=10, num_stages=1)),
                                  (8, dict(organisation="shared_qk", l_split=5, num_stages=1))],
                         ids=["n64-early", "n3-1stage", "n8-split4", "n1-sharedqk-l10", "n8-sharedqk-l5"])
def test_gathered_kernel_with_window_source(n, kw):
    """The model's layout: 128 window rows per query from a second source, then 512 pool rows (two KV steps from the
    window, eight from the pool; with one stage, a window step is fetched inside the loop)."""
    _check_rows(n, 64, 512, 640, "random", seed=n + 11, window=128, **kw)


def test_gathered_kernel_all_masked_and_large_pool():
    """Every entry masked (all mass on the sink: exact zeros) over a pool of 2^20 rows (1 GiB at d = 512: row offsets
    past 2^31 bytes, so the 64-bit address arithmetic is exercised)."""
    _check_rows(4, 64, 512, 640, "all_false", pool_rows=1 << 20)
    _check_rows(4, 64, 512, 640, "random", pool_rows=1 << 21, seed=5)


@pytest.mark.parametrize("b,s", [(4, 1), (64, 1), (2, 3), (16, 6)])
def test_model_pooled_path_equals_kernel_on_gathered_rows(b, s):
    """The model's use of the gathering kernel (``attention.attend_selected_pooled``: each query's own 128 window
    rows + its 512 selected rows read from a pool by index, −1-free indices with a mask of unselected entries)
    against the kernel on the rows laid out as ``attend_selected(impl="pallas")`` lays them out (window, then
    ``pool[rows]``), in the organisation the pooled path uses (``tuning.gather_options``: ``split_cta`` with early
    release and, on an H100, 32-row steps above 8 queries; ``shared_qk`` above 66) — the same computation on the
    same rows, so bit-equal (masked rows contribute exact zeros whatever their values) — at V4-Flash's width (64
    heads × 512); query (0, 0) sees nothing (exact zeros)."""
    from dinfer_jax.models.attention import attend_selected_pooled

    gpu_device()
    h, d, sw, k, pool_rows = 64, 512, 128, 512, 16384
    rng = np.random.default_rng(b + s)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)).astype(ml_dtypes.bfloat16))
    kv = jnp.asarray(rng.standard_normal((b, s, sw, d)).astype(ml_dtypes.bfloat16))
    pool = jnp.asarray(rng.standard_normal((pool_rows, d)).astype(ml_dtypes.bfloat16))
    rows = rng.integers(0, pool_rows, (b, s, k)).astype(np.int32)
    win = rng.random((b, s, sw)) < 0.8
    sel = rng.random((b, s, k)) < 0.9
    win[0, 0], sel[0, 0] = False, False
    sink = jnp.asarray(rng.standard_normal(h).astype(np.float32))
    rows, win, sel = jnp.asarray(rows), jnp.asarray(win), jnp.asarray(sel)
    got = np.asarray(jax.jit(attend_selected_pooled)(q, kv, win, pool, rows, sel, sink).astype(jnp.float32))
    n = b * s
    keys = jnp.concatenate([kv, pool[rows]], axis=2).reshape(n, sw + k, d)
    valid = jnp.concatenate([win, sel], axis=2).reshape(n, sw + k)
    # the model's rule for bf16 pools (tuning.gather_options); the kernel on gathered rows in the same organisation
    # sums the softmax in the same 32- or 64-row blocks
    from pallas_kernels.attention.tuning import gather_options
    want = sparse_decode_attention(q.reshape(n, h, d), keys, valid, sink, scale=d ** -0.5,
                                   **gather_options(n, "bf16"))
    want = np.asarray(want.astype(jnp.float32)).reshape(b, s, h, d)
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max():.3g}"
    assert np.all(got[0, 0] == 0)


@pytest.mark.parametrize("n,kw", [
    (64, dict(early_release=True)), (4, {}), (8, dict(v_split=4)),
    (64, dict(block_kv=32, num_stages=4, early_release=True)),
    # rows staged whole one step ahead and decoded from shared memory (_produce_fp4_prefetch)
    (64, dict(block_kv=32, num_stages=4, early_release=True, fp4_prefetch=True)),
    (4, dict(block_kv=32, num_stages=4, fp4_prefetch=True)),
    (8, dict(block_kv=32, num_stages=4, v_split=4, fp4_prefetch=True)),
    (1, dict(organisation="shared_qk", l_split=10, num_stages=1)),   # V4.1 batch-1 decode: the model's rule
], ids=["n64-early", "n4", "n8-split4", "n64-bkv32-early", "n64-bkv32-early-prefetch", "n4-bkv32-prefetch",
        "n8-bkv32-split4-prefetch", "n1-sharedqk-l10"])
def test_fp4_pool_rows_decoded_in_kernel(n, kw):
    """V4.1's compressed rows as the cache stores them (``v41_fp4``: 256 B of e2m1 codes + 32 e4m3 scales per row,
    from ``kv_formats.encode`` of random rows spanning several decades, so that many scale exponents occur) read by
    index and decoded by the kernel, after 128 bf16 window rows: bit-equal to the kernel on the rows
    ``kv_formats.decode`` gives (the decode is exact, module docstring of ``row_gather_sm90``)."""
    from dinfer_jax.engine.kv_formats import decode, encode

    dev = gpu_device()
    h, d, sw, k, pool_rows = 64, 512, 128, 512, 8192
    rng = np.random.default_rng(n)
    x = rng.standard_normal((pool_rows, d)) * np.exp2(rng.integers(-12, 8, (pool_rows, 1)))
    with jax.default_device(dev):
        data, scales = encode(jnp.asarray(x, jnp.bfloat16), "v41_fp4")
        pool = jnp.concatenate([data, scales], axis=1)                                  # [R, 288] uint8
        q = jnp.asarray(rng.standard_normal((n, h, d)).astype(ml_dtypes.bfloat16))
        window = jnp.asarray(rng.standard_normal((n, sw, d)).astype(ml_dtypes.bfloat16))
        rows = jnp.asarray(rng.integers(0, pool_rows, (n, k)).astype(np.int32))
        valid = jnp.asarray(rng.random((n, sw + k)) < 0.9)
        sink = jnp.asarray(rng.standard_normal(h).astype(np.float32))
        got = sparse_decode_attention_rows(q, pool, rows, valid, sink, scale=d ** -0.5, window=window, **kw)
        decoded = decode(pool[rows][..., : d // 2], pool[rows][..., d // 2:], "v41_fp4", dtype=jnp.bfloat16)
        keys = jnp.concatenate([window, decoded], axis=1)
        same = {k: v for k, v in kw.items() if k != "fp4_prefetch"}     # how the rows arrive, not the result
        want = sparse_decode_attention(q, keys, valid, sink, scale=d ** -0.5, **same)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max():.3g}, max |want| {np.abs(want).max():.3g}"
