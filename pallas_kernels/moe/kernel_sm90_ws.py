"""Warp-specialised variant of the grouped expert GEMM (Hopper, Mosaic GPU).

Same contract and orientation as :func:`pallas_kernels.moe.kernel_sm90.grouped_matmul_t` (weights on the WGMMA M
side, dequantised in registers; tokens on the N side from shared memory). What changes is the organisation of a
CTA, which the single-warpgroup kernel's ablations showed to be its limit (docs/perf/moe_kernel_h200.md: even with
no FP4 decode it reached only 38% of copy bandwidth, because one warpgroup loads, converts and multiplies in turn):

* three warpgroups: one **producer** issues the TMA copies of weight and token tiles
  (``emit_pipeline_warp_specialized``) and two **consumers** each take half of the CTA's weight rows. While one
  consumer converts its FP4 tile, the other's MMA runs, and the producer keeps ``stages`` tiles in flight.
* the per-item pipelines are chained (``pipeline_state`` START / STEADY / STOP): the producer starts fetching the
  next work item's tiles while the consumers finish the current one, so there is no pipeline fill per item.
  Chaining needs the K steps per item to be a multiple of ``stages``; otherwise each item runs its own pipeline.
* each consumer fetches the UE8M0 scales of its rows for the **next** item while it computes the current one
  (two scale buffers), so the scale copy's latency is hidden as well.

Work items are (token tile, row block) pairs. Only tiles below ``num_tiles`` (the layout puts every used tile
first) are visited; SM ``s`` takes items ``s, s + #SM, …``, consecutive SMs sharing a token tile and expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.moe.fp4 import packed_to_int4, scale_bits, signed_codes_to_scaled_bf16_bits
from pallas_kernels.moe.kernel_sm90 import TileConfig, _scale_rows, _swizzle_transforms
from pallas_kernels.moe.reference import ExpertWeight

COMPUTE_WGS = 2
MEMORY_REGISTERS = 40
SMEM_BYTES = 232448   # H100/H200 dynamic shared memory per CTA


def grouped_matmul_ws(x_t: jax.Array, w: ExpertWeight, tile_group: jax.Array, num_tiles: jax.Array, *,
                      config: TileConfig, out_dtype=jnp.float32, w_up: ExpertWeight | None = None,
                      swiglu_limit: float | None = None, ablate: str = "") -> jax.Array:
    """Grouped GEMM over the padded layout with two consumer warpgroups and a TMA producer.

    ``config.block_n`` is the CTA's weight rows (each consumer takes ``block_n / 2``, a multiple of 64).

    Args:
      x_t: ``bf16 [K, rows]``; column block t belongs to expert ``tile_group[t]``.
      w: expert weight ``[G, N_out, K]`` ("fp4" or "bf16"); ``w_up`` the up projection for the fused SwiGLU.
      tile_group: ``int32 [rows / block_m]``; tiles ``≥ num_tiles`` are never read (their output is unwritten).
      num_tiles: ``int32`` scalar, tiles in use.
    Returns:
      ``out_t [N_out, rows]`` in ``out_dtype`` (bf16 when fused).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = config
    k, rows = x_t.shape
    _, n_out, k2 = w.shape
    if k2 != k:
        raise ValueError(f"weight reduction width {k2} != activation rows {k}")
    if rows % cfg.block_m:
        raise ValueError(f"rows={rows} is not a multiple of block_m={cfg.block_m}")
    if cfg.block_n % (64 * COMPUTE_WGS):
        raise ValueError(f"block_n={cfg.block_n} must be a multiple of {64 * COMPUTE_WGS} (64 rows per consumer)")
    cfg.check(n_out, k)
    fused = w_up is not None
    if fused and (w_up.shape != w.shape or w_up.fmt != w.fmt):
        raise ValueError("gate and up weights must have the same shape and format")
    if fused and swiglu_limit is None:
        raise ValueError("the fused gate/up product needs swiglu_limit")
    fmt = w.fmt
    if fmt not in ("fp4", "bf16"):
        raise ValueError(f"kernel supports fp4 and bf16 expert weights, got {fmt!r}")
    out_dtype = jnp.bfloat16 if fused else jnp.dtype(out_dtype)
    bm, cta_n, bk = cfg.block_m, cfg.block_n, cfg.block_k
    bn = cta_n // COMPUTE_WGS
    n_blocks = n_out // cta_n
    k_steps = k // bk
    kg = k // 32
    stages = min(cfg.stages, k_steps)
    chained = k_steps % stages == 0

    weights = [w] + ([w_up] if fused else [])
    nw = len(weights)
    if fmt == "fp4":
        w_data = [packed_to_int4(m.data) for m in weights]
        w_scales = [scale_bits(m.scale) for m in weights]
        w_dtype = jnp.int4
    else:
        w_data = [m.data.astype(jnp.bfloat16) for m in weights]
        w_scales = []
        w_dtype = jnp.bfloat16
    ns = len(w_scales)
    # Two scale buffers (prefetch the next item's) when shared memory allows, else one (fetched per item).
    pipeline_bytes = stages * (bk * bm * 2 + nw * cta_n * bk * jnp.dtype(w_dtype).itemsize)
    if fmt == "fp4":
        pipeline_bytes = stages * (bk * bm * 2 + nw * cta_n * bk // 2)
    fixed = COMPUTE_WGS * bn * bm * jnp.dtype(out_dtype).itemsize + 2048
    scale_slots = 2 if pipeline_bytes + fixed + 2 * COMPUTE_WGS * ns * bn * kg <= SMEM_BYTES else 1

    x_tr = _swizzle_transforms(plgpu, bm, jnp.bfloat16)
    w_tr = _swizzle_transforms(plgpu, bk, w_dtype)
    o_tr = _swizzle_transforms(plgpu, bm, out_dtype)
    num_sms = getattr(jax.devices()[0], "core_count", None) or 132

    def make_pipeline(step_fn, context, state):
        return plgpu.emit_pipeline_warp_specialized(
            step_fn,
            grid=(k_steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[plgpu.BlockSpec((bk, bm), lambda kk: (kk, 0), transforms=x_tr)]
            + [plgpu.BlockSpec((cta_n, bk), lambda kk: (0, kk), transforms=w_tr)] * nw,
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=stages,
            compute_context=context,
            pipeline_state=state,
        )

    def body(meta_gmem, tile_group_gmem, x_gmem, *refs):
        w_gmems = refs[:nw]
        s_gmems = refs[nw:nw + ns]
        out_gmem = refs[nw + ns]
        o_smem, s_smem, s_barrier = refs[nw + ns + 1:]
        sm = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        total = meta_gmem[0] * n_blocks
        count = jnp.maximum(total - sm + num_sms - 1, 0) // num_sms   # items of this SM

        def coords(i):
            item = sm + i * num_sms
            ti = item // n_blocks
            return ti, item % n_blocks, tile_group_gmem[ti]

        def fetch_scales(i):
            _, ni, g = coords(i)
            slot = i % scale_slots
            for j, s_gmem in enumerate(s_gmems):
                plgpu.copy_gmem_to_smem(s_gmem.at[g, pl.ds(ni * cta_n + wg * bn, bn)], s_smem.at[wg, slot, j],
                                        s_barrier.at[wg * scale_slots + slot])

        def ignore(*_, **__):
            return None

        def do_item(i, state):
            ti, ni, g = coords(i)
            slot = i % scale_slots

            def step(idx, x_smem, *rest):
                w_smems, accs = rest[:nw], rest[nw]
                (kk,) = idx
                for j in range(nw):
                    w_rows = w_smems[j].at[pl.ds(wg * bn, bn)]
                    if fmt == "fp4":
                        r = w_rows[...]
                        if ablate == "decode":
                            a = plgpu.layout_cast(r.astype(jnp.bfloat16), plgpu.Layout.WGMMA)
                        else:
                            bits = signed_codes_to_scaled_bf16_bits(r.astype(jnp.int16))
                            a = lax.bitcast_convert_type(bits, jnp.bfloat16)
                            if ablate == "scale":
                                a = plgpu.layout_cast(a, plgpu.Layout.WGMMA)
                            else:
                                s_chunk = s_smem.at[wg, slot, j].at[:, pl.ds(kk * (bk // 32), bk // 32)]
                                a = _scale_rows(plgpu, s_chunk, a, exponent_bias=126)
                        plgpu.wgmma(accs[j], a, x_smem)
                    else:
                        plgpu.wgmma(accs[j], w_rows, x_smem)
                plgpu.wgmma_wait(0)   # the slot is released to the producer when the step returns
                return accs

            def context(eval_pipeline):
                if ns and scale_slots == 1:
                    fetch_scales(i)
                elif ns:
                    @pl.when(i == 0)
                    def _():
                        fetch_scales(i)

                    @pl.when(i + 1 < count)
                    def _():
                        fetch_scales(i + 1)

                if ns:
                    plgpu.barrier_wait(s_barrier.at[wg * scale_slots + slot])

                def acc_scope(*accs):
                    eval_pipeline(tuple(accs))
                    return tuple(acc[...] for acc in accs)

                results = pl.run_scoped(acc_scope, *[plgpu.ACC((bn, bm), jnp.float32) for _ in range(nw)])
                if fused:
                    gate, up = results
                    gate = jnp.minimum(gate, swiglu_limit)
                    up = jnp.minimum(jnp.maximum(up, -swiglu_limit), swiglu_limit)
                    out = gate * jax.nn.sigmoid(gate) * up
                else:
                    (out,) = results
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # this consumer's previous store left o_smem
                o_smem.at[wg][...] = out.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg], out_gmem.at[pl.ds(ni * cta_n + wg * bn, bn), pl.ds(ti * bm, bm)])

            pipeline = make_pipeline(step, context, state)
            pipeline(x_gmem.at[:, pl.ds(ti * bm, bm)], *[wg_.at[g, pl.ds(ni * cta_n, cta_n)] for wg_ in w_gmems],
                     allocations=allocs)

        allocs = None

        def scoped(pipeline_allocs):
            nonlocal allocs
            allocs = pipeline_allocs
            if chained:
                from jax._src.pallas.mosaic_gpu.pipeline import PipelinePipeline

                @pl.when(count > 0)
                def _():
                    do_item(0, PipelinePipeline.START)

                @pl.loop(1, jnp.maximum(count - 1, 1))
                def _(i):
                    do_item(i, PipelinePipeline.STEADY)

                @pl.when(count > 1)
                def _():
                    do_item(count - 1, PipelinePipeline.STOP)
            else:
                @pl.loop(0, count)
                def _(i):
                    do_item(i, None)

        template = make_pipeline(ignore, ignore, None)
        pl.run_scoped(scoped, template.get_allocations(
            x_gmem.at[:, pl.ds(0, bm)], *[wg_.at[0, pl.ds(0, cta_n)] for wg_ in w_gmems]), collective_axes="wg")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    body.__name__ = f"moe_ws_{'gate_up' if fused else 'down'}_{fmt}"
    scratch = [
        plgpu.SMEM((COMPUTE_WGS, bn, bm), out_dtype, transforms=o_tr),
        plgpu.SMEM((COMPUTE_WGS, scale_slots, max(ns, 1), bn, kg), jnp.uint8),
        plgpu.Barrier(num_arrivals=max(ns, 1), num_barriers=COMPUTE_WGS * scale_slots),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_out, rows), out_dtype),
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    meta = jnp.reshape(num_tiles, (1,)).astype(jnp.int32)
    return kernel(meta, tile_group.astype(jnp.int32), x_t.astype(jnp.bfloat16), *w_data, *w_scales)
