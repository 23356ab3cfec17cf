"""mHC Sinkhorn kernel (Mosaic GPU, ``pallas_kernels.mhc.sinkhorn_sm90``) against the contract on an H100/H200.
Marked ``gpu`` (excluded from CI); run with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu -q tests/test_mhc_kernel_gpu.py``.

Tolerance as in tests/test_mhc_kernel_cpu.py (max 2^-20, mean 1e-7 against float64): the device's ``exp`` and
division without ``approx_math`` are within a few ulps, like the CPU's. The kernel must also agree with the XLA
form on the same device within the same bounds, and a tiny V4 step with ``mhc_impl="pallas"`` must give the XLA
step's logits to fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import gpu_device
from pallas_kernels.mhc.reference import sinkhorn_ref
from pallas_kernels.mhc.sinkhorn_sm90 import sinkhorn_projection
from test_mhc_kernel_cpu import EPS, ITERS, _assert_close, _logits, exact_sinkhorn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape,block,scale", [((64, 1, 4, 4), 128, 3.0), ((8192, 4, 4), 256, 30.0),
                                               ((5, 4, 4), 128, 0.1), ((3, 2, 2), 128, 3.0)])
def test_kernel_matches_the_contract_on_the_device(shape, block, scale):
    dev = gpu_device()
    x = jax.device_put(_logits(shape, scale, seed=2), dev)
    got = np.asarray(jax.jit(lambda x: sinkhorn_projection(x, ITERS, EPS, block=block))(x))
    assert got.shape == shape
    _assert_close(got, exact_sinkhorn(x, ITERS, EPS))
    _assert_close(got, np.asarray(jax.jit(lambda x: sinkhorn_ref(x, ITERS, EPS))(x), np.float64))


def test_model_step_with_the_kernel_matches_xla():
    from dinfer_jax.engine.kv_cache import init_cache
    from dinfer_jax.engine.model_step import model_step
    from dinfer_jax.models import load_config, random_model
    from dinfer_jax.models.layer_plan import stack_params
    from dinfer_jax.models.step_state import CacheConfig, StepInput

    gpu_device()
    model = random_model(load_config("tiny-v4"), seed=3, include_mtp=False)
    cfg = model.config
    params = stack_params(cfg, model.params)
    rng = np.random.default_rng(0)
    toks = rng.integers(4, cfg.vocab_size, (2, 16)).astype(np.int32)
    inp = StepInput(*(jnp.asarray(a) for a in (toks, np.zeros(2, np.int32), np.full(2, 16, np.int32),
                                              np.arange(1, 3, dtype=np.int32), np.arange(1, 5, dtype=np.int32)
                                              .reshape(2, 2), np.full(2, 15, np.int32))))
    cc = CacheConfig(num_slots=3, num_blocks=5, block_size=16)
    out = {}
    for impl in ("jnp", "pallas"):
        step = jax.jit(functools.partial(model_step, cfg=cfg, dtype=model.dtype, mhc_impl=impl))
        out[impl] = np.asarray(step(params, init_cache(cfg, cc, model.dtype), inp)[0], np.float64)
    scale = np.abs(out["jnp"]).max()
    assert np.abs(out["pallas"] - out["jnp"]).max() <= 1e-5 * scale   # fp32 rounding of the sums' order only
