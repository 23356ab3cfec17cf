"""The backbone over cached state: embedding → scanned layer groups → final streams; the logits head.

:func:`run_backbone` is the one model body behind both the full-sequence forward (a fresh cache, rows from
position 0) and the serving step. Layer groups of :func:`layer_plan.plan_layers` run as ``jax.lax.scan`` over
their repeats; the scan body unrolls one period (consecutive layers of possibly different kinds). The scan carries
the cross-layer values and the group's stacked cache (updated in place at ``[rep, …]``) and scans over the
group's stacked parameters; per-layer intermediates come back as the scan's stacked outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.attention import RopeTable
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.invariant import rowwise
from dinfer_jax.models.layer_plan import LayerGroup, layer_info, plan_layers, stack_params
from dinfer_jax.models.layers import Carry, LayerOptions, StepContext, layer_v4, layer_v41
from dinfer_jax.models.mhc import hc_collapse, hc_head
from dinfer_jax.models.ops import F32, linear_fp32_input, rms_norm, rope_cos_sin, rope_inv_freq
from dinfer_jax.models.step_state import ModelCache, StepInput
from dinfer_jax.models.v41 import embed_tokens
from sharding.rules import constrain


def rope_for(cfg: ModelConfig, pos: jax.Array) -> dict[bool, tuple[Any, RopeTable]]:
    """``{compressed: (inv_freq, table)}`` at positions ``pos``: plain ``rope_theta`` for sliding-only layers,
    ``compress_rope_theta`` with YaRN for compressed layers."""
    out = {}
    for compressed in (False, True):
        inv = rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta if compressed else cfg.rope_theta,
                            cfg.yarn if compressed else None)
        cos, sin = rope_cos_sin(pos, inv)
        out[compressed] = (inv, RopeTable(cos, sin))
    return out


def _fill_carry(body: Any, carry: Carry, cache: Any, params: Any) -> Carry:
    """Give ``carry`` every entry one period of ``body`` produces (zeros where absent or of another shape), so the
    scan's carry has one structure. Sound because a period writes each such entry before reading it."""
    first = jax.tree.map(lambda x: x[0], params)
    out = jax.eval_shape(lambda c: body((c, cache), (first, jnp.int32(0)))[0][0], carry)
    filled = {}
    for key, s in out.items():
        v = carry.get(key)
        ok = v is not None and v.shape == s.shape and v.dtype == s.dtype
        filled[key] = v if ok else jnp.zeros(s.shape, s.dtype)
    return filled


def _run_group(g: LayerGroup, params: tuple[Any, ...], cache: tuple[Any, ...], carry: Carry, ctx: StepContext, *,
               cfg: ModelConfig, opts: LayerOptions) -> tuple[Carry, tuple[Any, ...], tuple[dict[str, Any], ...]]:
    layer_fn = layer_v41 if cfg.is_v41 else layer_v4
    infos = [layer_info(cfg, g.start + j) for j in range(g.period)]

    def body(state: tuple[Carry, tuple[Any, ...]], xs: tuple[tuple[Any, ...], jax.Array]):
        c, caches = state
        period_params, rep = xs
        caches, auxes = list(caches), []
        for j in range(g.period):
            layer = g.start + rep * g.period + j
            c, caches[j], aux = layer_fn(period_params[j], c, caches[j], rep, layer, ctx, cfg=cfg, info=infos[j],
                                         opts=opts)
            auxes.append(aux)
        return (c, tuple(caches)), tuple(auxes)

    if g.repeats == 1:  # nothing to scan: call the body once (index 0 of the stacked arrays)
        (carry, cache), aux = body((carry, cache), (jax.tree.map(lambda x: x[0], params), jnp.int32(0)))
        return carry, cache, jax.tree.map(lambda x: x[None], aux)
    carry = _fill_carry(body, carry, cache, params)
    (carry, cache), aux = jax.lax.scan(body, (carry, cache), (params, jnp.arange(g.repeats, dtype=jnp.int32)))
    return carry, cache, aux


def run_backbone(params: Any, cache: ModelCache, inp: StepInput, *, cfg: ModelConfig, dtype: str,
                 opts: LayerOptions, engram: jax.Array | None = None
                 ) -> tuple[Carry, ModelCache, list[dict[str, jax.Array]]]:
    """All backbone layers on one step's rows.

    params: checkpoint layout or with ``"layers"`` already stacked (:func:`stack_params`; stacking inside a jit
    copies the layer weights on every call). cache: :class:`ModelCache` in scan layout. engram (V4.1):
    ``[n_engram,B,Q,E_in]`` Engram rows. Returns ``(carry with final "streams" [B,Q,n,D] (+ "premix" [B,Q,n]),
    updated cache, per-layer aux dicts in layer order)``.
    """
    dt = jnp.dtype(dtype)
    tokens = inp.tokens
    B, Q = tokens.shape
    pos = inp.positions()
    eidx = None
    if cfg.engram_layer_ids:
        if engram is None:
            raise ValueError("this V4.1 config has Engram layers: pass their rows (engram)")
        table = [-1] * cfg.num_layers
        for i, layer in enumerate(cfg.engram_layer_ids):
            table[layer] = i
        eidx = jnp.asarray(table, jnp.int32)
    ctx = StepContext(inp, pos, rope_for(cfg, pos), engram, eidx)
    x = embed_tokens(params, tokens, dt, inp.image_embeds, inp.image_mask)
    n = cfg.hc_mult
    streams = jnp.broadcast_to(x[:, :, None, :], (B, Q, n, cfg.hidden_size))
    carry: Carry = {"streams": constrain(opts.sharder, streams, ("act_batch", "act_seq", None, None))}
    if cfg.is_v41:
        carry["premix"] = jnp.broadcast_to(jax.nn.one_hot(0, n, dtype=F32), (B, Q, n))
    layers = stack_params(cfg, params)["layers"]
    plan = plan_layers(cfg)
    new_cache, per_layer = [], [None] * cfg.num_layers
    for g, gp, gc in zip(plan, layers.groups, cache.layers, strict=False):
        carry, gc, aux = _run_group(g, gp, gc, carry, ctx, cfg=cfg, opts=opts)
        new_cache.append(gc)
        for j in range(g.period):
            for r in range(g.repeats):
                per_layer[g.layer(r, j)] = {key: v[r] for key, v in aux[j].items()}
    return carry, dataclasses.replace(cache, layers=tuple(new_cache)), per_layer


def head_logits(params: Any, carry: Carry, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Final hidden and logits of streams ``[B,S,n,D]``: V4 HC head, V4.1 collapse with the last ``premix``; then
    the final RMSNorm and the vocabulary head, all fp32. Returns ``(logits [B,S,V], hidden [B,S,D])``."""
    def head(streams: jax.Array, premix: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        if cfg.is_v41:
            h = hc_collapse(streams, premix)
        else:
            h = hc_head(streams, params["hc_head"], hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
        h = rms_norm(h, params["norm"], cfg.norm_eps, out_dtype=F32)
        # one bf16 GEMM over an exact split of h (0.3 ms of a batch-64 H200 decode step, against 2.2 ms for
        # converting the weight and an fp32 GEMM), fp32-accurate: tests/test_head_gpu.py, docs/perf/serving_h200.md
        return linear_fp32_input(h, params["head"]), h

    return rowwise(head, carry["streams"], carry.get("premix"))
