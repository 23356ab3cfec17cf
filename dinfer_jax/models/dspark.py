"""DeepSeek-V4.1 DSpark drafter (``docs/spec/model-v41.md`` §3.8; DeepInfer class ``DFlash``): the ``mtp.0..2`` draft
layers.

Two stages, as in DeepInfer's ``DFlash.update_main_cache`` and ``DFlash.run_drafts``:

* :func:`main_keys`: every target token's features ``F`` (the V4.1 forward's ``dspark_features``: the mean over the
  mHC streams of the trunk entering each target layer's attention) become one SWA key per draft layer,
  ``K_i = Q8(rope_main(rms(m · wkv_iᵀ; kv_norm_i), pos))`` with ``m = rms(F · main_projᵀ; main_norm)``. DeepInfer
  writes these into each draft layer's own SWA ring through the same fused norm → RoPE → e4m3/UE8M0-per-32 cast as the
  target's SWA keys, so they are Q8 fake-quantised exactly when ``cfg.kv_fake_quant`` is set.
* :func:`draft_block`: one block of ``dspark_block_size`` rows after the last accepted position ``a``, at positions
  ``a+1 … a+block`` with tokens ``[golden, noise, …]``; three full shifted-mHC blocks (first one expanded from the
  embedding with the one-hot pre-mix, like the backbone's layer 0) whose attention keys are, for *every* row, the
  draft layer's main keys at positions ``a−W+1 … a`` (those ≥ 0) plus all ``block`` draft keys (bidirectional in the
  block; DeepInfer's ``get_fused_dflash_get_input_ref`` builds exactly this one ``W + block`` index list per request
  and shares it across the block's rows). Main RoPE (``rope_theta``, no YaRN), sink, no compressed KV, MoE with
  ``dspark_n_routed_experts`` experts top-``dspark_num_experts_per_tok``. After the last layer: HC post, then the
  collapse with that layer's FFN pre-mix → ``h`` (DeepInfer ``hidden_states_before_norm``).
  Heads (:func:`dspark_heads`, parameters of the last ``mtp`` block) — DeepInfer ``DFlash.sample_drafts``:
  ``logits_i = rms(h_i; norm) · headᵀ`` (fp32); then for i = 0 … block−1 in order, with ``t_{−1} = golden``:
  ``e_i = markov_embed[t_{i−1}]``, ``logits_i += e_i · markov_headᵀ`` (fp32 accumulation),
  ``c_i = sigmoid(clamp(([h_i ; e_i] · w_confᵀ) / T_i, ±60))`` on the **un-normalised** ``h_i`` and the **same**
  ``e_i`` the Markov term used (so row 0 uses the golden token's row), and ``t_i = sample(logits_i)`` (greedy argmax
  by default). Row i predicts the token at position ``a + 2 + i``.

Everything is a pure function of arrays with the config (and sampling hook) static; the ``*_jit`` wrappers are the
compiled entry points. :func:`draft_after_prefix` runs the target on a prompt and drafts the next block (notebooks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.attention import RopeTable, attend, output_projection, query_and_window_kv, rope_tables
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.fake_quant import maybe_fake_quant, q8_fake
from dinfer_jax.models.mhc import hc_collapse, hc_mixes, hc_post
from dinfer_jax.models.moe import EP_IMPLS, moe
from dinfer_jax.models.ops import F32, apply_rope_tail, linear, rms_norm
from dinfer_jax.models.v41 import embed_tokens

# DeepInfer clamps every confidence-head temperature to at least ``SAMPLING_EPS`` (deepinfer/sampling_params.py).
SAMPLING_EPS = 1e-5
CONFIDENCE_CLAMP = 60.0

# sample_fn(logits_i [B,V] fp32, step i) -> tokens [B] int32
SampleFn = Callable[[jax.Array, int], jax.Array]


class DraftOutput(NamedTuple):
    """One drafted block. ``logits [B,blk,V]`` fp32 (base head + Markov term), ``confidences [B,blk]`` fp32,
    ``tokens [B,blk]`` int32 (row i = the draft for position a+2+i), ``hidden [B,blk,D]`` (the pre-norm ``h`` the
    heads read, model dtype)."""

    logits: jax.Array
    confidences: jax.Array
    tokens: jax.Array
    hidden: jax.Array


def _q8(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Q8 (e4m3, UE8M0 per 32) as for the target's SWA keys (skipped for widths that are not block multiples)."""
    return maybe_fake_quant(cfg.kv_fake_quant, q8_fake, x, 32)


def _main_rope(cfg: ModelConfig, positions: jax.Array) -> RopeTable:
    """Main RoPE (``rope_theta``, no YaRN) cos/sin ``[..., r/2]`` for ``positions`` of any shape."""
    return rope_tables(cfg, positions)["main"][1]


def _hc_kw(cfg: ModelConfig) -> dict[str, Any]:
    return dict(hc_mult=cfg.hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)


# --- main keys ----------------------------------------------------------------------------------------------------


def main_keys(params: Mapping[str, Any], cfg: ModelConfig, features: jax.Array, positions: jax.Array,
              dtype: Any = None) -> jax.Array:
    """Every draft layer's SWA key for target tokens.

    params: the full parameter tree (uses ``params["mtp"][0]["main_proj"/"main_norm"]`` and each
    ``params["mtp"][i]["attn"]["wkv"/"kv_norm"]``). features ``[B,P,n_targets·D]`` (``dspark_features``);
    positions ``[P]`` or ``[B,P]`` int (absolute positions of the feature rows). dtype: activation dtype (default:
    the features' dtype). Returns ``[n_draft, B, P, d]`` in that dtype:
    ``K_i = Q8(rope_main(rms(rms(F·main_projᵀ; main_norm) · wkv_iᵀ; kv_norm_i), pos))`` (Q8 iff
    ``cfg.kv_fake_quant``).
    """
    dt = jnp.dtype(dtype) if dtype is not None else features.dtype
    mtp = params["mtp"]
    f = features.astype(dt)
    m = rms_norm(linear(f, mtp[0]["main_proj"]), mtp[0]["main_norm"], cfg.norm_eps)  # [B,P,D]
    rope = _main_rope(cfg, jnp.asarray(positions))
    keys = []
    for blk in mtp:
        a = blk["attn"]
        k = rms_norm(linear(m, a["wkv"]), a["kv_norm"], cfg.norm_eps)
        keys.append(_q8(cfg, apply_rope_tail(k, rope.cos, rope.sin)))
    return jnp.stack(keys)


# --- draft layers -------------------------------------------------------------------------------------------------


def block_positions(anchor_pos: jax.Array, window: int, block: int) -> tuple[jax.Array, jax.Array]:
    """Positions of a draft block after ``anchor_pos [B]`` = a: ``(rows [B,block] = a+1 … a+block,
    keys [B, window+block] = a−window+1 … a+block with −1 for negative positions)`` — the key list that every row
    of the block attends to (DeepInfer ``get_fused_dflash_get_input_ref``'s ``kv_index``, as positions)."""
    a = jnp.asarray(anchor_pos, jnp.int32)[:, None]
    rows = a + 1 + jnp.arange(block, dtype=jnp.int32)[None, :]
    keys = a - window + 1 + jnp.arange(window + block, dtype=jnp.int32)[None, :]
    return rows, jnp.where(keys >= 0, keys, -1)


def window_keys(keys: jax.Array, anchor_pos: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """The main keys a draft block reads: positions ``a−W+1 … a`` (the first W entries of :func:`block_positions`).

    keys ``[B,P,d]`` indexed by absolute position; anchor_pos ``[B]``. Returns ``(keys [B,W,d], valid [B,W] bool)``;
    slots at negative positions (start of a sequence) or beyond P are invalid (they hold position 0's key, masked).
    """
    P = keys.shape[1]
    idx = block_positions(anchor_pos, window, 0)[1]  # [B,W]
    valid = (idx >= 0) & (idx < P)
    got = jnp.take_along_axis(keys, jnp.clip(idx, 0, P - 1)[..., None], axis=1)
    return got, valid


def draft_attention(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig, positions: jax.Array,
                    win_keys: jax.Array, win_valid: jax.Array) -> jax.Array:
    """One draft layer's attention sublayer.

    h ``[B,blk,D]`` (attn-normed); positions ``[B,blk]`` (a+1 … a+blk per row); win_keys ``[B,W,d]`` / win_valid
    ``[B,W]`` from :func:`window_keys`. Queries and draft keys use the main RoPE; draft keys are Q8 like any SWA key.
    Every row sees the valid window keys and all ``blk`` draft keys; per-head sink. Returns ``[B,blk,D]``.
    """
    blk = h.shape[1]

    def one(hb: jax.Array, pos: jax.Array, kw: jax.Array, vw: jax.Array) -> jax.Array:
        rope = _main_rope(cfg, pos)
        _, q, kv = query_and_window_kv(p, hb[None], cfg=cfg, rope=rope)
        kv = _q8(cfg, kv)
        keys = jnp.concatenate([kw[None].astype(kv.dtype), kv], axis=1)  # [1, W+blk, d]
        mask = jnp.concatenate([jnp.broadcast_to(vw[None, :], (blk, vw.shape[0])), jnp.ones((blk, blk), bool)], 1)
        o = attend(q, keys, mask, None, None, p["attn_sink"])
        return output_projection(p, o, cfg=cfg, rope=rope)[0]

    return jax.vmap(one)(h, positions, win_keys, win_valid)


def block_input_ids(cfg: ModelConfig, golden: jax.Array) -> jax.Array:
    """The block's input ids ``[B,blk]`` int32: ``[golden, noise × (blk−1)]`` (DeepInfer
    ``DFlash._embed_draft_init_tokens``)."""
    golden = jnp.asarray(golden, jnp.int32)
    ids = jnp.full((golden.shape[0], cfg.dspark_block_size), cfg.dspark_noise_token_id, jnp.int32)
    return ids.at[:, 0].set(golden)


def draft_hidden(params: Mapping[str, Any], cfg: ModelConfig, keys: jax.Array, anchor_pos: jax.Array,
                 golden: jax.Array, *, dtype: Any = None, block_tokens: jax.Array | None = None,
                 moe_impl: str = "auto", window: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The draft layers: ``h [B,blk,D]`` (model dtype) before the heads' norm.

    keys ``[n_draft,B,P,d]`` from :func:`main_keys` (indexed by absolute position; entries after ``a`` are never
    read); anchor_pos ``[B]`` int = a, the last accepted position (its features must be in ``keys``); golden ``[B]``
    int = the token at a+1. block_tokens ``[B,blk]`` overrides the block's input ids (default
    ``[golden, noise × (blk−1)]``). window: the window keys already gathered, ``(keys [n_draft,B,W,d], valid
    [B,W])`` for positions a−W+1 … a (the serving engine reads them from its per-slot rings; ``keys`` is then
    unused).
    """
    dt = jnp.dtype(dtype) if dtype is not None else params["embed"].dtype
    blk, n, W = cfg.dspark_block_size, cfg.hc_mult, cfg.sliding_window
    anchor_pos = jnp.asarray(anchor_pos, jnp.int32)
    golden = jnp.asarray(golden, jnp.int32)
    B = golden.shape[0]
    if block_tokens is None:
        block_tokens = block_input_ids(cfg, golden)
    positions = block_positions(anchor_pos, W, blk)[0]  # [B,blk]
    x = embed_tokens(params, block_tokens, dt, None, None)
    streams = jnp.broadcast_to(x[:, :, None, :], (B, blk, n, cfg.hidden_size))
    premix = jnp.broadcast_to(jax.nn.one_hot(0, n, dtype=F32), (B, blk, n))
    kw = _hc_kw(cfg)
    for i, p in enumerate(params["mtp"]):
        wk, wv = window_keys(keys[i], anchor_pos, W) if window is None else (window[0][i], window[1])
        pre_a, post_a, comb_a = hc_mixes(streams, p["hc_attn"], **kw)
        u = rms_norm(hc_collapse(streams, premix), p["attn_norm"], cfg.norm_eps)
        a = draft_attention(p["attn"], u, cfg=cfg, positions=positions, win_keys=wk, win_valid=wv)
        streams = hc_post(streams, a, post_a, comb_a)
        premix, post_f, comb_f = hc_mixes(streams, p["hc_ffn"], **kw)
        y = rms_norm(hc_collapse(streams, pre_a), p["ffn_norm"], cfg.norm_eps)
        # The draft layers get no sharder: a mesh model's expert-parallel impl runs here as "dense" (as before EP).
        mo, _ = moe(p["ffn"], y, None, cfg=cfg, hash_routed=False,
                    impl="dense" if moe_impl in EP_IMPLS else moe_impl, top_k=cfg.dspark_num_experts_per_tok)
        streams = hc_post(streams, mo, post_f, comb_f)
    return hc_collapse(streams, premix)


# --- heads --------------------------------------------------------------------------------------------------------


def _temperature(temperature: float | Sequence[float], step: int) -> float:
    t = temperature[step] if isinstance(temperature, (tuple, list)) else temperature
    return max(float(t), SAMPLING_EPS)


def confidence_head(hidden: jax.Array, markov_emb: jax.Array, w_conf: jax.Array, temperature: float) -> jax.Array:
    """``sigmoid(clamp(([hidden ; markov_emb] · w_confᵀ) / T, ±60))`` → fp32 ``[...]``.

    hidden ``[..., D]`` (pre-norm h), markov_emb ``[..., r]``, w_conf ``[1, D+r]``. Like DeepInfer, the weight is
    rounded to bf16 (``DFlash.__init__`` passes ``proj.weight.to(bfloat16)``) and the dot is fp32
    (``confidence_head_fused_ref``: ``features.float() @ weight.float()``); sigmoid as ``1 / (1 + exp(−z))``.
    """
    feats = jnp.concatenate([hidden.astype(F32), markov_emb.astype(F32)], axis=-1)
    w = w_conf.astype(jnp.bfloat16).astype(F32).reshape(-1)
    z = jnp.einsum("...i,i->...", feats, w, precision=jax.lax.Precision.HIGHEST)
    z = jnp.clip(z / max(float(temperature), SAMPLING_EPS), -CONFIDENCE_CLAMP, CONFIDENCE_CLAMP)
    return 1.0 / (1.0 + jnp.exp(-z))


def greedy(logits: jax.Array, step: int) -> jax.Array:
    """Default draft sampler: argmax (lowest index on ties), int32 ``[B]``."""
    del step
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def dspark_heads(params: Mapping[str, Any], cfg: ModelConfig, h: jax.Array, golden: jax.Array, *,
                 temperature: float | Sequence[float] = 1.0,
                 sample_fn: SampleFn | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Base head, sequential Markov correction, confidence and sampling on ``h [B,blk,D]``.

    Uses the shared ``params["head"]`` and the last mtp block's ``norm``, ``markov_embed``, ``markov_head``,
    ``confidence_proj``. temperature: confidence-head T (one float, or one per step; clamped ≥ 1e−5).
    sample_fn(logits_i [B,V] fp32, i) → [B] int32 (default :func:`greedy`); it must be jit-traceable, and its draw
    is what the next row's Markov embedding reads. Returns ``(logits [B,blk,V] fp32, confidences [B,blk] fp32,
    tokens [B,blk] int32)``.
    """
    last = params["mtp"][-1]
    sample = sample_fn or greedy
    y = rms_norm(h, last["norm"], cfg.norm_eps, out_dtype=F32)
    base = linear(y, params["head"])  # [B,blk,V]
    prev = jnp.asarray(golden, jnp.int32)
    logits, confs, toks = [], [], []
    for i in range(h.shape[1]):
        e = last["markov_embed"][prev]  # [B,r] (model dtype)
        li = base[:, i] + linear(e, last["markov_head"], F32)
        confs.append(confidence_head(h[:, i], e, last["confidence_proj"], _temperature(temperature, i)))
        prev = sample(li, i).astype(jnp.int32)
        logits.append(li)
        toks.append(prev)
    return jnp.stack(logits, 1), jnp.stack(confs, 1), jnp.stack(toks, 1)


def draft_block(params: Mapping[str, Any], cfg: ModelConfig, main_keys: jax.Array, anchor_pos: jax.Array,
                golden: jax.Array, *, dtype: Any = None, temperature: float | Sequence[float] = 1.0,
                sample_fn: SampleFn | None = None, block_tokens: jax.Array | None = None,
                moe_impl: str = "auto") -> DraftOutput:
    """One DSpark draft block after the last accepted position ``a`` (see the module docstring).

    main_keys ``[n_draft,B,P,d]`` (:func:`main_keys` at positions 0…P−1, P > max a); anchor_pos ``[B]`` int;
    golden ``[B]`` int (the token the target sampled for a+1). Returns :class:`DraftOutput`.
    """
    h = draft_hidden(params, cfg, main_keys, anchor_pos, golden, dtype=dtype, block_tokens=block_tokens,
                     moe_impl=moe_impl)
    logits, confs, toks = dspark_heads(params, cfg, h, golden, temperature=temperature, sample_fn=sample_fn)
    return DraftOutput(logits, confs, toks, h)


main_keys_jit = jax.jit(main_keys, static_argnames=("cfg", "dtype"))
draft_block_jit = jax.jit(draft_block, static_argnames=("cfg", "dtype", "temperature", "sample_fn", "moe_impl"))


# --- convenience ----------------------------------------------------------------------------------------------------


class PrefixDraft(NamedTuple):
    """:func:`draft_after_prefix` result: ``draft`` (:class:`DraftOutput`), ``golden [B]`` int32, ``anchor_pos [B]``
    int32 (= length − 1), ``target`` (the target's :class:`~dinfer_jax.models.v4.ForwardOutput`: logits
    ``[B,S,V]`` fp32, intermediates with ``dspark_features [B,S,n_targets·D]``), ``main_keys [n_draft,B,S,d]``."""

    draft: DraftOutput
    golden: jax.Array
    anchor_pos: jax.Array
    target: Any
    main_keys: jax.Array


def draft_after_prefix(model_or_params: Any, cfg: ModelConfig | None, token_ids: Any, *,
                       lengths: Any = None, dtype: str | None = None, temperature: float | Sequence[float] = 1.0,
                       sample_fn: SampleFn | None = None, collect: bool = False) -> PrefixDraft:
    """Run the target on ``token_ids [B,S]`` (positions 0…S−1), take golden = argmax of the logits at the last
    prompt position a = length−1 (``lengths [B]``, default S; right padding beyond a row's length is harmless since
    the target is causal) and draft the next block from the target features.

    model_or_params: a :class:`dinfer_jax.models.Model` (cfg may be None) or a parameter tree with ``cfg`` and
    ``dtype`` (configs with Engram layers need a Model, which carries the host-side tables). ``collect`` keeps the
    target's per-layer intermediates (``run(..., collect=True)``). ``temperature`` must be a float or a tuple (it is
    a static argument of the compiled draft).
    """
    from dinfer_jax.models import Model, run

    if isinstance(model_or_params, Model):
        model = model_or_params
    else:
        if cfg is None:
            raise ValueError("draft_after_prefix: pass cfg with a bare parameter tree")
        if cfg.engram_layer_ids:
            raise ValueError("a config with Engram layers needs a Model (host-side Engram tables)")
        model = Model(cfg, model_or_params, dtype or "float32")
    cfg = model.config
    temperature = tuple(map(float, temperature)) if isinstance(temperature, (list, tuple)) else float(temperature)
    if not cfg.is_v41 or not cfg.n_mtp_layers or not model.params.get("mtp"):
        raise ValueError("draft_after_prefix needs a V4.1 model with DSpark (mtp) parameters")
    ids = np.asarray(token_ids)
    B, S = ids.shape
    lens = np.full((B,), S, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lens.shape != (B,) or (lens < 1).any() or (lens > S).any():
        raise ValueError(f"lengths must be [B] in [1, {S}], got {lens}")
    out = run(model, ids, collect=collect)
    features = out.intermediates["dspark_features"]
    anchor = jnp.asarray(lens - 1)
    golden = jnp.argmax(out.logits[jnp.arange(B), anchor], axis=-1).astype(jnp.int32)
    keys = main_keys_jit(model.params, cfg, features, jnp.arange(S), dtype=model.dtype)
    # block_tokens passed explicitly: the same compiled function serves calls that override them.
    draft = draft_block_jit(model.params, cfg, keys, anchor, golden, dtype=model.dtype, temperature=temperature,
                            sample_fn=sample_fn, block_tokens=block_input_ids(cfg, golden), moe_impl=model.moe_impl)
    return PrefixDraft(draft, golden, anchor, out, keys)


__all__ = ["DraftOutput", "PrefixDraft", "block_input_ids", "block_positions", "confidence_head", "draft_after_prefix",
           "draft_attention", "draft_block", "draft_block_jit", "draft_hidden", "dspark_heads", "greedy", "main_keys",
           "main_keys_jit", "window_keys"]
