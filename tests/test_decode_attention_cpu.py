"""Decode attention (``pallas_kernels.attention``) on CPU: the ``jnp`` reference against an independent float64
NumPy computation of the contract, the wrapper's shape checks, and the Mosaic GPU kernel lowering for CUDA.

Whether the compiled kernel computes the right thing is the GPU test (tests/test_decode_attention_gpu.py, marked
``gpu``). On CPU, under jax ≥ 0.11, ``test_kernel_in_mosaic_gpu_interpreter`` runs the kernel's orchestration (TMA
slices, barriers and stage reuse, mask, sink, online softmax, column splits, output placement) in Pallas's Mosaic GPU
interpreter. The interpreter runs neither a WGMMA with its A operand in registers nor ``pl.run_state`` over an
initialised accumulator nor a store into an accumulator (jax 0.11.2), so that test stages P through shared memory,
initialises the accumulator with a WGMMA against an identity matrix (trace-time shims, see
``_interpreter_shims``); the register-operand WGMMA itself is checked on the GPU only.
The interpreter runs each warpgroup as a host thread blocked in callbacks at its barriers; with a single host CPU
device it can starve and hang (seen with ``shared_qk``'s three warpgroups on a 2-core machine), so these tests rely
on conftest.py's 8 host devices.

Tolerance of the reference against exact arithmetic. Per output element ``o[n,h,c]`` let
``A[n,h,c] = Σ_l p[n,h,l] · |kv[n,l,c]|`` (exact probabilities); bf16's unit roundoff is ``u = 2^-8``. The contract
rounds each probability to bf16 (relative error ≤ u, so ≤ u · A in the sum) and the output to bf16
(≤ u · |o| ≤ u · A); logits, softmax and sums in fp32 add ≲ 10^-6 · A. So ``|ref − exact| ≤ 2^-7 · A`` plus fp32
noise (allowed: 2^-20 · max A).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from pallas_kernels.attention.decode_sm90 import check_config, smem_bytes, sparse_decode_attention, traffic
from pallas_kernels.attention.reference import sparse_decode_attention_ref
from pallas_kernels.attention.tuning import decode_options

SHARED = dict(organisation="shared_qk")
PING32 = dict(organisation="pingpong", block_kv=32, num_stages=4)   # two 32-row tiles in flight per consumer
PING64 = dict(organisation="pingpong", block_kv=64, num_stages=2)
CLUSTER = dict(organisation="split_cluster")                        # split_cta's CTAs as a cluster, multicast
BKV32 = dict(block_kv=32, num_stages=4)                             # split_cta: 96 KiB in flight, not 64
EARLY = dict(early_release=True)                                    # split_cta: others' chunks freed after QK
SEESAW = dict(organisation="seesaw")                              # FlashMLA's schedule, one CTA a token


def exact_contract(q, kv, valid, sink, scale: float, *, round_probs: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The contract in float64 NumPy, one query at a time: ``(o, A)`` with ``A = Σ_l p · |kv|`` (the error scale).
    ``round_probs`` rounds the probabilities to bf16 (from float64, once) as the contract says; else exact."""
    q, kv, sink = (np.asarray(x, np.float64) for x in (q, kv, sink))
    valid = np.asarray(valid)
    n, h, d = q.shape
    o = np.zeros((n, h, d))
    a = np.zeros((n, h, d))
    for i in range(n):
        rows = kv[i][valid[i]]                                   # [Lv, d]
        logits = scale * q[i] @ rows.T                           # [H, Lv]
        m = np.maximum(logits.max(axis=1, initial=-np.inf), sink)
        e = np.exp(logits - m[:, None])
        p = e / (e.sum(axis=1) + np.exp(sink - m))[:, None]
        a[i] = p @ np.abs(rows)
        if round_probs:
            p = p.astype(ml_dtypes.bfloat16).astype(np.float64)
        o[i] = p @ rows
    return o, a


def _inputs(n: int, h: int, d: int, rows: int, seed: int):
    """Random bf16 queries and rows, ~70% valid rows, query 0 with no valid row, head 1 with a huge sink, and
    padding rows (invalid) filled with large finite values that must contribute exactly 0."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, h, d)).astype(ml_dtypes.bfloat16)
    kv = rng.standard_normal((n, rows, d)).astype(ml_dtypes.bfloat16)
    valid = rng.random((n, rows)) < 0.7
    valid[0] = False
    valid[1, rows // 2:] = False                                 # a window-like prefix
    kv[~valid] = ml_dtypes.bfloat16(3e4)                         # padding: huge, finite, masked
    sink = rng.standard_normal(h).astype(np.float32)
    sink[1] = 1e4                                                # all of head 1's mass on the sink
    return q, kv, valid, sink


@pytest.mark.parametrize("n,h,d,rows", [(5, 8, 64, 48), (3, 64, 128, 128)])
def test_reference_matches_float64_contract(n, h, d, rows):
    q, kv, valid, sink = _inputs(n, h, d, rows, seed=n * 7 + d)
    scale = d ** -0.5
    got = np.asarray(sparse_decode_attention_ref(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(valid),
                                                 jnp.asarray(sink), scale=scale), np.float64)
    assert got.dtype == np.float64 and np.isfinite(got).all()
    want, a = exact_contract(q, kv, valid, sink, scale)
    assert (got[0] == 0).all()                                   # no valid row: exactly 0
    assert (got[:, 1] == 0).all()                                # huge sink: exp(s − 1e4) = 0 in fp32
    err = np.abs(got - want)
    bound = 2.0 ** -7 * a + 2.0 ** -20 * a.max()
    assert (err <= bound).all(), float((err / bound).max())
    assert err.mean() <= 2.0 ** -9 * a.mean()     # rounding errors are not all at their bound (GPU test: why)


def test_reference_rounds_probabilities_to_bf16():
    """One valid row per query, fp32 inputs and output (no output rounding): ``o = bf16(p) · kv_row`` exactly, with
    ``p = 1 / (1 + e^(sink − s))`` chosen far from a bf16 rounding boundary, which differs from ``p · kv_row`` by
    ~10^-3 relative. Distinguishes a reference that skips the rounding."""
    h, d, rows = 4, 16, 8
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, h, d)).astype(np.float32)
    kv = rng.standard_normal((1, rows, d)).astype(np.float32)
    valid = np.zeros((1, rows), bool)
    valid[0, 3] = True
    s = (q[0] @ kv[0, 3]).astype(np.float64)
    sink = (s + np.log(2.0)).astype(np.float32)                  # p = 1/3 per head (bf16(1/3) = 0.333984375)
    got = np.asarray(sparse_decode_attention_ref(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(valid),
                                                 jnp.asarray(sink), scale=1.0), np.float64)
    want, _ = exact_contract(q, kv, valid, sink, 1.0, round_probs=True)
    unrounded, _ = exact_contract(q, kv, valid, sink, 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    assert (np.abs(got - unrounded) > 1e-3 * np.abs(unrounded)).all()


def test_wrapper_rejects_bad_shapes():
    s = jax.ShapeDtypeStruct
    ok = dict(q=s((2, 64, 512), jnp.bfloat16), kv=s((2, 128, 512), jnp.bfloat16), valid=s((2, 128), jnp.bool_),
              sink=s((64,), jnp.float32))

    def trace(**over):
        args = {**ok, **over}
        jax.jit(lambda q, kv, valid, sink: sparse_decode_attention(q, kv, valid, sink, scale=0.1)).trace(**args)

    trace()
    with pytest.raises(ValueError, match="multiple of 64"):
        trace(q=s((2, 32, 512), jnp.bfloat16), sink=s((32,), jnp.float32))
    with pytest.raises(ValueError, match="block_kv"):
        trace(kv=s((2, 100, 512), jnp.bfloat16), valid=s((2, 100), jnp.bool_))
    with pytest.raises(ValueError, match="valid must be"):
        trace(valid=s((2, 64), jnp.bool_))
    with pytest.raises(ValueError, match="bf16"):
        trace(q=s((2, 64, 512), jnp.float32))
    with pytest.raises(ValueError, match="accumulator"):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=1)
    with pytest.raises(ValueError, match="shared memory"):
        check_config(64, 512, 640, block_kv=64, num_stages=3, v_split=2)
    assert check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2) == 2
    assert check_config(64, 512, 64, block_kv=64, num_stages=2, v_split=2) == 1   # capped at the KV steps
    assert smem_bytes(512, 64, 2) == 197376
    # shared_qk: Q 64 KiB + 2 KV stages 128 KiB + mask rows, sinks (1 KiB each after Pallas's alignment) + exchange
    # 2 × 16 KiB + 8 mbarriers = 231488 B, what Mosaic GPU itself counts (checked by lowering with a tiny bound below)
    assert smem_bytes(512, 64, 2, "shared_qk") == 231488
    assert check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="shared_qk") == 2
    assert check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="shared_qk",
                        l_split=10) == 1
    with pytest.raises(ValueError, match="shared memory"):
        check_config(64, 512, 640, block_kv=64, num_stages=3, v_split=2, organisation="shared_qk")
    with pytest.raises(ValueError, match="v_split must be 2"):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=4, organisation="shared_qk")
    with pytest.raises(ValueError, match="only organisations 'shared_qk' and 'seesaw'"):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, l_split=2)
    with pytest.raises(ValueError, match="must divide"):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="shared_qk", l_split=3)
    with pytest.raises(ValueError, match="organisation="):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="both")


def test_pingpong_config():
    """``pingpong``: 32-row tiles allowed, an even number of refilled stages, the same shared-memory limit."""
    assert check_config(64, 512, 640, block_kv=32, num_stages=4, v_split=2, organisation="pingpong") == 4
    assert check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="pingpong") == 2
    assert check_config(64, 512, 96, block_kv=32, num_stages=4, v_split=2, organisation="pingpong") == 3  # no refill
    with pytest.raises(ValueError, match="must be even"):
        check_config(64, 512, 640, block_kv=32, num_stages=3, v_split=2, organisation="pingpong")
    with pytest.raises(ValueError, match="shared memory"):
        check_config(64, 512, 640, block_kv=32, num_stages=6, v_split=2, organisation="pingpong")
    with pytest.raises(ValueError, match="multiple of 32"):
        check_config(64, 512, 640, block_kv=16, num_stages=2, v_split=2, organisation="pingpong")
    with pytest.raises(ValueError, match="multiple of 64"):
        check_config(64, 512, 640, block_kv=32, num_stages=2, v_split=2, organisation="shared_qk")
    with pytest.raises(ValueError, match="only organisations 'shared_qk' and 'seesaw'"):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="pingpong", l_split=2)
    # Q 64 KiB + 4 stages × 32 KiB + mask rows, sink, (m, l) 1 KiB each + fp32 merge chunk 16 KiB + bf16 output
    # chunk 8 KiB + 12 mbarriers (checked against Mosaic's own count below)
    assert smem_bytes(512, 32, 4, "pingpong") == 224352


@pytest.mark.parametrize("organisation,block_kv,stages", [("shared_qk", 64, 2), ("shared_qk", 128, 2),
                                                         ("pingpong", 32, 4), ("pingpong", 64, 2),
                                                         ("seesaw", 64, 2)])
def test_smem_bytes_match_mosaic(monkeypatch, organisation, block_kv, stages):
    """:func:`smem_bytes` is exactly what Mosaic GPU allocates for the organisations that reserve no reduction
    scratch (its error message under a 1-byte bound reports the figure), so their margins under 227 KiB are real."""
    from jax.experimental.mosaic.gpu import core

    monkeypatch.setattr(core, "_SMEM_SIZE_BOUND", 1)
    s = jax.ShapeDtypeStruct
    d = 512 if block_kv < 128 else 256
    f = functools.partial(sparse_decode_attention, scale=0.1, organisation=organisation, block_kv=block_kv,
                          num_stages=stages)
    with pytest.raises(ValueError, match=f"smem_bytes={smem_bytes(d, block_kv, stages, organisation)} "):
        jax.jit(f).trace(s((2, 64, d), jnp.bfloat16), s((2, 640, d), jnp.bfloat16), s((2, 640), jnp.bool_),
                         s((64,), jnp.float32)).lower(lowering_platforms=("cuda",))


def test_seesaw_config():
    """Q 64 KiB + two whole 64-row blocks 128 KiB + the small fp32 buffer (mask rows, sink, m_0, m_1) + two fp32
    exchange buffers + 11 mbarriers: 920 B under the 232,448 B of a CTA; three stages do not fit."""
    assert check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="seesaw", l_split=2) == 2
    assert smem_bytes(512, 64, 2, "seesaw") == 65536 + 131072 + 2048 + 2 * 16384 + 8 * 11
    with pytest.raises(ValueError, match="shared memory"):
        check_config(64, 512, 640, block_kv=64, num_stages=3, v_split=2, organisation="seesaw")
    with pytest.raises(ValueError, match="at least 2 stages"):
        check_config(64, 512, 640, block_kv=64, num_stages=1, v_split=2, organisation="seesaw")
    with pytest.raises(ValueError, match="64-row KV blocks"):
        check_config(64, 512, 640, block_kv=128, num_stages=2, v_split=2, organisation="seesaw")
    with pytest.raises(ValueError, match="v_split must be 2"):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=4, organisation="seesaw")


def _seesaw_schedule(q, kv, valid, sink, scale: float, l_split: int) -> np.ndarray:
    """The ``seesaw`` kernel's arithmetic (decode_seesaw_sm90's docstring) in float32 NumPy, round by round: block
    ``2r`` warpgroup 0's (output columns ``[0, d/2)``), block ``2r + 1`` warpgroup 1's, an odd last block warpgroup
    0's alone, base-2 logits, P rounded to bf16 relative to the running max at the point each P·V uses it, the parts
    merged as ``decode_sm90._combine_parts`` does. Returns ``o`` float32 ``[N, H, d]`` (before the final bf16
    rounding)."""
    f32, bf16 = np.float32, ml_dtypes.bfloat16
    q, kv, sink = (np.asarray(x, f32) for x in (q, kv, sink))
    n, h, d = q.shape
    dh, blk = d // 2, 64
    log2e = f32(np.log2(np.e))
    mask = np.where(np.asarray(valid), f32(0), f32(-np.inf))
    per_part = kv.shape[1] // blk // l_split
    out = np.zeros((n, h, d), f32)

    def pv(p, rows):                                        # bf16(p) · V in fp32
        return p.astype(bf16).astype(f32) @ rows

    for i in range(n):
        accs, ms, ls = [], [], []
        for part in range(l_split):
            m = sink * log2e
            l_sum = np.full(h, f32(1.0 if part == 0 else 0.0))
            o_l, o_r = np.zeros((h, dh), f32), np.zeros((h, dh), f32)
            blocks = [kv[i, b * blk:(b + 1) * blk] for b in range(part * per_part, (part + 1) * per_part)]
            masks = [mask[i, b * blk:(b + 1) * blk] for b in range(part * per_part, (part + 1) * per_part)]
            logits = [(q[i] @ b.T) * f32(scale) * log2e + mk[None, :] for b, mk in zip(blocks, masks, strict=True)]
            rounds, tail = divmod(per_part, 2)
            for r in range(rounds):
                j0, j1 = 2 * r, 2 * r + 1
                s0 = logits[j0]
                m0 = np.maximum(m, s0.max(axis=1))
                a0 = np.exp2(m - m0)
                p0 = np.exp2(s0 - m0[:, None])
                o_l = o_l * a0[:, None] + pv(p0, blocks[j0][:, :dh])           # warpgroup 0
                s1 = logits[j1]
                m1 = np.maximum(m0, s1.max(axis=1))
                a1 = np.exp2(m0 - m1)
                p1 = np.exp2(s1 - m1[:, None])
                o_l = o_l * a1[:, None] + pv(p1, blocks[j1][:, :dh])
                o_r = o_r * (a0 * a1)[:, None] + pv(p1, blocks[j1][:, dh:])    # warpgroup 1
                o_r = o_r + pv(p0 * a1[:, None], blocks[j0][:, dh:])
                l_sum = (l_sum * a0 + p0.sum(axis=1)) * a1 + p1.sum(axis=1)
                m = m1
            if tail:
                s0 = logits[-1]
                m0 = np.maximum(m, s0.max(axis=1))
                a0 = np.exp2(m - m0)
                p0 = np.exp2(s0 - m0[:, None])
                o_l = o_l * a0[:, None] + pv(p0, blocks[-1][:, :dh])
                o_r = o_r * a0[:, None] + pv(p0, blocks[-1][:, dh:])
                l_sum = l_sum * a0 + p0.sum(axis=1)
                m = m0
            accs.append(np.concatenate([o_l, o_r], axis=1))
            ms.append(m)
            ls.append(l_sum)
        w = np.exp2(np.stack(ms) - np.max(ms, axis=0))                       # [parts, H]
        out[i] = (w[..., None] * np.stack(accs)).sum(axis=0) / (w * np.stack(ls)).sum(axis=0)[:, None]
    return out


@pytest.mark.parametrize("rows,l_split", [(640, 1), (640, 2), (192, 1), (64, 1), (640, 5)])
def test_seesaw_schedule_matches_contract(rows, l_split):
    """The ``seesaw`` schedule's rescalings (each warpgroup's ``a_0``, ``a_1``, the odd last block, the L parts'
    merge) give the contract within the GPU test's bound: ``|o − exact| ≤ 2^-7 · A + 2^-14 · max A``, the mean
    within ``2^-9 · mean A``, exact zeros for the query with no valid row and the head whose sink dominates. The
    kernel implements this arithmetic; this checks the algebra itself (with ``a_1`` left out of ``O_R``'s second
    product, four of these five cases fail — the one-block case has no full round; checked by hand 2026-12-07)."""
    n, h, d = 3, 64, 512
    q, kv, valid, sink = _inputs(n, h, d, rows, seed=rows + l_split)
    got = _seesaw_schedule(q, kv, valid, sink, d ** -0.5, l_split).astype(ml_dtypes.bfloat16).astype(np.float64)
    want, a = exact_contract(q, kv, valid, sink, d ** -0.5)
    assert (got[0] == 0).all() and (got[:, 1] == 0).all()
    err = np.abs(got - want)
    assert (err <= 2.0 ** -7 * a + 2.0 ** -14 * a.max()).all(), float((err / (2.0 ** -7 * a + 1e-30)).max())
    assert err.mean() <= 2.0 ** -9 * a.mean()


def test_split_cta_small_tiles_and_early_release_config():
    assert check_config(64, 512, 640, block_kv=32, num_stages=4, v_split=2) == 4
    assert check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, early_release=True) == 2
    with pytest.raises(ValueError, match="shared memory"):       # Q 64 KiB + 5 × 32 KiB tiles > 227 KiB
        check_config(64, 512, 640, block_kv=32, num_stages=5, v_split=2)
    with pytest.raises(ValueError, match="block_kv=16"):
        check_config(64, 512, 640, block_kv=16, num_stages=4, v_split=2)
    with pytest.raises(ValueError, match="early_release"):
        check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="shared_qk",
                     early_release=True)
    with pytest.raises(ValueError, match="early_release"):
        check_config(64, 256, 640, block_kv=64, num_stages=2, v_split=1, early_release=True)


def test_split_cluster_config():
    """``split_cluster``: ``split_cta``'s shared memory and block rule, clusters of 2–8 CTAs."""
    assert check_config(64, 512, 640, block_kv=64, num_stages=2, v_split=2, organisation="split_cluster") == 2
    assert smem_bytes(512, 64, 2, "split_cluster") == smem_bytes(512, 64, 2, "split_cta")
    with pytest.raises(ValueError, match="v_split must be 2 to 8"):
        check_config(64, 256, 640, block_kv=64, num_stages=2, v_split=1, organisation="split_cluster")
    with pytest.raises(ValueError, match="multiple of 64"):
        check_config(64, 512, 640, block_kv=32, num_stages=2, v_split=2, organisation="split_cluster")
    with pytest.raises(ValueError, match="shared memory"):
        check_config(64, 512, 640, block_kv=64, num_stages=3, v_split=2, organisation="split_cluster")


def test_split_cluster_multicasts_in_one_cluster():
    """``split_cluster``'s kernel is launched with a cluster of ``v_split`` CTAs and multicasts its Q and KV copies
    over it (each CTA copies ``1 / v_split`` of a tile into all the cluster's shared memories), with a cluster-wide
    "consumed" barrier; ``split_cta``'s kernel does none of that. Read from the kernel's jaxpr (the lowered Mosaic
    module is bytecode); that the copies land where the compute reads them is the GPU test's part."""
    s = jax.ShapeDtypeStruct
    jaxprs = {}
    for org in ("split_cta", "split_cluster"):
        f = functools.partial(sparse_decode_attention, scale=0.1, organisation=org)
        jaxprs[org] = str(jax.make_jaxpr(f)(s((64, 64, 512), jnp.bfloat16), s((64, 640, 512), jnp.bfloat16),
                                            s((64, 640), jnp.bool_), s((64,), jnp.float32)))
    copies = {org: [ln for ln in j.splitlines() if "copy_gmem_to_smem" in ln] for org, j in jaxprs.items()}
    multicast = [ln for ln in copies["split_cluster"] if "collective_axes=('split',)" in ln]
    # Q: 2 column chunks; KV: 2 chunks × 2 stages issued up front, 2 in the refill loop; local: the sink and the
    # mask rows (2 up front, 1 in the loop)
    assert len(multicast) == 8 and len(copies["split_cluster"]) == len(copies["split_cta"]) == 12
    assert "cluster=(2,)" in jaxprs["split_cluster"] and "cluster_names=('split',)" in jaxprs["split_cluster"]
    assert "cluster=()" in jaxprs["split_cta"] and "collective_axes=('split',)" not in jaxprs["split_cta"]


def test_traffic_counts():
    t = traffic(64, 64, 512, 640)
    assert t["bytes_read"] == 64 * 640 * 512 * 2 + 64 * 64 * 512 * 2 + 64 * 640 * 4 + 64 * 4
    assert t["bytes"] == t["bytes_read"] + 64 * 64 * 512 * 2
    assert t["flops_useful"] == 4 * 64 * 64 * 640 * 512
    assert t["flops_executed"] == 6 * 64 * 64 * 640 * 512
    shared = traffic(64, 64, 512, 640, organisation="shared_qk")
    assert shared["flops_executed"] == shared["flops_useful"] and shared["bytes"] == t["bytes"]
    assert shared["partial_bytes"] == 0
    assert traffic(64, 64, 512, 640, organisation="shared_qk", l_split=2)["partial_bytes"] == 2 * 2 * 64 * 64 * 514 * 4
    assert traffic(64, 64, 512, 640, organisation="pingpong") == t      # split_cta's reads and products
    assert traffic(64, 64, 512, 640, organisation="split_cluster") == t  # the same from HBM; half the L2 reads


@pytest.mark.parametrize("n, rows, want", [
    (1, 640, dict(organisation="shared_qk", l_split=10)),      # one query: one KV block per CTA
    (8, 640, dict(organisation="shared_qk", l_split=10)),      # 80 CTAs
    (8, 1280, dict(organisation="shared_qk", l_split=10)),     # 20 blocks: 20 would need 160 CTAs
    (3, 448, dict(organisation="shared_qk", l_split=7)),
    (2, 64, dict(organisation="shared_qk", l_split=1)),        # one block: nothing to split, no merge
    (9, 640, dict(organisation="split_cta", early_release=True)),
    (64, 640, dict(organisation="split_cta", early_release=True)),
    (66, 640, dict(organisation="split_cta", early_release=True)),   # 132 CTAs: still one wave
    (67, 640, dict(organisation="shared_qk", l_split=1)),            # split_cta would need a second wave
    (384, 640, dict(organisation="shared_qk", l_split=1)),           # batch 64 verifying five drafts
])
def test_decode_options_by_query_count(n, rows, want):
    """The model's choice of organisation (pallas_kernels/attention/tuning.py): a valid configuration every time
    (check_config accepts it) and the one its docstring states."""
    got = decode_options(n, rows)
    assert got == want
    check_config(64, 512, rows, block_kv=64, num_stages=2, v_split=2, **got)


def test_decode_options_rejects_bad_sizes():
    for n, rows in [(0, 640), (4, 0), (4, 100)]:
        with pytest.raises(ValueError, match="rows a positive multiple of 64"):
            decode_options(n, rows)


@pytest.mark.parametrize("n,h,d,rows,kw", [
    (64, 64, 512, 640, {}),                                        # the real decode size
    (1, 128, 512, 64, {}),                                         # two head blocks, one KV step
    (4, 64, 256, 256, dict(v_split=1, num_stages=3)),
    (4, 64, 512, 256, dict(v_split=4)),
    (64, 64, 512, 640, SHARED),                                    # shared_qk at the real size
    (1, 128, 512, 64, SHARED),
    (4, 64, 256, 640, dict(SHARED, block_kv=128)),
    (4, 64, 128, 256, dict(SHARED, num_stages=1)),
    (64, 64, 512, 640, dict(SHARED, l_split=2)),                   # L split: fp32 partials out, XLA combine
    (1, 64, 512, 640, dict(SHARED, l_split=10)),
    (64, 64, 512, 640, PING32),                                    # pingpong at the real size
    (64, 64, 512, 640, PING64),
    (1, 128, 512, 64, PING32),                                     # two KV steps: one each
    (3, 64, 256, 96, dict(PING32, v_split=1)),                     # three steps, no refill, odd stage count
    (64, 64, 512, 640, CLUSTER),                                   # split_cluster at the real size
    (4, 64, 512, 256, dict(CLUSTER, v_split=4)),                   # clusters of 4 CTAs
    (1, 128, 512, 64, CLUSTER),                                    # one KV step: nothing refilled
    (64, 64, 512, 640, BKV32),                                     # split_cta, 32-row tiles, 4 stages
    (64, 64, 512, 640, EARLY),                                     # split_cta, early release of others' chunks
    (4, 64, 512, 256, dict(EARLY, v_split=4)),
    (64, 64, 512, 640, SEESAW),                                    # seesaw: 5 rounds of two blocks
    (64, 64, 512, 640, dict(SEESAW, l_split=2)),                   # 5 blocks a part: an odd last block
    (1, 128, 512, 64, SEESAW),                                     # one block: warpgroup 0's alone
    (4, 64, 256, 192, dict(SEESAW, l_split=3)),                    # one block a part, fp32 partials out
])
def test_kernel_lowers_for_cuda(n, h, d, rows, kw):
    """The Mosaic GPU kernel lowers for CUDA on this CPU-only machine (jax 0.10.2 and 0.11.2): the Pallas →
    Mosaic GPU lowering (layouts, WGMMA operand shapes, TMA slices, barriers) runs; PTX compilation does not."""
    s = jax.ShapeDtypeStruct

    def f(q, kv, valid, sink):
        return sparse_decode_attention(q, kv, valid, sink, scale=d ** -0.5, **kw)

    traced = jax.jit(f).trace(s((n, h, d), jnp.bfloat16), s((n, rows, d), jnp.bfloat16), s((n, rows), jnp.bool_),
                              s((h,), jnp.float32))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def _organisation_id(kw: dict) -> str:
    """A test id naming the organisation and its L split (``-k seesaw`` selects that organisation's cases)."""
    return kw.get("organisation", "split_cta") + (f"-l{kw['l_split']}" if kw.get("l_split", 1) > 1 else "")


def _interpreter_shims(monkeypatch) -> None:
    """Trace-time stand-ins for what jax 0.11.2's Mosaic GPU interpreter lacks (see the module docstring): every
    ``plgpu.kernel`` gets three extra shared-memory buffers, each with one slice per warpgroup (``shared_qk`` runs
    two compute warpgroups at once); a WGMMA A operand in registers is stored into the calling warpgroup's slice of
    the first and read from there; ``pl.run_state(f)(ACC.init(x))`` becomes a fresh accumulator, ``acc += x · I``
    (x staged in the second, the identity in the third), then ``f``. Exact in the interpreter (its WGMMA is a NumPy
    matmul)."""
    from jax._src.state.types import AbstractRef, TransformedRef
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    real_wgmma, real_kernel, width = plgpu.wgmma, plgpu.kernel, 512
    stash: dict = {}

    def kernel(body, *, scratch_types, **kw):
        wgs = kw.get("num_threads") or 1
        extra = [plgpu.SMEM((wgs, 64, width), jnp.bfloat16), plgpu.SMEM((wgs, 64, width), jnp.float32),
                 plgpu.SMEM((wgs, width, width), jnp.float32)]

        def wrapped(*refs):
            stash["p"], stash["x"], stash["eye"] = refs[-3:]
            stash["wg"] = kw.get("thread_name")
            body(*refs[:-3])

        return real_kernel(wrapped, scratch_types=[*scratch_types, *extra], **kw)

    def mine(name):
        return stash[name].at[lax.axis_index(stash["wg"]) if stash["wg"] else 0]

    def wgmma(acc, a, b, **kw):
        if not (isinstance(a, TransformedRef) or isinstance(getattr(a, "aval", None), AbstractRef)):
            staged = mine("p").at[:, pl.ds(0, a.shape[1])]
            staged[...] = a
            a = staged
        real_wgmma(acc, a, b, **kw)

    def staged_with_identity(x):
        """``x [m, k]`` fp32 stored in the calling warpgroup's staging buffer, and a ``[k, k]`` identity beside it:
        the operands of a WGMMA that adds ``x`` to an accumulator."""
        k = x.shape[1]
        x_ref, eye = mine("x").at[:, pl.ds(0, k)], mine("eye").at[pl.ds(0, k), pl.ds(0, k)]
        x_ref[...] = x
        eye[...] = (lax.broadcasted_iota(jnp.int32, (k, k), 0) == lax.broadcasted_iota(jnp.int32, (k, k), 1)
                    ).astype(jnp.float32)
        return x_ref, eye

    def run_state(f):
        def run(init):
            x = init._init
            m, k = x.shape
            x_ref, eye = staged_with_identity(x)

            def scope(acc_ref):
                real_wgmma(acc_ref, x_ref, eye)
                f(acc_ref)
                return acc_ref[...]

            return pl.run_scoped(scope, plgpu.ACC((m, k), jnp.float32))

        return run

    monkeypatch.setattr(plgpu, "wgmma", wgmma)
    monkeypatch.setattr(plgpu, "kernel", kernel)
    monkeypatch.setattr(pl, "run_state", run_state)


@pytest.mark.parametrize("n,h,d,rows,kw", [
    (2, 64, 128, 256, {}),                                         # 4 KV steps through 2 stages
    (3, 128, 256, 192, dict(v_split=4, num_stages=3)),             # two head blocks, 4 column chunks, no refill
    (2, 64, 512, 640, {}),                                         # the real head width and row count
    (2, 64, 512, 640, SHARED),                                     # shared_qk: the real size, 10 KV steps
    (3, 128, 128, 192, dict(SHARED, num_stages=3)),                # two head blocks, d/2 = 64, no refill
    (3, 64, 512, 640, dict(SHARED, l_split=2)),                    # L in two parts, 5 steps each, XLA combine
    (2, 64, 256, 256, dict(SHARED, l_split=4)),                    # one KV step per part
    (2, 64, 512, 640, PING32),                                     # pingpong: 20 steps through 4 stages
    (3, 128, 256, 192, dict(PING64, v_split=1)),                   # two head blocks, 3 steps: consumer 1 takes one
    (2, 64, 256, 64, PING64),                                      # one KV step: consumer 1 has none
    (2, 64, 512, 640, CLUSTER),                                    # split_cluster: 10 steps, multicast tiles
    (2, 64, 512, 640, BKV32),                                      # split_cta: 20 steps through 4 stages
    (2, 64, 512, 640, EARLY),                                      # others' chunks refilled after the QK product
    (2, 64, 512, 640, dict(BKV32, **EARLY)),
    (3, 128, 256, 192, dict(EARLY, v_split=4, num_stages=2)),      # three chunks early, the own one after P·V
    (2, 64, 512, 640, SEESAW),                                     # seesaw: 5 rounds, stages refilled
    (3, 64, 512, 640, dict(SEESAW, l_split=2)),                    # odd last block per part, XLA combine
    (3, 128, 256, 192, SEESAW),                                    # two head blocks, one round + a last block
], ids=lambda v: _organisation_id(v) if isinstance(v, dict) else None)
def test_kernel_in_mosaic_gpu_interpreter(monkeypatch, n, h, d, rows, kw):
    """The kernel (with the shims above) in the Mosaic GPU interpreter against the exact contract, with the GPU
    test's tolerances (tests/test_decode_attention_gpu.py says why): ``|kernel − exact| ≤ 2^-7 · A + 2^-14 · max A``
    and ``mean |kernel − exact| ≤ 2^-9 · mean A``; exact zeros for the query with no valid row and the head whose
    sink dominates."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not hasattr(plgpu, "force_gpu_interpret_mode"):
        pytest.skip(f"jax {jax.__version__}: no plgpu.force_gpu_interpret_mode (the Mosaic GPU interpreter API this "
                    "test drives arrived with jax 0.11)")
    _interpreter_shims(monkeypatch)
    q, kv, valid, sink = _inputs(n, h, d, rows, seed=d + rows)
    scale = d ** -0.5
    args = tuple(jnp.asarray(x) for x in (q, kv, valid, sink))
    kernel = jax.jit(functools.partial(sparse_decode_attention.__wrapped__, scale=scale, **kw))  # own jit cache
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = np.asarray(kernel(*args), np.float64)
    assert (got[0] == 0).all() and (got[:, 1] == 0).all()
    want, a = exact_contract(q, kv, valid, sink, scale)
    err = np.abs(got - want)
    bound = 2.0 ** -7 * a + 2.0 ** -14 * a.max()
    print(f"N={n} H={h} d={d} L={rows} {kw}: max err/bound {(err / bound).max():.3f}, "
          f"mean err/bound {err.mean() / (2.0 ** -9 * a.mean()):.3f}")
    assert (err <= bound).all(), float((err / bound).max())
    assert err.mean() <= 2.0 ** -9 * a.mean()


@pytest.mark.parametrize("kw", [SHARED, dict(SHARED, l_split=2), dict(PING32, v_split=1), SEESAW,
                                dict(SEESAW, l_split=2)], ids=lambda kw: _organisation_id(kw))
def test_exchanges_have_no_race(monkeypatch, capsys, kw):
    """``shared_qk`` (4 KV steps through 2 stages, so the exchange buffers are rewritten and the stages refilled)
    and ``pingpong`` (8 steps through 4 stages, its merge in two chunks through one buffer) under the interpreter's
    happens-before race detector: no race may involve the two consumers' exchanges (partial logits; ``pingpong``'s
    running max and sum and merge chunks) or the outputs. The one pattern the detector does report, in both
    organisations, is the producer's TMA
    refill of a stage's mask row after the consumers' plain loads of it, ordered only through the "consumed"
    mbarrier (no proxy fence between the generic-proxy loads and the async-proxy write; the TMA pipelines of jax's
    and CUTLASS's kernels release stages the same way, and ``split_cta`` passed on the H200 with it), so races whose
    write is that refill are allowed here. Removing either exchange wait makes this test fail (checked by hand)."""
    import re

    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not hasattr(plgpu, "force_gpu_interpret_mode"):
        pytest.skip(f"jax {jax.__version__}: no Mosaic GPU interpreter")
    _interpreter_shims(monkeypatch)
    n, h, d, rows = 3, 64, 128, 256
    q, kv, valid, sink = _inputs(n, h, d, rows, seed=11)
    args = tuple(jnp.asarray(x) for x in (q, kv, valid, sink))
    kernel = jax.jit(functools.partial(sparse_decode_attention.__wrapped__, scale=d ** -0.5, **kw))
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        got = np.asarray(kernel(*args), np.float64)
    printed = capsys.readouterr().out
    reports = printed.split("RACE DETECTED")[1:]
    frames = [re.findall(r"(read|write) of .*?\((_[\w.<>]*)\)\n", r) for r in reports]
    refill = "_produce_kv.<locals>.issue"
    others = [f for f in frames if not any(kind == "write" and fn.endswith(refill) for kind, fn in f)]
    assert not others, f"races outside the mask refill: {others}"
    want, a = exact_contract(q, kv, valid, sink, d ** -0.5)
    assert (np.abs(got - want) <= 2.0 ** -7 * a + 2.0 ** -14 * a.max()).all()
