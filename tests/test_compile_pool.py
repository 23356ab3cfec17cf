"""The warm-up's parallel compilation (engine/compile_pool.py): every job runs, errors surface, and programs compiled
ahead of time on threads are the ones jit then runs (no second compilation)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.engine.compile_pool import compile_all, default_compile_threads


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
