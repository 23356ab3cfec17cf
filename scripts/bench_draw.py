"""The random draw's exact paths (``sampling.random.random_sampling``) at the V4 vocabulary, V = 129,280.

The draw inverts torch's sequential fp64 CDF. ``method="auto"`` proves most rows with a vocabulary-parallel search
and recomputes the rest exactly under a ``lax.cond``; on a GPU that recomputation was the sequential scan (~16K
dependent steps) and is now ``_binadecdf.binade_search`` (one vocabulary-parallel pass per binade of the running
sum). What is timed (wall milliseconds of the jitted call, mean of 5 after a warm call; the conditional's predicate
read by the host included), per batch:

* ``auto, all certified``: flat rows (standard normal logits, what a random-weight model gives), no fallback —
  with the default prefix sums (block totals locating the one block whose prefix sums are formed,
  ``prefix="two_level"``, ``_fastcdf._locate_two_level``), with ``jnp.cumsum`` over the whole row (``"xla"``), with
  fp32 block products (``prefix="blocked"``, ``sampling/_scan``; slower on an H200, docs/perf/serving_h200.md,
  second session of 2026-12-07) and with bf16 byte products for the integer limbs (``prefix="bytes"``);
* ``auto + scan`` / ``auto + binade``: the same rows with row 0 replaced by one the certificate cannot prove
  (``tests/helpers.uncertifiable_rows`` at full width), so the fallback runs, through each exact path (the binade
  fallback compacts the uncertified rows and processes 8 at a time: ``_binadecdf.binade_rows``);
* ``exact scan`` / ``binade``: every row through that exact path (flat rows: ~18 binades each).

``same``: every variant returned the same tokens. ``--kernels`` (GPU only) adds, per batch and prefix form (``xla``,
``bytes``, ``two_level``), the device time of the certified draw by kernel (CUPTI, median of 10 calls) against its
wall time.
``python scripts/bench_draw.py [--batches 1 64] [--kernels] [--out DIR]``;
``--smoke`` runs a small vocabulary on any backend (a check that the script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_topk import wall_ms  # noqa: E402  (scripts/ is on sys.path when run as a script)

from dinfer_jax.sampling.random import random_sampling  # noqa: E402
from helpers import uncertifiable_rows  # noqa: E402

VOCAB = 129280


def inputs(batch: int, vocab: int, uncertified: bool):
    """(probs [batch, vocab] f32, seeds [batch] uint64, positions [batch] int32); row 0 uncertifiable if asked."""
    rng = np.random.default_rng(batch)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    seeds = rng.integers(0, 2**64, batch, dtype=np.uint64)
    positions = rng.integers(0, 2**20, batch).astype(np.int32)
    if uncertified:
        row, seed, pos, _ = uncertifiable_rows(rng, 1, n_tiny=min(4096, vocab - 8), width=vocab)
        probs[0], seeds[0], positions[0] = row[0], seed[0], pos[0]
    return jnp.asarray(probs), seeds, jnp.asarray(positions)


VARIANTS = {  # label: (uncertified row present, random_sampling keywords)
    "auto, all certified (default: two-level search)": (False, dict(method="auto")),
    "auto, all certified, jnp.cumsum": (False, dict(method="auto", prefix="xla")),
    "auto, all certified, block products": (False, dict(method="auto", prefix="blocked")),
    "auto, all certified, byte products": (False, dict(method="auto", prefix="bytes")),
    "auto + scan": (True, dict(method="auto", fallback="scan")),
    "auto + binade": (True, dict(method="auto", fallback="binade")),
    "exact scan": (False, dict(method="exact")),
    "binade": (False, dict(method="binade")),
}


def bench(batches, vocab: int) -> list[dict]:
    rows = []
    for batch in batches:
        row, tokens = {"batch": batch}, {}
        for label, (uncertified, kw) in VARIANTS.items():
            probs, seeds, positions = inputs(batch, vocab, uncertified)
            # not under an outer jit: seeds_to_u64 must see the uint64 seeds on the host (a jit argument would be
            # truncated to uint32 without x64); random_sampling dispatches its own jitted program
            f = functools.partial(random_sampling, **kw)
            t0 = time.perf_counter()
            out = np.asarray(f(probs, seeds, positions))
            row[f"{label} first s"] = time.perf_counter() - t0
            row[label] = wall_ms(f, probs, seeds, positions)
            tokens.setdefault(uncertified, []).append(out)
            print(f"batch {batch} {label}: {row[label]:.3f} ms (first call {row[f'{label} first s']:.1f} s)",
                  flush=True)
        row["same"] = all((t == outs[0]).all() for outs in tokens.values() for t in outs)
        rows.append(row)
    return rows


def kernel_breakdown(batches, vocab: int, top: int = 12, prefixes=("xla",)) -> str:
    """The certified draw (flat rows, no fallback) by kernel, per prefix-sum form: CUPTI device ms per call against
    wall ms."""
    from bench_kernels import device_times

    from dinfer_jax.sampling.random import seeds_to_u64
    out = []
    for batch, prefix in itertools.product(batches, prefixes):
        probs, seeds, positions = inputs(batch, vocab, False)
        u = seeds_to_u64(seeds)                   # split on the host: a jit argument cannot carry uint64 without x64
        f = jax.jit(functools.partial(random_sampling, method="auto", prefix=prefix))
        wall = wall_ms(f, probs, (u.hi, u.lo), positions)
        total, per = device_times(f, probs, (u.hi, u.lo), positions)
        out += [f"batch {batch}, prefix {prefix}: wall {wall:.3f} ms, device (sum of kernels) {total:.3f} ms, "
                f"{len(per)} kernel names",
                "| kernel | ms per call | share of device |", "|---|---:|---:|"]
        for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"| `{name[:90]}` | {ms:.4f} | {ms / total:.0%} |")
        out.append("")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    labels = list(VARIANTS)
    out = ["| batch | " + " | ".join(f"{x} ms" for x in labels) + " | same |",
           "|---:|" + "---:|" * len(labels) + "---|"]
    for r in rows:
        out.append(f"| {r['batch']} | " + " | ".join(f"{r[x]:.3f}" for x in labels) + f" | {r['same']} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--smoke", action="store_true", help="vocabulary 8192, batch 4: the script runs (any backend)")
    p.add_argument("--kernels", action="store_true", help="GPU only: the certified draw's device time by kernel")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.kernels and jax.default_backend() != "gpu":
        p.error(f"--kernels reads CUPTI and needs a GPU (backend here: {jax.default_backend()})")
    batches, vocab = ([4], 8192) if args.smoke else (args.batches, VOCAB)
    rows = bench(batches, vocab)
    md = (f"draw exact paths, V = {vocab}, {jax.devices()[0].device_kind}, jax {jax.__version__}; wall ms of the "
          f"jitted call (mean of 5)\n\n{table(rows)}\n")
    if args.kernels:
        md += "\n" + kernel_breakdown(batches, vocab, prefixes=("xla", "bytes", "two_level"))
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_draw.md").write_text(md)
        (args.out / "bench_draw.json").write_text(json.dumps(rows, indent=1))
    if not all(r["same"] for r in rows):
        raise SystemExit("variants disagree on the tokens")


if __name__ == "__main__":
    main()
