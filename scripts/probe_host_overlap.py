"""Does XLA overlap a host computation inside a program with the device's kernels? (issue 13, item 3)

The Engram step with tables in pinned host memory gathers its rows on the host inside the step (XLA host
offloading). On the H200 the step then runs ~0.3–0.6 ms longer than with device tables and CUPTI sees the device
idle for that long inside the step (``docs/perf/serving_h200.md``, 2026-12-03). The gather needs only the step's
token ids, so in principle it can run while the device works on the first layers. This probe times, in one
program each:

* ``device``: a chain of bf16 GEMMs (the stand-in for the layers before the rows are needed);
* ``host``: ids → host, a gather of ``rows`` rows of a pinned-host FP8 table on the host, the rows → device;
* ``both, independent``: both, combined only at the end (the most freedom XLA can have to overlap);
* ``both, rows needed first``: the GEMM chain starts from the gathered rows (no overlap possible: the floor).

If ``both, independent`` ≈ max(device, host) XLA overlaps; ≈ device + host it serializes, and hiding the gather
needs another mechanism (a gather issued before the step, or a kernel reading pinned host rows).

    JAX_PLATFORMS=cuda,cpu python3 scripts/probe_host_overlap.py --out /tmp/overlap
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def on_host(fn, *args):
    """``fn(*args)`` as a host computation inside the program (the function form of ``compute_on``)."""
    from jax.experimental import compute_on as offload

    transform = getattr(offload, "compute_on2", None) or offload.compute_on
    return transform(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)


def gather(table: jax.Array, ids: jax.Array) -> jax.Array:
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return jax.lax.gather(table, ids.reshape(-1, 1), dn, slice_sizes=(1, table.shape[1]),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def host_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """ids (device) → host gather → rows on the device, fp32 ``[n, width]``."""
    h = jax.device_put(ids, jax.memory.Space.Host)
    rows = on_host(gather, table, h)
    return jax.device_put(rows, jax.memory.Space.Device).astype(jnp.float32)


def gemm_chain(x: jax.Array, w: jax.Array, depth: int) -> jax.Array:
    for _ in range(depth):
        x = jnp.tanh(jnp.dot(x, w, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
    return x


def programs(depth: int):
    def device(x, w, table, ids):
        return gemm_chain(x, w, depth).astype(jnp.float32).sum()

    def host(x, w, table, ids):
        return host_rows(table, ids).sum()

    def both_independent(x, w, table, ids):
        return gemm_chain(x, w, depth).astype(jnp.float32).sum() + host_rows(table, ids).sum()

    def both_dependent(x, w, table, ids):
        r = host_rows(table, ids)
        x = x + r.sum().astype(x.dtype) * 0
        return gemm_chain(x, w, depth).astype(jnp.float32).sum() + r.sum()

    return {"device": device, "host": host, "both, independent": both_independent,
            "both, rows needed first": both_dependent}


def time_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table-rows", type=int, default=4_000_000)
    ap.add_argument("--width", type=int, default=256, help="bytes per table row (FP8 codes)")
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 4096], help="rows gathered per call")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    table_np = rng.integers(0, 120, (args.table_rows, args.width), dtype=np.uint8).view(jnp.float8_e4m3fn)
    host_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    table = jax.device_put(table_np, host_sharding)
    x = jax.device_put(jnp.asarray(rng.standard_normal((args.tokens, args.dim)), jnp.bfloat16), dev)
    w = jax.device_put(jnp.asarray(rng.standard_normal((args.dim, args.dim)) / np.sqrt(args.dim), jnp.bfloat16), dev)
    results = []
    for n in args.rows:
        ids = jax.device_put(jnp.asarray(rng.integers(0, args.table_rows, n), jnp.int32), dev)
        for depth in args.depth:
            row = {"rows": n, "gemms": depth}
            for name, fn in programs(depth).items():
                row[name] = time_ms(jax.jit(fn), (x, w, table, ids), args.repeats)
            serial = row["device"] + row["host"]
            row["overlap share"] = (serial - row["both, independent"]) / max(min(row["device"], row["host"]), 1e-9)
            results.append(row)
            print(json.dumps(row), flush=True)
    head = ["rows", "gemms", "device", "host", "both, independent", "both, rows needed first", "overlap share"]
    lines = [f"jax {jax.__version__}, {dev.device_kind}; ms per call (best of 3 × {args.repeats}); GEMMs "
             f"[{args.tokens}, {args.dim}] × [{args.dim}, {args.dim}] bf16; table {args.table_rows} × {args.width} B "
             "in pinned host memory; overlap share: (device + host − both) ÷ min(device, host), 1 = fully hidden",
             "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in results:
        lines.append("| " + " | ".join(f"{r[h]:.3f}" if isinstance(r[h], float) else str(r[h]) for h in head) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe_host_overlap.md").write_text(text + "\n")
        (out / "probe_host_overlap.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
