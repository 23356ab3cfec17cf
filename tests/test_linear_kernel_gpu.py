"""FP8 linear kernel (Mosaic GPU) against its ``jnp`` reference on an H100/H200. Marked ``gpu`` (excluded from CI);
run with ``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu tests/test_linear_kernel_gpu.py``.

Tolerance: the kernel multiplies bf16 activations by exactly dequantised bf16 weights (products exact in fp32) and
sums in fp32 in another order than the reference (an fp32 CPU product of the same bf16-rounded activations and the
same weights). The difference is fp32 rounding over K ≤ 8192 terms: ~2^-24 · sqrt(K) ≈ 5e-6 of the output scale.
We allow max 1e-4 and mean 1e-5 relative to ``max|reference|``; a wrong scale, code or tile is of order 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import gpu_device
from pallas_kernels.linear import reference as ref
from pallas_kernels.linear.kernel_sm90 import LinearConfig, fp8_grouped_linear_sm90, fp8_linear_sm90
from pallas_kernels.linear.tuning import config_for

pytestmark = pytest.mark.gpu

FINITE = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)


def _weight(rng, n, k, block):
    codes = rng.choice(FINITE, size=(n, k))
    codes[0, :254] = FINITE                        # every finite code, subnormals included, in the first row
    sbits = rng.integers(112, 126, size=(-(-n // block[0]), -(-k // block[1]))).astype(np.uint8)
    return codes.view(ml_dtypes.float8_e4m3fn), sbits.view(ml_dtypes.float8_e8m0fnu)


CASES = [  # (tokens, n, k, block, config or None = the block table's)
    (1, 1024, 4096, (128, 128), None), (16, 512, 4096, (128, 128), None), (64, 4096, 2048, (128, 128), None),
    (64, 1280, 5120, (32, 32), None), (200, 4096, 1280, (32, 32), None), (1024, 2048, 4096, (128, 128), None),
    (64, 1024, 4096, (128, 128), LinearConfig(64, 128, 64, 2, 3)),
    (8, 512, 1024, (128, 128), LinearConfig(16, 64, 128, 1, 2)),
    (64, 1024, 4096, (128, 128), LinearConfig(64, 64, 128, 2, 3, ctas_per_sm=2)),
    (64, 4096, 8192, (128, 128), LinearConfig(64, 128, 128, 4, 2, ctas_per_sm=2)),
]


@pytest.mark.parametrize("tokens,n,k,block,cfg", CASES)
def test_fp8_linear_matches_reference(tokens, n, k, block, cfg):
    dev = gpu_device()
    rng = np.random.default_rng(tokens + n + k)
    codes, scale = _weight(rng, n, k, block)
    x = rng.standard_normal((tokens, k)).astype(np.float32).astype(ml_dtypes.bfloat16)
    cfg = cfg or config_for(tokens, n, k)
    got = np.asarray(fp8_linear_sm90(jax.device_put(jnp.asarray(x), dev), jax.device_put(jnp.asarray(codes), dev),
                                     jax.device_put(jnp.asarray(scale), dev), config=cfg, block=block))
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(jnp.asarray(a), cpu) for a in (x, codes, scale)]
    want = np.asarray(jax.jit(ref.fp8_linear, static_argnums=3)(*args, block))
    scale_ = np.abs(want).max()
    err = np.abs(got - want)
    assert err.max() / scale_ < 1e-4 and err.mean() / scale_ < 1e-5, (err.max() / scale_, err.mean() / scale_)


@pytest.mark.parametrize("tokens,groups,r,k", [(64, 8, 1024, 4096), (1, 8, 1024, 4096), (16, 4, 512, 2048)])
def test_fp8_grouped_linear_matches_reference_per_group(tokens, groups, r, k):
    """The grouped form (V4's ``wo_a``: 8 groups of ``[1024, 4096]``): group ``g`` of the output is the reference
    product of group ``g``'s activations and weight rows; same tolerance as above."""
    dev, block = gpu_device(), (128, 128)
    rng = np.random.default_rng(tokens + groups + r + k)
    codes, scale = _weight(rng, groups * r, k, block)
    x = rng.standard_normal((tokens, groups, k)).astype(np.float32).astype(ml_dtypes.bfloat16)
    cfg = config_for(tokens, groups * r, k)
    got = np.asarray(fp8_grouped_linear_sm90(*(jax.device_put(jnp.asarray(a), dev) for a in (x, codes, scale)),
                                             config=cfg, block=block))
    assert got.shape == (tokens, groups, r)
    cpu = jax.devices("cpu")[0]
    sb = r // block[0]
    for g in range(groups):
        args = [jax.device_put(jnp.asarray(a), cpu)
                for a in (x[:, g], codes[g * r:(g + 1) * r], scale[g * sb:(g + 1) * sb])]
        want = np.asarray(jax.jit(ref.fp8_linear, static_argnums=3)(*args, block))
        err = np.abs(got[:, g] - want) / np.abs(want).max()
        assert err.max() < 1e-4 and err.mean() < 1e-5, (g, err.max(), err.mean())


def test_reused_kernel_lowering_gives_the_same_bits():
    """The kernel embedded from its exported module (``pallas_kernels/lowering_reuse.py``, a second program reusing
    the first's lowering) computes the same bits as the kernel lowered with its program."""
    from pallas_kernels import lowering_reuse
    from pallas_kernels.lowering_reuse import kernel_call, reuse_kernel_lowerings

    dev = gpu_device()
    tokens, n, k, block = 64, 1280, 5120, (32, 32)
    rng = np.random.default_rng(7)
    codes, scale = _weight(rng, n, k, block)
    x = rng.standard_normal((tokens, k)).astype(np.float32).astype(ml_dtypes.bfloat16)
    args = [jax.device_put(jnp.asarray(a), dev) for a in (x, codes, scale)]
    cfg = config_for(tokens, n, k)

    def program(variant: int):   # programs that differ besides the kernel, as the engine's buckets do
        return jax.jit(lambda *a: (kernel_call(fp8_linear_sm90, *a, config=cfg, block=block), jnp.int32(variant)))

    direct = np.asarray(program(0)(*args)[0])
    lowering_reuse._exported.cache_clear()
    with reuse_kernel_lowerings("cuda"):
        first = np.asarray(program(1)(*args)[0])
        second = np.asarray(program(2)(*args)[0])
    assert lowering_reuse._exported.cache_info()[:2] == (1, 1)   # (hits, misses): the second program reused it
    np.testing.assert_array_equal(first, direct)
    np.testing.assert_array_equal(second, direct)
