#!/usr/bin/env python
"""Does a ``lax.cond`` in a jitted program block the host thread that dispatches it (GPU)?

XLA's GPU runtime runs a conditional whose branches it cannot record into a command buffer by copying the predicate
to the host and waiting for it; the dispatching thread then blocks until the device reaches the conditional, which
turns asynchronous dispatch into synchronous execution. This probe times the dispatch (the call's return) against
completion for: ~7 ms of matmuls alone, followed by a cond with cheap branches, and by a cond with a sort in a
branch; by a cond whose taken branch holds a 1,000-step loop; then the engine's sampler (``dinfer_jax.sampling.sample``,
64 x 129,280 logits) in its host-decided variants, whose random draw keeps one data-dependent ``lax.cond``
(exact scan for uncertified rows).

    python scripts/probe_cond_sync.py                 # on the GPU; XLA_FLAGS to try command-buffer settings
    python scripts/probe_cond_sync.py --option-sets   # the sampler with per-program compile options
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


def scan_cond(x: jax.Array, flag: jax.Array):
    y = _work(x)

    def scan_branch(v):
        return lax.fori_loop(0, 1000, lambda i, a: a * 0.999 + v[i % 64], v[0])

    row = lax.cond(jnp.all(flag > 5), lambda v: v[0], scan_branch, y)
    return y, row.sum()


def time_dispatch(fn, *args, reps: int = 1) -> tuple[float, float]:
    """(ms until the call returned, ms until its result was ready), the medians of ``reps`` calls each started with
    the device idle, after two warm calls: a return long before completion is asynchronous dispatch, one close to it
    means the program blocked the host."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ret, done = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(*args)
        ret.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        done.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ret)), 1e3 * float(np.median(done))


def main() -> None:
    flags = os.environ.get("XLA_FLAGS", "(default flags)")
    x = jnp.ones((4096, 4096), jnp.bfloat16) * 0.01
    flag = jnp.ones((4,), jnp.int32)
    for name, f in (("plain", plain), ("cheap cond", cheap_cond), ("sort in cond", sort_cond),
                    ("loop in cond (taken)", scan_cond)):
        d, t = time_dispatch(jax.jit(f), x, flag)
        print(f"{flags[:50]:50s} {name:28s} dispatch {d:7.2f} ms  done {t:7.2f} ms", flush=True)

    sampler_cases(x, {})


# XLA's default command-buffer kinds with conditionals and loops added (per-program options take enum names, not
# the flag's "+KIND" form)
_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
SAMPLER_OPTION_SETS = {
    "defaults": {},
    "XLA sort (no cub)": {"xla_gpu_enable_cub_radix_sort": False},
    "command buffers + CONDITIONAL, WHILE": {"xla_gpu_enable_command_buffer": _COMMAND_BUFFERS},
    "same + XLA sort (no cub)": {"xla_gpu_enable_command_buffer": _COMMAND_BUFFERS,
                                 "xla_gpu_enable_cub_radix_sort": False},
}


def sampler_cases(x: jax.Array, options: dict, label: str = "", reference: dict | None = None) -> dict:
    """The engine's sampler after ~7 ms of device work, each host-decided variant compiled with XLA ``options``
    (per program, as the engine passes them); tokens compared with ``reference``'s (same inputs). Returns the
    tokens per case."""
    from dinfer_jax.sampling import SamplingParams, SamplingTensors, sample

    rng = np.random.default_rng(0)
    flat = jnp.asarray(rng.standard_normal((64, 129280)), jnp.float32)
    # Zipf-like rows (p ~ rank^-1.5, ranks shuffled per row): top-p 0.9 is decided by the 1,024 candidates
    ranks = np.argsort(rng.random((64, 129280)), axis=1) + 1
    zipf = jnp.asarray(-1.5 * np.log(ranks), jnp.float32)
    flags = label or os.environ.get("XLA_FLAGS", "(default flags)")
    cases = {"all greedy": (SamplingParams(temperature=0.0), flat),
             "draw, no filters": (SamplingParams(temperature=1.0), flat),
             "draw, top-k 50": (SamplingParams(temperature=1.0, top_k=50), flat),
             "draw, top-p 0.9 (zipf)": (SamplingParams(temperature=1.0, top_p=0.9), zipf),
             "draw, top-p 0.9 (flat: full sorts)": (SamplingParams(temperature=1.0, top_p=0.9), flat)}
    # the engine's draw variant has use_filters=True whenever some row samples (runner.SAMPLER_VARIANTS): rows
    # without filters then skip the sorts under a conditional on the device
    cases["draw, no filters, engine's variant (use_filters=True)"] = (SamplingParams(temperature=1.0), flat)
    out = {}
    for name, (sp, logits) in cases.items():
        st = SamplingTensors.from_params([sp] * 64, list(range(64)), [100] * 64,
                                         use_filters=True if "engine's variant" in name else None)
        heavy = jax.jit(lambda z, lg=logits: _work(z)[:64, :1].astype(jnp.float32) * 0 + lg)

        def step(z, st=st, heavy=heavy):
            return sample(heavy(z), st)[0]

        d, t = time_dispatch(jax.jit(step, compiler_options=options or None), x)
        out[name] = np.asarray(jax.jit(step, compiler_options=options or None)(x))
        equal = reference is not None and np.array_equal(out[name], reference[name])
        same = "" if reference is None else f" tokens {'equal' if equal else 'DIFFER'}"
        print(f"{flags[:50]:50s} sampler: {name:52s} dispatch {d:7.2f} ms  done {t:7.2f} ms{same}", flush=True)
    return out


def option_sets() -> None:
    """The sampler under each of :data:`SAMPLER_OPTION_SETS`, passed as per-program compile options."""
    x = jnp.ones((4096, 4096), jnp.bfloat16) * 0.01
    reference = None
    for label, options in SAMPLER_OPTION_SETS.items():
        try:
            toks = sampler_cases(x, options, label, reference)
        except Exception as e:  # an option XLA does not accept per program: report it and go on
            print(f"{label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        reference = reference or toks


if __name__ == "__main__":
    option_sets() if "--option-sets" in sys.argv else main()
