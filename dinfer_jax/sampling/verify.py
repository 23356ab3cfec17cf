"""Fused sampling with speculative verification: DeepInfer's ``fused_sample_ref`` (docs/spec/engine.md §5, §7).

Per row ``i`` of ``logits [Q, V]`` (rows are independent; nothing here links the rows of one request):

1. ``logprobs = log_softmax(top_k(top_p(logits * (1 / temperature))))`` — the filters of ``sampler.py``
   (:func:`~dinfer_jax.sampling.sampler.processed_logprobs`); ``p = exp(logprobs)``.
2. ``fresh = random_sampling(p, seed, position, case 0)``.
3. Only when draft inputs are given (``draft_logprobs`` is not None), with ``d = draft_token_ids[i]`` and
   ``q = draft_logprobs[i]`` (the drafter's full log-prob row for that position):

   * ``residual = max(p - exp(q - DRAFT_PROB_PENALTY), 0)`` (``DRAFT_PROB_PENALTY = 5e-5``), and
     ``accept_probs = max(1 - sum(residual), 0)`` on verify rows, 1 elsewhere;
   * ``draft_selected_logprobs = q[d]`` (``-inf`` for a sentinel ``d < 0``);
   * accepted iff ``exp(min(logprobs[d] - q[d], 0)) > u`` in f32, where ``u`` is the acceptance uniform of
     (seed, position, case 2) rounded to f32 (:func:`~dinfer_jax.sampling.random.acceptance_u53`,
     :func:`~dinfer_jax.sampling.random.u53_to_f32`). A draft removed by top-p/top-k has ``logprobs[d] = -inf``
     and is never accepted; a sentinel is never accepted; a NaN difference (both ``-inf``) is a rejection;
   * ``accept = accepted`` on verify rows, True on the others;
   * ``tokens = d`` if accepted, else ``random_sampling(residual, seed, position, case 1)`` on verify rows;
     ``fresh`` on the others (a request's bonus row is an ordinary row).

   A residual with zero mass samples token 0, as ``random_sampling_ref`` does on an all-zero row (DeepInfer's GPU
   kernel takes the first maximum logit instead; the reference is what this port matches).

The seed is ``seq_seed + offset mod 2**64`` with offset 0 for ``tag == "default"`` and ``MTP_SEED_OFFSET`` for any
other tag. Which rows are verify rows, and the "-1 after the first rejection" bookkeeping of a request's run of
drafts, belong to the caller (DeepInfer does them outside ``fused_sample``); this function decides each row alone.

Additions to the reference's contract (never changing a result the reference defines):

* temperatures below ``SAMPLING_EPS`` (e.g. 0) get DeepInfer's greedy substitution (temperature 1e-5, top-p 1,
  top-k -1), which DeepInfer applies before ``fused_sample``; the reference would produce NaN there;
* ``top_p >= 1`` disables top-p outright (as ``sample``; see ``sampler.py``);
* inside ``jax.jit`` a draft id ``>= V`` cannot be rejected at trace time and counts as a sentinel (the reference
  would fail to index); concrete inputs with such ids raise ``ValueError``.

Exactness: given the same f32 ``logprobs``, every decision here is the reference's bit for bit (integer hash, the
f32 rounding of ``u``, the exact CDF inversion of ``random_sampling``). The logprobs themselves are XLA's fp32
``log_softmax``, equal to ATen's to a few ulps, so end-to-end equality with the reference holds except for rows
where such an ulp moves a CDF boundary or the acceptance comparison (see docs/speculative_verify.md).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._u64 import U64
from .params import MTP_SEED_OFFSET, SAMPLING_EPS
from .random import METHODS, acceptance_u53, add_seed_offset, random_sampling, seeds_to_u64, u53_to_f32
from .sampler import processed_logprobs

DRAFT_PROB_PENALTY = 5e-5
"""DeepInfer's ``DRAFT_PROB_PENALTY`` (``tilelang_ops/common.py``): draft log-probs are lowered by this before the
residual is formed, so the residual is never empty for normalised rows."""


class FusedSampleResult(NamedTuple):
    """Outputs of :func:`fused_sample` (unpacks as DeepInfer's 5-tuple).

    logprobs: [Q, V] f32, processed target logprobs (filtered tokens ``-inf``).
    tokens: [Q] int32, the selected token of each row.
    accept: [Q] bool or None; acceptance of the row's draft (True on non-verify rows). None without drafts.
    draft_selected_logprobs: [Q] f32 or None; ``draft_logprobs[i, d_i]``, ``-inf`` for sentinel drafts.
    accept_probs: [Q] f32 or None; ``max(1 - sum(residual), 0)`` on verify rows, 1 on the others.
    """

    logprobs: jax.Array
    tokens: jax.Array
    accept: jax.Array | None
    draft_selected_logprobs: jax.Array | None
    accept_probs: jax.Array | None


def _concrete_values(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array, or None when it is traced (its values are unknown at trace time)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_shape(name: str, x: Any, shape: tuple[int, ...]) -> None:
    if tuple(np.shape(x)) != shape:
        raise ValueError(f"fused_sample: {name} must have shape {shape}, got {tuple(np.shape(x))}")


@partial(jax.jit, static_argnames=("seed_offset", "method", "verify", "use_min_p"))
def _fused_sample_impl(logits, temperatures, top_ps, top_ks, seed_hi, seed_lo, positions, is_verify,
                       draft_logprobs, draft_token_ids, min_p, *, seed_offset: int, method: str, verify: bool,
                       use_min_p: bool):
    greedy = temperatures < jnp.float32(SAMPLING_EPS)
    temperatures = jnp.where(greedy, jnp.float32(SAMPLING_EPS), temperatures)
    top_ps = jnp.where(greedy, jnp.float32(1.0), top_ps)
    top_ks = jnp.where(greedy, jnp.int32(-1), top_ks)
    min_p = jnp.where(greedy, jnp.float32(0.0), min_p) if use_min_p else None
    logprobs = processed_logprobs(logits, temperatures, top_ps, top_ks, min_p)
    probs = jnp.exp(logprobs)
    seeds = add_seed_offset(U64(seed_hi, seed_lo), seed_offset)
    fresh = random_sampling(probs, seeds, positions, method=method)
    if not verify:
        return FusedSampleResult(logprobs, fresh, None, None, None)

    v = logits.shape[1]
    draft_logprobs = draft_logprobs.astype(jnp.float32)
    sentinel = (draft_token_ids < 0) | (draft_token_ids >= v)
    safe = jnp.where(sentinel, 0, draft_token_ids)[:, None]
    residual = jnp.maximum(probs - jnp.exp(draft_logprobs - jnp.float32(DRAFT_PROB_PENALTY)), 0.0)
    accept_probs = jnp.maximum(1.0 - jnp.sum(residual, axis=-1), 0.0)
    accept_probs = jnp.where(is_verify, accept_probs, jnp.float32(1.0))
    draft_lp = jnp.take_along_axis(draft_logprobs, safe, axis=-1)[:, 0]
    draft_selected = jnp.where(sentinel, -jnp.inf, draft_lp)
    target_lp = jnp.take_along_axis(logprobs, safe, axis=-1)[:, 0]
    ratio = jnp.exp(jnp.minimum(target_lp - draft_lp, 0.0))  # NaN (both -inf) stays NaN: compares False
    u = u53_to_f32(acceptance_u53(seeds, positions))
    accepted = (ratio > u) & ~sentinel
    accept = jnp.where(is_verify, accepted, True)
    resampled = random_sampling(residual, seeds, positions, is_nextn_predict=True, method=method)
    tokens = jnp.where(is_verify, jnp.where(accept, draft_token_ids, resampled), fresh)
    return FusedSampleResult(logprobs, tokens, accept, draft_selected, accept_probs)


def fused_sample(
    logits: jax.Array,
    temperatures: jax.Array,
    top_ps: jax.Array,
    top_ks: jax.Array,
    seq_seeds: Any,
    positions: jax.Array,
    *,
    tag: str = "default",
    is_verify: jax.Array | None = None,
    draft_logprobs: jax.Array | None = None,
    draft_token_ids: jax.Array | None = None,
    method: str = "auto",
    min_p: jax.Array | None = None,
) -> FusedSampleResult:
    """Temperature -> top-p -> top-k -> log-softmax -> sample, with optional per-row draft verification; equal to
    DeepInfer's ``fused_sample_ref`` (see the module docstring for the exact rule).

    Usable eagerly and inside ``jax.jit`` (``tag`` and ``method`` are static Python values).

    Args:
        logits: [Q, V] float (f32 or bf16; computed in f32).
        temperatures: [Q] f32; values below 1e-5 are greedy (DeepInfer's substitution is applied).
        top_ps: [Q] f32 in (0, 1]; ``>= 1`` disables.
        top_ks: [Q] int32; negative disables.
        seq_seeds: [Q] per-row uint64 seeds in any form :func:`~dinfer_jax.sampling.seeds_to_u64` accepts.
        positions: [Q] int32 sample positions (RNG counters; packed draft rows use
            :func:`~dinfer_jax.sampling.draft_positions`).
        tag: RNG namespace: ``"default"`` (target sampling) or any other string (seeds offset by
            ``MTP_SEED_OFFSET``, DeepInfer's draft namespace).
        is_verify: [Q] bool, rows that verify a draft token. Required with ``draft_logprobs``.
        draft_logprobs: [Q, V] float, the drafter's log-prob row for each row's draft (read for every row; values
            of non-verify rows only affect ``draft_selected_logprobs``). Enables verification.
        draft_token_ids: [Q] int32 draft token of each row; -1 is a sentinel that forces rejection. Required with
            ``draft_logprobs``. Other ids outside [0, V) raise when concrete and count as sentinels when traced.
        method: ``random_sampling`` method (``"auto"`` or ``"exact"``; same tokens).
        min_p: [N] f32 or None. An addition to DeepInfer's contract (its ``fused_sample`` has no min-p): rows
            with ``min_p > 0`` drop tokens below ``min_p`` times the top probability after top-k, as
            :func:`~dinfer_jax.sampling.sample` does. None (default) or all zeros: the reference's result.

    Returns:
        :class:`FusedSampleResult` ``(logprobs [Q, V] f32, tokens [Q] int32, accept [Q] bool,
        draft_selected_logprobs [Q] f32, accept_probs [Q] f32)``; the last three are None without
        ``draft_logprobs``.

    Raises:
        ValueError: on shape mismatches, draft inputs given partially, a non-bool ``is_verify``, an unknown
            ``method``, or (for concrete, non-traced ids) a draft id outside ``{-1} ∪ [0, V)``.
    """
    if method not in METHODS:
        raise ValueError(f"fused_sample: method must be one of {METHODS}, got {method!r}")
    if not isinstance(tag, str):
        raise ValueError(f"fused_sample: tag must be a string, got {tag!r}")
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"fused_sample: logits must be [Q, V], got shape {logits.shape}")
    q, v = logits.shape
    for name, x in (("temperatures", temperatures), ("top_ps", top_ps), ("top_ks", top_ks),
                    ("positions", positions)):
        _check_shape(name, x, (q,))
    seeds = seeds_to_u64(seq_seeds)
    _check_shape("seq_seeds", seeds.lo, (q,))
    if min_p is not None:
        _check_shape("min_p", min_p, (q,))

    verify = draft_logprobs is not None
    if not verify:
        if is_verify is not None or draft_token_ids is not None:
            raise ValueError("fused_sample: is_verify / draft_token_ids were given without draft_logprobs")
        is_verify = jnp.zeros((q,), bool)
        draft_logprobs = jnp.zeros((q, 1), jnp.float32)  # unused placeholders (not traced into the result)
        draft_token_ids = jnp.zeros((q,), jnp.int32)
    else:
        if is_verify is None or draft_token_ids is None:
            raise ValueError("fused_sample: verification (draft_logprobs given) also needs is_verify and "
                             "draft_token_ids")
        _check_shape("draft_logprobs", draft_logprobs, (q, v))
        _check_shape("is_verify", is_verify, (q,))
        _check_shape("draft_token_ids", draft_token_ids, (q,))
        if jnp.asarray(is_verify).dtype != jnp.bool_:
            raise ValueError(f"fused_sample: is_verify must be bool, got {jnp.asarray(is_verify).dtype}")
        if not jnp.issubdtype(jnp.asarray(draft_token_ids).dtype, jnp.integer):
            raise ValueError("fused_sample: draft_token_ids must be integers")
        ids = _concrete_values(draft_token_ids)
        if ids is not None:
            bad = (ids != -1) & ((ids < 0) | (ids >= v))
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"fused_sample: draft_token_ids[{i}] = {int(ids[i])} is outside [0, {v}) and "
                                 "is not the sentinel -1")
    seed_offset = 0 if tag == "default" else MTP_SEED_OFFSET
    return _fused_sample_impl(
        logits,
        jnp.asarray(temperatures, jnp.float32),
        jnp.asarray(top_ps, jnp.float32),
        jnp.asarray(top_ks, jnp.int32),
        seeds.hi,
        seeds.lo,
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(is_verify, bool),
        jnp.asarray(draft_logprobs),
        jnp.asarray(draft_token_ids, jnp.int32),
        jnp.zeros((q,), jnp.float32) if min_p is None else jnp.asarray(min_p, jnp.float32),
        seed_offset=seed_offset,
        method=method,
        verify=verify,
        use_min_p=min_p is not None,
    )
