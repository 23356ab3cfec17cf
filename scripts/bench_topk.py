"""The indexer's top-k selection: ``lax.top_k`` against the selection through group maxima
(``group_select.group_topk_select``) and the model's choice between them (``csa2.topk_select``), same indices
required.

``python scripts/bench_kernels.py topk [--out DIR]`` on the GPU (CUPTI device times, medians of 10, copy bandwidth
measured in the same run); ``python scripts/bench_topk.py --smoke`` on any backend (wall times of small sizes: a
check that the script runs, not a measurement).

Shapes: decode steps of V4.1-Flash (top-k 512, ratio 2: context / 2 scores a row) at batch 64 and contexts 4K / 32K
/ 128K, V4-Flash (ratio 4) at 128K, V4.1-Flash at batch 1 and 128K, one prefill chunk (1,024 queries over 16,384
rows), and V4.1-Flash at batch 64 and 8K / 16K (where the two cross), for each variant of :data:`VARIANTS`. Scores
are random normal with the invisible rows of a chunk at −inf (as ``index_scores`` leaves them). ``GB/s``: the fp32
scores read once (``rows · T · 4`` B) over ``lax.top_k``'s time — the least any selection reads. ``same``: rows on
which every variant's indices and mask equal ``lax.top_k``'s. ``model rule``: ``csa2.topk_select`` as the model
calls it, whose ``topk_impl`` picks one of the two by shape and backend.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dinfer_jax.models.csa2 import topk_select  # noqa: E402
from dinfer_jax.models.group_select import group_topk_select  # noqa: E402

TOPK = 512
# (label, batch, queries per row, compressed rows T)
CASES = [("V4.1 decode, 4K", 64, 1, 2048), ("V4.1 decode, 32K", 64, 1, 16384), ("V4.1 decode, 128K", 64, 1, 65536),
         ("V4 decode, 128K", 64, 1, 32768), ("V4.1 decode, 128K", 1, 1, 65536),
         ("V4.1 prefill chunk, 1024 queries", 1, 1024, 16384), ("V4.1 decode, 8K", 64, 1, 4096),
         ("V4.1 decode, 16K", 64, 1, 8192)]
SMOKE = [("smoke decode", 2, 1, 2048), ("smoke chunk", 1, 16, 1024)]
# the group-maxima selection by entries per group (csa2 uses group_select.GROUP)
VARIANTS = {f"group {g}": functools.partial(group_topk_select, group=g) for g in (4, 8, 16)}
MODEL = "model rule"   # the column of topk_select as the model calls it (csa2.topk_impl picks sort or group)


def _scores(batch: int, queries: int, t: int) -> jax.Array:
    x = jax.random.normal(jax.random.key(batch * 7 + queries + t), (batch, queries, t), jnp.float32)
    if queries > 1:   # a chunk's causal tail: query s sees the first t − (queries − 1 − s) rows
        visible = t - (queries - 1 - jnp.arange(queries))
        x = jnp.where(jnp.arange(t)[None, None, :] < visible[None, :, None], x, -jnp.inf)
    return x


def wall_ms(f, *args, iterations: int = 5) -> float:
    """Mean wall milliseconds of ``f(*args)`` over ``iterations`` calls after one warm call."""
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(iterations):
        out = f(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / iterations


def bench_topk(cases, timer, copy_bw: float | None, on_row=lambda rows: None,
               variants: list[str] | None = None) -> list[dict]:
    """Times ``lax.top_k`` and each variant named in ``variants`` (default: all of :data:`VARIANTS`) per case
    with ``timer(f, *args) -> ms``; rows of the table (``same``: the rows on which every variant equals
    ``lax.top_k``)."""
    unknown = sorted(set(variants or ()) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    sort = jax.jit(functools.partial(topk_select, k=TOPK, impl="sort"))
    timed = {name: jax.jit(functools.partial(VARIANTS[name], k=TOPK)) for name in (variants or VARIANTS)}
    timed[MODEL] = jax.jit(functools.partial(topk_select, k=TOPK))     # impl="auto": csa2's rule on this backend
    rows = []
    for label, batch, queries, t in cases:
        x = _scores(batch, queries, t)
        i_s, m_s = map(np.asarray, sort(x))
        same = np.ones(i_s.shape[:-1], bool)
        for f in timed.values():
            i_r, m_r = map(np.asarray, f(x))
            same &= np.all(i_s == i_r, axis=-1) & np.all(m_s == m_r, axis=-1)
        rows.append(dict(case=label, batch=batch, queries=queries, rows_T=t, sort_ms=timer(sort, x),
                         variant_ms={name: timer(f, x) for name, f in timed.items()}, bytes=x.size * 4,
                         same=int(same.sum()), total=batch * queries,
                         copy_GBps=None if copy_bw is None else copy_bw / 1e9))
        on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    names = list(rows[0]["variant_ms"]) if rows else []
    lines = ["| case | batch | queries | scores a row | lax.top_k ms (GB/s) | "
             + " | ".join(f"{name} ms (× top_k)" for name in names) + " | same indices |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(names) + "---:|"]

    def rate(r: dict, ms: float) -> str:
        gbps = r["bytes"] / (ms * 1e-3) / 1e9
        pct = f", {100 * gbps / r['copy_GBps']:.0f}%" if r["copy_GBps"] else ""
        return f"{ms:.3f} ({gbps:.0f}{pct})"

    for r in rows:
        others = " | ".join(f"{ms:.3f} ({r['sort_ms'] / ms:.2f}×)" for ms in r["variant_ms"].values())
        lines.append(f"| {r['case']} | {r['batch']} | {r['queries']} | {r['rows_T']} | {rate(r, r['sort_ms'])} | "
                     f"{others} | {r['same']} of {r['total']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small sizes, wall times: the script runs (any backend)")
    args = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} (wall times)")
    # each finished row printed at once, so a run cut short by a time limit keeps what it measured
    rows = bench_topk(SMOKE if args.smoke else CASES, wall_ms, None,
                      on_row=lambda rows: print(table(rows).splitlines()[-1], flush=True))
    print(table(rows))


if __name__ == "__main__":
    main()
