"""Organisation ``"seesaw"`` of the Hopper decode-attention kernel: FlashMLA's schedule for 64 heads — one CTA per
(L part, head block, token), two compute warpgroups taking the KV blocks two at a time, each computing the whole QK
product of its own block and P·V of both blocks on its half of the output columns.

Same contract as :func:`pallas_kernels.attention.decode_sm90.sparse_decode_attention` (whose ``organisation``
argument selects this kernel). Why it exists (docs/perf/attention_h200.md, third session of 2026-12-07): at 64
queries the kernels that exist either repeat the QK product on 128 CTAs (``split_cta``, ``split_cluster``) or
remove it with a synchronisation that costs more than it saves (``shared_qk``'s per-step logit exchange, a DSMEM
exchange); FlashMLA's "seesaw" schedule (described in docs/perf/attention_h200.md) computes each block's logits
once, in one warpgroup, and lets the other warpgroup's softmax run while it does.

* Grid ``(l_split, H / 64, N)`` as ``shared_qk``; three warpgroups: compute ``0`` and ``1`` (232 registers each),
  ``2`` issues the TMA copies (:func:`~pallas_kernels.attention.decode_sm90._produce_kv`, both column chunks of
  each block and its mask row).
* Warpgroup ``c`` owns the output columns ``[c·d/2, (c+1)·d/2)`` (accumulator ``[64, d/2]`` fp32, 128 registers
  per thread at d = 512). KV blocks go in rounds of two: block ``2r`` is warpgroup 0's, ``2r + 1`` warpgroup 1's.
  With running max ``m`` and sum ``l`` (base 2) at the start of a round:

  - warpgroup 0: ``s_0 = Q K_0ᵀ`` (all of d), ``m_0 = max(m, rowmax s_0)``, ``a_0 = 2^(m − m_0)``, ``p_0 =
    2^(s_0 − m_0)``; publishes ``m_0``; ``O_L ← O_L·a_0 + bf16(p_0)·V_0L``; reads ``m_1``, ``a_1 = 2^(m_0 − m_1)``;
    publishes ``p_0`` (fp32); reads ``p_1``; ``O_L ← O_L·a_1 + bf16(p_1)·V_1L``;
  - warpgroup 1: ``s_1 = Q K_1ᵀ``; reads ``m_0``; ``m_1 = max(m_0, rowmax s_1)``, ``a_1``, ``p_1 = 2^(s_1 −
    m_1)``; publishes ``m_1`` and ``p_1``; ``O_R ← O_R·(a_0·a_1) + bf16(p_1)·V_1R``; reads ``p_0``; ``O_R ← O_R
    + bf16(p_0·a_1)·V_0R``;
  - both: ``l ← (l·a_0 + Σ p_0)·a_1 + Σ p_1`` and ``m ← m_1`` — the same fp32 operations on the same values in
    both warpgroups (each sums the exchanged ``p`` it holds in registers), so both hold bitwise the same ``l``.

  An odd last block is warpgroup 0's alone (``a_1 = 1``), warpgroup 1 taking its ``p_0`` for ``O_R`` as above.
  Every P is rounded to bf16 relative to a running max, as in the other organisations, so the contract's bound
  is unchanged.
* Exchange buffers (fp32 ``[64, 64]`` in the WGMMA register layout through (8, 32)-tiled, 128-byte-swizzled shared
  memory, as ``shared_qk``'s): ``p_0`` and ``p_1``; and rows of one small fp32 buffer for ``m_0``, ``m_1`` (its
  other rows hold the stages' mask rows and the sink). Orderings: ``m_0`` / ``m_1`` / ``p_1`` are rewritten only
  after a wait that follows the other warpgroup's read of the previous value in its program order (``m_0`` after
  ``p_1``'s "ready", ``m_1`` and ``p_1`` after ``m_0``'s); ``p_0`` has its own "free" barrier.
* Stages hold whole blocks (both column chunks: 64 KiB at d = 512) and are released by both warpgroups (each after
  its last P·V on the block); each warpgroup also waits for the "loaded" barrier of every block it reads. Shared
  memory at d = 512, 2 stages: Q 64 KiB (reused for O) + KV 128 KiB + the small buffer + 2 × 16 KiB exchange =
  231,424 B + mbarriers, under the 232,448 B of a CTA only because no reduction scratch is reserved (row
  reductions stay inside a warp, as in ``shared_qk``).
* ``l_split > 1``: each part writes its unnormalised accumulators (through its warpgroup's exchange buffer, 64
  columns at a time, once the other warpgroup has read it for the last time) and its ``(m, l)``; XLA merges them
  (``decode_sm90._combine_parts``), as for ``shared_qk``.

Status (docs/perf/attention_h200.md, fourth session of 2026-12-07): exact on an H100 (GPU cases, and jax 0.11.2's
Mosaic GPU interpreter with its race detector), but the slowest organisation — 43.1 µs at 64 queries against 23.6
for ``split_cta`` with early release, 63.9 at 128 against ``shared_qk``'s 43.5. With bf16 rows only two 64 KiB
stages fit beside Q, a round holds both until it ends, and so the next round's loads wait for this round's compute.
Kept for FP8 / FP4 rows, whose stages are half or a quarter of the size. The CPU checks: lowering for CUDA, Mosaic's
shared-memory count, and the schedule's arithmetic emulated round by round in NumPy
(``tests/test_decode_attention_cpu.py::test_seesaw_schedule_matches_contract``). GPU-only assumptions: those of
``shared_qk`` (the exchange through swizzled fp32 buffers, the register-A WGMMA of P, ``setmaxnreg`` 232 / 40 with
384 threads).

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
    _produce_kv,
    parts_kernel,
    store_output,
    store_partial,
    store_stats,
)
from pallas_kernels.mgpu_compat import load_whole

CONSUMERS = 2                 # compute warpgroups; c owns output columns [c·d/2, (c+1)·d/2)
BLOCK_KV = 64                 # KV rows a block: a mask row is one row of the small buffer ([., 64] fp32)
BARRIERS_FIXED = 7            # setup, m0 / m1 / p0 / p1 ready, p0 / p1 free


def seesaw_smem_bytes(d: int, block_kv: int, stages: int) -> int:
    """Shared memory one CTA allocates, each buffer rounded up to 1 KiB as Pallas does: Q (``[64, d]`` bf16, reused
    for O), ``stages`` KV blocks (``[block_kv, d]`` bf16), the small fp32 buffer (``stages`` mask rows, the sink,
    ``m_0``, ``m_1``), the two fp32 exchange buffers ``[64, block_kv]`` and the mbarriers."""
    barriers = BARRIERS_FIXED + 2 * stages
    return (_aligned(HEADS_PER_CTA * d * 2) + _aligned(stages * block_kv * d * 2)
            + _aligned((stages + 3) * HEADS_PER_CTA * 4) + 2 * _aligned(HEADS_PER_CTA * block_kv * 4) + 8 * barriers)


def seesaw_call(q4: jax.Array, kv4: jax.Array, bias: jax.Array, sink: jax.Array, *, scale: float, block_kv: int,
                stages: int, l_split: int):
    """The kernel (module docstring).

    Args:
      q4: ``bf16 [N, H, 2, dh]``; kv4: ``bf16 [N, L, 2, dh]``; bias: ``fp32 [N, L]`` (0 valid, −inf not); sink:
        ``fp32 [H]``. ``block_kv`` must be 64; ``L / 64`` a multiple of ``l_split``.
    Returns:
      ``l_split == 1``: ``bf16 [N, H, 2, dh]``. ``l_split > 1``: ``(acc fp32 [l_split, N, H, 2, dh], ml fp32
      [l_split, N, 2, H])`` as ``_shared_qk_call``'s, for ``decode_sm90._combine_parts``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, h, consumers, dh = q4.shape
    assert consumers == CONSUMERS and block_kv == BLOCK_KV, (consumers, block_kv)
    rows = bias.shape[1]
    kv_steps = rows // block_kv // l_split      # KV blocks per CTA
    rounds, tail = divmod(kv_steps, 2)
    p0_uses = rounds + tail                     # p_0 is published every round and for an odd last block
    hb = HEADS_PER_CTA
    qk_scale = float(scale) * LOG2E
    split_l = l_split > 1
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    sink_row, m0_row, m1_row = stages, stages + 1, stages + 2

    def body(q_ref, kv_ref, bias_ref, sink_ref, *refs):
        if split_l:
            acc_ref, ml_ref, *refs = refs
        else:
            o_ref, *refs = refs
        (q_smem, kv_smem, small, p0_smem, p1_smem, setup, loaded, consumed, m0_ready, m1_ready, p0_ready,
         p1_ready, p0_free, p1_free) = refs
        part = lax.axis_index("part")
        h0 = lax.axis_index("head_block") * hb
        tok = lax.axis_index("token")
        wg = lax.axis_index("wg")
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        bcast = lambda v, shape: lax.broadcast_in_dim(v, shape, [0])   # noqa: E731 - one value per head (row)

        def wait_loaded(block):
            plgpu.barrier_wait(loaded.at[lax.rem(block, jnp.array(stages, block.dtype))])

        def logits(block):
            """``s = scale·log2(e)·Q Kᵀ + mask`` of a block, all of d (fp32 ``[64, 64]``)."""
            slot = lax.rem(block, jnp.array(stages, block.dtype))

            def compute_qk(acc_ref):
                for chunk in range(consumers):
                    plgpu.wgmma(acc_ref, q_smem.at[chunk], kv_smem.at[slot, chunk].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(compute_qk, plgpu.ACC((hb, block_kv), jnp.float32))
            mask = load_whole(plgpu, small.at[slot], plgpu.Layout.WGMMA.reduce(0))
            return s * qk_scale + lax.broadcast_in_dim(mask, s.shape, [1])

        def pv(acc, p, block, c):
            """``acc + bf16(p) · V_c`` of a block (``acc fp32 [64, dh]``)."""
            slot = lax.rem(block, jnp.array(stages, block.dtype))

            def compute(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(jnp.bfloat16), kv_smem.at[slot, c])

            return pl.run_state(compute)(plgpu.ACC.init(acc))

        def release(block):
            @pl.when(block + stages < kv_steps)        # only blocks whose stage the producer refills
            def _release():
                plgpu.barrier_arrive(consumed.at[lax.rem(block, jnp.array(stages, block.dtype))])

        def publish_row(row, value, ready):
            small.at[row][...] = value
            plgpu.barrier_arrive(ready)

        def read_row(row, ready):
            plgpu.barrier_wait(ready)
            return load_whole(plgpu, small.at[row], row_layout)

        def publish_p0(use, p0):
            @pl.when(use > 0)                          # warpgroup 1 has loaded the previous p_0
            def _free():
                plgpu.barrier_wait(p0_free)

            p0_smem[...] = p0
            plgpu.barrier_arrive(p0_ready)

        def compute(c: int):
            plgpu.set_max_registers(SHARED_QK_COMPUTE_REGISTERS, action="increase")
            if c == 0:
                for chunk in range(consumers):
                    plgpu.copy_gmem_to_smem(q_ref.at[tok, pl.ds(h0, hb), chunk], q_smem.at[chunk], setup)
                plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(h0, hb)], small.at[sink_row], setup)
            plgpu.barrier_wait(setup)
            m = load_whole(plgpu, small.at[sink_row], row_layout) * LOG2E
            l_sum = plgpu.layout_cast(jnp.full((hb,), 1.0, jnp.float32), row_layout)
            if split_l:                                # the sink's exp(0) = 1 is counted once, in part 0
                l_sum = l_sum * (part == 0).astype(jnp.float32)
            acc = plgpu.layout_cast(jnp.full((hb, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def round_wg0(r, carry):
                acc, m, l_sum = carry
                b0, b1 = 2 * r, 2 * r + 1
                wait_loaded(b0)
                s0 = logits(b0)
                m0 = jnp.maximum(m, s0.max(axis=1))
                a0 = jnp.exp2(m - m0)
                p0 = jnp.exp2(s0 - bcast(m0, s0.shape))
                sum0 = p0.sum(axis=1)
                publish_row(m0_row, m0, m0_ready)
                acc = pv(acc * bcast(a0, acc.shape), p0, b0, 0)
                m1 = read_row(m1_row, m1_ready)
                a1 = jnp.exp2(m0 - m1)
                publish_p0(r, p0)
                plgpu.barrier_wait(p1_ready)
                p1 = load_whole(plgpu, p1_smem, plgpu.Layout.WGMMA)
                if split_l:                            # p1_smem is warpgroup 1's output buffer after the last round
                    @pl.when(r + 1 == rounds)
                    def _last_read():
                        plgpu.barrier_arrive(p1_free)
                wait_loaded(b1)
                acc = pv(acc * bcast(a1, acc.shape), p1, b1, 0)
                release(b0)
                release(b1)
                l_sum = (l_sum * a0 + sum0) * a1 + p1.sum(axis=1)
                return acc, m1, l_sum

            def round_wg1(r, carry):
                acc, m, l_sum = carry
                b0, b1 = 2 * r, 2 * r + 1
                wait_loaded(b1)
                s1 = logits(b1)
                m0 = read_row(m0_row, m0_ready)
                a0 = jnp.exp2(m - m0)
                m1 = jnp.maximum(m0, s1.max(axis=1))
                a1 = jnp.exp2(m0 - m1)
                p1 = jnp.exp2(s1 - bcast(m1, s1.shape))
                sum1 = p1.sum(axis=1)
                publish_row(m1_row, m1, m1_ready)
                p1_smem[...] = p1                      # rewritten only after m_0's "ready": warpgroup 0 has read it
                plgpu.barrier_arrive(p1_ready)
                acc = pv(acc * bcast(a0 * a1, acc.shape), p1, b1, 1)
                plgpu.barrier_wait(p0_ready)
                p0 = load_whole(plgpu, p0_smem, plgpu.Layout.WGMMA)
                if split_l:                            # p0_smem is warpgroup 0's output buffer at the end
                    plgpu.barrier_arrive(p0_free)
                else:
                    @pl.when(r + 1 < p0_uses)          # only reads a later publication waits for
                    def _read():
                        plgpu.barrier_arrive(p0_free)

                wait_loaded(b0)
                acc = pv(acc, p0 * bcast(a1, p0.shape), b0, 1)
                release(b0)
                release(b1)
                l_sum = (l_sum * a0 + p0.sum(axis=1)) * a1 + sum1
                return acc, m1, l_sum

            carry = lax.fori_loop(0, rounds, round_wg0 if c == 0 else round_wg1, (acc, m, l_sum))
            acc, m, l_sum = carry
            if tail:                                   # an odd last block: warpgroup 0's alone
                last = jnp.int32(kv_steps - 1)
                if c == 0:
                    wait_loaded(last)
                    s0 = logits(last)
                    m0 = jnp.maximum(m, s0.max(axis=1))
                    a0 = jnp.exp2(m - m0)
                    p0 = jnp.exp2(s0 - bcast(m0, s0.shape))
                    publish_row(m0_row, m0, m0_ready)
                    publish_p0(jnp.int32(rounds), p0)
                    acc = pv(acc * bcast(a0, acc.shape), p0, last, 0)
                else:
                    m0 = read_row(m0_row, m0_ready)
                    a0 = jnp.exp2(m - m0)
                    plgpu.barrier_wait(p0_ready)
                    p0 = load_whole(plgpu, p0_smem, plgpu.Layout.WGMMA)
                    if split_l:
                        plgpu.barrier_arrive(p0_free)
                    wait_loaded(last)
                    acc = pv(acc * bcast(a0, acc.shape), p0, last, 1)
                release(last)
                l_sum = l_sum * a0 + p0.sum(axis=1)
                m = m0

            if not split_l:
                # both warpgroups' QK products are done (module docstring): Q's buffer is free
                store_output(acc, l_sum, q_smem.at[c], o_ref.at[tok, pl.ds(h0, hb), c])
                return

            # L split: the unnormalised accumulator goes out through this warpgroup's exchange buffer, 64 columns
            # at a time, once the other warpgroup has read it for the last time
            out = p0_smem if c == 0 else p1_smem
            if c == 0 or rounds:                       # with no full round p_1 was never published
                plgpu.barrier_wait(p0_free if c == 0 else p1_free)
            store_partial(acc, out, acc_ref.at[part, tok, pl.ds(h0, hb), c])
            if c == 0:                                 # m and l are the same in both warpgroups; warpgroup 1 read
                # m_0 before its last p_0 (waited above), so both rows are free
                store_stats(m, l_sum, small.at[m0_row], small.at[m1_row], ml_ref.at[part, tok, :, pl.ds(h0, hb)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 0)
        def _wg0():
            compute(0)

        @pl.when(wg == 1)
        def _wg1():
            compute(1)

        @pl.when(wg == consumers)
        def _memory():
            # the mask rows land in rows 0 … stages − 1 of the small buffer
            _produce_kv(kv_ref, bias_ref, kv_smem, small, loaded, consumed, tok=tok, row0=part * (kv_steps * block_kv),
                        chunks=consumers, block_kv=block_kv, stages=stages, kv_steps=kv_steps)

    body.__name__ = f"sparse_decode_attention_seesaw_d{consumers * dh}{f'_l{l_split}' if split_l else ''}"
    scratch = [
        plgpu.SMEM((consumers, hb, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages, consumers, block_kv, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages + 3, hb), jnp.float32),             # mask rows, sink, m_0, m_1
        plgpu.SMEM((hb, block_kv), jnp.float32, transforms=tiled32),
        plgpu.SMEM((hb, block_kv), jnp.float32, transforms=tiled32),
        plgpu.Barrier(num_arrivals=consumers + 1),                            # Q chunks + sink
        plgpu.Barrier(num_arrivals=consumers + 1, num_barriers=stages),       # a block's chunks + its mask row
        plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),           # both warpgroups done with a block
        *(plgpu.Barrier(num_arrivals=1) for _ in range(6)),                   # m0 / m1 / p0 / p1 ready, p0 / p1 free
    ]
    return parts_kernel(body, scratch, q4, l_split, consumers)(q4, kv4, bias, sink)


__all__ = ["BLOCK_KV", "CONSUMERS", "seesaw_call", "seesaw_smem_bytes"]
