"""Organisation ``"split_exchange"`` of the Hopper decode-attention kernel: the two CTAs of a token split the QK
product over d and exchange their partial logits through distributed shared memory.

Same contract as :func:`pallas_kernels.attention.decode_sm90.sparse_decode_attention` (whose ``organisation``
argument selects this kernel). Why it exists: in ``split_cta`` both CTAs of a token compute the whole ``S = Q Kᵀ``
(64 × 64 × 512 per KV step) and P·V on their half of the columns, so a third of the tensor work is a repeat and each
CTA loads every KV tile whole (64 KiB a step at d = 512, which with Q's 64 KiB leaves room for two stages).
``shared_qk`` removes the repeat but puts a token on one SM, which at 64 queries leaves half of the SMs idle.
Here the two CTAs of a token form a cluster and each keeps to its half of d:

* Grid ``(H / 64, N)`` with a cluster of the ``v_split = 2`` CTAs of a (head block, token) along ``"split"``; two
  warpgroups as ``split_cta`` (one computes, one issues TMA copies; registers 256 / 40).
* CTA ``c`` loads only its column chunk ``c`` of Q (``[64, dh]``, 32 KiB at d = 512) and of each KV tile
  (``[block_kv, dh]``, 32 KiB a 64-row step), so four stages fit where ``split_cta`` holds two.
* Per KV step: ``S_c = Q_c · K_cᵀ`` (one WGMMA), then ``plgpu.async_store_smem`` writes ``S_c`` (fp32 ``[64,
  block_kv]``, WGMMA layout) into the peer CTA's receive buffer for that step's parity; the store completes the
  bytes on the peer's "received" mbarrier. Each CTA waits for its own "received" barrier, loads ``S_peer`` and forms
  ``S = S_own + S_peer`` — one fp32 addition of the same two values in both CTAs (IEEE addition commutes), so both
  hold bitwise the same S, hence the same running max, P and sum (as ``shared_qk``'s two consumers). Then the
  online softmax of every organisation and ``P·V_c`` on the CTA's own columns of the same tile.
* Software-pipelined by one step: a CTA computes and sends step ``s + 1``'s partial before it waits for the peer's
  partial of step ``s`` and runs that step's softmax and P·V, so the exchange (a DSMEM round trip, ~1.4 µs a step
  on an H100 when it sat on the serial chain: docs/perf/attention_h200.md, third session of 2026-12-07) overlaps
  the previous step's work. The tile of step ``s + 1`` is in use while step ``s``'s P·V still reads its own, so
  the kernel needs two stages or more.
* Two receive buffers (by step parity). Before writing step ``s + 2``'s partial into the peer's buffer, a CTA
  waits on the cluster barrier "free" of that parity, on which both CTAs arrive once they have loaded step ``s``'s
  partial (so the peer's buffer is no longer read). Arrivals are made only for steps that a later step waits on,
  so every barrier phase is observed.
* Tensor work per CTA and step: 2 · 64 · 64 · dh (QK) + 2 · 64 · 64 · dh (P·V) — 2/3 of ``split_cta``'s; shared
  memory at d = 512, block_kv = 64, 4 stages: Q 32 KiB (reused for O) + KV 128 KiB + mask rows 1 KiB + sink + the
  receive buffers 2 × 16 KiB.

Exit safety: every partial a CTA receives is for a step it waits on, and every arrival it receives on "free" is for
a phase it waits on before its last send, so no CTA exits while its peer still writes into its shared memory.

Not run in jax 0.11.2's Mosaic GPU interpreter, which has no rule for ``async_store_smem`` (its discharge rejects
the store; measured 2026-12-07), so the exchange is checked on the GPU only.

GPU-only assumptions (beyond ``split_cta``'s; checked by tests/test_decode_attention_gpu.py): the register store
into the peer's (8, 32)-tiled, 128-byte-swizzled fp32 buffer (``st.async`` with ``complete_tx`` on the peer's
mbarrier; jax's own test of ``async_store_smem`` stores a WGMMA-layout fp32 array the same way); the ordering of a
CTA's plain loads of its receive buffer before the peer's next ``st.async`` into it by the cluster barrier's
release arrive / acquire wait.

Imports of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention.decode_sm90 import (
    COMPUTE_REGISTERS,
    HEADS_PER_CTA,
    LOG2E,
    _aligned,
    _online_softmax_step,
    _produce_kv,
)
from pallas_kernels.mgpu_compat import load_whole

PARTS = 2                     # CTAs of a token (cluster size); each owns d / 2 columns
RECEIVE_BUFFERS = 2           # partial logits in flight from the peer, by step parity


def exchange_smem_bytes(d: int, block_kv: int, stages: int) -> int:
    """Shared memory one CTA allocates, each buffer rounded up to 1 KiB as Pallas does: its Q chunk (``[64, d/2]``
    bf16, reused for O), ``stages`` KV chunks ``[block_kv, d/2]`` bf16 with their mask rows, the sink, the receive
    buffers (fp32 ``[64, block_kv]`` each) and the mbarriers (setup, loaded / consumed per stage, received / free per
    buffer)."""
    dh = d // PARTS
    barriers = 1 + 2 * stages + 2 * RECEIVE_BUFFERS
    return (_aligned(HEADS_PER_CTA * dh * 2) + _aligned(stages * block_kv * dh * 2) + _aligned(stages * block_kv * 4)
            + _aligned(HEADS_PER_CTA * 4) + _aligned(RECEIVE_BUFFERS * HEADS_PER_CTA * block_kv * 4) + 8 * barriers)


def exchange_call(q4: jax.Array, kv4: jax.Array, bias: jax.Array, sink: jax.Array, *, scale: float,
                  block_kv: int, stages: int) -> jax.Array:
    """The kernel on the split layouts (module docstring).

    Args:
      q4: ``bf16 [N, H, 2, dh]``; kv4: ``bf16 [N, L, 2, dh]``; bias: ``fp32 [N, L]`` (0 valid, −inf not); sink:
        ``fp32 [H]``. ``L`` a multiple of ``block_kv`` (a multiple of 64).
    Returns:
      ``bf16 [N, H, 2, dh]``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, h, parts, dh = q4.shape
    assert parts == PARTS, parts
    rows = kv4.shape[1]
    kv_steps = rows // block_kv
    hb = HEADS_PER_CTA
    qk_scale = float(scale) * LOG2E
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))   # fp32: 128-byte rows too

    def body(q_ref, kv_ref, bias_ref, sink_ref, o_ref, q_smem, kv_smem, bias_smem, sink_smem, recv_smem,
             setup_barrier, loaded_barriers, consumed_barriers, received_barriers, free_barriers):
        split = lax.axis_index("split")
        peer = 1 - split
        h0 = lax.axis_index("head_block") * hb
        tok = lax.axis_index("token")
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            plgpu.copy_gmem_to_smem(q_ref.at[tok, pl.ds(h0, hb), split], q_smem, setup_barrier)
            plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(h0, hb)], sink_smem, setup_barrier)
            plgpu.barrier_wait(setup_barrier)

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            m_i = load_whole(plgpu, sink_smem, row_layout) * LOG2E
            l_i = plgpu.layout_cast(jnp.full((hb,), 1.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.full((hb, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def own_logits(step):
                """Waits for KV step ``step``'s tile; ``S_c = Q_c · K_cᵀ`` (fp32 ``[64, block_kv]``)."""
                slot = lax.rem(step, jnp.array(stages, step.dtype))
                plgpu.barrier_wait(loaded_barriers.at[slot])

                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, kv_smem.at[slot, 0].transpose((1, 0)))
                    return acc_ref[...]

                return pl.run_scoped(compute_qk, plgpu.ACC((hb, block_kv), jnp.float32))

            def send(step, s_own):
                """Stores step ``step``'s partial logits into the peer's receive buffer of that parity, once the
                peer has loaded what was sent into it two steps before."""
                buf = lax.rem(step, jnp.array(RECEIVE_BUFFERS, step.dtype))

                @pl.when(step >= RECEIVE_BUFFERS)
                def _wait_free():
                    plgpu.barrier_wait(free_barriers.at[buf])

                plgpu.async_store_smem(s_own, recv_smem.at[buf], received_barriers.at[buf], cluster_idx=peer,
                                       cluster_dim="split")

            def finish(step, s_own, carry):
                """The peer's partial of step ``step``, the softmax and P·V; releases the stage."""
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.array(stages, step.dtype))
                buf = lax.rem(step, jnp.array(RECEIVE_BUFFERS, step.dtype))
                plgpu.barrier_wait(received_barriers.at[buf])
                s_peer = load_whole(plgpu, recv_smem.at[buf], plgpu.Layout.WGMMA)

                @pl.when(step + RECEIVE_BUFFERS < kv_steps)   # only phases a later send waits on
                def _free():
                    plgpu.barrier_arrive(free_barriers.at[buf])

                # S = S_0 + S_1 in both CTAs: the same two fp32 values added (commutative), the same bits
                qk = s_own + s_peer
                bias = load_whole(plgpu, bias_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                p16, acc, m_new, l_i = _online_softmax_step(qk, bias, m_i, l_i, acc, qk_scale=qk_scale)

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, kv_smem.at[slot, 0])

                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))

                @pl.when(step + stages < kv_steps)   # only stages the producer refills
                def _release():
                    plgpu.barrier_arrive(consumed_barriers.at[slot])

                return acc, m_new, l_i

            def kv_step(step, carry):
                # the next step's partial goes to the peer first, so it is in flight during this step's softmax
                # and P·V instead of on the serial chain
                *state, s_own = carry
                s_next = own_logits(step + 1)
                send(step + 1, s_next)
                return (*finish(step, s_own, tuple(state)), s_next)

            first = jnp.int32(0)
            s_first = own_logits(first)
            send(first, s_first)
            *state, s_last = lax.fori_loop(0, kv_steps - 1, kv_step, (acc, m_i, l_i, s_first))
            acc, m_i, l_i = finish(jnp.int32(kv_steps - 1), s_last, tuple(state))
            acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
            q_smem[...] = acc.astype(jnp.bfloat16)      # every QK product has been waited for: Q's buffer is free
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[tok, pl.ds(h0, hb), split])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _memory():
            # this CTA's column chunk only: a one-chunk view of the rows for the shared producer
            _produce_kv(kv_ref.at[:, :, pl.ds(split, 1)], bias_ref, kv_smem, bias_smem, loaded_barriers,
                        consumed_barriers, tok=tok, row0=0, chunks=1, block_kv=block_kv, stages=stages,
                        kv_steps=kv_steps)

    body.__name__ = f"sparse_decode_attention_exchange_d{PARTS * dh}_bkv{block_kv}_s{stages}"
    scratch = [
        plgpu.SMEM((hb, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages, 1, block_kv, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages, block_kv), jnp.float32),
        plgpu.SMEM((hb,), jnp.float32),
        plgpu.SMEM((RECEIVE_BUFFERS, hb, block_kv), jnp.float32, transforms=tiled32),
        plgpu.Barrier(num_arrivals=2),                                          # Q chunk + sink
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),                     # KV chunk + mask row
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),                     # the compute warpgroup is done
        plgpu.Barrier(num_arrivals=1, num_barriers=RECEIVE_BUFFERS),            # the peer's partial has landed
        # both CTAs have loaded their buffer of this parity (one arrival from each CTA of the cluster)
        plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=1, num_barriers=RECEIVE_BUFFERS),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(q4.shape, jnp.bfloat16),
        scratch_types=scratch,
        grid=(h // hb, n),
        grid_names=("head_block", "token"),
        cluster=(PARTS,),
        cluster_names=("split",),
        num_threads=2,
        thread_name="wg",
        # row reductions of the WGMMA layout stay inside a warp (shuffles), as in shared_qk: no scratch reserved
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    return kernel(q4, kv4, bias, sink)


__all__ = ["PARTS", "RECEIVE_BUFFERS", "exchange_call", "exchange_smem_bytes"]
