"""The MoE implementation switch: "auto" runs the GPU kernel only where it can, and the kernel's contract
(``pallas_kernels.moe.reference``) is the model's routed-expert function on native MXFP4 weights."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dinfer_jax.models import load_config
from dinfer_jax.models.moe import _experts_ragged, moe, pallas_supported
from dinfer_jax.models.qweights import QuantizedWeight
from pallas_kernels.moe import reference


def _fp4(rng, g, out, inn):
    data = rng.integers(0, 256, (g, out, inn // 2), dtype=np.uint8)
    scale = rng.integers(118, 124, (g, out, inn // 32), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return QuantizedWeight(jnp.asarray(data), jnp.asarray(scale), "fp4", (1, 32))


def _experts(rng, g=8, d=128, i=64):
    return {"w1": _fp4(rng, g, i, d), "w3": _fp4(rng, g, i, d), "w2": _fp4(rng, g, d, i)}


def test_kernel_contract_equals_model_ragged_path_fp32():
    """Same routed-expert function: the model applies the router weight before the down projection, the kernel's
    contract after it; in fp32 they agree to rounding (≤ 1e-6 of the output scale over these sizes)."""
    rng = np.random.default_rng(0)
    cfg = load_config("tiny-v4")
    ex = _experts(rng)
    n, k = 11, 2
    x = jnp.asarray(rng.standard_normal((n, 128)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(8, k, replace=False) for _ in range(n)]), jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    got = np.asarray(_experts_ragged(ex, x, idx, w, cfg=cfg))
    adapt = [reference.ExpertWeight(ex[m].data, ex[m].scale, "fp4") for m in ("w1", "w3", "w2")]
    want = np.asarray(reference.experts(x, idx, w, *adapt, swiglu_limit=cfg.swiglu_limit))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-6


def test_auto_is_ragged_on_cpu_and_pallas_refuses_clearly():
    rng = np.random.default_rng(1)
    cfg = load_config("tiny-v4")
    D, E = cfg.hidden_size, cfg.n_routed_experts
    p = {"gate": {"weight": jnp.asarray(rng.standard_normal((E, D)) * 0.1, jnp.float32),
                  "bias": jnp.zeros((E,), jnp.float32)},
         "experts": _experts(rng, E, D, cfg.moe_inter_dim)}
    x = jnp.asarray(rng.standard_normal((1, 5, D)), jnp.bfloat16)
    assert pallas_supported(p["experts"], x.dtype) is not None          # CPU backend
    y_auto, _ = moe(p, x, None, cfg=cfg, hash_routed=False, impl="auto")
    y_ragged, _ = moe(p, x, None, cfg=cfg, hash_routed=False, impl="ragged")
    np.testing.assert_array_equal(np.asarray(y_auto, np.float32), np.asarray(y_ragged, np.float32))
    with pytest.raises(ValueError, match="needs a GPU"):
        moe(p, x, None, cfg=cfg, hash_routed=False, impl="pallas")
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        moe(p, x, None, cfg=cfg, hash_routed=False, impl="cuda")
