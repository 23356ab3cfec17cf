"""The lightning indexer of one decode step over paged index keys, at real dimensions, piece by piece.

``python scripts/bench_kernels.py indexer [--contexts 4096 32768 131072] [--batches 1 64] [--out DIR]``

Per model, batch and context, the keys read through the page table as the engine stores them — DeepSeek-V4-Flash:
fp32 values, 512 B a row (ratio 4); V4.1-Flash: DeepInfer's ``fp4_index`` bytes, 68 B a row (ratio 2) — and timed
on the device (CUPTI, medians of 10):

* ``scores, fp32 products``: ``pages_read`` + decode + ``index_scores_of`` with fp32 operands at full precision
  (what every step did before the bf16 path; V4's path still);
* ``scores, bf16 products``: the same with ``fp4_operands=True`` (V4.1: Q4u queries and ``fp4_index`` keys are
  exact in bf16, ``docs/kv_formats.md`` "Indexer operands"); for V4 (unquantised keys) not applicable;
* the Mosaic GPU kernel (``pallas_kernels.indexer``, keys decoded in registers), V4.1 only: ``paged kernel`` — the
  model's GPU path for an index source scoring its own pages (the kernel reads them through the page table) + the
  visibility mask; ``pages_read + kernel`` — the path of index sources scoring another layer's keys (gathered once
  by that layer, timed here per call); ``kernel alone`` — the kernel on rows already gathered;
* ``top-k``: ``csa2.topk_select`` (``lax.top_k``, the sort of the picks and the mask) on the scores alone.

Queries are Q4u-rounded random values (V4.1) or plain random values (V4), head weights random: the work does not
depend on them. Bytes: the stored keys ``B · T · row`` (the least any indexer reads); GB/s against the copy bandwidth
measured in the same run. ``differ``: top-k sets of the bf16 path that are not the fp32 path's (of ``B``).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dinfer_jax.models import load_config  # noqa: E402
from dinfer_jax.models.attention import index_scores_of  # noqa: E402
from dinfer_jax.models.cache_codec import RowCodec  # noqa: E402
from dinfer_jax.models.cache_io import pages_read  # noqa: E402
from dinfer_jax.models.csa2 import topk_select  # noqa: E402
from dinfer_jax.models.fake_quant import q4u_fake  # noqa: E402

BLOCK = 128  # tokens per page (DeepInfer's default)
MODELS = (("deepseek-v4-flash", 4, None), ("deepseek-v4.1-flash", 2, "fp4_index"))


def _case(cfg, codec: RowCodec, ratio: int, B: int, context: int, key) -> dict:
    """Paged keys (sequences' pages interleaved in the pool, page 0 the null page), page tables, queries ``[B,1,Hi,di]``
    fp32, head weights ``[B,1,Hi]``, positions ``[B,1]``."""
    rpb = BLOCK // ratio
    pages_per_seq = -(-context // BLOCK)
    n_blocks = B * pages_per_seq + 1
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    ks = jax.random.split(key, 3)
    keys = jax.random.normal(ks[0], (n_blocks * rpb, di), jnp.float32)
    pool = codec.pack(keys.astype(jnp.bfloat16) if codec.fmt else keys).reshape(1, n_blocks, rpb, -1)
    pages = (1 + jnp.arange(pages_per_seq)[None, :] * B + jnp.arange(B)[:, None]).astype(jnp.int32)
    q = jax.random.normal(ks[1], (B, 1, Hi, di), jnp.float32)
    if codec.fmt:
        q = q4u_fake(q, 32)
    w = jax.random.normal(ks[2], (B, 1, Hi), jnp.float32) * 0.05
    pos = jnp.full((B, 1), context - 1, jnp.int32)
    return dict(pool=pool, pages=pages, q=q, w=w, pos=pos, T=pages_per_seq * rpb)


def _scores(codec: RowCodec, ratio: int, fp4: bool, pool, pages, q, w, pos):
    keys = codec.unpack(pages_read(pool, jnp.int32(0), pages))
    return index_scores_of(q, w, keys, pos, ratio=ratio, fp4_operands=fp4)


def _scores_kernel(ratio: int, pool, pages, q, w, pos):
    from dinfer_jax.models.attention import index_scores_stored

    return index_scores_stored(q, w, pages_read(pool, jnp.int32(0), pages), pos, ratio=ratio)


def _scores_paged(ratio: int, pool, pages, q, w, pos):
    from dinfer_jax.models.attention import index_scores_paged

    return index_scores_paged(q, w, pool, jnp.int32(0), pages, pos, ratio=ratio)


def _kernel_alone(q, w, rows):
    from pallas_kernels.indexer.scores_sm90 import index_scores_rows

    return index_scores_rows(q, w, rows)


def _compare(topk, got, want) -> tuple[float, int]:
    """Max difference relative to the largest finite reference score, and top-k sets that differ."""
    finite = np.isfinite(np.asarray(want))
    scale = float(np.abs(np.asarray(want)[finite]).max())
    err = float(np.abs(np.asarray(got - want)[finite]).max() / max(scale, 1e-30))
    return err, int(np.any(np.asarray(topk(got)) != np.asarray(topk(want)), axis=(1, 2)).sum())


def sweep_paged(device_times, copy_bw: float, batch: int = 64, context: int = 131072,
                tile_rows: tuple[int, ...] = (64, 128), box_bytes: tuple[int, ...] = (16, 128)) -> str:
    """The paged kernel's ``tile_rows`` × ``stages`` × ``splits`` at V4.1-Flash's size: a table of ms and % of
    copy bandwidth on the stored key bytes (page-table reads early, the default; the other placement was measured
    on 2026-12-04 and is within noise)."""
    from pallas_kernels.indexer.scores_sm90 import check_config, index_scores_paged

    cfg = load_config("deepseek-v4.1-flash")
    codec = RowCodec(cfg.index_head_dim, jnp.float32, "fp4_index")
    c = _case(cfg, codec, 2, batch, context, jax.random.key(1))
    key_bytes = batch * c["T"] * 68
    lines = [f"paged kernel alone, V4.1-Flash, batch {batch}, context {context} ({c['T']} rows)", "",
             "| TMA box bytes | tile rows | stages | splits | ms | GB/s | % copy |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for bb, tr in itertools.product(box_bytes, tile_rows):
        default, _ = check_config(batch, 1, cfg.index_n_heads, 128, c["T"], stages=4, splits=None, tile_rows=tr)
        for stages in (2, 4):
            for splits in (default, default * 2):
                if (c["T"] // tr) % splits:
                    continue
                fn = jax.jit(functools.partial(index_scores_paged, stages=stages, splits=splits, tile_rows=tr,
                                               box_bytes=bb))
                t, _ = device_times(fn, c["q"], c["w"], c["pool"], jnp.int32(0), c["pages"])
                gbps = key_bytes / t / 1e6
                lines.append(f"| {bb} | {tr} | {stages} | {splits} | {t:.3f} | {gbps:.0f} | "
                             f"{100 * gbps / (copy_bw / 1e9):.0f}% |")
                print(lines[-1], flush=True)
    return "\n".join(lines)


def _topk(k: int, scores):
    return topk_select(scores, k)[0]


def bench_indexer(args, device_times, copy_bw: float, on_row=lambda rows: None) -> list[dict]:
    """Rows of the table (module docstring)."""
    rows = []
    kernel = getattr(args, "kernel", True) and jax.default_backend() == "gpu"
    for name, ratio, fmt in MODELS:
        cfg = load_config(name)
        codec = RowCodec(cfg.index_head_dim, jnp.float32, fmt)
        row_bytes = codec.stored[0] * codec.stored[1].itemsize
        topk = jax.jit(functools.partial(_topk, cfg.index_topk))
        for B in args.batches:
            for C in args.contexts:
                c = _case(cfg, codec, ratio, B, C, jax.random.key(C + B))
                a = (c["pool"], c["pages"], c["q"], c["w"], c["pos"])
                slow = jax.jit(functools.partial(_scores, codec, ratio, False))
                t_slow, _ = device_times(slow, *a)
                s_slow = slow(*a)
                t_fast = err = t_kern = t_alone = err_k = t_paged = err_p = float("nan")
                differ = differ_k = differ_p = -1
                if fmt is not None:
                    fast = jax.jit(functools.partial(_scores, codec, ratio, True))
                    t_fast, _ = device_times(fast, *a)
                    s_fast = fast(*a)
                    err, differ = _compare(topk, s_fast, s_slow)
                    del s_fast
                    if kernel:
                        kern = jax.jit(functools.partial(_scores_kernel, ratio))
                        t_kern, _ = device_times(kern, *a)
                        err_k, differ_k = _compare(topk, kern(*a), s_slow)
                        paged = jax.jit(functools.partial(_scores_paged, ratio))
                        t_paged, _ = device_times(paged, *a)
                        err_p, differ_p = _compare(topk, paged(*a), s_slow)
                        rows_g = pages_read(c["pool"], jnp.int32(0), c["pages"])
                        t_alone, _ = device_times(jax.jit(_kernel_alone), c["q"], c["w"], rows_g)
                        del rows_g
                t_topk, _ = device_times(topk, s_slow)
                key_bytes = B * c["T"] * row_bytes
                row = dict(model=name, batch=B, context=C, rows=c["T"], row_bytes=row_bytes, keys=fmt or "fp32",
                           scores_fp32_ms=t_slow, scores_bf16_ms=t_fast, topk_ms=t_topk,
                           scores_fp32_GBps=key_bytes / t_slow / 1e6, scores_bf16_GBps=key_bytes / t_fast / 1e6,
                           max_rel_diff=err, topk_sets_differ=differ, copy_GBps=copy_bw / 1e9,
                           scores_kernel_ms=t_kern, kernel_alone_ms=t_alone,
                           scores_kernel_GBps=key_bytes / t_kern / 1e6, kernel_alone_GBps=key_bytes / t_alone / 1e6,
                           kernel_max_rel_diff=err_k, kernel_topk_sets_differ=differ_k,
                           paged_ms=t_paged, paged_GBps=key_bytes / t_paged / 1e6, paged_max_rel_diff=err_p,
                           paged_topk_sets_differ=differ_p)
                rows.append(row)
                print(json.dumps(row), flush=True)
                on_row(rows)
                del c, s_slow
    return rows


def _rate(ms: float, gbps: float, cp: float) -> str:
    return f"{ms:.3f} ({gbps:.0f}, {100 * gbps / cp:.0f}%)" if ms == ms else "—"


def kernel_table(rows: list[dict]) -> str:
    """The kernel's columns, for the rows that have them (V4.1 on a GPU)."""
    lines = ["| model | batch | context | rows | bf16 products ms (GB/s, % copy) | paged kernel ms (GB/s, % copy) | "
             "pages_read + kernel ms (GB/s, % copy) | kernel alone ms (GB/s, % copy) | bf16 / paged | "
             "max rel. diff vs fp32 (paged, rows) | top-k sets differing (paged, rows) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("scores_kernel_ms", float("nan")) != r.get("scores_kernel_ms", float("nan")):
            continue
        cp = r["copy_GBps"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['rows']} | "
                     f"{_rate(r['scores_bf16_ms'], r['scores_bf16_GBps'], cp)} | "
                     f"{_rate(r['paged_ms'], r['paged_GBps'], cp)} | "
                     f"{_rate(r['scores_kernel_ms'], r['scores_kernel_GBps'], cp)} | "
                     f"{_rate(r['kernel_alone_ms'], r['kernel_alone_GBps'], cp)} | "
                     f"{r['scores_bf16_ms'] / r['paged_ms']:.1f}× | "
                     f"{r['paged_max_rel_diff']:.1e}, {r['kernel_max_rel_diff']:.1e} | "
                     f"{r['paged_topk_sets_differ']}, {r['kernel_topk_sets_differ']} of {r['batch']} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| model (keys, B/row) | batch | context | rows | scores, fp32 products ms (GB/s, % copy) | "
             "scores, bf16 products ms (GB/s, % copy) | fp32 / bf16 | top-k ms | max rel. diff bf16 vs fp32 | "
             "top-k sets differing |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cp = r["copy_GBps"]
        fast = (f"{r['scores_bf16_ms']:.3f} ({r['scores_bf16_GBps']:.0f}, {100 * r['scores_bf16_GBps'] / cp:.0f}%)"
                if r["scores_bf16_ms"] == r["scores_bf16_ms"] else "—")
        have = r["scores_bf16_ms"] == r["scores_bf16_ms"]      # NaN: not applicable
        ratio = f"{r['scores_fp32_ms'] / r['scores_bf16_ms']:.1f}×" if have else "—"
        diff = f"{r['max_rel_diff']:.1e}" if r["max_rel_diff"] == r["max_rel_diff"] else "—"
        differ = f"{r['topk_sets_differ']} of {r['batch']}" if r["topk_sets_differ"] >= 0 else "—"
        lines.append(f"| {r['model']} ({r['keys']}, {r['row_bytes']}) | {r['batch']} | {r['context']} | {r['rows']} | "
                     f"{r['scores_fp32_ms']:.3f} ({r['scores_fp32_GBps']:.0f}, {100 * r['scores_fp32_GBps'] / cp:.0f}%)"
                     f" | {fast} | {ratio} | {r['topk_ms']:.3f} | {diff} | {differ} |")
    return "\n".join(lines)
