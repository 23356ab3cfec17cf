"""Organisation ``"pingpong"`` of the Hopper decode-attention kernel: two consumer warpgroups on alternate KV blocks.

Same contract as :func:`pallas_kernels.attention.decode_sm90.sparse_decode_attention` (whose ``organisation``
argument selects this kernel). Why it exists: ``split_cta`` (one compute warpgroup a CTA) runs each KV block's
QK product, online softmax and P·V one after another, so the tensor cores idle during every softmax; at the real
decode size (64 queries, 64 heads × 512, 640 rows) it reaches 52–55% of the H200's copy bandwidth
(``docs/perf/attention_h200.md``). Here a CTA has two compute warpgroups that take the KV blocks in turn, so one's
softmax runs while the other's WGMMAs do (the overlap FlashAttention 3 gets from its two warpgroups; unlike FA3 the
order is not forced by named barriers, the warp schedulers interleave them).

* Grid and split of d as ``split_cta``: ``(v_split, H / 64, N)``, one CTA per (column chunk of d, block of 64
  heads, query token); every CTA computes the whole ``S = Q Kᵀ`` and ``P·V`` for its ``d / v_split`` columns.
* Three warpgroups: consumers 0 and 1 (``set_max_registers`` 232 each), warpgroup 2 issues the TMA copies (40).
  Consumer ``c`` takes KV blocks ``c, c + 2, c + 4, …`` with its own accumulator ``[64, dh]``, running max and
  running sum; consumer 0 starts with the sink's ``exp(0) = 1`` in its sum, consumer 1 with 0 (the sink counted
  once), both with the sink's max.
* Stages: block ``j`` uses stage ``j mod stages``; when stages are refilled their number must be even, so a stage
  only ever carries blocks of one consumer (each barrier phase is waited for by the warpgroup that consumes it, in
  order). Shared memory at d = 512: Q 64 KiB + ``stages · block_kv · 1 KiB`` of KV; ``block_kv = 32`` with 4
  stages (two tiles in flight per consumer) or ``block_kv = 64`` with 2 (the default of ``split_cta``'s size).
* Merge: both consumers publish ``(m_c, l_c)`` (fp32 ``[64]`` each) and wait for each other ("stats" barrier);
  with ``m = max(m_0, m_1)``, ``e_c = 2^(m_c − m)`` and ``total = l_0 e_0 + l_1 e_1`` (the same operations in the
  same order in both, so the same bits), consumer 1 sends ``acc_1 · e_1`` to consumer 0 in fp32 chunks of
  ``[64, 64]`` through one shared buffer ("written" / "read" barriers), and consumer 0 writes
  ``bf16((acc_0 · e_0 + acc_1 · e_1) / total)`` chunk by chunk (TMA stores from a ``[64, 64]`` bf16 buffer).
  Each consumer rounds P to bf16 relative to its own running max, as ``shared_qk`` does per L part, so the
  contract's error bound is unchanged.

GPU-only assumptions (on top of ``split_cta``'s and ``shared_qk``'s, see ``decode_sm90``): ``block_kv = 32`` tiles
(WGMMA N = 32 for QK, K = 32 for P·V, 32-entry mask rows); the fp32 chunk exchange through a (8, 32)-tiled,
128-byte-swizzled buffer, ordered by mbarriers (as ``shared_qk``'s exchange); TMA stores of ``[64, 64]`` bf16 chunks
into the 4-D output.

Imports of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention.decode_sm90 import (
    HEADS_PER_CTA,
    LOG2E,
    SHARED_QK_COMPUTE_REGISTERS,
    _aligned,
    _online_softmax_step,
    _produce_kv,
)
from pallas_kernels.mgpu_compat import load_whole

CONSUMERS = 2
MERGE_COLUMNS = 64            # columns of the fp32 chunks consumer 1 hands to consumer 0 (16 KiB a chunk)


def pingpong_smem_bytes(d: int, block_kv: int, stages: int) -> int:
    """Shared memory one CTA allocates, each buffer rounded up to 1 KiB as Pallas does: Q (``[64, d]`` bf16), the
    KV stages, their mask rows, the sink, the consumers' ``(m, l)``, the fp32 merge chunk, the bf16 output chunk,
    and the mbarriers (setup, loaded / consumed per stage, stats, written, read)."""
    barriers = 1 + 2 * stages + 3
    return (_aligned(HEADS_PER_CTA * d * 2) + _aligned(stages * block_kv * d * 2) + _aligned(stages * block_kv * 4)
            + _aligned(HEADS_PER_CTA * 4) + _aligned(CONSUMERS * 2 * HEADS_PER_CTA * 4)
            + _aligned(HEADS_PER_CTA * MERGE_COLUMNS * 4) + _aligned(HEADS_PER_CTA * MERGE_COLUMNS * 2) + 8 * barriers)


def pingpong_call(q4: jax.Array, kv4: jax.Array, bias: jax.Array, sink: jax.Array, *, scale: float,
                  block_kv: int, stages: int) -> jax.Array:
    """The kernel on the split layouts.

    Args:
      q4: ``bf16 [N, H, v_split, dh]``; kv4: ``bf16 [N, L, v_split, dh]``; bias: ``fp32 [N, L]`` (0 valid, −inf
        not); sink: ``fp32 [H]``. ``dh`` a multiple of :data:`MERGE_COLUMNS`, ``L`` of ``block_kv``.
    Returns:
      ``bf16 [N, H, v_split, dh]``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, h, v_split, dh = q4.shape
    rows = kv4.shape[1]
    kv_steps = rows // block_kv
    hb = HEADS_PER_CTA
    qk_scale = float(scale) * LOG2E
    rounds = dh // MERGE_COLUMNS
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    # the P·V WGMMA contracts over the tile's block_kv rows in groups of one swizzle width: 128-byte swizzling needs
    # K ≥ 64 bf16, so 32-row tiles are stored with 64-byte swizzling (and Q with them: the QK WGMMA's operands
    # must share a swizzle)
    kv_tiled = tiled if block_kv % 64 == 0 else (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))

    def body(q_ref, kv_ref, bias_ref, sink_ref, o_ref, q_smem, kv_smem, bias_smem, sink_smem, ml_smem, merge_smem,
             out_smem, setup_barrier, loaded_barriers, consumed_barriers, stats_barrier, written_barrier,
             read_barrier):
        split = lax.axis_index("split")
        h0 = lax.axis_index("head_block") * hb
        tok = lax.axis_index("token")
        wg = lax.axis_index("wg")
        row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per head (accumulator row)

        def consume(c: int) -> None:
            plgpu.set_max_registers(SHARED_QK_COMPUTE_REGISTERS, action="increase")
            if c == 0:
                for chunk in range(v_split):
                    plgpu.copy_gmem_to_smem(q_ref.at[tok, pl.ds(h0, hb), chunk], q_smem.at[chunk], setup_barrier)
                plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(h0, hb)], sink_smem, setup_barrier)
            plgpu.barrier_wait(setup_barrier)

            m_i = load_whole(plgpu, sink_smem, row_layout) * LOG2E
            l_i = plgpu.layout_cast(jnp.full((hb,), 1.0 if c == 0 else 0.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.full((hb, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def kv_step(i, carry):
                acc, m_i, l_i = carry
                block = 2 * i + c
                slot = lax.rem(block, jnp.array(stages, block.dtype))
                plgpu.barrier_wait(loaded_barriers.at[slot])

                def compute_qk(acc_ref):
                    for chunk in range(v_split):
                        plgpu.wgmma(acc_ref, q_smem.at[chunk], kv_smem.at[slot, chunk].transpose((1, 0)))
                    return acc_ref[...]

                qk = pl.run_scoped(compute_qk, plgpu.ACC((hb, block_kv), jnp.float32))
                bias = load_whole(plgpu, bias_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                p16, acc, m_new, l_i = _online_softmax_step(qk, bias, m_i, l_i, acc, qk_scale=qk_scale)

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, kv_smem.at[slot, split])

                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))

                @pl.when(block + stages < kv_steps)   # only stages the producer refills: no phase left unobserved
                def _release():
                    plgpu.barrier_arrive(consumed_barriers.at[slot])

                return acc, m_new, l_i

            acc, m_i, l_i = lax.fori_loop(0, (kv_steps - c + 1) // 2, kv_step, (acc, m_i, l_i))

            ml_smem.at[c, 0][...] = m_i
            ml_smem.at[c, 1][...] = l_i
            plgpu.barrier_arrive(stats_barrier)
            plgpu.barrier_wait(stats_barrier)
            m0, l0 = (load_whole(plgpu, ml_smem.at[0, k], row_layout) for k in range(2))
            m1, l1 = (load_whole(plgpu, ml_smem.at[1, k], row_layout) for k in range(2))
            m = jnp.maximum(m0, m1)
            e0, e1 = jnp.exp2(m0 - m), jnp.exp2(m1 - m)

            if c == 1:
                scaled = acc * lax.broadcast_in_dim(e1, acc.shape, [0])
                for r in range(rounds):
                    if r:
                        plgpu.barrier_wait(read_barrier)   # consumer 0 has loaded the previous chunk
                    merge_smem[...] = scaled[:, r * MERGE_COLUMNS:(r + 1) * MERGE_COLUMNS]
                    plgpu.barrier_arrive(written_barrier)
                return

            total = l0 * e0 + l1 * e1                      # ≥ the sink's e0 > 0
            inv = 1.0 / total
            for r in range(rounds):
                cols = slice(r * MERGE_COLUMNS, (r + 1) * MERGE_COLUMNS)
                plgpu.barrier_wait(written_barrier)
                other = load_whole(plgpu, merge_smem, plgpu.Layout.WGMMA)
                if r + 1 < rounds:
                    plgpu.barrier_arrive(read_barrier)
                own = acc[:, cols] * lax.broadcast_in_dim(e0, (hb, MERGE_COLUMNS), [0])
                o = (own + other) * lax.broadcast_in_dim(inv, (hb, MERGE_COLUMNS), [0])
                if r:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous chunk's store has read it
                out_smem[...] = o.astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, o_ref.at[tok, pl.ds(h0, hb), split, pl.ds(r * MERGE_COLUMNS,
                                                                                         MERGE_COLUMNS)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 0)
        def _consumer0():
            consume(0)

        @pl.when(wg == 1)
        def _consumer1():
            consume(1)

        @pl.when(wg == CONSUMERS)
        def _memory():
            _produce_kv(kv_ref, bias_ref, kv_smem, bias_smem, loaded_barriers, consumed_barriers, tok=tok, row0=0,
                        chunks=v_split, block_kv=block_kv, stages=stages, kv_steps=kv_steps)

    body.__name__ = f"sparse_decode_attention_pingpong_d{v_split * dh}_bkv{block_kv}"
    scratch = [
        plgpu.SMEM((v_split, hb, dh), jnp.bfloat16, transforms=kv_tiled),
        plgpu.SMEM((stages, v_split, block_kv, dh), jnp.bfloat16, transforms=kv_tiled),
        plgpu.SMEM((stages, block_kv), jnp.float32),
        plgpu.SMEM((hb,), jnp.float32),
        plgpu.SMEM((CONSUMERS, 2, hb), jnp.float32),
        plgpu.SMEM((hb, MERGE_COLUMNS), jnp.float32, transforms=tiled32),
        plgpu.SMEM((hb, MERGE_COLUMNS), jnp.bfloat16, transforms=tiled),
        plgpu.Barrier(num_arrivals=v_split + 1),                                # Q chunks + sink
        plgpu.Barrier(num_arrivals=v_split + 1, num_barriers=stages),          # KV chunks + mask row
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),                    # the stage's consumer is done
        plgpu.Barrier(num_arrivals=CONSUMERS),                                 # both (m, l) published
        plgpu.Barrier(num_arrivals=1),                                         # consumer 1's chunk written
        plgpu.Barrier(num_arrivals=1),                                         # consumer 0 has loaded it
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(q4.shape, jnp.bfloat16),
        scratch_types=scratch,
        grid=(v_split, h // hb, n),
        grid_names=("split", "head_block", "token"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    return kernel(q4, kv4, bias, sink)


__all__ = ["CONSUMERS", "MERGE_COLUMNS", "pingpong_call", "pingpong_smem_bytes"]
