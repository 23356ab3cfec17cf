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


def test_engine_sampler_program_takes_its_fallbacks_in_command_buffers() -> None:
    """The engine's sampler program compiles with ``GPU_SAMPLER_OPTIONS`` (its conditionals recorded into command
    buffers, XLA's sorts instead of cub's) so that it does not block the host. Both of its data-dependent branches
    must still give the same results: (1) the exact draw for rows the fast search cannot certify (crafted rows whose
    reference token is known in closed form, mixed with ordinary rows; expected tokens from the CPU's exact
    emulation, which test_sampling.py checks against DeepInfer's reference); (2) the full vocabulary sorts when
    top-p cannot be cut within the candidates (flat logits, top-p 0.9), the candidates' path (top-k 50) and no
    filters: tokens and log-probs bit-equal to the same program compiled with XLA's defaults on the same GPU."""
    from dinfer_jax.engine.runner import GPU_SAMPLER_OPTIONS, _device_sample, step_programs
    from dinfer_jax.sampling._fastcdf import certified_search
    from dinfer_jax.sampling.random import seeds_to_u64, uniform_u53
    from helpers import uncertifiable_rows

    gpu, cpu = _accelerator(), jax.devices("cpu")[0]
    rng = np.random.default_rng(5)
    crafted, c_seeds, c_pos, n_tiny = uncertifiable_rows(rng, 6)
    ordinary = _probs(rng, 26, crafted.shape[1])
    probs = np.concatenate([crafted, ordinary])
    seeds = np.concatenate([c_seeds, rng.integers(0, 2**64, size=26, dtype=np.uint64)])
    pos = np.concatenate([c_pos, rng.integers(0, 2**31, size=26).astype(np.int32)])
    with jax.default_device(cpu):
        expect = np.asarray(random_sampling(probs, seeds, pos, method="exact"))
    assert (expect[:6] == 3 + n_tiny).all()
    options = dict(GPU_SAMPLER_OPTIONS)
    with jax.default_device(gpu):
        k = uniform_u53(seeds_to_u64(seeds), jnp.asarray(pos), 0)
        _, cert = jax.jit(certified_search)(jax.lax.bitcast_convert_type(jnp.asarray(probs), jnp.uint32), k)
        assert not np.asarray(cert)[:6].any()  # the exact branch is taken
        draw = jax.jit(lambda p: random_sampling(p, seeds, pos), compiler_options=options)
        np.testing.assert_array_equal(np.asarray(draw(jax.device_put(probs, gpu))), expect)

        n, v = 64, 129280
        logits = jax.device_put((rng.standard_normal((n, v)) * 0.5).astype(np.float32), gpu)
        engine = step_programs((), "gpu").sample
        plain = jax.jit(_device_sample, static_argnames=("max_rows", "batch_invariant"))
        mask = jnp.full((n, (v + 31) // 32), -1, jnp.int32)
        cases = {"top-p 0.9 (full sorts)": SamplingParams(temperature=1.0, top_p=0.9, logprobs=3),
                 "top-k 50": SamplingParams(temperature=0.7, top_k=50, logprobs=3),
                 "no filters": SamplingParams(temperature=1.0, logprobs=3)}
        for name, sp in cases.items():
            st = SamplingTensors.from_params([sp] * n, list(range(n)), [7] * n, num_top_logprobs=3)
            got = engine(logits, st, mask, max_rows=n, batch_invariant=0)
            ref = plain(logits, st, mask, max_rows=n, batch_invariant=0)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
