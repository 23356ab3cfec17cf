"""The warm-up's parallel compilation (engine/compile_pool.py): every job runs, errors surface, and programs compiled
ahead of time on threads are the ones jit then runs (no second compilation)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.engine.compile_pool import compile_all, compiler_options_key, default_compile_threads


def test_every_job_runs_once_and_progress_counts_them():
    seen, lock, done = [], threading.Lock(), []

    def job(i):
        with lock:
            seen.append(i)

    compile_all([lambda i=i: job(i) for i in range(7)], threads=3, on_done=lambda: done.append(1))
    assert sorted(seen) == list(range(7)) and len(done) == 7


def test_first_error_is_raised_after_the_rest_finish():
    finished = []

    def bad():
        raise ValueError("bucket (4, 64, 32) does not lower")

    jobs = [lambda: finished.append(1), bad, lambda: finished.append(2)]
    with pytest.raises(ValueError, match=r"bucket \(4, 64, 32\)"):
        compile_all(jobs, threads=2)
    assert sorted(finished) == [1, 2]


def test_thread_count_validation(monkeypatch):
    with pytest.raises(ValueError, match="compile threads must be >= 1"):
        compile_all([], threads=0)
    monkeypatch.setenv("DINFER_JAX_COMPILE_THREADS", "0")
    with pytest.raises(ValueError, match="DINFER_JAX_COMPILE_THREADS"):
        default_compile_threads()
    monkeypatch.setenv("DINFER_JAX_COMPILE_THREADS", "3")
    assert default_compile_threads() == 3


def test_ahead_of_time_compiles_are_reused_by_the_jitted_calls():
    """What the warm-up relies on: after ``f.lower(x).compile()`` on a thread, calling ``f(x)`` compiles nothing
    (jax's backend-compile event does not fire) and gives the compiled program's result."""
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=-1) * 3.0)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)), jnp.float32)
    shapes = [(n, 16) for n in (1, 3, 5, 7)]
    events: list[str] = []

    def listen(name: str, secs: float, **kw) -> None:
        if name.endswith("backend_compile_duration"):
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        compile_all([lambda s=s: f.lower(jax.ShapeDtypeStruct(s, jnp.float32), w).compile() for s in shapes],
                    threads=2)
        assert len(events) == len(shapes)
        for s in shapes:
            x = np.ones(s, np.float32)
            np.testing.assert_allclose(np.asarray(f(x, w)), np.tanh(x @ np.asarray(w)).sum(-1) * 3.0, rtol=1e-5)
        assert len(events) == len(shapes), "a jitted call compiled again what the pool had compiled"
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_bad_compiler_option_is_refused_by_name():
    with pytest.raises(ValueError, match="xla_no_such_option"):
        compiler_options_key({"xla_no_such_option": 1})
    with pytest.raises(ValueError, match="names are strings"):
        compiler_options_key({"xla_gpu_autotune_level": [0]})
    assert compiler_options_key(None) == () == compiler_options_key({})
    assert compiler_options_key({"xla_gpu_autotune_level": 0, "xla_disable_hlo_passes": "fusion"}) == (
        ("xla_disable_hlo_passes", "fusion"), ("xla_gpu_autotune_level", 0))


def test_engine_compiles_its_steps_with_the_given_options():
    """``LLM(compiler_options=...)`` reaches XLA for the model step and the sampler: with HLO fusion disabled XLA:CPU
    wraps every op left unfused in a fusion of its own (``wrapped_*``): many more of them than its default
    pipeline leaves."""
    from dinfer_jax import LLM
    from dinfer_jax.engine.buckets import Buckets
    from dinfer_jax.models import random_model
    from dinfer_jax.models.config import load_config

    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)
    buckets = Buckets(decode_batch=(2,), prefill_batch=(1,), prefill_len=(16,), pages=(2,))
    texts = {}
    for name, opts in (("default", None), ("no fusion", {"xla_disable_hlo_passes": "fusion"})):
        llm = LLM(model, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, buckets=buckets, warmup=False,
                  progress=False, kv_cache_memory_bytes=8 << 20, compiler_options=opts)
        r = llm.runner
        texts[name] = (r._lower_step((2, 1, 2), True).compile().as_text(),
                       r._lower_sampler(2, False, True).compile().as_text())
    for default, unfused in zip(texts["default"], texts["no fusion"], strict=True):
        assert unfused.count("wrapped_") > 2 * default.count("wrapped_") + 10


def test_first_of_each_splits_the_warmup_into_two_waves():
    """The first wave holds one job per key, in order; the second every repeat, in order."""
    from dinfer_jax.engine.compile_pool import first_of_each

    keys = [(64, 1), (64, 1), (1, 8192), (64, 1), (1, 8192), (8, 1)]
    assert first_of_each(keys) == ([0, 2, 5], [1, 3, 4])
    assert first_of_each([]) == ([], [])


def test_staged_warmup_setting(monkeypatch):
    from dinfer_jax.engine.compile_pool import default_staged

    monkeypatch.setenv("DINFER_JAX_STAGED_WARMUP", "1")
    assert default_staged() is True
    monkeypatch.setenv("DINFER_JAX_STAGED_WARMUP", "0")
    assert default_staged() is False
    monkeypatch.setenv("DINFER_JAX_STAGED_WARMUP", "yes")
    with pytest.raises(ValueError, match="DINFER_JAX_STAGED_WARMUP must be 0 or 1"):
        default_staged()
    monkeypatch.delenv("DINFER_JAX_STAGED_WARMUP")
    assert default_staged() is (jax.default_backend() == "gpu")


def test_staged_warmup_compiles_every_bucket_once(monkeypatch):
    """A staged warm-up (forced on this CPU) compiles one program per (rows, tokens) shape and the samplers first,
    the other page-table widths second, and serving then compiles nothing."""
    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine import runner as runner_mod
    from dinfer_jax.engine.buckets import Buckets
    from dinfer_jax.models import random_model
    from dinfer_jax.models.config import load_config

    waves = []
    real = runner_mod.compile_all

    def recording(jobs, threads, on_done=None):
        waves.append(len(jobs))
        real(jobs, threads, on_done)

    monkeypatch.setattr(runner_mod, "compile_all", recording)
    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)
    buckets = Buckets(decode_batch=(2,), prefill_batch=(1,), prefill_len=(16,), pages=(1, 2))
    llm = LLM(model, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, buckets=buckets, warmup=False,
              progress=False, kv_cache_memory_bytes=8 << 20)
    llm.runner.warmup(compile_threads=2, staged=True)
    # programs [2,1] and [1,16] at 1 and 2 pages; samplers for batches 1 and 2, two variants each
    assert waves == [2 + 4, 2]
    compiled = llm.runner.num_compilations
    llm.generate([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert llm.runner.num_compilations == compiled, "compiled outside the staged warm-up"
