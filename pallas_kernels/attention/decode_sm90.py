"""Decode attention over gathered rows for Hopper (Mosaic GPU): DeepSeek-V4 MQA with a shared latent K = V.

Contract (the same as :func:`pallas_kernels.attention.reference.sparse_decode_attention_ref`)::

    sparse_decode_attention(q, kv, valid, sink, *, scale) -> o
    q     [N, H, d]  bf16   H a multiple of 64; d a multiple of 64 · v_split with d / v_split ≤ 256 (d = 512 real)
    kv    [N, L, d]  bf16   L a multiple of block_kv (the rows query n attends over; value rows = key rows)
    valid [N, L]     bool   False: padding / outside the window, contributes exactly 0 (its kv row must still be
                            finite: the masked probability is 0, and 0 · NaN is NaN in the P·V product)
    sink  [H]        fp32   per-head logit in the softmax denominator only (must be finite)
    o     [N, H, d]  bf16
    s[n,h,l] = scale · <q[n,h], kv[n,l]>  (bf16 products, fp32 accumulation)
    p = softmax over {s[n,h,l] : valid l} ∪ {sink[h]};  o[n,h] = Σ_l p[n,h,l] · kv[n,l]
    P is rounded to bf16 before the P·V product (fp32 accumulation); o is rounded to bf16. A query with no valid row
    gets o = 0 (all its mass is on the sink).

Five organisations, chosen by ``sparse_decode_attention(..., organisation=...)``: ``"split_cta"`` (the default),
``"split_cluster"`` and ``"shared_qk"``, all below, ``"pingpong"`` (``split_cta``'s grid with two compute
warpgroups taking the KV blocks in turn, so one's softmax overlaps the other's WGMMAs;
:mod:`pallas_kernels.attention.decode_pingpong_sm90`) and ``"seesaw"`` (FlashMLA's schedule: one CTA per token and
L part, two compute warpgroups each computing the QK product of alternate blocks and P·V of both on half the
columns; :mod:`pallas_kernels.attention.decode_seesaw_sm90`: exact on an H100 but the slowest, 43 µs at 64
queries, because with bf16 rows only two KV stages fit and loads alternate with compute). Tried and removed after
measuring (docs/perf/attention_h200.md): a QK product issued one step ahead (``qk_ahead``), KV steps prefetched into
L2, and the two CTAs of a token exchanging partial logits through distributed shared memory (``split_exchange``,
commit e02c203: exact, but 34–40 µs against 24 at 64 queries on an H100).

:func:`sparse_decode_attention_rows` is ``split_cta`` reading its rows from a pool by index (bf16 rows copied with
``cp.async`` into the tiles, or ``v41_fp4`` rows decoded into them; :mod:`pallas_kernels.attention.row_gather_sm90`):
the same compute warpgroup, another memory warpgroup (:func:`_produce_gathered`).

Organisation ``split_cta`` (one kernel launch, no combine step):

* Grid ``(v_split, H / 64, N)``, one CTA per (column split of d, block of 64 heads, query token). The split is the
  fastest grid axis, so the CTAs that read the same token's rows run side by side and the second read of a KV
  tile hits L2. At the real size (N = 64, H = 64, d = 512, v_split = 2) that is 128 CTAs for the H200's 132 SMs.
* Why the split of d: the fp32 output accumulator of 64 heads × 512 columns is 256 registers per thread in one
  warpgroup (more than a thread has); 64 × 256 is 128. Every CTA computes the full ``S = Q Kᵀ`` (contraction over
  all d) and ``P·V`` for its ``d / v_split`` columns only, so the QK product is done ``v_split`` times (the price of
  not exchanging P between CTAs).
* Two warpgroups (``num_threads=2``), organised as jax's ``attention_mgpu.py`` forward kernel (manual TMA +
  mbarriers, Lane semantics) with one compute warpgroup instead of two: warpgroup 0 computes (online softmax in
  fp32 registers), warpgroup 1 only issues TMA copies; ``set_max_registers`` gives them 256 / 40 registers per
  thread, the split jax's warp-specialised pipeline uses for one compute warpgroup. One compute warpgroup holds all
  64 heads (the WGMMA M = 64).
* Shared memory: d is stored as ``v_split`` column chunks of ``dh = d / v_split`` so that every WGMMA operand is a
  whole ``[rows, dh]`` buffer (128-byte swizzle, (8, 64) tiles, as jax's attention kernel), never a column slice of
  a swizzled tile. Q: ``[v_split, 64, dh]`` bf16 (64 KiB at d = 512), loaded once; it is reused for the output tile
  once the last QK product has been read. KV: ``[stages, v_split, block_kv, dh]`` bf16 (64 KiB per stage at d = 512,
  block_kv = 64) plus the stage's additive mask row ``[stages, block_kv]`` fp32. At d = 512 two stages fit (192 KiB
  + 0.8 KiB of the 227 KiB per CTA); three would not (256 KiB).
* Per KV step: ``S = Σ_c Q_c · K_cᵀ`` (``v_split`` WGMMAs into one fp32 accumulator, K read through a transposed
  shared-memory view); ``S · scale · log2(e) + bias`` with ``bias`` = 0 / −inf from ``valid`` (prepared by the
  wrapper as fp32 ``[N, L]``, copied per step with the KV tile, broadcast over the heads in the WGMMA column
  layout); online softmax in base 2; ``P`` cast to bf16 and used as the WGMMA A operand from registers against
  ``V`` = this CTA's column chunk of the same KV tile; then the stage is released to the producer.
* The sink: each head's running max starts at ``sink[h]`` (in base 2) and its running sum at 1 (= exp(sink − sink)),
  with a zero accumulator; masked logits are −inf, so a row with no valid entry keeps the sink's max, adds
  exp2(−inf) = 0 and ends with ``o = 0 / 1 = 0``.
* Pipeline: the producer issues ``stages`` tiles up front, then waits on the stage's "consumed" barrier before each
  refill; the compute warpgroup waits on the stage's "loaded" barrier (``v_split`` KV copies + 1 mask copy arrive on
  it) and arrives on "consumed" only for steps whose stage is refilled (no barrier phase is left unobserved). There
  is no QK/softmax/PV overlap inside a CTA (one compute warpgroup); at decode sizes the launch is short (10 KV steps
  at L = 640) and the copies of the next stage overlap the current step's compute.

Two options of ``split_cta`` that keep more KV bytes in flight (the batch-64 kernel's time followed the bytes in
flight per SM in ``pingpong``'s measurements, docs/perf/attention_h200.md):

* ``block_kv=32, num_stages=4``: the same 128 KiB of KV stages in four 32-row tiles, so while the compute warpgroup
  works on one tile three (96 KiB) are being loaded instead of one (64 KiB). 32-row tiles are stored (8, 32)-tiled
  with 64-byte swizzling (Q too: the QK WGMMA's operands share a swizzle), as ``pingpong``'s: 128-byte swizzling
  needs a P·V contraction of at least 64 rows.
* ``early_release=True``: a stage's column chunks other than the CTA's own are read only by the QK product, so they
  are released on a second "consumed" barrier as soon as that product has been waited for, and the producer
  refills them during the softmax and P·V; the own chunk and the mask row follow on the first barrier after P·V.
  The stage's "loaded" barrier still expects all ``v_split`` chunks and the mask row.

Organisation ``split_cluster`` (``split_cta`` with each tile read once):

* The same CTAs, warpgroups, buffers and per-step work as ``split_cta``, but the ``v_split`` CTAs of one (head
  block, token) are launched as one thread-block cluster (grid ``(H / 64, N)``, cluster ``(v_split,)``). Every CTA
  needs the whole Q and every whole KV tile; in ``split_cta`` each reads them itself (the repeats meant to hit L2),
  here each CTA's TMA copies ``1 / v_split`` of each tile and multicasts it into all the cluster's shared memories
  (Mosaic's collective copy: every CTA's "loaded" barrier expects the full tile). The point: half the L2 → SM
  traffic at ``v_split = 2``, for a kernel whose time followed the KV bytes in flight (``pingpong``'s measurements,
  docs/perf/attention_h200.md).
* Because a refill writes into every CTA of the cluster, a stage's "consumed" barrier is a cluster barrier: each
  compute warpgroup arrives on it in every CTA (``v_split`` arrivals per phase), and a producer refills a stage only
  once all of them have released it. Every arrival a CTA receives is for a step its own producer waits on before
  it finishes, and every tile written into it is one its compute warpgroup waits for, so no CTA exits with a peer
  still writing to it. The mask rows and the sink stay per CTA.

Organisation ``shared_qk`` (no duplicated QK product):

* Grid ``(l_split, H / 64, N)``, one CTA per (part of L, block of 64 heads, query token); ``l_split = 1`` by default
  (one launch, no combine). Three warpgroups (``num_threads=3``), as jax's ``attention_mgpu.py`` forward kernel:
  warpgroups 0 and 1 compute, warpgroup 2 only issues TMA copies; ``set_max_registers`` 232 / 40 (that kernel's
  figures: 2 · 128 · 232 + 128 · 40 = 64512 of the 65536 registers of an SM).
* Consumer ``c`` owns the column chunk ``c`` of d (``dh = d / 2`` ≤ 256 columns): its Q chunk ``Q_c`` (loaded once),
  its accumulator ``[64, dh]`` (128 registers per thread at dh = 256) and the output columns
  ``[c·dh, (c+1)·dh)``. Per KV block it computes the partial logits ``S_c = Q_c · K_cᵀ`` over its chunk only (one
  WGMMA, K_c read transposed as in ``split_cta``), stores them (fp32 ``[64, block_kv]``, in the WGMMA register
  layout through a (8, 32)-tiled, 128-byte-swizzled buffer: Mosaic finds no bank-conflict-free plan for that layout
  on an unswizzled one) into its exchange buffer, arrives on and waits for the "written" barrier (two warpgroup
  arrivals: in Pallas's Lane semantics each of the 256 threads arrives with release semantics and the wait
  acquires, so the other consumer's stores are visible), loads the other consumer's partial, arrives on the "read"
  barrier and forms ``S = S_own + S_other``: one fp32 addition of the same two values in both consumers (IEEE
  addition is commutative), so both hold bitwise the same S and hence the same running max, P and sum. Then the same
  mask, sink, base-2 online softmax as ``split_cta``, and ``P·V_c`` on its own columns of the same KV tile; the
  stage's "consumed" barrier expects both consumers.
* A consumer overwrites its exchange buffer only after waiting on the "read" barrier of the previous step (the other
  consumer has loaded it); that wait comes after the next QK product, so it costs nothing unless the other consumer
  lags. One buffer per consumer: double buffering by step parity would need 64 KiB, which does not fit.
* Shared memory at d = 512, block_kv = 64, 2 stages, as Pallas allocates it (every buffer rounded up to 1 KiB): Q
  64 KiB (reused for O) + KV 128 KiB + mask rows 1 KiB + the sink (one copy per consumer) 1 KiB + exchange
  2 × 16 KiB + 8 mbarriers = 231488 B of the 232448 B per CTA (checked against Mosaic's own count in the CPU tests).
  It fits only because the kernel asks for no reduction scratch (``reduction_scratch_bytes=0``; Pallas reserves
  2 KiB by default): its row reductions over the WGMMA layout stay inside a warp (shuffles). Three stages do not fit.
* Work per SM: one token's QK + PV (``4·H·L·d`` FLOPs) now runs on one SM, where ``split_cta`` spreads ``6·H·L·d``
  over two. At N = 64 only 64 CTAs run (of 132 SMs) and each does 4/3 of a ``split_cta`` CTA's tensor work, so
  ``shared_qk`` wins at N = 64 only if ``split_cta`` is bound by the serial QK → softmax → PV chain of its single
  compute warpgroup (22.7 µs against ~10 µs of tensor work per SM at peak) rather than by tensor throughput; the two
  consumers' WGMMAs are half as large and run concurrently. Both consumers are in lockstep through the exchange, so
  the tensor cores idle during their softmax (no ping-pong as in FlashAttention 3; a later version could issue the
  next block's QK before the softmax).
* ``l_split > 1`` splits each token's L rows into ``l_split`` parts of ``L / l_split`` rows (CTAs side by side in the
  grid): 128 CTAs at N = 64 with ``l_split = 2``, and 5 or 10 SMs instead of one for a single query. Each part starts
  from the sink's max, with running sum 1 in part 0 and 0 in the others (the sink counted once), and writes its
  unnormalised fp32 accumulator (through its exchange buffer, ``block_kv`` columns at a time, after the other
  consumer's last read) with its running max and sum; XLA merges the parts (:func:`_combine_parts`:
  ``o = Σ w_i acc_i / Σ w_i l_i``, ``w_i = 2^(m_i − max m)``). The P rounding is the same (relative to each part's
  running max, as within one CTA), so the contract and its error bound are unchanged. The price: the fp32 partials
  (``2 · l_split · N · H · d · 4`` B written and read back, 40% of the KV bytes at N = 64, ``l_split = 2``) and a
  second (XLA) kernel.

GPU-only assumptions of ``shared_qk`` (on top of those below; checked by tests/test_decode_attention_gpu.py, not on
CPU):

* ``setmaxnreg`` 232 / 40 with 384 threads per CTA and a compute warpgroup holding accumulator 128 + own and other
  partial S 2 × 32 + P 32 + bf16 P 16 + mask 16 registers per thread (peak near 232 at dh = 256: a spill would be
  slow, not wrong);
* the fp32 WGMMA-layout store / load through the (8, 32)-tiled, 128-byte-swizzled exchange buffer, and the ordering
  of those generic-proxy stores and loads by the two mbarriers (release arrive / acquire wait per thread);
* WGMMA operands addressed with the consumer index (``q_smem.at[c]``, ``kv_smem.at[slot, c]``; jax's attention
  kernel indexes its Q buffer by warpgroup the same way);
* with ``l_split > 1``: TMA stores of fp32 ``[64, block_kv]`` tiles into a 5-D output and of 64-entry fp32 rows.

GPU-only assumptions (not checked by lowering on CPU; see tests/test_decode_attention_gpu.py):

* the 128-byte swizzled ``[block_kv, dh]`` tile read transposed as the WGMMA B operand with ``dh`` up to 256 and
  ``d / dh`` WGMMAs accumulating into one accumulator (jax's attention kernel reads K the same way for head_dim ≤ 256);
* the fp32 mask row loaded from shared memory in the WGMMA column layout (``Layout.WGMMA.reduce(0)``) and broadcast
  over rows (jax's attention backward kernel does this with its LSE rows);
* ``exp2`` with ``approx_math`` maps −inf to +0 (PTX ``ex2.approx.ftz.f32`` does);
* a TMA copy of a ``[64, dh]`` slice of ``q``/``o`` (row stride ``d``) and of ``block_kv`` fp32 mask entries;
* ``setmaxnreg`` 256 (increase) / 40 (decrease) with 256 threads per CTA (as jax's warp-specialised pipeline with
  one compute warpgroup);
* register pressure of the compute warpgroup: accumulator 128 + S 32 + P 32 + bf16 P 16 + mask 16 registers per
  thread, below 256 (a spill would be slow, not wrong).

Checked on CPU (tests/test_decode_attention_cpu.py): lowering for CUDA under jax 0.10.2 and 0.11.2 (Mosaic's own
shared-memory check included), and, under jax 0.11.2, the whole kernel in the Mosaic GPU interpreter with the
register-operand WGMMA and ``pl.run_state`` replaced by shared-memory equivalents; for ``shared_qk`` too (with and
without ``l_split``), whose exchange also ran under the interpreter's happens-before race detector: no race on the
exchange buffers or the outputs (removing either exchange wait is reported); the one pattern it reports, in both
organisations, is the TMA refill of a stage's mask row after the consumers' plain loads of it, ordered by the
"consumed" mbarrier without a proxy fence (``test_shared_qk_exchange_has_no_race``). ``split_cta`` on the H200
(jax 0.11.2, 2026-12-01): tests/test_decode_attention_gpu.py passed (21 cases), and a benchmark at the real size
(N = 64, H = 64, d = 512, L = 640, CUPTI) gave 22.7 µs against 231 µs for the jitted ``jnp`` reference: 2.23 TB/s
of :func:`traffic`'s bytes, 237 TFLOP/s useful (355 executed). One query alone takes 16.9 µs: the ten KV steps
of a CTA run one after another (QK, softmax, PV, no overlap), so that is the latency a later version should cut
(software-pipelined QK of the next block, or a split of L across CTAs for small N).

Imports of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention.reference import check_shapes
from pallas_kernels.mgpu_compat import load_whole

HEADS_PER_CTA = 64            # the WGMMA M of one warpgroup
MAX_DH = 256                  # fp32 accumulator columns per thread budget: 64 × 256 / 128 threads = 128 registers
SMEM_BYTES = 232448           # H100/H200 dynamic shared memory per CTA
SMEM_RESERVE = 4096           # barriers and 1 KiB alignment of the swizzled buffers (measured: 3.6 KiB)
# One compute and one memory warpgroup: jax's warp-specialised pipeline gives a lone compute warpgroup
# min(256, 512 − 40) = 256 registers (pipeline._compute_registers; attention_mgpu.py's backward kernels run so with
# compute_wgs_bwd=1). 232 (its forward kernel's figure) is for two compute warpgroups; with 256 threads the
# register count at entry may already exceed 232, and setmaxnreg.inc must not lower it.
COMPUTE_REGISTERS = 256
MEMORY_REGISTERS = 40
# the gathering warpgroup of sparse_decode_attention_rows computes an address pair per 16-byte copy (its copies hold
# no registers in flight): more than the TMA warpgroup's 40, well within 65536 − 128 · 256 per SM
GATHER_REGISTERS = 96
# organisation="shared_qk": two compute warpgroups and one memory warpgroup (384 threads), the split of jax's
# attention_mgpu.py forward kernel and of its warp-specialised pipeline with two compute warpgroups:
# 2 · 128 · 232 + 128 · 40 = 64512 ≤ 65536 registers per SM.
SHARED_QK_COMPUTE_REGISTERS = 232
SHARED_QK_CONSUMERS = 2       # compute warpgroups; consumer c owns output columns [c·d/2, (c+1)·d/2)
# shared_qk's gathering warpgroup: what the two 232-register consumers leave of the CTA's pool. setmaxnreg moves
# registers within the pool the CTA was launched with — 384 threads × 168 (65536 / 384 rounded down to setmaxnreg's
# multiple of 8) = 64512 — so the three counts must sum to 3 · 168 = 504, not 512: with 48 here the consumers'
# "increase" waited forever (a hang measured on an H100, 2026-12-06).
SHARED_QK_THREAD_REGISTERS = 65536 // (128 * (SHARED_QK_CONSUMERS + 1)) // 8 * 8
SHARED_QK_GATHER_REGISTERS = ((SHARED_QK_CONSUMERS + 1) * SHARED_QK_THREAD_REGISTERS
                              - SHARED_QK_CONSUMERS * SHARED_QK_COMPUTE_REGISTERS)
SMEM_ALIGNMENT = 1024         # Pallas rounds every shared-memory scratch buffer up to 1 KiB
# pingpong: decode_pingpong_sm90.py; seesaw: decode_seesaw_sm90.py
ORGANISATIONS = ("split_cta", "split_cluster", "shared_qk", "pingpong", "seesaw")
MAX_CLUSTER = 8                # the portable cluster size limit of Hopper
LOG2E = math.log2(math.e)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def _produce_kv(kv_ref, bias_ref, kv_smem, bias_smem, loaded_barriers, consumed_barriers, *, tok, row0, chunks: int,
                block_kv: int, stages: int, kv_steps: int, multicast: str | None = None, own_chunk=None,
                others_consumed=None) -> None:
    """The TMA warpgroup of both organisations: lowers its registers, issues the first ``stages`` KV tiles (each
    ``chunks`` column chunks plus the tile's mask row, all arriving on the stage's "loaded" barrier), then refills
    a stage once its "consumed" barrier says the compute side is done with it. Rows from ``row0`` (the L split).
    ``multicast``: a cluster axis whose CTAs all need the same KV tiles (``split_cluster``): each CTA of it copies
    its share of every column chunk and the TMA unit writes it into every CTA's shared memory (each CTA's "loaded"
    barrier still expects the whole tile); the mask rows stay per CTA.
    ``others_consumed`` (``split_cta`` with ``early_release``): barriers on which the compute side releases the
    column chunks other than ``own_chunk`` once its QK product has read them; those chunks of a stage are refilled
    then, and ``own_chunk`` with the mask row on ``consumed_barriers`` (after the P·V product)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    def issue(step, slot, which=None, with_bias=True):
        kv_rows = pl.ds(step * block_kv if isinstance(row0, int) and row0 == 0 else row0 + step * block_kv, block_kv)
        for c in range(chunks) if which is None else which:
            plgpu.copy_gmem_to_smem(kv_ref.at[tok, kv_rows, c], kv_smem.at[slot, c], loaded_barriers.at[slot],
                                    **({} if multicast is None else dict(collective_axes=multicast)))
        if with_bias:
            plgpu.copy_gmem_to_smem(bias_ref.at[tok, kv_rows], bias_smem.at[slot], loaded_barriers.at[slot])

    for i in range(stages):
        issue(i, i)

    @pl.loop(0, kv_steps - stages)
    def _refill(step):
        _refill_stage(issue, lax.rem(step, jnp.array(stages, step.dtype)), step + stages,
                      consumed_barriers=consumed_barriers, others_consumed=others_consumed, own_chunk=own_chunk,
                      chunks=chunks)


def _refill_stage(issue, slot, step, *, consumed_barriers, others_consumed, own_chunk, chunks: int) -> None:
    """Both memory warpgroups' refill of ``slot`` with KV step ``step`` (``issue(step, slot, which=None,
    with_bias=True)`` fetches the named column chunks and the mask row) once the compute side has released it:
    all at once on ``consumed_barriers``, or with ``others_consumed`` (early release) the chunks other than
    ``own_chunk`` as soon as the QK product has read them, then the own chunk and the mask row after P·V."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if others_consumed is None:
        plgpu.barrier_wait(consumed_barriers.at[slot])
        issue(step, slot)
        return
    plgpu.barrier_wait(others_consumed.at[slot])
    issue(step, slot, which=[lax.rem(own_chunk + j, chunks) for j in range(1, chunks)], with_bias=False)
    plgpu.barrier_wait(consumed_barriers.at[slot])
    issue(step, slot, which=[own_chunk])


def _gathering_prologue(rows_ref, rows_smem, rows_barrier, *, tok, registers: int) -> None:
    """Both gathering producers' start: give up registers to the compute side, then copy the query's row indices
    ``rows_ref[tok]`` into shared memory (TMA) and wait for them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.set_max_registers(registers, action="decrease")
    plgpu.copy_gmem_to_smem(rows_ref.at[tok], rows_smem, rows_barrier)
    plgpu.barrier_wait(rows_barrier)


def _fp4_row_chunks(src_ref, kv_smem, slot, which, *, chunks: int, dh: int) -> list[tuple]:
    """``(codes, scales, tile)`` of each column chunk ``c`` in ``which`` of ``v41_fp4`` rows ``src_ref [R, D/2 +
    D/16]`` (a pool in global memory or staged rows in shared memory): chunk ``c``'s codes are bytes ``c·dh/2 …``
    of a row, its scales bytes ``D/2 + c·dh/16 …``; the tile is stage ``slot``'s chunk ``c``."""
    half = chunks * dh // 2
    return [(src_ref.at[:, pl.ds(c * (dh // 2), dh // 2)], src_ref.at[:, pl.ds(half + c * (dh // 16), dh // 16)],
             kv_smem.at[slot, c]) for c in which]


def _copy_mask_row(bias_ref, bias_smem, loaded_barriers, *, tok, step, slot, block_kv: int) -> None:
    """The gathering producers' TMA copy of KV step ``step``'s mask row into stage ``slot``, counted by the stage's
    "loaded" barrier."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.copy_gmem_to_smem(bias_ref.at[tok, pl.ds(step * block_kv, block_kv)], bias_smem.at[slot],
                            loaded_barriers.at[slot])


def _produce_gathered(pool_ref, rows_ref, bias_ref, kv_smem, rows_smem, bias_smem, rows_barrier, loaded_barriers,
                      consumed_barriers, *, tok, chunks: int, block_kv: int, stages: int, kv_steps: int,
                      own_chunk=None, others_consumed=None, window_ref=None, window_steps: int = 0, step0=0,
                      registers: int = GATHER_REGISTERS) -> None:
    """The gathering warpgroup of :func:`sparse_decode_attention_rows`: the same pipeline as :func:`_produce_kv`,
    but each KV tile's rows are fetched by index from the pool with ``cp.async`` into the swizzled tiles
    (:mod:`pallas_kernels.attention.row_gather_sm90`). The mask rows still come by TMA.

    Per thread, each KV step's copies are one ``cp.async`` group; before announcing step ``s`` the warpgroup waits
    until all but its newest :func:`~pallas_kernels.attention.row_gather_sm90.producer_wait_pending` groups have
    landed (that function says why the count is right; one group short was a race measured on an H100). With one
    stage, iteration ``s`` first refills it with step ``s`` itself, once step ``s − 1`` has released it. Then the
    warpgroup fences (generic → async proxy, what the WGMMA reads through), syncs, and arrives once on the stage's
    "loaded" barrier (which also counts the mask row's TMA copy). Only then does it wait for the compute side to
    release the previous step's stage, so a step is announced as soon as it has landed.
    A ``uint8`` pool holds ``v41_fp4`` rows: each thread loads its rows' code words and scale bytes and stores the
    decoded bf16 values (:func:`~pallas_kernels.attention.row_gather_sm90.issue_fp4_row_decode`; plain loads, so
    those steps' groups are empty and complete at once).
    ``window_ref``: a second source for the first ``window_steps`` KV steps (each query's window rows, laid out by
    the caller; their indices in ``rows_ref`` are rows of ``window_ref``). ``step0``: this CTA's first KV step of
    the query's ``L / block_kv`` (``shared_qk``'s L split; ``rows_smem`` holds all of the query's row indices);
    ``kv_steps`` counts this CTA's steps. ``registers``: the warpgroup's register budget."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.attention.row_gather_sm90 import (
        commit_group,
        issue_fp4_row_decode,
        issue_row_copies,
        producer_wait_pending,
        wait_group,
    )

    _gathering_prologue(rows_ref, rows_smem, rows_barrier, tok=tok, registers=registers)
    dh = kv_smem.shape[-1]

    def fetch(src_ref, step, slot, which):
        if src_ref.dtype == jnp.uint8:      # v41_fp4 rows [R, D/2 + D/16]: decoded into the tiles on the way
            issue_fp4_row_decode(plgpu, _fp4_row_chunks(src_ref, kv_smem, slot, which, chunks=chunks, dh=dh),
                                 rows_smem.at[step], block_rows=block_kv, cols=dh, swizzle=kv_swizzle(block_kv))
            return
        for c in which:
            issue_row_copies(plgpu, src_ref.at[:, c], rows_smem.at[step], kv_smem.at[slot, c], block_rows=block_kv,
                             cols=dh, swizzle=kv_swizzle(block_kv))

    def issue(step, slot, which=None, with_bias=True):
        which = list(range(chunks)) if which is None else which
        if window_ref is None or (isinstance(step, int) and step >= window_steps):
            fetch(pool_ref, step, slot, which)
        elif isinstance(step, int):
            fetch(window_ref, step, slot, which)
        else:
            pl.when(step < window_steps)(lambda: fetch(window_ref, step, slot, which))
            pl.when(step >= window_steps)(lambda: fetch(pool_ref, step, slot, which))
        if with_bias:
            _copy_mask_row(bias_ref, bias_smem, loaded_barriers, tok=tok, step=step, slot=slot, block_kv=block_kv)

    for i in range(stages):
        issue(step0 + i, i)
        commit_group(plgpu)

    def refill(prev):
        """Once the compute side has released local step ``prev``'s stage, fetch step ``prev + stages`` into it."""
        _refill_stage(issue, lax.rem(prev, jnp.array(stages, prev.dtype)), step0 + prev + stages,
                      consumed_barriers=consumed_barriers, others_consumed=others_consumed, own_chunk=own_chunk,
                      chunks=chunks)

    @pl.loop(0, kv_steps)
    def _step(step):
        slot = lax.rem(step, jnp.array(stages, step.dtype))
        if stages == 1:   # the one stage holds this step only once the previous step has released it
            pl.when(step >= 1)(lambda: refill(step - 1))
            commit_group(plgpu)              # group `step` (group 0 came from the first issue)
        wait_group(plgpu, producer_wait_pending(stages))   # this thread's copies of step `step` have landed
        plgpu.commit_smem()                  # fence.proxy.async + warpgroup barrier: everyone's have
        plgpu.barrier_arrive(loaded_barriers.at[slot])
        if stages > 1:    # refill the stage the compute side works on now, step − 1's, once it is released
            pl.when(jnp.logical_and(step >= 1, step - 1 + stages < kv_steps))(lambda: refill(step - 1))
            commit_group(plgpu)              # one group per iteration, empty when nothing was refilled


def _produce_fp4_prefetch(pool_ref, rows_ref, bias_ref, kv_smem, rows_smem, raw_smem, bias_smem, rows_barrier,
                          loaded_barriers, consumed_barriers, *, tok, chunks: int, block_kv: int, stages: int,
                          kv_steps: int, own_chunk, others_consumed=None, window_ref=None,
                          window_steps: int = 0) -> None:
    """The gathering warpgroup for ``v41_fp4`` pool rows with the next step's rows in flight while this step is
    decoded (``sparse_decode_attention_rows(..., fp4_prefetch=True)``): each step's stored rows are copied whole
    (``cp.async``, 16-byte units) into one of two staging buffers ``raw_smem [2, block_kv, D/2 + D/16]``, and decoded
    from there into the stage's tiles once the compute side has released it.

    Order (``W = window_steps ≤ stages``, checked by the caller): the window's ``W`` steps are copied into their
    (still free) stages and committed as one group, then step ``W``'s rows into staging buffer ``W mod 2`` as the next
    group; once the first group has landed the window stages are announced. Iteration ``t = W … kv_steps − 1``:
    copy step ``t + 1``'s rows into buffer ``(t + 1) mod 2`` (which held step ``t − 1``, decoded in the previous
    iteration) and commit (an empty group after the last step); ``wait_group(1)`` = every group but that newest one has
    landed, i.e. step ``t``'s rows; a warpgroup barrier makes every thread's copies visible to all; then, once
    the stage is free (step ``t − stages`` released — with early release the other CTAs' column chunks first, the own
    chunk and the mask row after P·V), decode into it, fence, synchronise and arrive on its "loaded" barrier."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.attention.row_gather_sm90 import (
        commit_group,
        decode_staged_fp4_rows,
        issue_raw_row_copies,
        issue_row_copies,
        wait_group,
    )

    _gathering_prologue(rows_ref, rows_smem, rows_barrier, tok=tok, registers=GATHER_REGISTERS)
    dh = kv_smem.shape[-1]
    swizzle = kv_swizzle(block_kv)

    def mask_row(step, slot):
        _copy_mask_row(bias_ref, bias_smem, loaded_barriers, tok=tok, step=step, slot=slot, block_kv=block_kv)

    def stage_rows(step):
        issue_raw_row_copies(plgpu, pool_ref, rows_smem.at[step], raw_smem.at[lax.rem(step, 2)], block_rows=block_kv)

    def fill(step, slot, which=None, with_bias=True):
        """Decodes step ``step``'s staged rows (column chunks ``which``, default all) into stage ``slot``."""
        parts = _fp4_row_chunks(raw_smem.at[lax.rem(step, 2)], kv_smem, slot,
                                range(chunks) if which is None else which, chunks=chunks, dh=dh)
        decode_staged_fp4_rows(plgpu, parts, block_rows=block_kv, cols=dh, swizzle=swizzle)
        if with_bias:
            mask_row(step, slot)

    for i in range(window_steps):            # the window's steps: bf16 rows straight into their free stages
        for c in range(chunks):
            issue_row_copies(plgpu, window_ref.at[:, c], rows_smem.at[i], kv_smem.at[i, c], block_rows=block_kv,
                             cols=dh, swizzle=swizzle)
        mask_row(i, i)
    commit_group(plgpu)
    if window_steps < kv_steps:
        stage_rows(window_steps)
    commit_group(plgpu)
    if window_steps:
        wait_group(plgpu, 1)                 # the window's copies have landed (the staged rows may not have)
        plgpu.commit_smem()
        for i in range(window_steps):
            plgpu.barrier_arrive(loaded_barriers.at[i])

    @pl.loop(window_steps, kv_steps)
    def _step(step):
        slot = lax.rem(step, jnp.array(stages, step.dtype))
        pl.when(step + 1 < kv_steps)(lambda: stage_rows(step + 1))
        commit_group(plgpu)
        wait_group(plgpu, 1)                 # this thread's copies of step `step`'s rows have landed
        plgpu.commit_smem()                  # warpgroup barrier: everyone's have

        pl.when(step < stages)(lambda: fill(step, slot))      # a stage not used yet
        pl.when(step >= stages)(lambda: _refill_stage(fill, slot, step, consumed_barriers=consumed_barriers,
                                                      others_consumed=others_consumed, own_chunk=own_chunk,
                                                      chunks=chunks))

        plgpu.commit_smem()                  # fence.proxy.async + barrier: the tiles are written for the WGMMA
        plgpu.barrier_arrive(loaded_barriers.at[slot])


def _online_softmax_step(qk, bias, m_i, l_i, acc, *, qk_scale: float):
    """One KV block of the base-2 online softmax, shared by every organisation: ``qk fp32 [64, block_kv]`` (WGMMA
    layout), ``bias fp32 [block_kv]`` (0 / −inf, column layout), running max ``m_i`` and sum ``l_i`` (``[64]``), the
    accumulator ``acc fp32 [64, dh]``. Returns ``(p16, acc, m_new, l_i)``: the block's probabilities in bf16 (the
    P·V operand) and the rescaled state. ``m_i`` ≥ the sink's max is finite, so masked logits give exp2(−inf) = 0."""
    s = qk * qk_scale + lax.broadcast_in_dim(bias, qk.shape, [1])
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p.astype(jnp.bfloat16), acc, m_new, l_i


def smem_bytes(d: int, block_kv: int, stages: int, organisation: str = "split_cta") -> int:
    """Shared memory one CTA allocates.

    ``split_cta``: Q (reused for O), ``stages`` KV tiles with their mask rows, the sink (unaligned sum; the check
    adds :data:`SMEM_RESERVE`). ``shared_qk``: the buffers as Pallas allocates them, each rounded up to 1 KiB — Q
    (reused for O), the KV tiles, the mask rows, the sink (one copy per consumer), the two consumers' fp32 partial
    logits ``[64, block_kv]`` — plus the mbarriers; the kernel reserves no reduction scratch (its reductions stay
    inside a warp). ``pingpong``: :func:`pallas_kernels.attention.decode_pingpong_sm90.pingpong_smem_bytes`."""
    if organisation in ("split_cta", "split_cluster"):
        return HEADS_PER_CTA * d * 2 + stages * (block_kv * d * 2 + block_kv * 4) + HEADS_PER_CTA * 4
    if organisation == "shared_qk":
        barriers = 2 + 2 * stages + 2                               # setup ×2, loaded/consumed ×stages, exchange ×2
        return (_aligned(HEADS_PER_CTA * d * 2) + _aligned(stages * block_kv * d * 2) + _aligned(stages * block_kv * 4)
                + _aligned(SHARED_QK_CONSUMERS * HEADS_PER_CTA * 4)
                + _aligned(SHARED_QK_CONSUMERS * HEADS_PER_CTA * block_kv * 4) + 8 * barriers)
    if organisation == "pingpong":
        from pallas_kernels.attention.decode_pingpong_sm90 import pingpong_smem_bytes
        return pingpong_smem_bytes(d, block_kv, stages)
    if organisation == "seesaw":
        from pallas_kernels.attention.decode_seesaw_sm90 import seesaw_smem_bytes
        return seesaw_smem_bytes(d, block_kv, stages)
    raise ValueError(f"organisation={organisation!r} is not one of {ORGANISATIONS}")


def check_config(h: int, d: int, rows: int, *, block_kv: int, num_stages: int, v_split: int,
                 organisation: str = "split_cta", l_split: int = 1, early_release: bool = False,
                 extra_smem: int = 0) -> int:
    """Validates the static configuration; returns the pipeline depth actually used (≤ the number of KV steps of a
    CTA). ``extra_smem``: bytes of shared memory beyond :func:`smem_bytes` (the gathered kernel's row indices)."""
    if organisation not in ORGANISATIONS:
        raise ValueError(f"organisation={organisation!r} is not one of {ORGANISATIONS}")
    if h % HEADS_PER_CTA:
        raise ValueError(f"number of heads H={h} must be a multiple of {HEADS_PER_CTA}")
    if organisation in ("shared_qk", "seesaw") and v_split != SHARED_QK_CONSUMERS:
        raise ValueError(f"organisation={organisation!r} splits d between its {SHARED_QK_CONSUMERS} consumer "
                         f"warpgroups: v_split must be {SHARED_QK_CONSUMERS}, got {v_split}")
    if organisation not in ("shared_qk", "seesaw") and l_split != 1:
        raise ValueError(f"l_split={l_split}: only organisations 'shared_qk' and 'seesaw' split L across CTAs")
    if organisation == "seesaw" and block_kv != 64:
        raise ValueError(f"block_kv={block_kv}: organisation='seesaw' takes 64-row KV blocks")
    if organisation == "seesaw" and num_stages < 2 and rows // block_kv // max(l_split, 1) > 1:
        raise ValueError(f"num_stages={num_stages}: organisation='seesaw' reads two KV blocks a round, so it needs "
                         f"at least 2 stages")
    if v_split < 1 or d % (64 * v_split):
        raise ValueError(f"head width d={d} must be a multiple of 64 · v_split = {64 * v_split}")
    if d // v_split > MAX_DH:
        raise ValueError(f"d / v_split = {d // v_split} > {MAX_DH}: the fp32 accumulator would not fit in registers "
                         f"(use v_split ≥ {-(-d // MAX_DH)})")
    if organisation == "split_cluster" and not 2 <= v_split <= MAX_CLUSTER:
        raise ValueError(f"organisation='split_cluster' launches the v_split CTAs of a token as one cluster: v_split "
                         f"must be 2 to {MAX_CLUSTER}, got {v_split}")
    if early_release and (organisation != "split_cta" or v_split < 2):
        raise ValueError(f"early_release releases the column chunks of the other CTAs of a token: organisation must "
                         f"be 'split_cta' with v_split ≥ 2, got {organisation!r}, v_split={v_split}")
    block_multiple = 32 if organisation in ("pingpong", "split_cta") else 64
    if block_kv % block_multiple or block_kv <= 0:
        raise ValueError(f"block_kv={block_kv} must be a positive multiple of {block_multiple} ({organisation})")
    if rows == 0 or rows % block_kv:
        raise ValueError(f"number of rows L={rows} must be a positive multiple of block_kv={block_kv}")
    if l_split < 1 or (rows // block_kv) % l_split:
        raise ValueError(f"l_split={l_split} must divide the number of KV blocks L / block_kv = {rows // block_kv}")
    if organisation in ("shared_qk", "seesaw") and l_split > 1 and (d // v_split) % block_kv:
        raise ValueError(f"l_split > 1 writes the fp32 partial output through the [64, block_kv] exchange buffer: "
                         f"d / 2 = {d // v_split} must be a multiple of block_kv={block_kv}")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be at least 1")
    stages = min(num_stages, rows // block_kv // l_split)
    if organisation == "pingpong" and stages < rows // block_kv and stages % 2:
        raise ValueError(f"num_stages={num_stages}: organisation='pingpong' refills its stages, so their number must "
                         f"be even (a stage carries the KV blocks of one consumer warpgroup)")
    need = smem_bytes(d, block_kv, stages, organisation) + extra_smem
    limit = SMEM_BYTES - (SMEM_RESERVE if organisation in ("split_cta", "split_cluster") else 0)   # others: none
    if need > limit:
        raise ValueError(f"shared memory {need} B (d={d}, block_kv={block_kv}, stages={stages}, {organisation}) "
                         f"exceeds {limit} B per CTA; lower num_stages or block_kv")
    return stages


def kv_swizzle(block_kv: int) -> int:
    """Swizzle (bytes) of ``split_cta``'s KV tiles: 128-byte lines, except for 32-row steps, whose P·V product
    contracts too few rows for them (as pingpong's): 64-byte lines in ``(8, 32)`` tiles."""
    return 128 if block_kv % 64 == 0 else 64


def _split_cta_call(q4: jax.Array, kv4: jax.Array, bias: jax.Array, sink: jax.Array, *, scale: float,
                           block_kv: int, stages: int, cluster: bool = False, early_release: bool = False,
                           rows_idx: jax.Array | None = None, window4: jax.Array | None = None,
                           fp4_prefetch: bool = False) -> jax.Array:
    """The Mosaic GPU kernel on the split layouts (``cluster``: organisation ``split_cluster``, the ``v_split`` CTAs
    of a (head block, token) launched as one cluster sharing their Q and KV copies; ``early_release``: the column
    chunks only the QK product reads are released for refill before the softmax and P·V; ``rows_idx``: the KV rows
    are gathered by index from a pool by the memory warpgroup, :func:`sparse_decode_attention_rows`; module
    docstring).

    Args:
      q4: ``bf16 [N, H, v_split, dh]`` (q with d split into ``v_split`` chunks; a free reshape).
      kv4: ``bf16 [N, L, v_split, dh]``; with ``rows_idx``, the pool ``bf16 [R, v_split, dh]`` or ``uint8
        [R, v_split · dh · (1/2 + 1/16)]`` (``v41_fp4`` rows).
      bias: ``fp32 [N, L]``, 0 for a valid row and −inf otherwise.
      sink: ``fp32 [H]``.
      rows_idx: ``int32 [N, L / block_kv, block_kv]``, row ``l`` of query ``n`` is ``pool[rows_idx[n].flat[l]]``
        (every index in ``[0, R)``).
      window4: with ``rows_idx``, an optional second source ``bf16 [Rw, v_split, dh]`` for the first ``Rw / N``
        rows of every query (a multiple of ``block_kv``; their ``rows_idx`` entries index it).
      fp4_prefetch: with a ``uint8`` pool, the producer stages each step's rows in shared memory one step ahead
        (:func:`_produce_fp4_prefetch`).
    Returns:
      ``bf16 [N, H, v_split, dh]``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, h, v_split, dh = q4.shape
    gathered = rows_idx is not None
    window_steps = 0 if window4 is None else window4.shape[0] // n // block_kv
    rows = bias.shape[1]
    kv_steps = rows // block_kv
    hb = HEADS_PER_CTA
    qk_scale = float(scale) * LOG2E   # logits in base 2: exp(x) = exp2(x · log2 e)
    swizzle = kv_swizzle(block_kv)
    tiled = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    multicast = dict(collective_axes="split") if cluster else {}

    def body(*refs):
        window_ref = None
        raw_smem = None
        if gathered:
            (q_ref, kv_ref, bias_ref, sink_ref, rows_ref, *refs) = refs
            if window4 is not None:
                window_ref, *refs = refs
            (o_ref, q_smem, kv_smem, bias_smem, sink_smem, rows_smem, *refs) = refs
            if fp4_prefetch:
                raw_smem, *refs = refs
            (setup_barrier, rows_barrier, loaded_barriers, consumed_barriers, *others_consumed) = refs
        else:
            (q_ref, kv_ref, bias_ref, sink_ref, o_ref, q_smem, kv_smem, bias_smem, sink_smem, setup_barrier,
             loaded_barriers, consumed_barriers, *others_consumed) = refs
        others_consumed = others_consumed[0] if others_consumed else None
        split = lax.axis_index("split")
        h0 = lax.axis_index("head_block") * hb
        tok = lax.axis_index("token")
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            for c in range(v_split):
                plgpu.copy_gmem_to_smem(q_ref.at[tok, pl.ds(h0, hb), c], q_smem.at[c], setup_barrier, **multicast)
            plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(h0, hb)], sink_smem, setup_barrier)
            plgpu.barrier_wait(setup_barrier)

            row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per head (accumulator row)
            m_i = load_whole(plgpu, sink_smem, row_layout) * LOG2E
            l_i = plgpu.layout_cast(jnp.full((hb,), 1.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.full((hb, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def finish_step(step, qk, carry):
                """Softmax and P·V of KV step ``step`` from its logits ``qk``; releases the stage."""
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.array(stages, jnp.int32))
                bias = load_whole(plgpu, bias_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))   # one per KV column
                p16, acc, m_new, l_i = _online_softmax_step(qk, bias, m_i, l_i, acc, qk_scale=qk_scale)

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, kv_smem.at[slot, split])

                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))   # reading it waits for the WGMMA

                @pl.when(step + stages < kv_steps)   # only stages the producer refills: no phase left unobserved
                def _release():
                    plgpu.barrier_arrive(consumed_barriers.at[slot])

                return acc, m_new, l_i

            def issue_qk(step, s_ref):
                """Waits for KV step ``step``'s tile and issues its ``S = Q Kᵀ`` WGMMAs into ``s_ref`` (async)."""
                slot = lax.rem(step, jnp.array(stages, jnp.int32))
                plgpu.barrier_wait(loaded_barriers.at[slot])
                for c in range(v_split):
                    plgpu.wgmma(s_ref, q_smem.at[c], kv_smem.at[slot, c].transpose((1, 0)))

            def kv_step(step, carry):
                def compute_qk(acc_ref):
                    issue_qk(step, acc_ref)
                    return acc_ref[...]

                qk = pl.run_scoped(compute_qk, plgpu.ACC((hb, block_kv), jnp.float32))   # waits for the WGMMAs
                if others_consumed is not None:
                    @pl.when(step + stages < kv_steps)
                    def _release_others():   # the other CTAs' column chunks: only the QK product read them
                        plgpu.barrier_arrive(others_consumed.at[lax.rem(step, jnp.array(stages, jnp.int32))])

                return finish_step(step, qk, carry)

            acc, m_i, l_i = lax.fori_loop(0, kv_steps, kv_step, (acc, m_i, l_i))
            # every QK product has been read: Q's buffer is free
            store_output(acc, l_i, q_smem.at[0], o_ref.at[tok, pl.ds(h0, hb), split])

        @pl.when(wg == 1)
        def _memory():
            if fp4_prefetch:
                _produce_fp4_prefetch(kv_ref, rows_ref, bias_ref, kv_smem, rows_smem, raw_smem, bias_smem,
                                      rows_barrier, loaded_barriers, consumed_barriers, tok=tok, chunks=v_split,
                                      block_kv=block_kv, stages=stages, kv_steps=kv_steps, own_chunk=split,
                                      others_consumed=others_consumed, window_ref=window_ref,
                                      window_steps=window_steps)
                return
            if gathered:
                _produce_gathered(kv_ref, rows_ref, bias_ref, kv_smem, rows_smem, bias_smem, rows_barrier,
                                  loaded_barriers, consumed_barriers, tok=tok, chunks=v_split, block_kv=block_kv,
                                  stages=stages, kv_steps=kv_steps, own_chunk=split, others_consumed=others_consumed,
                                  window_ref=window_ref, window_steps=window_steps)
                return
            _produce_kv(kv_ref, bias_ref, kv_smem, bias_smem, loaded_barriers, consumed_barriers, tok=tok, row0=0,
                        chunks=v_split, block_kv=block_kv, stages=stages, kv_steps=kv_steps,
                        multicast="split" if cluster else None, own_chunk=split, others_consumed=others_consumed)

    body.__name__ = (f"sparse_decode_attention_d{v_split * dh}_bkv{block_kv}{'_cluster' if cluster else ''}"
                     f"{'_early' if early_release else ''}{'_gathered' if gathered else ''}"
                     f"{'_prefetch' if fp4_prefetch else ''}")
    # split_cluster: a stage is refilled (into both CTAs' shared memory) only once both CTAs' compute warpgroups
    # are done with it, so its "consumed" barrier counts the arrivals of the whole cluster.
    consumed = (plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=1, num_barriers=stages) if cluster
                else plgpu.Barrier(num_arrivals=1, num_barriers=stages))
    scratch = [
        plgpu.SMEM((v_split, hb, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages, v_split, block_kv, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages, block_kv), jnp.float32),
        plgpu.SMEM((hb,), jnp.float32),
        *([plgpu.SMEM((kv_steps, block_kv), jnp.int32)] if gathered else []),
        *([plgpu.SMEM((2, block_kv, kv4.shape[-1]), jnp.uint8)] if fp4_prefetch else []),   # staged fp4 rows
        plgpu.Barrier(num_arrivals=v_split + 1),
        *([plgpu.Barrier(num_arrivals=1)] if gathered else []),
        # a stage has landed: its v_split column chunks (TMA) or the gathering warpgroup's one arrival, + the mask row
        plgpu.Barrier(num_arrivals=(1 if gathered else v_split) + 1, num_barriers=stages),
        consumed,
        *([plgpu.Barrier(num_arrivals=1, num_barriers=stages)] if early_release else []),
    ]
    grid = (dict(grid=(h // hb, n), grid_names=("head_block", "token"), cluster=(v_split,), cluster_names=("split",))
            if cluster else dict(grid=(v_split, h // hb, n), grid_names=("split", "head_block", "token")))
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(q4.shape, jnp.bfloat16),
        scratch_types=scratch,
        **grid,
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    return kernel(q4, kv4, bias, sink, *([rows_idx] if gathered else []), *([] if window4 is None else [window4]))


def _shared_qk_call(q4: jax.Array, kv4: jax.Array, bias: jax.Array, sink: jax.Array, *, scale: float,
                    block_kv: int, stages: int, l_split: int, rows_idx: jax.Array | None = None,
                    window4: jax.Array | None = None):
    """The ``shared_qk`` kernel (module docstring): one CTA per (L part, head block, token), two consumer warpgroups
    exchanging their partial logits through shared memory, one TMA warpgroup — or, with ``rows_idx``, a warpgroup
    gathering each step's rows by index (:func:`_produce_gathered`, as :func:`_split_cta_call`'s).

    Args:
      q4: ``bf16 [N, H, 2, dh]``; kv4: ``bf16 [N, L, 2, dh]``; bias: ``fp32 [N, L]``; sink: ``fp32 [H]``.
      rows_idx, window4: as :func:`_split_cta_call`'s (``kv4`` is then the pool ``bf16 [R, 2, dh]`` or ``uint8
        [R, 2 · dh · (1/2 + 1/16)]``).
    Returns:
      ``l_split == 1``: ``bf16 [N, H, 2, dh]``, the output. ``l_split > 1``: ``(acc, ml)`` with ``acc fp32
      [l_split, N, H, 2, dh]`` the unnormalised partial outputs of each part of L and ``ml fp32 [l_split, N, 2, H]``
      its running max (base 2) and running sum (the sink counted in part 0 only), for :func:`_combine_parts`.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, h, consumers, dh = q4.shape
    assert consumers == SHARED_QK_CONSUMERS
    gathered = rows_idx is not None
    rows = bias.shape[1]
    kv_steps = rows // block_kv // l_split      # KV blocks per CTA
    window_steps = 0 if window4 is None else window4.shape[0] // n // block_kv
    hb = HEADS_PER_CTA
    qk_scale = float(scale) * LOG2E
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))   # fp32: 128-byte rows too
    split_l = l_split > 1

    def body(q_ref, kv_ref, bias_ref, sink_ref, *refs):
        rows_ref = window_ref = rows_smem = rows_barrier = None
        if gathered:
            rows_ref, *refs = refs
            if window4 is not None:
                window_ref, *refs = refs
        if split_l:
            acc_ref, ml_ref, *refs = refs
        else:
            o_ref, *refs = refs
        q_smem, kv_smem, bias_smem, sink_smem, exch_smem, *refs = refs
        if gathered:
            rows_smem, *refs = refs
        setup_barriers, *refs = refs
        if gathered:
            rows_barrier, *refs = refs
        loaded_barriers, consumed_barriers, written_barrier, read_barrier = refs
        part = lax.axis_index("part")
        h0 = lax.axis_index("head_block") * hb
        tok = lax.axis_index("token")
        wg = lax.axis_index("wg")
        row0 = part * (kv_steps * block_kv)      # first KV row of this CTA

        @pl.when(wg < consumers)
        def _compute():
            plgpu.set_max_registers(SHARED_QK_COMPUTE_REGISTERS, action="increase")
            c = wg                               # this consumer's column chunk
            other = 1 - c
            plgpu.copy_gmem_to_smem(q_ref.at[tok, pl.ds(h0, hb), c], q_smem.at[c], setup_barriers.at[c])
            plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(h0, hb)], sink_smem.at[c], setup_barriers.at[c])
            plgpu.barrier_wait(setup_barriers.at[c])

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            m_i = load_whole(plgpu, sink_smem.at[c], row_layout) * LOG2E
            l_i = plgpu.layout_cast(jnp.full((hb,), 1.0, jnp.float32), row_layout)
            if split_l:                          # the sink's exp(0) = 1 is counted once, in part 0
                l_i = l_i * (part == 0).astype(jnp.float32)
            acc = plgpu.layout_cast(jnp.full((hb, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def kv_step(step, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.array(stages, step.dtype))
                plgpu.barrier_wait(loaded_barriers.at[slot])

                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[c], kv_smem.at[slot, c].transpose((1, 0)))
                    return acc_ref[...]

                s_own = pl.run_scoped(compute_qk, plgpu.ACC((hb, block_kv), jnp.float32))   # Q_c · K_cᵀ

                @pl.when(step > 0)               # the other consumer has read our previous partial
                def _reuse():
                    plgpu.barrier_wait(read_barrier)

                exch_smem.at[c][...] = s_own
                plgpu.barrier_arrive(written_barrier)
                plgpu.barrier_wait(written_barrier)
                s_other = load_whole(plgpu, exch_smem.at[other], plgpu.Layout.WGMMA)

                @pl.when(step + (0 if split_l else 1) < kv_steps)   # split_l: the epilogue reuses the buffer too
                def _read():
                    plgpu.barrier_arrive(read_barrier)

                # S = S_0 + S_1: one fp32 addition of the same two values in both consumers (IEEE addition is
                # commutative), so both hold bitwise the same S, hence the same m, P and l.
                qk = s_own + s_other
                bias = load_whole(plgpu, bias_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                p16, acc, m_new, l_i = _online_softmax_step(qk, bias, m_i, l_i, acc, qk_scale=qk_scale)

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, kv_smem.at[slot, c])

                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))

                @pl.when(step + stages < kv_steps)
                def _release():
                    plgpu.barrier_arrive(consumed_barriers.at[slot])

                return acc, m_new, l_i

            acc, m_i, l_i = lax.fori_loop(0, kv_steps, kv_step, (acc, m_i, l_i))
            if not split_l:
                # this consumer's last QK product has been read: Q_c is free
                store_output(acc, l_i, q_smem.at[c], o_ref.at[tok, pl.ds(h0, hb), c])
                return

            # L split: the unnormalised fp32 accumulator goes out through this consumer's exchange buffer, block_kv
            # columns at a time, once the other consumer has read the last partial logits from it.
            plgpu.barrier_wait(read_barrier)
            store_partial(acc, exch_smem.at[c], acc_ref.at[part, tok, pl.ds(h0, hb), c])

            @pl.when(c == 0)                     # m and l are the same in both consumers
            def _stats():                        # both sink copies were read before the first exchange
                store_stats(m_i, l_i, sink_smem.at[0], sink_smem.at[1], ml_ref.at[part, tok, :, pl.ds(h0, hb)])

            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == consumers)
        def _memory():
            if gathered:
                _produce_gathered(kv_ref, rows_ref, bias_ref, kv_smem, rows_smem, bias_smem, rows_barrier,
                                  loaded_barriers, consumed_barriers, tok=tok, chunks=consumers, block_kv=block_kv,
                                  stages=stages, kv_steps=kv_steps, window_ref=window_ref, window_steps=window_steps,
                                  step0=part * kv_steps, registers=SHARED_QK_GATHER_REGISTERS)
                return
            _produce_kv(kv_ref, bias_ref, kv_smem, bias_smem, loaded_barriers, consumed_barriers, tok=tok, row0=row0,
                        chunks=consumers, block_kv=block_kv, stages=stages, kv_steps=kv_steps)

    body.__name__ = (f"sparse_decode_attention_shared_qk_d{consumers * dh}_bkv{block_kv}"
                     f"{f'_l{l_split}' if split_l else ''}{'_gathered' if gathered else ''}")
    scratch = [
        plgpu.SMEM((consumers, hb, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages, consumers, block_kv, dh), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((stages, block_kv), jnp.float32),
        plgpu.SMEM((consumers, hb), jnp.float32),
        plgpu.SMEM((consumers, hb, block_kv), jnp.float32, transforms=tiled32),
        *([plgpu.SMEM((rows // block_kv, block_kv), jnp.int32)] if gathered else []),   # all the query's indices
        plgpu.Barrier(num_arrivals=2, num_barriers=consumers),                 # Q chunk + sink, per consumer
        *([plgpu.Barrier(num_arrivals=1)] if gathered else []),                # the indices have landed
        # a stage has landed: its KV chunks (TMA) or the gathering warpgroup's one arrival, + the mask row
        plgpu.Barrier(num_arrivals=(1 if gathered else consumers) + 1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),            # both consumers done with a stage
        plgpu.Barrier(num_arrivals=consumers),                                 # both partial logits written
        plgpu.Barrier(num_arrivals=consumers),                                 # both partial logits read
    ]
    kernel = parts_kernel(body, scratch, q4, l_split, consumers)
    return kernel(q4, kv4, bias, sink, *([rows_idx] if gathered else []), *([] if window4 is None else [window4]))


def parts_kernel(body, scratch: list, q4: jax.Array, l_split: int, consumers: int):
    """The Mosaic GPU kernel of an organisation with one CTA per (L part, head block, token) and ``consumers``
    compute warpgroups plus a memory warpgroup (``shared_qk``, ``seesaw``), outputs as :func:`parts_out_type`; no
    reduction scratch (their row reductions stay inside a warp)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, h = q4.shape[:2]
    return plgpu.kernel(
        body,
        out_type=parts_out_type(q4, l_split),
        scratch_types=scratch,
        grid=(l_split, h // HEADS_PER_CTA, n),
        grid_names=("part", "head_block", "token"),
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )


def store_output(acc, l_sum, o_smem, o_gmem) -> None:
    """``bf16(acc / l_sum)`` (``acc fp32 [64, c]`` WGMMA layout, ``l_sum [64]``) through ``o_smem`` (bf16, free) to
    ``o_gmem [64, c]``; waits for the store."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    o_smem[...] = (acc / lax.broadcast_in_dim(l_sum, acc.shape, [0])).astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)


def store_stats(m, l_sum, m_smem, l_smem, ml_gmem) -> None:
    """A part's running max and sum (``[64]`` each) through the free fp32 rows ``m_smem``, ``l_smem`` to ``ml_gmem
    [2, 64]``; the stores stay in flight."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m_smem[...] = m
    l_smem[...] = l_sum
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(m_smem, ml_gmem.at[0])
    plgpu.copy_smem_to_gmem(l_smem, ml_gmem.at[1])


def parts_out_type(q4: jax.Array, l_split: int):
    """Output types of a kernel over ``l_split`` parts of L (``shared_qk``, ``seesaw``): the bf16 output ``[N, H, 2,
    dh]`` for one part; else the unnormalised fp32 accumulators ``[l_split, N, H, 2, dh]`` and the running max and
    sum ``[l_split, N, 2, H]`` for :func:`_combine_parts`."""
    if l_split == 1:
        return jax.ShapeDtypeStruct(q4.shape, jnp.bfloat16)
    n, h = q4.shape[:2]
    return (jax.ShapeDtypeStruct((l_split, *q4.shape), jnp.float32),
            jax.ShapeDtypeStruct((l_split, n, 2, h), jnp.float32))


def store_partial(acc, out_smem, acc_gmem) -> None:
    """Writes a part's unnormalised accumulator ``acc fp32 [64, dh]`` (WGMMA layout) to ``acc_gmem [64, dh]``
    through the fp32 staging buffer ``out_smem [64, c]`` (``c`` columns at a time, each chunk's TMA store having read
    the buffer before the next chunk overwrites it); returns with the stores in flight."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cols = out_smem.shape[-1]
    for j in range(acc.shape[1] // cols):
        if j:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[...] = acc[:, j * cols:(j + 1) * cols]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, acc_gmem.at[:, pl.ds(j * cols, cols)])


def _combine_parts(acc: jax.Array, ml: jax.Array) -> jax.Array:
    """Merges the L parts of ``shared_qk`` with ``l_split > 1``: ``acc fp32 [S, N, H, d]``, ``ml fp32 [S, N, 2, H]``
    (running max in base 2, running sum) → ``bf16 [N, H, d]``. Every running max is ≥ the sink's, so finite."""
    m, l_sum = ml[:, :, 0], ml[:, :, 1]                          # [S, N, H]
    w = jnp.exp2(m - m.max(axis=0, keepdims=True))
    total = (w * l_sum).sum(axis=0)                              # ≥ the sink's term of part 0 · its weight > 0
    o = (w[..., None] * acc).sum(axis=0) / total[..., None]
    return o.astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_stages", "v_split", "organisation",
                                             "l_split", "early_release"))
def sparse_decode_attention(q: jax.Array, kv: jax.Array, valid: jax.Array, sink: jax.Array, *, scale: float,
                            block_kv: int = 64, num_stages: int = 2, v_split: int = 2,
                            organisation: str = "split_cta", l_split: int = 1,
                            early_release: bool = False) -> jax.Array:
    """Decode attention over each query's gathered rows on Hopper (organisations: module docstring).

    ``s = scale · q[n,h]·kv[n,l]`` (fp32); ``p = softmax({s : valid} ∪ {sink[h]})`` without the sink's entry;
    ``o[n,h] = bf16(Σ_l bf16(p) · kv[n,l])`` (fp32 accumulation); 0 for a query with no valid row.

    Args:
      q: ``bf16 [N, H, d]``; H a multiple of 64, d a multiple of ``64 · v_split`` with ``d / v_split ≤ 256``.
      kv: ``bf16 [N, L, d]``, the key rows and the value rows; L a multiple of ``block_kv``; every row finite
        (padding too).
      valid: ``bool [N, L]``; False rows contribute exactly 0.
      sink: ``fp32 [H]`` (finite).
      scale: logit scale (static).
      block_kv: KV rows per pipeline step (multiple of 32 for ``split_cta`` and ``pingpong``, of 64 otherwise).
      num_stages: TMA pipeline depth (capped at the number of KV steps; shared memory permitting).
      v_split: column chunks of d: ``split_cta``, CTAs per (token, head block), each producing ``d / v_split``
        output columns (also ``pingpong``); ``shared_qk``, its consumer warpgroups (must be 2).
      organisation: ``"split_cta"`` (default: ``v_split`` CTAs per token, each computing the whole QK product),
        ``"split_cluster"`` (``split_cta``'s CTAs of a token as one cluster, each Q and KV tile read once from L2
        and multicast to all of them; v_split 2–8),
        ``"shared_qk"`` (one CTA per token and head block, two consumer warpgroups sharing the QK product) or
        ``"pingpong"`` (``split_cta``'s CTAs, each with two consumer warpgroups on alternate KV blocks; an even
        ``num_stages`` when stages are refilled) or ``"seesaw"`` (one CTA per token and L part, FlashMLA's
        schedule; 64-row blocks, ≥ 2 stages, ``l_split`` as ``shared_qk``).
      l_split: ``shared_qk`` and ``seesaw`` only: CTAs per (token, head block), each over ``L / l_split`` rows,
        their fp32 partial outputs merged by XLA after the kernel (must divide ``L / block_kv``).
      early_release: ``split_cta`` only: each KV step releases the column chunks that only its QK product reads
        (the other CTAs' output columns) as soon as that product is done, so their refill is in flight during the
        softmax and P·V; the CTA's own chunk and the mask row are released after P·V as before.
    Returns:
      ``o bf16 [N, H, d]``.
    """
    n, h, d, rows = check_shapes(q, kv, valid, sink)
    if q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16:
        raise ValueError(f"q and kv must be bf16, got {q.dtype} and {kv.dtype}")
    stages = check_config(h, d, rows, block_kv=block_kv, num_stages=num_stages, v_split=v_split,
                          organisation=organisation, l_split=l_split, early_release=early_release)
    dh = d // v_split
    bias = jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)
    args = (q.reshape(n, h, v_split, dh), kv.reshape(n, rows, v_split, dh), bias, sink.astype(jnp.float32))
    if organisation in ("split_cta", "split_cluster"):
        out = _split_cta_call(*args, scale=scale, block_kv=block_kv, stages=stages,
                              cluster=organisation == "split_cluster", early_release=early_release)
    elif organisation == "pingpong":
        from pallas_kernels.attention.decode_pingpong_sm90 import pingpong_call
        out = pingpong_call(*args, scale=scale, block_kv=block_kv, stages=stages)
    elif organisation == "seesaw":
        from pallas_kernels.attention.decode_seesaw_sm90 import seesaw_call
        out = seesaw_call(*args, scale=scale, block_kv=block_kv, stages=stages, l_split=l_split)
        if l_split > 1:
            acc, ml = out
            return _combine_parts(acc.reshape(l_split, n, h, d), ml)
    elif l_split == 1:
        out = _shared_qk_call(*args, scale=scale, block_kv=block_kv, stages=stages, l_split=1)
    else:
        acc, ml = _shared_qk_call(*args, scale=scale, block_kv=block_kv, stages=stages, l_split=l_split)
        return _combine_parts(acc.reshape(l_split, n, h, d), ml)
    return out.reshape(n, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_stages", "v_split", "early_release",
                                             "fp4_prefetch", "organisation", "l_split"))
def sparse_decode_attention_rows(q: jax.Array, pool: jax.Array, rows: jax.Array, valid: jax.Array, sink: jax.Array,
                                 *, scale: float, window: jax.Array | None = None, block_kv: int = 64,
                                 num_stages: int = 2, v_split: int = 2, early_release: bool = False,
                                 fp4_prefetch: bool = False, organisation: str = "split_cta",
                                 l_split: int = 1) -> jax.Array:
    """:func:`sparse_decode_attention` on ``kv = pool[rows]`` (or ``concat(window, pool[rows])``) without
    materialising the gathered rows: the kernel's memory warpgroup fetches each query's rows by index straight into
    its shared-memory tiles (``cp.async``, 16 bytes per thread and copy;
    :mod:`pallas_kernels.attention.row_gather_sm90`). Organisations ``split_cta`` and ``shared_qk`` (few queries,
    ``l_split`` CTAs per query, each gathering its part of the rows); the compute warpgroups are the same code, so
    the result equals ``sparse_decode_attention(q, kv, valid, sink, organisation=…, l_split=…)`` bit for bit.

    Args:
      q: ``bf16 [N, H, d]`` as in :func:`sparse_decode_attention`.
      pool: ``bf16 [R, d]``, rows addressed by ``rows`` (a paged cache viewed as rows: page · page_size + offset),
        or ``uint8 [R, d/2 + d/16]``: ``v41_fp4`` rows (V4.1's compressed KV), decoded by the kernel as it fetches
        them (exactly the bf16 values ``kv_formats.decode`` gives).
      rows: ``int32 [N, K]``. Entries outside ``[0, R)`` are clamped into it (only for safety: such rows must be
        masked by ``valid``); every row read must be finite, masked ones included.
      valid: ``bool [N, Sw + K]`` (``Sw = 0`` without ``window``); ``Sw + K`` a multiple of ``block_kv``.
      sink: ``fp32 [H]``; scale, num_stages, v_split, early_release: as in :func:`sparse_decode_attention`.
      window: optional ``bf16 [N, Sw, d]``, rows each query reads before its pool rows (its sliding window, laid
        out by the caller), ``Sw`` a multiple of ``block_kv``; fetched by the same copies from this second source.
      block_kv: KV rows per pipeline step, a multiple of 32 (split_cta's smallest step; 32-row steps use 64-byte
        swizzled ``(8, 32)`` tiles, :func:`kv_swizzle`). The producer can have ``num_stages − 1`` steps' copies in
        flight (:func:`~pallas_kernels.attention.row_gather_sm90.producer_wait_pending`), so 32-row steps in 4
        stages keep 96 rows in flight where 64-row steps in 2 stages (what fits at d = 512) keep 64.
      fp4_prefetch: ``v41_fp4`` pools only: copy each step's stored rows whole into shared memory one step ahead
        and decode them from there (:func:`_produce_fp4_prefetch`), instead of loading, decoding and storing
        each step synchronously; needs two staging buffers of ``block_kv`` rows (fits with 32-row steps) and the
        window's steps to fit the stages. ``split_cta`` only.
      organisation, l_split: ``"split_cta"`` or ``"shared_qk"`` (``v_split`` 2; ``l_split`` dividing ``L /
        block_kv``; its gathering warpgroup has :data:`SHARED_QK_GATHER_REGISTERS` registers), as in
        :func:`sparse_decode_attention`.
    Returns:
      ``o bf16 [N, H, d]``.
    """
    from pallas_kernels.attention.row_gather_sm90 import check_gather_shape

    n, h, d = q.shape
    sw = 0 if window is None else window.shape[1]
    fp4 = pool.dtype == jnp.uint8
    row_width = d // 2 + d // 16 if fp4 else d
    if pool.ndim != 2 or pool.shape[1] != row_width:
        raise ValueError(f"pool must be [R, d={d}] bf16 or [R, d/2 + d/16 = {d // 2 + d // 16}] uint8 (v41_fp4 "
                         f"rows), got {pool.shape} {pool.dtype}")
    if window is not None and (window.ndim != 3 or window.shape[0] != n or window.shape[2] != d):
        raise ValueError(f"window must be [N={n}, Sw, d={d}], got {window.shape}")
    if rows.ndim != 2 or rows.shape[0] != n or valid.shape != (n, sw + rows.shape[1]):
        raise ValueError(f"rows {rows.shape} must be [N={n}, K] and valid {valid.shape} [N, Sw={sw} + K]")
    if q.dtype != jnp.bfloat16 or (window is not None and window.dtype != jnp.bfloat16):
        raise ValueError(f"q and window must be bf16, got {q.dtype} and {None if window is None else window.dtype}")
    if pool.dtype not in (jnp.bfloat16, jnp.uint8):
        raise ValueError(f"pool must be bf16 rows or uint8 v41_fp4 rows, got {pool.dtype}")
    if not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows must be integer row indices, got {rows.dtype}")
    length = sw + rows.shape[1]
    check_shapes(q, jax.ShapeDtypeStruct((n, length, d), jnp.bfloat16), valid, sink)
    if block_kv % 32 or sw % block_kv:
        raise ValueError(f"block_kv={block_kv} must be a multiple of 32 dividing the window's {sw} rows")
    if organisation not in ("split_cta", "shared_qk"):
        raise ValueError(f"the gathering kernel's organisation must be 'split_cta' or 'shared_qk', got "
                         f"{organisation!r}")
    if fp4_prefetch and not fp4:
        raise ValueError("fp4_prefetch stages v41_fp4 rows: the pool must be uint8 v41_fp4 rows")
    if fp4_prefetch and organisation != "split_cta":
        raise ValueError("fp4_prefetch is a split_cta producer")
    staging = 2 * block_kv * row_width if fp4_prefetch else 0
    stages = check_config(h, d, length, block_kv=block_kv, num_stages=num_stages, v_split=v_split,
                          organisation=organisation, l_split=l_split, early_release=early_release,
                          extra_smem=4 * length + staging)
    if fp4_prefetch and sw // block_kv > stages:
        raise ValueError(f"fp4_prefetch fetches the window's {sw // block_kv} steps into fresh stages first: they "
                         f"must fit the {stages} stages")
    dh = d // v_split
    check_gather_shape(block_kv, dh, kv_swizzle(block_kv))
    bias = jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)
    idx = jnp.clip(rows, 0, pool.shape[0] - 1).astype(jnp.int32)
    window4 = None
    if window is not None:        # query n's window rows are rows n·Sw … n·Sw + Sw − 1 of the window source
        idx = jnp.concatenate([jnp.arange(n * sw, dtype=jnp.int32).reshape(n, sw), idx], axis=1)
        window4 = window.reshape(n * sw, v_split, dh)
    args = (q.reshape(n, h, v_split, dh), pool if fp4 else pool.reshape(pool.shape[0], v_split, dh), bias,
            sink.astype(jnp.float32))
    gather = dict(rows_idx=idx.reshape(n, length // block_kv, block_kv), window4=window4)
    if organisation == "shared_qk" and l_split > 1:
        acc, ml = _shared_qk_call(*args, scale=scale, block_kv=block_kv, stages=stages, l_split=l_split, **gather)
        return _combine_parts(acc.reshape(l_split, n, h, d), ml)
    if organisation == "shared_qk":
        out = _shared_qk_call(*args, scale=scale, block_kv=block_kv, stages=stages, l_split=1, **gather)
    else:
        out = _split_cta_call(*args, scale=scale, block_kv=block_kv, stages=stages, early_release=early_release,
                              fp4_prefetch=fp4_prefetch, **gather)
    return out.reshape(n, h, d)


def traffic(n: int, h: int, d: int, rows: int, *, v_split: int = 2, organisation: str = "split_cta",
            l_split: int = 1) -> dict[str, float]:
    """Work of one call, for achieved-rate figures.

    ``bytes_read``: the minimum HBM reads — kv ``N·L·d·2`` + q ``N·H·d·2`` + mask ``N·L·4`` + sink ``H·4`` (with
    ``split_cta`` each KV tile is read by ``v_split`` CTAs; the repeats are meant to hit L2). ``bytes``: reads + the
    output ``N·H·d·2``. Neither counts ``shared_qk``'s fp32 partial outputs with ``l_split > 1`` (written and read
    back once each: ``partial_bytes`` = ``2 · l_split·N·H·d·4``, plus the running max and sum).
    ``flops_useful``: the contract's products, ``2·N·H·L·d`` (QK) + ``2·N·H·L·d`` (PV) = ``4·N·H·L·d``.
    ``flops_executed``: what the tensor cores run: ``split_cta`` computes the QK product once per split,
    ``2·N·H·L·d·v_split + 2·N·H·L·d`` (``6·N·H·L·d`` = 1.5 × useful at v_split = 2), as does ``pingpong``;
    ``shared_qk`` and ``seesaw`` once.
    """
    qk = 2 * n * h * rows * d
    read = n * rows * d * 2 + n * h * d * 2 + n * rows * 4 + h * 4
    partial = 2 * l_split * n * h * (d + 2) * 4 if organisation in ("shared_qk", "seesaw") and l_split > 1 else 0
    qk_times = 1 if organisation in ("shared_qk", "seesaw") else v_split
    return dict(bytes_read=float(read), bytes=float(read + n * h * d * 2), flops_useful=float(2 * qk),
                flops_executed=float(qk * qk_times + qk), partial_bytes=float(partial))
