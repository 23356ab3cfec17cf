"""One jitted model step over the serving cache: chunked prefill or decode rows for V4 and V4.1.

A step processes ``B`` rows (:class:`StepInput`) of up to ``Q`` query tokens each against the serving cache
(:class:`ModelCache`). Rows with ``n = 0`` are padding: they write nowhere and their outputs are ignored. The layer
math and its cache I/O are the model's (:func:`dinfer_jax.models.backbone.run_backbone`, the same function the
full-sequence forward runs); this module adds the on-device Engram n-gram rows and the logits of each row's
``last`` token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.backbone import head_logits, run_backbone
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.engram_lookup import EngramLookup, EngramState
from dinfer_jax.models.invariant import batch_invariant as invariant_tracing
from dinfer_jax.models.layers import LayerOptions
from dinfer_jax.models.linear_impl import linear_impl as linear_impl_scope
from dinfer_jax.models.linear_impl import resolve_linear_impl
from dinfer_jax.models.step_state import ModelCache, StepInput
from pallas_kernels.lowering_reuse import platform_from_env, reuse_kernel_lowerings


def _engram_rows_device(hist_all: jax.Array, inp: StepInput, cfg: ModelConfig,
                        cmap: jax.Array) -> tuple[jax.Array, jax.Array]:
    """N-gram rows ``[B,Q,M]`` of compressed ids (row r = token at p−r) from this step's tokens and the slot's
    history; returns the rows and the updated history ``[num_slots, M−1]``."""
    M = cfg.engram_max_ngram_size
    tokens = inp.tokens
    B, Q = tokens.shape
    pad = cmap[cfg.engram_pad_id]
    comp = cmap[jnp.clip(tokens, 0, cmap.shape[0] - 1)]
    hist = hist_all[inp.slot]  # [B, M-1]: hist[:, r-1] = token at start - r
    hist = jnp.where((inp.start == 0)[:, None], pad, hist)
    seq = jnp.concatenate([hist[:, ::-1], comp], axis=1)  # positions start-(M-1) … start+Q-1
    idx = (M - 1) + jnp.arange(Q)[:, None] - jnp.arange(M)[None, :]  # [Q, M]
    rows = seq[:, idx]  # [B,Q,M]
    # history after this row: the last M-1 valid tokens
    last = (M - 1) + inp.n[:, None] - 1 - jnp.arange(M - 1)[None, :]
    new_hist_rows = jnp.take_along_axis(seq, jnp.clip(last, 0, seq.shape[1] - 1), axis=1)
    keep = inp.n > 0
    s = jnp.where(keep, inp.slot, hist_all.shape[0])
    new_hist = hist_all.at[s].set(new_hist_rows, mode="drop")
    return rows, new_hist


def model_step(params: Mapping[str, Any], cache: ModelCache, inp: StepInput, *, cfg: ModelConfig, dtype: str,
               moe_impl: str = "auto", engram_fn: EngramLookup | None = None,
               engram: EngramState | None = None, ep_manual: int = 0, cp_manual: int = 0,
               copies_manual: int = 0, return_carry: bool = False, attention: str = "auto",
               attention_impl: str = "auto", count_experts: bool = False, batch_invariant: int = 0,
               yoco_skip: bool = False, mhc_impl: str = "auto", linear_impl: str = "xla") -> tuple[Any, ...]:
    """Run the model on one step's rows.

    params: ``"layers"`` stacked (:func:`stack_params`) for serving, or in checkpoint layout (stacked per call).
    Returns ``(logits [B,V] fp32 at each row's ``last`` token, updated cache)``. V4.1 Engram rows come from
    ``engram_fn`` (:class:`~dinfer_jax.models.engram_lookup.EngramLookup`: n-gram hash and table gather inside
    the program) reading ``engram`` (the compressed-id map and the placed tables). ``ep_manual``: EP group size
    when called per device inside a ``shard_map`` over the mesh (:mod:`dinfer_jax.engine.dp_runner`), 0
    otherwise; ``cp_manual`` likewise the CP group size (prefill MoE rows split over the CP ranks by the mirrored
    rule), ``copies_manual`` the copies of each DP engine (:class:`~dinfer_jax.models.layers.LayerOptions`; 0 = not
    called per device inside a mesh program: the mesh engine always passes ≥ 1).
    ``attention`` / ``attention_impl``: how queries read the compressed rows, and what attends to the gathered ones
    (:class:`~dinfer_jax.models.layers.LayerOptions`).
    ``count_experts`` (EPLB) adds the step's per-layer expert loads ``[L, E]`` int32 (real tokens only) as a third
    output. ``return_carry`` (speculative decoding) adds the backbone's final carry (``streams [B,Q,n,D]`` at
    every query position, and V4.1's ``dspark_features``) as a third output. ``batch_invariant`` > 0 traces the
    step batch-invariantly with that many token rows per product (:mod:`dinfer_jax.models.invariant`): a row's
    logits then do not depend on the other rows, their number, its position or its prompt's chunking.
    ``yoco_skip`` (V4.1 ``yoco="compact"``, prefill rows entirely below their kept suffix): the YOCO region only
    writes its KV sources' compressed rows (:func:`~dinfer_jax.models.layers.layer_v41_region_sources`); the
    returned logits are then meaningless (no row samples).
    ``mhc_impl``: the mHC Sinkhorn's implementation (:class:`~dinfer_jax.models.layers.LayerOptions`).
    ``linear_impl``: the FP8 linears' implementation (:mod:`dinfer_jax.models.linear_impl`: ``"xla"`` or the
    Mosaic GPU kernel, ``"pallas"``). On a GPU the one-device step's Mosaic GPU kernels are lowered once per
    process and shape instead of once per program (:mod:`pallas_kernels.lowering_reuse`; off with
    ``DINFER_JAX_REUSE_KERNEL_LOWERINGS=0``).
    """
    reuse = None if (ep_manual or cp_manual or copies_manual) else platform_from_env()
    with (invariant_tracing(batch_invariant),
          linear_impl_scope(resolve_linear_impl(linear_impl, bool(batch_invariant))),
          reuse_kernel_lowerings(reuse)):
        return _model_step(params, cache, inp, cfg=cfg, dtype=dtype, moe_impl=moe_impl, engram_fn=engram_fn,
                           engram=engram, ep_manual=ep_manual, cp_manual=cp_manual, copies_manual=copies_manual,
                           return_carry=return_carry, attention=attention, attention_impl=attention_impl,
                           count_experts=count_experts, yoco_skip=yoco_skip, mhc_impl=mhc_impl)


def _model_step(params: Mapping[str, Any], cache: ModelCache, inp: StepInput, *, cfg: ModelConfig, dtype: str,
                moe_impl: str, engram_fn: EngramLookup | None, engram: EngramState | None, ep_manual: int,
                cp_manual: int, copies_manual: int, return_carry: bool, attention: str, attention_impl: str,
                count_experts: bool, yoco_skip: bool, mhc_impl: str) -> tuple[Any, ...]:
    engram_emb = None
    if cfg.engram_layer_ids:
        rows, hist = _engram_rows_device(cache.ngram_hist, inp, cfg, engram.cmap)
        cache = dataclasses.replace(cache, ngram_hist=hist)
        engram_emb = engram_fn(engram.tables, rows).astype(jnp.dtype(dtype))  # [n_engram, B, Q, E_in]
    opts = LayerOptions(moe_impl=moe_impl, ep_manual=ep_manual, cp_manual=cp_manual,
                        copies_manual=max(copies_manual, 1), attention=attention, attention_impl=attention_impl,
                        count_experts=count_experts, yoco_skip=yoco_skip, mhc_impl=mhc_impl)
    carry, cache, aux = run_backbone(params, cache, inp, cfg=cfg, dtype=dtype, opts=opts, engram=engram_emb)
    last = {k: jnp.take_along_axis(v, inp.last.reshape((-1,) + (1,) * (v.ndim - 1)), axis=1)
            for k, v in carry.items() if k in ("streams", "premix")}  # [B,1,...]
    logits, _ = head_logits(params, last, cfg)
    if count_experts:
        if return_carry:
            raise ValueError("count_experts and return_carry are not combined")
        return logits[:, 0], cache, jnp.stack([a["expert_loads"] for a in aux])
    if return_carry:
        feats = [a["dspark_feature"] for a in aux if "dspark_feature" in a]
        if feats:  # V4.1 DSpark target features [B,Q,n_targets·D]
            carry = {**carry, "dspark_features": jnp.concatenate(feats, axis=-1)}
        return logits[:, 0], cache, carry
    return logits[:, 0], cache
