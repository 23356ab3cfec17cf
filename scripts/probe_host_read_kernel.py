"""Can a Mosaic GPU kernel read a pinned-host array directly? (issue 13, item 3: Engram tables in host memory)

XLA runs a host computation inside a program in stream order, so the Engram host gather stalls the device
(``docs/perf/serving_h200.md``, 2026-12-03). DeepInfer avoids this by reading the host rows from the GPU itself
(its ``EngramBuffer``: pinned host memory is addressable from device code). In JAX, a Pallas kernel given an array
with ``memory_kind="pinned_host"`` lowers to a ``mosaic_gpu`` custom call that takes the host array as its operand
(seen on CPU by lowering for CUDA, jax 0.10.2). What XLA's GPU compiler does with that operand is the question this
script answers on the device:

* it passes the host pointer: the kernel's reads go over PCIe, a call costs microseconds whatever the table size;
* it copies the operand to device memory first: a call costs the table's size over PCIe (~50 GB/s), i.e. grows
  with the table (and a table larger than device memory fails);
* it refuses to compile.

The kernel copies ``rows`` contiguous rows of int32 starting at a device-given id (the simplest host read); the
script checks the values and times calls for two table sizes::

    JAX_PLATFORMS=cuda,cpu python3 scripts/probe_host_read_kernel.py --table-mib 64 4096 --out /tmp/host_read
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def read_kernel(rows: int, width: int):
    """A Mosaic GPU kernel: ``out[r] = table[ids[0] + r]`` for ``r < rows`` (int32 rows of ``width``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(t_ref, ids_ref, o_ref):
        o_ref[...] = t_ref[pl.ds(ids_ref[0], rows), :]

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((rows, width), jnp.int32), grid=(1,), grid_names=("x",),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table-mib", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--width", type=int, default=256, help="int32 per row")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    results = []
    for mib in args.table_mib:
        n = (mib << 20) // (4 * args.width)
        row = {"table_MiB": mib, "table_rows": n}
        try:
            table_np = np.arange(n * args.width, dtype=np.int64).astype(np.int32).reshape(n, args.width)
            table = jax.device_put(table_np, host)
            fn = jax.jit(read_kernel(args.rows, args.width))
            start = n // 2 + 3
            ids = jax.device_put(jnp.array([start], jnp.int32), dev)
            t0 = time.perf_counter()
            compiled = fn.lower(table, ids).compile()
            row["compile_s"] = time.perf_counter() - t0
            hlo = compiled.as_text()
            row["copies_in_program"] = hlo.count("copy-start") + hlo.count(" copy(")
            got = np.asarray(compiled(table, ids))
            row["correct"] = bool((got == table_np[start:start + args.rows]).all())
            jax.block_until_ready(compiled(table, ids))
            t0 = time.perf_counter()
            for i in range(args.repeats):
                out = compiled(table, jax.device_put(jnp.array([(start + 97 * i) % (n - args.rows)], jnp.int32), dev))
            jax.block_until_ready(out)
            row["ms_per_call"] = 1e3 * (time.perf_counter() - t0) / args.repeats
            row["GBps_if_table_copied"] = (mib << 20) / (row["ms_per_call"] * 1e-3) / 1e9
        except Exception as e:  # noqa: BLE001 - the probe reports a refusal as a result
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe_host_read_kernel.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
