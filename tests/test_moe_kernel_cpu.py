"""Expert-kernel pieces that run on CPU: padded layout (exact integers), FP4 decode, and the kernel's jnp contract.

The Mosaic GPU kernels themselves are checked on the H200 (tests/test_moe_kernel_gpu.py, marked ``gpu``): their
in-register dequantisation uses ``inline_mgpu`` and a WGMMA with its A operand in registers, neither of which
Pallas's Mosaic GPU interpreter runs (jax 0.10.2: ``Expected shape (5,) but got (64, 64)`` in the interpreter's
wgmma, even with the decode written in jnp). On CPU they are lowered for CUDA (``test_kernel_lowers_for_cuda``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.moe import fp4, layout, reference

# The e2m1 value of each 4-bit code, from the format's definition (sign bit 3, exponent bits 2-1 with bias 1,
# mantissa bit 0; exponent 0 is subnormal: 0.5·m).
E2M1 = [(-1) ** (c >> 3) * (((c >> 1) & 3) and 2.0 ** (((c >> 1) & 3) - 1) * (1 + (c & 1) / 2) or 0.5 * (c & 1))
        for c in range(16)]


def test_e2m1_table_is_the_format():
    assert E2M1[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [abs(v) for v in E2M1[8:]] == E2M1[:8]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_signed_codes_all_16(dtype):
    codes = np.arange(16)
    signed = np.where(codes >= 8, codes - 16, codes)     # what an int4 read of the nibble gives
    got = np.asarray(fp4.decode_signed_codes(jnp.asarray(signed, dtype)), np.float32)
    np.testing.assert_array_equal(np.abs(got), np.abs(E2M1))
    np.testing.assert_array_equal(np.signbit(got[1:]), np.signbit(np.array(E2M1[1:])))  # −0 may lose its sign


def test_dequantize_fp4_matches_numpy_decode():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 4, 32), dtype=np.uint8)          # [G, out, in/2]
    sbits = rng.integers(100, 140, (3, 4, 2), dtype=np.uint8)          # [G, out, in/32]
    want = np.empty((3, 4, 64), np.float32)
    want[..., 0::2] = np.array(E2M1, np.float32)[packed & 15]
    want[..., 1::2] = np.array(E2M1, np.float32)[packed >> 4]
    want *= np.repeat(2.0 ** (sbits.astype(np.float32) - 127), 32, axis=-1)
    scale = sbits.view(ml_dtypes.float8_e8m0fnu)
    got = fp4.dequantize_fp4(jnp.asarray(packed), jnp.asarray(scale))
    np.testing.assert_array_equal(np.asarray(got), want)
    got_bits = fp4.dequantize_fp4(jnp.asarray(packed), jnp.asarray(sbits), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got_bits, np.float32), want)   # exact in bf16 too


@pytest.mark.parametrize("n,k,g,bm", [(1, 6, 256, 8), (5, 2, 8, 8), (64, 6, 16, 16), (37, 4, 8, 32)])
def test_grouped_layout_exact(n, k, g, bm):
    rng = np.random.default_rng(n * 100 + g)
    ids = np.stack([rng.choice(g, k, replace=False) for _ in range(n)]).astype(np.int32)
    lay = layout.grouped_layout(jnp.asarray(ids), g, bm)
    rows = layout.num_rows(n * k, g, bm)
    row = np.asarray(lay.row)
    tg = np.asarray(lay.tile_group)
    assert tg.shape == (rows // bm,)
    assert len(set(row.reshape(-1).tolist())) == n * k and row.max() < rows      # a slot each, in range
    np.testing.assert_array_equal(tg[row // bm], ids)                            # each pair's tile is its expert
    # experts appear in increasing order, each on whole tiles, pairs in flat order inside an expert
    used = tg[tg >= 0]
    assert (np.diff(used) >= 0).all() and int(lay.num_tiles) == len(used)
    assert (tg[len(used):] == -1).all()
    for e in range(g):
        mine = row.reshape(-1)[ids.reshape(-1) == e]
        assert (np.diff(mine) == 1).all()
        if len(mine):
            assert mine[0] % bm == 0
    np.testing.assert_array_equal(np.asarray(lay.group_sizes), np.bincount(ids.reshape(-1), minlength=g))


def test_scatter_and_combine_roundtrip():
    rng = np.random.default_rng(3)
    n, k, g, bm, d = 9, 3, 8, 8, 16
    ids = np.stack([rng.choice(g, k, replace=False) for _ in range(n)]).astype(np.int32)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.random((n, k)).astype(np.float32)
    lay = layout.grouped_layout(jnp.asarray(ids), g, bm)
    rows = layout.num_rows(n * k, g, bm)
    xt = layout.gather_rows_t(jnp.asarray(x), lay, rows)
    # identity experts: combining the gathered inputs gives Σ_j w_j · x
    y = layout.combine_rows_t(xt, lay, jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(y), x * w.sum(1, keepdims=True), rtol=1e-6)
    mask = np.ones(rows, bool)
    mask[np.asarray(lay.row).reshape(-1)] = False
    assert not np.asarray(xt)[:, mask].any()            # padding columns are zero


def _random_fp4_expert(key, g, out, inn):
    k1, k2 = jax.random.split(key)
    data = jax.random.randint(k1, (g, out, inn // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    sbits = jax.random.randint(k2, (g, out, inn // 32), 118, 124, jnp.int32).astype(jnp.uint8)
    return reference.ExpertWeight(data, sbits, "fp4")


def test_reference_equals_dense_loop_in_float64():
    """The reference's grouped GEMM equals a per-token loop over dense float64 expert weights."""
    g, d, i, n, k, limit = 8, 64, 32, 7, 2, 1.5
    keys = jax.random.split(jax.random.key(0), 5)
    w1, w3 = _random_fp4_expert(keys[0], g, i, d), _random_fp4_expert(keys[1], g, i, d)
    w2 = _random_fp4_expert(keys[2], g, d, i)
    x = jax.random.normal(keys[3], (n, d), jnp.float32)
    rng = np.random.default_rng(1)
    ids = np.stack([rng.choice(g, k, replace=False) for _ in range(n)]).astype(np.int32)
    rw = jax.random.uniform(keys[4], (n, k), jnp.float32)
    got = np.asarray(reference.experts(x, jnp.asarray(ids), rw, w1, w3, w2, swiglu_limit=limit))
    W1, W3, W2 = (np.asarray(w.dense(), np.float64) for w in (w1, w3, w2))
    xn, rwn = np.asarray(x, np.float64), np.asarray(rw, np.float64)
    want = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            e = ids[t, j]
            gg = np.minimum(W1[e] @ xn[t], limit)
            uu = np.clip(W3[e] @ xn[t], -limit, limit)
            want[t] += rwn[t, j] * (W2[e] @ (gg / (1 + np.exp(-gg)) * uu))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err   # fp32 accumulation over ≤ 64 terms


@pytest.mark.parametrize("assignments", [16 * 6, 8192 * 6])
@pytest.mark.parametrize("table", ["TABLE", "FALLBACK"])
def test_kernel_lowers_for_cuda(assignments, table):
    """The Mosaic GPU kernels (both GEMMs, the block table's sizes: warp-specialised, and the single-warpgroup
    fallback) lower for CUDA on a CPU-only machine: catches API drift and shared-memory overflow before a GPU run.
    (Whether they compute the right thing is the GPU test.)"""
    from pallas_kernels.moe import tuning
    from pallas_kernels.moe.kernel_sm90 import experts_sm90

    def configs_for(n):
        return next((up, down) for limit, up, down in getattr(tuning, table) if n <= limit)

    g, d, i, k = 16, 1024, 512, 6
    n = assignments // k
    s = jax.ShapeDtypeStruct
    def fp4w(o, inn):
        return reference.ExpertWeight(s((g, o, inn // 2), jnp.uint8), s((g, o, inn // 32), jnp.uint8), "fp4")
    up, down = configs_for(assignments)
    traced = jax.jit(experts_sm90, static_argnames=("swiglu_limit", "up_config", "down_config")).trace(
        s((n, d), jnp.bfloat16), s((n, k), jnp.int32), s((n, k), jnp.float32), fp4w(i, d), fp4w(i, d), fp4w(d, i),
        swiglu_limit=10.0, up_config=up, down_config=down)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2
    assert (up.consumers, down.consumers) == ((2, 2) if table == "TABLE" else (1, 1))


def test_configs_fall_back_when_tiles_do_not_divide():
    from pallas_kernels.moe.tuning import FALLBACK, TABLE, configs_for

    assert configs_for(96, hidden=4096, inter=2048) == TABLE[0][1:]
    assert configs_for(96, hidden=4096, inter=192) == FALLBACK[0][1:]     # 192 rows: not a multiple of 128
    assert configs_for(6 * 8192, hidden=512, inter=256) == TABLE[1][1:]


def test_scaled_bf16_bits_are_e2m1_times_2_pow_minus_126():
    """The kernel's bit-placement decode, read as bf16 by the format's own rules (sign, 8-bit exponent with bias
    127, 7-bit mantissa, exponent 0 subnormal), is e2m1(code)·2^-126 for all 16 codes."""
    codes = np.arange(16)
    signed = np.where(codes >= 8, codes - 16, codes).astype(np.int16)
    bits = np.asarray(fp4.signed_codes_to_scaled_bf16_bits(jnp.asarray(signed))).astype(np.int64) & 0xFFFF
    sign = np.where(bits >> 15, -1.0, 1.0)
    exp, mant = (bits >> 7) & 0xFF, bits & 0x7F
    value = sign * np.where(exp > 0, 2.0 ** (exp - 127.0) * (1 + mant / 128), 2.0 ** -126 * mant / 128)
    np.testing.assert_array_equal(value * 2.0 ** 126, np.array(E2M1))


def test_packed_pair_decode_is_two_bit_placement_decodes():
    """The packed decode (two codes of one byte → two bf16 in one 32-bit integer) equals the per-element bit
    placement for both nibbles of all 256 bytes, which the test above ties to the e2m1 format."""
    for x in range(256):
        got = fp4.packed_pair_to_scaled_bf16x2(x)
        lo, hi = (x & 15, x >> 4)
        want = [int(fp4.signed_codes_to_scaled_bf16_bits(jnp.int16(c - 16 if c >= 8 else c))) & 0xFFFF
                for c in (lo, hi)]
        assert (got & 0xFFFF, got >> 16) == tuple(want), x


def test_dropped_pairs_take_no_tile_and_combine_to_zero():
    """Expert-parallel view (id ``G``: the pair is computed on another rank): such pairs get row ``rows`` (past
    the buffer), no tile and no column of the gathered activations, and their weighted outputs are exact zeros;
    the kept pairs are laid out exactly as the same routing without the dropped ones."""
    rng = np.random.default_rng(5)
    n, k, g, bm, d = 23, 4, 8, 8, 16
    ids = np.stack([rng.choice(g, k, replace=False) for _ in range(n)]).astype(np.int32)
    drop = rng.random((n, k)) < 0.5
    marked = np.where(drop, g, ids).astype(np.int32)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.random((n, k)).astype(np.float32)
    lay = layout.grouped_layout(jnp.asarray(marked), g, bm)
    rows = layout.num_rows(n * k, g, bm)
    row = np.asarray(lay.row)
    assert (row[drop] == rows).all() and (row[~drop] < rows).all()
    assert len(set(row[~drop].tolist())) == int((~drop).sum())
    np.testing.assert_array_equal(np.asarray(lay.group_sizes), np.bincount(ids[~drop], minlength=g))
    tg = np.asarray(lay.tile_group)
    np.testing.assert_array_equal(tg[row[~drop] // bm], ids[~drop])
    assert int(lay.num_tiles) == int(sum(-(-c // bm) for c in np.bincount(ids[~drop], minlength=g)))
    xt = np.asarray(layout.gather_rows_t(jnp.asarray(x), lay, rows))
    used = np.zeros(rows, bool)
    used[row[~drop]] = True
    assert not xt[:, ~used].any()                       # no column for a dropped pair
    # padding columns filled with garbage (the kernel leaves unused tiles unwritten): dropped pairs stay zero
    yt = np.where(used[None, :], xt, np.nan).astype(np.float32)
    r = np.asarray(layout.choice_rows_t(jnp.asarray(yt), lay, jnp.asarray(w)))
    np.testing.assert_array_equal(r[drop], 0.0)
    np.testing.assert_allclose(r[~drop], x[np.nonzero(~drop)[0]] * w[~drop][:, None], rtol=1e-6)
    y = np.asarray(layout.combine_rows_t(jnp.asarray(yt), lay, jnp.asarray(w)))
    np.testing.assert_allclose(y, x * np.where(drop, 0, w).sum(1, keepdims=True), rtol=1e-5)


def test_expert_choices_kernel_lowers_for_cuda():
    """The expert-parallel entry point (pairs marked ``G`` skipped, per-pair outputs) lowers for CUDA."""
    from pallas_kernels.moe.kernel_sm90 import expert_choices_sm90
    from pallas_kernels.moe.tuning import configs_for

    g, d, i, k, n = 16, 1024, 512, 6, 64
    s = jax.ShapeDtypeStruct
    def fp4w(o, inn):
        return reference.ExpertWeight(s((g, o, inn // 2), jnp.uint8), s((g, o, inn // 32), jnp.uint8), "fp4")
    up, down = configs_for(n * k)
    traced = expert_choices_sm90.trace(s((n, d), jnp.bfloat16), s((n, k), jnp.int32), s((n, k), jnp.float32),
                                       fp4w(i, d), fp4w(i, d), fp4w(d, i), swiglu_limit=10.0, up_config=up,
                                       down_config=down)
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("mosaic_gpu") >= 2
