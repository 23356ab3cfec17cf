"""Quantised weights kept in DeepSeek's released storage formats on the device (see ``docs/quantized_weights.md``).

A :class:`QuantizedWeight` is a pytree of two arrays (codes and block scales) plus static format metadata. The
model never builds a full-precision copy ahead of time: consumers call :func:`as_dense` inside the jitted
computation, right before the matmul that uses the weight, so XLA (or a kernel) can fuse the decode.

Formats (logical dense weight ``W [..., out, in]``; leading axes stack experts and/or layers):

* ``fmt="fp8"``: ``data`` float8_e4m3fn ``[..., out, in]``; ``scale`` ``[..., ⌈out/bo⌉, ⌈in/bi⌉]`` (float8_e8m0fnu
  UE8M0 as released, or float32 for ``weight_scale_inv`` checkpoints); ``W[i, j] = e4m3(data[i, j]) ·
  scale[i // bo, j // bi]``.
* ``fmt="fp4"`` (MXFP4): ``data`` uint8 ``[..., out, in/2]``, two e2m1 codes per byte, low nibble = even column;
  ``scale`` float8_e8m0fnu ``[..., out/bo, in/bi]`` with ``block=(1, 32)``; ``W[i, j] = e2m1(nibble) · scale[i // bo,
  j // bi]``.
* ``fmt="fp4_mma"``: the same MXFP4 bits rearranged for the Hopper expert kernel's registers
  (:mod:`pallas_kernels.moe.fp4_mma`): ``data`` int32 ``[..., out/64, in/16, 128]``, ``scale`` int32
  ``[..., out/64, in/64, 32]`` (four UE8M0 bytes per word), ``block=(1, 32)``. Same bytes as ``"fp4"``; a
  permutation made once at load (:func:`to_kernel_layout`) for routed experts that the GPU kernel reads.

Exactness of :func:`dequantize`: each code is a short binary significand (e4m3: 4 bits, e2m1: 2 bits) times a power
of two, and a UE8M0 scale is a power of two, so the product is the same significand with a shifted exponent. It is
therefore exactly representable in any float format with at least that many significand bits (bf16: 8, fp32: 24)
whose exponent range contains it; released scales keep weights far inside bf16's range (2^-133 … 2^127). The decode
multiplies in fp32 (code and scale convert exactly) and rounds once to the target dtype, which for power-of-two
scales is a no-op; with fp32 scales (not powers of two) it is the single fp32 rounding a host-side dequantiser
makes, so both load modes give bit-identical weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("fp8", "fp4", "fp4_mma")
FP4_BLOCK = (1, 32)

# e2m1 value of each 4-bit code (bit 3 = sign, bits 2-1 = exponent with bias 1, bit 0 = mantissa).
_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)
_DATA_DTYPE = {"fp8": jnp.dtype(jnp.float8_e4m3fn), "fp4": jnp.dtype(jnp.uint8), "fp4_mma": jnp.dtype(jnp.int32)}
_SCALE_DTYPES = (jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """Codes plus block scales of one weight (or a stack of weights along leading axes).

    ``data`` and ``scale`` are pytree children (arrays, tracers or ``ShapeDtypeStruct``); ``fmt`` and ``block`` are
    static. Shapes and dtypes are validated whenever both children carry them (placeholders such as shardings
    pass through, as pytree utilities need).
    """

    data: Any
    scale: Any
    fmt: str = dataclasses.field(metadata={"static": True})
    block: tuple[int, int] = dataclasses.field(metadata={"static": True})

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantised format {self.fmt!r}; expected one of {FORMATS}")
        if len(self.block) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block):
            raise ValueError(f"block must be two positive integers, got {self.block!r}")
        object.__setattr__(self, "block", tuple(self.block))
        if _has_array_shape(self.data) and _has_array_shape(self.scale):
            _validate(self)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical dense shape ``[..., out, in]``."""
        s = tuple(self.data.shape)
        if self.fmt == "fp4_mma":
            return s[:-3] + (64 * s[-3], 16 * s[-2])
        return s[:-1] + (2 * s[-1],) if self.fmt == "fp4" else s

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def nbytes(self) -> int:
        """Device bytes of codes plus scales."""
        return _nbytes(self.data) + _nbytes(self.scale)

    def __getitem__(self, index: int | slice) -> QuantizedWeight:
        """Index the leading (stacking) axis, e.g. one expert or one layer; the format is unchanged."""
        if self.ndim < (4 if self.fmt == "fp4_mma" else 3):
            raise IndexError("only stacked quantised weights ([..., out, in] with leading axes) can be indexed")
        return QuantizedWeight(self.data[index], self.scale[index], self.fmt, self.block)


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["data", "scale"], meta_fields=["fmt", "block"])


def _has_array_shape(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _nbytes(x: Any) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def expected_scale_shape(fmt: str, data_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale shape ``[..., ⌈out/bo⌉, ⌈in/bi⌉]`` for codes of ``data_shape`` (logical ``in`` = 2 × bytes for fp4)."""
    *lead, out, inn = data_shape
    if fmt == "fp4":
        inn *= 2
    return (*lead, _cdiv(out, block[0]), _cdiv(inn, block[1]))


def _validate(w: QuantizedWeight) -> None:
    dshape, sshape = tuple(w.data.shape), tuple(w.scale.shape)
    if w.fmt == "fp4_mma":
        ok = (len(dshape) >= 3 and dshape[-1] == 128 and dshape[-2] % 4 == 0 and w.block == FP4_BLOCK
              and jnp.dtype(w.data.dtype) == jnp.int32 and jnp.dtype(w.scale.dtype) == jnp.int32
              and sshape == dshape[:-2] + (dshape[-2] // 4, 32))
        if not ok:
            raise ValueError(f"fp4_mma weight must be int32 data [..., out/64, in/16, 128] and int32 scale "
                             f"[..., out/64, in/64, 32] with block {FP4_BLOCK}; got data {dshape} "
                             f"{jnp.dtype(w.data.dtype)}, scale {sshape} {jnp.dtype(w.scale.dtype)}, block {w.block}")
        return
    if len(dshape) < 2:
        raise ValueError(f"quantised {w.fmt} data must be at least 2-D [..., out, in], got shape {dshape}")
    want = _DATA_DTYPE[w.fmt]
    if jnp.dtype(w.data.dtype) != want:
        raise ValueError(f"quantised {w.fmt} data must be {want}, got {jnp.dtype(w.data.dtype)}")
    if jnp.dtype(w.scale.dtype) not in _SCALE_DTYPES:
        raise ValueError(f"quantised {w.fmt} scale must be one of {[str(d) for d in _SCALE_DTYPES]}, "
                         f"got {jnp.dtype(w.scale.dtype)}")
    if w.fmt == "fp4" and jnp.dtype(w.scale.dtype) != jnp.dtype(jnp.float8_e8m0fnu):
        raise ValueError(f"fp4 scales must be float8_e8m0fnu, got {jnp.dtype(w.scale.dtype)}")
    expect = expected_scale_shape(w.fmt, dshape, w.block)
    if sshape != expect:
        raise ValueError(f"{w.fmt} scale shape {sshape} does not match data shape {dshape} with block {w.block} "
                         f"(expected {expect})")


def decode_codes(w: QuantizedWeight) -> jax.Array:
    """Unscaled code values as fp32 ``[..., out, in]`` (exact: every e4m3/e2m1 value is an fp32 value)."""
    if w.fmt == "fp8":
        return w.data.astype(jnp.float32)
    table = jnp.asarray(_E2M1_VALUES)
    lo = table[(w.data & 0x0F).astype(jnp.int32)]
    hi = table[(w.data >> 4).astype(jnp.int32)]
    return jnp.stack([lo, hi], axis=-1).reshape(w.shape)  # low nibble is the even column


def expand_scale(w: QuantizedWeight) -> jax.Array:
    """Per-element fp32 scale ``[..., out, in]`` (each scale repeated over its block, edge blocks cropped)."""
    *_, out, inn = w.shape
    s = w.scale.astype(jnp.float32)
    s = jnp.repeat(s, w.block[0], axis=-2, total_repeat_length=s.shape[-2] * w.block[0])[..., :out, :]
    s = jnp.repeat(s, w.block[1], axis=-1, total_repeat_length=s.shape[-1] * w.block[1])[..., :inn]
    return s


def dequantize(w: QuantizedWeight, dtype: Any = jnp.float32) -> jax.Array:
    """Dense ``[..., out, in]`` weight in ``dtype``: ``code × scale``, exact (see the module docstring).

    Vectorised over any leading (expert / layer) axes; jit-friendly (static shapes only).
    """
    if w.fmt == "fp4_mma":
        w = released_layout(w)
    return (decode_codes(w) * expand_scale(w)).astype(dtype)


def as_dense(w: jax.Array | QuantizedWeight, dtype: Any) -> jax.Array:
    """The one call site helper: a weight as a dense array of ``dtype`` (dequantised if quantised)."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w, dtype)
    return w.astype(dtype)


def take_rows(w: jax.Array | QuantizedWeight, rows: jax.Array, dtype: Any) -> jax.Array:
    """``w[rows]`` for a 2-D ``[out, in]`` weight as ``dtype`` (an embedding lookup); a quantised table is decoded
    only at the gathered rows."""
    if not isinstance(w, QuantizedWeight):
        return w[rows].astype(dtype)
    if w.ndim != 2:
        raise ValueError(f"take_rows needs a 2-D weight, got logical shape {w.shape}")
    sub = QuantizedWeight(w.data[rows.reshape(-1)], w.scale[rows.reshape(-1) // w.block[0]], w.fmt, (1, w.block[1]))
    return dequantize(sub, dtype).reshape(*rows.shape, w.shape[-1])


def kernel_layout(w: QuantizedWeight) -> QuantizedWeight:
    """MXFP4 ``"fp4"`` → ``"fp4_mma"`` (the same bits in the expert kernel's register order; widths multiples of
    64)."""
    from pallas_kernels.moe.fp4_mma import pack

    if w.fmt != "fp4" or w.block != FP4_BLOCK:
        raise ValueError(f"only MXFP4 weights (fp4, block {FP4_BLOCK}) have a kernel layout, got {w.fmt} {w.block}")
    data, scale = pack(w.data, jax.lax.bitcast_convert_type(w.scale, jnp.uint8))
    return QuantizedWeight(data, scale, "fp4_mma", FP4_BLOCK)


def released_layout(w: Any) -> Any:
    """Inverse of :func:`kernel_layout` (identity for the released formats and for dense arrays)."""
    if not is_quantized(w) or w.fmt != "fp4_mma":
        return w
    from pallas_kernels.moe.fp4_mma import unpack

    data, sbits = unpack(w.data, w.scale)
    return QuantizedWeight(data, jax.lax.bitcast_convert_type(sbits, jnp.float8_e8m0fnu), "fp4", FP4_BLOCK)


def kernel_layout_fits(w: Any) -> bool:
    """Whether ``w`` is an MXFP4 weight whose widths the kernel layout and the kernel's tiles take."""
    return (is_quantized(w) and w.fmt == "fp4" and w.block == FP4_BLOCK and w.shape[-2] % 128 == 0
            and w.shape[-1] % 256 == 0)


def to_kernel_layout(params: Any, *, release: bool = False) -> Any:
    """``params`` with every routed-expert MXFP4 weight (a leaf under an ``"experts"`` key that
    :func:`kernel_layout_fits`) in the ``"fp4_mma"`` layout; other leaves unchanged. Each weight is rearranged on
    its device by one jitted call. ``release=True`` frees each released-layout weight once converted (the caller
    must own ``params``), so peak memory grows by one weight, not by the experts of the whole model."""
    convert = jax.jit(kernel_layout)

    def one(path: Any, leaf: Any) -> Any:
        under_experts = any(getattr(k, "key", None) == "experts" for k in path)
        if not (under_experts and kernel_layout_fits(leaf)):
            return leaf
        out = jax.block_until_ready(convert(leaf))
        if release:
            for a in (leaf.data, leaf.scale):
                a.delete()
        return out

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def tree_nbytes(tree: Any) -> int:
    """Device bytes of every array leaf of ``tree`` (codes and scales of quantised weights included)."""
    return sum(_nbytes(x) for x in jax.tree_util.tree_leaves(tree))


def logical_size(tree: Any) -> int:
    """Number of logical (dense) scalars in ``tree``; a quantised weight counts its dense shape."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_quantized)
    return sum(math.prod(x.shape) for x in leaves)


def abstract_quantized(shape: tuple[int, ...], fmt: str, block: tuple[int, int],
                       scale_dtype: Any = jnp.float8_e8m0fnu) -> QuantizedWeight:
    """A :class:`QuantizedWeight` of ``jax.ShapeDtypeStruct`` for a dense ``[..., out, in]`` weight."""
    *lead, out, inn = shape
    if fmt == "fp4_mma":
        if out % 64 or inn % 64:
            raise ValueError(f"fp4_mma needs widths that are multiples of 64, got shape {tuple(shape)}")
        return QuantizedWeight(jax.ShapeDtypeStruct((*lead, out // 64, inn // 16, 128), jnp.int32),
                               jax.ShapeDtypeStruct((*lead, out // 64, inn // 64, 32), jnp.int32), fmt, FP4_BLOCK)
    if fmt == "fp4" and inn % 2:
        raise ValueError(f"fp4 needs an even input dimension, got shape {tuple(shape)}")
    dshape = (*lead, out, inn // 2) if fmt == "fp4" else tuple(shape)
    data = jax.ShapeDtypeStruct(dshape, _DATA_DTYPE[fmt])
    scale = jax.ShapeDtypeStruct(expected_scale_shape(fmt, dshape, block), jnp.dtype(scale_dtype))
    return QuantizedWeight(data, scale, fmt, tuple(block))
