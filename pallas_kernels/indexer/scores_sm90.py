"""Lightning-indexer scores over FP4 index-key rows for Hopper (Mosaic GPU).

Contract (the same as :func:`pallas_kernels.indexer.reference.index_scores_rows_ref`)::

    index_scores_rows(q, w, rows) -> scores
    q      [B, S, H, 128]  fp32 / bf16  FP4 values (Q4u: e2m1 codes times powers of two), exact in bf16
    w      [B, S, H]       fp32         H a multiple of 32, at most 128 (32 in V4.1-Flash, 64 in V4)
    rows   [B, T, 68]      uint8        ``fp4_index`` rows ``[64 B packed e2m1 | 4 B UE8M0]`` (as the cache stores them)
    scores [B, S, T]       fp32         Σ_h relu(q[b,s,h] · k[b,t]) · w[b,s,h]

The keys never exist in memory as numbers: each 64-row tile of rows is copied (TMA) into shared memory as its
4352 bytes, and every thread decodes its part of the tile straight into the WGMMA A-operand registers.

The paged form, :func:`index_scores_paged`, reads the same rows through a page table (``pool uint8 [L, N, rpb,
68]``, ``pages [B, P]``, a layer index): what the model's caches hold, without gathering them first.

**Organisation.** Grid ``(splits, B)``: CTA ``(p, b)`` handles a contiguous run of ``T / tile_rows / splits``
tiles of sequence ``b`` with one warpgroup: it loads ``b``'s queries (``[S, 128, H]`` bf16, the WGMMA B operand)
and head weights once, keeps ``stages`` tiles in flight (TMA into a ring of uint8 buffers, one copy per 32 rows:
2176 contiguous bytes, as the 68-byte row stride is not 16-byte aligned, boxed as ``[17, 128]`` by default or
``[136, 16]`` — the same bytes land in shared memory either way, and 128-byte lines copy faster; the page of each
32-row piece is read from the page table in GMEM, so pages must hold a multiple of 32 rows), and per tile of
``tile_rows`` rows (128 by default): decodes its 64-row sub-tiles into registers, releases the buffer to the next
TMA, then per query ``s`` one WGMMA ``[64 keys, 128] × [128, H]`` per sub-tile into fp32 (all issued before the
wait), ``relu``, the head weights broadcast over the rows, a row sum over the heads, and one TMA store of the
tile's scores. Shared memory is small (``S · 16 KiB`` of queries at H = 64 + ``stages`` × 8.5 KiB at 128-row
tiles), so several CTAs share an SM and their TMA streams overlap.

**Register decode.** In the WGMMA A layout thread ``t = 32w + 4g + c`` holds rows ``r = 16w + g + 8·q0`` and
columns ``16·kc + 2c + 8·q1 + h`` (``q0, q1, h ∈ {0, 1}``, ``kc ∈ 0..7``). The thread reads bytes ``16c .. 16c + 15``
of each of its rows (four aligned 32-bit loads: row ``r`` starts at byte ``68 r``, a multiple of 4): codes of dims
``32c .. 32c + 31``, which is exactly scale group ``c`` — one scale byte per row for all its 32 registers. Which
of its codes lands in which register is free, provided the queries' dims are permuted the same way
(:func:`key_permutation`). The kernel pairs nibble ``j`` and nibble ``j + 4`` of word ``i`` into the register of
chunk ``kc = 2i + j // 2``, half ``q1 = j % 2``, so that one register is::

    ((x << (6 − 4j)) & 0x01C001C0) | ((x << (12 − 4j)) & 0x80008000)      (negative shifts shift right)

i.e. sign → bit 15, exponent and mantissa bits → bits 8..6 of each bf16 half: the bf16 pattern of
``e2m1(code) · 2^−126``. Column ``16kc + 2c + 8q1 + h`` therefore holds dim ``32c + 8·(kc // 2) + 2·(kc % 2) + q1 +
4h``. Each register is then multiplied (``bf16x2``) by ``2^(S − 65)`` built from the scale byte ``S`` as
``((S + 62) · 0x10001) << 7``: ``e2m1 · 2^(S − 191)``. The queries are multiplied by ``2^64`` (exact) when they are
cast to bf16, so every product is ``e2m1 · 2^(S − 127) · q`` exactly, accumulated in fp32.

**Range.** The multiplier is a normal bf16 number for ``S ≤ 192``, i.e. key blocks with maxima up to ``6 · 2^65``;
decoded keys are exact down to ``e2m1 · 2^(S − 127) ≥ 2^−133 · 2^64`` (below that, blocks with ``S < 59``, i.e.
maxima under ``6 · 2^−68``, bf16 flushes some to zero: the reference keeps them). Queries must stay below
``2^63`` in magnitude. Rows the caller will mask (past a sequence's length, stale pages) may decode to anything,
including inf / NaN, and must be masked by a select, not a multiply.

:func:`host_decode_tile` is the register decode on the host (what the CPU tests check against the format's
definition); the kernel issues the same operations. Checked on the H200 (jax 0.11.2, 2026-12-04):
tests/test_indexer_kernel_gpu.py passed (kernel against the reference, engine with the kernel against the full
forward) with 16-byte boxes and 64-row tiles; the kernel-vs-reference cases also with the present defaults (not
yet the engine case). At V4.1-Flash's size, batch 64 and 128K context: 0.129–0.131 ms = 51–52% of copy bandwidth
on the stored bytes (0.147 ms, 46%, with the earlier 16-byte boxes; ``docs/perf/attention_h200.md``). Imports
of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.indexer.reference import check_shapes
from pallas_kernels.mgpu_compat import load_whole

DIM = 128                       # index head width the register decode is built for (four scale groups of 32)
ROW_BYTES = DIM // 2 + DIM // 32    # 68
TILE = 64                       # key rows per WGMMA (its M)
TILE_ROWS = (64, 128, 256)      # key rows a CTA takes per pipeline step: 1, 2 or 4 WGMMA sub-tiles
# measured on the H200 (docs/perf/attention_h200.md, fifth session of 2026-12-04): 128-row steps over 128-byte-wide
# TMA boxes take 12% less time than 64-row steps over 16-byte-wide boxes (0.129 vs 0.147 ms)
DEFAULT_TILE_ROWS = 128
DEFAULT_BOX_BYTES = 128
QUERY_SCALE = 2.0 ** 64         # queries are pre-multiplied by this; keys carry 2^-64 (module docstring)
MAX_QUERIES = 8                 # query tokens per sequence a CTA holds in shared memory (decode and verify rows)
TARGET_CTAS = 132 * 4           # several small CTAs per SM overlap their TMA streams
SMEM_BYTES = 232448             # H100/H200 dynamic shared memory per CTA
SMEM_ALIGNMENT = 1024
REDUCTION_SCRATCH = 2048
BODY_MASK = 0x01C001C0
SIGN_MASK = 0x80008000


def key_permutation() -> np.ndarray:
    """``perm [128]``: WGMMA column ``j`` of the decoded key tile holds key dim ``perm[j]`` (module docstring)."""
    perm = np.empty(DIM, np.int64)
    for kc in range(8):
        for c in range(4):
            for q1 in range(2):
                for h in range(2):
                    perm[16 * kc + 2 * c + 8 * q1 + h] = 32 * c + 8 * (kc // 2) + 2 * (kc % 2) + q1 + 4 * h
    return perm


def _shift(x: int, n: int) -> int:
    return (x << n) & 0xFFFFFFFF if n >= 0 else x >> -n


def register_bits(word: int, j: int) -> int:
    """Host model of one register: the two bf16 patterns ``e2m1 · 2^−126`` of nibbles ``j`` (low half) and
    ``j + 4`` (high half) of a little-endian 32-bit word. Same shifts and masks as the kernel."""
    return (_shift(word, 6 - 4 * j) & BODY_MASK) | (_shift(word, 12 - 4 * j) & SIGN_MASK)


def multiplier_bits(scale: int) -> int:
    """Host model of the scale step: two bf16 ``2^(S − 65)`` for the UE8M0 byte ``S`` (valid for ``S ≤ 192``)."""
    return (((scale + 62) * 0x10001) << 7) & 0xFFFFFFFF


def _bf16_value(bits16: int) -> float:
    sign = -1.0 if bits16 & 0x8000 else 1.0
    e, m = (bits16 >> 7) & 0xFF, bits16 & 0x7F
    return sign * (m / 128 * 2.0 ** -126 if e == 0 else (1 + m / 128) * 2.0 ** (e - 127))


def host_decode_tile(rows: np.ndarray) -> np.ndarray:
    """The kernel's decode of one tile on the host: ``uint8 [64, 68]`` → ``float64 [64, 128]``, the A operand in
    WGMMA column order (column ``j`` = key dim ``key_permutation()[j]`` times ``2^−64``)."""
    rows = np.asarray(rows, np.uint8)
    assert rows.shape == (TILE, ROW_BYTES)
    out = np.zeros((TILE, DIM))
    for t in range(128):
        w, g, c = t // 32, (t % 32) // 4, t % 4
        for q0 in range(2):
            r = 16 * w + g + 8 * q0
            words = rows[r, 16 * c:16 * c + 16].view("<u4")
            mul = multiplier_bits(int(rows[r, 64 + c]))
            for kc in range(8):
                for q1 in range(2):
                    bits = register_bits(int(words[kc // 2]), 2 * (kc % 2) + q1)
                    for h in range(2):
                        v = _bf16_value((bits >> 16 * h) & 0xFFFF) * _bf16_value((mul >> 16 * h) & 0xFFFF)
                        out[r, 16 * kc + 2 * c + 8 * q1 + h] = v
    return out


def query_operand(q: jax.Array) -> jax.Array:
    """Queries ``[B, S, H, 128]`` → the WGMMA B operand ``bf16 [B, S, 128, H]``: dims in :func:`key_permutation`
    order, times ``2^64`` (exact for FP4 values)."""
    qp = jnp.take(q.astype(jnp.float32), jnp.asarray(key_permutation()), axis=-1) * QUERY_SCALE
    return jnp.swapaxes(qp.astype(jnp.bfloat16), -1, -2)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def smem_bytes(s: int, h: int, stages: int, tile_rows: int = DEFAULT_TILE_ROWS) -> int:
    """Shared memory one CTA allocates, each buffer rounded up to 1 KiB as Pallas does: the queries ``[S, 128,
    H]`` bf16, the head weights, the ring of ``stages`` key tiles of ``tile_rows`` rows, two score tiles ``[S,
    tile_rows]`` fp32, mbarriers, and the 2 KiB Pallas reserves for cross-warp reductions by default."""
    return (REDUCTION_SCRATCH + _aligned(s * DIM * h * 2) + _aligned(s * h * 4)
            + _aligned(stages * tile_rows * ROW_BYTES) + _aligned(2 * s * tile_rows * 4) + 8 * (1 + stages))


def check_config(b: int, s: int, h: int, d: int, t: int, *, stages: int, splits: int | None,
                 tile_rows: int = DEFAULT_TILE_ROWS) -> tuple[int, int]:
    """Validates the static configuration; returns ``(splits, stages)`` actually used (``splits`` CTAs per sequence
    over the ``T / tile_rows`` tiles)."""
    if d != DIM:
        raise ValueError(f"the kernel's register decode needs index head width {DIM}, got {d}")
    if h % 32 or not 32 <= h <= 128:
        raise ValueError(f"number of index heads H={h} must be 32, 64, 96 or 128 (the WGMMA N side)")
    if not 1 <= s <= MAX_QUERIES:
        raise ValueError(f"query tokens per sequence S={s} must be between 1 and {MAX_QUERIES}")
    if tile_rows not in TILE_ROWS:
        raise ValueError(f"tile_rows={tile_rows} must be one of {TILE_ROWS}")
    if t <= 0 or t % tile_rows:
        raise ValueError(f"number of key rows T={t} must be a positive multiple of tile_rows={tile_rows}")
    if stages < 1:
        raise ValueError(f"stages={stages} must be at least 1")
    tiles = t // tile_rows
    need = smem_bytes(s, h, min(stages, tiles), tile_rows)
    if need > SMEM_BYTES:
        raise ValueError(f"shared memory {need} B (S={s} query tokens of H={h} heads, stages={stages}) exceeds "
                         f"{SMEM_BYTES} B per CTA; fewer query tokens per call")
    if splits is None:
        splits = max(p for p in range(1, tiles + 1) if tiles % p == 0 and (b * p <= TARGET_CTAS or p == 1))
    if splits < 1 or tiles % splits:
        raise ValueError(f"splits={splits} must divide the number of tiles T / tile_rows = {tiles}")
    return splits, min(stages, tiles // splits)


def _decode_keys(plgpu, k_ref, first_row: int = 0):
    """Rows ``first_row … first_row + 63`` of the tile ``k_ref`` (uint8 smem ``[copies, 2176 / box, box]``: rows
    of 68 bytes, contiguous) → bf16 ``[64, 128]`` in the WGMMA register layout (module docstring)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    shape = (TILE, DIM)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct(shape, jnp.bfloat16, plgpu.Layout.WGMMA),
    )
    def decoded(_, k_smem):
        layout = fa.WGMMA_LAYOUT
        i32 = ir.IntegerType.get_signless(32)
        i8 = ir.IntegerType.get_signless(8)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())

        def c(v):
            return arith.constant(i32, v - (1 << 32) if v >= 1 << 31 else v)

        def shift(x, n):
            if n == 0:
                return x
            return arith.shli(x, c(n)) if n > 0 else arith.shrui(x, c(-n))

        base = mgpu_utils.memref_ptr(k_smem)
        t = arith.remui(mgpu_utils.thread_idx(), c(128))
        warp, lane = arith.shrui(t, c(5)), arith.andi(t, c(31))
        g, cc = arith.shrui(lane, c(2)), arith.andi(lane, c(3))

        def load_word(byte_offset):
            return llvm.load(i32, mgpu_utils.getelementptr(base, [byte_offset], i8))

        words, muls = {}, {}
        for q0 in range(2):
            r = arith.addi(arith.addi(arith.muli(warp, c(16)), g), c(first_row + 8 * q0))
            row0 = arith.muli(r, c(ROW_BYTES))
            first = arith.addi(row0, arith.muli(cc, c(16)))
            words[q0] = [load_word(arith.addi(first, c(4 * i))) for i in range(4)]
            scale = arith.andi(arith.shrui(load_word(arith.addi(row0, c(64))), arith.muli(cc, c(8))), c(0xFF))
            mul = arith.shli(arith.muli(arith.addi(scale, c(62)), c(0x10001)), c(7))
            muls[q0] = mgpu_utils.bitcast(mul, bf16x2)

        strides = mgpu_utils.get_contiguous_strides(shape)
        tile_strides = layout.tiling.tile_strides(strides)
        regs_shape = layout.registers_shape(shape)
        out = np.empty(regs_shape, dtype=object)
        for tile_idx in np.ndindex(regs_shape):
            lin = sum(i * s for i, s in zip(tile_idx, tile_strides, strict=False))
            d_row, d_col = divmod(lin, shape[1])
            q0, rrem = divmod(d_row, 8)
            kc, crem = divmod(d_col, 16)
            q1, crem = divmod(crem, 8)
            if rrem or crem or q0 > 1:
                raise AssertionError(f"unexpected WGMMA register offset ({d_row}, {d_col})")
            j = 2 * (kc % 2) + q1
            x = words[q0][kc // 2]
            bits = arith.ori(arith.andi(shift(x, 6 - 4 * j), c(BODY_MASK)),
                             arith.andi(shift(x, 12 - 4 * j), c(SIGN_MASK)))
            out[tile_idx] = arith.mulf(mgpu_utils.bitcast(bits, bf16x2), muls[q0])
        return fa.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return decoded(k_ref)


def copy_rows(rows_per_page: int) -> int:
    """Rows per TMA copy: 32 (2176 bytes = 136 16-byte lines; TMA boxes hold at most 256 lines, and Pallas's copies
    move a multiple of 128 bytes, which 68-byte rows reach at multiples of 32 rows). Pages must hold a multiple of
    32 rows (DeepInfer's 128-token pages at ratio 2 or 4); :func:`index_scores_rows` takes any layout."""
    if rows_per_page <= 0 or rows_per_page % 32:
        raise ValueError(f"rows per page {rows_per_page} must be a positive multiple of 32 for the paged kernel")
    return 32


def _kernel_call(qt: jax.Array, w: jax.Array, pool: jax.Array, layer: jax.Array, pages: jax.Array, *,
                 splits: int, stages: int, early_page_reads: bool = True, tile_rows: int = DEFAULT_TILE_ROWS,
                 box_bytes: int = DEFAULT_BOX_BYTES) -> jax.Array:
    """The Mosaic GPU kernel.

    Args:
      qt: ``bf16 [B, S, 128, H]`` (:func:`query_operand`); w: ``fp32 [B, S, H]``.
      pool: ``uint8 [L, N, rpb, 68]`` paged index-key rows (``rpb`` rows per page).
      layer: ``int32 []``, the layer of ``pool`` to read; pages: ``int32 [B, P]``, ``P · rpb`` a multiple of
        ``tile_rows``.
      early_page_reads: read the next refill's page ids before waiting for the current tile (benchmark switch;
        False reads them after the decode, right before the copies).
      box_bytes: inner width of the TMA box over a 32-row piece (2176 contiguous bytes as ``[2176 / box_bytes,
        box_bytes]``: 16 or 128; the shared-memory bytes are the same either way).
      tile_rows: key rows per pipeline step, ``tile_rows / 64`` WGMMA sub-tiles decoded together and their products
        issued back to back, so a step's fixed costs (barriers, the score store) are paid once per ``tile_rows``.
    Returns:
      ``fp32 [B, S, P · rpb]``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, s, d, h = qt.shape
    n_layers, n_pages, rpb, _ = pool.shape
    n_table = pages.shape[1]
    t = n_table * rpb
    rc = copy_rows(rpb)
    pieces = rpb // rc                      # copies per page
    copies = tile_rows // rc                # copies per tile
    subtiles = tile_rows // TILE
    box = (rc * ROW_BYTES // box_bytes, box_bytes)
    pool4 = pool.reshape(n_layers, n_pages * pieces, *box)    # a free reshape: rows are contiguous in a page
    tiles_per_cta = t // tile_rows // splits
    swizzle = min(128, 2 * h)
    q_transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    def body(meta_ref, pages_ref, q_ref, w_ref, pool_ref, out_ref, q_smem, w_smem, k_smem, o_smem, setup_barrier,
             loaded_barriers):
        seq = lax.axis_index("seq")
        tile0 = lax.axis_index("split") * tiles_per_cta
        layer_idx = meta_ref[0]
        for i in range(s):
            plgpu.copy_gmem_to_smem(q_ref.at[seq, i], q_smem.at[i], setup_barrier)
        plgpu.copy_gmem_to_smem(w_ref.at[seq], w_smem, setup_barrier)

        def pieces_of(i):
            """The pool pieces (page · pieces + piece within the page) of this CTA's tile ``i`` (clamped into the
            table, so a load for a tile that does not exist is harmless)."""
            out = []
            for j in range(copies):
                row = (tile0 + i) * tile_rows + j * rc
                page = pages_ref[seq, jnp.minimum(row // rpb, n_table - 1)]
                out.append(page * pieces + (row % rpb) // rc if pieces > 1 else page)
            return out

        def issue(tile_pieces, slot):
            for j, piece in enumerate(tile_pieces):
                plgpu.copy_gmem_to_smem(pool_ref.at[layer_idx, piece], k_smem.at[slot, j], loaded_barriers.at[slot])

        for i in range(stages):
            issue(pieces_of(i), i)
        plgpu.barrier_wait(setup_barrier)
        head_weights = [load_whole(plgpu, w_smem.at[i], plgpu.Layout.WGMMA.reduce(0)) for i in range(s)]

        @pl.loop(0, tiles_per_cta)
        def _tile(i):
            slot = lax.rem(i, jnp.array(stages, i.dtype))
            # the refill's page-table reads (GMEM) go out before the waits below, so their latency hides behind them
            refill = pieces_of(i + stages) if early_page_reads else None
            plgpu.barrier_wait(loaded_barriers.at[slot])
            keys = [_decode_keys(plgpu, k_smem.at[slot], TILE * j) for j in range(subtiles)]
            plgpu.commit_smem()              # every thread has read the slot: it may be refilled

            @pl.when(i + stages < tiles_per_cta)
            def _refill():
                issue(refill if early_page_reads else pieces_of(i + stages), slot)

            o_slot = lax.rem(i, jnp.array(2, i.dtype))
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)    # the store from this o_slot two tiles ago is out
            for qi in range(s):
                def qk(*acc_refs, qi=qi):
                    for j, acc_ref in enumerate(acc_refs):     # all sub-tiles' products in flight, then one wait
                        plgpu.wgmma(acc_ref, keys[j], q_smem.at[qi])
                    return [acc_ref[...] for acc_ref in acc_refs]

                accs = pl.run_scoped(qk, *[plgpu.ACC((TILE, h), jnp.float32) for _ in range(subtiles)])
                for j, acc in enumerate(accs):
                    weighted = jnp.maximum(acc, 0.0) * lax.broadcast_in_dim(head_weights[qi], acc.shape, [1])
                    o_smem.at[o_slot, qi, pl.ds(TILE * j, TILE)][...] = weighted.sum(axis=1)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[o_slot],
                                    out_ref.at[seq, pl.ds(0, s), pl.ds((tile0 + i) * tile_rows, tile_rows)])

        plgpu.wait_smem_to_gmem(0)

    body.__name__ = f"index_scores_fp4_h{h}_s{s}_rpb{rpb}_t{tile_rows}"
    scratch = [
        plgpu.SMEM((s, d, h), jnp.bfloat16, transforms=q_transforms),
        plgpu.SMEM((s, h), jnp.float32),
        plgpu.SMEM((stages, copies, *box), jnp.uint8),
        plgpu.SMEM((2, s, tile_rows), jnp.float32),
        plgpu.Barrier(num_arrivals=s + 1),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, s, t), jnp.float32),
        scratch_types=scratch,
        grid=(splits, b),
        grid_names=("split", "seq"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    meta = jnp.reshape(layer, (1,)).astype(jnp.int32)
    return kernel(meta, pages.astype(jnp.int32), qt, w, pool4)


def padded_pages(n_pages: int, rows_per_page: int, tile_rows: int) -> int:
    """The fewest pages ``≥ n_pages`` whose rows are a multiple of ``tile_rows``: a multiple of ``tile_rows /
    gcd(rows_per_page, tile_rows)`` pages."""
    step = tile_rows // math.gcd(rows_per_page, tile_rows)
    return -(-n_pages // step) * step


@functools.partial(jax.jit, static_argnames=("stages", "splits", "early_page_reads", "tile_rows", "box_bytes"))
def index_scores_paged(q: jax.Array, w: jax.Array, pool: jax.Array, layer: jax.Array, pages: jax.Array, *,
                       stages: int = 4, splits: int | None = None, early_page_reads: bool = True,
                       tile_rows: int = DEFAULT_TILE_ROWS, box_bytes: int = DEFAULT_BOX_BYTES) -> jax.Array:
    """Indexer scores ``fp32 [B, S, P · rpb]`` of queries ``q [B, S, H, 128]`` (FP4 values) with head weights ``w
    [B, S, H]`` over each sequence's pages ``pages [B, P]`` of layer ``layer`` of the paged rows ``pool uint8 [L, N,
    rpb, 68]`` — the rows :func:`dinfer_jax.models.cache_io.pages_read` would gather, read by the kernel through
    the page table. A page count whose rows are not a multiple of ``tile_rows`` is padded with page 0 (those scores
    are cut off again). ``stages``: tiles in flight per CTA; ``splits``: CTAs per sequence (default: as many as keep
    ≤ ~4 CTAs per SM busy); ``tile_rows``: key rows per pipeline step (64, 128 or 256)."""
    if q.ndim != 4 or w.shape != q.shape[:3]:
        raise ValueError(f"q must be [B, S, H, D] and w [B, S, H], got {q.shape} and {w.shape}")
    b, s, h, d = q.shape
    if pool.ndim != 4 or pool.dtype != jnp.uint8 or pool.shape[-1] != ROW_BYTES:
        raise ValueError(f"pool must be uint8 [L, N, rows per page, {ROW_BYTES}], got {pool.dtype} {pool.shape}")
    rpb = pool.shape[2]
    if pages.ndim != 2 or pages.shape[0] != b:
        raise ValueError(f"pages must be [B={b}, P], got {pages.shape}")
    copy_rows(rpb)
    if tile_rows not in TILE_ROWS:
        raise ValueError(f"tile_rows={tile_rows} must be one of {TILE_ROWS}")
    if box_bytes not in (16, 128):
        raise ValueError(f"box_bytes={box_bytes} must be 16 or 128")
    t = pages.shape[1] * rpb
    n_pages = padded_pages(pages.shape[1], rpb, tile_rows)
    if n_pages != pages.shape[1]:
        pages = jnp.pad(pages, ((0, 0), (0, n_pages - pages.shape[1])))
    splits, stages = check_config(b, s, h, d, n_pages * rpb, stages=stages, splits=splits, tile_rows=tile_rows)
    out = _kernel_call(query_operand(q), w.astype(jnp.float32), pool, jnp.asarray(layer, jnp.int32), pages,
                       splits=splits, stages=stages, early_page_reads=early_page_reads, tile_rows=tile_rows,
                       box_bytes=box_bytes)
    return out[:, :, :t] if n_pages * rpb != t else out


@functools.partial(jax.jit, static_argnames=("stages", "splits", "tile_rows"))
def index_scores_rows(q: jax.Array, w: jax.Array, rows: jax.Array, *, stages: int = 4,
                      splits: int | None = None, tile_rows: int = DEFAULT_TILE_ROWS) -> jax.Array:
    """Indexer scores ``fp32 [B, S, T]`` of queries ``q [B, S, H, 128]`` (FP4 values) with head weights ``w [B, S,
    H]`` over rows already laid out per sequence, ``uint8 [B, T, 68]`` (module docstring): the paged kernel with
    32-row pages in order. ``T`` that is not a multiple of ``tile_rows`` is padded with zero rows (their scores are
    cut off)."""
    b, s, h, d, t = check_shapes(q, w, rows)
    t_pad = -(-t // tile_rows) * tile_rows
    if t_pad != t:
        rows = jnp.pad(rows, ((0, 0), (0, t_pad - t), (0, 0)))
    per_seq = t_pad // 32
    pool = rows.reshape(1, b * per_seq, 32, ROW_BYTES)
    pages = jnp.arange(b * per_seq, dtype=jnp.int32).reshape(b, per_seq)
    out = index_scores_paged(q, w, pool, jnp.int32(0), pages, stages=stages, splits=splits, tile_rows=tile_rows)
    return out[:, :, :t] if t_pad != t else out


def traffic(b: int, s: int, h: int, t: int) -> dict[str, float]:
    """Work of one call: ``bytes_read`` = rows ``B·T·68`` + queries ``B·S·H·128·2`` + weights ``B·S·H·4``;
    ``bytes`` adds the scores ``B·S·T·4``; ``flops`` = ``2·B·S·H·T·128`` (the q·k products)."""
    read = b * t * ROW_BYTES + b * s * h * DIM * 2 + b * s * h * 4
    return dict(bytes_read=float(read), bytes=float(read + b * s * t * 4), flops=float(2 * b * s * h * t * DIM))
