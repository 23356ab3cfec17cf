"""Exact dequantisation (and the matching quantisers) of DeepSeek's released weight formats.

* FP8: ``W[i,j] = e4m3(code[i,j]) · scale[i // bo, j // bi]``; the scale is an E8M0 byte (``2^(S−127)``) or fp32.
* MXFP4 experts: stored int8 ``[out, in/2]`` (two e2m1 codes per byte, low nibble = even column, bit 3 = sign)
  with an E8M0 scale per 32 input columns: ``W[i,j] = e2m1(nibble) · 2^(S[i, j//32] − 127)``.

Both products are exact in fp32 (and in bf16), so dequantise-at-load loses nothing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     dtype=np.float32)
FP4_BLOCK = 32
E4M3_MAX = 448.0


def _expand_blocks(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    s = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)
    return s[: shape[0], : shape[1]]


def scale_to_f32(scale: np.ndarray) -> np.ndarray:
    """E8M0 / fp32 / bf16 scale tensor → fp32 values (E8M0 byte S means 2^(S−127))."""
    return np.asarray(scale).astype(np.float32)


def dequant_fp8(code: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 e4m3 ``[out, in]`` with block scales ``[⌈out/bo⌉, ⌈in/bi⌉]`` → fp32 ``[out, in]``."""
    if code.ndim != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {code.shape}")
    want = (-(-code.shape[0] // block[0]), -(-code.shape[1] // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not match weight {code.shape} with block {block} "
                         f"(expected {want})")
    return code.astype(np.float32) * _expand_blocks(scale_to_f32(scale), code.shape, block)


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 ``[out, in/2]`` int8/uint8 with E8M0 scales ``[out, in/32]`` → fp32 ``[out, in]``."""
    b = np.asarray(packed).view(np.uint8)
    out, half = b.shape
    if tuple(scale.shape) != (out, 2 * half // FP4_BLOCK):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match packed weight {b.shape} "
                         f"(expected {(out, 2 * half // FP4_BLOCK)})")
    vals = np.empty((out, 2 * half), np.float32)
    vals[:, 0::2] = E2M1_GRID[b & 0x0F]
    vals[:, 1::2] = E2M1_GRID[b >> 4]
    return vals * np.repeat(scale_to_f32(scale), FP4_BLOCK, axis=1)


def _ue8m0_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest power of two ``s`` with ``amax / s <= qmax`` (UE8M0 rounding up), as fp32."""
    ratio = np.maximum(amax, np.float32(1e-30)) / np.float32(qmax)
    return np.exp2(np.ceil(np.log2(ratio))).astype(np.float32)


def quantize_fp8(w: np.ndarray, block: tuple[int, int], ue8m0: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise ``[out, in]`` to e4m3 codes and ``[⌈out/bo⌉, ⌈in/bi⌉]`` scales (E8M0 bytes or fp32)."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    bo, bi = block
    po, pi = -(-o // bo) * bo, -(-i // bi) * bi
    padded = np.zeros((po, pi), np.float32)
    padded[:o, :i] = w
    amax = np.abs(padded.reshape(po // bo, bo, pi // bi, bi)).max(axis=(1, 3))
    scale = _ue8m0_scale(amax, E4M3_MAX) if ue8m0 else np.maximum(amax, 1e-30) / np.float32(E4M3_MAX)
    code = (w / _expand_blocks(scale, (o, i), block)).astype(ml_dtypes.float8_e4m3fn)
    return code, scale.astype(ml_dtypes.float8_e8m0fnu) if ue8m0 else scale


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``[out, in]`` to packed e2m1 (int8 ``[out, in/2]``) with E8M0 scales per 32 columns.

    Nearest grid value (ties to the even code) after dividing by the block's power-of-two scale.
    """
    w = np.asarray(w, np.float32)
    o, i = w.shape
    if i % FP4_BLOCK:
        raise ValueError(f"FP4 needs in_features divisible by {FP4_BLOCK}, got {i}")
    blocks = w.reshape(o, i // FP4_BLOCK, FP4_BLOCK)
    scale = _ue8m0_scale(np.abs(blocks).max(axis=2), 6.0)
    x = (blocks / scale[..., None]).reshape(o, i)
    mag = np.abs(x)
    grid = E2M1_GRID[:8]
    nearest = np.argmin(np.abs(mag[..., None] - grid), axis=-1).astype(np.uint8)
    codes = nearest | np.where(np.signbit(x) & (nearest > 0), 8, 0).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, scale.astype(ml_dtypes.float8_e8m0fnu)
