"""Speculative decoding on the device: the V4 MTP drafter's serving state, drafting, and verification of drafts
inside the target's decode step (``docs/speculative_decoding.md``, ``docs/spec/engine.md`` §5).

Layout (all indexed by the sequence's state slot; slot 0 is the padding slot, as in DeepInfer's ``MTPInfoPool``):

* ``draft_tokens [num_slots, k]`` int32 and ``draft_logprobs [num_slots, k, V]`` f32: the drafts a sequence's last
  processed step published, read by its next decode (verify) row. The drafting functions also return each row's
  confidences ``[B, k]`` f32 in its drafts (DSpark: the confidence head; MTP: the drafter's temperature-1
  probability of its own draft), which the host reads for confidence-scheduled verification
  (:mod:`dinfer_jax.engine.spec_schedule`).
* ``mtp``: the MTP block's own sliding-window ring ``[1, num_slots, W + backtrack, d]`` (a one-layer
  :class:`LayerCache`), written at every committed position and, speculatively, at the drafted ones.

A verify row holds ``1 + k`` query tokens: the committed input token at ``start`` and the drafts ``d1..dk``. Row
``j`` of its logits predicts position ``start + j + 1``: for ``j < ndraft`` it verifies ``d_{j+1}``, row ``ndraft``
is the bonus row. Rejected positions leave KV in the rings and pages; nothing is copied back: the rings hold
``backtrack`` extra entries (see :class:`~dinfer_jax.models.step_state.CacheConfig`), compressed rows of rejected
positions are invisible to committed queries and rewritten when the real token reaches them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.backbone import head_logits, rope_for
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.layer_plan import SLIDING_INFO
from dinfer_jax.models.layers import LayerOptions, StepContext, layer_v4
from dinfer_jax.models.ops import linear, rms_norm
from dinfer_jax.models.qweights import take_rows
from dinfer_jax.models.step_state import CacheConfig, LayerCache, StepInput, single_layer_cache
from dinfer_jax.sampling import SampleLogprobs, fused_sample
from dinfer_jax.sampling.params import SAMPLING_EPS
from dinfer_jax.sampling.sampler import _canonical_zero, processed_logprobs

SPECULATIVE_METHODS = (None, "mtp", "dspark")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Drafter state threaded (donated) from step to step; see the module docstring."""

    draft_tokens: jax.Array
    draft_logprobs: jax.Array
    mtp: LayerCache | None = None  # V4 MTP: the block's SWA ring
    dkeys: jax.Array | None = None  # V4.1 DSpark: each draft layer's main keys, [n_draft, num_slots, W + b, d]


def init_spec_state(cfg: ModelConfig, cc: CacheConfig, k: int, dtype: Any, method: str = "mtp") -> SpecState:
    common = dict(draft_tokens=jnp.zeros((cc.num_slots, k), jnp.int32),
                  draft_logprobs=jnp.zeros((cc.num_slots, k, cfg.vocab_size), jnp.float32))
    if method == "dspark":
        shape = (cfg.n_mtp_layers, cc.num_slots, cfg.sliding_window + cc.backtrack, cfg.head_dim)
        return SpecState(dkeys=jnp.zeros(shape, jnp.dtype(dtype)), **common)
    return SpecState(mtp=single_layer_cache(cfg, SLIDING_INFO, cc, dtype), **common)


def _mtp_layer(params: Any, cache: LayerCache, streams: jax.Array, next_ids: jax.Array, inp: StepInput, *,
               cfg: ModelConfig, dtype: str, moe_impl: str) -> tuple[jax.Array, jax.Array, LayerCache]:
    """MTP block ``mtp.0`` over rows of positions ``inp.start …``: position t combines the hidden streams at t with
    the token at t + 1 (``next_ids``). Returns ``(mtp streams [B,Q,n,D], logits [B,V] at inp.last, cache)``."""
    p = params["mtp"][0]
    dt = jnp.dtype(dtype)
    e = rms_norm(take_rows(params["embed"], next_ids, dt), p["enorm"], cfg.norm_eps)
    hn = rms_norm(streams.astype(dt), p["hnorm"], cfg.norm_eps)
    x = (linear(e, p["e_proj"])[:, :, None, :] + linear(hn, p["h_proj"])).astype(dt)
    inp = dataclasses.replace(inp, tokens=next_ids)
    pos = inp.positions()
    ctx = StepContext(inp, pos, rope_for(cfg, pos))
    carry, cache, _ = layer_v4(p, {"streams": x}, cache, jnp.int32(0), jnp.int32(-1), ctx, cfg=cfg,
                               info=SLIDING_INFO, opts=LayerOptions(moe_impl=moe_impl))
    out = carry["streams"]
    last = jnp.take_along_axis(out, inp.last.reshape(-1, 1, 1, 1), axis=1)
    logits, _ = head_logits({"hc_head": p["hc_head"], "norm": p["norm"], "head": params["head"]},
                            {"streams": last}, cfg)
    return out, logits[:, 0], cache


def _sample_rows(logits: jax.Array, samp: Any, positions: jax.Array, *, tag: str, **verify: Any):
    """fused_sample over ``[N, V]`` rows with the per-row sampling tensors ``samp`` (already ``[N]``); greedy rows
    take the argmax (as the non-speculative sampler does), and a greedy verify row accepts iff draft == argmax.
    Returns ``(tokens [N], accept [N] or None, processed logprobs [N, V])``. When every row is greedy or padding the
    random draws are skipped (their results would all be overwritten): statically when ``samp.all_greedy``, else
    under a ``lax.cond``."""
    argmax = jnp.argmax(_canonical_zero(logits.astype(jnp.float32)), axis=-1).astype(jnp.int32)

    def drawn(lg: jax.Array):
        res = fused_sample(lg, samp.temperature, samp.top_p, samp.top_k, (samp.seed_hi, samp.seed_lo), positions,
                           tag=tag, min_p=samp.min_p, **verify)
        return res.tokens, (res.accept if verify else None), res.logprobs

    def greedy_only(lg: jax.Array):
        # greedy rows have no filters (DeepInfer's substitution), nor do padding rows: no sorts needed
        lp = processed_logprobs(lg, jnp.where(samp.greedy, jnp.float32(SAMPLING_EPS), samp.temperature),
                                samp.top_p, samp.top_k, use_filters=False)
        return argmax, (jnp.ones(argmax.shape, bool) if verify else None), lp

    if samp.all_greedy:
        tokens, accept, lp = greedy_only(logits)
    else:  # the speculative step fixes all_greedy=False (one program per bucket): decide on the device
        tokens, accept, lp = jax.lax.cond(jnp.all(samp.greedy | ~samp.valid), greedy_only, drawn, logits)
    tokens = jnp.where(samp.greedy, argmax, tokens)
    if accept is not None:
        acc_greedy = jnp.where(verify["is_verify"], verify["draft_token_ids"] == argmax, True)
        accept = jnp.where(samp.greedy, acc_greedy, accept)
        tokens = jnp.where(samp.greedy, argmax, jnp.where(verify["is_verify"] & accept,
                                                          verify["draft_token_ids"], tokens))
    return tokens, accept, lp


def _rows(samp: Any, q: int) -> Any:
    """Sampling tensors of ``[B]`` rows repeated ``q`` times each → ``[B·q]``."""
    return jax.tree.map(lambda x: jnp.repeat(x, q, axis=0), samp)


def _own_probability(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``softmax(logits)[token]`` per row at temperature 1, f32 ``[B]``: the MTP drafter's confidence in its draft
    (the processed log-probs of a greedy row are those of temperature 1e−5, ≈ 1 for any argmax)."""
    lg = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(lg, tokens[:, None], axis=-1)[:, 0]
    return jnp.exp(picked - jax.nn.logsumexp(lg, axis=-1))


def draft(params: Any, spec: SpecState, streams: jax.Array, next_ids: jax.Array, inp: StepInput, n_mtp: jax.Array,
          publish: jax.Array, samp: Any, *, cfg: ModelConfig, dtype: str, moe_impl: str,
          k: int) -> tuple[SpecState, jax.Array]:
    """Run the MTP drafter after the target: feed it the committed positions ``start … start + n_mtp − 1`` of each
    row (target streams + the next token), then draft ``k`` tokens autoregressively from the last of them (MTP
    reuses its own output streams for drafts 2…k, DeepSeek-V3 style). Rows with ``publish`` store their drafts in
    the sequence's slot. Draft token i (0-based) sits at position ``start + n_mtp + 1 + i`` and is sampled there
    with the request's filters in the draft RNG namespace. Returns ``(spec, confidences [B, k] f32)``."""
    B = next_ids.shape[0]
    n_mtp = jnp.where(inp.n > 0, n_mtp, 0)
    last = jnp.maximum(n_mtp - 1, 0)
    step = dataclasses.replace(inp, n=n_mtp, last=last)
    mtp_streams, logits, cache = _mtp_layer(params, spec.mtp, streams, next_ids, step, cfg=cfg, dtype=dtype,
                                            moe_impl=moe_impl)
    h = jnp.take_along_axis(mtp_streams, last.reshape(-1, 1, 1, 1), axis=1)  # [B,1,n,D]
    toks, lps, confs = [], [], []
    pos0 = inp.start + n_mtp  # position of the target's newest token (the one drafts follow)
    for i in range(k):
        tok, _, lp = _sample_rows(logits, samp, pos0 + 1 + i, tag="draft")
        toks.append(tok)
        lps.append(lp)
        confs.append(_own_probability(logits, tok))
        if i + 1 < k:
            one = StepInput(tokens=tok[:, None], start=pos0 + i, n=(n_mtp > 0).astype(jnp.int32), slot=inp.slot,
                            pages=inp.pages, last=jnp.zeros((B,), jnp.int32))
            h, logits, cache = _mtp_layer(params, cache, h, tok[:, None], one, cfg=cfg, dtype=dtype,
                                          moe_impl=moe_impl)
    s = jnp.where(publish & (n_mtp > 0), inp.slot, spec.draft_tokens.shape[0])
    return dataclasses.replace(spec, mtp=cache,
                               draft_tokens=spec.draft_tokens.at[s].set(jnp.stack(toks, 1), mode="drop"),
                               draft_logprobs=spec.draft_logprobs.at[s].set(jnp.stack(lps, 1), mode="drop")
                               ), jnp.stack(confs, 1)


def verify(logits: jax.Array, drafts: jax.Array, draft_lp: jax.Array, ndraft: jax.Array, start: jax.Array,
           samp: Any, num_top: int) -> tuple[jax.Array, jax.Array, SampleLogprobs]:
    """Verify ``ndraft [B]`` (≤ Q − 1) drafts per row. logits ``[B,Q,V]`` (Q ≤ 1 + k, the step's width), drafts
    ``[B,Q−1]``, draft_lp ``[B,Q−1,V]``.

    Returns ``(tokens [B,Q], num_accepted [B], logprobs)``: the row's emitted run is ``tokens[b, :num_accepted+1]``
    (the accepted drafts, then the residual resample at the first rejection or the bonus token)."""
    B, Q, V = logits.shape
    j = jnp.arange(Q)[None, :]
    is_verify = j < ndraft[:, None]
    dtok = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    dlp = jnp.concatenate([draft_lp, jnp.zeros((B, 1, V), jnp.float32)], axis=1)
    rows = _rows(samp, Q)
    tokens, accept, lp = _sample_rows(logits.reshape(B * Q, V), rows, (start[:, None] + j + 1).reshape(-1),
                                      tag="default", is_verify=is_verify.reshape(-1),
                                      draft_logprobs=dlp.reshape(B * Q, V), draft_token_ids=dtok.reshape(-1))
    acc = (accept.reshape(B, Q) & is_verify).astype(jnp.int32)
    nacc = jnp.sum(jnp.cumprod(acc, axis=1), axis=1)
    tok_lp = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if num_top:
        top_lp, top_ids = jax.lax.top_k(lp, num_top)
    else:
        top_lp, top_ids = jnp.zeros((B * Q, 0), jnp.float32), jnp.zeros((B * Q, 0), jnp.int32)
    out = SampleLogprobs(tok_lp.reshape(B, Q), top_lp.reshape(B, Q, -1), top_ids.astype(jnp.int32).reshape(B, Q, -1))
    return tokens.reshape(B, Q), nacc, out


def draft_dspark(params: Any, spec: SpecState, features: jax.Array, golden: jax.Array, inp: StepInput,
                 n_commit: jax.Array, publish: jax.Array, samp: Any, *, cfg: ModelConfig, dtype: str, moe_impl: str,
                 k: int) -> tuple[SpecState, jax.Array]:
    """V4.1 DSpark drafter after the target: write each draft layer's main keys for the committed positions
    ``start … start + n_commit − 1`` (features ``[B,Q,n_targets·D]`` of the target step) into the slot's key rings,
    then draft one block after the anchor ``a = start + n_commit − 1`` with ``golden`` (the target's token at a+1)
    and keep its first ``k`` rows. Draft row i sits at position ``a + 2 + i``, sampled with the request's filters
    in the draft RNG namespace; the Markov term of row i reads the draft actually sampled at row i − 1. Returns
    ``(spec, confidences [B, k] f32)`` (the confidence head's, of the published rows)."""
    from dinfer_jax.models import dspark
    from dinfer_jax.models.cache_io import ring_write

    n_commit = jnp.where(inp.n > 0, n_commit, 0)
    pos = inp.positions()
    keys = dspark.main_keys(params, cfg, features, pos, dtype=dtype)  # [n_draft,B,Q,d]
    ring = spec.dkeys
    for i in range(ring.shape[0]):
        ring = ring_write(ring, jnp.int32(i), inp.slot, pos, n_commit, keys[i])
    W, R = cfg.sliding_window, ring.shape[2]
    a = inp.start + n_commit - 1
    wpos = a[:, None] - W + 1 + jnp.arange(W)[None, :]  # [B,W]
    rows = ring[:, inp.slot]  # [n_draft,B,R,d]
    wk = jnp.take_along_axis(rows, jnp.mod(wpos, R)[None, :, :, None], axis=2)
    h = dspark.draft_hidden(params, cfg, None, a, golden, dtype=dtype, moe_impl=moe_impl,
                            window=(wk, wpos >= 0))
    lps = []

    def sample_fn(logits_i: jax.Array, i: int) -> jax.Array:
        tok, _, lp = _sample_rows(logits_i, samp, a + 2 + i, tag="draft")
        lps.append(lp)
        return tok

    # heads for the k published rows only: row i reads h at row i and the draft of row i - 1, never later rows
    _, confs, toks = dspark.dspark_heads(params, cfg, h[:, :k], golden, sample_fn=sample_fn)
    s = jnp.where(publish & (n_commit > 0), inp.slot, spec.draft_tokens.shape[0])
    return dataclasses.replace(spec, dkeys=ring,
                               draft_tokens=spec.draft_tokens.at[s].set(toks[:, :k], mode="drop"),
                               draft_logprobs=spec.draft_logprobs.at[s].set(jnp.stack(lps[:k], 1), mode="drop")
                               ), confs[:, :k].astype(jnp.float32)
