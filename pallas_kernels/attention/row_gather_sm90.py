"""Rows gathered by index from global memory into swizzled WGMMA tiles, for Hopper (Mosaic GPU, ``cp.async``).

Hopper's TMA has no row gather (``tma gather4`` is Blackwell's), and a TMA copy of one row cannot land in a row of
a swizzled tile as Pallas expresses copies. So a warpgroup issues the gather itself, as Ampere-style kernels do:
every thread copies 16-byte pieces of rows with ``cp.async.cg.shared.global`` (an asynchronous global → shared
copy that holds no registers while in flight), computing for each piece the source address from the row index
and the destination address inside the swizzled tile, then ``cp.async.commit_group`` / ``cp.async.wait_group``
track completion per thread. The tile is the one Pallas declares as ``SMEM((rows, cols), bf16,
transforms=(TilingTransform((8, 64)), SwizzleTransform(128)))`` — what the WGMMA reads — so the consumer needs no
re-layout.

**Tile layout** (Mosaic GPU's, from ``FragmentedArray.transfer_tiled``): a ``[rows, cols]`` bf16 buffer tiled
``(8, 64)`` is stored as ``[rows / 8, cols / 64, 8, 64]``, i.e. 1 KiB tiles of eight 128-byte lines; 128-byte
swizzling XORs the 16-byte unit index within a line with the line index modulo 8. So element ``(r, 8k + e)``
(``k`` the 16-byte unit of the row, ``e < 8``) is at 16-byte unit

    ((r // 8) · (cols / 64) + k // 8) · 64 + (r % 8) · 8 + ((k % 8) XOR (r % 8))

of the buffer, whose base Pallas aligns to 1 KiB (the XOR is of address bits). 32-row KV steps use ``(8, 32)`` tiles
with 64-byte swizzling instead (the kernel's P·V product needs 64 contracted rows for 128-byte swizzling): 512-byte
tiles of eight 64-byte lines, where Mosaic XORs the unit index within a line (4 units) with the index of its
128-byte chunk modulo 4, i.e. ``(r % 8) // 2``. :func:`unit_offset` is that formula for both swizzles, written once
for both the host model (integers) and the kernel (MLIR values).

**Work split.** For one ``[block_rows, cols]`` destination the ``block_rows · cols / 8`` units are spread over the
128 threads: thread ``t`` takes units ``u = t + 128 j``, row ``u // (cols / 8)``, unit ``u % (cols / 8)``, so a
warp copies 512 contiguous bytes of one row at a time (coalesced) when ``cols = 256``.

What completion means: a thread's ``cp.async.wait_group n`` returns once all but its ``n`` newest groups have
landed; the kernel then fences the generic proxy against the async proxy (``fence.proxy.async``, the WGMMA reads
shared memory through the async proxy) and synchronises the warpgroup before one release arrival tells the
consumer (``plgpu.commit_smem`` + ``plgpu.barrier_arrive``).

Imports of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import numpy as np

UNIT_BYTES = 16                 # one cp.async transfer
TILE_ROWS = 8                   # rows of a WGMMA operand tile: (8, swizzle / 2) bf16, i.e. 8 swizzled lines
SWIZZLES = (128, 64)            # 128-byte lines for 64-row KV steps, 64-byte lines for 32-row steps
WARPGROUP = 128


class _IntOps:
    """Host integers for :func:`unit_offset` (the model the CPU tests check)."""

    @staticmethod
    def c(v):
        return v

    div = staticmethod(lambda a, b: a // b)
    rem = staticmethod(lambda a, b: a % b)
    add = staticmethod(lambda a, b: a + b)
    mul = staticmethod(lambda a, b: a * b)
    xor = staticmethod(lambda a, b: a ^ b)
    shl = staticmethod(lambda a, b: (a << b) & 0xFFFFFFFF)
    shr = staticmethod(lambda a, b: a >> b)
    band = staticmethod(lambda a, b: a & b)
    bor = staticmethod(lambda a, b: a | b)


def line_units(swizzle: int) -> int:
    """16-byte units per swizzled line (= per tile row): 8 for 128-byte swizzling, 4 for 64-byte."""
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES} bytes, got {swizzle}")
    return swizzle // UNIT_BYTES


def unit_offset(r, k, cols: int, ops=_IntOps, *, swizzle: int = 128):
    """16-byte unit of a ``(8, swizzle / 2)``-tiled, ``swizzle``-byte-swizzled bf16 ``[rows, cols]`` buffer
    holding elements ``(r, 8k … 8k + 7)`` (module docstring); ``r`` and ``k`` host ints or values of ``ops``'
    kind."""
    c = ops.c
    n = line_units(swizzle)
    tile = ops.add(ops.mul(ops.div(r, c(TILE_ROWS)), c(cols // (8 * n))), ops.div(k, c(n)))
    line = ops.rem(r, c(TILE_ROWS))
    # the XOR key: the 128-byte chunk of the unit modulo n (the line itself for 128 bytes, half of it for 64)
    key = line if n == 8 else ops.rem(ops.div(line, c(8 // n)), c(n))
    return ops.add(ops.add(ops.mul(tile, c(TILE_ROWS * n)), ops.mul(line, c(n))), ops.xor(ops.rem(k, c(n)), key))


def host_tile_image(block: np.ndarray, *, swizzle: int = 128) -> np.ndarray:
    """What the gather leaves in shared memory for the rows ``block [rows, cols]`` (any dtype, 2 bytes per element):
    the buffer's 16-byte units in address order, ``[rows · cols / 8, 8]``, placed by :func:`unit_offset`."""
    rows, cols = block.shape
    units = block.reshape(rows, cols // 8, 8)
    image = np.zeros((rows * cols // 8, 8), block.dtype)
    for r in range(rows):
        for k in range(cols // 8):
            image[unit_offset(r, k, cols, swizzle=swizzle)] = units[r, k]
    return image


def tile_transforms(plgpu, swizzle: int) -> tuple:
    """Pallas' transforms of a gathered tile: ``TilingTransform((8, swizzle / 2))`` + ``SwizzleTransform(swizzle)``."""
    return (plgpu.TilingTransform((TILE_ROWS, 8 * line_units(swizzle))), plgpu.SwizzleTransform(swizzle))


def check_gather_shape(block_rows: int, cols: int, swizzle: int = 128) -> None:
    """The gather's static constraints: whole ``(8, swizzle / 2)`` tiles and a whole number of units per thread."""
    tile_cols = 8 * line_units(swizzle)
    if cols % tile_cols or block_rows % TILE_ROWS:
        raise ValueError(f"a gathered tile must be whole (8, {tile_cols}) tiles, got [{block_rows}, {cols}]")
    if (block_rows * cols // 8) % WARPGROUP:
        raise ValueError(f"[{block_rows}, {cols}] bf16 is not a whole number of 16-byte units per thread of a "
                         f"warpgroup")


def issue_row_copies(plgpu, src_ref, rows_ref, dst_ref, *, block_rows: int, cols: int, swizzle: int = 128) -> None:
    """Every thread of the calling warpgroup issues its ``cp.async`` copies of ``dst[r] = src[rows[r]]`` for
    ``r < block_rows`` (no commit, no wait).

    Args:
      src_ref: GMEM bf16 ``[R, cols]`` (row stride from its memref type: a column chunk ``pool.at[:, c]`` of a
        ``[R, chunks, cols]`` pool has stride ``chunks · cols``).
      rows_ref: SMEM int32 ``[block_rows]``, row indices into ``src`` (each in ``[0, R)``: nothing is checked).
      dst_ref: SMEM bf16 ``[block_rows, cols]`` tiled ``(8, swizzle / 2)`` and ``swizzle``-byte swizzled.
    """
    from jax._src.lib.mlir.dialects import arith, llvm, nvvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    check_gather_shape(block_rows, cols, swizzle)
    tiled = tile_transforms(plgpu, swizzle)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(tiled)))
    def issue(_, src, rows, dst):
        i32, i64, u8 = _int_types()
        ops = _mlir_ops(arith, i32)
        src_ptr, row_stride = _global_rows(src)
        rows_ptr = mgpu_utils.memref_ptr(rows)
        dst_ptr = mgpu_utils.memref_ptr(dst)
        units = cols // 8
        t = arith.remui(mgpu_utils.thread_idx(), ops.c(WARPGROUP))
        for j in range(block_rows * units // WARPGROUP):
            u = arith.addi(t, ops.c(WARPGROUP * j))
            r, k = arith.divui(u, ops.c(units)), arith.remui(u, ops.c(units))
            row = llvm.load(i32, mgpu_utils.getelementptr(rows_ptr, [r], i32))
            src_elem = arith.addi(arith.muli(arith.extui(i64, row), arith.constant(i64, row_stride)),
                                  arith.extui(i64, arith.muli(k, ops.c(8))))
            src_piece = mgpu_utils.getelementptr(src_ptr, [arith.muli(src_elem, arith.constant(i64, 2))], u8)
            dst_piece = mgpu_utils.getelementptr(
                dst_ptr, [arith.muli(unit_offset(r, k, cols, ops, swizzle=swizzle), ops.c(UNIT_BYTES))], u8)
            nvvm.cp_async_shared_global(dst_piece, src_piece, UNIT_BYTES, nvvm.LoadCacheModifierKind.CG)

    issue(src_ref, rows_ref, dst_ref)


# ---- v41_fp4 rows decoded on the way (V4.1's compressed KV: 256 B of e2m1 pairs + 32 e4m3 scales per 512 values) ----
#
# A 16-byte unit of the tile holds 8 values ``8k … 8k + 7`` of a row: the row's 32-bit data word ``k`` (8 e2m1 codes,
# element 2i in the low nibble of byte i, bit 3 of a nibble the sign) and its scale byte ``k // 2`` (one e4m3 scale per
# 16 values). Decoding is exact: an e2m1 value (≤ 2 significant bits) times an e4m3 scale (≤ 4) has ≤ 6 significant
# bits and lies in [2^-10, 2688], so it is a bf16 number, the one the model's ``kv_formats.decode`` computes in fp32
# and rounds (exactly) to bf16.
#
# Bits: the nibble's 3 magnitude bits ``em`` placed at bits 8..6 of a bf16 half and its sign at bit 15 give the bf16
# pattern of ``e2m1 · 2^-126`` (exponent field = the 2 exponent bits, top mantissa bit = the mantissa bit; e = 0 is the
# subnormal 0.5 · 2^-126 or 0), so two values of a 32-bit word are::
#
#     ((t & 0x7) << 6) | ((t & 0x8) << 12) | ((t & 0x70) << 18) | ((t & 0x80) << 24),   t = word >> 8w
#
# multiplied (bf16x2) by 2^126 to give the e2m1 values exactly. The scale byte ``b`` (positive e4m3: exponent 4 bits
# bias 7, mantissa 3 bits) placed at bits 10..4 is the bf16 pattern of ``e4m3(b) · 2^-120`` (subnormal e4m3 codes
# land on bf16 subnormals the same way), times 2^120 exactly. The two products, then e2m1 · scale, are exact.

FP4_PAIR_SHIFTS = ((0x7, 6), (0x8, 12), (0x70, 18), (0x80, 24))   # (mask of t, left shift) of the formula above
E2M1_UNSCALE = 2.0 ** 126
E4M3_UNSCALE = 2.0 ** 120


def fp4_pair_bits(word, w: int, ops=_IntOps):
    """The bf16x2 bit pattern of ``e2m1 · 2^-126`` for elements ``2w`` (low half) and ``2w + 1`` of a data word."""
    t = ops.shr(word, ops.c(8 * w)) if w else word
    out = None
    for mask, shift in FP4_PAIR_SHIFTS:
        part = ops.shl(ops.band(t, ops.c(mask)), ops.c(shift))
        out = part if out is None else ops.bor(out, part)
    return out


def e4m3_scale_bits(byte, ops=_IntOps):
    """The bf16x2 pattern of ``e4m3(byte) · 2^-120`` in both halves (``byte`` a positive e4m3 code)."""
    half = ops.shl(ops.band(byte, ops.c(0x7F)), ops.c(4))
    return ops.bor(half, ops.shl(half, ops.c(16)))


def host_decode_fp4_unit(word: int, scale_byte: int) -> np.ndarray:
    """The 8 bf16 values (as float32) the kernel makes of one data word and its scale byte, through the same bit
    formulas and bf16 products (computed here with ml_dtypes bf16, whose products of these exact values are exact)."""
    import ml_dtypes

    def halves(bits: int) -> np.ndarray:
        return np.array([bits & 0xFFFF, bits >> 16], np.uint16).view(ml_dtypes.bfloat16)

    bf = ml_dtypes.bfloat16
    scale = halves(e4m3_scale_bits(scale_byte)) * bf(E4M3_UNSCALE)
    vals = [halves(fp4_pair_bits(word, w)) * bf(E2M1_UNSCALE) * scale for w in range(4)]
    return np.concatenate(vals).astype(np.float32)


UNITS_PER_LOAD = 4      # a thread loads 16 bytes of codes (4 units of 8 values) and their 2 scale bytes at once


def issue_fp4_row_decode(plgpu, chunks, rows_ref, *, block_rows: int, cols: int, swizzle: int = 128) -> None:
    """Every thread of the calling warpgroup loads, decodes and stores its share of ``dst[r] = decode(src[rows[r]])``
    for ``r < block_rows`` in each chunk (plain loads from global memory: 16 bytes of codes = 4 units, and their 2
    scale bytes, every chunk's loads issued before any decode so that they are all in flight together;
    ``st.shared`` of 16 bytes per unit at its swizzled place; the caller fences and synchronises before the tiles
    are read by the WGMMA).

    Args:
      chunks: ``[(data_ref, scale_ref, dst_ref), …]``, per column chunk: GMEM uint8 ``[R, cols / 2]``, the packed
        e2m1 bytes of this chunk of each stored row (a column slice of the ``v41_fp4`` pool ``[R, D/2 + D/16]``;
        row stride from the memref type), GMEM uint8 ``[R, cols / 16]``, its e4m3 scale bytes, and SMEM bf16
        ``[block_rows, cols]`` tiled ``(8, swizzle / 2)`` and ``swizzle``-byte swizzled.
      rows_ref: SMEM int32 ``[block_rows]``, row indices into the pool (each in ``[0, R)``).
    """
    _fp4_decode(plgpu, chunks, rows_ref, block_rows=block_rows, cols=cols, swizzle=swizzle)


def decode_staged_fp4_rows(plgpu, chunks, *, block_rows: int, cols: int, swizzle: int = 128) -> None:
    """:func:`issue_fp4_row_decode` from rows already in shared memory (``v41_fp4`` bytes that
    :func:`issue_raw_row_copies` staged): ``dst[r] = decode(staged[r])``, loads from shared memory instead of a
    gather from global memory. ``chunks``: ``[(data_ref, scale_ref, dst_ref), …]`` with ``data_ref`` SMEM uint8
    ``[block_rows, cols / 2]`` and ``scale_ref`` SMEM uint8 ``[block_rows, cols / 16]`` (column slices of the staged
    rows ``[block_rows, D/2 + D/16]``). Every thread must see the staged bytes (the caller waits for the copies and
    synchronises the warpgroup first)."""
    _fp4_decode(plgpu, chunks, None, block_rows=block_rows, cols=cols, swizzle=swizzle)


def _fp4_decode(plgpu, chunks, rows_ref, *, block_rows: int, cols: int, swizzle: int) -> None:
    """Both FP4 decodes: rows gathered from global memory through ``rows_ref``, or (``rows_ref`` None) row ``r`` of
    staged rows in shared memory."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    check_gather_shape(block_rows, cols, swizzle)
    loads_per_row = cols // 8 // UNITS_PER_LOAD
    if (block_rows * loads_per_row) % WARPGROUP:
        raise ValueError(f"[{block_rows}, {cols}]: {block_rows * loads_per_row} 16-byte code loads do not split "
                         f"evenly over a warpgroup")
    tiled = tile_transforms(plgpu, swizzle)
    chunk_types = tuple((plgpu.RefType(), plgpu.RefType(), plgpu.RefType(tiled)) for _ in chunks)
    staged = rows_ref is None

    @plgpu.inline_mgpu(arg_types=(chunk_types, *(() if staged else (plgpu.RefType(),))))
    def decode(_, chunk_refs, *rows):
        i16 = ir.IntegerType.get_signless(16)
        i32, i64, u8 = _int_types()
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        vec4 = ir.VectorType.get((4,), i32)
        ops = _mlir_ops(arith, i32)

        def splat(v):
            value = ir.FloatAttr.get(ir.BF16Type.get(), v)
            return arith.constant(bf16x2, ir.DenseElementsAttr.get_splat(bf16x2, value))

        e2m1_unscale, e4m3_unscale = splat(E2M1_UNSCALE), splat(E4M3_UNSCALE)
        rows_ptr = None if staged else mgpu_utils.memref_ptr(rows[0])
        t = arith.remui(mgpu_utils.thread_idx(), ops.c(WARPGROUP))
        loaded = []
        for data, scales, dst in chunk_refs:      # every load first: they are independent, all in flight at once
            data_ptr, stride = _shared_rows(data) if staged else _global_rows(data)
            scale_ptr, scale_stride = _shared_rows(scales) if staged else _global_rows(scales)
            if scale_stride != stride:
                raise ValueError(f"data and scale slices must be of one pool (row strides {stride}, {scale_stride})")
            dst_ptr = mgpu_utils.memref_ptr(dst)
            for j in range(block_rows * loads_per_row // WARPGROUP):
                g = arith.addi(t, ops.c(WARPGROUP * j))
                r = arith.divui(g, ops.c(loads_per_row))
                k0 = arith.muli(arith.remui(g, ops.c(loads_per_row)), ops.c(UNITS_PER_LOAD))
                row = r if staged else llvm.load(i32, mgpu_utils.getelementptr(rows_ptr, [r], i32))
                base = arith.muli(arith.extui(i64, row), arith.constant(i64, stride))
                words = llvm.load(vec4, mgpu_utils.getelementptr(
                    data_ptr, [arith.addi(base, arith.extui(i64, arith.muli(k0, ops.c(4))))], u8), alignment=16)
                pair = llvm.load(i16, mgpu_utils.getelementptr(
                    scale_ptr, [arith.addi(base, arith.extui(i64, arith.divui(k0, ops.c(2))))], u8), alignment=2)
                loaded.append((dst_ptr, r, k0, words, arith.extui(i32, pair)))
        for dst_ptr, r, k0, words, pair in loaded:
            for i in range(UNITS_PER_LOAD):
                word = llvm.extractelement(words, ops.c(i))
                byte = ops.band(ops.shr(pair, ops.c(8 * (i // 2))), ops.c(0xFF)) if i // 2 else pair
                scale = arith.mulf(mgpu_utils.bitcast(e4m3_scale_bits(byte, ops), bf16x2), e4m3_unscale)
                vec = llvm.mlir_undef(vec4)
                for w in range(4):
                    two = arith.mulf(mgpu_utils.bitcast(fp4_pair_bits(word, w, ops), bf16x2), e2m1_unscale)
                    vec = llvm.insertelement(vec, mgpu_utils.bitcast(arith.mulf(two, scale), i32), ops.c(w))
                k = arith.addi(k0, ops.c(i))
                offset = unit_offset(r, k, cols, ops, swizzle=swizzle)
                place = mgpu_utils.getelementptr(dst_ptr, [arith.muli(offset, ops.c(UNIT_BYTES))], u8)
                llvm.store(vec, place, alignment=UNIT_BYTES)

    decode(tuple(tuple(c) for c in chunks), *(() if staged else (rows_ref,)))


def raw_copy_units(block_rows: int, row_bytes: int) -> tuple[int, int]:
    """``(units, copies per thread)`` of :func:`issue_raw_row_copies`: the 16-byte units of ``block_rows`` stored rows
    of ``row_bytes`` each, and how many a warpgroup thread issues (the last pass clamps its unit to the last one,
    so a few threads copy that unit again: the same bytes to the same place)."""
    if row_bytes % UNIT_BYTES:
        raise ValueError(f"stored rows of {row_bytes} B are not whole 16-byte units")
    units = block_rows * row_bytes // UNIT_BYTES
    return units, -(-units // WARPGROUP)


def issue_raw_row_copies(plgpu, src_ref, rows_ref, dst_ref, *, block_rows: int) -> None:
    """Every thread of the calling warpgroup issues its ``cp.async`` copies of whole stored rows, ``dst[r] =
    src[rows[r]]`` byte for byte (no commit, no wait): the ``v41_fp4`` rows that :func:`decode_staged_fp4_rows` then
    decodes from shared memory, so that one step's rows can be in flight while the previous step is decoded.

    Args:
      src_ref: GMEM uint8 ``[R, row_bytes]`` (``row_bytes`` a multiple of 16; rows 16-byte aligned).
      rows_ref: SMEM int32 ``[block_rows]``, row indices into ``src`` (each in ``[0, R)``).
      dst_ref: SMEM uint8 ``[block_rows, row_bytes]``, plain (no tiling).
    """
    from jax._src.lib.mlir.dialects import arith, llvm, nvvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    row_bytes = src_ref.shape[-1]
    units, passes = raw_copy_units(block_rows, row_bytes)
    per_row = row_bytes // UNIT_BYTES

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def issue(_, src, rows, dst):
        i32, i64, u8 = _int_types()
        ops = _mlir_ops(arith, i32)
        src_ptr, stride = _global_rows(src)
        dst_ptr, dst_stride = _shared_rows(dst)
        rows_ptr = mgpu_utils.memref_ptr(rows)
        t = arith.remui(mgpu_utils.thread_idx(), ops.c(WARPGROUP))
        for j in range(passes):
            u = arith.addi(t, ops.c(WARPGROUP * j))
            if WARPGROUP * (j + 1) > units:
                u = arith.minui(u, ops.c(units - 1))
            r, k = arith.divui(u, ops.c(per_row)), arith.remui(u, ops.c(per_row))
            row = llvm.load(i32, mgpu_utils.getelementptr(rows_ptr, [r], i32))
            src_byte = arith.addi(arith.muli(arith.extui(i64, row), arith.constant(i64, stride)),
                                  arith.extui(i64, arith.muli(k, ops.c(UNIT_BYTES))))
            dst_byte = arith.addi(arith.muli(r, ops.c(dst_stride)), arith.muli(k, ops.c(UNIT_BYTES)))
            nvvm.cp_async_shared_global(mgpu_utils.getelementptr(dst_ptr, [dst_byte], u8),
                                        mgpu_utils.getelementptr(src_ptr, [src_byte], u8), UNIT_BYTES,
                                        nvvm.LoadCacheModifierKind.CG)

    issue(src_ref, rows_ref, dst_ref)


def _shared_rows(ref):
    """``(pointer, row stride in elements)`` of an SMEM ``[rows, cols]`` memref with contiguous rows (a column slice
    of staged rows keeps their row stride)."""
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    (row_stride, col_stride), _ = ir.MemRefType(ref.type).get_strides_and_offset()
    if col_stride != 1:
        raise ValueError(f"staged rows must be contiguous, got column stride {col_stride}")
    return mgpu_utils.memref_ptr(ref), row_stride


def _global_rows(ref):
    """``(global-address-space pointer, row stride in elements)`` of a GMEM ``[R, cols]`` memref whose rows are
    contiguous (a column slice of a wider pool keeps the pool's row stride)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    (row_stride, col_stride), _ = ir.MemRefType(ref.type).get_strides_and_offset()
    if col_stride != 1:
        raise ValueError(f"gathered rows must be contiguous, got column stride {col_stride}")
    return llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref)), row_stride


def _int_types():
    """The MLIR integer types the inline code uses: ``(i32, i64, i8)`` (the last for byte addressing)."""
    from jax._src.lib.mlir import ir

    return tuple(ir.IntegerType.get_signless(bits) for bits in (32, 64, 8))


def _mlir_ops(arith, i32):
    """The integer operations of :func:`unit_offset` / :func:`fp4_pair_bits` on 32-bit MLIR values."""
    class ops:
        c = staticmethod(lambda v: arith.constant(i32, v))
        div = staticmethod(arith.divui)
        rem = staticmethod(arith.remui)
        add = staticmethod(arith.addi)
        mul = staticmethod(arith.muli)
        xor = staticmethod(arith.xori)
        shl = staticmethod(arith.shli)
        shr = staticmethod(arith.shrui)
        band = staticmethod(arith.andi)
        bor = staticmethod(arith.ori)

    return ops


def producer_wait_pending(stages: int) -> int:
    """``cp.async.wait_group`` count of the gathering producer (``decode_sm90._produce_gathered``) before it
    announces step ``s``: its first ``stages`` steps are groups ``0 … stages − 1``; loop iteration ``i`` commits one
    group holding step ``i − 1 + stages`` (or nothing), so step ``s ≥ stages`` is group ``s + 1`` and at iteration
    ``s`` the newest ``stages − 2`` groups are the only ones that may still be in flight. One stage: iteration ``s``
    commits step ``s`` itself before waiting, so everything is waited for."""
    return max(stages - 2, 0)


def commit_group(plgpu) -> None:
    """``cp.async.commit_group``: closes the calling thread's group of copies issued since the last commit."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def commit(_):
        nvvm.cp_async_commit_group()

    commit()


def wait_group(plgpu, pending: int) -> None:
    """``cp.async.wait_group pending``: waits until at most ``pending`` of the calling thread's newest groups are
    still in flight (static count)."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def wait(_):
        nvvm.cp_async_wait_group(pending)

    wait()


__all__ = ["check_gather_shape", "commit_group", "e4m3_scale_bits", "fp4_pair_bits", "host_decode_fp4_unit",
           "decode_staged_fp4_rows", "host_tile_image", "issue_fp4_row_decode", "issue_raw_row_copies",
           "issue_row_copies", "line_units", "producer_wait_pending", "raw_copy_units", "tile_transforms",
           "unit_offset", "wait_group"]
