"""The sampler's top-p / top-k filters: two stable sorts of the whole vocabulary against the filters decided from
the 1,024 most likely tokens (``sampler.top_p_top_k_mask(..., candidates=C)``, falling back to the sorts under a
``lax.cond`` when a row's cut lies beyond them), same processed log-probs required.

``python scripts/bench_kernels.py sampler [--out DIR]`` on the GPU (CUPTI device times, medians of 10, plus wall
times of the jitted call, which include the conditional's predicate read by the host); ``python
scripts/bench_sampler.py --smoke`` on any backend (wall times of small sizes: a check that the script runs, not a
measurement).

What is timed: ``sampler.processed_logprobs`` (temperature, top-p, top-k, log-softmax) on ``[N, V]`` fp32 logits,
V = 129,280 (the V4 / V4.1 vocabulary), at batch 1, 64 and 256, for the filters a serving request sets (top-k 50;
top-p 0.95; both; none) and two logit distributions:

* ``zipf``: logits of a Zipf law, ``p(rank r) ∝ r^-1.5``, over a random permutation of the vocabulary (a trained
  model's next-token distribution is close to Zipfian; 2.4% of the mass lies beyond rank 1,024), so top-p 0.95's cut
  falls inside the candidates and the full sorts never run;
* ``flat``: standard normal logits (what a random-weight model gives): top-p 0.95 keeps ~90% of the vocabulary, the
  candidates cannot decide it and the full sorts run after the candidate pass — the fallback's cost.

``same``: rows whose processed log-probs are bit-equal between the two ways.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_topk import wall_ms  # noqa: E402  (scripts/ is on sys.path when run as a script)

from dinfer_jax.sampling.sampler import FILTER_CANDIDATES, processed_logprobs  # noqa: E402

VOCAB = 129280
# (filter label, top_p, top_k)
FILTERS = [("top-k 50", 1.0, 50), ("top-p 0.95", 0.95, -1), ("top-p 0.95 + top-k 50", 0.95, 50), ("none", 1.0, -1)]
DISTRIBUTIONS = ("zipf", "flat")
BATCHES = (1, 64, 256)
SMOKE_VOCAB = 4096


def logits(distribution: str, batch: int, vocab: int) -> jax.Array:
    """[batch, vocab] fp32 logits of ``distribution`` (module docstring), one random permutation per row."""
    key = jax.random.key(batch * 31 + vocab)
    if distribution == "flat":
        return jax.random.normal(key, (batch, vocab), jnp.float32)
    if distribution != "zipf":
        raise ValueError(f"unknown distribution {distribution!r}; known: {DISTRIBUTIONS}")
    by_rank = -1.5 * jnp.log(jnp.arange(1, vocab + 1, dtype=jnp.float32))
    perm = jax.vmap(lambda k: jax.random.permutation(k, vocab))(jax.random.split(key, batch))
    return jnp.take(by_rank, perm)


def _or_nan(timer, f, *args) -> float:
    """``timer(f, *args)``, or NaN when it fails (CUPTI's per-kernel timer refuses a program whose kernel names
    differ between iterations; seen at batch 2): the wall-time columns still stand."""
    try:
        return timer(f, *args)
    except RuntimeError as e:
        print(f"device time not measured: {e}", flush=True)
        return float("nan")


def bench_sampler(batches, vocab: int, candidates: int, timer, wall, on_row=lambda rows: None,
                  filters: list[str] | None = None) -> list[dict]:
    """Times ``processed_logprobs`` with the full sorts (``candidates=None``) and with ``candidates`` for every
    distribution × filter (labels of :data:`FILTERS`, default all) × batch; ``timer(f, *args) -> ms`` (device time
    where measured), ``wall(f, *args) -> ms``."""
    unknown = sorted(set(filters or ()) - {f[0] for f in FILTERS})
    if unknown:
        raise ValueError(f"unknown filters {unknown}; known: {[f[0] for f in FILTERS]}")
    ways = {name: jax.jit(functools.partial(processed_logprobs, candidates=c))
            for name, c in (("full", None), ("candidates", candidates))}
    rows = []
    for distribution in DISTRIBUTIONS:
        for batch in batches:
            x = logits(distribution, batch, vocab)
            temperature = jnp.ones((batch,), jnp.float32)
            for label, top_p, top_k in (f for f in FILTERS if filters is None or f[0] in filters):
                args = (x, temperature, jnp.full((batch,), top_p, jnp.float32), jnp.full((batch,), top_k, jnp.int32))
                full, cand = (np.asarray(ways[name](*args)) for name in ("full", "candidates"))
                kept = np.isfinite(full).sum(axis=-1)
                rows.append(dict(distribution=distribution, batch=batch, filters=label, vocab=vocab,
                                 kept_median=int(np.median(kept)),
                                 same=int(np.all(full.view(np.uint32) == cand.view(np.uint32), axis=-1).sum()),
                                 full_ms=_or_nan(timer, ways["full"], *args),
                                 candidates_ms=_or_nan(timer, ways["candidates"], *args),
                                 full_wall_ms=wall(ways["full"], *args),
                                 candidates_wall_ms=wall(ways["candidates"], *args)))
                on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| logits | batch | filters | tokens kept (median) | full sorts ms | candidates ms | speed-up | "
             "wall ms full / candidates | same rows |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['distribution']} | {r['batch']} | {r['filters']} | {r['kept_median']} | "
                     f"{r['full_ms']:.3f} | {r['candidates_ms']:.3f} | {r['full_ms'] / r['candidates_ms']:.2f}× | "
                     f"{r['full_wall_ms']:.3f} / {r['candidates_wall_ms']:.3f} | {r['same']} of {r['batch']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small sizes, wall times: the script runs (any backend)")
    args = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} (wall times)")
    vocab, batches = (SMOKE_VOCAB, (1, 4)) if args.smoke else (VOCAB, BATCHES)
    candidates = 64 if args.smoke else FILTER_CANDIDATES
    rows = bench_sampler(batches, vocab, candidates, wall_ms, wall_ms,
                         on_row=lambda rows: print(table(rows).splitlines()[-1], flush=True))
    print(table(rows))


if __name__ == "__main__":
    main()
