"""Decode attention over paged compressed rows at real dimensions: masking all rows vs gathering each query's top-k.

``python scripts/bench_kernels.py attention [--contexts 4096 32768 131072] [--batches 1 64] [--out DIR]``

One CSA-style decode step of DeepSeek-V4-Flash (64 heads, K = V latent 512, top-k 512, ratio 4, window 128, bf16
rows) and of V4.1-Flash (the same shapes with ratio 2 and rows in DeepInfer's ``v41_fp4`` bytes, 288 B, decoded
after the read), per context length and batch, timed on the device (CUPTI) for the pieces that differ between the
two ways a query can read the compressed rows (``LayerOptions.attention``):

* ``dense``: every page of the sequence read (``cache_io.pages_read``), decoded, and attended with the top-k as a
  mask (``attention.attend``): O(context) per query;
* ``sparse``: only the selected rows gathered through the page table (``cache_io.pages_gather``), decoded, and
  attended (``attention.attend_selected``): O(top-k + window);
* ``gather + kernel`` (on a GPU): the same gather and decode, then the Mosaic GPU decode kernel
  (``attend_selected(impl="pallas")``, ``pallas_kernels/attention``) — the model's GPU path;
* ``kernel alone`` (on a GPU): the Mosaic GPU kernel by itself (``sparse_decode_attention``) on rows already
  gathered, decoded to bf16 and laid out as the model lays them out (reads ``(window + top-k)·d·2`` bytes per
  query);
* ``indexer``: the lightning indexer's scores over every compressed row (V4: fp32 index keys) and its top-k
  (``attention.index_scores``, ``csa2.topk_select``): O(context) for both modes.

Bytes per step (what a kernel must read at least): dense T·row + window; sparse k·row + window; indexer T·key.
GB/s = those bytes over the device time, against the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dinfer_jax.engine.kv_formats import decode, encode  # noqa: E402
from dinfer_jax.models import load_config  # noqa: E402
from dinfer_jax.models.attention import (  # noqa: E402
    RopeTable,
    attend,
    attend_selected,
    index_scores,
    selected_kernel_unsupported,
)
from dinfer_jax.models.cache_codec import RowCodec  # noqa: E402
from dinfer_jax.models.cache_io import pages_gather, pages_read  # noqa: E402
from dinfer_jax.models.csa2 import topk_select  # noqa: E402
from dinfer_jax.models.ops import rope_cos_sin, rope_inv_freq  # noqa: E402
from pallas_kernels.attention.decode_sm90 import (  # noqa: E402
    sparse_decode_attention,
    sparse_decode_attention_rows,
    traffic,
)
from pallas_kernels.attention.reference import sparse_decode_attention_ref  # noqa: E402
from pallas_kernels.attention.tuning import decode_options  # noqa: E402

BLOCK = 128  # tokens per page (DeepInfer's default)


def _interleaved_pages(B: int, pages_per_seq: int) -> jax.Array:
    """Page tables ``[B, pages_per_seq]`` int32: sequence b's i-th page is pool page ``1 + i·B + b`` (the sequences'
    pages interleaved in the pool, page 0 left as the null page)."""
    return (1 + jnp.arange(pages_per_seq)[None, :] * B + jnp.arange(B)[:, None]).astype(jnp.int32)


def _case(cfg, ratio: int, codec: RowCodec, B: int, context: int, key):
    """Random pools, page tables (each sequence's pages contiguous, sequences interleaved), queries and a top-k."""
    rpb = BLOCK // ratio
    pages_per_seq = -(-context // BLOCK)
    T = pages_per_seq * rpb
    n_blocks = B * pages_per_seq + 1
    ks = jax.random.split(key, 8)
    d, H, W = cfg.head_dim, cfg.num_heads, cfg.sliding_window
    rows = jax.random.normal(ks[0], (n_blocks * rpb, d), jnp.float32)
    pool = codec.pack(rows.astype(jnp.bfloat16)).reshape(1, n_blocks, rpb, -1)
    pages = _interleaved_pages(B, pages_per_seq)
    q = jax.random.normal(ks[1], (B, 1, H, d), jnp.bfloat16)
    win = jax.random.normal(ks[2], (B, W, d), jnp.bfloat16)
    wmask = jnp.ones((B, 1, W), bool)
    sink = jax.random.normal(ks[3], (H,), jnp.float32)
    visible = context // ratio
    k, n = cfg.index_topk, min(cfg.index_topk, visible)       # fewer visible rows than k: −1 fill, as topk_select
    idx = jnp.sort(jax.vmap(lambda kk: jax.random.choice(kk, visible, (n,), replace=False))(
        jax.random.split(ks[4], B)), axis=-1).astype(jnp.int32)
    idx = jnp.pad(idx, ((0, 0), (0, k - n)), constant_values=-1)[:, None, :]           # [B,1,k]
    return dict(pool=pool, pages=pages, q=q, win=win, wmask=wmask, sink=sink, idx=idx, T=T, visible=visible)


def _dense(codec: RowCodec, pool, pages, q, win, wmask, idx, sink, visible):
    ckv = codec.unpack(pages_read(pool, jnp.int32(0), pages))
    T = ckv.shape[1]
    sel = jnp.zeros((idx.shape[0], 1, T), bool).at[jnp.arange(idx.shape[0])[:, None, None], 0, idx].set(True)
    cmask = sel & (jnp.arange(T) < visible)
    return attend(q, win, wmask, ckv, cmask, sink)


def _sparse(codec: RowCodec, pool, pages, q, win, wmask, idx, sink, impl: str = "jnp"):
    rows = codec.unpack(pages_gather(pool, jnp.int32(0), pages, idx))
    return attend_selected(q, win, wmask, rows, idx >= 0, sink, impl=impl)


def _kernel_rows(codec: RowCodec, pool, pages, idx, win, wmask):
    """The kernel's own input for one decode query per sequence: window then selected rows, decoded to bf16, padded
    to a multiple of 64, masked rows zeroed (``keys [B, L, d]``, ``valid [B, L]``), as the model lays them out."""
    rows = codec.unpack(pages_gather(pool, jnp.int32(0), pages, idx))[:, 0].astype(jnp.bfloat16)
    keys = jnp.concatenate([win, rows], axis=1)
    valid = jnp.concatenate([wmask[:, 0], idx[:, 0] >= 0], axis=1)
    pad = (-keys.shape[1]) % 64
    keys, valid = jnp.pad(keys, ((0, 0), (0, pad), (0, 0))), jnp.pad(valid, ((0, 0), (0, pad)))
    return jnp.where(valid[..., None], keys, jnp.zeros((), keys.dtype)), valid


def _indexer_case(cfg, B: int, context: int, ratio: int, key):
    rpb = BLOCK // ratio
    pages_per_seq = -(-context // BLOCK)
    n_blocks = B * pages_per_seq + 1
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    ks = jax.random.split(key, 6)
    p = {"wq_b": jax.random.normal(ks[0], (Hi * di, cfg.q_lora_rank), jnp.bfloat16) * 0.02,
         "weights_proj": jax.random.normal(ks[1], (Hi, cfg.hidden_size), jnp.bfloat16) * 0.02}
    ikv = jax.random.normal(ks[2], (1, n_blocks, rpb, di), jnp.float32)
    pages = _interleaved_pages(B, pages_per_seq)
    h = jax.random.normal(ks[3], (B, 1, cfg.hidden_size), jnp.bfloat16)
    cq = jax.random.normal(ks[4], (B, 1, cfg.q_lora_rank), jnp.bfloat16)
    pos = jnp.full((B, 1), context - 1, jnp.int32)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn))
    return dict(p=p, ikv=ikv, pages=pages, h=h, cq=cq, pos=pos, cos=cos, sin=sin)


def _indexer(cfg, ratio: int, p, ikv, pages, h, cq, pos, cos, sin):
    keys = pages_read(ikv, jnp.int32(0), pages)
    scores = index_scores(p, h, cq, keys, pos, cfg=cfg, ratio=ratio, rope=RopeTable(cos, sin))
    return topk_select(scores, cfg.index_topk)[0]


def bench_attention(args, device_times, copy_bw: float) -> list[dict]:
    """Rows of the table: per model, batch and context, dense / sparse / indexer device ms and GB/s."""
    rows = []
    models = [("deepseek-v4-flash", 4, None), ("deepseek-v4.1-flash", 2, "v41_fp4")]
    for name, ratio, fmt in models:
        cfg = load_config(name)
        codec = RowCodec(cfg.head_dim, jnp.bfloat16, fmt, reciprocal=False)
        row_bytes = codec.stored[0] * codec.stored[1].itemsize
        win_bytes = cfg.sliding_window * cfg.head_dim * 2
        for B in args.batches:
            for C in args.contexts:
                c = _case(cfg, ratio, codec, B, C, jax.random.key(C + B))
                dense = jax.jit(functools.partial(_dense, codec, visible=c["visible"]))
                sparse = jax.jit(functools.partial(_sparse, codec))
                a = (c["pool"], c["pages"], c["q"], c["win"], c["wmask"], c["idx"], c["sink"])
                got = np.asarray(sparse(*a), np.float32)
                want = np.asarray(dense(*a), np.float32)
                err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                t_dense, _ = device_times(dense, *a)
                t_sparse, _ = device_times(sparse, *a)
                # the model's GPU path: the same gather, then the Mosaic GPU kernel (pallas_kernels/attention)
                t_kernel = err_kernel = t_alone = float("nan")
                if selected_kernel_unsupported(c["q"]) is None:
                    kernel = jax.jit(functools.partial(_sparse, codec, impl="pallas"))
                    got_k = np.asarray(kernel(*a), np.float32)
                    err_kernel = float(np.abs(got_k - got).max() / max(np.abs(got).max(), 1e-30))
                    t_kernel, _ = device_times(kernel, *a)
                    keys, valid = jax.jit(functools.partial(_kernel_rows, codec))(
                        c["pool"], c["pages"], c["idx"], c["win"], c["wmask"])
                    # the organisation the model takes for these rows (the model's path above uses the same rule)
                    alone = jax.jit(functools.partial(sparse_decode_attention, scale=cfg.head_dim ** -0.5,
                                                      **decode_options(*keys.shape[:2])))
                    t_alone, _ = device_times(alone, c["q"][:, 0], keys, valid, c["sink"])
                    del keys, valid
                del c
                ic = _indexer_case(cfg, B, C, ratio, jax.random.key(7))
                ix = jax.jit(functools.partial(_indexer, cfg, ratio))
                t_ix, _ = device_times(ix, ic["p"], ic["ikv"], ic["pages"], ic["h"], ic["cq"], ic["pos"],
                                       ic["cos"], ic["sin"])
                T = -(-C // BLOCK) * (BLOCK // ratio)
                b_dense = B * (T * row_bytes + win_bytes)
                b_sparse = B * (cfg.index_topk * row_bytes + win_bytes)
                b_ix = B * T * cfg.index_head_dim * 4
                b_alone = B * (cfg.index_topk + cfg.sliding_window) * cfg.head_dim * 2
                row = dict(model=name, batch=B, context=C, rows=T, row_bytes=row_bytes, dense_ms=t_dense,
                           sparse_ms=t_sparse, kernel_ms=t_kernel, kernel_rel_err=err_kernel,
                           indexer_ms=t_ix, max_rel_err=err,
                           dense_GBps=b_dense / t_dense / 1e6, sparse_GBps=b_sparse / t_sparse / 1e6,
                           kernel_GBps=b_sparse / t_kernel / 1e6, kernel_alone_ms=t_alone,
                           kernel_alone_GBps=b_alone / t_alone / 1e6,
                           indexer_GBps=b_ix / t_ix / 1e6, copy_GBps=copy_bw / 1e9)
                rows.append(row)
                print(json.dumps(row), flush=True)
                del ic
    return rows


def table(rows: list[dict]) -> str:
    head = ("| model | batch | context | compressed rows | dense ms | sparse ms | dense / sparse | sparse GB/s "
            "(% copy) | gather + kernel ms | gather + kernel GB/s (% copy) | kernel alone ms | kernel alone GB/s "
            "(% copy) | indexer ms | indexer GB/s (% copy) | "
            "max rel. err (sparse vs dense; kernel vs sparse) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            "---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['rows']} | {r['dense_ms']:.3f} | "
                     f"{r['sparse_ms']:.3f} | {r['dense_ms'] / r['sparse_ms']:.1f}× | {r['sparse_GBps']:.0f} "
                     f"({100 * r['sparse_GBps'] / r['copy_GBps']:.0f}%) | {r['kernel_ms']:.3f} | "
                     f"{r['kernel_GBps']:.0f} ({100 * r['kernel_GBps'] / r['copy_GBps']:.0f}%) | "
                     f"{r['kernel_alone_ms']:.4f} | "
                     f"{r['kernel_alone_GBps']:.0f} ({100 * r['kernel_alone_GBps'] / r['copy_GBps']:.0f}%) | "
                     f"{r['indexer_ms']:.3f} | "
                     f"{r['indexer_GBps']:.0f} ({100 * r['indexer_GBps'] / r['copy_GBps']:.0f}%) | "
                     f"{r['max_rel_err']:.1e}; {r['kernel_rel_err']:.1e} |")
    return "\n".join(lines)


# The decode kernel by itself (``bench_kernels.py attention-kernel``): the organisations of
# pallas_kernels/attention/decode_sm90.py at the real size, labels → keyword arguments.
KERNEL_VARIANTS = {
    "split_cta": dict(organisation="split_cta"),
    "split_cluster": dict(organisation="split_cluster"),
    "split_cta early": dict(organisation="split_cta", early_release=True),
    "split_cta bkv=32 stages=4": dict(organisation="split_cta", block_kv=32, num_stages=4),
    "split_cta bkv=32 stages=4 early": dict(organisation="split_cta", block_kv=32, num_stages=4, early_release=True),
    "shared_qk": dict(organisation="shared_qk"),
    "shared_qk l_split=2": dict(organisation="shared_qk", l_split=2),
    "shared_qk l_split=5": dict(organisation="shared_qk", l_split=5),
    "shared_qk l_split=10": dict(organisation="shared_qk", l_split=10),
    "pingpong bkv=32 stages=4": dict(organisation="pingpong", block_kv=32, num_stages=4),
    "pingpong bkv=64 stages=2": dict(organisation="pingpong", block_kv=64, num_stages=2),
    "pingpong bkv=32 stages=2": dict(organisation="pingpong", block_kv=32, num_stages=2),
    "seesaw": dict(organisation="seesaw"),
    "seesaw l_split=2": dict(organisation="seesaw", l_split=2),
}
SMALL_BATCH_ONLY = ("shared_qk l_split=5", "shared_qk l_split=10")   # many parts only pay off with few tokens
MODEL_RULE = "model rule"   # what the model calls at this N (pallas_kernels.attention.tuning.decode_options)


def _kernel_case(n: int, h: int, d: int, rows: int, key):
    """Random bf16 queries and rows, ~95% of the rows valid (a decode query's window + top-k), a random sink."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = jax.random.normal(k1, (n, h, d), jnp.bfloat16)
    kv = jax.random.normal(k2, (n, rows, d), jnp.bfloat16)
    valid = jax.random.uniform(k3, (n, rows)) < 0.95
    sink = jax.random.normal(k4, (h,), jnp.float32)
    return q, kv, valid, sink


@functools.partial(jax.jit, static_argnames="scale")
def _error_scale(q, kv, valid, sink, *, scale: float):
    """``A[n,h,c] = Σ_l p[n,h,l] · |kv[n,l,c]|`` in fp32 (exact-enough probabilities), the per-element error scale
    of tests/test_decode_attention_gpu.py."""
    s = jnp.einsum("nhd,nld->nhl", q.astype(jnp.float32), kv.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.maximum(s.max(-1), sink[None, :])
    e = jnp.exp(s - m[..., None])
    p = e / (e.sum(-1) + jnp.exp(sink[None, :] - m))[..., None]
    return jnp.einsum("nhl,nld->nhd", p, jnp.abs(kv.astype(jnp.float32)), precision=jax.lax.Precision.HIGHEST)


def bench_decode_kernel(batches, device_times, copy_bw: float, *, h: int = 64, d: int = 512, rows: int = 640,
                        variants=None, on_row=lambda rows: None) -> list[dict]:
    """Rows of :func:`kernel_table`: per batch N and variant of the decode kernel, the device time of the whole call
    (mask preparation, the kernel, the combine of ``l_split``) and of the Mosaic GPU kernel alone, GB/s of
    :func:`traffic`'s bytes over the call time against ``copy_bw`` (bytes/s, measured in the same run), TFLOP/s
    useful and executed, and the error against the ``jnp`` reference: max of ``|kernel − ref| / (2^-6 · A + 2^-14 ·
    max A)`` (≤ 1 passes, the GPU test's bound) and max ``|kernel − ref|`` over max ``|ref|``."""
    out = []
    scale = d ** -0.5
    for n in batches:
        args = _kernel_case(n, h, d, rows, jax.random.key(n))
        want = jax.jit(functools.partial(sparse_decode_attention_ref, scale=scale))(*args).astype(jnp.float32)
        a = _error_scale(*args, scale=scale)
        bound = 2.0 ** -6 * a + 2.0 ** -14 * a.max()
        for label in variants or [*KERNEL_VARIANTS, MODEL_RULE]:
            kw = decode_options(n, rows) if label == MODEL_RULE else KERNEL_VARIANTS[label]
            if label in SMALL_BATCH_ONLY and variants is None and n > 8:
                continue
            row = dict(batch=n, heads=h, d=d, rows=rows, copy_GBps=copy_bw / 1e9,
                       variant=f"{label}: {kw}" if label == MODEL_RULE else label)
            def measure(row=row, kw=kw, args=args, want=want, bound=bound, n=n):
                f = jax.jit(functools.partial(sparse_decode_attention, scale=scale, **kw))
                got = f(*args).astype(jnp.float32)
                err = jnp.abs(got - want)
                row["err_over_bound"] = float((err / bound).max())
                row["rel_err"] = float(err.max() / jnp.abs(want).max())
                ms, per_kernel = device_times(f, *args)
                kernel_ms = sum(t for k, t in per_kernel.items() if "sparse_decode_attention" in k) or float("nan")
                shape_kw = {k: v for k, v in kw.items() if k in ("v_split", "organisation", "l_split")}
                t = traffic(n, h, d, rows, **shape_kw)     # block_kv, stages, early_release: the same bytes
                row.update(call_us=ms * 1e3, kernel_us=kernel_ms * 1e3, kernels=per_kernel,
                           GBps=t["bytes"] / (ms * 1e-3) / 1e9,
                           TFLOPs_useful=t["flops_useful"] / (ms * 1e-3) / 1e12,
                           TFLOPs_executed=t["flops_executed"] / (ms * 1e-3) / 1e12)
                row["pct_copy"] = 100 * row["GBps"] * 1e9 / copy_bw

            _record(row, measure, out, on_row)
    return out


def _record(row: dict, measure, out: list[dict], on_row) -> None:
    """Runs ``measure()`` (which fills ``row``), keeps the error instead where it raises (one variant failing to
    compile must not end the run), appends ``row`` to ``out``, prints it and hands ``out`` to ``on_row``."""
    try:
        measure()
    except Exception as e:  # noqa: BLE001 - one variant failing (compile, ptxas) must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    out.append(row)
    print(json.dumps(row, default=str)[:600], flush=True)
    on_row(out)


GATHER_VARIANTS = ("XLA pool[rows] + kernel", "kernel on pre-gathered rows", "gathered in kernel",
                   "gathered in kernel, early release")
FP4_GATHER_VARIANTS = ("v41_fp4: XLA gather + decode + kernel", "v41_fp4: gathered + decoded in kernel")
# the gathering producer's pipeline depth: with 64-row steps only 2 stages fit at d = 512, so one step's copies are
# in flight while the other is computed on; 32-row steps in 3 or 4 stages keep 2 or 3 in flight
DEPTH_VARIANTS = {"gathered in kernel, early, 32-row steps × 3": dict(block_kv=32, num_stages=3),
                  "gathered in kernel, early, 32-row steps × 4": dict(block_kv=32, num_stages=4)}
# the FP4 producer loads, decodes and stores one step at a time; staged, the next step's rows are in flight (cp.async
# into shared memory) while this one is decoded
# up to tuning.SMALL_N_MAX queries (and above tuning.SPLIT_CTA_MAX) the model's rule is shared_qk: XLA's gather then
# that kernel, against its gathering form (each CTA fetching its part of the rows)
SMALL_N_VARIANTS = ("shared_qk rule: XLA pool[rows] + kernel", "shared_qk rule: gathered in kernel",
                    "shared_qk rule, v41_fp4: XLA gather + decode + kernel",
                    "shared_qk rule, v41_fp4: gathered + decoded in kernel")
FP4_DEPTH_VARIANTS = {"v41_fp4: gathered + decoded, 32-row steps × 4": dict(block_kv=32, num_stages=4),
                      "v41_fp4: staged a step ahead, 32-row steps × 4": dict(block_kv=32, num_stages=4,
                                                                            fp4_prefetch=True)}


def bench_gathered(batches, device_times, copy_bw: float, *, h: int = 64, d: int = 512, rows: int = 640,
                   pool_rows: int = 1 << 18, variants=None, on_row=lambda rows: None) -> list[dict]:
    """Rows of :func:`gathered_table`: the decode kernel reading each query's ``rows`` rows from a bf16 pool of
    ``pool_rows`` rows (256K rows of 1 KiB by default, far beyond L2) through random indices — XLA's gather
    ``pool[rows]`` then the kernel (the model's way for bf16 caches), the kernel alone on the gathered rows, and
    ``sparse_decode_attention_rows`` (the gather inside the kernel: ``cp.async`` into the swizzled tiles), without and
    with early release; then the same rows stored as ``v41_fp4`` bytes (V4.1), gathered and decoded by XLA before
    the kernel or by the kernel itself. GB/s of :func:`traffic`'s bytes with the rows as stored (1 KiB or 288 B a
    row, read once) over the call time against ``copy_bw``; ``equal``: the output is bit-equal to the kernel on
    the XLA-gathered (and decoded) rows. ``variants``: labels to time (default: all that apply to the batch)."""
    out = []
    scale = d ** -0.5
    early = dict(organisation="split_cta", early_release=True)
    for n in batches:
        k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(n), 5)
        q = jax.random.normal(k1, (n, h, d), jnp.bfloat16)
        pool = jax.random.normal(k2, (pool_rows, d), jnp.bfloat16)
        idx = jax.random.randint(k3, (n, rows), 0, pool_rows, jnp.int32)
        valid = jax.random.uniform(k4, (n, rows)) < 0.95
        sink = jax.random.normal(k5, (h,), jnp.float32)
        kv = jax.block_until_ready(pool[idx])
        want = sparse_decode_attention(q, kv, valid, sink, scale=scale, **early)
        calls = {
            GATHER_VARIANTS[0]: (jax.jit(lambda q, p, i, v, s: sparse_decode_attention(
                q, p[i], v, s, scale=scale, **early)), (q, pool, idx, valid, sink)),
            GATHER_VARIANTS[1]: (jax.jit(functools.partial(sparse_decode_attention, scale=scale, **early)),
                                 (q, kv, valid, sink)),
            GATHER_VARIANTS[2]: (jax.jit(functools.partial(sparse_decode_attention_rows, scale=scale)),
                                 (q, pool, idx, valid, sink)),
            GATHER_VARIANTS[3]: (jax.jit(functools.partial(sparse_decode_attention_rows, scale=scale,
                                                           early_release=True)), (q, pool, idx, valid, sink)),
        }
        # V4.1's rows as stored (v41_fp4 bytes): decoded by XLA after its gather, or by the kernel as it fetches them
        data, scales = encode(pool, "v41_fp4")
        fp4 = jnp.concatenate([data, scales], axis=1)

        def xla_fp4(q, p, i, v, s, nb=d // 2, block_kv=64, options=early):
            g = p[i]
            return sparse_decode_attention(q, decode(g[..., :nb], g[..., nb:], "v41_fp4", dtype=jnp.bfloat16), v, s,
                                           scale=scale, block_kv=block_kv, **options)

        want_fp4 = jax.jit(xla_fp4)(q, fp4, idx, valid, sink)
        calls[FP4_GATHER_VARIANTS[0]] = (jax.jit(xla_fp4), (q, fp4, idx, valid, sink))
        calls[FP4_GATHER_VARIANTS[1]] = (jax.jit(functools.partial(sparse_decode_attention_rows, scale=scale,
                                                                   early_release=n > 8)), (q, fp4, idx, valid, sink))
        # 32-row steps sum the softmax in another order: their reference is the kernel on the gathered rows in
        # 32-row steps
        references = {}
        for label, kw in DEPTH_VARIANTS.items():
            calls[label] = (jax.jit(functools.partial(sparse_decode_attention_rows, scale=scale, early_release=True,
                                                      **kw)), (q, pool, idx, valid, sink))
            references[label] = sparse_decode_attention(q, kv, valid, sink, scale=scale, **early,
                                                        block_kv=kw["block_kv"])
        for label, kw in FP4_DEPTH_VARIANTS.items():
            calls[label] = (jax.jit(functools.partial(sparse_decode_attention_rows, scale=scale,
                                                      early_release=n > 8, **kw)), (q, fp4, idx, valid, sink))
            references[label] = jax.jit(functools.partial(xla_fp4, block_kv=kw["block_kv"]))(q, fp4, idx, valid,
                                                                                               sink)
        rule = decode_options(n, rows)
        if rule["organisation"] == "shared_qk":
            # the model's shared_qk rule (few queries, L split; or above SPLIT_CTA_MAX queries, one CTA a query),
            # gathering in each CTA, in one stage (two stages do not fit beside the gathering form's index rows at
            # d = 512: 234,048 of 232,448 B)
            calls[SMALL_N_VARIANTS[0]] = (jax.jit(lambda q, p, i, v, s, rule=rule: sparse_decode_attention(
                q, p[i], v, s, scale=scale, **rule)), (q, pool, idx, valid, sink))
            calls[SMALL_N_VARIANTS[1]] = (jax.jit(functools.partial(sparse_decode_attention_rows, scale=scale,
                                                                    num_stages=1, **rule)),
                                          (q, pool, idx, valid, sink))
            references[SMALL_N_VARIANTS[0]] = references[SMALL_N_VARIANTS[1]] = sparse_decode_attention(
                q, kv, valid, sink, scale=scale, **rule)
            calls[SMALL_N_VARIANTS[2]] = (jax.jit(functools.partial(xla_fp4, options=rule)),
                                          (q, fp4, idx, valid, sink))
            calls[SMALL_N_VARIANTS[3]] = (jax.jit(functools.partial(sparse_decode_attention_rows, scale=scale,
                                                                    num_stages=1, **rule)),
                                          (q, fp4, idx, valid, sink))
            references[SMALL_N_VARIANTS[2]] = references[SMALL_N_VARIANTS[3]] = jax.jit(
                functools.partial(xla_fp4, options=rule))(q, fp4, idx, valid, sink)
        t = traffic(n, h, d, rows)
        # the stored bytes of the rows: 1 KiB (bf16) or 288 B (v41_fp4) a row, + queries, mask, sink, output
        fp4_bytes = t["bytes"] - n * rows * d * 2 + n * rows * fp4.shape[1]
        for label, (f, args) in calls.items():
            if variants is not None and label not in variants:
                continue
            row = dict(batch=n, heads=h, d=d, rows=rows, pool_rows=pool_rows, copy_GBps=copy_bw / 1e9, variant=label)
            fp4_row = label in FP4_GATHER_VARIANTS or label in FP4_DEPTH_VARIANTS or label in SMALL_N_VARIANTS[2:]
            nbytes = fp4_bytes if fp4_row else t["bytes"]
            reference = references.get(label, want_fp4 if fp4_row else want)

            def measure(row=row, f=f, args=args, nbytes=nbytes, reference=reference):
                row["equal"] = bool(jnp.array_equal(f(*args), reference))
                ms, per_kernel = device_times(f, *args)
                row.update(call_us=ms * 1e3, kernels=per_kernel, GBps=nbytes / (ms * 1e-3) / 1e9)
                row["pct_copy"] = 100 * row["GBps"] * 1e9 / copy_bw

            _record(row, measure, out, on_row)
    return out


def gathered_table(rows: list[dict]) -> str:
    lines = [f"copy bandwidth measured in this run: {rows[0]['copy_GBps']:.0f} GB/s" if rows else "", "",
             "| N | H × d | L | pool rows | variant | call µs | GB/s (% copy) | bit-equal to XLA gather + kernel |",
             "|---:|---|---:|---:|---|---:|---:|---|"]
    return "\n".join(lines + _variant_lines(
        rows, lambda r: f"| {r['batch']} | {r['heads']} × {r['d']} | {r['rows']} | {r['pool_rows']} | {r['variant']} |",
        lambda r: f"{r['call_us']:.1f} | {r['GBps']:.0f} ({r['pct_copy']:.0f}%) | {r['equal']} |", 3))


def kernel_table(rows: list[dict]) -> str:
    lines = [f"copy bandwidth measured in this run: {rows[0]['copy_GBps']:.0f} GB/s" if rows else "", "",
             "| N | H × d | L | variant | call µs | kernel µs | GB/s (% copy) | TFLOP/s useful (executed) "
             "| max err / bound vs ref | max rel. err |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    return "\n".join(lines + _variant_lines(
        rows, lambda r: f"| {r['batch']} | {r['heads']} × {r['d']} | {r['rows']} | {r['variant']} |",
        lambda r: f"{r['call_us']:.1f} | {r['kernel_us']:.1f} | {r['GBps']:.0f} ({r['pct_copy']:.0f}%) | "
                  f"{r['TFLOPs_useful']:.0f} ({r['TFLOPs_executed']:.0f}) | {r['err_over_bound']:.2f} | "
                  f"{r['rel_err']:.1e} |", 6))


def _variant_lines(rows: list[dict], head, cells, n_cells: int) -> list[str]:
    """Table lines of benchmark rows: ``head(r)`` then ``cells(r)``, or FAILED with the row's error and
    ``n_cells`` empty cells for a variant that did not run."""
    return [f"{head(r)} FAILED: {r['error'][:160]} |" + " |" * (n_cells - 1) if "error" in r
            else f"{head(r)} {cells(r)}" for r in rows]


# One prefill chunk (``bench_kernels.py prefill-attention``): V4.1-Flash attention of S query tokens starting at
# position ``start`` over the window (a ring of W entries, then the chunk) and the compressed rows (v41_fp4 bytes,
# ratio 2), per way the model can compute it.
PREFILL_VARIANTS = ("dense, shared window", "dense, per-query window", "sparse, per-query window",
                    "sparse + kernel, per-query window")


def _prefill_case(cfg, codec: RowCodec, S: int, start: int, key):
    """Random ring + chunk window keys with their mask (as ``layers._window`` builds it), one sequence's compressed
    rows as stored bytes, per-query top-k indices among the visible rows (sorted, −1 fill), queries and a sink."""
    ratio, d, H, W, K = 2, cfg.head_dim, cfg.num_heads, cfg.sliding_window, cfg.index_topk
    ks = jax.random.split(key, 6)
    pos = start + jnp.arange(S)[None]                                          # [1,S]
    rpos = start - 1 - jnp.mod(start - 1 - jnp.arange(W), W)[None]             # ring of W entries
    keys = jax.random.normal(ks[0], (1, W + S, d), jnp.bfloat16)
    kpos = jnp.concatenate([rpos, pos], axis=1)
    kvalid = jnp.concatenate([rpos >= 0, jnp.ones((1, S), bool)], axis=1)
    wmask = kvalid[:, None] & (kpos[:, None] <= pos[..., None]) & (kpos[:, None] > pos[..., None] - W)
    T = (start + S) // ratio
    stored = codec.pack(jax.random.normal(ks[1], (T, d), jnp.float32).astype(jnp.bfloat16))[None]   # [1,T,bytes]
    visible = (pos + 1) // ratio                                               # [1,S]
    scores = jnp.where(jnp.arange(T) < visible[..., None], jax.random.uniform(ks[2], (1, S, T)), -jnp.inf)
    val, idx = jax.lax.top_k(scores, min(K, T))                                # distinct rows, as topk_select
    idx = jnp.sort(jnp.where(val > -jnp.inf, idx, T), axis=-1)
    idx = jnp.where(idx < T, idx, -1).astype(jnp.int32)
    fill = jnp.where(idx[0] >= 0, idx[0], T)                                   # −1 → a column dropped below
    cmask = jnp.zeros((1, S, T + 1), bool).at[0, jnp.arange(S)[:, None], fill].set(True)[..., :T]
    q = jax.random.normal(ks[3], (1, S, H, d), jnp.bfloat16)
    sink = jax.random.normal(ks[4], (H,), jnp.float32)
    return dict(keys=keys, wmask=wmask, stored=stored, idx=idx, cmask=cmask, q=q, sink=sink, pos=pos,
                start=jnp.full((1,), start, jnp.int32), T=T)


def _prefill_variant(label: str, codec: RowCodec, W: int):
    """The jitted computation of one :data:`PREFILL_VARIANTS` entry, from the stored rows on (gather/decode
    included, as the model's step does)."""
    from dinfer_jax.models.attention_invariant import window_rows
    from dinfer_jax.models.cache_io import take_rows

    def f(q, keys, wmask, stored, idx, cmask, sink, start, pos):
        if "per-query" in label:
            keys, wmask = window_rows(keys, wmask, start, pos, W)
        if label.startswith("dense"):
            return attend(q, keys, wmask, codec.unpack(stored), cmask, sink)
        impl = "pallas" if "kernel" in label else "jnp"
        return attend_selected(q, keys, wmask, codec.unpack(take_rows(stored, idx)), idx >= 0, sink, impl=impl)
    return jax.jit(f)


def bench_prefill(chunks, device_times, ceil: dict, on_row=lambda rows: None) -> list[dict]:
    """Rows of :func:`prefill_table`: per chunk ``(S, start)`` and variant, device ms, query tokens/s, TFLOP/s of
    the minimal work (``4·H·(W + k)·d`` per query: QK and PV over the window and the top-k) against the bf16 peak
    measured in the same run, and the error against the ``dense, shared window`` output (max over max |ref|)."""
    cfg = load_config("deepseek-v4.1-flash")
    codec = RowCodec(cfg.head_dim, jnp.bfloat16, "v41_fp4", reciprocal=False)
    out = []
    for S, start in chunks:
        c = _prefill_case(cfg, codec, S, start, jax.random.key(S + start))
        a = tuple(c[k] for k in ("q", "keys", "wmask", "stored", "idx", "cmask", "sink", "start", "pos"))
        ref = None
        flops = 4 * cfg.num_heads * (cfg.sliding_window + cfg.index_topk) * cfg.head_dim * S
        for label in PREFILL_VARIANTS:
            row = dict(S=S, start=start, rows=c["T"], variant=label, bf16_TFLOPs=ceil["bf16_TFLOPs"])
            try:
                if "kernel" in label and selected_kernel_unsupported(c["q"]) is not None:
                    raise RuntimeError(selected_kernel_unsupported(c["q"]))
                f = _prefill_variant(label, codec, cfg.sliding_window)
                got = np.asarray(f(*a), np.float32)
                if ref is None:
                    ref = got
                row["rel_err"] = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
                ms, _ = device_times(f, *a)
                row.update(ms=ms, tokens_per_s=S / (ms * 1e-3), TFLOPs_minimal=flops / (ms * 1e-3) / 1e12)
            except Exception as e:  # noqa: BLE001 - a variant failing (memory, compile) must not end the run
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out.append(row)
            print(json.dumps(row), flush=True)
            on_row(out)
        del c, a
    return out


def prefill_table(rows: list[dict]) -> str:
    lines = [f"bf16 matmul peak measured in this run: {rows[0]['bf16_TFLOPs']:.0f} TFLOP/s" if rows else "", "",
             "| chunk tokens | start | compressed rows | variant | ms | query tokens/s | TFLOP/s minimal (% peak) "
             "| max rel. err vs dense shared |", "|---:|---:|---:|---|---:|---:|---:|---:|"]
    return "\n".join(lines + _variant_lines(
        rows, lambda r: f"| {r['S']} | {r['start']} | {r['rows']} | {r['variant']} |",
        lambda r: f"{r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['TFLOPs_minimal']:.0f} "
                  f"({100 * r['TFLOPs_minimal'] / r['bf16_TFLOPs']:.0f}%) | {r['rel_err']:.1e} |", 4))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 0, 8192, 0, 4096, 28672], metavar="S START",
                   help="prefill-attention: (chunk tokens, start position) pairs")
    p.add_argument("--variants", nargs="+", default=None, choices=[*KERNEL_VARIANTS, MODEL_RULE],
                   help="attention-kernel: the decode kernel's variants to time (default: all, the l_split=5/10 "
                        "ones at batches ≤ 8 only)")
