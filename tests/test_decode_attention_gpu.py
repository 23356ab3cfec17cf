"""Decode-attention kernel (Mosaic GPU, ``pallas_kernels.attention.decode_sm90``) against the contract on an
H100/H200. Marked ``gpu`` (excluded from CI); run with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu -q tests/test_decode_attention_gpu.py``.

Tolerance, per output element. Let ``A[n,h,c] = Σ_l p[n,h,l] · |kv[n,l,c]|`` with the exact probabilities and
``o_exact`` the exact output without any bf16 rounding (both in float64 here); bf16's unit roundoff is ``u = 2^-8``.
The kernel rounds each probability's contribution to bf16 (``exp(s − running max)`` before its final divide:
relative error ≤ u, so ≤ u · A in the sum) and its output to bf16 (≤ u · |o| ≤ u · A); fp32 accumulation and
``ex2.approx`` (2 ulp) add ≲ 10^-5 · A, allowed as 2^-14 · max A. Hence

* ``|kernel − o_exact| ≤ 2^-7 · A + 2^-14 · max A``, and, the reference having the same two roundings,
  ``|kernel − reference| ≤ 2^-6 · A + 2^-14 · max A``;
* on average far less, since rounding errors are not all at their bound nor of one sign: ``mean |kernel − o_exact|
  ≤ 2^-9 · mean A``. A systematic error of 1% (a wrong scale, a lost KV block) fails it.

Queries with no valid row and a head whose sink dominates (1e4) must be exactly 0.

All 21 cases passed on the H200 (jax 0.11.2, 2026-12-01): the largest error was 0.80 of the per-element bound
(N = 64, H = 128, L = 64, prefix mask: queries with one to three valid rows, where both roundings are at full
size), the largest mean 0.30 of the mean bound. Each case prints its ratios (``-s``). The ``shared_qk`` cases
(``organisation="shared_qk"``, with and without ``l_split``) were added afterwards and passed on the H200 on
2026-12-02; the 20 ``pingpong`` cases (``-k ping``) passed there on 2026-12-05 (jax 0.11.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import gpu_device
from pallas_kernels.attention.decode_sm90 import sparse_decode_attention
from pallas_kernels.attention.reference import sparse_decode_attention_ref

pytestmark = pytest.mark.gpu

HUGE_SINK_HEAD = 1


def _mask(kind: str, n: int, rows: int, rng: np.random.Generator) -> np.ndarray:
    """``random``: ~70% valid, query 0 with none (when N > 1); ``prefix``: query i sees its first w_i rows (a window
    filling up; w_0 = 0 when N > 1, the last query sees all); ``all_false``: nothing valid."""
    if kind == "random":
        valid = rng.random((n, rows)) < 0.7
        if n > 1:
            valid[0] = False
        return valid
    if kind == "prefix":
        widths = (np.arange(n) * rows) // max(n - 1, 1) if n > 1 else np.array([rows // 2 + 3])
        return np.arange(rows)[None, :] < widths[:, None]
    if kind == "all_false":
        return np.zeros((n, rows), bool)
    raise ValueError(kind)


def _case(n: int, h: int, d: int, rows: int, mask: str, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, h, d)).astype(ml_dtypes.bfloat16)
    kv = rng.standard_normal((n, rows, d)).astype(ml_dtypes.bfloat16)
    valid = _mask(mask, n, rows, rng)
    kv[~valid] = ml_dtypes.bfloat16(3e4)            # padding rows: huge but finite, must contribute exactly 0
    sink = rng.standard_normal(h).astype(np.float32)
    sink[HUGE_SINK_HEAD] = 1e4
    return q, kv, valid, sink


def _exact(q, kv, valid, sink, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``(o_exact, A)`` in float64, ``[N, H, d]`` each: the contract with exact probabilities and no bf16 rounding,
    and ``A = Σ_l p · |kv|``."""
    q64, kv64 = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    logits = scale * np.matmul(q64, kv64.transpose(0, 2, 1))                     # [N, H, L]
    logits = np.where(valid[:, None, :], logits, -np.inf)
    s64 = np.asarray(sink, np.float64)[None, :]
    m = np.maximum(logits.max(axis=-1), s64)
    e = np.exp(logits - m[..., None])
    p = e / (e.sum(axis=-1) + np.exp(s64 - m))[..., None]
    rows = kv64 * valid[..., None]                                               # padding rows: p = 0 anyway
    return np.matmul(p, rows), np.matmul(p, np.abs(rows))


def _check(n, h, d, rows, mask, seed=0, **kw):
    dev = gpu_device()
    q, kv, valid, sink = _case(n, h, d, rows, mask, seed)
    scale = d ** -0.5
    with jax.default_device(dev):
        args = tuple(jax.device_put(jnp.asarray(x), dev) for x in (q, kv, valid, sink))
        got = np.asarray(sparse_decode_attention(*args, scale=scale, **kw).astype(jnp.float32), np.float64)
        want = np.asarray(jax.jit(sparse_decode_attention_ref, static_argnames="scale")(*args, scale=scale)
                          .astype(jnp.float32), np.float64)
    assert got.shape == (n, h, d)
    assert np.isfinite(got).all()
    empty = ~valid.any(axis=1)
    assert (got[empty] == 0).all(), "a query with no valid row must give exactly 0"
    assert (got[:, HUGE_SINK_HEAD] == 0).all(), "a head whose sink dominates must give exactly 0"
    if empty.all():
        return
    exact, a = _exact(q, kv, valid, sink, scale)
    slack = 2.0 ** -14 * a.max()
    err, err_ref = np.abs(got - exact), np.abs(got - want)
    ratio, ratio_ref = err / (2.0 ** -7 * a + slack), err_ref / (2.0 ** -6 * a + slack)
    mean_ratio = err.mean() / (2.0 ** -9 * a.mean())
    print(f"N={n} H={h} d={d} L={rows} {mask} {kw}: max err/bound {ratio.max():.3f} (vs exact), "
          f"{ratio_ref.max():.3f} (vs reference); mean err/bound {mean_ratio:.3f}")
    worst = np.unravel_index(np.argmax(ratio), ratio.shape)
    assert (ratio <= 1).all(), f"max err/bound vs exact {ratio.max():.3g} at (n, h, c) = {worst}"
    assert (ratio_ref <= 1).all(), f"max err/bound vs reference {ratio_ref.max():.3g}"
    assert mean_ratio <= 1, f"mean err / (2^-9 · mean A) = {mean_ratio:.3g}"


ORGANISATIONS = ["split_cta", "shared_qk", "pingpong", "seesaw"]


@pytest.mark.parametrize("organisation", ORGANISATIONS)
@pytest.mark.parametrize("mask", ["random", "prefix"])
@pytest.mark.parametrize("rows", [64, 640])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("n", [1, 64])
def test_kernel_matches_reference(n, h, rows, mask, organisation):
    """The real head width (d = 512, two column halves, 2 stages), one or ten KV steps, one or two head blocks, in
    every organisation (``split_cta``: two CTAs per token; ``shared_qk``: two consumer warpgroups of one CTA sharing
    the QK product; ``pingpong``: two CTAs per token, each with two consumer warpgroups on alternate KV blocks;
    ``seesaw``: one CTA per token, two compute warpgroups on alternate blocks, each with half of the columns)."""
    _check(n, h, 512, rows, mask, seed=n + h + rows, organisation=organisation)


@pytest.mark.parametrize("organisation", ORGANISATIONS)
def test_all_queries_masked_give_zeros(organisation):
    _check(64, 64, 512, 640, "all_false", organisation=organisation)


SHARED = dict(organisation="shared_qk")
PING = dict(organisation="pingpong")
CLUSTER = dict(organisation="split_cluster")


@pytest.mark.parametrize("d,kw", [
    (512, dict(v_split=4)),                          # four column chunks of 128
    (256, dict(v_split=1, num_stages=3)),            # no split, three stages
    (256, dict(block_kv=128)),                       # 128-row KV blocks
    (128, dict(num_stages=1)),                       # no pipelining
    (512, dict(SHARED, l_split=2)),                  # shared_qk, L in two parts (fp32 partials, XLA combine)
    (512, dict(SHARED, l_split=10)),                 # shared_qk, one KV step per part
    (256, dict(SHARED, block_kv=128)),               # shared_qk, 128-row KV blocks (exchange 2 × 32 KiB)
    (128, dict(SHARED, num_stages=1)),               # shared_qk, no pipelining, d / 2 = 64
    (512, dict(PING, block_kv=32, num_stages=4)),    # pingpong, 32-row tiles (64-byte swizzle), 4 stages
    (512, dict(PING, block_kv=32, num_stages=2)),
    (256, dict(PING, v_split=1, block_kv=64)),       # pingpong, no split of d, merge in 4 chunks
    (512, dict(CLUSTER, v_split=4)),                 # split_cluster, clusters of 4 CTAs
    (256, dict(CLUSTER, block_kv=128)),              # split_cluster, 128-row tiles
    (128, dict(CLUSTER, num_stages=1)),              # split_cluster, every step waits for both CTAs' release
    (512, dict(block_kv=32, num_stages=4)),          # split_cta, 32-row tiles (64-byte swizzle), 4 stages
    (512, dict(early_release=True)),                 # split_cta, other CTAs' chunks released after QK
    (512, dict(block_kv=32, num_stages=4, early_release=True)),
    (512, dict(v_split=4, early_release=True)),      # three chunks released early, one after P·V
], ids=["d512-split4", "d256-split1-3stages", "d256-bkv128", "d128-1stage", "shared-d512-l2", "shared-d512-l10",
        "shared-d256-bkv128", "shared-d128-1stage", "ping-d512-bkv32-4stages", "ping-d512-bkv32-2stages",
        "ping-d256-split1", "cluster-d512-split4", "cluster-d256-bkv128", "cluster-d128-1stage",
        "d512-bkv32-4stages", "d512-early", "d512-bkv32-4stages-early", "d512-split4-early"])
def test_kernel_configs(d, kw):
    _check(8, 128, d, 640, "random", seed=d, **kw)


@pytest.mark.parametrize("l_split", [2, 5])
@pytest.mark.parametrize("mask", ["random", "prefix", "all_false"])
def test_seesaw_l_split(l_split, mask):
    """``seesaw`` with L split across CTAs at the real size: five blocks a part (two rounds and an odd last block)
    or two (one round), merged by XLA as ``shared_qk``'s parts."""
    _check(64, 64, 512, 640, mask, seed=l_split + 7, organisation="seesaw", l_split=l_split)


@pytest.mark.parametrize("l_split", [2, 5])
@pytest.mark.parametrize("mask", ["random", "prefix", "all_false"])
def test_shared_qk_l_split(l_split, mask):
    """``shared_qk`` with L split across CTAs at the real size: parts that see no valid row (prefix masks) must
    merge to the same result (their running max stays the sink's, their sum 0)."""
    _check(64, 64, 512, 640, mask, seed=l_split, organisation="shared_qk", l_split=l_split)


@pytest.mark.parametrize("b,s,per_query", [(4, 1, False), (2, 3, False), (4, 1, True), (16, 6, True), (1, 300, True)])
def test_model_attend_selected_kernel_matches_xla_path(b, s, per_query):
    """The model's use of the kernel (``attention.attend_selected(impl="pallas")``: window rows shared by the row's
    queries — or each query's own 128 window rows (``per_query``, what the model passes the kernel, decode and
    prefill chunks alike) — + each query's gathered rows, laid out per query, padded to 64, masked rows zeroed)
    against the XLA path (``impl="jnp"``) at V4-Flash's width: 64 heads × 512, window 128 (+ this step's s rows when
    shared), top-k 512 with unselected entries. Both round the probabilities and the output to bf16, so they differ
    by at most 2 · (2^-7 · A) per element (A as in the module docstring, from float64 here) plus 2^-14 · max A."""
    from dinfer_jax.models.attention import attend_selected

    gpu_device()
    h, d, sw, k = 64, 512, 128 + (0 if per_query else s), 512
    rng = np.random.default_rng(7)
    q = rng.standard_normal((b, s, h, d)).astype(ml_dtypes.bfloat16)
    kv = rng.standard_normal((b, s, sw, d) if per_query else (b, sw, d)).astype(ml_dtypes.bfloat16)
    rows = rng.standard_normal((b, s, k, d)).astype(ml_dtypes.bfloat16)
    win = rng.random((b, s, sw)) < 0.8
    win[0, 0] = False
    sel = rng.random((b, s, k)) < 0.9
    sel[0, 0] = False                       # query (0, 0) sees nothing: exact zeros
    sink = rng.standard_normal(h).astype(np.float32)
    args = tuple(jnp.asarray(a) for a in (q, kv, win, rows, sel, sink))
    got = np.asarray(jax.jit(lambda *a: attend_selected(*a, impl="pallas"))(*args), np.float64)
    want = np.asarray(jax.jit(lambda *a: attend_selected(*a, impl="jnp"))(*args), np.float64)
    window = kv if per_query else np.broadcast_to(kv[:, None], (b, s, sw, d))
    keys = np.concatenate([window, rows], axis=2).astype(np.float64)
    valid = np.concatenate([win, sel], axis=2)
    logits = np.einsum("bshd,bsld->bshl", q.astype(np.float64), keys) * d ** -0.5
    logits = np.where(valid[:, :, None], logits, -np.inf)
    m = np.maximum(logits.max(-1), sink[None, None, :])
    e = np.exp(logits - m[..., None])
    p = e / (e.sum(-1) + np.exp(sink[None, None, :] - m))[..., None]
    a = np.einsum("bshl,bsld->bshd", p, np.abs(keys))
    bound = 2 * 2.0 ** -7 * a + 2.0 ** -14 * a.max()
    ratio = np.abs(got - want) / bound
    print(f"b={b} s={s} per_query={per_query}: max error / bound {ratio.max():.2f}")
    assert ratio.max() <= 1.0
    assert np.all(got[0, 0] == 0) and np.all(want[0, 0] == 0)
