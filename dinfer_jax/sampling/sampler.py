"""Logits -> tokens (+ logprobs) on device, with DeepInfer's filtering order and deterministic sampling.

DeepInfer reference (``tilelang_ops/fused_sample.py``: ``fused_sample_ref``, ``apply_top_p_top_k_ref``):

1. ``logits * (1 / temperature)`` (the reciprocal is an fp32 division, then an fp32 multiply).
2. top-p: ``probs = softmax(logits)``; sort descending with a *stable* sort (ties: lower column first); remove a
   token when the cumulative mass *before* it exceeds ``top_p`` (``cumsum(sorted) - sorted > top_p``).
3. top-k on the top-p-masked logits: stable descending sort, keep ranks ``< top_k`` (``-1`` disables). Ranks come
   from the logits, not the probabilities, so two logits that round to the same probability keep logit order.
4. ``logprobs = log_softmax`` over the survivors; sampling probabilities are ``exp(logprobs)``.
5. ``random_sampling(probs, seed, position)`` (stream case 0).

Choices made here (not DeepInfer behaviour, or where DeepInfer's reference is ambiguous):

* ``top_p >= 1`` disables top-p outright (the kernel's documented semantics). The torch reference would also drop
  tail tokens whose fp32 exclusive cumsum happens to exceed 1.0 by rounding.
* ``-0.0`` logits sort as ``+0.0`` (torch's comparison sort treats them as equal; XLA's sort orders -0 < +0).
* min-p (absent from DeepInfer): applied last, after top-k: with ``p = softmax`` of the top-p/top-k survivors,
  keep ``p >= min_p * max(p)``. The most likely token always survives, and since the criterion is a ratio to the
  maximum, the result equals min-p applied to the full tempered distribution intersected with the top-p/top-k set.
* Greedy rows (``temperature < 1e-5``): DeepInfer samples them with temperature 1e-5 (effectively, not exactly,
  argmax: near-ties within ~1e-3 logits are random). ``greedy_fast_path=True`` (default) returns the argmax of the
  raw logits instead (lowest index on ties); ``False`` reproduces DeepInfer's path. Their logprobs are DeepInfer's
  either way (temperature 1e-5, no filters).
* logprobs (DeepInfer ``Sampler._prepare_top_info`` / ``_update_golden_tokens``): taken from the *processed*
  distribution of step 4 (tempered, filtered, renormalised; filtered tokens are ``-inf``). The top-n uses
  ``lax.top_k`` (ties: lower index first; rows with fewer than n survivors list ``-inf`` entries).
  ``logprobs_mode="raw"`` gives ``log_softmax(logits)`` of the unprocessed logits instead.

Everything is shape-static (N rows, V columns, n top logprobs), so one compiled step per bucket serves any
batch; padding rows (``valid=False``) get all-zero logits internally and zero outputs, never NaN.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dinfer_jax.models.group_select import int_keys, top_indices

from ._u64 import U64
from .params import SamplingTensors
from .random import add_seed_offset, random_sampling

LOGPROBS_MODES = ("processed", "raw")
# On a GPU the two stable sorts of a [64, 129280] vocabulary took 2.8 ms of a decode step (serving_h200.md); the
# filters then look at the FILTER_CANDIDATES most likely tokens only, which decide them whenever the cut falls inside
# that prefix (top_p_top_k_mask says when). Only where the vocabulary is at least 16 times that many.
FILTER_CANDIDATES = 1024
# On XLA:CPU the sorts cost ~0.6 ms per 2,048-entry row (5.9 ms for 10 rows: more than the default model's whole
# decode step), and selecting candidates grows quickly with their number there, so a CPU looks at fewer
# (docs/perf/bench_generate_cpu.md, "Sampled decoding").
CPU_FILTER_CANDIDATES = 64


class SampleLogprobs(NamedTuple):
    """Logprob outputs of :func:`sample`.

    token_logprobs: [N] f32, logprob of the returned token.
    top_logprobs: [N, n] f32, the n largest logprobs, descending.
    top_token_ids: [N, n] int32, their token ids.
    """

    token_logprobs: jax.Array
    top_logprobs: jax.Array
    top_token_ids: jax.Array


def _canonical_zero(x: jax.Array) -> jax.Array:
    """Replace -0.0 by +0.0 (so sorts treat them as equal, as torch does)."""
    return jnp.where(x == 0, jnp.zeros_like(x), x)


def _stable_descending_order(x: jax.Array) -> jax.Array:
    """Per-row column order by descending value, ties by ascending column (torch stable descending sort)."""
    key = -_canonical_zero(x)  # every zero becomes -0.0: all zeros tie
    iota = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    _, order = lax.sort((key, iota), dimension=x.ndim - 1, is_stable=True, num_keys=1)
    return order


def _unpermute(order: jax.Array, values: jax.Array) -> jax.Array:
    """out[i, order[i, r]] = values[i, r] (inverse of take_along_axis)."""
    rows = lax.broadcasted_iota(jnp.int32, order.shape, 0)
    return jnp.zeros_like(values).at[rows, order].set(values, unique_indices=True)


def filter_candidates(vocab: int, backend: str, rows: int = 2) -> int | None:
    """How many most likely tokens :func:`top_p_top_k_mask` examines first for ``rows`` rows of a ``vocab``-wide
    vocabulary: :data:`FILTER_CANDIDATES` on a GPU from 2 rows and :data:`CPU_FILTER_CANDIDATES` on a CPU, when the
    vocabulary has at least 16 times as many; None (the whole vocabulary sorted) otherwise and on other backends.
    A single row on a GPU sorts faster than its candidates are found (H100, V = 129,280: 0.12 against 0.20 ms of
    device time; from 2 rows the candidates win, 11× at 32 rows; docs/perf/serving_h200.md)."""
    c = {"gpu": FILTER_CANDIDATES, "cpu": CPU_FILTER_CANDIDATES}.get(backend)
    if c is None or vocab < 16 * c or (backend == "gpu" and rows < 2):
        return None
    return c


def _top_k_removed(masked: jax.Array, top_k: jax.Array, vocab: int) -> jax.Array:
    """[N, M] bool: the entries of ``masked [N, M]`` (top-p survivors' logits, −inf elsewhere) whose stable
    descending rank is ``top_k`` or more (``top_k [N]``, negative: none; clipped to the vocabulary)."""
    n, m = masked.shape
    ranks = _unpermute(_stable_descending_order(masked), jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (n, m)))
    return (top_k[:, None] >= 0) & (ranks >= jnp.minimum(top_k, vocab)[:, None])


def _full_top_p_top_k_mask(logits: jax.Array, probs: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """The mask from the two stable sorts of the whole vocabulary (DeepInfer's reference, literally)."""
    order = _stable_descending_order(probs)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    exclusive = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    remove_sorted = (exclusive > top_p[:, None]) & (top_p[:, None] < 1.0)
    keep = ~_unpermute(order, remove_sorted)
    return keep & ~_top_k_removed(jnp.where(keep, logits, -jnp.inf), top_k, logits.shape[-1])


def _candidate_top_p_top_k_mask(logits: jax.Array, probs: jax.Array, top_p: jax.Array, top_k: jax.Array,
                                candidates: int) -> tuple[jax.Array, jax.Array]:
    """The same mask from the ``C = candidates`` most likely tokens, and ``[N]`` bool: whether it is exact for the
    row. Tokens outside the ``C`` are dropped, so the row is exact when the full filters drop them too:

    * top-p removes rank ``C − 1`` itself, hence every later rank: a later rank's ``cumsum − p`` is at least rank
      ``C − 1``'s (a larger or equal cumsum minus a smaller or equal probability; rounding is monotone). This relies
      on the cumsum of the ``C`` being the full cumsum's prefix bit for bit — so on XLA:CPU (a left-to-right
      reduction; tested); a GPU may associate a 129K-long cumsum differently, which can move a cut that falls on
      an ulp-level tie with ``top_p`` by one token;
    * or top-k keeps fewer than ``C`` ranks and the ``top_k``-th probability is above the ``C``-th: every token
      outside has a smaller probability, hence a smaller logit, than ``top_k`` tokens that survive top-p (top-p
      keeps a prefix of the probability order), so its logit rank is at least ``top_k``;
    * or the row has no filter (``top_p >= 1`` and ``top_k < 0``): the caller keeps everything.
    """
    n, v = logits.shape
    c = candidates
    # the C most likely columns, as a set (ties: lower column), then in the stable descending order of the full sort
    cols = top_indices(int_keys(_canonical_zero(probs)), c)                    # [N, C] ascending
    cand_p = jnp.take_along_axis(probs, cols, axis=-1)
    order = _stable_descending_order(cand_p)
    cols = jnp.take_along_axis(cols, order, axis=-1)
    sorted_p = jnp.take_along_axis(cand_p, order, axis=-1)
    remove_sorted = (jnp.cumsum(sorted_p, axis=-1) - sorted_p > top_p[:, None]) & (top_p[:, None] < 1.0)
    masked = jnp.where(remove_sorted, -jnp.inf, jnp.take_along_axis(logits, cols, axis=-1))
    keep_sorted = ~remove_sorted & ~_top_k_removed(masked, top_k, v)
    rows = lax.broadcasted_iota(jnp.int32, cols.shape, 0)
    keep = jnp.zeros((n, v), bool).at[rows, cols].set(keep_sorted, unique_indices=True)

    p_at_k = jnp.take_along_axis(sorted_p, jnp.clip(top_k - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
    exact = remove_sorted[:, -1] \
        | ((top_k == 0) | ((top_k > 0) & (top_k < c) & (p_at_k > sorted_p[:, -1]))) \
        | ((top_p >= 1.0) & (top_k < 0))
    return keep, exact


def top_p_top_k_mask(logits: jax.Array, top_p: jax.Array, top_k: jax.Array, *,
                     candidates: int | None = None) -> jax.Array:
    """Tokens kept by DeepInfer's stable top-p then top-k (``apply_top_p_top_k_ref``).

    Args:
        logits: [N, V] f32, temperature already applied (``-inf`` allowed, at least one finite per row).
        top_p: [N] f32 in (0, 1]; ``>= 1`` disables.
        top_k: [N] int32; ``-1`` (any negative) disables.
        candidates: static; None sorts the whole vocabulary twice. An int ``C`` (< V / 2) decides the filters from
            the ``C`` most likely tokens (found without a full sort; :mod:`dinfer_jax.models.group_select`) and falls
            back to the full sorts, under a ``lax.cond``, only when some row's cut lies beyond them
            (:func:`_candidate_top_p_top_k_mask`); the same mask either way.
    Returns:
        [N, V] bool keep-mask.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    if candidates is None or 2 * candidates > logits.shape[-1]:
        return _full_top_p_top_k_mask(logits, probs, top_p, top_k)
    keep, exact = _candidate_top_p_top_k_mask(logits, probs, top_p, top_k, candidates)
    unfiltered = (top_p >= 1.0) & (top_k < 0)
    keep = keep | unfiltered[:, None]
    return lax.cond(jnp.all(exact), lambda: keep, lambda: _full_top_p_top_k_mask(logits, probs, top_p, top_k))


def min_p_mask(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Keep-mask of min-p: ``softmax(logits) >= min_p * max`` per row; ``min_p <= 0`` keeps everything.
    logits: [N, V] f32 (already filtered, -inf = removed); min_p: [N] f32. Returns [N, V] bool."""
    probs = jax.nn.softmax(logits, axis=-1)
    pmax = jnp.max(probs, axis=-1, keepdims=True)
    return (probs >= min_p[:, None] * pmax) | (min_p[:, None] <= 0.0)


def processed_logprobs(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    min_p: jax.Array | None = None,
    *,
    use_filters: bool = True,
    candidates: int | None | str = "auto",
) -> jax.Array:
    """Steps 1-4 of the module docstring on explicit per-row arrays (shared by :func:`process_logits` and
    :func:`~dinfer_jax.sampling.fused_sample`).

    Args:
        logits: [N, V] float (computed in f32).
        temperature: [N] f32, > 0 (callers apply the greedy substitution first).
        top_p: [N] f32; ``>= 1`` disables. top_k: [N] int32; negative disables.
        min_p: [N] f32 or None (no min-p step at all).
        use_filters: static; False skips top-p / top-k / min-p (no sorts).
        candidates: static; :func:`top_p_top_k_mask`'s (default: :func:`filter_candidates` for this vocabulary and
            the default backend).
    Returns:
        [N, V] f32 processed logprobs; filtered tokens are ``-inf``.
    """
    x = logits.astype(jnp.float32)
    inv_t = jnp.float32(1.0) / temperature
    x = x * inv_t[:, None]
    if candidates == "auto":
        candidates = filter_candidates(x.shape[-1], jax.default_backend(), x.shape[0])
    if use_filters:
        def filtered(z: jax.Array) -> jax.Array:
            keep = top_p_top_k_mask(z, top_p, top_k, candidates=candidates)
            if min_p is not None:
                keep = keep & min_p_mask(jnp.where(keep, z, -jnp.inf), min_p)
            return keep

        # Skip the two vocabulary sorts when no row filters. This conditional is a host sync on GPUs (see
        # SamplingTensors); the engine's plain step has it only in its draw variant (use_filters=True when some row
        # samples), which syncs for its random draw anyway, and none in its all-greedy variant.
        needed = jnp.any((top_p < 1.0) | (top_k >= 0))
        if min_p is not None:
            needed = needed | jnp.any(min_p > 0.0)
        keep = lax.cond(needed, filtered, lambda z: jnp.ones(z.shape, bool), x)
        x = jnp.where(keep, x, -jnp.inf)
    # A logprob is ≤ 0; XLA:CPU's fused exp/log can leave the top token of a sharp row (temperature 1e-5) at
    # +2e-8 (measured: 64 rows of logits / 1e-5), so the result is clamped to 0.
    return jnp.minimum(jax.nn.log_softmax(x, axis=-1), 0.0)


def process_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Steps 1-4 of the module docstring: [N, V] logits -> [N, V] f32 processed logprobs (filtered = -inf)."""
    x = jnp.where(st.valid[:, None], logits.astype(jnp.float32), 0.0)
    return processed_logprobs(x, st.temperature, st.top_p, st.top_k, st.min_p, use_filters=st.use_filters)


@partial(jax.jit, static_argnames=("greedy_fast_path", "seed_offset", "logprobs_mode", "method"))
def sample(
    logits: jax.Array,
    params_tensors: SamplingTensors,
    *,
    greedy_fast_path: bool = True,
    seed_offset: int = 0,
    logprobs_mode: str = "processed",
    method: str = "auto",
) -> tuple[jax.Array, SampleLogprobs]:
    """Sample one token per row (see the module docstring for the exact semantics).

    Args:
        logits: [N, V] float (f32 or bf16; computed in f32).
        params_tensors: :class:`SamplingTensors` with N rows (from ``SamplingTensors.from_params``).
        greedy_fast_path: static; greedy rows take the argmax (True) or DeepInfer's temperature-1e-5 sample.
        seed_offset: static; added to every seed mod 2**64 (``MTP_SEED_OFFSET`` for draft sampling).
        logprobs_mode: static; ``"processed"`` (DeepInfer) or ``"raw"`` (log_softmax of the input logits).
        method: static; ``random_sampling`` method (``"auto"``, ``"exact"`` or ``"binade"``; same tokens).
    Returns:
        tokens: [N] int32 (0 for padding rows).
        :class:`SampleLogprobs` (zeros for padding rows).
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    st = params_tensors
    logprobs = process_logits(logits, st)
    seeds = add_seed_offset(U64(st.seed_hi, st.seed_lo), seed_offset)
    if greedy_fast_path:
        raw = jnp.where(st.valid[:, None], logits.astype(jnp.float32), 0.0)
        argmax = jnp.argmax(_canonical_zero(raw), axis=-1).astype(jnp.int32)
        # every row greedy: the draw would be overwritten. Known on the host (SamplingTensors.all_greedy): no draw
        # at all; otherwise (callers that fix all_greedy=False) skipped on the device when it turns out so.
        if st.all_greedy:
            drawn = jnp.zeros(logits.shape[:1], jnp.int32)
        else:
            drawn = lax.cond(jnp.all(st.greedy | ~st.valid), lambda p: jnp.zeros(p.shape[:1], jnp.int32),
                             lambda p: random_sampling(p, seeds, st.position, method=method), jnp.exp(logprobs))
        tokens = jnp.where(st.greedy, argmax, drawn)
    else:
        tokens = random_sampling(jnp.exp(logprobs), seeds, st.position, method=method)
    tokens = jnp.where(st.valid, tokens, 0)

    if logprobs_mode == "raw":
        logprobs = jax.nn.log_softmax(jnp.where(st.valid[:, None], logits.astype(jnp.float32), 0.0), axis=-1)
    token_lp = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    k = st.num_top_logprobs
    if k > 0:
        top_lp, top_ids = lax.top_k(logprobs, k)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    valid = st.valid
    out = SampleLogprobs(
        token_logprobs=jnp.where(valid, token_lp, 0.0),
        top_logprobs=jnp.where(valid[:, None], top_lp, 0.0),
        top_token_ids=jnp.where(valid[:, None], top_ids.astype(jnp.int32), 0),
    )
    return tokens, out
