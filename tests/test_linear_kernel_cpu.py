"""FP8 linear kernel pieces that run on CPU: the bit-placement decode and its scale bias against the e4m3 format
(ml_dtypes), the reference against float64, the kernel's scale layout, the block table on the models' shapes,
and the kernel lowered for CUDA. Whether the kernel computes the right thing is tests/test_linear_kernel_gpu.py."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.linear import reference as ref

FINITE_CODES = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)   # 0x7F / 0xFF are NaN


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """The format's values, by ml_dtypes (independent of the code under test)."""
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def placed_bits(codes: np.ndarray) -> np.ndarray:
    """The kernel's decode on CPU arrays: the bf16 bit patterns of the placed codes, as uint16."""
    bits = ref.e4m3_bits_to_scaled_bf16_bits(jnp.asarray(codes.astype(np.int8)).astype(jnp.int16))
    return np.asarray(bits).view(np.uint16)


def test_bit_placement_is_e4m3_times_2_pow_minus_120_for_every_finite_code():
    got = placed_bits(FINITE_CODES).view(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(got * 2.0 ** 120, e4m3_values(FINITE_CODES))


@pytest.mark.parametrize("s", [100, 115, 121, 127, 134])
def test_scale_multiplier_restores_the_value_exactly(s):
    """The kernel multiplies the placed bits by the bf16 number with exponent field S + 120 (``_scale_rows``); the
    product must be e4m3(code) · 2^(S−127) and representable in bf16 (so an IEEE bf16 multiply, which keeps
    subnormal inputs as the GPU's does, returns it exactly) for every finite code, subnormal codes included.
    Computed in float64 here: XLA:CPU flushes bf16 subnormals to zero, the GPU does not (the FP4 decode relies on
    the same, checked on the H200)."""
    a = placed_bits(FINITE_CODES).view(ml_dtypes.bfloat16).astype(np.float64)
    mult = np.array([(s + ref.SCALE_BIAS) << 7], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    product = a * mult
    np.testing.assert_array_equal(product, e4m3_values(FINITE_CODES) * 2.0 ** (s - 127))
    np.testing.assert_array_equal(product.astype(ml_dtypes.bfloat16).astype(np.float64), product)


def random_weight(rng, n: int, k: int, block: tuple[int, int]):
    codes = rng.choice(FINITE_CODES, size=(n, k)).view(ml_dtypes.float8_e4m3fn)
    sbits = rng.integers(110, 128, size=(-(-n // block[0]), -(-k // block[1]))).astype(np.uint8)
    return codes, sbits


@pytest.mark.parametrize("n,k,block", [(256, 384, (128, 128)), (200, 160, (128, 128)), (96, 64, (32, 32))])
def test_reference_matches_float64(n, k, block):
    rng = np.random.default_rng(n + k)
    codes, sbits = random_weight(rng, n, k, block)
    x = rng.standard_normal((5, k)).astype(np.float32)
    w64 = e4m3_values(codes.view(np.uint8)) * np.ldexp(
        1.0, np.repeat(np.repeat(sbits.astype(np.int64) - 127, block[0], 0)[:n], block[1], 1)[:, :k])
    w = np.asarray(ref.dequantize(jnp.asarray(codes), jnp.asarray(sbits.view(ml_dtypes.float8_e8m0fnu)), block))
    np.testing.assert_array_equal(w.astype(np.float64), w64)     # exact: a 4-bit significand times 2^e
    y = np.asarray(ref.fp8_linear(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(sbits), block))
    want = x.astype(np.float64) @ w64.T
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < 1e-6, err        # fp32 sums of ≤ 384 terms


@pytest.mark.parametrize("n,k,block,split", [(256, 512, (128, 128), 1), (128, 1280, (32, 32), 2),
                                             (64, 2048, (128, 128), 4)])
def test_kernel_scales_layout(n, k, block, split):
    """Slab ``[s, row, j]`` holds the exponent of row ``row`` for inputs ``32·(s·kg + j)`` onward, padded."""
    from pallas_kernels.linear.kernel_sm90 import kernel_scales

    rng = np.random.default_rng(0)
    _, sbits = random_weight(rng, n, k, block)
    got = np.asarray(kernel_scales(jnp.asarray(sbits), n, k, block, split))
    kg = k // 32 // split
    assert got.shape == (split, n, -(-kg // 16) * 16)
    for s_, row, j in itertools.product(range(split), range(0, n, 7), range(kg)):
        col = 32 * (s_ * kg + j)
        assert got[s_, row, j] == sbits[row // block[0], col // block[1]]
    assert not got[:, :, kg:].any()


SHAPES = [(2048, 4096), (4096, 2048), (512, 4096), (8192, 4096), (4096, 8192), (1024, 4096), (32768, 1024),
          (2304, 5120), (5120, 2304), (512, 5120), (25600, 6144), (5120, 8192), (1280, 5120), (4096, 1280),
          (32768, 1280)]   # the FP8 linears of V4-Flash and V4.1-Flash layers


@pytest.mark.parametrize("tokens", [1, 16, 64, 256, 8192])
def test_block_table_fits_every_model_linear(tokens):
    from pallas_kernels.linear.tuning import DECODE_MAX_TOKENS, NUM_SMS, SMEM_LIMIT, config_for

    for n, k in SHAPES:
        cfg = config_for(tokens, n, k)
        cfg.check(n, k)
        assert cfg.smem_bytes(k) <= SMEM_LIMIT
        if tokens <= DECODE_MAX_TOKENS:
            assert cfg.block_m <= max(16, 2 * tokens)     # decode: padding at most doubles the token tile
        if tokens > DECODE_MAX_TOKENS:
            assert cfg.split_k == 1                     # prefill: no partial sums to add
        else:
            assert cfg.split_k == 1 or 8 * cfg.split_k * cfg.block_m <= k // 4   # partial sums ≤ 1/4 of W
            if (n // cfg.block_n) < NUM_SMS and 16 * cfg.block_m <= k // 4 and k % (cfg.block_k * 2) == 0:
                assert cfg.split_k > 1, (n, k, cfg)     # decode: small-N weights split K where it is cheap


@pytest.mark.parametrize("tokens,n,k,block", [(64, 1024, 4096, (128, 128)), (8192, 4096, 2048, (128, 128)),
                                              (16, 4096, 1280, (32, 32)), (1, 512, 4096, (128, 128)),
                                              (24, 2304, 5120, (32, 32))])
def test_kernel_lowers_for_cuda(tokens, n, k, block):
    """The Mosaic GPU kernel lowers for CUDA on a CPU-only machine (API drift, layouts, shared memory)."""
    from pallas_kernels.linear.kernel_sm90 import fp8_linear_sm90
    from pallas_kernels.linear.tuning import config_for

    s = jax.ShapeDtypeStruct
    cfg = config_for(tokens, n, k)
    traced = fp8_linear_sm90.trace(s((tokens, k), jnp.bfloat16), s((n, k), jnp.float8_e4m3fn),
                                   s((-(-n // block[0]), -(-k // block[1])), jnp.float8_e8m0fnu),
                                   config=cfg, block=block)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("grouped", [False, True])
def test_two_ctas_per_sm_lower_for_cuda(grouped):
    """``ctas_per_sm=2`` (two persistent CTAs per SM, for the decode sweep of scripts/bench_linear.py) lowers."""
    from pallas_kernels.linear.kernel_sm90 import LinearConfig, fp8_grouped_linear_sm90, fp8_linear_sm90

    s = jax.ShapeDtypeStruct
    cfg = LinearConfig(64, 64, 128, 2, 3, ctas_per_sm=2)
    if grouped:
        traced = fp8_grouped_linear_sm90.trace(s((64, 8, 4096), jnp.bfloat16), s((8192, 4096), jnp.float8_e4m3fn),
                                               s((64, 32), jnp.float8_e8m0fnu), config=cfg, block=(128, 128))
    else:
        traced = fp8_linear_sm90.trace(s((64, 4096), jnp.bfloat16), s((1024, 4096), jnp.float8_e4m3fn),
                                       s((8, 32), jnp.float8_e8m0fnu), config=cfg, block=(128, 128))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="ctas_per_sm=3"):
        LinearConfig(64, 64, 128, 2, 3, ctas_per_sm=3).check(1024, 4096)


def test_config_refuses_scale_rows_longer_than_one_copy():
    from pallas_kernels.linear.kernel_sm90 import LinearConfig

    LinearConfig(64, 64, 128, 1).check(1024, 8192)            # 256 scale bytes per row: one TMA copy
    with pytest.raises(ValueError, match="256 scale bytes"):
        LinearConfig(64, 64, 128, 1).check(1024, 16384)
    LinearConfig(64, 64, 128, 2).check(1024, 16384)



@pytest.mark.parametrize("tokens,groups,r,k", [(64, 8, 1024, 4096), (1, 8, 1024, 4096), (16, 4, 512, 2048)])
def test_grouped_kernel_lowers_for_cuda(tokens, groups, r, k):
    """The grouped form (V4's output projection ``wo_a``: 8 groups of ``[1024, 4096]``) lowers for CUDA."""
    from pallas_kernels.linear.kernel_sm90 import fp8_grouped_linear_sm90
    from pallas_kernels.linear.tuning import config_for

    s = jax.ShapeDtypeStruct
    n = groups * r
    traced = fp8_grouped_linear_sm90.trace(s((tokens, groups, k), jnp.bfloat16), s((n, k), jnp.float8_e4m3fn),
                                           s((n // 128, k // 128), jnp.float8_e8m0fnu),
                                           config=config_for(tokens, n, k), block=(128, 128))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_grouped_kernel_refuses_groups_that_split_a_scale_block():
    from pallas_kernels.linear.kernel_sm90 import fp8_grouped_linear_sm90
    from pallas_kernels.linear.tuning import config_for

    s = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="groups of whole"):
        fp8_grouped_linear_sm90.trace(s((4, 3, 256), jnp.bfloat16), s((192, 256), jnp.float8_e4m3fn),
                                      s((2, 2), jnp.float8_e8m0fnu), config=config_for(4, 192, 256),
                                      block=(128, 128))
