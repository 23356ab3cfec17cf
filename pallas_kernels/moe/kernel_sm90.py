"""Grouped expert GEMM for Hopper (Mosaic GPU) with the weights dequantised in registers.

Orientation (as in decode-friendly quantised GEMMs): expert weights are the WGMMA **A** operand (M side, loaded
from shared memory into registers, FP4 → bf16 decoded and scaled there), tokens are the **B** operand (N side,
straight from shared memory). So a decode tile of 8–32 tokens still issues full 64-row MMAs over the weights, and
every weight byte is read once per token tile.

Inputs are transposed activations ``x_t [K, rows]`` in the padded expert-sorted layout of
:mod:`pallas_kernels.moe.layout` (every ``block_m`` columns belong to one expert), so tiles are dense and stores
are whole tiles. Output is transposed too: ``out_t [N_out, rows]``, which is exactly the next GEMM's ``x_t``.

Two products:

* ``grouped_matmul_t(x_t, w)``:            ``out_t[:, r] = W[g(r)] · x_t[:, r]``  (fp32 or bf16 out)
* ``grouped_matmul_t(x_t, w1, w_up=w3)``:  ``out_t[:, r] = swiglu(W1·x, W3·x)`` in fp32, stored bf16 (the fused
  gate/up projection with the clamp of ``swiglu_limit``).

Work items are (token tile, weight-row block) pairs over a persistent grid of one CTA per SM; tiles past the last
expert (``tile_group < 0``) are skipped. Per item, the UE8M0 scales of the block's weight rows (``[block_n, K/32]``
bytes) are copied to shared memory once; the K loop is a TMA pipeline over weight and token tiles.

Imports of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.moe.fp4 import decode_signed_codes, packed_to_int4, scale_bits, signed_codes_to_scaled_bf16_bits
from pallas_kernels.moe.reference import ExpertWeight


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Block sizes of one grouped GEMM.

    block_m: tokens per tile (WGMMA N; multiple of 8, ≤ 256). block_n: weight rows per item (WGMMA M; multiple
    of 64). block_k: reduction per pipeline step (multiple of 64; 32-column scale groups inside it). stages: TMA
    pipeline depth. consumers: 1 = the single-warpgroup kernel of this module; 2 = the warp-specialised kernel
    (:mod:`pallas_kernels.moe.kernel_sm90_ws`: a TMA producer and two consumer warpgroups of ``block_n / 2`` rows).
    """

    block_m: int
    block_n: int
    block_k: int
    stages: int = 3
    consumers: int = 1

    def check(self, n_out: int, k: int) -> None:
        if self.block_m % 8 or not 8 <= self.block_m <= 256:
            raise ValueError(f"block_m={self.block_m} must be a multiple of 8 in [8, 256]")
        if self.block_n % 64:
            raise ValueError(f"block_n={self.block_n} must be a multiple of 64")
        if self.block_k % 64:
            raise ValueError(f"block_k={self.block_k} must be a multiple of 64")
        if n_out % self.block_n:
            raise ValueError(f"output width {n_out} is not a multiple of block_n={self.block_n}")
        if k % self.block_k:
            raise ValueError(f"reduction width {k} is not a multiple of block_k={self.block_k}")
        if self.consumers not in (1, 2):
            raise ValueError(f"consumers={self.consumers} must be 1 or 2")


def _swizzle_transforms(plgpu, minor_elems: int, dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8 if jnp.dtype(dtype) != jnp.int4 else 4
    swizzle = plgpu.find_swizzle(minor_elems * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _scale_rows(plgpu, s_ref, w, exponent_bias: int = 0):
    """``w [bn, bk]`` (bf16, WGMMA layout) times ``2^(S−127+exponent_bias)`` with ``S = s_ref[row, col // 32]``
    (uint8 smem)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA),
        return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.bfloat16, plgpu.Layout.WGMMA),
    )
    def scaled(_, s_smem, w_arr):
        i16 = ir.IntegerType.get_signless(16)
        bf16 = ir.BF16Type.get()
        index = ir.IndexType.get()
        c32 = arith.constant(index, 32)
        c7 = arith.constant(i16, 7)
        bias = arith.constant(i16, exponent_bias)

        def one(val, idx):
            group = arith.divui(idx[1], c32)
            byte = memref.load(s_smem, [idx[0], group])
            exponent = arith.addi(arith.extui(i16, byte), bias)
            bits = arith.shli(exponent, c7)   # bf16 with exponent field S + bias: 2^(S - 127 + bias)
            return arith.mulf(val, arith.bitcast(bf16, bits))

        return w_arr.foreach(one, create_array=True)

    return scaled(s_ref, w)


def _check_gemm(x_t: jax.Array, w: ExpertWeight, w_up: ExpertWeight | None, swiglu_limit: float | None,
                cfg: TileConfig) -> tuple[int, int, int]:
    """Shape / format checks shared by both grouped GEMM kernels; returns ``(k, rows, n_out)``."""
    k, rows = x_t.shape
    _, n_out, k2 = w.shape
    if k2 != k:
        raise ValueError(f"weight reduction width {k2} != activation rows {k}")
    if rows % cfg.block_m:
        raise ValueError(f"rows={rows} is not a multiple of block_m={cfg.block_m}")
    cfg.check(n_out, k)
    if w_up is not None and (w_up.shape != w.shape or w_up.fmt != w.fmt):
        raise ValueError("gate and up weights must have the same shape and format")
    if w_up is not None and swiglu_limit is None:
        raise ValueError("the fused gate/up product needs swiglu_limit")
    if w.fmt not in ("fp4", "fp4_mma", "bf16"):
        raise ValueError(f"kernel supports fp4, fp4_mma and bf16 expert weights, got {w.fmt!r}")
    if w.fmt == "fp4_mma" and cfg.consumers != 2:
        raise ValueError("fp4_mma weights are read by the warp-specialised kernel only (consumers=2)")
    return k, rows, n_out


def _weight_operands(weights: list[ExpertWeight]) -> tuple[list[jax.Array], list[jax.Array], object]:
    """What the kernels read of the weights: data (FP4 as int4, else bf16), UE8M0 scale bytes (FP4 only) and the
    data's dtype in shared memory."""
    if weights[0].fmt == "fp4":
        return [packed_to_int4(m.data) for m in weights], [scale_bits(m.scale) for m in weights], jnp.int4
    return [m.data.astype(jnp.bfloat16) for m in weights], [], jnp.bfloat16


def grouped_matmul_t(x_t: jax.Array, w: ExpertWeight, tile_group: jax.Array, *, config: TileConfig,
                     out_dtype=jnp.float32, w_up: ExpertWeight | None = None,
                     swiglu_limit: float | None = None, decode: str = "bits", ablate: str = "") -> jax.Array:
    """Grouped GEMM over the padded layout (see module docstring).

    ``decode``: "bits" (default: integer bit placement, see :mod:`pallas_kernels.moe.fp4`) or "float" (the
    piecewise-linear float formula). ``ablate`` is for benchmarking only: "scale" skips the scale multiply, "decode"
    also the e2m1 decode (wrong
    results; the stages are timed by difference).

    Args:
      x_t: ``bf16 [K, rows]``, rows a multiple of ``block_m``; column block t belongs to expert ``tile_group[t]``.
      w: expert weight ``[G, N_out, K]`` ("fp4" or "bf16"); ``w_up`` the up projection for the fused SwiGLU.
      tile_group: ``int32 [rows / block_m]``, −1 for unused tiles (skipped, their output left unwritten).
    Returns:
      ``out_t [N_out, rows]`` in ``out_dtype`` (bf16 when fused).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = config
    k, rows, n_out = _check_gemm(x_t, w, w_up, swiglu_limit, cfg)
    if tile_group.shape != (rows // cfg.block_m,):
        raise ValueError(f"tile_group shape {tile_group.shape} != ({rows // cfg.block_m},)")
    fused = w_up is not None
    fmt = w.fmt
    out_dtype = jnp.bfloat16 if fused else jnp.dtype(out_dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    n_blocks = n_out // bn
    n_tiles = rows // bm
    kg = k // 32

    weights = [w] + ([w_up] if fused else [])
    w_data, w_scales, w_dtype = _weight_operands(weights)
    nw = len(weights)

    x_tr = _swizzle_transforms(plgpu, bm, jnp.bfloat16)
    w_tr = _swizzle_transforms(plgpu, bk, w_dtype)
    o_tr = _swizzle_transforms(plgpu, bm, out_dtype)

    def body(tile_group_gmem, x_gmem, *refs):
        w_gmems = refs[:nw]
        s_gmems = refs[nw:nw + len(w_scales)]
        out_gmem = refs[nw + len(w_scales)]
        o_smem, s_smems, s_barrier = refs[nw + len(w_scales) + 1:]

        @plgpu.nd_loop((n_tiles, n_blocks), collective_axes="sm")
        def _item(loop_info):
            ti, ni = loop_info.index
            g = tile_group_gmem[ti]

            @pl.when(g >= 0)
            def _():
                if fmt == "fp4":
                    for s_gmem, s_smem in zip(s_gmems, s_smems, strict=False):
                        plgpu.copy_gmem_to_smem(s_gmem.at[g, pl.ds(ni * bn, bn)], s_smem, s_barrier)
                        plgpu.barrier_wait(s_barrier)

                def step(idx, x_smem, *w_smem_and_accs):
                    w_smems = w_smem_and_accs[:nw]
                    accs = w_smem_and_accs[nw:]
                    (kk,) = idx
                    if fmt == "fp4":
                        regs = [ws[...] for ws in w_smems]
                        plgpu.wgmma_wait(0)   # the previous step's MMAs still read their A registers
                        for r, s_smem, acc in zip(regs, s_smems, accs, strict=False):
                            s_chunk = s_smem.at[:, pl.ds(kk * (bk // 32), bk // 32)]
                            if decode == "bits" and ablate != "decode":
                                bits = signed_codes_to_scaled_bf16_bits(r.astype(jnp.int16))
                                a = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
                                bias = 126          # the codes carry 2^-126
                            else:
                                a = r.astype(jnp.bfloat16)
                                if ablate != "decode":
                                    a = decode_signed_codes(a)
                                bias = 0
                            if ablate not in ("decode", "scale"):
                                a = _scale_rows(plgpu, s_chunk, a, exponent_bias=bias)
                            else:
                                a = plgpu.layout_cast(a, plgpu.Layout.WGMMA)
                            plgpu.wgmma(acc, a, x_smem)
                    else:
                        for ws, acc in zip(w_smems, accs, strict=False):
                            plgpu.wgmma(acc, ws, x_smem)

                def acc_scope(*accs):
                    pipeline = plgpu.emit_pipeline(
                        lambda idx, x_smem, *ws: step(idx, x_smem, *ws, *accs),
                        grid=(k // bk,),
                        in_specs=[plgpu.BlockSpec((bk, bm), lambda kk: (kk, ti), transforms=x_tr,
                                                  delay_release=1)]
                        + [plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), transforms=w_tr, delay_release=1)] * nw,
                        max_concurrent_steps=cfg.stages,
                    )
                    pipeline(x_gmem, *[wg.at[g] for wg in w_gmems])
                    plgpu.wgmma_wait(0)
                    return tuple(acc[...] for acc in accs)

                results = pl.run_scoped(acc_scope, *[plgpu.ACC((bn, bm), jnp.float32) for _ in range(nw)])
                if fused:
                    gate, up = results
                    gate = jnp.minimum(gate, swiglu_limit)
                    up = jnp.minimum(jnp.maximum(up, -swiglu_limit), swiglu_limit)
                    out = gate * jax.nn.sigmoid(gate) * up
                else:
                    (out,) = results
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # previous item's store has left o_smem
                o_smem[...] = out.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(ni * bn, bn), pl.ds(ti * bm, bm)])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    body.__name__ = f"moe_{'gate_up' if fused else 'down'}_{fmt}"
    scratch = [plgpu.SMEM((bn, bm), out_dtype, transforms=o_tr)]
    scratch.append([plgpu.SMEM((bn, kg), jnp.uint8) for _ in w_scales])
    scratch.append(plgpu.Barrier(num_arrivals=1))
    num_sms = getattr(jax.devices()[0], "core_count", None) or 132
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_out, rows), out_dtype),
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(tile_group.astype(jnp.int32), x_t.astype(jnp.bfloat16), *w_data, *w_scales)


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "up_config", "down_config", "decode", "ablate"))
def experts_sm90(x: jax.Array, expert_ids: jax.Array, route_weights: jax.Array, w1: ExpertWeight,
                 w3: ExpertWeight, w2: ExpertWeight, *, swiglu_limit: float, up_config: TileConfig,
                 down_config: TileConfig, decode: str = "bits", ablate: str = "") -> jax.Array:
    """Routed experts on Hopper; same contract as :func:`pallas_kernels.moe.reference.experts` (bf16 compute).
    A token's ``k`` weighted outputs are summed in choice order (:func:`~pallas_kernels.moe.layout.combine_rows_t`).
    """
    from pallas_kernels.moe.layout import combine_rows_t

    y_t, lay = _expert_outputs_t(x, expert_ids, w1, w3, w2, swiglu_limit=swiglu_limit, up_config=up_config,
                                 down_config=down_config, decode=decode, ablate=ablate)
    return combine_rows_t(y_t, lay, route_weights)


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "up_config", "down_config", "decode"))
def expert_choices_sm90(x: jax.Array, expert_ids: jax.Array, route_weights: jax.Array, w1: ExpertWeight,
                        w3: ExpertWeight, w2: ExpertWeight, *, swiglu_limit: float, up_config: TileConfig,
                        down_config: TileConfig, decode: str = "bits") -> jax.Array:
    """Each (token, choice) pair's weighted expert output, uncombined: the expert-parallel form of
    :func:`experts_sm90`. ``x [N, D]``; ``expert_ids [N, k]`` int32 in ``[0, G]``, where ``G`` (the number of
    experts in ``w1``) marks a pair this device does not compute; ``route_weights [N, k]`` fp32. Returns fp32
    ``[N, k, D]``: ``w · expert(x)`` per pair, exactly zero for the pairs marked ``G`` (they take no tile, so they
    cost nothing). Summing a row's pairs in choice order gives :func:`experts_sm90`'s bits."""
    from pallas_kernels.moe.layout import choice_rows_t

    y_t, lay = _expert_outputs_t(x, expert_ids, w1, w3, w2, swiglu_limit=swiglu_limit, up_config=up_config,
                                 down_config=down_config, decode=decode, ablate="")
    return choice_rows_t(y_t, lay, route_weights)


def _expert_outputs_t(x, expert_ids, w1, w3, w2, *, swiglu_limit, up_config, down_config, decode, ablate):
    """Both grouped GEMMs over the expert-sorted, tile-padded rows: ``(y_t [D, rows] fp32, layout)``."""
    from pallas_kernels.moe.layout import gather_rows_t, grouped_layout, num_rows

    if up_config.block_m != down_config.block_m:
        raise ValueError("both GEMMs must share block_m (they share the token tiles)")
    n, k = expert_ids.shape
    g_count = w1.shape[0]
    bm = up_config.block_m
    lay = grouped_layout(expert_ids, g_count, bm)
    rows = num_rows(n * k, g_count, bm)
    x_t = gather_rows_t(x.astype(jnp.bfloat16), lay, rows)
    a_t = _gemm(x_t, w1, lay, up_config, w_up=w3, swiglu_limit=swiglu_limit, decode=decode, ablate=ablate)
    y_t = _gemm(a_t, w2, lay, down_config, out_dtype=jnp.float32, decode=decode, ablate=ablate)
    return y_t, lay


def _gemm(x_t, w, lay, config: TileConfig, *, decode: str, **kw):
    """One grouped GEMM with the kernel the config names (``config.consumers``)."""
    if config.consumers == 1:
        if decode == "packed":
            raise ValueError("decode='packed' is implemented in the warp-specialised kernel only (consumers=2)")
        return grouped_matmul_t(x_t, w, lay.tile_group, config=config, decode=decode, **kw)
    from pallas_kernels.moe.kernel_sm90_ws import grouped_matmul_ws

    if decode == "float":
        raise ValueError("the warp-specialised kernel decodes FP4 by bit placement only (decode='bits' or 'packed')")
    return grouped_matmul_ws(x_t, w, lay.tile_group, lay.num_tiles, config=config, decode=decode, **kw)
