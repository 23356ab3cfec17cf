"""Manifold-constrained hyper-connections (mHC): the n residual streams of V4 (spec ``docs/spec/model-v4.md`` §3.3)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dinfer_jax.models.invariant import active_tile, ordered_sum, token_tiled
from dinfer_jax.models.ops import F32, linear_f32
from pallas_kernels.lowering_reuse import kernel_call
from pallas_kernels.mhc.reference import sinkhorn_ref
from pallas_kernels.mhc.sinkhorn_sm90 import sinkhorn_projection


def _normed_mix(streams: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """``(x̄ · fnᵀ) · rsqrt(mean(x̄²) + eps)`` with x̄ the flattened streams ``[B,S,n·D]`` in fp32 (batch-invariantly
    over fixed tiles of tokens)."""
    if active_tile():
        return token_tiled(lambda t: _normed_mix(t, fn, norm_eps), streams, lead=streams.ndim - 2)
    flat = streams.reshape(*streams.shape[:-2], -1).astype(F32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    return linear_f32(flat, fn)


MHC_IMPLS = ("auto", "jnp", "pallas")


def resolve_mhc_impl(impl: str) -> str:
    """``"jnp"`` or ``"pallas"`` for an ``impl`` of :data:`MHC_IMPLS`: ``"auto"`` is the Mosaic GPU kernel when jax's
    default backend is a GPU (5× less step compile time on the H200, ``docs/perf/compile_time_gpu.md``), else XLA.
    ValueError for a name not in :data:`MHC_IMPLS`."""
    if impl not in MHC_IMPLS:
        raise ValueError(f"mhc_impl must be one of {MHC_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "jnp"
    return impl


def sinkhorn(comb_logits: jax.Array, iters: int, eps: float, impl: str = "auto") -> jax.Array:
    """Doubly-stochastic projection of ``[..., n(j), n(k)]`` logits: softmax over k, then alternate normalisation.

    First a column normalisation (sum over j), then ``iters − 1`` rounds of row (sum over k) + column.
    ``impl``: ``"jnp"`` (XLA: :func:`pallas_kernels.mhc.reference.sinkhorn_ref`), ``"pallas"`` (the Mosaic GPU
    kernel :mod:`pallas_kernels.mhc.sinkhorn_sm90`, GPU only: keeps the rounds out of XLA's fusion pass,
    ``docs/perf/compile_time_gpu.md``) or ``"auto"`` (:func:`resolve_mhc_impl`).
    """
    impl = resolve_mhc_impl(impl)
    if impl == "jnp":
        # looped on CPU, where XLA's fusion of the unrolled rounds costs quadratic work (sinkhorn_ref's docstring)
        return sinkhorn_ref(comb_logits, iters, eps, unroll=jax.default_backend() != "cpu")
    if jax.default_backend() != "gpu":
        raise ValueError(f"mhc_impl='pallas' needs a GPU (backend is {jax.default_backend()!r})")
    return kernel_call(sinkhorn_projection, comb_logits.astype(F32), iters=iters, eps=eps)


def hc_mixes(streams: jax.Array, site: Mapping[str, jax.Array], *, hc_mult: int, sinkhorn_iters: int,
             hc_eps: float, norm_eps: float, impl: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mixing weights of one mHC site from streams ``[B,S,n,D]``: ``(pre [B,S,n], post [B,S,n], comb [B,S,n,n])``,
    all fp32; comb is doubly stochastic and indexed ``[j (input stream), k (output stream)]``. ``impl``: the
    Sinkhorn's implementation (:func:`sinkhorn`)."""
    n = hc_mult
    mix = _normed_mix(streams, site["fn"], norm_eps)  # [B,S,(2+n)n]
    base, scale = site["base"].astype(F32), site["scale"].astype(F32)
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = mix[..., 2 * n:] * scale[2] + base[2 * n:]
    comb = sinkhorn(comb_logits.reshape(*comb_logits.shape[:-1], n, n), sinkhorn_iters, hc_eps, impl)
    return pre, post, comb


# The stream mixes (hc_collapse, hc_post, hc_head) contract over the n = 4 streams as elementwise products and a
# fixed chain of adds rather than as dots: XLA makes a dot with a contraction of 4 a GEMM call, and without GEMM
# autotuning (the engine's decode programs on a GPU) laid its output out transposed, so the RMS norm after it became
# a column reduction (1.08 vs 0.015 ms per V4-Flash decode step on the H200, docs/perf/serving_h200.md); products and
# fp32 adds stay as they were.


def hc_collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """``Σ_j pre_j · X_j``: ``[B,S,n,D]`` × ``[B,S,n]`` → ``[B,S,D]`` (fp32 sum, streams' dtype out)."""
    return _weighted_streams(pre, streams.astype(F32)).astype(streams.dtype)


def _weighted_streams(weights: jax.Array, streams: jax.Array) -> jax.Array:
    """``Σ_j weights[..., j] · streams[..., j, :]``: ``[..., n]`` × ``[..., n, D]`` → ``[..., D]`` fp32."""
    return ordered_sum(weights[..., None] * streams, axis=-2)


def hc_pre(streams: jax.Array, site: Mapping[str, jax.Array], *, hc_mult: int, sinkhorn_iters: int, hc_eps: float,
           norm_eps: float, impl: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Collapse the streams for one sublayer (V4, unshifted).

    streams: ``[B,S,n,D]``. Returns ``(u [B,S,D] in the streams' dtype, post [B,S,n] fp32, comb [B,S,n,n] fp32)``.
    """
    pre, post, comb = hc_mixes(streams, site, hc_mult=hc_mult, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                               norm_eps=norm_eps, impl=impl)
    return hc_collapse(streams, pre), post, comb


def hc_post(streams: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """Expand a sublayer output back into the streams: ``X'_k = post_k · y + Σ_j comb[j,k] · X_j`` (fp32 math)."""
    mixed = ordered_sum(comb[..., None] * streams.astype(F32)[..., :, None, :], axis=-3)  # Σ_j comb[j,k]·X_j
    out = post[..., None] * y.astype(F32)[..., None, :] + mixed
    return out.astype(streams.dtype)


def hc_head(streams: jax.Array, head: Mapping[str, jax.Array], *, hc_eps: float, norm_eps: float) -> jax.Array:
    """Final collapse of ``[B,S,n,D]`` streams to ``[B,S,D]`` (fp32) without Sinkhorn."""
    mix = _normed_mix(streams, head["fn"], norm_eps)
    pre = jax.nn.sigmoid(mix * head["scale"].astype(F32) + head["base"].astype(F32)) + hc_eps
    return _weighted_streams(pre, streams.astype(F32))
