"""The lightning indexer's bf16 product path for FP4 operands (``index_scores_of(..., fp4_operands=True)``).

Claim under test: Q4u queries and ``fp4_index`` keys are e2m1 codes times power-of-two scales, so they are exact in
bf16 and every ``q_i · k_i`` product is exact in fp32; the bf16-operand path (fp32 accumulation) therefore gives the
fp32 path's scores up to the order of the fp32 additions. The reference is float64 NumPy on the same decoded
values (independent of both paths), and the operands are produced by the model's own quantisers and the cache's
``fp4_index`` codec, as the engine holds them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.engine.kv_formats import decode, encode
from dinfer_jax.models import load_config
from dinfer_jax.models.attention import index_operands_fp4, index_scores_of
from dinfer_jax.models.fake_quant import q4u_fake


def _operands(seed: int, b: int, s: int, h: int, t: int, di: int, spread: float):
    """Q4u queries ``[b,s,h,di]``, ``fp4_index`` keys ``[b,t,di]`` decoded to fp32, head weights ``[b,s,h]``.
    ``spread``: log2 range of the per-block magnitudes (wide ranges exercise the power-of-two scales)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    mag_q = jnp.exp2(jax.random.uniform(ks[0], (b, s, h, di // 32, 1), minval=-spread, maxval=spread))
    mag_k = jnp.exp2(jax.random.uniform(ks[1], (b, t, di // 32, 1), minval=-spread, maxval=spread))
    q = q4u_fake((jax.random.normal(ks[2], (b, s, h, di // 32, 32)) * mag_q).reshape(b, s, h, di), 32)
    k_raw = (jax.random.normal(ks[3], (b, t, di // 32, 32)) * mag_k).reshape(b, t, di).astype(jnp.bfloat16)
    data, scales = encode(k_raw.reshape(b * t, di), "fp4_index")
    k = decode(data, scales, "fp4_index", dtype=jnp.float32).reshape(b, t, di)
    w = jax.random.normal(ks[4], (b, s, h), jnp.float32) * 0.05
    return q, k, w


def _scores64(q, k, w) -> np.ndarray:
    dots = np.einsum("bshd,btd->bsht", np.asarray(q, np.float64), np.asarray(k, np.float64))
    return np.einsum("bsht,bsh->bst", np.maximum(dots, 0.0), np.asarray(w, np.float64))


@pytest.mark.parametrize("spread", [0.0, 8.0])
@pytest.mark.parametrize("shape", [(2, 3, 8, 200, 64), (1, 1, 64, 1024, 128)])
def test_fp4_operands_are_exact_in_bf16(shape, spread):
    b, s, h, t, di = shape
    q, k, _ = _operands(1, b, s, h, t, di, spread)
    assert bool(jnp.all(q.astype(jnp.bfloat16).astype(jnp.float32) == q))
    assert bool(jnp.all(k.astype(jnp.bfloat16).astype(jnp.float32) == k))


@pytest.mark.parametrize("spread", [0.0, 8.0])
@pytest.mark.parametrize("shape", [(2, 3, 8, 200, 64), (1, 1, 64, 1024, 128), (3, 2, 16, 77, 32)])
def test_bf16_product_path_matches_float64_and_fp32_path(shape, spread):
    """Scores of both paths against float64. Tolerance: the fp32 sums of exact products, two of them (the dot over
    di, the head sum over h), each within (n − 1) · 2^−24 of the sum of |terms|; 4e-7 of the scores' scale covers
    the largest case here (di = 128, h = 64) with margin, and both paths must meet the same bound."""
    b, s, h, t, di = shape
    q, k, w = _operands(7 + di, b, s, h, t, di, spread)
    pos = jnp.full((b, s), 4 * t, jnp.int32)             # every row visible (ratio 4)
    fast = np.asarray(index_scores_of(q, w, k, pos, ratio=4, fp4_operands=True))
    slow = np.asarray(index_scores_of(q, w, k, pos, ratio=4))
    want = _scores64(q, k, w)
    scale = np.abs(want).max()
    for got in (fast, slow):
        err = np.abs(got - want)
        assert err.max() <= 4e-7 * scale, (err.max() / scale, err.mean() / scale)


def test_bf16_product_path_keeps_the_causal_mask():
    q, k, w = _operands(3, 1, 4, 8, 40, 64, 2.0)
    pos = jnp.asarray([[3, 40, 79, 159]], jnp.int32)     # ratio 4: 1, 10, 20, 40 visible rows
    got = np.asarray(index_scores_of(q, w, k, pos, ratio=4, fp4_operands=True))
    for i, n in enumerate((1, 10, 20, 40)):
        assert np.all(np.isfinite(got[0, i, :n])) and np.all(got[0, i, n:] == -np.inf)


@pytest.mark.parametrize("preset, fake_quant, expected", [
    ("deepseek-v4.1-flash", True, True),
    ("deepseek-v4.1-flash", False, False),
    ("deepseek-v4-flash", False, False),
    ("deepseek-v4-flash", True, True),
])
def test_index_operands_fp4_follows_the_fake_quantisation(preset, fake_quant, expected):
    cfg = load_config(preset).replace(kv_fake_quant=fake_quant)
    assert index_operands_fp4(cfg) is expected
    assert index_operands_fp4(cfg.replace(index_head_dim=80)) is False   # not a multiple of 32: unquantised
