"""Elementary ops shared by the V4 family: RMSNorm, interleaved tail RoPE with optional YaRN, linear."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.config import YarnConfig
from dinfer_jax.models.invariant import active_tile, invariant_tracing, token_tiled
from dinfer_jax.models.linear_impl import kernel_config, kernel_linear
from dinfer_jax.models.qweights import QuantizedWeight, as_dense

F32 = jnp.float32


def matmul_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """Full fp32 products for fp32 inputs (no TF32 on GPUs); the backend default otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def f32_accumulating(*operands: jax.Array) -> tuple[jax.Array, ...]:
    """Operands for a dot with fp32 accumulation.

    XLA:CPU has no bf16×bf16→f32 dot, so on CPU bf16 operands are widened to fp32 first: the products of bf16
    values are exact in fp32, so this is the same arithmetic as a GPU bf16 dot with fp32 accumulation.
    """
    if jax.default_backend() == "cpu":
        return tuple(o.astype(F32) if o.dtype == jnp.bfloat16 else o for o in operands)
    return operands


def matmul(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(eq, a, b)`` in the operands' dtype with fp32 accumulation and an fp32 result."""
    prec = matmul_precision(a.dtype)
    a, b = f32_accumulating(a, b)
    return jnp.einsum(eq, a, b, preferred_element_type=F32, precision=prec)


def linear(x: jax.Array, w: jax.Array | QuantizedWeight, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``x · wᵀ`` for a weight stored ``[out, in]`` (dense, or quantised and decoded here, inside the computation);
    computed in ``x``'s dtype with fp32 accumulation. Batch-invariantly (:mod:`~dinfer_jax.models.invariant`)
    over fixed tiles of rows."""
    if active_tile() and x.ndim > 1:
        return token_tiled(lambda t: linear(t, w, out_dtype), x, lead=x.ndim - 1)
    config = kernel_config(x, w)   # the FP8 kernel when a step is traced with it (dinfer_jax.models.linear_impl)
    y = kernel_linear(x, w, config) if config is not None else matmul("...i,oi->...o", x, as_dense(w, x.dtype))
    return y.astype(out_dtype or x.dtype)


def linear_fp32_input(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    """``x · wᵀ`` to fp32 accuracy for fp32 ``x [..., in]``: fp32 ``[..., out]``.

    With a bf16 weight on an accelerator, ``x`` is split exactly into three bf16 pieces (``hi = bf16(x)``,
    ``mid = bf16(x − hi)``, ``lo = x − hi − mid``: 8 + 8 + 8 significant bits cover fp32's 24, and bf16 has fp32's
    exponent range) and one bf16 GEMM over the stacked pieces reads the weight once; every product is exact in
    fp32 and accumulates in fp32, so the result is an fp32 GEMM's up to accumulation order. The direct way
    converts the whole weight to fp32 on every call and runs an fp32 GEMM (for V4's 129,280 × 4096 head: 0.76 ms
    of conversion plus a 1.4 ms FFMA GEMM per decode step on the H200, against ~0.3 ms here). On CPU (no bf16
    GEMM; bf16 operands are widened anyway) and for other weights: the direct fp32 product.

    The model's vocabulary head (:mod:`~dinfer_jax.models.backbone`); checked on the H200 by tests/test_head_gpu.py
    (its first version, bf16 round trips instead of ``reduce_precision``, measured 2e-4 relative error there)."""
    if active_tile() and x.ndim > 1:
        return token_tiled(lambda t: linear_fp32_input(t, w), x, lead=x.ndim - 1)
    if isinstance(w, jax.Array) and w.dtype == jnp.bfloat16 and jax.default_backend() != "cpu":
        parts = jnp.einsum("k...i,oi->k...o", split_bf16x3(x), w, preferred_element_type=F32)
        return (parts[0] + parts[1]) + parts[2]
    return linear(x.astype(F32), as_dense(w, F32))


# split-K form of the fp32 projections (linear_f32): used for calls of at most this many rows (decode steps), in
# pieces of this many input channels
SPLIT_K_MAX_ROWS = 256
SPLIT_K_CHUNK = 256


def linear_f32(x: jax.Array, w: jax.Array | QuantizedWeight, split_k: bool | None = None) -> jax.Array:
    """``x · wᵀ`` in full fp32 (fp32 operands, no TF32): ``x [..., K]`` any float dtype, ``w [N, K]`` dense or
    quantised; fp32 ``[..., N]``. For the model's fp32 projections with few outputs (mHC mixes, compressor, index
    head weights, router).

    ``split_k`` (default: on a GPU, for at most :data:`SPLIT_K_MAX_ROWS` rows, outside the batch-invariant mode,
    when :data:`SPLIT_K_CHUNK` divides ``K`` at least twice): the contraction is cut into ``K / SPLIT_K_CHUNK``
    pieces, one batched fp32 GEMM computes every piece's partial product and a sum over the pieces adds them. A
    decode step's ``[64, 16384] × [24, 16384]ᵀ`` otherwise runs as one GEMM with a handful of output tiles walking
    all of K: XLA's autotuner finds a split-K Triton tile for it, but without autotuning (the engine's decode
    programs on a GPU) cuBLAS's fp32 GEMM took ~0.5 ms per call on the H200 instead of ~0.02
    (``docs/perf/serving_h200.md``). Same products, fp32 partial sums added in another order."""
    if active_tile() and x.ndim > 1:
        return token_tiled(lambda t: linear_f32(t, w, split_k), x, lead=x.ndim - 1)
    xf, wf = x.astype(F32), as_dense(w, F32)
    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    if split_k is None:
        split_k = (jax.default_backend() == "gpu" and rows <= SPLIT_K_MAX_ROWS and not invariant_tracing()
                   and k % SPLIT_K_CHUNK == 0 and k >= 2 * SPLIT_K_CHUNK)
    if not split_k:
        return linear(xf, wf)
    pieces = k // SPLIT_K_CHUNK if k % SPLIT_K_CHUNK == 0 else 1
    xs = xf.reshape(rows, pieces, k // pieces)
    ws = wf.reshape(wf.shape[0], pieces, k // pieces)
    partial = jnp.einsum("rpc,npc->prn", xs, ws, precision=jax.lax.Precision.HIGHEST)  # [pieces, rows, N]
    return jnp.sum(partial, axis=0).reshape(*x.shape[:-1], wf.shape[0])


def split_bf16x3(x: jax.Array) -> jax.Array:
    """fp32 ``x [...]`` → bf16 ``[3, ...]`` with ``hi + mid + lo == x`` exactly for ``|x| ≥ 2^-90`` (tested; near
    2^-104 XLA:CPU loses the last piece to denormal flushing). Hidden states after the final RMSNorm are O(1)."""
    # reduce_precision, not a bf16 round trip: XLA's GPU compiler may drop a convert pair f32 → bf16 → f32
    # (xla_allow_excess_precision), which made the residual zero (measured: 2e-4 relative error on the H200)
    xf = x.astype(F32)
    hi = jax.lax.reduce_precision(xf, exponent_bits=8, mantissa_bits=7)
    r = xf - hi
    mid = jax.lax.reduce_precision(r, exponent_bits=8, mantissa_bits=7)
    lo = r - mid
    return jnp.stack([hi, mid, lo]).astype(jnp.bfloat16)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``w ⊙ x / sqrt(mean(x²) + eps)`` over the last axis; reduction and weight multiply in fp32."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(F32)
    return y.astype(out_dtype or x.dtype)


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnConfig | None) -> np.ndarray:
    """Per-pair inverse frequencies ``[r/2]`` (fp32), YaRN-interpolated when ``yarn`` is given (no mscale).

    Follows DeepSeek's ``precompute_freqs_cis`` (equal to transformers' ``_compute_yarn_parameters``):
    low/high correction dims floored/ceiled, linear ramp over pair indices.
    """
    pos_freqs = np.power(np.float32(theta), np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim))
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if yarn is None:
        return inv

    def corr_dim(n_rot: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (n_rot * 2 * math.pi))) / (
            2 * math.log(theta))

    low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
    extrap = (np.float32(1) - ramp).astype(np.float32)
    interp = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    return (interp * (np.float32(1) - extrap) + inv * extrap).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[..., r/2]`` (fp32) of ``positions[..., None] * inv_freq``."""
    ang = positions.astype(F32)[..., None] * jnp.asarray(inv_freq, F32)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope_tail(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotate the last ``r = 2·cos.shape[-1]`` channels of ``x`` in interleaved pairs (2i, 2i+1).

    x: ``[..., S, (heads,) dim]``; cos/sin: ``[..., S, r/2]`` broadcast over any head axis the caller inserted.
    ``inverse`` rotates by −φ. Computed in fp32, returned in ``x``'s dtype.
    """
    half = cos.shape[-1]
    r = 2 * half
    nope, rot = x[..., :-r], x[..., -r:]
    rf = rot.astype(F32).reshape(*rot.shape[:-1], half, 2)
    x0, x1 = rf[..., 0], rf[..., 1]
    if inverse:
        sin = -sin
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    rotated = jnp.stack([y0, y1], axis=-1).reshape(rot.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)
