"""MXFP4 expert weights rearranged for the Hopper kernel's registers ("fp4_mma" layout).

The released layout (``uint8 [G, N, K/2]``, two e2m1 codes per byte, UE8M0 scales ``[G, N, K/32]``) makes the
kernel read one byte per register and spend ~10 integer operations per pair of codes (measured: the FP4 decode cost
more than everything else in the decode-shape kernel, docs/perf/moe_kernel_h200.md). This layout holds the same bits
— same byte count, a permutation — arranged so that a consumer thread reads its codes with one 16-byte
shared-memory load per 64×64 block and turns each 32-bit word into four bf16 pairs with one to five operations.

**Blocks.** Each expert matrix is cut into 64-row × 64-column blocks. Inside a block, thread ``t = 32w + 4g + c`` of
a warpgroup (warp ``w``, lane ``4g + c``) holds, in the WGMMA register layout, rows ``16w + g + 8·q0`` and columns
``16·kc + 2c + 8·q1 + h`` for ``q0, q1, h ∈ {0, 1}`` and 16-column chunks ``kc ∈ 0..3``: 32 codes. They are stored
as four 32-bit words (one per ``kc``) at words ``4t .. 4t + 3`` of the block's 512 — so the 128 threads read the
block's 2048 bytes as consecutive 16-byte pieces (no bank conflicts).

``data``: ``int32 [G, N/64, K/16, 128]`` — block ``(rb, kb)`` is rows ``4kb .. 4kb + 3`` of ``data[g, rb]``.
``scale``: ``int32 [G, N/64, K/64, 32]`` — word ``8w + g`` of block ``(rb, kb)`` holds the four UE8M0 bytes that
thread row-pair needs: byte ``q0 + 2·grp`` = scale of row ``16w + g + 8·q0``, 32-column group ``grp`` of the block.

**Bits of a word.** Register ``r = q0 + 2·q1`` of chunk ``kc`` is the pair (even column ``h = 0`` in the low
half, odd column in the high half). The kernel forms the bf16 bit pattern ``e2m1(code) · 2^-126`` of both codes
(sign at bit 15, exponent bits at 8–7, mantissa bit at 6 of each half; :mod:`pallas_kernels.moe.fp4`), then
multiplies by ``2^(S−1)``. The word stores each code's four bits where one shift and one mask put them:

* registers 0, 1, 2: ``(word << 3r) & 0x81C081C0`` (their bits sit 3r below their destination);
* register 3: ``((word >> 6) & 0x01800180) | ((word >> 4) & 0x00400040) | ((word << 4) & 0x80008000)``.

Range: as for the released layout's bit-placement decode (:mod:`pallas_kernels.moe.fp4`), ``2^(S−1)`` must be a
normal bf16 number, so scales ``S ≤ 128`` (block maxima ≤ 12); trained expert weights sit far below that.

:func:`decode_word` is that arithmetic on the host (what the CPU tests check); the kernel issues the same
operations on registers (:mod:`pallas_kernels.moe.kernel_sm90_ws`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe.reference import ExpertWeight

BLOCK = 64                      # rows and columns of a block
MASK = 0x81C081C0               # sign, two exponent bits and the mantissa bit of both bf16 halves
# Destination of a code's bits (mantissa, exponent low, exponent high, sign) inside its bf16 half.
_DEST = (6, 7, 8, 15)
# Where register r keeps those bits in the word (low half; the high half is the same + 16).
_SRC = tuple(tuple(d - 3 * r for d in _DEST) for r in range(3)) + ((10, 13, 14, 11),)


def _bit_tables() -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` int arrays ``[4 registers, 2 halves, 4 bits]``: a code's bit ``b`` of register ``r``, half
    ``h`` lives at word bit ``src[r, h, b]`` and is decoded to bit ``dst[r, h, b]`` of the register."""
    src = np.array([[[s + 16 * h for s in _SRC[r]] for h in range(2)] for r in range(4)])
    dst = np.array([[[d + 16 * h for d in _DEST] for h in range(2)] for _ in range(4)])
    assert sorted(src.reshape(-1).tolist()) == list(range(32)), "the four registers must tile the word"
    return src, dst


SRC_BITS, DST_BITS = _bit_tables()


def _codes(packed: jax.Array) -> jax.Array:
    """``uint8 [..., K/2]`` → 4-bit codes ``uint32 [..., K]`` (even column = low nibble)."""
    p = packed.astype(jnp.uint32)
    return jnp.stack([p & 15, p >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def check_fits(n: int, k: int) -> None:
    """Raise unless an ``[n, k]`` matrix can take the layout (both widths multiples of 64)."""
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"the fp4_mma layout needs both widths to be multiples of {BLOCK}, got [{n}, {k}]")


def pack(data: jax.Array, scale_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Released MXFP4 arrays → the ``fp4_mma`` arrays (a permutation of the same bits).

    Args:
      data: ``uint8 [..., N, K/2]`` (two e2m1 codes per byte, low nibble = even column).
      scale_bits: ``uint8 [..., N, K/32]`` (UE8M0 exponent bytes).
    Returns:
      ``(int32 [..., N/64, K/16, 128], int32 [..., N/64, K/64, 32])``.
    """
    *lead, n, kh = data.shape
    k = 2 * kh
    check_fits(n, k)
    L = len(lead)
    # codes [..., rb, w, q0, g8, kb, kc, q1, c, h]: row = 64rb + 16w + 8q0 + g8, col = 64kb + 16kc + 8q1 + 2c + h
    c = _codes(data).reshape(*lead, n // 64, 4, 2, 8, k // 64, 4, 2, 4, 2)
    c = c.transpose(*range(L), *(L + i for i in (0, 4, 1, 3, 7, 5, 2, 6, 8)))   # [..., rb, kb, w, g8, c, kc, q0, q1, h]
    words = jnp.zeros(c.shape[:-3], jnp.uint32)
    for q0 in range(2):
        for q1 in range(2):
            r = q0 + 2 * q1
            for h in range(2):
                code = c[..., q0, q1, h]
                for b in range(4):
                    words = words | (((code >> b) & 1) << int(SRC_BITS[r, h, b]))
    # words [..., rb, kb, w, g8, c, kc]: thread t = 32w + 4g8 + c holds words 4t .. 4t + 3 of the block
    out_data = jax.lax.bitcast_convert_type(words, jnp.int32).reshape(*lead, n // 64, k // 16, 128)

    s = scale_bits.astype(jnp.uint32).reshape(*lead, n // 64, 4, 2, 8, k // 64, 2)     # [..., rb, w, q0, g8, kb, grp]
    s = s.transpose(*range(L), *(L + i for i in (0, 4, 1, 3, 5, 2)))                 # [..., rb, kb, w, g8, grp, q0]
    s = s.reshape(*s.shape[:-2], 4)                                                  # byte q0 + 2 grp
    sw = s[..., 0] | (s[..., 1] << 8) | (s[..., 2] << 16) | (s[..., 3] << 24)
    out_scale = jax.lax.bitcast_convert_type(sw, jnp.int32).reshape(*lead, n // 64, k // 64, 32)
    return out_data, out_scale


def unpack(data: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack`: ``fp4_mma`` arrays → released ``(uint8 [..., N, K/2], uint8 UE8M0 [..., N, K/32])``."""
    *lead, nb, k16, _ = data.shape
    n, k = nb * 64, k16 * 16
    L = len(lead)
    words = jax.lax.bitcast_convert_type(data, jnp.uint32).reshape(*lead, nb, k // 64, 4, 8, 4, 4)
    codes = []
    for q0 in range(2):
        for q1 in range(2):
            r = q0 + 2 * q1
            for h in range(2):
                code = jnp.zeros(words.shape, jnp.uint32)
                for b in range(4):
                    code = code | (((words >> int(SRC_BITS[r, h, b])) & 1) << b)
                codes.append(code)
    # [..., rb, kb, w, g8, c, kc, q0, q1, h] -> [..., rb, w, q0, g8, kb, kc, q1, c, h]
    c = jnp.stack(codes, axis=-1).reshape(*words.shape, 2, 2, 2)
    c = c.transpose(*range(L), *(L + i for i in (0, 2, 6, 3, 1, 5, 7, 4, 8))).reshape(*lead, n, k // 2, 2)
    packed = (c[..., 0] | (c[..., 1] << 4)).astype(jnp.uint8)

    sw = jax.lax.bitcast_convert_type(scale, jnp.uint32).reshape(*lead, nb, k // 64, 4, 8)
    s = jnp.stack([(sw >> (8 * i)) & 255 for i in range(4)], axis=-1).reshape(*sw.shape, 2, 2)  # [..., grp, q0]
    # [..., rb, kb, w, g8, grp, q0] -> [..., rb, w, q0, g8, kb, grp]
    s = s.transpose(*range(L), *(L + i for i in (0, 2, 5, 3, 1, 4))).reshape(*lead, n, k // 32).astype(jnp.uint8)
    return packed, s


def to_mma_layout(w: ExpertWeight) -> ExpertWeight:
    """Released MXFP4 ``ExpertWeight`` ``[G, N, K]`` → the same bits in the ``"fp4_mma"`` layout."""
    from pallas_kernels.moe.fp4 import scale_bits

    if w.fmt != "fp4":
        raise ValueError(f"expected released-layout fp4 weights, got fmt={w.fmt!r}")
    return ExpertWeight(*pack(w.data, scale_bits(w.scale)), "fp4_mma")


def from_mma_layout(w: ExpertWeight) -> ExpertWeight:
    """Inverse of :func:`to_mma_layout`: ``"fp4_mma"`` → released-layout ``"fp4"`` (uint8 codes, uint8 UE8M0)."""
    if w.fmt != "fp4_mma":
        raise ValueError(f"expected fp4_mma weights, got fmt={w.fmt!r}")
    return ExpertWeight(*unpack(w.data, w.scale), "fp4")


def decode_word(word: int) -> tuple[int, int, int, int]:
    """Host model of the kernel's decode of one 32-bit word: the four uint32 registers, each two bf16 bit patterns
    ``e2m1(code) · 2^-126`` (even column low). Same shifts and masks as the kernel."""
    q = word & 0xFFFFFFFF
    r0 = q & MASK
    r1 = (q << 3) & MASK
    r2 = (q << 6) & MASK
    r3 = ((q >> 6) & 0x01800180) | ((q >> 4) & 0x00400040) | ((q << 4) & 0x80008000)
    return r0, r1, r2, r3


def scale_multiplier(scale_word: int, byte: int) -> int:
    """Host model of the kernel's scale step: the uint32 holding two bf16 ``2^(S−1)`` for UE8M0 byte ``byte`` of
    the word (``(S · 0x10001 + 126 · 0x10001) << 7``)."""
    s = (scale_word >> (8 * byte)) & 0xFF
    return ((s * 0x10001 + 126 * 0x10001) << 7) & 0xFFFFFFFF
