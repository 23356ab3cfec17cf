"""Sampling on an accelerator: same tokens as on the CPU backend (whose tokens ``test_sampling.py`` checks against
DeepInfer's references), plus timings. Marked ``gpu`` (excluded from CI); run with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu -s tests/test_sampling_gpu.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.sampling import SamplingParams, SamplingTensors, process_logits, random_sampling, sample

pytestmark = pytest.mark.gpu


def _accelerator():
    try:
        devs = [d for d in jax.devices() if d.platform != "cpu"]
    except RuntimeError:
        devs = []
    if not devs:
        pytest.skip("no accelerator backend")
    return devs[0]


def _probs(rng: np.random.Generator, n: int, v: int) -> np.ndarray:
    x = rng.standard_normal((n, v)).astype(np.float32) * rng.choice([1.0, 3.0, 8.0], size=(n, 1)).astype(np.float32)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[::7] = 0
    p[::7, rng.integers(v)] = 1.0
    return p.astype(np.float32)


def _time(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) / reps


def test_random_sampling_gpu_equals_cpu() -> None:
    gpu, cpu = _accelerator(), jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    n, v = 256, 129280
    probs = _probs(rng, n, v)
    seeds = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    pos = rng.integers(0, 2**31, size=n).astype(np.int32)
    with jax.default_device(cpu):
        expect = np.asarray(random_sampling(probs, seeds, pos))
    with jax.default_device(gpu):
        p = jax.device_put(probs, gpu)
        got = np.asarray(random_sampling(p, seeds, pos))
        np.testing.assert_array_equal(got, expect)
        t_auto = _time(lambda q: random_sampling(q, seeds, pos), p)
        print(f"\nrandom_sampling auto  [{n}x{v}] on {gpu.device_kind}: {t_auto * 1e3:.2f} ms")
        for block in (1, 8):
            got = np.asarray(random_sampling(p, seeds, pos, method="exact", block=block))
            np.testing.assert_array_equal(got, expect)
            t = _time(lambda q, b=block: random_sampling(q, seeds, pos, method="exact", block=b), p, reps=1)
            print(f"random_sampling exact [{n}x{v}] block={block}: {t * 1e3:.1f} ms")


def test_sample_gpu_matches_cpu() -> None:
    gpu, cpu = _accelerator(), jax.devices("cpu")[0]
    rng = np.random.default_rng(1)
    n, v = 256, 129280
    x = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=float(rng.uniform(0.2, 1.5)), top_p=float(rng.choice([1.0, 0.9, 0.5])),
                             top_k=int(rng.choice([-1, 40, 1000])), min_p=float(rng.choice([0.0, 0.01])),
                             logprobs=5) for _ in range(n)]
    params[:16] = [SamplingParams(temperature=0.0, logprobs=5)] * 16
    seeds = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    pos = rng.integers(0, 2**31, size=n).astype(np.int32)
    with jax.default_device(cpu):
        st_c = SamplingTensors.from_params(params, seeds, pos)
        lp_c = np.asarray(jax.jit(process_logits)(jnp.asarray(x), st_c))
    with jax.default_device(gpu):
        st = SamplingTensors.from_params(params, seeds, pos)
        xg = jax.device_put(x, gpu)
        tokens, info = sample(xg, st)
        lp_g = np.asarray(jax.jit(process_logits)(xg, st))
        # fp32 softmax/exp/log differ between backends by ulps: compare the surviving sets and values loosely
        same = np.isfinite(lp_g) == np.isfinite(lp_c)
        assert same.all(axis=1).mean() > 0.98
        both = np.isfinite(lp_g) & np.isfinite(lp_c)
        np.testing.assert_allclose(lp_g[both], lp_c[both], atol=1e-4, rtol=1e-5)
        # sampling itself is exact: GPU tokens are the CPU sampler applied to the GPU's probabilities
        with jax.default_device(cpu):
            expect = np.array(random_sampling(np.exp(lp_g), seeds, pos))
        expect[:16] = np.argmax(x[:16], axis=1)
        np.testing.assert_array_equal(np.asarray(tokens), expect)
        t = _time(lambda q: sample(q, st), xg)
        print(f"\nsample (filters, top-5 logprobs) [{n}x{v}] on {gpu.device_kind}: {t * 1e3:.2f} ms")
        st_nf = SamplingTensors.from_params([SamplingParams(temperature=0.8)] * n, seeds, pos)
        t = _time(lambda q: sample(q, st_nf), xg)
        print(f"sample (no filters) [{n}x{v}]: {t * 1e3:.2f} ms")
