"""V4 attention building blocks (spec ``docs/spec/model-v4.md`` §3.4–3.7); the sublayers over cached state are in
:mod:`dinfer_jax.models.layers`.

Every layer attends to a sliding window of raw KV rows; CSA layers (m = 4, overlapping compressor + lightning
indexer top-k) and HCA layers (m large, all closed windows) add compressed KV rows. K = V = one 512-wide latent
shared by all heads, learned per-head sink, inverse RoPE on the output, grouped low-rank output projection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.attention_invariant import index_dots_invariant
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.invariant import active_tile, token_tiled
from dinfer_jax.models.linear_impl import grouped_kernel_config, kernel_grouped_linear
from dinfer_jax.models.ops import (
    F32,
    apply_rope_tail,
    linear,
    linear_f32,
    matmul,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from dinfer_jax.models.qweights import as_dense

FP4_INDEX_BLOCK = 32  # values per power-of-two scale of the indexer's FP4 queries (Q4u) and keys (fp4_index)


@dataclasses.dataclass(frozen=True)
class RopeTable:
    """cos/sin ``[S, r/2]`` (fp32) for the query positions and for compressed-row positions ``w·m``."""

    cos: jax.Array
    sin: jax.Array


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> dict[str, tuple[Any, RopeTable]]:
    """``{"main": (inv_freq, table), "compress": (inv_freq, table)}`` for ``positions [S]``: main = plain
    ``rope_theta`` (sliding-only layers, MTP), compress = ``compress_rope_theta`` with YaRN (compressed layers)."""
    out = {}
    for name, theta, yarn in (("main", cfg.rope_theta, None), ("compress", cfg.compress_rope_theta, cfg.yarn)):
        inv = rope_inv_freq(cfg.rope_head_dim, theta, yarn)
        cos, sin = rope_cos_sin(positions, inv)
        out[name] = (inv, RopeTable(cos, sin))
    return out


def index_queries(p: Mapping[str, Any], h: jax.Array, cq: jax.Array, *, cfg: ModelConfig,
                  rope: RopeTable) -> tuple[jax.Array, jax.Array]:
    """The lightning indexer's per-token half: queries ``[B,S,Hi,di]`` fp32 (RoPE'd; with ``kv_fake_quant``
    rounded to FP4 (Q4u), V4's after the reference's Hadamard rotation, its keys being rotated where they are
    cached; without it V4 omits the rotation, which changes no score, as transformers does) and head weights
    ``[B,S,Hi]`` fp32 (``·di^−½·Hi^−½``). h ``[B,S,D]``, cq ``[B,S,q_lora]``, rope the query positions' table."""
    from dinfer_jax.models.fake_quant import hadamard, maybe_fake_quant, q4u_fake

    B, S, _ = h.shape
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    q = linear(cq, p["wq_b"]).reshape(B, S, Hi, di)
    q = apply_rope_tail(q, rope.cos[..., None, :], rope.sin[..., None, :]).astype(F32)
    if cfg.kv_fake_quant and not cfg.is_v41:
        q = hadamard(q)
    q = maybe_fake_quant(cfg.kv_fake_quant, q4u_fake, q, 32)
    w = linear_f32(h, p["weights_proj"]) * (di ** -0.5) * (Hi ** -0.5)  # [B,S,Hi]
    return q, w


def index_scores_of(q: jax.Array, w: jax.Array, k_rows: jax.Array, pos: jax.Array, *, ratio: int,
                    fp4_operands: bool = False) -> jax.Array:
    """Lightning-indexer scores ``[B,S,T]`` fp32 of :func:`index_queries`' ``(q, w)``: ``Σ_h relu(q_h · k_j) · w_h``
    with −inf where ``j ≥ (p+1)//m``. k_rows ``[B,T,di]`` (index keys, RoPE'd), pos ``[S]`` or ``[B,S]`` absolute
    positions of the query rows.

    ``fp4_operands``: the caller guarantees that ``q`` and ``k_rows`` hold FP4 values (e2m1 codes times
    power-of-two scales: Q4u queries, ``fp4_index`` keys; ``cfg.kv_fake_quant``). Such values are exact in bf16 and
    their products exact in fp32, so the ``q · k`` products run as bf16 with fp32 accumulation — on a GPU the
    tensor cores instead of fp32 arithmetic, with half the key bytes — and give the fp32 path's dots up to the
    order of the fp32 additions (``docs/kv_formats.md``, "Indexer operands")."""
    if active_tile():
        scores = index_dots_invariant(q, w, k_rows)
    else:
        if fp4_operands:
            dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.bfloat16), k_rows.astype(jnp.bfloat16),
                              preferred_element_type=F32)
        else:
            dots = jnp.einsum("bshd,btd->bsht", q, k_rows.astype(F32), precision=jax.lax.Precision.HIGHEST)
        scores = jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots), w, precision=jax.lax.Precision.HIGHEST)
    return mask_visible(scores, pos, ratio)


def mask_visible(scores: jax.Array, pos: jax.Array, ratio: int) -> jax.Array:
    """Indexer scores ``[B,S,T]`` with −inf where compressed row ``j ≥ (p+1)//ratio`` (not yet complete for the
    query at position ``p``; pos ``[S]`` or ``[B,S]``). A select, so rows past a sequence's length may hold anything,
    non-finite values included."""
    visible = jnp.arange(scores.shape[-1]) < ((pos + 1) // ratio)[..., None]  # [S,T] or [B,S,T]
    return jnp.where(visible, scores, -jnp.inf)


def _not_a_gpu(backend: str | None) -> str | None:
    """Why a Mosaic GPU kernel cannot run on ``backend`` (default: jax's), or None on a GPU."""
    backend = backend or jax.default_backend()
    return None if backend == "gpu" else f"backend is {backend!r}, the kernel needs a GPU"


def index_kernel_unsupported(cfg: ModelConfig, num_queries: int, backend: str | None = None) -> str | None:
    """Why the Mosaic GPU indexer kernel (``pallas_kernels.indexer``) cannot score ``num_queries`` query tokens per
    sequence of ``cfg`` over its stored index keys on ``backend`` (default: jax's; None when it can): it needs a
    GPU, keys stored as ``fp4_index`` bytes with FP4 queries (:func:`index_operands_fp4`), index heads of width 128
    in a multiple of 32 up to 128, and at most 8 query tokens per sequence (decode and verification rows)."""
    from pallas_kernels.indexer.scores_sm90 import DIM, MAX_QUERIES

    if (off_gpu := _not_a_gpu(backend)) is not None:
        return off_gpu
    if not index_operands_fp4(cfg):
        return "index keys are not stored as fp4_index bytes (kv_fake_quant off)"
    if cfg.index_head_dim != DIM:
        return f"index head width {cfg.index_head_dim} is not {DIM}"
    if cfg.index_n_heads % 32 or cfg.index_n_heads > 128:
        return f"{cfg.index_n_heads} index heads are not a multiple of 32 up to 128"
    if num_queries > MAX_QUERIES:
        return f"{num_queries} query tokens per sequence (the kernel holds at most {MAX_QUERIES})"
    return None


def index_impl(requested: str, cfg: ModelConfig, num_queries: int, backend: str | None = None) -> str:
    """``"jnp"`` or ``"pallas"`` for the indexer's scores (:func:`index_scores_stored`), under the same switch as
    the decode-attention kernel (``LayerOptions.attention_impl``): ``"auto"`` takes the kernel where it can run
    (:func:`index_kernel_unsupported`) outside batch-invariant mode. ``"pallas"`` / ``"pallas_gather"`` raise off a
    GPU and otherwise take it where the model and its cache can feed it: steps with more query tokens than it holds
    (prefill) and index keys it cannot read (V4's exact cache: plain keys, not ``fp4_index`` bytes) are scored by
    XLA — the switch names the decode-attention kernel, which runs either way."""
    if requested not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {requested!r}")
    backend = backend or jax.default_backend()
    why = index_kernel_unsupported(cfg, num_queries, backend)
    if requested in KERNEL_IMPLS and backend != "gpu":
        raise ValueError(f"attention_impl={requested!r} cannot run the indexer kernel here: {why}")
    if requested in KERNEL_IMPLS:
        return "jnp" if why is not None else "pallas"
    if requested == "auto":
        return "pallas" if why is None and not active_tile() else "jnp"
    return requested


def index_scores_paged(q: jax.Array, w: jax.Array, pool: jax.Array, layer: jax.Array, pages: jax.Array,
                       pos: jax.Array, *, ratio: int) -> jax.Array:
    """Indexer scores ``[B,S,P·rpb]`` fp32 (masked as :func:`index_scores_of`) of each sequence's pages ``pages
    [B,P]`` of layer ``layer`` of the paged ``fp4_index`` rows ``pool uint8 [L,N,rpb,68]``, through the Mosaic GPU
    kernel reading the pages itself (no gathered copy of the rows). Same values as :func:`index_scores_stored` on
    ``pages_read(pool, layer, pages)``. Pages of other than a multiple of 32 rows (small test pages) are gathered
    first (:func:`index_scores_stored`)."""
    from pallas_kernels.indexer.scores_sm90 import index_scores_paged as kernel

    if pool.shape[2] % 32:
        from dinfer_jax.models.cache_io import pages_read

        return index_scores_stored(q, w, pages_read(pool, layer, pages), pos, ratio=ratio)
    return mask_visible(kernel(q, w, pool, layer, pages), pos, ratio)


def index_scores_stored(q: jax.Array, w: jax.Array, stored: jax.Array, pos: jax.Array, *, ratio: int) -> jax.Array:
    """Indexer scores ``[B,S,T]`` fp32 (masked as :func:`index_scores_of`) straight from the stored ``fp4_index``
    rows ``uint8 [B,T,68]`` through the Mosaic GPU kernel: the keys are decoded in registers, never written out.
    Same values as decoding the rows and calling :func:`index_scores_of` with ``fp4_operands=True``, up to the
    order of the fp32 additions (``docs/kv_formats.md``, "Indexer operands")."""
    from pallas_kernels.indexer.scores_sm90 import index_scores_rows

    return mask_visible(index_scores_rows(q, w, stored), pos, ratio)


def index_operands_fp4(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s indexer queries and keys hold FP4 values (``index_scores_of(..., fp4_operands=True)``):
    with ``kv_fake_quant`` both are rounded to e2m1 with power-of-two scales per 32 values (Q4u queries,
    ``fp4_index`` keys) — when the index head width is a multiple of 32; otherwise the reference leaves them
    unquantised."""
    return bool(cfg.kv_fake_quant) and cfg.index_head_dim % FP4_INDEX_BLOCK == 0


def index_scores(p: Mapping[str, Any], h: jax.Array, cq: jax.Array, k_rows: jax.Array, pos: jax.Array, *,
                 cfg: ModelConfig, ratio: int, rope: RopeTable) -> jax.Array:
    """Lightning-indexer scores ``[B,S,T]`` fp32 (:func:`index_queries`, then :func:`index_scores_of`)."""
    q, w = index_queries(p, h, cq, cfg=cfg, rope=rope)
    return index_scores_of(q, w, k_rows, pos, ratio=ratio, fp4_operands=index_operands_fp4(cfg))


def query_latent(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """The queries' low-rank latent ``cq [B,S,q_lora]`` (normalised) of ``h [B,S,D]``."""
    return rms_norm(linear(h, p["wq_a"]), p["q_norm"], cfg.norm_eps)


def query_heads(p: Mapping[str, Any], cq: jax.Array, *, cfg: ModelConfig, rope: RopeTable) -> jax.Array:
    """The attention queries ``q [B,S,H,d]`` (RoPE'd) of the latent ``cq [B,S,q_lora]`` (:func:`query_latent`);
    ``rope`` the rows' table. V4 normalises each q head (unweighted RMS); V4.1 does not."""
    B, S, _ = cq.shape
    q = linear(cq, p["wq_b"]).reshape(B, S, cfg.num_heads, cfg.head_dim)
    if cfg.use_qnorm:
        q = rms_norm(q, None, cfg.norm_eps)
    return apply_rope_tail(q, rope.cos[..., None, :], rope.sin[..., None, :])


def window_kv(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig, rope: RopeTable) -> jax.Array:
    """The shared K=V latent ``kv [B,S,d]`` (normalised, RoPE'd) of ``h [B,S,D]``: the rows the window attends."""
    kv = rms_norm(linear(h, p["wkv"]), p["kv_norm"], cfg.norm_eps)
    return apply_rope_tail(kv, rope.cos, rope.sin)


def query_and_window_kv(p: Mapping[str, Any], h: jax.Array, *, cfg: ModelConfig,
                        rope: RopeTable) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q low-rank path and the shared K=V latent. h: ``[B,S,D]``. Returns ``(cq [B,S,q_lora]``
    (:func:`query_latent`), ``q [B,S,H,d]`` with RoPE (:func:`query_heads`), ``kv [B,S,d]`` with RoPE
    (:func:`window_kv`))."""
    cq = query_latent(p, h, cfg=cfg)
    return cq, query_heads(p, cq, cfg=cfg, rope=rope), window_kv(p, h, cfg=cfg, rope=rope)


def _visible_rows(rows: jax.Array, mask: jax.Array) -> jax.Array:
    """``rows [B,T,d]`` with the rows no query sees (``mask [B or 1,S,T]`` all False over S) set to 0 by a select:
    a masked row's weight is exactly 0, but 0 · NaN is NaN, so a stale row (a freed page or ring slot still holding
    a previous request's non-finite values) must not enter the weighted sum at all."""
    seen = jnp.any(mask, axis=1)
    return jnp.where(seen[..., None], rows, jnp.zeros((), rows.dtype))


def _window_term(q: jax.Array, kv: jax.Array, wm: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """The window keys' part of an attention: scaled logits ``[B,H,S,Lw]`` fp32 (−inf where masked) and the map
    from their probabilities ``[B,H,S,Lw]`` (q's dtype) to the weighted rows ``[B,S,H,d]`` fp32.

    kv is either shared by the step's queries, ``[B,Lw,d]`` with ``wm [B or 1,S,Lw]``, or each query's own window,
    ``[B,S,Lw,d]`` with ``wm [B,S,Lw]`` (:func:`~dinfer_jax.models.attention_invariant.window_rows`: a long
    prefill chunk then costs ``S·W`` products instead of ``S·(R+S)``)."""
    B, S, H, d = q.shape
    dt = q.dtype
    scale = d ** -0.5
    if kv.ndim == 4:
        rows = jnp.where(wm[..., None], kv.astype(dt), jnp.zeros((), dt))   # select: see _visible_rows
        logits = jnp.where(wm[:, None], matmul("bshd,bswd->bhsw", q, rows) * scale, -jnp.inf)
        return logits, lambda p: matmul("bhsw,bswd->bshd", p, rows)
    rows = _visible_rows(kv.astype(dt), jnp.broadcast_to(wm, (B, S, kv.shape[1])))
    logits = jnp.where(wm[:, None], matmul("bshd,btd->bhst", q, rows) * scale, -jnp.inf)
    return logits, lambda p: matmul("bhst,btd->bshd", p, rows)


def _sink_softmax_sum(dt: jnp.dtype, sink: jax.Array,
                      *terms: tuple[jax.Array, Callable[[jax.Array], jax.Array]]) -> jax.Array:
    """One softmax over the logits of every ``(logits [B,H,S,L_i], values)`` term and the sink column, then
    ``Σ_i values_i(probabilities_i)`` with the probabilities rounded to ``dt``; returns ``[B,S,H,d]`` in ``dt``."""
    B, H, S = terms[0][0].shape[:3]
    sink_col = jnp.broadcast_to(sink.astype(F32)[None, :, None, None], (B, H, S, 1))
    probs = jax.nn.softmax(jnp.concatenate([t[0] for t in terms] + [sink_col], axis=-1), axis=-1)
    o, start = None, 0
    for logits, values in terms:
        part = values(probs[..., start:start + logits.shape[-1]].astype(dt))
        o, start = part if o is None else o + part, start + logits.shape[-1]
    return o.astype(dt)


def attend(q: jax.Array, kv: jax.Array, win_mask: jax.Array, ckv: jax.Array | None, cmask: jax.Array | None,
           sink: jax.Array) -> jax.Array:
    """Sink softmax attention over window rows plus compressed rows, K = V.

    q ``[B,S,H,d]``; kv ``[B,S,d]`` with ``win_mask`` ``[S,S]`` (or ``[B,S,S]``), or each query's own window rows
    ``[B,S,W,d]`` with ``win_mask [B,S,W]`` (see :func:`_window_term`); ckv ``[B,T,d]`` with cmask ``[B,S,T]``;
    sink ``[H]`` fp32 logits that only enlarge the denominator. Returns o ``[B,S,H,d]`` (q's dtype); a query with
    no visible key gets 0.
    """
    B, S, H, d = q.shape
    dt = q.dtype
    scale = d ** -0.5
    wm = win_mask if win_mask.ndim == 3 else win_mask[None]
    if kv.ndim == 4:   # per-query windows: the window and the compressed rows in two products
        terms = [_window_term(q, kv, wm)]
        if ckv is not None and ckv.shape[1] > 0:
            crows = _visible_rows(ckv.astype(dt), cmask)
            terms.append((jnp.where(cmask[:, None], matmul("bshd,btd->bhst", q, crows) * scale, -jnp.inf),
                          lambda p: matmul("bhst,btd->bshd", p, crows)))
        return _sink_softmax_sum(dt, sink, *terms)
    sink_col = jnp.broadcast_to(sink.astype(F32)[None, :, None, None], (B, H, S, 1))
    logits = matmul("bshd,btd->bhst", q, kv) * scale
    logits = jnp.where(wm[:, None], logits, -jnp.inf)
    values = [_visible_rows(kv, wm)]
    if ckv is not None and ckv.shape[1] > 0:
        c_logits = matmul("bshd,btd->bhst", q, ckv.astype(dt)) * scale
        logits = jnp.concatenate([logits, jnp.where(cmask[:, None], c_logits, -jnp.inf)], axis=-1)
        values.append(_visible_rows(ckv.astype(dt), cmask))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink_col], axis=-1), axis=-1)[..., :-1]
    v = jnp.concatenate(values, axis=1)
    return matmul("bhst,btd->bshd", probs.astype(dt), v).astype(dt)


# "pallas_gather": "pallas", and where the selected rows are stored as the kernel can read them (V4's exact bf16 cache,
# V4.1's v41_fp4 rows) the decode kernel fetches them itself instead of XLA gathering them first
# (attend_selected_pooled); "auto" does so for decode steps (selected_attention_impl)
ATTENTION_IMPLS = ("auto", "jnp", "pallas", "pallas_gather")
KERNEL_IMPLS = ("pallas", "pallas_gather")


def selected_kernel_unsupported(q: jax.Array, backend: str | None = None) -> str | None:
    """Why the Mosaic GPU decode kernel (``pallas_kernels.attention``) cannot run :func:`attend_selected` for
    queries ``q [B,S,H,d]`` on ``backend`` (default: jax's; None when it can): it needs a GPU, bf16, heads in blocks
    of 64 and a width that splits into two halves of at most 256 columns in 64-wide tiles."""
    if (off_gpu := _not_a_gpu(backend)) is not None:
        return off_gpu
    if q.dtype != jnp.bfloat16:
        return f"queries are {q.dtype}, the kernel computes in bfloat16"
    H, d = q.shape[-2:]
    if H % 64:
        return f"{H} heads are not a multiple of 64"
    if d % 128 or d > 512:
        return f"head width {d} is not a multiple of 128 up to 512"
    return None


def selected_attention_impl(requested: str, q: jax.Array, backend: str | None = None) -> str:
    """``"jnp"``, ``"pallas"`` or ``"pallas_gather"`` for :func:`attend_selected` on ``backend`` (default: jax's).
    ``"pallas"`` takes the kernel on XLA-gathered rows for every step and raises where it cannot run;
    ``"pallas_gather"`` likewise, with the kernel fetching the selected rows from the cache itself
    (:func:`attend_selected_pooled`) where it can read them (``layers.kernel_reads``) and the step has more than 8
    query rows (:func:`pooled_kernel_pays`). ``"auto"`` is ``"pallas_gather"`` where the kernel can run and the step
    has few queries per row (decode): bit-equal to the kernel on gathered rows and faster than XLA's gather at 16
    and 64 queries (1.7× bf16, 2.9× ``v41_fp4`` at 64 on an H100; V4.1's 4-layer decode step 9.14 against 9.32 ms,
    docs/perf/attention_h200.md); prefill chunks keep XLA's path until the kernel's gain on them (1.25x per chunk
    in ``bench_kernels.py prefill-attention``) is measured in the serving step."""
    if requested not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {requested!r}")
    why = selected_kernel_unsupported(q, backend)
    if requested in KERNEL_IMPLS and why is not None:
        raise ValueError(f"attention_impl={requested!r} cannot run here: {why}")
    if requested == "auto":
        return "pallas_gather" if why is None and q.shape[1] <= 8 else "jnp"
    return requested


def _attend_selected_pallas(q: jax.Array, kv: jax.Array, wm: jax.Array, rows: jax.Array, row_mask: jax.Array,
                            sink: jax.Array) -> jax.Array:
    """:func:`attend_selected` through the Mosaic GPU kernel: each query's window rows (shared ``[B,Sw,d]``,
    broadcast, or its own ``[B,S,Sw,d]``) and selected rows laid out as one row set ``[B·S, Sw+K (padded to 64),
    d]`` (masked rows zeroed: the kernel needs finite rows); the kernel's organisation by the number of query rows
    (``pallas_kernels.attention.tuning``)."""
    from pallas_kernels.attention.decode_sm90 import sparse_decode_attention
    from pallas_kernels.attention.tuning import decode_options
    from pallas_kernels.lowering_reuse import kernel_call

    B, S, H, d = q.shape
    K = rows.shape[2]
    if kv.ndim == 4:   # each query's own window rows
        Sw = kv.shape[2]
        keys = jnp.concatenate([kv.astype(q.dtype), rows.astype(q.dtype)], axis=2)
    else:
        Sw = kv.shape[1]
        keys = jnp.concatenate([jnp.broadcast_to(kv[:, None], (B, S, Sw, d)), rows.astype(q.dtype)], axis=2)
    valid = jnp.concatenate([jnp.broadcast_to(wm, (B, S, Sw)), row_mask], axis=2)
    pad = (-(Sw + K)) % 64
    keys = jnp.pad(keys, ((0, 0), (0, 0), (0, pad), (0, 0)))
    valid = jnp.pad(valid, ((0, 0), (0, 0), (0, pad)))
    keys = jnp.where(valid[..., None], keys, jnp.zeros((), q.dtype))
    L = Sw + K + pad
    # the row set's length is window + top-k, not the page-table width: programs of one batch bucket share it
    o = kernel_call(sparse_decode_attention, q.reshape(B * S, H, d), keys.reshape(B * S, L, d),
                    valid.reshape(B * S, L), sink.astype(F32), scale=d ** -0.5, **decode_options(B * S, L))
    return o.reshape(B, S, H, d)


def pooled_kernel_pays(n_queries: int) -> bool:
    """Whether ``attention_impl="pallas_gather"`` hands a step of ``n_queries`` query rows the gathering kernel: above
    ``tuning.SMALL_N_MAX`` (at 16 and 64 queries it beat XLA's gather + the kernel on an H100; with fewer, the
    kernel on gathered rows splits each query's rows over many CTAs, which ``split_cta``'s gathering form does not:
    23.7 µs against 18.8 µs at one query; ``shared_qk``'s gathering form, which does, measured the same as XLA's
    gather + ``shared_qk``, 12.6 against 12.3 µs: docs/perf/attention_h200.md)."""
    from pallas_kernels.attention import tuning

    return n_queries > tuning.SMALL_N_MAX


def attend_selected_pooled(q: jax.Array, kv: jax.Array, wm: jax.Array, pool: jax.Array, rows: jax.Array,
                           row_mask: jax.Array, sink: jax.Array) -> jax.Array:
    """:func:`attend_selected` with ``impl="pallas"`` on the selected rows ``pool[rows]``, without gathering them:
    the Mosaic GPU kernel fetches them from the pool by index (``sparse_decode_attention_rows``); each query's window
    rows ``kv [B,S,Sw,d]`` (mask ``wm [B,S,Sw]``) are laid out by XLA as for the kernel on gathered rows.

    Args:
      q: ``bf16 [B,S,H,d]``; kv, wm: each query's own window rows and mask.
      pool: ``bf16 [R, d]`` (a paged cache viewed as rows, :func:`~dinfer_jax.models.cache_io.pool_rows`) or
        ``uint8 [R, d/2 + d/16]`` ``v41_fp4`` rows (:func:`~dinfer_jax.models.cache_io.stored_rows`), decoded by the
        kernel.
      rows: ``int32 [B,S,K]`` indices into ``pool``; row_mask ``bool [B,S,K]`` (False: no entry).
      sink: ``[H]``.
    Returns:
      ``[B,S,H,d]`` bf16, the kernel's result on ``concat(window, pool[rows])``.
    """
    from pallas_kernels.attention import tuning
    from pallas_kernels.lowering_reuse import kernel_call

    B, S, H, d = q.shape
    Sw, K = kv.shape[2], rows.shape[2]
    wpad, kpad = (-Sw) % 64, (-K) % 64
    window = jnp.pad(jnp.where(wm[..., None], kv.astype(q.dtype), jnp.zeros((), q.dtype)),
                     ((0, 0), (0, 0), (0, wpad), (0, 0)))
    valid = jnp.concatenate([jnp.pad(jnp.broadcast_to(wm, (B, S, Sw)), ((0, 0), (0, 0), (0, wpad))),
                             jnp.pad(row_mask, ((0, 0), (0, 0), (0, kpad)))], axis=2)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, kpad)))
    n, L = B * S, Sw + wpad + K + kpad
    o = kernel_call(_rows_kernel, q.reshape(n, H, d), pool, rows.reshape(n, K + kpad), valid.reshape(n, L),
                    sink.astype(F32), window.reshape(n, Sw + wpad, d), scale=d ** -0.5,
                    **tuning.gather_options(n, "v41_fp4" if pool.dtype == jnp.uint8 else "bf16"))
    return o.reshape(B, S, H, d)


def _rows_kernel(q: jax.Array, pool: jax.Array, rows: jax.Array, valid: jax.Array, sink: jax.Array,
                 window: jax.Array, *, scale: float, **options) -> jax.Array:
    """``sparse_decode_attention_rows`` with the window as an operand (:func:`kernel_call` takes statics by
    keyword only); ``options``: ``tuning.gather_options``."""
    from pallas_kernels.attention.decode_sm90 import sparse_decode_attention_rows

    return sparse_decode_attention_rows(q, pool, rows, valid, sink, scale=scale, window=window, **options)


def attend_selected(q: jax.Array, kv: jax.Array, win_mask: jax.Array, rows: jax.Array, row_mask: jax.Array,
                    sink: jax.Array, impl: str = "jnp") -> jax.Array:
    """:func:`attend` with each query's own compressed rows instead of a mask over all of them (sparse attention).

    q ``[B,S,H,d]``; kv ``[B,Sw,d]`` window rows with ``win_mask`` ``[S,Sw]`` (or ``[B,S,Sw]``), or each query's
    own ``[B,S,Sw,d]`` with ``[B,S,Sw]`` (:func:`_window_term`); rows ``[B,S,K,d]``
    the compressed rows query ``s`` selected (its top-k, gathered) with ``row_mask`` ``[B,S,K]`` (False: no entry);
    sink ``[H]``. Returns o ``[B,S,H,d]`` (q's dtype). The same function of the same visible set as
    :func:`attend` (masked entries add nothing there), computed over ``K`` instead of all ``T`` compressed rows.
    ``impl``: ``"jnp"`` (XLA) or ``"pallas"`` (the Mosaic GPU decode kernel; :func:`selected_attention_impl`
    picks one); the two differ by bf16 rounding only.
    """
    B, S, H, d = q.shape
    dt = q.dtype
    scale = d ** -0.5
    wm = win_mask if win_mask.ndim == 3 else win_mask[None]
    if impl == "pallas":
        return _attend_selected_pallas(q, kv, wm, rows, row_mask, sink)
    rows = jnp.where(row_mask[..., None], rows.astype(dt), jnp.zeros((), dt))  # select: see _visible_rows
    c_logits = jnp.where(row_mask[:, None], matmul("bshd,bskd->bhsk", q, rows) * scale, -jnp.inf)
    return _sink_softmax_sum(dt, sink, _window_term(q, kv, wm),
                             (c_logits, lambda p: matmul("bhsk,bskd->bshd", p, rows)))


def use_selected_rows(mode: str, queries: int, topk: int, rows: int) -> bool:
    """Whether a step attends to gathered top-k rows (:func:`attend_selected`) rather than masking all ``rows``
    compressed rows (:func:`attend`). ``mode``: ``"auto"``, ``"sparse"`` or ``"dense"``. ``"auto"`` gathers

    * when ``queries · topk < rows``: the gathered rows are fewer than the rows a dense pass reads (decode steps at
      long context, which are bound by the bytes read), or
    * when the step has at least :data:`COMPUTE_BOUND_QUERIES` queries per row and ``2 · topk ≤ rows``: a prefill
      chunk reads the rows once for all its queries but computes ``queries · rows`` products against
      ``queries · topk`` for the gathered ones (an 8192-token V4.1 chunk over 4096 rows: 8x fewer)."""
    if mode not in ("auto", "sparse", "dense"):
        raise ValueError(f"attention mode must be 'auto', 'sparse' or 'dense', got {mode!r}")
    if mode == "auto":
        return queries * topk < rows or (queries >= COMPUTE_BOUND_QUERIES and 2 * topk <= rows)
    return mode == "sparse"


COMPUTE_BOUND_QUERIES = 64  # queries per row from which a step's attention is counted as compute-bound


def output_projection(p: Mapping[str, Any], o: jax.Array, *, cfg: ModelConfig, rope: RopeTable) -> jax.Array:
    """Inverse RoPE at the query position, then the grouped low-rank output. o ``[B,S,H,d]`` → ``[B,S,D]``."""
    B, S, H, d = o.shape
    G, R = cfg.o_groups, cfg.o_lora_rank
    dt = o.dtype
    o = apply_rope_tail(o, rope.cos[..., None, :], rope.sin[..., None, :], inverse=True)
    o = o.reshape(B, S, G, H * d // G)
    config = None if active_tile() else grouped_kernel_config(o, p["wo_a"])
    if config is not None:   # wo_a read as stored: a bf16 copy per step moves 5x its FP8 bytes (written, read)
        z = kernel_grouped_linear(o, p["wo_a"], config).astype(dt)
    else:
        wo_a = as_dense(p["wo_a"], dt).reshape(G, R, H * d // G)

        def grouped(o: jax.Array) -> jax.Array:
            return matmul("...gi,gri->...gr", o, wo_a).astype(dt)

        z = token_tiled(grouped, o, lead=2) if active_tile() else grouped(o)
    return linear(z.reshape(B, S, G * R), p["wo_b"])
