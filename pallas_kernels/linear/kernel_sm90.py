"""FP8 block-scaled linear layer for Hopper (Mosaic GPU), the weights dequantised in registers.

Why a kernel: XLA compiles the FP8 linears as GEMM fusions with their dequantisation and autotunes every one of
them, which is most of a real-dimension serving step's GPU compile time (``docs/perf/serving_h200.md``: autotuning
off halves the warm-up but makes decode 3.2× slower). A kernel with a fixed block table needs no autotuning.

Organisation (that of :mod:`pallas_kernels.moe.kernel_sm90`, with one weight matrix and a split over K):

* the weight is the WGMMA **A** operand (the M side, 64-row multiples): ``block_n`` weight rows per work item,
  loaded from shared memory into registers as int8, decoded to bf16 by bit placement
  (:func:`~pallas_kernels.linear.reference.e4m3_bits_to_scaled_bf16_bits`) and scaled there by the UE8M0 block
  scale (the expert kernel's :func:`~pallas_kernels.moe.kernel_sm90._scale_rows`, bias 120);
* tokens are the **B** operand (the N side, ``block_m`` of 16–256 columns) straight from shared memory, so a
  decode call of a few tokens still issues full 64-row MMAs and reads every weight byte once per token tile;
* work items are (token tile, weight-row block, K split) triples over a persistent grid of one CTA per SM. The
  split over K (``split_k``) gives small-``N`` weights enough items to occupy the SMs at decode (a ``[1024, 4096]``
  weight has 16 row blocks of 64); the partial sums are fp32 ``[split_k, N, M]`` and are added outside the kernel.
  ``split_k`` comes from the block table (:mod:`pallas_kernels.linear.tuning`): decode calls split, prefill calls
  (thousands of tokens, items enough) do not.

Inputs: ``x`` bf16 ``[M, K]``; ``codes`` float8_e4m3fn ``[N, K]``; ``scale`` UE8M0 per block (V4: 128 × 128,
V4.1: 32 × 32). The kernel reads the scales per row and 32 inputs (:func:`kernel_scales`: exponent bytes expanded
from the blocks by XLA in the wrapper, 1/32 of the weight's bytes; a load-time layout would save that pass).
Output fp32 ``[M, N]``.

Status: both forms pass ``tests/test_linear_kernel_gpu.py``: the plain form on the H200 and the H100 since
2026-12-03 (``docs/perf/linear_kernel_h200.md``), the grouped form (:func:`fp8_grouped_linear_sm90`, V4's ``wo_a``)
on the H100 since 2026-12-07, when the model took it by default (``docs/perf/serving_h200.md``, eighth session of
2026-12-07). ``ctas_per_sm=2`` lowers (CPU tests) and has GPU test cases that have not run yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear.reference import BLOCK, SCALE_BIAS, e4m3_bits_to_scaled_bf16_bits, ue8m0_bits


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """Block sizes of one FP8 linear call.

    block_m: tokens per tile (WGMMA N; 16–256, a power of two). block_n: weight rows per item (WGMMA M; 64 or
    128, so a tile never straddles two 128-row scale blocks). block_k: reduction per pipeline step (64 or 128).
    split_k: K ranges per (token tile, row block), each a whole number of ``block_k`` steps. stages: TMA pipeline
    depth. ctas_per_sm: persistent CTAs per SM (1 or 2); two give each SM two independent pipelines, so one
    CTA's loads run while the other decodes and multiplies (the single-warpgroup kernel's only latency hiding
    besides its stages), at half the shared memory each.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    stages: int = 4
    ctas_per_sm: int = 1

    def check(self, n: int, k: int) -> None:
        if self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"block_m={self.block_m} must be 16, 32, 64, 128 or 256 (a token tile's bf16 row is "
                             "swizzled in 32-, 64- or 128-byte units)")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n={self.block_n} must be 64 or 128")
        if self.block_k not in (64, 128):
            raise ValueError(f"block_k={self.block_k} must be 64 or 128")
        if n % self.block_n:
            raise ValueError(f"output width {n} is not a multiple of block_n={self.block_n}")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
        if self.split_k < 1 or k % (self.block_k * self.split_k):
            raise ValueError(f"reduction width {k} is not a multiple of block_k · split_k = "
                             f"{self.block_k} · {self.split_k}")
        if _scale_cols(k, self.split_k) > 256:
            raise ValueError(f"a K split of {k // self.split_k} inputs has more than 256 scale bytes per row (one "
                             "TMA copy's limit); split K further")

    def smem_bytes(self, k: int) -> int:
        """Shared memory of one CTA: the pipeline's token and weight tiles, the output tile, the scale rows."""
        tiles = self.stages * (self.block_k * self.block_m * 2 + self.block_n * self.block_k)
        return tiles + self.block_n * self.block_m * 4 + self.block_n * _scale_cols(k, self.split_k)


def _scale_cols(k: int, split_k: int) -> int:
    """Scale bytes per row of one K split, padded to whole 16-byte TMA units."""
    return -(-(k // (32 * split_k)) // 16) * 16


def kernel_scales(scale: jax.Array, n: int, k: int, block: tuple[int, int], split_k: int) -> jax.Array:
    """UE8M0 block scales ``[⌈n/bo⌉, ⌈k/bi⌉]`` (``block = (bo, bi)``, ``bi`` a multiple of 32) → the kernel's
    exponent bytes per row and 32 inputs, one slab per K split, each row padded to 16 bytes: uint8
    ``[split_k, n, ⌈k/32/split_k⌉₁₆]``."""
    bo, bi = block
    if bi % 32:
        raise ValueError(f"the kernel reads scales per 32 inputs; block {block} does not divide into them")
    bits = jnp.repeat(jnp.repeat(ue8m0_bits(scale), bo, axis=0)[:n], bi // 32, axis=1)[:, :k // 32]
    kg = k // (32 * split_k)
    slabs = bits.reshape(n, split_k, kg).transpose(1, 0, 2)
    return jnp.pad(slabs, ((0, 0), (0, 0), (0, _scale_cols(k, split_k) - kg)))


def _check(x: jax.Array, codes: jax.Array, scale: jax.Array, block: tuple[int, int],
           cfg: LinearConfig) -> tuple[int, int, int]:
    m, k = x.shape
    n, k2 = codes.shape
    if k2 != k:
        raise ValueError(f"weight input width {k2} != activation width {k}")
    if codes.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"codes must be float8_e4m3fn, got {codes.dtype}")
    want = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} != {want} (one per {block[0]} × {block[1]} block)")
    cfg.check(n, k)
    return m, n, k


def fp8_linear_t(x_t: jax.Array, codes_i8: jax.Array, scale_bits: jax.Array, *, config: LinearConfig,
                 group_rows: int = 0) -> jax.Array:
    """The kernel on transposed operands: ``x_t`` bf16 ``[K, Mp]`` (``Mp`` a multiple of ``block_m``),
    ``codes_i8`` int8 ``[N, K]`` (the e4m3 bytes), ``scale_bits`` uint8 from :func:`kernel_scales` → fp32
    partial sums ``[split_k, N, Mp]``.

    ``group_rows = R > 0``: a grouped product — the weight is ``G = N / R`` stacked ``[R, K]`` matrices and
    ``x_t`` is ``[G·K, Mp]``, group ``g``'s activations in rows ``g·K …``; output rows ``g·R …`` are group ``g``'s
    (the attention's grouped output projection, one call instead of a dequantised copy of the weight). A weight
    row block reads the activation rows of its group; nothing else changes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.moe.kernel_sm90 import _scale_rows, _swizzle_transforms

    cfg = config
    kx, rows = x_t.shape
    n, k = codes_i8.shape
    bm, bn, bk, sk = cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k
    groups = n // group_rows if group_rows else 1
    if group_rows and (n % group_rows or group_rows % bn):
        raise ValueError(f"group_rows={group_rows} must divide the {n} weight rows and be a multiple of "
                         f"block_n={bn}")
    if kx != groups * k:
        raise ValueError(f"activation rows {kx} != {groups} group(s) x reduction width {k}")
    if rows % bm:
        raise ValueError(f"token columns {rows} are not a multiple of block_m={bm}")
    k_blocks = k // bk                # x_t row blocks per group
    steps = k // (bk * sk)            # pipeline steps per K split
    kg = _scale_cols(k, sk)           # scale bytes per row of a K split (padded)
    if scale_bits.shape != (sk, n, kg):
        raise ValueError(f"scale bytes {scale_bits.shape} != {(sk, n, kg)} (see kernel_scales)")

    x_tr = _swizzle_transforms(plgpu, bm, jnp.bfloat16)
    w_tr = _swizzle_transforms(plgpu, bk, jnp.int8)
    o_tr = _swizzle_transforms(plgpu, bm, jnp.float32)

    def body(x_gmem, w_gmem, s_gmem, out_gmem, o_smem, s_smem, s_barrier):
        @plgpu.nd_loop((rows // bm, n // bn, sk), collective_axes="sm")
        def _item(loop_info):
            ti, ni, si = loop_info.index
            group_base = jax.lax.div(ni, group_rows // bn) * k_blocks if group_rows else 0
            plgpu.copy_gmem_to_smem(s_gmem.at[si, pl.ds(ni * bn, bn)], s_smem, s_barrier)
            plgpu.barrier_wait(s_barrier)

            def step(idx, x_smem, w_smem, acc):
                (kk,) = idx
                codes = w_smem[...]
                plgpu.wgmma_wait(0)   # the previous step's MMA still reads its A registers
                bits = e4m3_bits_to_scaled_bf16_bits(codes.astype(jnp.int16))
                a = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
                a = _scale_rows(plgpu, s_smem.at[:, pl.ds(kk * (bk // 32), bk // 32)], a, exponent_bias=SCALE_BIAS)
                plgpu.wgmma(acc, a, x_smem)

            def acc_scope(acc):
                pipeline = plgpu.emit_pipeline(
                    lambda idx, x_smem, w_smem: step(idx, x_smem, w_smem, acc),
                    grid=(steps,),
                    in_specs=[plgpu.BlockSpec((bk, bm), lambda kk: (group_base + si * steps + kk, ti),
                                              transforms=x_tr, delay_release=1),
                              plgpu.BlockSpec((bn, bk), lambda kk: (ni, si * steps + kk), transforms=w_tr,
                                              delay_release=1)],
                    max_concurrent_steps=cfg.stages,
                )
                pipeline(x_gmem, w_gmem)
                plgpu.wgmma_wait(0)
                return acc[...]

            out = pl.run_scoped(acc_scope, plgpu.ACC((bn, bm), jnp.float32))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous item's store has left o_smem
            o_smem[...] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[si, pl.ds(ni * bn, bn), pl.ds(ti * bm, bm)])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    body.__name__ = "fp8_linear"
    num_sms = getattr(jax.devices()[0], "core_count", None) or 132
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((sk, n, rows), jnp.float32),
        scratch_types=[plgpu.SMEM((bn, bm), jnp.float32, transforms=o_tr), plgpu.SMEM((bn, kg), jnp.uint8),
                       plgpu.Barrier(num_arrivals=1)],
        grid=(num_sms * cfg.ctas_per_sm,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(x_t.astype(jnp.bfloat16), codes_i8, scale_bits)


def _padded_call(x: jax.Array, codes: jax.Array, scale: jax.Array, block: tuple[int, int], config: LinearConfig,
                 group_rows: int) -> jax.Array:
    """The wrappers' common part: ``x [M, G·K]`` padded to whole token tiles and transposed, the codes as int8,
    the scale bytes laid out, the kernel run and its K-split partial sums added → fp32 ``[M, N]``."""
    m = x.shape[0]
    n, k = codes.shape
    rows = -(-m // config.block_m) * config.block_m
    x_t = jnp.pad(x.astype(jnp.bfloat16), ((0, rows - m), (0, 0))).T
    codes_i8 = jax.lax.bitcast_convert_type(codes, jnp.int8)
    parts = fp8_linear_t(x_t, codes_i8, kernel_scales(scale, n, k, block, config.split_k), config=config,
                         group_rows=group_rows)
    return parts.sum(axis=0)[:, :m].T


@functools.partial(jax.jit, static_argnames=("config", "block"))
def fp8_linear_sm90(x: jax.Array, codes: jax.Array, scale: jax.Array, *, config: LinearConfig,
                    block: tuple[int, int] = (BLOCK, BLOCK)) -> jax.Array:
    """``x [M, K]`` · ``Wᵀ`` with ``W`` given as e4m3 ``codes [N, K]`` and UE8M0 ``scale [⌈N/bo⌉, ⌈K/bi⌉]``
    (``block = (bo, bi)``: V4's 128 × 128, V4.1's 32 × 32) → fp32 ``[M, N]``; the contract of
    :func:`pallas_kernels.linear.reference.fp8_linear` (bf16 products, fp32 sums)."""
    _check(x, codes, scale, block, config)
    return _padded_call(x, codes, scale, block, config, group_rows=0)


@functools.partial(jax.jit, static_argnames=("config", "block"))
def fp8_grouped_linear_sm90(x: jax.Array, codes: jax.Array, scale: jax.Array, *, config: LinearConfig,
                            block: tuple[int, int] = (BLOCK, BLOCK)) -> jax.Array:
    """Per-group products ``y[m, g] = x[m, g] · W_gᵀ``: ``x [M, G, K]``, ``W`` given as e4m3 ``codes [G·R, K]``
    (group ``g``'s ``[R, K]`` matrix in rows ``g·R …``) and UE8M0 ``scale`` over the stacked ``[G·R, K]`` →
    fp32 ``[M, G, R]``; per group the contract of :func:`pallas_kernels.linear.reference.fp8_linear`. ``R`` must
    be a multiple of ``config.block_n`` and of the scale block's rows (a tile never mixes two groups)."""
    m, g, k = x.shape
    n = codes.shape[0]
    if n % g or (n // g) % block[0]:
        raise ValueError(f"{n} weight rows do not split into {g} groups of whole {block[0]}-row scale blocks")
    _check(x[:, 0], codes, scale, block, config)
    return _padded_call(x.reshape(m, g * k), codes, scale, block, config, group_rows=n // g).reshape(m, g, n // g)


__all__ = ["LinearConfig", "fp8_grouped_linear_sm90", "fp8_linear_sm90", "fp8_linear_t", "kernel_scales"]
