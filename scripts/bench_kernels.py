"""Kernel benchmarks on the accelerator: ``python scripts/bench_kernels.py moe [--tokens N ...] [--sweep N ...]
[--out DIR]``, ``python scripts/bench_kernels.py attention [--contexts N ...] [--batches N ...] [--out DIR]``,
``python scripts/bench_kernels.py attention-kernel [--batches N ...] [--variants ...] [--out DIR]``,
``python scripts/bench_kernels.py attention-rows [--batches N ...] [--out DIR]``,
``python scripts/bench_kernels.py prefill-attention [--chunks S START ...] [--out DIR]``,
``python scripts/bench_kernels.py indexer [--contexts N ...] [--batches N ...] [--out DIR]``,
``python scripts/bench_kernels.py linear [--tokens N ...] [--out DIR]``,
``python scripts/bench_kernels.py linear-sweep [--tokens N ...] [--out DIR]``,
``python scripts/bench_kernels.py topk [--out DIR]``,
``python scripts/bench_kernels.py sampler [--out DIR]``.

``sampler``: the sampler's top-p / top-k filters, two whole-vocabulary sorts against the 1,024-candidate decision
(``scripts/bench_sampler.py`` says what is measured).

``topk``: the indexer's top-k selection, ``lax.top_k`` against the selection through group maxima
(``scripts/bench_topk.py`` says what is measured).

``indexer``: the lightning indexer over paged keys, fp32 against bf16 products, and its top-k
(``scripts/bench_indexer.py`` says what is measured).

``linear``: the FP8 linear kernel (``pallas_kernels/linear``) against the model's XLA path at the V4 / V4.1 linear
shapes (``scripts/bench_linear.py`` says what is measured). ``linear-sweep``: the kernel's block sizes, pipeline
depth, CTAs per SM and K split at the V4 decode shapes, each timed over weight copies that do not fit in L2
(``bench_linear.sweep_linear``).

``attention``: decode attention over paged compressed rows, masked vs gathered top-k, and the indexer
(``scripts/bench_attention.py`` says what is measured).

``attention-kernel``: the Mosaic GPU decode-attention kernel alone (``pallas_kernels/attention/decode_sm90.py``) at
the real size (64 heads × 512, L = 640 rows per token; default batches 1 and 64), both organisations
(``split_cta``, ``shared_qk``, and ``shared_qk`` with L split over CTAs) in one run: device time of the call and of
the kernel, GB/s and % of the copy bandwidth measured in the same run, TFLOP/s, error against the reference
(``bench_attention.bench_decode_kernel``).

``attention-rows``: the decode-attention kernel reading its rows from a bf16 pool by index — XLA's gather then the
kernel, the kernel alone on gathered rows, and the gather inside the kernel (``sparse_decode_attention_rows``),
with bit-equality to the kernel on the gathered rows (``bench_attention.bench_gathered``).

``prefill-attention``: one V4.1-Flash prefill chunk's attention (window + compressed rows, from the stored bytes
on) computed the ways the model can: all rows masked with the shared or each query's own window, the gathered top-k
in XLA, or through the Mosaic GPU kernel (``bench_attention.bench_prefill``).

``moe``: the routed-expert kernel (``pallas_kernels.moe``) at V4-Flash expert shapes (256 experts, hidden 4096,
expert width 2048, top-6, MXFP4 weights):

* ceilings measured in the same run: device-to-device copy bandwidth and a bf16 8192³ matmul;
* correctness of every variant against the ``jnp`` reference (bf16 compute, fp32 reference on the same
  dequantised weights; max and mean error relative to the output's scale);
* decode shapes (1, 16, 64, 256 tokens): GB/s of the expert weight bytes the routing touches (FP4 codes + UE8M0
  scales of each distinct expert) over the kernel time, as a fraction of the measured copy bandwidth;
* prefill (8192 tokens): TFLOP/s (2·3·tokens·k·D·I) as a fraction of the measured bf16 peak;
* baseline: XLA's ``ragged_dot`` on bf16 weights (decode shapes).

Times are per-kernel device times from CUPTI (``jax.experimental.mosaic.gpu.profiler``), medians over iterations.
Prints a table and writes it (markdown + JSON) under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.moe import reference  # noqa: E402
from pallas_kernels.moe.fp4_mma import to_mma_layout  # noqa: E402
from pallas_kernels.moe.kernel_sm90 import TileConfig, experts_sm90  # noqa: E402
from pallas_kernels.moe.tuning import pick_configs  # noqa: E402


def device_times(f, *args, iterations: int = 10) -> tuple[float, dict[str, float]]:
    """Median total device time per call (ms) and the median per kernel name, from CUPTI."""
    from jax.experimental.mosaic.gpu import profiler
    _, per_iter = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    totals = [sum(t for _, t in it) for it in per_iter]
    names: dict[str, list[float]] = {}
    for it in per_iter:
        for name, t in it:
            names.setdefault(name, []).append(t)
    return statistics.median(totals), {k: statistics.median(v) for k, v in names.items()}


def wall_time(f, *args, iterations: int = 20) -> float:
    jax.block_until_ready(f(*args))
    t = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3


def ceilings() -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second, the best of an XLA elementwise pass and a
    device-to-device copy) and the bf16 matmul rate, measured here."""
    n = 1 << 30
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)   # 2 GiB
    ms, _ = device_times(jax.jit(lambda a: a + jnp.bfloat16(1)), x)
    bw_xla = 2 * x.nbytes / (ms * 1e-3)
    del x
    bw_copy = 0.0
    try:  # the image's PyTorch gives the plain cudaMemcpy device-to-device figure
        import torch
        a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(10):
            b.copy_(a)
        ev[1].record()
        torch.cuda.synchronize()
        bw_copy = 2 * a.numel() * 10 / (ev[0].elapsed_time(ev[1]) * 1e-3)
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - torch is optional; the XLA figure stands alone then
        print("torch copy not measured:", e)
    bw = max(bw_xla, bw_copy)
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    ms_mm, _ = device_times(mm, a, b)
    return {"copy_GBps": bw / 1e9, "xla_elementwise_GBps": bw_xla / 1e9, "torch_copy_GBps": bw_copy / 1e9,
            "bf16_TFLOPs": 2 * 8192 ** 3 / (ms_mm * 1e-3) / 1e12}


def random_fp4(key, g: int, out: int, inn: int) -> reference.ExpertWeight:
    """Random MXFP4 experts with scales around 2^-7 (dequantised std ≈ 0.02)."""
    k1, k2 = jax.random.split(key)
    data = jax.random.bits(k1, (g, out, inn // 2), jnp.uint8)
    sbits = jax.random.randint(k2, (g, out, inn // 32), 118, 122, jnp.int32).astype(jnp.uint8)
    return reference.ExpertWeight(data, sbits, "fp4")


def routing(key, n: int, g: int, k: int):
    k1, k2 = jax.random.split(key)
    scores = jax.random.uniform(k1, (n, g))
    _, ids = jax.lax.top_k(scores, k)
    w = jax.random.uniform(k2, (n, k), jnp.float32, 0.1, 1.0)
    return ids.astype(jnp.int32), w


def cpu_reference(x, ids, rw, w1, w3, w2, limit):
    """The reference on the host CPU in fp32 (exact products, no TF32), over just the experts these tokens use."""
    cpu = jax.devices("cpu")[0]
    used, compact = np.unique(np.asarray(ids), return_inverse=True)
    sub = [reference.ExpertWeight(jax.device_put(m.data[used], cpu), jax.device_put(m.scale[used], cpu), m.fmt)
           for m in (w1, w3, w2)]
    with jax.default_device(cpu):
        return reference.experts(jax.device_put(x, cpu), jnp.asarray(compact.reshape(ids.shape), jnp.int32),
                                 jax.device_put(rw, cpu), *sub, swiglu_limit=limit)


def touched_bytes(ids: jax.Array, w1, w3, w2) -> int:
    used = np.unique(np.asarray(ids)).size
    per_expert = sum(m.nbytes for m in (w1, w3, w2)) // w1.shape[0]
    return used * per_expert


def rel_err(got, want) -> tuple[float, float]:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = np.abs(want).max()
    d = np.abs(got - want)
    return float(d.max() / scale), float(d.mean() / scale)


def bench_moe(args, on_row=lambda rows: None) -> list[dict]:
    G, D, I, K = 256, 4096, 2048, 6
    limit = 10.0
    keys = jax.random.split(jax.random.key(42), 4)
    w1, w3 = random_fp4(keys[0], G, I, D), random_fp4(keys[1], G, I, D)
    w2 = random_fp4(keys[2], G, D, I)
    mma = args.decode == "mma"     # the kernel reads the fp4_mma rearrangement; the references the released layout
    kw = [jax.jit(to_mma_layout)(m) for m in (w1, w3, w2)] if mma else [w1, w3, w2]
    token_counts = args.tokens
    rows = []
    for n in token_counts:
        kx, kr = jax.random.split(jax.random.fold_in(keys[3], n))
        x = jax.random.normal(kx, (n, D), jnp.bfloat16)
        ids, rw = routing(kr, n, G, K)
        n_check = min(n, 512)
        ref = jax.jit(functools.partial(reference.experts, swiglu_limit=limit))(
            x[:n_check], ids[:n_check], rw[:n_check], w1, w3, w2)
        ref_cpu = cpu_reference(x[:8], ids[:8], rw[:8], w1, w3, w2, limit)
        nbytes = touched_bytes(ids, w1, w3, w2)
        flops = 2 * 3 * n * K * D * I
        if n <= 256 and not args.no_baseline:
            dense = [jnp.swapaxes(m.dense(jnp.bfloat16), 1, 2) for m in (w1, w3, w2)]
            xla = jax.jit(functools.partial(_xla_ragged, limit=limit))
            try:
                ms, _ = device_times(xla, x, ids, rw, *dense)
                rows.append(dict(tokens=n, variant="XLA ragged_dot bf16 (baseline)", ms=ms,
                                 GBps=_dense_touched(ids, D, I) / (ms * 1e-3) / 1e9, TFLOPs=flops / (ms * 1e-3) / 1e12,
                                 err_max=None, err_mean=None, gemm_ms=None))
            except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
                rows.append(dict(tokens=n, variant="XLA ragged_dot bf16 (baseline)", error=repr(e)[:300]))
            del dense
        variants = [(c, "") for c in pick_configs(n * K, sweep=n in args.sweep)
                    if not mma or (c[0].consumers == 2 and c[1].consumers == 2)]
        if n in args.ablate:   # the table's config and the first warp-specialised candidate, stages removed
            ablated = pick_configs(n * K, sweep=False)[:1] + [c for c in pick_configs(n * K, sweep=True)
                                                              if c[0].consumers == 2][:1]
            variants += [(c, a) for c in ablated for a in ("scale", "decode")
                         if not mma or (a == "scale" and c[0].consumers == 2)]
        for (up_cfg, down_cfg), ablate in variants:
            name = (f"pallas fp4 ({args.decode}) up{_c(up_cfg)} down{_c(down_cfg)}"
                    + (f" ablate={ablate}" if ablate else ""))
            try:
                f = jax.jit(functools.partial(experts_sm90, swiglu_limit=limit, up_config=up_cfg,
                                              down_config=down_cfg, decode="bits" if mma else args.decode,
                                              ablate=ablate))
                t0 = time.perf_counter()
                got = jax.block_until_ready(f(x, ids, rw, *kw))
                compile_s = time.perf_counter() - t0
                emax, emean = rel_err(got[:n_check], ref)
                cmax, cmean = rel_err(got[:8], ref_cpu)
                ms, per_kernel = device_times(f, x, ids, rw, *kw)
                gemm_ms = sum(v for k_, v in per_kernel.items() if k_.startswith("moe_"))
                rows.append(dict(tokens=n, variant=name, ms=ms, gemm_ms=gemm_ms, compile_s=compile_s,
                                 GBps=nbytes / (ms * 1e-3) / 1e9, TFLOPs=flops / (ms * 1e-3) / 1e12,
                                 err_max=emax, err_mean=emean, cpu_err_max=cmax, cpu_err_mean=cmean,
                                 kernels=per_kernel))
            except Exception as e:  # noqa: BLE001 - each variant's failure is recorded and the sweep goes on
                traceback.print_exc(limit=4)
                rows.append(dict(tokens=n, variant=name, error=f"{type(e).__name__}: {str(e)[:400]}"))
            print(json.dumps(rows[-1], default=str)[:600], flush=True)
            on_row(rows)
    return rows


def _dense_touched(ids, D, I) -> int:
    return np.unique(np.asarray(ids)).size * 3 * D * I * 2


def _xla_ragged(x, ids, rw, w1t, w3t, w2t, limit):
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    xs = x[tok]
    sizes = jnp.bincount(flat, length=w1t.shape[0]).astype(jnp.int32)
    g = jax.lax.ragged_dot(xs, w1t, sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, w3t, sizes, preferred_element_type=jnp.float32)
    a = reference.swiglu(g, u, limit).astype(x.dtype)
    y = jax.lax.ragged_dot(a, w2t, sizes, preferred_element_type=jnp.float32) * rw.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[tok].add(y)


def _c(c: TileConfig) -> str:
    ws = " ws" if c.consumers == 2 else ""
    return f"[m{c.block_m} n{c.block_n} k{c.block_k} s{c.stages}{ws}]"


def table(rows: list[dict], ceil: dict[str, float]) -> str:
    lines = [f"ceilings measured in this run: copy {ceil['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s",
             "", "time = all device kernels of the call (routing layout, gathers, both GEMMs, combine); "
             "GEMM = the two Mosaic GPU kernels alone. Errors: max / mean |kernel − reference| over max|reference|, "
             "against the XLA reference on the GPU (first ≤512 tokens) and the fp32 CPU reference (first 8 tokens).",
             "", "| tokens | variant | time ms | GEMM ms | GB/s touched (GEMM) | % copy BW | TFLOP/s (GEMM) "
             "| % bf16 peak "
             "| err vs GPU ref max / mean | err vs CPU fp32 max / mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['variant']} | FAILED: {r['error'][:120]} | | | | | | |")
            continue
        e1 = "" if r.get("err_max") is None else f"{r['err_max']:.1e} / {r['err_mean']:.1e}"
        e2 = "" if r.get("cpu_err_max") is None else f"{r['cpu_err_max']:.1e} / {r['cpu_err_mean']:.1e}"
        gm = r.get("gemm_ms") or r["ms"]
        gbps = r["GBps"] * r["ms"] / gm
        tf = r["TFLOPs"] * r["ms"] / gm
        lines.append(f"| {r['tokens']} | {r['variant']} | {r['ms']:.3f} | {gm:.3f} | {gbps:.0f} | "
                     f"{100 * gbps / ceil['copy_GBps']:.0f}% | {tf:.1f} | "
                     f"{100 * tf / ceil['bf16_TFLOPs']:.1f}% | {e1} | {e2} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["moe", "attention", "attention-kernel", "attention-rows", "prefill-attention",
                                    "indexer", "indexer-sweep", "linear", "linear-sweep", "topk", "sampler"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 8192], help="token counts to run")
    p.add_argument("--sweep", type=int, nargs="*", default=[], help="token counts at which to sweep block sizes")
    p.add_argument("--no-baseline", action="store_true", help="skip the XLA ragged_dot baseline")
    p.add_argument("--decode", default="bits", choices=["bits", "float", "packed", "mma"],
                   help="the kernel's FP4 decode (float: single-warpgroup configs only; packed: warp-specialised "
                        "only; mma: the weights rearranged into the fp4_mma layout, warp-specialised only)")
    p.add_argument("--ablate", type=int, nargs="*", default=[],
                   help="token counts at which to time the kernel without its scale / decode stages")
    p.add_argument("--out", default=None, help="directory for the table (markdown) and raw rows (JSON)")
    p.add_argument("--row-variants", nargs="+", default=None,
                   help="attention-rows: the variants to time, by label (default: every one that applies)")
    p.add_argument("--topk-cases", type=int, nargs="*", default=None,
                   help="topk: indices into bench_topk.CASES (default: all)")
    p.add_argument("--topk-variants", nargs="*", default=None,
                   help="topk: variants of bench_topk.VARIANTS (default: all)")
    p.add_argument("--sampler-batches", type=int, nargs="*", default=None,
                   help="sampler: batch sizes (default: bench_sampler.BATCHES)")
    p.add_argument("--sampler-filters", nargs="*", default=None,
                   help="sampler: labels of bench_sampler.FILTERS (default: all)")
    import bench_attention  # scripts/ is on sys.path when run as a script

    bench_attention.add_arguments(p)
    args = p.parse_args()
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    ceil = ceilings()
    print(ceil, flush=True)

    def saver(name: str, to_table, echo: bool = False):
        """A callback writing ``name``.md (the table) and ``name``.json under ``--out`` after every row, so a run
        cut short by a time limit keeps its results; ``echo``: also print the table's newest row as it comes."""
        def save(rows: list[dict]) -> None:
            if args.out:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"{name}.md").write_text(to_table(rows) + "\n")
                (out / f"{name}.json").write_text(json.dumps({"ceilings": ceil, "rows": rows}, default=str, indent=1))
            if echo:
                print(to_table(rows).splitlines()[-1], flush=True)
        return save

    if args.what == "prefill-attention":
        pairs = list(zip(args.chunks[::2], args.chunks[1::2], strict=True))
        rows = bench_attention.bench_prefill(pairs, device_times, ceil,
                                             on_row=saver("bench_prefill_attention", bench_attention.prefill_table))
        print(bench_attention.prefill_table(rows))
        return
    if args.what == "attention-kernel":
        rows = bench_attention.bench_decode_kernel(args.batches, device_times, ceil["copy_GBps"] * 1e9,
                                                   variants=args.variants,
                                                   on_row=saver("bench_attention_kernel", bench_attention.kernel_table))
        print(bench_attention.kernel_table(rows))
        return
    if args.what == "attention-rows":
        rows = bench_attention.bench_gathered(args.batches, device_times, ceil["copy_GBps"] * 1e9,
                                              variants=args.row_variants,
                                              on_row=saver("bench_attention_rows", bench_attention.gathered_table))
        print(bench_attention.gathered_table(rows))
        return
    if args.what == "indexer-sweep":
        import bench_indexer

        sweep = bench_indexer.sweep_paged(device_times, ceil["copy_GBps"] * 1e9)
        print(sweep)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_indexer_sweep.md").write_text(sweep + "\n")
        return
    if args.what == "indexer":
        import bench_indexer

        rows = bench_indexer.bench_indexer(args, device_times, ceil["copy_GBps"] * 1e9,
                                           on_row=saver("bench_indexer", lambda r: bench_indexer.table(r) + "\n\n"
                                                        + bench_indexer.kernel_table(r)))
        print(bench_indexer.table(rows))
        print(bench_indexer.kernel_table(rows))
        if jax.default_backend() == "gpu":
            sweep = bench_indexer.sweep_paged(device_times, ceil["copy_GBps"] * 1e9)
            print(sweep)
            if args.out:
                (Path(args.out) / "bench_indexer_sweep.md").write_text(sweep + "\n")
        return
    if args.what == "topk":
        import bench_topk

        cases = bench_topk.CASES if args.topk_cases is None else [bench_topk.CASES[i] for i in args.topk_cases]
        rows = bench_topk.bench_topk(cases, lambda f, *a: device_times(f, *a)[0], ceil["copy_GBps"] * 1e9,
                                     on_row=saver("bench_topk", bench_topk.table, echo=True),
                                     variants=args.topk_variants)
        print(bench_topk.table(rows))
        return
    if args.what == "sampler":
        import bench_sampler

        rows = bench_sampler.bench_sampler(args.sampler_batches or bench_sampler.BATCHES, bench_sampler.VOCAB,
                                           bench_sampler.FILTER_CANDIDATES, lambda f, *a: device_times(f, *a)[0],
                                           wall_time, on_row=saver("bench_sampler", bench_sampler.table, echo=True),
                                           filters=args.sampler_filters)
        print(bench_sampler.table(rows))
        return
    if args.what == "linear-sweep":
        import bench_linear

        rows = bench_linear.sweep_linear(args.tokens, device_times, ceil["copy_GBps"] * 1e9,
                                         on_row=saver("linear_sweep", bench_linear.sweep_table))
        print(bench_linear.sweep_table(rows))
        return
    if args.what == "linear":
        import bench_linear

        rows = bench_linear.bench_linear(args.tokens, device_times, ceil["copy_GBps"] * 1e9,
                                         ceil["bf16_TFLOPs"] * 1e12, on_row=saver("bench_linear", bench_linear.table))
        print(bench_linear.table(rows))
        return
    if args.what == "attention":
        rows = bench_attention.bench_attention(args, device_times, ceil["copy_GBps"] * 1e9)
        text = bench_attention.table(rows)
        print(text)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_attention.md").write_text(text + "\n")
            (out / "bench_attention.json").write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=1))
        return
    rows = bench_moe(args, on_row=saver("bench_moe", lambda rows: table(rows, ceil)))
    print(table(rows, ceil))


if __name__ == "__main__":
    main()
