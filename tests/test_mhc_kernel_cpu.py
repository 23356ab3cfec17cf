"""mHC Sinkhorn projection (``pallas_kernels.mhc``) on CPU: the ``jnp`` reference and the kernel's plane arithmetic
against an independent float64 NumPy computation of the contract, the wrapper's checks, the Mosaic GPU lowering
for CUDA, and (jax ≥ 0.11) the whole kernel in Pallas's Mosaic GPU interpreter. Whether the compiled kernel
computes the same on the device is tests/test_mhc_kernel_gpu.py (marked ``gpu``).

Tolerance. Every entry lies in [0, 1]. Each softmax, row and column normalisation rounds each entry with a relative
error of a few fp32 ulps (a sum of four terms: three roundings; a division: one), and the alternating normalisation
is contractive, so errors from early rounds are damped rather than accumulated: measured against float64, the
largest error is 2.3e-7 (≈ 2 ulps at 1.0) and the mean 2e-8 over 4096 random matrices at logit scales 1–30.
Allowed: max ≤ 2^-20 (8 ulps at 1.0) and mean ≤ 1e-7. A wrong round order, a missing eps or a transposed
normalisation moves entries by > 1e-3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mhc.reference import sinkhorn_ref
from pallas_kernels.mhc.sinkhorn_sm90 import check_shapes, sinkhorn_planes, sinkhorn_projection

ITERS, EPS = 20, 1e-6
MAX_ERR, MEAN_ERR = 2.0 ** -20, 1e-7


def exact_sinkhorn(logits, iters: int, eps: float) -> np.ndarray:
    """The contract in float64 NumPy."""
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    c = e / e.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return c


def _logits(shape, scale: float, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


def _assert_close(got, want) -> None:
    err = np.abs(np.asarray(got, np.float64) - want)
    assert err.max() <= MAX_ERR and err.mean() <= MEAN_ERR, (err.max(), err.mean())


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_reference_and_planes_match_the_contract(scale):
    x = _logits((2048, 4, 4), scale)
    want = exact_sinkhorn(x, ITERS, EPS)
    _assert_close(jax.jit(lambda x: sinkhorn_ref(x, ITERS, EPS))(x), want)
    _assert_close(jax.jit(lambda x: sinkhorn_ref(x, ITERS, EPS, unroll=False))(x), want)
    planes = [[x[:, j, k] for k in range(4)] for j in range(4)]
    out = jax.jit(lambda p: sinkhorn_planes(p, ITERS, EPS))(planes)
    _assert_close(np.stack([np.stack(row, -1) for row in out], -2), want)
    # doubly stochastic up to eps: the last step normalised the columns
    assert np.abs(want.sum(-2) - 1).max() < 1e-5


def test_wrong_inputs_are_refused():
    with pytest.raises(ValueError, match=r"\[..., n, n\]"):
        check_shapes(jnp.zeros((3, 4, 5)), 128)
    with pytest.raises(ValueError, match="float32"):
        check_shapes(jnp.zeros((3, 4, 4), jnp.bfloat16), 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        check_shapes(jnp.zeros((3, 4, 4)), 100)


@pytest.mark.parametrize("shape,block", [((64, 1, 4, 4), 128), ((8192, 4, 4), 256), ((5, 4, 4), 128),
                                         ((3, 2, 2), 128)])
def test_kernel_lowers_for_cuda(shape, block):
    """The Pallas → Mosaic GPU lowering runs for CUDA on this CPU-only machine (PTX compilation does not)."""
    traced = jax.jit(lambda x: sinkhorn_projection(x, ITERS, EPS, block=block)).trace(
        jax.ShapeDtypeStruct(shape, jnp.float32))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_kernel_is_lowered_once_per_shape_not_per_site():
    """Many mHC sites of one shape share one lowered kernel (the GPU compiles each lowered kernel, seconds each):
    five calls on two distinct shapes lower two Mosaic GPU custom calls, and the kernel body holds the rounds as one
    loop, not ``iters − 1`` unrolled copies (its size does not grow with ``iters``)."""
    def program(iters: int):
        def sites(x):
            a = sinkhorn_projection(x, iters, EPS)
            b = sinkhorn_projection(a * 2.0, iters, EPS)
            c = sinkhorn_projection(b + 1.0, iters, EPS)
            d = sinkhorn_projection(x[:8], iters, EPS)
            return c, sinkhorn_projection(d - 1.0, iters, EPS)
        return jax.jit(sites).trace(jax.ShapeDtypeStruct((300, 4, 4), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()

    text = program(ITERS)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2
    assert abs(len(program(40)) - len(text)) < 0.01 * len(text)


@pytest.mark.parametrize("shape,block,scale", [((3, 70, 4, 4), 128, 3.0), ((300, 4, 4), 256, 30.0),
                                               ((1, 4, 4), 128, 0.1)])
def test_kernel_in_mosaic_gpu_interpreter(shape, block, scale):
    """The whole kernel (copies, plane loads and stores, padding of N to the block, leading axes restored) in the
    Mosaic GPU interpreter against the contract."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not hasattr(plgpu, "force_gpu_interpret_mode"):
        pytest.skip(f"jax {jax.__version__}: no Mosaic GPU interpreter (plgpu.force_gpu_interpret_mode, jax >= 0.11)")
    x = _logits(shape, scale, seed=1)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = np.asarray(jax.jit(lambda x: sinkhorn_projection(x, ITERS, EPS, block=block))(x))
    assert got.shape == shape
    _assert_close(got, exact_sinkhorn(x, ITERS, EPS))


def test_model_step_routes_mhc_impl_to_the_sinkhorn():
    """``model_step(mhc_impl=...)`` reaches every mHC site's Sinkhorn: "pallas" is refused on this CPU by the
    Sinkhorn itself, an unknown name is refused, and "jnp" (the default) traces."""
    import functools

    from dinfer_jax.engine.model_step import model_step
    from dinfer_jax.models import load_config
    from dinfer_jax.models.layer_plan import stack_params
    from dinfer_jax.models.params import abstract_params
    from dinfer_jax.models.step_state import CacheConfig, StepInput, cache_shapes

    cfg = load_config("tiny-v4")
    params = jax.eval_shape(functools.partial(stack_params, cfg),
                            abstract_params(cfg, "float32", include_mtp=False, weights="dense"))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    inp = StepInput(tokens=i32(2, 1), start=i32(2), n=i32(2), slot=i32(2), pages=i32(2, 2), last=i32(2))
    cache = cache_shapes(cfg, CacheConfig(num_slots=3, num_blocks=5, block_size=16), "float32")

    def trace(impl: str):
        return jax.jit(functools.partial(model_step, cfg=cfg, dtype="float32", mhc_impl=impl)).trace(
            params, cache, inp)

    with pytest.raises(ValueError, match="mhc_impl='pallas' needs a GPU"):
        trace("pallas")
    with pytest.raises(ValueError, match="mhc_impl must be one of"):
        trace("triton")
    trace("jnp")


def test_llm_refuses_an_mhc_impl_that_cannot_run_here():
    import dataclasses

    from dinfer_jax import LLM
    from dinfer_jax.models import load_config, random_model

    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)
    with pytest.raises(ValueError, match="mhc_impl='pallas' .* needs a GPU"):
        LLM(dataclasses.replace(model, mhc_impl="pallas"), warmup=False, progress=False)
    with pytest.raises(ValueError, match="mhc_impl must be one of"):
        LLM(dataclasses.replace(model, mhc_impl="cuda"), warmup=False, progress=False)


def test_auto_is_the_kernel_only_on_a_gpu():
    from dinfer_jax.models.mhc import resolve_mhc_impl

    assert jax.default_backend() == "cpu"
    assert resolve_mhc_impl("auto") == "jnp"
    assert resolve_mhc_impl("pallas") == "pallas" and resolve_mhc_impl("jnp") == "jnp"
    with pytest.raises(ValueError, match="mhc_impl must be one of"):
        resolve_mhc_impl("xla")
