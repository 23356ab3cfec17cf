"""How should a decode step run its fp32 projections? (issue 9: ~0.29 ms of a V4-Flash slice's batch-64 step)

The H100 kernel map of the seventh session of 2026-12-07 (``docs/perf/serving_h200.md``) found, besides cuBLAS's
FFMA fp32 GEMMs (0.21 ms a step), per-step layout work on the fp32 weights: XLA merges the split-K einsums of
:func:`dinfer_jax.models.ops.linear_f32` that share an input (the compressor's ``wkv`` / ``wgate``, the indexer
compressor's, the index head's ``weights_proj``: 1024 + 1024 + 256 + 256 + 64 = 2624 outputs) into one dot and
concatenates their weights into ``f32[16, 256, 2624]`` on every step (28 µs), and transposes others (11 µs each).
This probe times, at one layer's real shapes and batch 64, ways of computing the same fp32 products:

* ``model``: ``linear_f32`` on each ``[N, K]`` weight, as the model does now (split-K on a GPU);
* ``plain``: ``linear_f32(split_k=False)`` on each weight (one fp32 GEMM each);
* ``laid``: each weight stored at load as ``[K / 256, 256, N]`` and the split-K einsum reading it as is;
* ``laid-concat``: the five weights stored as one ``[K / 256, 256, 2624]`` (one einsum, outputs sliced);
* ``plain-concat``: one ``[K, 2624]`` weight, one fp32 GEMM.

Each variant runs over ``--layers`` distinct copies of the weights (so none is in L2 when read) and is timed by
CUPTI (``bench_kernels.device_times``); printed: µs per layer, GB/s of the weight bytes and % of the copy ceiling
measured in the same run, the kernels, and each variant's max difference from ``model`` and from a float64 product
relative to the output's scale (all are fp32 products with fp32 sums; only the summation order may differ).

    JAX_PLATFORMS=cuda,cpu python3 scripts/probe_linear_f32.py [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dinfer_jax.models.ops import SPLIT_K_CHUNK, linear_f32  # noqa: E402

HI = jax.lax.Precision.HIGHEST
K = 4096
NS = (1024, 1024, 256, 256, 64)   # V4-Flash ratio-4 layer: compressor wkv, wgate; indexer's wkv, wgate; weights_proj


def _laid(w: jax.Array) -> jax.Array:
    """``[N, K]`` → ``[K / c, c, N]`` (the split-K einsum's operand order; done once, at load)."""
    n, k = w.shape
    return w.T.reshape(k // SPLIT_K_CHUNK, SPLIT_K_CHUNK, n)


def _split_einsum(x: jax.Array, w_laid: jax.Array) -> jax.Array:
    p, c, n = w_laid.shape
    part = jnp.einsum("rpc,pcn->prn", x.reshape(x.shape[0], p, c), w_laid, precision=HI)
    return jnp.sum(part, axis=0)


VARIANTS = {
    "model": (lambda ws: ws, lambda x, ws: [linear_f32(x, w) for w in ws]),
    "plain": (lambda ws: ws, lambda x, ws: [linear_f32(x, w, split_k=False) for w in ws]),
    "laid": (lambda ws: [_laid(w) for w in ws], lambda x, ws: [_split_einsum(x, w) for w in ws]),
    "laid-concat": (lambda ws: _laid(jnp.concatenate(ws)),
                    lambda x, w: jnp.split(_split_einsum(x, w), np.cumsum(NS)[:-1], axis=-1)),
    "plain-concat": (lambda ws: jnp.concatenate(ws).T,
                     lambda x, w: jnp.split(jnp.dot(x, w, precision=HI), np.cumsum(NS)[:-1], axis=-1)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="distinct weight copies (one layer's each)")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    from bench_kernels import ceilings, device_times

    ceil = ceilings()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; copy {ceil['copy_GBps']:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    layers = [[jnp.asarray(rng.standard_normal((n, K), np.float32) / 64) for n in NS] for _ in range(args.layers)]
    x = jnp.asarray(rng.standard_normal((args.batch, K), np.float32))
    wbytes = sum(n * K * 4 for n in NS)
    exact = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for w in layers[0]]
    scale = max(float(np.abs(e).max()) for e in exact)
    base = None
    print("| variant | us / layer | GB/s (% copy) | max err vs float64 | max diff vs model | kernels (us / layer) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (prepare, run) in VARIANTS.items():
        stored = [prepare(ws) for ws in layers]

        def step(x, stored, run=run):
            return [run(x, s) for s in stored]

        f = jax.jit(step)
        out = [np.asarray(o) for o in f(x, stored)[0]]
        base = out if base is None else base
        err = max(float(np.abs(o - e).max()) for o, e in zip(out, exact, strict=True)) / scale
        diff = max(float(np.abs(o - b).max()) for o, b in zip(out, base, strict=True)) / scale
        ms, kernels = device_times(f, x, stored)
        us = 1e3 * ms / args.layers
        gbps = wbytes / (us * 1e-6) / 1e9
        top = ", ".join(f"{k[:40]} {1e3 * v / args.layers:.1f}"
                        for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
        print(f"| {name} | {us:.1f} | {gbps:.0f} ({100 * gbps / ceil['copy_GBps']:.0f}%) | {err:.1e} | {diff:.1e} "
              f"| {top} |", flush=True)


if __name__ == "__main__":
    main()
