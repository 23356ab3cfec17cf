#!/usr/bin/env python
"""Does a ``lax.cond`` in a jitted program block the host thread that dispatches it (GPU)?

XLA's GPU runtime runs a conditional whose branches it cannot record into a command buffer by copying the predicate
to the host and waiting for it; the dispatching thread then blocks until the device reaches the conditional, which
turns asynchronous dispatch into synchronous execution. This probe times the dispatch (the call's return) against
completion for: ~7 ms of matmuls alone, followed by a cond with cheap branches, and by a cond with a sort in a
branch; then the engine's sampler (``dinfer_jax.sampling.sample``, 64 x 129,280 logits) in its three host-decided
variants, whose random draw keeps one data-dependent ``lax.cond`` (exact scan for uncertified rows).

    python scripts/probe_cond_sync.py        # on the GPU; XLA_FLAGS to try command-buffer settings
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _work(x: jax.Array) -> jax.Array:
    for _ in range(40):
        x = jnp.tanh(x @ x) * 0.5
    return x


def plain(x: jax.Array, flag: jax.Array):
    y = _work(x)
    return y, jnp.where(flag[0] > 0, y.sum(), -y.sum())


def cheap_cond(x: jax.Array, flag: jax.Array):
    y = _work(x)
    return y, lax.cond(flag[0] > 0, lambda v: v.sum(), lambda v: -v.sum(), y)


def sort_cond(x: jax.Array, flag: jax.Array):
    y = _work(x)
    keep = lax.cond(jnp.any(flag > 0), lambda v: jnp.sort(v, axis=-1) > 0, lambda v: jnp.ones(v.shape, bool), y)
    return y, jnp.where(keep, y, 0).sum()


def time_dispatch(fn, *args) -> tuple[float, float]:
    """(ms until the call returned, ms until its result was ready) after two warm calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0)


def main() -> None:
    flags = os.environ.get("XLA_FLAGS", "(default flags)")
    x = jnp.ones((4096, 4096), jnp.bfloat16) * 0.01
    flag = jnp.ones((4,), jnp.int32)
    for name, f in (("plain", plain), ("cheap cond", cheap_cond), ("sort in cond", sort_cond)):
        d, t = time_dispatch(jax.jit(f), x, flag)
        print(f"{flags[:50]:50s} {name:28s} dispatch {d:7.2f} ms  done {t:7.2f} ms", flush=True)

    from dinfer_jax.sampling import SamplingParams, SamplingTensors, sample

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((64, 129280)), jnp.float32)
    heavy = jax.jit(lambda z: _work(z)[:64, :1].astype(jnp.float32) * 0 + logits)  # ~7 ms of device work first
    cases = {"all greedy": SamplingParams(temperature=0.0),
             "draw, no filters": SamplingParams(temperature=1.0),
             "draw, top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9)}
    for name, sp in cases.items():
        st = SamplingTensors.from_params([sp] * 64, list(range(64)), [100] * 64)

        def step(z, st=st):
            return sample(heavy(z), st)[0]

        d, t = time_dispatch(step, x)
        print(f"{flags[:50]:50s} sampler: {name:19s} dispatch {d:7.2f} ms  done {t:7.2f} ms "
              f"(use_filters={st.use_filters}, all_greedy={st.all_greedy})", flush=True)


if __name__ == "__main__":
    main()
