"""Can a Mosaic GPU kernel gather KV rows by index as fast as XLA's gather? (issue 9: the gather in the kernel)

The decode-attention kernel reads rows that XLA gathered before it (``docs/perf/attention_h200.md``: at batch 64
the gather costs more than the kernel). Moving the gather into the kernel needs the rows of each query fetched
by index into shared memory; Hopper has no TMA gather, so each row is its own asynchronous copy (one TMA copy of
the contiguous row, the index read from shared memory). This probe measures that fetch alone: a kernel with one CTA
per query streams its ``L`` rows from ``pool[idx[n]]`` into a ring of ``stages`` shared-memory buffers of
``rows_per_step`` rows, 64 row copies per buffer, and writes each buffer back out with a TMA store, so it does
what ``pool[idx]`` does and moves the same bytes. Printed: device µs and GB/s of both against the copy ceiling
(``bench_kernels.ceilings``) for the real decode shape (64 queries × 640 rows × 512 bf16), with and without Pallas's
automatic warpgroup barrier before each copy (``unsafe_no_auto_barriers``). If the kernel is far slower than
XLA's gather, an in-kernel gather must fetch rows another way: the probe also times per-thread loads of each row
into registers (FlashMLA's way; ``group`` rows in flight) stored into the same buffer.

    JAX_PLATFORMS=cuda,cpu python3 scripts/probe_row_gather.py            # on a GPU
    python3 scripts/probe_row_gather.py --interpret                       # jax >= 0.11 on CPU: result check only
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.mgpu_compat import load_whole  # noqa: E402


def gather_rows(pool: jax.Array, idx: jax.Array, *, rows_per_step: int = 64, stages: int = 2,
                no_auto_barriers: bool = False) -> jax.Array:
    """``pool[idx]`` by a Mosaic GPU kernel: ``pool bf16 [R, c, w]`` (rows of ``c·w`` values stored as ``c`` chunks
    of ``w ≤ 256`` so that the TMA store's box stays within 256 per dimension), ``idx int32 [N, L]`` (every entry in
    ``[0, R)``, ``L`` a multiple of ``rows_per_step``) → ``bf16 [N, L, c, w]``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _, c, w = pool.shape
    steps = idx.shape[1] // rows_per_step
    stages = min(stages, steps)

    def body(pool_ref, idx_ref, out_ref, idx_smem, stage_smem, idx_barrier, loaded):
        tok = lax.axis_index("token")
        plgpu.copy_gmem_to_smem(idx_ref.at[tok], idx_smem, idx_barrier)
        plgpu.barrier_wait(idx_barrier)

        def issue(step, slot):
            @pl.loop(0, rows_per_step)
            def _row(r):
                row = idx_smem[step, r]
                plgpu.copy_gmem_to_smem(pool_ref.at[pl.ds(row, 1)], stage_smem.at[slot, pl.ds(r, 1)],
                                        loaded.at[slot])

        for i in range(stages):
            issue(i, i)

        @pl.loop(0, steps)
        def _step(step):
            slot = lax.rem(step, jnp.array(stages, step.dtype))
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.copy_smem_to_gmem(stage_smem.at[slot], out_ref.at[tok, pl.ds(step * rows_per_step, rows_per_step)])

            @pl.when(step + stages < steps)
            def _refill():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the store has read the buffer
                issue(step + stages, slot)

        plgpu.wait_smem_to_gmem(0)

    return _launch(body, pool, idx, rows_per_step,
                   [plgpu.SMEM((stages, rows_per_step, c, w), pool.dtype), plgpu.Barrier(num_arrivals=1),
                    plgpu.Barrier(num_arrivals=rows_per_step, num_barriers=stages)],
                   plgpu.CompilerParams(unsafe_no_auto_barriers=no_auto_barriers))


def _launch(body, pool: jax.Array, idx: jax.Array, rows_per_step: int, scratch: list, params=None) -> jax.Array:
    """One CTA per query row of ``idx [N, L]``, the output ``[N, L, c, w]`` of ``pool``'s dtype; ``body`` gets the
    refs, the indices in shared memory (``int32 [L / rows_per_step, rows_per_step]``) and then ``scratch``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, length = idx.shape
    steps = length // rows_per_step
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n, length, *pool.shape[1:]), pool.dtype),
                          scratch_types=[plgpu.SMEM((steps, rows_per_step), jnp.int32), *scratch], grid=(n,),
                          grid_names=("token",), **({} if params is None else dict(compiler_params=params)))
    # the indices as [N, steps, rows]: a TMA box holds at most 256 elements along each dimension
    return kernel(pool, idx.reshape(n, steps, rows_per_step))


def gather_rows_registers(pool: jax.Array, idx: jax.Array, *, rows_per_step: int = 64, group: int = 16) -> jax.Array:
    """``pool[idx]`` like :func:`gather_rows`, but each row is loaded from global memory into registers by the
    warpgroup's threads (``c·w / 128`` values each, one plain vector load per thread and row) and stored into the
    shared-memory buffer, ``group`` rows at a time (their loads issued before any store, so ``group`` rows are in
    flight), then the buffer goes out with a TMA store. The way FlashMLA's sparse kernels fetch rows (per-thread
    loads), in the form Pallas's Mosaic GPU expresses."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _, c, w = pool.shape
    steps = idx.shape[1] // rows_per_step
    per_thread = c * w // 128
    if rows_per_step % group or per_thread < 1:
        raise ValueError(f"group={group} must divide rows_per_step={rows_per_step}; rows need ≥ 128 values")
    layout = plgpu.Layout.WG_STRIDED((1, c, w), vec_size=min(per_thread, 8))

    def body(pool_ref, idx_ref, out_ref, idx_smem, stage_smem, idx_barrier):
        tok = lax.axis_index("token")
        plgpu.copy_gmem_to_smem(idx_ref.at[tok], idx_smem, idx_barrier)
        plgpu.barrier_wait(idx_barrier)

        @pl.loop(0, steps)
        def _step(step):
            @pl.when(step > 0)
            def _wait():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous store has read the buffer

            @pl.loop(0, rows_per_step // group)
            def _group(g):
                rows = [load_whole(plgpu, pool_ref.at[pl.ds(idx_smem[step, g * group + j], 1)], layout)
                        for j in range(group)]
                for j, v in enumerate(rows):
                    stage_smem.at[pl.ds(g * group + j, 1)][...] = v

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage_smem, out_ref.at[tok, pl.ds(step * rows_per_step, rows_per_step)])

        plgpu.wait_smem_to_gmem(0)

    return _launch(body, pool, idx, rows_per_step,
                   [plgpu.SMEM((rows_per_step, c, w), pool.dtype), plgpu.Barrier(num_arrivals=1)])


def case(n: int, length: int, d: int, pool_rows: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """A bf16 pool ``[pool_rows, d / 256 or 1, ≤ 256]`` of random rows and random indices ``[n, length]``."""
    w = min(d, 256)
    k1, k2 = jax.random.split(jax.random.key(seed))
    pool = jax.random.normal(k1, (pool_rows, d // w, w), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(k2, (n, length), 0, pool_rows, jnp.int32)
    return pool, idx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="check the result in the Mosaic GPU interpreter (CPU)")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--length", type=int, default=640)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--pool-rows", type=int, default=1 << 17, help="rows of the pool (128K rows of 1 KiB)")
    args = ap.parse_args()
    if args.interpret:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        pool, idx = case(4, 128, args.d, 1024)
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            for name, fn in [("row copies", gather_rows),
                             ("row copies, no auto barriers", functools.partial(gather_rows, no_auto_barriers=True)),
                             ("register loads", gather_rows_registers)]:
                same = bool(np.array_equal(np.asarray(jax.jit(fn)(pool, idx)), np.asarray(pool[idx])))
                print(f"interpreter, {name}: equal to pool[idx]: {same}")
                assert same
        return

    from bench_kernels import ceilings, device_times  # scripts/ is on sys.path when run as a script

    ceil = ceilings()
    pool, idx = case(args.n, args.length, args.d, args.pool_rows)
    nbytes = 2 * args.n * args.length * args.d * 2      # rows read + rows written
    want = np.asarray(pool[idx])
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.n} queries × {args.length} rows × "
          f"{args.d} bf16; copy ceiling {ceil['copy_GBps']:.0f} GB/s\n")
    print("| gather | µs | GB/s (read + write) | % copy | equal to pool[idx] |\n|---|---:|---:|---:|---|")
    variants = [("XLA pool[idx]", jax.jit(lambda p, i: p[i]))]
    for stages in (2, 3):
        for nab in (False, True):
            variants.append((f"row copies, {stages} stages{', no auto barriers' if nab else ''}",
                             jax.jit(functools.partial(gather_rows, stages=stages, no_auto_barriers=nab))))
    for group in (8, 16, 32):
        variants.append((f"register loads, {group} rows in flight",
                         jax.jit(functools.partial(gather_rows_registers, group=group))))
    for name, fn in variants:
        try:
            same = bool(np.array_equal(np.asarray(fn(pool, idx)), want))
            ms, _ = device_times(fn, pool, idx)
        except Exception as e:   # a variant that does not lower or run is reported, the others still measured
            print(f"| {name} | {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |", flush=True)
            continue
        gbps = nbytes / (ms * 1e-3) / 1e9
        print(f"| {name} | {1e3 * ms:.1f} | {gbps:.0f} | {100 * gbps / ceil['copy_GBps']:.0f}% | {same} |", flush=True)


if __name__ == "__main__":
    main()
