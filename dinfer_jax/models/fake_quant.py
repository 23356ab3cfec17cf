"""V4.1 fake quantisers (``docs/spec/model-v41.md`` §2): Q8, Q4u and Q4e over contiguous blocks of the last axis.

Each ``*_quantize`` returns ``(q, s)``: ``q [..., D]`` fp32 grid values (the e4m3 / e2m1 value of each code, sign
included) and ``s [..., D // block]`` fp32 block scales, with ``dequant = q · s``. Each ``*_fake`` returns the
dequantised values ``q · s`` cast to the input dtype; the product is exact in fp32 and in bf16 (≤ 4 + 4 significant
bits, fp32 exponent range), so for bf16 / fp32 inputs the result is the exact dequantised value.

All math is fp32 and bit-exact; rounding to the e4m3 / e2m1 grids is done explicitly (round half to even on the
grid spacing of the value's binade) instead of by dtype casts, so it is the same on every backend. Divisions by a
non-power of two are kept as true IEEE divisions (see :func:`_exact_div`). NaN / ±inf inputs are not supported (the
caches never see them). Backends that flush fp32 subnormals (XLA:CPU runs with FTZ/DAZ) only differ on Q4u blocks
whose values are all below ~2^−124 (subnormal inputs or outputs); Q8 and Q4e are unaffected because their minimum
scales send every subnormal input to code 0 and keep every output normal.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.invariant import active_tile, token_tiled

F32 = jnp.float32

E4M3_MAX = 448.0
E2M1_MAX = 6.0
Q8_AMAX_MIN = 1e-4  # as fp32, like the reference's fp32 clamp
Q4U_AMAX_MIN = 6.0 * 2.0**-126
Q4E_AMAX_MIN = 6.0 * 2.0**-9
# (mantissa bits, smallest normal exponent) of the target grids; below that exponent the spacing stays fixed
# (subnormals), which for e2m1 gives the 0.5 steps of {0, 0.5, 1, 1.5}.
_E4M3_GRID = (3, -6)
_E2M1_GRID = (1, 0)


def _exponent(t: jax.Array) -> jax.Array:
    """Unbiased exponent field ``exp_field − 127`` of fp32 ``t`` (int32, same shape); −127 for 0 and subnormals."""
    bits = jax.lax.bitcast_convert_type(t.astype(F32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def _exp2(k: jax.Array) -> jax.Array:
    """``2^k`` as fp32 for int32 ``k`` in [−126, 127], built from the exponent bits (exact)."""
    return jax.lax.bitcast_convert_type((k + 127) << 23, F32)


def pow2ceil_exponent(t: jax.Array) -> jax.Array:
    """``ceil(log2 t)`` of positive fp32 ``t`` from its bits: ``exp_field − 127 + (mantissa ≠ 0)`` (int32).

    This is the UE8M0 exponent of the spec; the stored scale byte is this value + 127.
    """
    bits = jax.lax.bitcast_convert_type(t.astype(F32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def pow2ceil(t: jax.Array) -> jax.Array:
    """``2^ceil(log2 t)`` of positive fp32 ``t`` (fp32, same shape), per :func:`pow2ceil_exponent`."""
    return _exp2(pow2ceil_exponent(t))


def _round_to_grid(y: jax.Array, mant_bits: int, min_exp: int) -> jax.Array:
    """Round fp32 ``y`` to nearest-even on a float grid with ``mant_bits`` mantissa bits and minimum exponent
    ``min_exp``, unbounded above (callers clamp first). ``y / spacing`` is exact because the spacing is a power
    of two, so ``jnp.round`` (half to even) performs the RNE of the narrow format; a value that rounds up to the
    next binade lands on that binade's first grid point, as RNE requires."""
    spacing = _exp2(jnp.maximum(_exponent(y), min_exp) - mant_bits)
    return jnp.round(y / spacing) * spacing


def e4m3_rne(y: jax.Array) -> jax.Array:
    """FP8 e4m3fn round-to-nearest-even of fp32 ``y`` with ``|y| ≤ 448`` (fp32 grid values, same shape)."""
    return _round_to_grid(y, *_E4M3_GRID)


def e2m1_rne(y: jax.Array) -> jax.Array:
    """FP4 e2m1 RNE of fp32 ``y`` clamped to ±6: grid {0, .5, 1, 1.5, 2, 3, 4, 6}; ties 0.25→0, 0.75→1, 1.25→1,
    1.75→2, 2.5→2, 3.5→4, 5→4 (fp32 grid values, same shape)."""
    return _round_to_grid(jnp.clip(y, -E2M1_MAX, E2M1_MAX), *_E2M1_GRID)


def _exact_div(num: jax.Array, den: jax.Array | float) -> jax.Array:
    """IEEE ``num / den`` (fp32, ``num``'s shape). XLA's simplifier turns a division by a constant or by a broadcast
    into a multiplication by the reciprocal, which differs in the last bit; the barrier on the full-shape
    denominator keeps the real division where the spec divides by a non-power of two."""
    den = jnp.broadcast_to(jnp.asarray(den, F32), num.shape)
    return num / jax.lax.optimization_barrier(den)


def _split_blocks(x: jax.Array, block: int) -> jax.Array:
    """``x [..., D]`` → fp32 ``[..., D // block, block]``; ``D`` must be a multiple of ``block``."""
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"last dim {d} is not a multiple of the quantisation block {block}")
    return x.astype(F32).reshape(*x.shape[:-1], d // block, block)


def _block_amax(xb: jax.Array, amax_min: float) -> jax.Array:
    """``max(amax |x_blk|, amax_min)`` of ``xb [..., n, block]`` → ``[..., n, 1]`` fp32."""
    return jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), jnp.asarray(amax_min, F32))


def _pow2_scaled(x: jax.Array, block: int, amax_min: float, qmax: float, grid: tuple[int, int]):
    """Shared body of Q8 / Q4u: UE8M0 scale ``s = pow2ceil(a / qmax)``, ``q = RNE(clamp(x / s, ±qmax))``.

    Division by the power of two ``s`` is exact, so ``x / s`` equals the references' ``x · (1/s)``.
    """
    xb = _split_blocks(x, block)
    s = pow2ceil(_exact_div(_block_amax(xb, amax_min), qmax))
    q = _round_to_grid(jnp.clip(xb / s, -qmax, qmax), *grid)
    return q.reshape(x.shape), s[..., 0]


def q8_quantize(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """Q8: e4m3 codes with a UE8M0 scale per ``block``; ``a = max(amax, 1e−4)``, ``s = pow2ceil(a/448)``.

    ``x [..., D]`` any float dtype → ``(q [..., D] fp32 e4m3 values, s [..., D // block] fp32 powers of two)``.
    """
    return _pow2_scaled(x, block, Q8_AMAX_MIN, E4M3_MAX, _E4M3_GRID)


def q4u_quantize(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """Q4u: e2m1 codes with a UE8M0 scale per ``block``; ``a = max(amax, 6·2^−126)``, ``s = pow2ceil(a/6)``.

    ``x [..., D]`` → ``(q [..., D] fp32 e2m1 values, s [..., D // block] fp32 powers of two)``.
    """
    return _pow2_scaled(x, block, Q4U_AMAX_MIN, E2M1_MAX, _E2M1_GRID)


def q4e_quantize(x: jax.Array, block: int = 16, *, reciprocal: bool = False) -> tuple[jax.Array, jax.Array]:
    """Q4e: e2m1 codes with an e4m3 scale per ``block``; ``a = max(amax, 6·2^−9)``, ``s = e4m3_RNE(min(a/6, 448))``.

    ``reciprocal=False`` (HF and DeepSeek's reference, the spec): ``q = e2m1_RNE(clamp(x / s, ±6))``.
    ``reciprocal=True`` (DeepInfer's kernels and ``ref_cast_from_bf16``): ``s = e4m3_RNE(min(a · fp32(1/6), 448))``
    and ``q = e2m1_RNE(clamp(x · fp32(1/s), ±6))``. ``s`` is not a power of two, so ``x · (1/s)`` can land on the
    other side of an e2m1 tie than ``x / s`` (``docs/spec/model-v41.md`` §6.1 row 9; for bf16 ``x`` a brute force
    over all bf16 values
    and e4m3 scales finds it only at the exact ties ``x = {1.25, 2.5, 5}·s`` with ``s = 1.875·2^k``, where
    ``x · (1/s)`` is one fp32 ulp above the tie and rounds up). ``a · (1/6)`` vs ``a / 6`` never changes
    ``s`` for bf16 inputs (checked exhaustively in the tests) but can for arbitrary fp32 ``a``.

    ``x [..., D]`` → ``(q [..., D] fp32 e2m1 values, s [..., D // block] fp32 e4m3 values)``.
    """
    xb = _split_blocks(x, block)
    a = _block_amax(xb, Q4E_AMAX_MIN)
    a6 = a * jnp.asarray(1.0 / E2M1_MAX, F32) if reciprocal else _exact_div(a, E2M1_MAX)
    s = e4m3_rne(jnp.minimum(a6, E4M3_MAX))
    y = xb * (1.0 / s) if reciprocal else _exact_div(xb, s)
    return e2m1_rne(y).reshape(x.shape), s[..., 0]


def _dequant(q: jax.Array, s: jax.Array, block: int, dtype: jnp.dtype) -> jax.Array:
    """``q [..., D] · s [..., D // block]`` (exact in fp32) cast to ``dtype``."""
    qb = q.reshape(*q.shape[:-1], q.shape[-1] // block, block)
    return (qb * s[..., None]).reshape(q.shape).astype(dtype)


def q8_fake(x: jax.Array, block: int = 32) -> jax.Array:
    """Q8 round trip of ``x [..., D]``: dequantised values in ``x.dtype`` (see :func:`q8_quantize`)."""
    return _dequant(*q8_quantize(x, block), block, x.dtype)


def q4u_fake(x: jax.Array, block: int = 32) -> jax.Array:
    """Q4u round trip of ``x [..., D]``: dequantised values in ``x.dtype`` (see :func:`q4u_quantize`)."""
    return _dequant(*q4u_quantize(x, block), block, x.dtype)


def q4e_fake(x: jax.Array, block: int = 16, *, reciprocal: bool = False) -> jax.Array:
    """Q4e round trip of ``x [..., D]``: dequantised values in ``x.dtype`` (see :func:`q4e_quantize`)."""
    return _dequant(*q4e_quantize(x, block, reciprocal=reciprocal), block, x.dtype)


def hadamard(x: jax.Array) -> jax.Array:
    """Orthonormal Hadamard rotation of the last axis (``x · H_n / √n``, Sylvester order; ``n`` a power of two), in
    fp32 at full precision. V4's reference rotates the indexer's queries and keys with it before their FP4
    fake-quantisation (``docs/spec/model-v4.md`` §3.7); without quantisation it would leave every score unchanged."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if active_tile() and x.ndim > 1:
        return token_tiled(hadamard, x, lead=x.ndim - 1)
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), jnp.asarray(h / np.sqrt(n), jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def maybe_fake_quant(enabled: bool, fn: Any, x: jax.Array, block: int) -> jax.Array:
    """``fn(x, block)`` when ``enabled``; like the reference, a vector whose width is not a multiple of ``block`` is
    left unquantised."""
    if not enabled or x.shape[-1] % block:
        return x
    return fn(x, block)
