"""mHC Sinkhorn projection for Hopper (Mosaic GPU): one launch per site, every round in registers.

Contract: the same as :func:`pallas_kernels.mhc.reference.sinkhorn_ref` (``[..., n, n]`` fp32 logits to the
doubly-stochastic ``[..., n, n]`` fp32 mixing matrix), each sum taken in index order (``((a + b) + c) + d``).

Why a kernel: written in XLA, the projection is 2 · iters dependent reduce → broadcast → divide rounds per mHC site
(20 rounds and ~90 sites in a V4-Flash step), and XLA's GPU fusion pass spends seconds per site deciding how to fuse
them (80% of a tiny model's step compile; ``docs/perf/compile_time_gpu.md``). Here the rounds are a loop of
register arithmetic that no fusion pass sees.

Organisation:

* The wrapper flattens the leading axes to ``N`` tokens and transposes to ``[n², N]`` fp32 (the n² entries as
  planes), padding ``N`` to a multiple of ``block`` with zero logits (finite: a uniform matrix, dropped after).
* Grid ``(N / block,)``, one warpgroup per CTA: the CTA copies its ``[n², block]`` slab to shared memory (one TMA
  copy), loads each entry's ``[block]`` plane into registers (``block / 128`` values per thread), runs the softmax
  and the rounds (one ``fori_loop`` of ``iters − 1`` trips) as elementwise arithmetic on the n² planes, stores
  them and copies the slab back.
* Each thread holds n² · block / 128 fp32 values (16 at n = 4, block = 128); no reduction crosses a thread, so the
  kernel has no shared-memory reduction scratch and no barrier beyond the copy-in.

Imports of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mhc.reference import sinkhorn_ref

LANES = 128  # threads of one warpgroup: one token per thread per 128-token group


def check_shapes(logits: jax.Array, block: int) -> None:
    """ValueError unless ``logits`` is ``[..., n, n]`` fp32 and ``block`` a positive multiple of 128."""
    if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"Sinkhorn logits must be [..., n, n], got {logits.shape}")
    if logits.dtype != jnp.float32:
        raise ValueError(f"Sinkhorn logits must be float32, got {logits.dtype}")
    if block <= 0 or block % LANES:
        raise ValueError(f"block must be a positive multiple of {LANES}, got {block}")


def _total(values: list) -> jax.Array:
    out = values[0]
    for v in values[1:]:
        out = out + v
    return out


def sinkhorn_planes(planes: list[list], iters: int, eps: float) -> list[list]:
    """The projection on ``n × n`` planes (``planes[j][k]`` any arrays of one shape): the arithmetic the kernel
    runs, usable on ``jnp`` arrays too. The ``iters − 1`` row + column rounds are one ``lax.fori_loop`` over the
    planes (a loop in the kernel, not 2 · iters unrolled copies: the unrolled form took ~12 s per call site to
    compile on the H200, ``docs/perf/compile_time_gpu.md``)."""
    n = len(planes)
    c = []
    for row in planes:                                     # softmax over k, + eps
        m = row[0]
        for v in row[1:]:
            m = jnp.maximum(m, v)
        e = [jnp.exp(v - m) for v in row]
        s = _total(e)
        c.append([v / s + eps for v in e])

    def by_columns(c: list[list]) -> list[list]:
        sums = [_total([c[j][k] for j in range(n)]) + eps for k in range(n)]
        return [[c[j][k] / sums[k] for k in range(n)] for j in range(n)]

    def one_round(_, c: list[list]) -> list[list]:
        c = [[v / (_total(row) + eps) for v in row] for row in c]   # rows: each j over its k
        return by_columns(c)

    c = by_columns(c)
    if iters > 1:
        c = lax.fori_loop(0, iters - 1, one_round, c)
    return c


def _kernel_call(x: jax.Array, *, n: int, iters: int, eps: float, block: int) -> jax.Array:
    """The Mosaic GPU kernel on planes ``x`` fp32 ``[n², N]`` (N a multiple of ``block``); same shape out."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nn, tokens = x.shape

    def body(x_ref, o_ref, slab, loaded):
        t0 = lax.axis_index("block") * block
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(t0, block)], slab, loaded)
        plgpu.barrier_wait(loaded)
        planes = [[slab[j * n + k] for k in range(n)] for j in range(n)]
        out = sinkhorn_planes(planes, iters, eps)
        for j in range(n):
            for k in range(n):
                slab[j * n + k] = out[j][k]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(slab, o_ref.at[:, pl.ds(t0, block)])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = f"mhc_sinkhorn_n{n}_it{iters}_b{block}"
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((nn, tokens), jnp.float32),
        scratch_types=[plgpu.SMEM((nn, block), jnp.float32), plgpu.Barrier(num_arrivals=1)],
        grid=(tokens // block,),
        grid_names=("block",),
        compiler_params=plgpu.CompilerParams(approx_math=False),
    )
    return kernel(x)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "block"))
def sinkhorn_projection(logits: jax.Array, iters: int, eps: float, *, block: int = LANES) -> jax.Array:
    """The Sinkhorn projection of ``[..., n, n]`` fp32 logits through the Mosaic GPU kernel (module docstring).

    A ``jax.jit`` function on purpose: inside an enclosing program, jax lowers the calls that share shapes and
    static arguments once (one private function, one kernel compile), not once per mHC site.
    """
    check_shapes(logits, block)
    n = logits.shape[-1]
    lead = logits.shape[:-2]
    flat = logits.reshape(-1, n * n)
    tokens = flat.shape[0]
    padded = -(-max(tokens, 1) // block) * block
    planes = jnp.pad(flat, ((0, padded - tokens), (0, 0))).T
    out = _kernel_call(planes, n=n, iters=iters, eps=eps, block=block)
    return out.T[:tokens].reshape(*lead, n, n)


__all__ = ["check_shapes", "sinkhorn_planes", "sinkhorn_projection", "sinkhorn_ref"]
