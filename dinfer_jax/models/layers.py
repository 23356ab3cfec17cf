"""The one layer function per family, over cached state: V4 (:func:`layer_v4`) and V4.1 (:func:`layer_v41`).

A layer processes ``B`` rows of ``Q`` query tokens (:class:`StepInput`) against its cache: the window of raw KV
rows (the slot's SWA ring plus this step's rows), the compressed rows closed so far (this step's new rows
included) and the indexer's top-k among them. The full-sequence forward is the same function on a fresh cache with
every row starting at position 0 (see :mod:`dinfer_jax.models.backbone`), so there is one implementation of the
layer math for the reference forward, prefill and decode.

Cache arrays carry a leading layer axis (scan repeats); ``k`` picks this layer's entry. What crosses layers travels
in ``carry`` (a dict): ``streams [B,Q,n,D]``, V4.1 ``premix [B,Q,n]`` and, from V4.1 source layers to the layers
after them, ``kv [B,T,d]`` (compressed KV of the latest KV source), ``ik [B,T,di]`` (latest index keys),
``selected [B,Q,T]`` (latest index source's top-k) and ``candidates [B,Q,T]`` (candidate blocks). "Latest" is
exactly the config's nearest-source-at-or-before rule (``cfg.kv_source`` etc.).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dinfer_jax.models.attention import (
    KERNEL_IMPLS,
    RopeTable,
    attend,
    attend_selected,
    attend_selected_pooled,
    index_impl,
    index_operands_fp4,
    index_queries,
    index_scores_of,
    index_scores_paged,
    index_scores_stored,
    output_projection,
    pooled_kernel_pays,
    query_heads,
    query_latent,
    selected_attention_impl,
    use_selected_rows,
    window_kv,
)
from dinfer_jax.models.attention_invariant import attend_invariant, window_rows
from dinfer_jax.models.cache_codec import RowCodec, cache_codecs
from dinfer_jax.models.cache_io import (
    buffer_take,
    closing_groups,
    pages_gather,
    pages_read,
    pages_write,
    pool_rows,
    ring_positions,
    ring_read,
    ring_write,
    stored_rows,
    take_rows,
)
from dinfer_jax.models.config import ATTN_CSA, ATTN_SLIDING, ModelConfig
from dinfer_jax.models.cp_rows import cp_tokenwise, group_tokenwise
from dinfer_jax.models.csa2 import candidate_blocks, topk_select
from dinfer_jax.models.engram import engram_gate
from dinfer_jax.models.eplb import expert_loads
from dinfer_jax.models.fake_quant import hadamard, maybe_fake_quant, q8_fake
from dinfer_jax.models.invariant import active_tile, invariant_tracing, ordered_sum, rowwise
from dinfer_jax.models.layer_plan import LayerInfo
from dinfer_jax.models.mhc import hc_collapse, hc_mixes, hc_post, hc_pre
from dinfer_jax.models.moe import moe, route
from dinfer_jax.models.ops import F32, apply_rope_tail, linear_f32, rms_norm, rope_cos_sin
from dinfer_jax.models.step_state import LayerCache, StepInput
from dinfer_jax.models.v41 import source_rows
from sharding.rules import Sharder, constrain

NEG_INF = -jnp.inf
Carry = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """Static switches: MoE implementation, mesh sharder, whether layers emit per-layer intermediates."""

    moe_impl: str = "auto"
    sharder: Sharder | None = None
    collect: bool = False
    ep_manual: int = 0  # EP group size when running per device inside a shard_map (DP engines); 0 = not
    cp_manual: int = 0  # CP group size there: the MoE of prefill rows runs on each rank's mirrored share
    copies_manual: int = 1  # copies of each engine there (ep > dp·cp): the MoE tokens are split over them
    # compressed rows a query attends: "auto" gathers its top-k rows when that reads less than masking all of them
    # (decode at long context), "sparse" / "dense" force one way (attention.use_selected_rows)
    attention: str = "auto"
    # how the gathered rows are attended: "auto" (the Mosaic GPU decode kernel where it runs, else XLA), "jnp",
    # "pallas", "pallas_gather" (the kernel also fetches the selected rows from the cache)
    # (attention.selected_attention_impl)
    attention_impl: str = "auto"
    # the mHC Sinkhorn: "auto" (the Mosaic GPU kernel on a GPU, XLA elsewhere), "jnp" or "pallas" (mhc.sinkhorn)
    mhc_impl: str = "auto"
    # every MoE sublayer reports aux["expert_loads"] [E] int32: this step's real tokens per logical expert (EPLB)
    count_experts: bool = False
    # V4.1 YOCO "compact" on a prefill step whose rows all lie below their kept suffix: the YOCO region only writes
    # its KV sources' compressed rows (layer_v41_region_sources); attention, MoE and window rings are skipped
    yoco_skip: bool = False


class StepContext(NamedTuple):
    """Per-step values every layer reads: the input, query positions ``[B,Q]``, RoPE ``{compressed: (inv_freq,
    table)}``, V4.1 Engram rows ``[n_engram,B,Q,E_in]`` and the layer → Engram row table ``[L]`` (−1: none)."""

    inp: StepInput
    pos: jax.Array
    ropes: dict[bool, tuple[Any, RopeTable]]
    engram: jax.Array | None = None
    engram_index: jax.Array | None = None


def _hc_kw(cfg: ModelConfig, mhc_impl: str = "auto") -> dict[str, Any]:
    return dict(hc_mult=cfg.hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps,
                impl=mhc_impl)


def _real_queries(inp: StepInput, Q: int) -> jax.Array:
    """``[B, Q]`` bool: the step's real query positions (``j < n``). Padding positions see no key at all: their
    positions run past the row's written cache, and a stale entry seen by any query of a row would stay in the
    row's weighted sums (``attention._visible_rows``), where a zero weight times a non-finite value is not zero."""
    return jnp.arange(Q)[None, :] < inp.n[:, None]


def _window(swa: jax.Array, k: jax.Array, kv: jax.Array, inp: StepInput, pos: jax.Array, W: int,
            floor: jax.Array | None, codec: RowCodec | None = None,
            stored: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Window keys ``[B, W+Q, d]`` (ring then this step's rows), their mask ``[B,Q,W+Q]``, updated ring.
    ``floor [B]`` hides keys below a position (YOCO mask). With a byte ``codec`` the ring holds ``stored`` (this
    step's rows packed, ``[B,Q,row_bytes]``) and is decoded on read; ``kv`` are the same rows' values."""
    ring = ring_read(swa, k, inp.slot)
    if codec is not None:
        ring = codec.unpack(ring)
    rpos = ring_positions(inp.start, ring.shape[1])  # ring may hold W + backtracking entries
    keys = jnp.concatenate([ring.astype(kv.dtype), kv], axis=1)
    kpos = jnp.concatenate([rpos, pos], axis=1)
    Q = pos.shape[1]
    kvalid = jnp.concatenate([rpos >= 0, jnp.arange(Q)[None, :] < inp.n[:, None]], axis=1)
    mask = kvalid[:, None, :] & (kpos[:, None, :] <= pos[:, :, None]) & (kpos[:, None, :] > pos[:, :, None] - W)
    mask = mask & _real_queries(inp, Q)[:, :, None]
    if floor is not None:
        mask = mask & (kpos[:, None, :] >= floor[:, None, None])
    return keys, mask, ring_write(swa, k, inp.slot, pos, inp.n, kv if stored is None else stored)


# ---------------------------------------------------------------------------------------------------------------
# compressors over (ring state + this step's tokens)


def _pool(values: jax.Array, scores: jax.Array) -> jax.Array:
    """Softmax-gated pooling of a compression group: ``Σ_t v[..., t, :] · softmax_t(s)[..., t, :]`` over axis 2 of
    ``[B, W, t, C]`` (batch-invariantly as chains of adds: XLA reduces a middle axis in an order that can follow
    the array's shape)."""
    if invariant_tracing():
        s = scores - jnp.max(scores, axis=2, keepdims=True)   # the max is exact in any order
        e = jnp.exp(s)
        return ordered_sum(values * (e / ordered_sum(e, 2)[:, :, None]), 2)
    return jnp.sum(values * jax.nn.softmax(scores, axis=2), axis=2)


def compress_v4(p: Any, h: jax.Array, st_kv: jax.Array, st_gate: jax.Array, start: jax.Array, n: jax.Array, *,
                ratio: int, dim: int, overlap: bool, inv_freq: Any,
                norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """V4 compressor. h ``[B,Q,D]``; st_* ``[B,Sm,coff·dim]`` (the row's slot ring, gate incl. APE).

    Returns ``(rows [B,W,dim] fp32, w [B,W], valid [B,W], kv [B,Q,coff·dim], gate [B,Q,coff·dim])`` — the
    projections of this step's tokens, for the caller to write into the ring. Row w pools tokens
    ``[w·m, (w+1)·m)`` (overlap: plus the first half-channels of window w−1) with RoPE at position ``w·m``.
    """
    B, Q, _ = h.shape
    pos = start[:, None] + jnp.arange(Q)[None, :]

    def project(h: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        hf = h.astype(F32)
        return linear_f32(hf, p["wkv"]), linear_f32(hf, p["wgate"]) + p["ape"].astype(F32)[jnp.mod(pos, ratio)]

    kv, gate = rowwise(project, h, pos)
    w, valid = closing_groups(start, n, ratio, Q)
    if overlap:
        tok = w[..., None] * ratio - ratio + jnp.arange(2 * ratio)  # [B,W,2m]
        kv_t, g_t = buffer_take(st_kv, kv, start, tok), buffer_take(st_gate, gate, start, tok)
        first = jnp.arange(2 * ratio) < ratio
        kv_sel = jnp.where(first[:, None], kv_t[..., :dim], kv_t[..., dim:])
        g_sel = jnp.where(first[:, None], g_t[..., :dim], g_t[..., dim:])
        before_start = (tok < 0)[..., None]
        kv_sel = jnp.where(before_start, 0.0, kv_sel)
        g_sel = jnp.where(before_start, NEG_INF, g_sel)
    else:
        tok = w[..., None] * ratio + jnp.arange(ratio)
        kv_sel, g_sel = buffer_take(st_kv, kv, start, tok), buffer_take(st_gate, gate, start, tok)

    def pool_row(kv_sel: jax.Array, g_sel: jax.Array, first_pos: jax.Array) -> jax.Array:
        pooled = rms_norm(_pool(kv_sel, g_sel), p["norm"], norm_eps, out_dtype=F32)
        cos, sin = rope_cos_sin(first_pos, inv_freq)
        return apply_rope_tail(pooled, cos, sin)

    return rowwise(pool_row, kv_sel, g_sel, w * ratio), w, valid, kv, gate


def compress_v41(p: Any, h: jax.Array, lc: LayerCache, k: jax.Array, inp: StepInput, *,
                 ratio: int) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """V4.1 CSA2 compressor: groups of ``ratio`` ∈ {1, 2} tokens, softmax-gated (ratio 2), no overlap/APE.

    Returns ``(latent [B,W,d] fp32 pre-norm, w [B,W], valid [B,W], ring updates)``.
    """
    B, Q, _ = h.shape
    pos = inp.positions()
    w, valid = closing_groups(inp.start, inp.n, ratio, Q)
    if ratio == 1:
        return rowwise(lambda h: linear_f32(h, p["wkv"]), h), w[:, :Q], valid[:, :Q], {}
    latent, score = rowwise(lambda h: (linear_f32(h, p["wkv"]), linear_f32(h, p["wgate"])), h)
    tok = w[..., None] * ratio + jnp.arange(ratio)
    lat_t = buffer_take(ring_read(lc.cst_latent, k, inp.slot), latent, inp.start, tok)
    sc_t = buffer_take(ring_read(lc.cst_score, k, inp.slot), score, inp.start, tok)
    pooled = rowwise(_pool, lat_t, sc_t)
    updates = {"cst_latent": ring_write(lc.cst_latent, k, inp.slot, pos, inp.n, latent),
               "cst_score": ring_write(lc.cst_score, k, inp.slot, pos, inp.n, score)}
    return pooled, w, valid, updates


# ---------------------------------------------------------------------------------------------------------------
# attention sublayers


def _query_windows(keys: jax.Array, wmask: jax.Array, start: jax.Array, pos: jax.Array, chunk: int,
                   cfg: ModelConfig, per_query: bool) -> tuple[jax.Array, jax.Array]:
    """The window keys as attention reads them for queries at ``pos [B,Qq]`` (the step's ``chunk`` rows, or a CP
    rank's share of them) with their mask rows ``wmask [B,Qq,R+chunk]``: shared by the queries (``keys [B,R+chunk,
    d]`` as :func:`_window` builds them) while the step has at most ``W`` rows, else — or with ``per_query`` — each
    query's own ``W`` keys in position order (``[B,Qq,W,d]``, ``[B,Qq,W]``;
    :func:`~dinfer_jax.models.attention_invariant.window_rows`). A prefill chunk of ``Q`` tokens then costs
    ``Q·W`` window products instead of ``Q·(R+Q)``; the visible set, hence the result up to the order of fp32
    additions, is the same."""
    if per_query or chunk > cfg.sliding_window:
        return window_rows(keys, wmask, start, pos, cfg.sliding_window, ring=keys.shape[1] - chunk)
    return keys, wmask


def _cp_selection(index_select: Callable[..., dict[str, jax.Array]], iq: jax.Array, extras: tuple[Any, ...],
                  inp: StepInput, opts: LayerOptions, idx_key: str) -> dict[str, jax.Array]:
    """The indexer's selection (``index_select(iq, *extras)``: top-k indices, masks, candidates) computed by each CP
    rank for its mirrored query rows and all-gathered into row order; the ``[B,Q,T]`` scores are left out (only
    ``collect`` reads them, and a step that collects is not split). Padding queries get no selection (−1)."""
    def local(*a: Any) -> dict[str, jax.Array]:
        return {k: v for k, v in index_select(*a).items() if k != "scores"}

    sel = _on_queries(local, iq, extras, inp, opts)
    real = _real_queries(inp, iq.shape[1])
    return {**sel, idx_key: jnp.where(real[..., None], sel[idx_key], -1)}


def _split_over_cp(num_queries: int, opts: LayerOptions) -> bool:
    """Whether this step's attention runs on each CP rank's mirrored query rows (prefill rows, ``num_queries``
    > 1 a row, inside the DP engines' per-device step; DeepInfer uses CP for prefill only)."""
    return opts.cp_manual > 1 and num_queries > 1 and not opts.collect and not active_tile()


QueryMap = Callable[[jax.Array, jax.Array], jax.Array]


def _query_source(p: Any, t: dict[str, jax.Array], inv_freq: Any, cfg: ModelConfig,
                  opts: LayerOptions) -> tuple[jax.Array, QueryMap | None]:
    """Where the attention core's queries come from: ``(t["q"] [B,Q,H,d], None)``, or on a step split over CP
    (whose ``t`` holds only the latent ``cq [B,Q,q_lora]``: :func:`_queries` with ``defer_queries``)
    ``(t["cq"], q_of)``, ``q_of(cq, pos)`` giving the query heads of a CP rank's rows at positions ``pos`` — so the
    ``wq_b`` products (``q_lora · H · d`` a token, V4-Flash's largest attention projection) are split over the
    ranks as the attention core is."""
    if "q" in t:
        return constrain(opts.sharder, t["q"], ("act_batch", "act_seq", "act_heads", None)), None

    def q_of(cq: jax.Array, pos: jax.Array) -> jax.Array:
        return query_heads(p, cq, cfg=cfg, rope=RopeTable(*rope_cos_sin(pos, inv_freq)))

    return t["cq"], q_of


def _query_like(q: jax.Array, q_of: QueryMap | None, pos: jax.Array) -> Any:
    """The queries' shape and dtype (``[B,Q,H,d]``) for static choices: ``q`` itself, or ``q_of(q, pos)``'s."""
    return q if q_of is None else jax.eval_shape(q_of, q, pos)


def _index_select_of_latent(select: Callable[..., dict[str, jax.Array]], p: Any, cfg: ModelConfig,
                            inv_freq: Any) -> Callable[..., dict[str, jax.Array]]:
    """``select(iq, iw, pos, *rest)`` as a function of ``(cq, h, pos, *rest)``: the indexer's queries and head
    weights (:func:`~dinfer_jax.models.attention.index_queries`) computed from the rows given (a CP rank's)."""
    def run(cq: jax.Array, h: jax.Array, pos: jax.Array, *rest: Any) -> dict[str, jax.Array]:
        iq, iw = index_queries(p["indexer"], h, cq, cfg=cfg, rope=RopeTable(*rope_cos_sin(pos, inv_freq)))
        return select(iq, iw, pos, *rest)

    return run


def _on_queries(fn: Callable[..., Any], q: jax.Array, extras: tuple[Any, ...], inp: StepInput,
                opts: LayerOptions, project: Callable[[jax.Array, jax.Array], jax.Array] | None = None) -> Any:
    """``fn(q, *extras)`` for a function of each query row separately (``[B,Q,...]`` in and out): on this CP
    rank's mirrored rows, all-gathered, when the step is split over CP (:func:`_split_over_cp`), else directly.
    ``project(y, pos)`` (``pos = extras[0]``, the rows' positions), when given, is applied on the rank's rows before
    the all-gather, and only when the step is split (the caller projects otherwise)."""
    if _split_over_cp(q.shape[1], opts):
        if project is not None:
            def projected(q: jax.Array, pos: jax.Array, *rest: Any) -> jax.Array:
                return project(fn(q, pos, *rest), pos)

            return cp_tokenwise(projected, q, extras, inp.n, opts.cp_manual)
        return cp_tokenwise(fn, q, extras, inp.n, opts.cp_manual)
    return fn(q, *extras)


def kernel_reads(codec: RowCodec, stored: jax.Array, q: jax.Array) -> bool:
    """Whether the decode kernel can read rows stored as ``stored`` by ``codec`` itself (``attention_impl=
    "pallas_gather"``): plain rows in the queries' dtype (V4's exact cache) or ``v41_fp4`` bytes (V4.1's compressed
    KV, decoded in the kernel)."""
    if codec.fmt is None:
        return stored.dtype == q.dtype
    return codec.fmt == "v41_fp4" and q.dtype == jnp.bfloat16


def _attend_rows(q: jax.Array, keys: jax.Array, wmask: jax.Array, rows_of: Callable[[jax.Array], jax.Array],
                 idx: jax.Array, sink: jax.Array, ctx: StepContext, cfg: ModelConfig,
                 opts: LayerOptions, pool_rows_of: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None,
                 project: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                 q_of: QueryMap | None = None) -> jax.Array:
    """Attention over the window and each query's selected compressed rows ``rows_of(idx)`` (``idx [B,Q,k]``, −1:
    none; the gather and decode of the rows happen here, so a CP rank gathers only its queries' rows),
    batch-invariantly when tracing so. The decode kernel reads each query's own window (``W`` rows instead of the
    ring's ``R`` plus the step's). With CP on a prefill step each rank attends its mirrored query rows and the
    outputs are all-gathered (:func:`~dinfer_jax.models.cp_rows.cp_tokenwise`). ``pool_rows_of(idx)``: where the
    rows are stored as the kernel reads them, ``(pool [R,d], indices [B,Q,k])`` for ``attention_impl="pallas_gather"``
    (the kernel fetches them from the pool; :func:`~dinfer_jax.models.attention.attend_selected_pooled`).
    ``project``: :func:`_on_queries`'s (the output projection on each CP rank's rows). ``q_of``
    (:func:`_query_source`): ``q`` is the queries' latent, mapped to queries on each rank's rows."""
    if active_tile():
        return attend_invariant(q, keys, wmask, ctx.inp.start, ctx.pos, cfg.sliding_window, sink, rows=rows_of(idx),
                                row_mask=idx >= 0)
    impl = selected_attention_impl(opts.attention_impl, _query_like(q, q_of, ctx.pos))
    chunk = q.shape[1]

    kernel = impl in KERNEL_IMPLS

    def core(q: jax.Array, pos: jax.Array, wmask: jax.Array, idx: jax.Array) -> jax.Array:
        q = q if q_of is None else q_of(q, pos)
        wkeys, wm = _query_windows(keys, wmask, ctx.inp.start, pos, chunk, cfg, per_query=kernel)
        if impl == "pallas_gather" and pool_rows_of is not None and pooled_kernel_pays(q.shape[0] * q.shape[1]):
            pool, rows = pool_rows_of(idx)
            return attend_selected_pooled(q, wkeys, wm, pool, rows, idx >= 0, sink)
        return attend_selected(q, wkeys, wm, rows_of(idx), idx >= 0, sink, impl="pallas" if kernel else impl)

    return _on_queries(core, q, (ctx.pos, wmask, idx), ctx.inp, opts, project)


def _attend_all(q: jax.Array, keys: jax.Array, wmask: jax.Array, ckv: jax.Array | None, cmask: jax.Array | None,
                sink: jax.Array, ctx: StepContext, cfg: ModelConfig, opts: LayerOptions,
                project: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                q_of: QueryMap | None = None) -> jax.Array:
    """Attention over the window and all compressed rows under ``cmask`` (batch-invariantly when tracing so; with CP
    on a prefill step over each rank's mirrored query rows, as :func:`_attend_rows`, ``project`` and ``q_of``
    included)."""
    if active_tile():
        return attend_invariant(q, keys, wmask, ctx.inp.start, ctx.pos, cfg.sliding_window, sink, ckv=ckv,
                                cmask=cmask)
    chunk = q.shape[1]

    def core(q: jax.Array, pos: jax.Array, wmask: jax.Array, cmask: jax.Array | None) -> jax.Array:
        q = q if q_of is None else q_of(q, pos)
        wkeys, wm = _query_windows(keys, wmask, ctx.inp.start, pos, chunk, cfg, per_query=False)
        return attend(q, wkeys, wm, ckv, cmask, sink)

    return _on_queries(core, q, (ctx.pos, wmask, cmask), ctx.inp, opts, project)


def _compress_into_cache(params: Any, h: jax.Array, kv_ring: jax.Array, gate_ring: jax.Array,
                         pool: jax.Array, k: jax.Array, inp: StepInput, pos: jax.Array, *, ratio: int, dim: int,
                         overlap: bool, inv_freq: Any, norm_eps: float, codec: RowCodec,
                         rotate: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """V4 compressor over this step's rows with its state ring, and the closed compressed rows written to the page
    pool as ``codec`` stores them (``rotate``: Hadamard-rotated first, V4's FP4 index keys). Returns the updated
    ``(kv_ring, gate_ring, pool)`` of layer ``k`` (same shapes as given)."""
    slot, start, n = inp.slot, inp.start, inp.n
    rows, w, valid, kvp, gate = compress_v4(
        params, h, ring_read(kv_ring, k, slot), ring_read(gate_ring, k, slot), start, n,
        ratio=ratio, dim=dim, overlap=overlap, inv_freq=inv_freq, norm_eps=norm_eps)
    packed = rowwise(lambda r: codec.pack(hadamard(r) if rotate else r), rows)
    return (ring_write(kv_ring, k, slot, pos, n, kvp), ring_write(gate_ring, k, slot, pos, n, gate),
            pages_write(pool, k, inp.pages, w, valid, packed))


def _queries(p: Any, h: jax.Array, pos: jax.Array, inv_freq: Any, *, cfg: ModelConfig,
             indexed: bool, defer_queries: bool = False) -> dict[str, jax.Array]:
    """The per-token half of an attention sublayer on normalised rows ``h [B,Q,D]`` at positions ``pos [B,Q]``:
    ``h``, ``cq [B,Q,q_lora]``, queries ``q [B,Q,H,d]`` and the window row ``kv [B,Q,d]`` (RoPE'd), and with
    ``indexed`` the indexer's queries ``iq [B,Q,Hi,di]`` and head weights ``iw [B,Q,Hi]``. ``defer_queries`` (a
    step split over CP): no ``q``, ``iq``, ``iw`` — each CP rank computes them from ``cq`` and ``h`` for its own
    rows (:func:`_query_source`, :func:`_index_select_of_latent`)."""
    table = RopeTable(*rope_cos_sin(pos, inv_freq))
    cq = query_latent(p, h, cfg=cfg)
    out = {"h": h, "cq": cq, "kv": window_kv(p, h, cfg=cfg, rope=table)}
    if defer_queries:
        return out
    out["q"] = query_heads(p, cq, cfg=cfg, rope=table)
    if indexed:
        out["iq"], out["iw"] = index_queries(p["indexer"], h, cq, cfg=cfg, rope=table)
    return out


def attention_v4(p: Any, t: dict[str, jax.Array], lc: LayerCache, k: jax.Array, ctx: StepContext, *,
                 cfg: ModelConfig, info: LayerInfo, opts: LayerOptions,
                 project: Callable[[jax.Array, jax.Array], jax.Array] | None = None
                 ) -> tuple[jax.Array, LayerCache, dict[str, jax.Array]]:
    """V4 attention sublayer (sliding / CSA / HCA) over the step's per-token values ``t`` (:func:`_queries`; V4
    layers also put ``kv_stored``, the window rows as the ring stores them, there). Returns ``(o [B,Q,H,d] before
    the output projection, updated layer cache, aux)``; aux (``collect``) holds ``indexer_topk [B,Q,k]`` and
    ``indexer_scores [B,Q,T]`` on CSA. On a step split over CP (:func:`_split_over_cp`) with ``project`` given,
    ``o`` is ``project(o, pos)`` instead (``[B,Q,D]``: each rank projects its own rows before the all-gather).

    With ``cfg.kv_fake_quant`` (``LLM(kv_cache_dtype="fp8")``, DeepSeek's reference numerics) the window and
    compressed KV rows are FlashMLA ``model1`` values (FP8 non-RoPE dims, bf16 RoPE dims) and the CSA index keys
    and queries Hadamard-rotated FP4, in this step as in the cache that stores their bytes."""
    inp, pos = ctx.inp, ctx.pos
    inv = ctx.ropes[info.ratio > 0][0]
    h, kv = t["h"], t["kv"]
    q, q_of = _query_source(p, t, inv, cfg, opts)
    codecs = cache_codecs(cfg, h.dtype)
    if codecs.packed:   # this step's window rows are the stored rows' values
        keys, wmask, swa = _window(lc.swa, k, kv, inp, pos, cfg.sliding_window, None, codecs.swa, t["kv_stored"])
    else:
        keys, wmask, swa = _window(lc.swa, k, kv, inp, pos, cfg.sliding_window, None)
    upd: dict[str, Any] = {"swa": swa}
    aux: dict[str, jax.Array] = {}
    ckv = cmask = top_idx = None
    if info.kind != ATTN_SLIDING:
        ratio, pages = info.ratio, inp.pages
        overlap = info.kind == ATTN_CSA
        upd["cst_kv"], upd["cst_gate"], upd["ckv"] = _compress_into_cache(
            p["compressor"], h, lc.cst_kv, lc.cst_gate, lc.ckv, k, inp, pos, ratio=ratio, dim=cfg.head_dim,
            overlap=overlap, inv_freq=inv, norm_eps=cfg.norm_eps, codec=codecs.ckv)
        n_rows = pages.shape[1] * upd["ckv"].shape[2]
        if overlap:
            ix = p["indexer"]
            upd["ist_kv"], upd["ist_gate"], upd["ikv"] = _compress_into_cache(
                ix["compressor"], h, lc.ist_kv, lc.ist_gate, lc.ikv, k, inp, pos, ratio=ratio,
                dim=cfg.index_head_dim, overlap=True, inv_freq=inv, norm_eps=cfg.norm_eps, codec=codecs.ikv,
                rotate=codecs.packed)
            kernel = index_impl(opts.attention_impl, cfg, pos.shape[1]) == "pallas"
            ikeys = None if kernel else codecs.ikv.unpack(pages_read(upd["ikv"], k, pages))

            def index_select(iq: jax.Array, iw: jax.Array, pos: jax.Array) -> dict[str, jax.Array]:
                if kernel:
                    scores = index_scores_paged(iq, iw, upd["ikv"], k, pages, pos, ratio=ratio)
                else:
                    scores = index_scores_of(iq, iw, ikeys, pos, ratio=ratio, fp4_operands=index_operands_fp4(cfg))
                top_idx, selected = topk_select(scores, cfg.index_topk)
                return {"top_idx": top_idx, "selected": selected, "scores": scores}

            if _split_over_cp(pos.shape[1], opts):   # each CP rank scores its mirrored queries (Q·T products split)
                sel = _cp_selection(_index_select_of_latent(index_select, p, cfg, inv), t["cq"], (h, pos), inp,
                                    opts, "top_idx")
            else:
                sel = index_select(t["iq"], t["iw"], pos)
            top_idx, selected = sel["top_idx"], sel["selected"]
            if opts.collect:
                aux.update(indexer_topk=top_idx, indexer_scores=sel["scores"])
        # batch-invariantly always the selected rows: their number (top-k) does not follow the step's page bucket
        if overlap and (active_tile() or use_selected_rows(opts.attention, q.shape[1], cfg.index_topk, n_rows)):
            def rows_of(idx: jax.Array) -> jax.Array:
                return codecs.ckv.unpack(pages_gather(upd["ckv"], k, pages, idx))

            def pool_rows_of(idx: jax.Array) -> tuple[jax.Array, jax.Array]:
                return pool_rows(upd["ckv"], k, pages, idx)

            q_like = _query_like(q, q_of, pos)
            o = _attend_rows(q, keys, wmask, rows_of, top_idx, p["attn_sink"], ctx, cfg, opts,
                             pool_rows_of=pool_rows_of if kernel_reads(codecs.ckv, upd["ckv"], q_like) else None,
                             project=project, q_of=q_of)
            return o, dataclasses.replace(lc, **upd), aux
        ckv = codecs.ckv.unpack(pages_read(upd["ckv"], k, pages))
        cmask = jnp.arange(ckv.shape[1]) < ((pos + 1) // ratio)[..., None]  # [B,Q,T]
        cmask = cmask & _real_queries(inp, pos.shape[1])[..., None]
        if overlap:
            cmask = cmask & selected
    o = _attend_all(q, keys, wmask, ckv, cmask, p["attn_sink"], ctx, cfg, opts, project, q_of)
    return o, dataclasses.replace(lc, **upd), aux


def _write_source_rows(p: Any, h: jax.Array, lc: LayerCache, k: jax.Array, inp: StepInput, *, cfg: ModelConfig,
                       info: LayerInfo, inv_freq: Any) -> dict[str, jax.Array]:
    """A V4.1 KV source's writes for this step's rows ``h [B,Q,D]`` (normalised attention input): its compressor
    state rings, its compressed rows (``"ckv"``) and index keys (``"ik"``, when it has them) in its pages, as the
    cache codecs store them. Returns the updated :class:`LayerCache` fields."""
    codecs = cache_codecs(cfg, h.dtype)
    latent, w, valid, upd = compress_v41(p["compressor"], h, lc, k, inp, ratio=info.ratio)

    def stored_rows(latent: jax.Array, first_pos: jax.Array) -> dict[str, jax.Array]:
        kvc, kidx, kvc_pre, kidx_pre = source_rows(p, latent, first_pos, cfg=cfg, dtype=h.dtype, inv_freq=inv_freq,
                                                   has_index_k=info.has_index_k)
        out = {"ckv": codecs.ckv.pack(kvc_pre if codecs.packed else kvc)}
        if info.has_index_k:
            out["ik"] = codecs.ik.pack(kidx_pre if codecs.packed else kidx)
        return out

    rows = rowwise(stored_rows, latent, w * info.ratio)
    upd["ckv"] = pages_write(lc.ckv, k, inp.pages, w, valid, rows["ckv"])
    if info.has_index_k:
        upd["ik"] = pages_write(lc.ik, k, inp.pages, w, valid, rows["ik"])
    return upd


def attention_v41(p: Any, t: dict[str, jax.Array], lc: LayerCache, k: jax.Array, carry: Carry, ctx: StepContext, *,
                  cfg: ModelConfig, info: LayerInfo, opts: LayerOptions,
                  project: Callable[[jax.Array, jax.Array], jax.Array] | None = None
                  ) -> tuple[jax.Array, LayerCache, Carry, dict[str, jax.Array]]:
    """V4.1 attention sublayer. A KV source compresses and pages its rows and publishes them (``carry["kv"]`` as
    stored, ``carry["ik"]`` decoded); every compressed layer attends to the latest source's rows selected by the
    latest index source's top-k (``carry["selected"]`` mask, ``carry["selected_idx"]`` indices): all rows masked,
    or only the selected rows gathered and decoded (``LayerOptions.attention``). ``t``: the step's per-token values
    (:func:`_queries`, plus ``kv_stored``: the window rows as the ring stores them). Returns ``(o [B,Q,H,d]
    before the output projection, layer cache, carry, aux)``; ``project`` as in :func:`attention_v4`."""
    inp, pos = ctx.inp, ctx.pos
    inv = ctx.ropes[info.ratio > 0][0]
    h = t["h"]
    q, q_of = _query_source(p, t, inv, cfg, opts)
    codecs = cache_codecs(cfg, h.dtype)
    floor = inp.window_floor if info.yoco_region else None
    keys, wmask, swa = _window(lc.swa, k, t["kv"], inp, pos, cfg.sliding_window, floor, codecs.swa, t["kv_stored"])
    upd: dict[str, Any] = {"swa": swa}
    carry = dict(carry)
    aux: dict[str, jax.Array] = {}
    ckv = cmask = None
    ratio = info.ratio
    if ratio > 0:
        # the same static choice in every layer of the step, so the carried index keys suit every index source
        index_kernel = index_impl(opts.attention_impl, cfg, pos.shape[1]) == "pallas"
        if info.kv_source:
            upd.update(_write_source_rows(p, h, lc, k, inp, cfg=cfg, info=info, inv_freq=inv))
            # the step attends to the pages it just wrote (earlier rows and this step's), decoded as stored
            carry["kv"] = pages_read(upd["ckv"], k, inp.pages)  # decoded by the consumers (all rows or top-k)
            if info.has_index_k and not index_kernel:
                carry["ik"] = codecs.ik.unpack(pages_read(upd["ik"], k, inp.pages))
            elif info.shares_index_k:   # as stored: the indexer kernel decodes them in registers
                carry["ik"] = pages_read(upd["ik"], k, inp.pages)
        stored = carry["kv"]
        if info.index_source:
            def index_select(iq: jax.Array, iw: jax.Array, pos: jax.Array,
                             candidates: jax.Array | None) -> dict[str, jax.Array]:
                if index_kernel and info.has_index_k:   # its own pages, read by the kernel
                    scores = index_scores_paged(iq, iw, upd["ik"], k, inp.pages, pos, ratio=ratio)
                elif index_kernel:
                    scores = index_scores_stored(iq, iw, carry["ik"], pos, ratio=ratio)
                else:
                    scores = index_scores_of(iq, iw, carry["ik"], pos, ratio=ratio,
                                             fp4_operands=index_operands_fp4(cfg))
                out = {}
                if info.candidate_source:
                    out["candidates"], out["candidate_blocks"] = candidate_blocks(
                        scores, (pos + 1) // ratio, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                elif info.uses_candidates:
                    scores = jnp.where(candidates, scores, NEG_INF)
                out["selected_idx"], out["selected"] = topk_select(scores, cfg.index_topk)
                return {**out, "scores": scores}

            cand = carry.get("candidates") if info.uses_candidates else None
            if _split_over_cp(pos.shape[1], opts):   # each CP rank scores its mirrored queries (Q·T products split)
                sel = _cp_selection(_index_select_of_latent(index_select, p, cfg, inv), t["cq"], (h, pos, cand),
                                    inp, opts, "selected_idx")
            else:
                sel = index_select(t["iq"], t["iw"], pos, cand)
            carry["selected_idx"], carry["selected"] = sel["selected_idx"], sel["selected"]
            if info.candidate_source:
                carry["candidates"] = sel["candidates"]
            if opts.collect:
                aux.update(indexer_topk=sel["selected_idx"], indexer_scores=sel["scores"])
                if info.candidate_source:
                    aux["candidate_blocks"] = sel["candidate_blocks"]
        if active_tile() or use_selected_rows(opts.attention, q.shape[1], cfg.index_topk, stored.shape[1]):
            def rows_of(idx: jax.Array) -> jax.Array:
                return codecs.ckv.unpack(take_rows(stored, idx))

            def pool_rows_of(idx: jax.Array) -> tuple[jax.Array, jax.Array]:
                return stored_rows(stored, idx)

            q_like = _query_like(q, q_of, pos)
            o = _attend_rows(q, keys, wmask, rows_of, carry["selected_idx"], p["attn_sink"], ctx, cfg, opts,
                             pool_rows_of=pool_rows_of if kernel_reads(codecs.ckv, stored, q_like) else None,
                             project=project, q_of=q_of)
            return o, dataclasses.replace(lc, **upd), carry, aux
        ckv = codecs.ckv.unpack(stored)
        cmask = (jnp.arange(ckv.shape[1]) < ((pos + 1) // ratio)[..., None]) & carry["selected"]
        cmask = cmask & _real_queries(inp, pos.shape[1])[..., None]
    o = _attend_all(q, keys, wmask, ckv, cmask, p["attn_sink"], ctx, cfg, opts, project, q_of)
    return o, dataclasses.replace(lc, **upd), carry, aux


def _attention_output(p: Any, o: jax.Array, pos: jax.Array, *, cfg: ModelConfig, inv_freq: Any) -> jax.Array:
    """The attention sublayer's output projection of ``o [B,Q,H,d]`` at positions ``pos [B,Q]`` → ``[B,Q,D]``."""
    return output_projection(p, o, cfg=cfg, rope=RopeTable(*rope_cos_sin(pos, inv_freq)))


# ---------------------------------------------------------------------------------------------------------------
# blocks


def layer_v4(p: Any, carry: Carry, lc: LayerCache, k: jax.Array, layer: jax.Array, ctx: StepContext, *,
             cfg: ModelConfig, info: LayerInfo,
             opts: LayerOptions) -> tuple[Carry, LayerCache, dict[str, jax.Array]]:
    """One V4 block on ``carry["streams"] [B,Q,n,D]``: mHC site → attention, mHC site → MoE.
    ``layer`` (the absolute layer index, possibly traced) is unused by V4. Returns ``(carry, cache, aux)``.

    What each token computes on its own (mHC mixes, norms, projections, the output projection, the MoE) runs in
    two :func:`~dinfer_jax.models.invariant.rowwise` segments around the attention core (batch-invariantly over
    fixed tiles of tokens; otherwise directly)."""
    del layer
    hc_kw = _hc_kw(cfg, opts.mhc_impl)
    inv = ctx.ropes[info.ratio > 0][0]
    packed = cache_codecs(cfg, jnp.dtype(carry["streams"].dtype)).packed
    split = _split_over_cp(carry["streams"].shape[1], opts)   # then each CP rank computes its rows' queries

    def attention_inputs(streams: jax.Array, pos: jax.Array) -> dict[str, jax.Array]:
        u, post, comb = hc_pre(streams, p["hc_attn"], **hc_kw)
        h = rms_norm(u, p["attn_norm"], cfg.norm_eps)
        t = _queries(p["attn"], h, pos, inv, cfg=cfg, indexed=info.kind == ATTN_CSA, defer_queries=split)
        if packed:   # this step's window rows are the stored rows' values
            swa = cache_codecs(cfg, h.dtype).swa
            t["kv_stored"] = swa.pack(t["kv"])
            t["kv"] = swa.unpack(t["kv_stored"])
        return {**t, "post": post, "comb": comb}

    t = rowwise(attention_inputs, carry["streams"], ctx.pos)
    project = functools.partial(_attention_output, p["attn"], cfg=cfg, inv_freq=inv)
    o, lc, aux = attention_v4(p["attn"], t, lc, k, ctx, cfg=cfg, info=info, opts=opts, project=project)
    projected = split   # o is then the projected [B,Q,D] (attention_v4)

    def rest(streams: jax.Array, o: jax.Array, post: jax.Array, comb: jax.Array, pos: jax.Array,
             tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        a = o if projected else project(o, pos)
        streams = hc_post(streams, a, post, comb)
        streams = constrain(opts.sharder, streams, ("act_batch", "act_seq", None, None))
        u, post, comb = hc_pre(streams, p["hc_ffn"], **hc_kw)
        m, moe_aux = _moe(p["ffn"], rms_norm(u, p["ffn_norm"], cfg.norm_eps), tokens, None, ctx, cfg=cfg,
                          hash_routed=info.hash_routed, opts=opts)
        return hc_post(streams, m, post, comb), moe_aux

    streams, moe_aux = rowwise(rest, carry["streams"], o, t["post"], t["comb"], ctx.pos, ctx.inp.tokens)
    streams = constrain(opts.sharder, streams, ("act_batch", "act_seq", None, None))
    if opts.collect:
        aux.update(moe_aux)
        aux["hidden_states"] = streams
    if opts.count_experts:
        aux["expert_loads"] = moe_aux["expert_loads"]
    return {**carry, "streams": streams}, lc, aux


def _moe(p: Any, x: jax.Array, token_ids: jax.Array | None, image_mask: jax.Array | None, ctx: StepContext, *,
         cfg: ModelConfig, hash_routed: bool, opts: LayerOptions) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE sublayer. Per device inside the DP engines' step (no aux outputs then but the optional
    ``expert_loads``): with engine copies
    (``opts.copies_manual > 1``), or CP ranks on decode rows, the devices of an engine split its tokens
    contiguously (:func:`~dinfer_jax.models.cp_rows.group_tokenwise`); otherwise with ``opts.cp_manual > 1`` on
    prefill rows (``Q > 1``) each CP rank computes its mirrored share (:func:`~dinfer_jax.models.cp_rows.
    cp_tokenwise`)."""
    def run(x: jax.Array, tid: jax.Array | None, img: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        return moe(p, x, tid, cfg=cfg, hash_routed=hash_routed, impl=opts.moe_impl, sharder=opts.sharder,
                   image_mask=img, expert_map=p.get("expert_map"), ep_manual=opts.ep_manual)

    counted = {}
    if opts.count_experts:
        # EPLB loads of this step's real tokens, routed on the engine's full rows before any split over devices
        # (the same decisions as the split routers; in the unsplit path XLA computes the router once)
        B, Q, D = x.shape
        idx, _ = route(p["gate"], x.reshape(B * Q, D), None if token_ids is None else token_ids.reshape(B * Q),
                       cfg=cfg, hash_routed=hash_routed,
                       image_mask=None if image_mask is None else image_mask.reshape(B * Q))
        valid = jnp.arange(Q)[None, :] < ctx.inp.n[:, None]
        counted = {"expert_loads": expert_loads(idx, cfg.n_routed_experts, valid)}
    cp = max(opts.cp_manual, 1)
    if not opts.collect and (opts.copies_manual > 1 or (cp > 1 and x.shape[1] == 1)):
        y = group_tokenwise(lambda x, t, i: run(x, t, i)[0], x, (token_ids, image_mask), opts.copies_manual, cp)
        return y, counted
    if opts.cp_manual > 1 and x.shape[1] > 1 and not opts.collect:
        y = cp_tokenwise(lambda x, t, i: run(x, t, i)[0], x, (token_ids, image_mask), ctx.inp.n, opts.cp_manual)
        return y, counted
    y, aux = run(x, token_ids, image_mask)
    return y, {**aux, **counted}


def _v41_attention_inputs(p: Any, streams: jax.Array, premix: jax.Array, pos: jax.Array, rows: jax.Array | None,
                          image_mask: jax.Array | None, *, cfg: ModelConfig, info: LayerInfo, inv_freq: Any,
                          queries: bool, mhc_impl: str = "auto", defer_queries: bool = False
                          ) -> dict[str, jax.Array]:
    """A V4.1 layer's per-token values before attention, for ``streams [B,Q,n,D]``: the Engram gate's streams
    (Engram layers, ``rows [B,Q,E_in]``), the normalised attention input ``h`` (collapse with ``premix``), and
    with ``queries`` the attention site's mixes (``pre``, ``post``, ``comb``), the queries and window rows
    (:func:`_queries`, ``defer_queries`` passed on; ``kv`` as attended, ``kv_stored`` as the ring stores it) and
    the DSpark feature."""
    if info.engram:
        streams = engram_gate(streams, rows, p["engram"], norm_eps=cfg.norm_eps, image_mask=image_mask)
    h = rms_norm(hc_collapse(streams, premix), p["attn_norm"], cfg.norm_eps)
    if not queries:
        return {"streams": streams, "h": h}
    pre, post, comb = hc_mixes(streams, p["hc_attn"], **_hc_kw(cfg, mhc_impl))
    t = _queries(p["attn"], h, pos, inv_freq, cfg=cfg, indexed=info.index_source, defer_queries=defer_queries)
    codecs = cache_codecs(cfg, h.dtype)   # byte codecs encode rows before rounding (``cache_codec`` says why)
    kv_pre = t["kv"]
    t["kv"] = maybe_fake_quant(cfg.kv_fake_quant, q8_fake, kv_pre, 32)
    t["kv_stored"] = codecs.swa.pack(kv_pre if codecs.packed else t["kv"])
    t.update(streams=streams, pre=pre, post=post, comb=comb)
    if info.dspark_target:
        t["dspark_feature"] = jnp.mean(streams.astype(F32), axis=2).astype(streams.dtype)
    return t


def _engram_rows(ctx: StepContext, layer: jax.Array, info: LayerInfo) -> jax.Array | None:
    return ctx.engram[ctx.engram_index[layer]] if info.engram else None


def layer_v41_region_sources(p: Any, carry: Carry, lc: LayerCache, k: jax.Array, layer: jax.Array,
                             ctx: StepContext, *, cfg: ModelConfig,
                             info: LayerInfo) -> tuple[Carry, LayerCache, dict[str, jax.Array]]:
    """A YOCO-region layer on kept-out prefill rows (``yoco="compact"``): only what the kept rows will read later —
    a KV source's compressed rows (and index keys) written to its pages, computed exactly as :func:`attention_v41`
    does from the layer's input; nothing else (no window-ring slots, no attention, no MoE; streams unchanged)."""
    if not (info.ratio > 0 and info.kv_source):
        return carry, lc, {}
    inp = ctx.inp
    t = rowwise(functools.partial(_v41_attention_inputs, p, cfg=cfg, info=info, inv_freq=ctx.ropes[True][0],
                                  queries=False),
                carry["streams"], carry["premix"], ctx.pos, _engram_rows(ctx, layer, info), inp.image_mask)
    upd = _write_source_rows(p["attn"], t["h"], lc, k, inp, cfg=cfg, info=info, inv_freq=ctx.ropes[True][0])
    return carry, dataclasses.replace(lc, **upd), {}


def layer_v41(p: Any, carry: Carry, lc: LayerCache, k: jax.Array, layer: jax.Array, ctx: StepContext, *,
              cfg: ModelConfig, info: LayerInfo,
              opts: LayerOptions) -> tuple[Carry, LayerCache, dict[str, jax.Array]]:
    """One V4.1 block with shifted mHC: Engram gate (Engram layers), attention, MoE. ``carry`` holds ``streams``
    ``[B,Q,n,D]``, ``premix`` ``[B,Q,n]`` (the previous FFN site's pre) and the cross-layer source values.
    ``layer`` (absolute index, possibly traced) picks the Engram rows. Returns ``(carry, cache, aux)``; aux has
    ``dspark_feature [B,Q,D]`` (mean attention-input stream) on DSpark target layers. With ``opts.yoco_skip`` a
    YOCO-region layer runs :func:`layer_v41_region_sources` instead. As in :func:`layer_v4`, the per-token
    computations run in two :func:`~dinfer_jax.models.invariant.rowwise` segments around the attention core."""
    if opts.yoco_skip and info.yoco_region:
        return layer_v41_region_sources(p, carry, lc, k, layer, ctx, cfg=cfg, info=info)
    hc_kw = _hc_kw(cfg, opts.mhc_impl)
    inp = ctx.inp
    inv = ctx.ropes[info.ratio > 0][0]
    split = _split_over_cp(carry["streams"].shape[1], opts)   # then each CP rank computes its rows' queries
    t = rowwise(functools.partial(_v41_attention_inputs, p, cfg=cfg, info=info, inv_freq=inv, queries=True,
                                  mhc_impl=opts.mhc_impl, defer_queries=split),
                carry["streams"], carry["premix"], ctx.pos, _engram_rows(ctx, layer, info), inp.image_mask)
    project = functools.partial(_attention_output, p["attn"], cfg=cfg, inv_freq=inv)
    o, lc, carry, aux = attention_v41(p["attn"], t, lc, k, carry, ctx, cfg=cfg, info=info, opts=opts,
                                      project=project)
    projected = split   # o is then the projected [B,Q,D] (attention_v41)

    def rest(streams: jax.Array, o: jax.Array, pre_a: jax.Array, post_a: jax.Array, comb_a: jax.Array,
             pos: jax.Array, image_mask: jax.Array | None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        a = o if projected else project(o, pos)
        streams = hc_post(streams, a, post_a, comb_a)
        pre_f, post_f, comb_f = hc_mixes(streams, p["hc_ffn"], **hc_kw)
        x = rms_norm(hc_collapse(streams, pre_a), p["ffn_norm"], cfg.norm_eps)
        m, moe_aux = _moe(p["ffn"], x, None, image_mask, ctx, cfg=cfg, hash_routed=False, opts=opts)
        return hc_post(streams, m, post_f, comb_f), pre_f, moe_aux

    streams, pre_f, moe_aux = rowwise(rest, t["streams"], o, t["pre"], t["post"], t["comb"], ctx.pos,
                                      inp.image_mask)
    streams = constrain(opts.sharder, streams, ("act_batch", "act_seq", None, None))
    if info.dspark_target:
        aux["dspark_feature"] = t["dspark_feature"]
    if opts.collect:
        aux.update(moe_aux)
        aux["hidden_states"] = streams
        aux["premix"] = pre_f
    if opts.count_experts:
        aux["expert_loads"] = moe_aux["expert_loads"]
    return {**carry, "streams": streams, "premix": pre_f}, lc, aux
