"""FP8 linear layer on the accelerator: the Mosaic GPU kernel (``pallas_kernels/linear``) against the model's XLA
path (``dinfer_jax.models.ops.linear`` on a ``QuantizedWeight``: XLA fuses the dequantisation into an autotuned
GEMM). Run through ``python scripts/bench_kernels.py linear [--tokens N ...] [--out DIR]``.

Per (tokens, weight shape): device time of the whole call (CUPTI; for the kernel that includes the scale
expansion and the split-K sum), compile time of a fresh jit of each (XLA's includes its GEMM autotuning, which is
why the kernel exists), GB/s of the weight bytes (codes + scales) against the copy bandwidth measured in the same
run, TFLOP/s against the measured bf16 peak, and the kernel's error against the XLA path relative to the output's
scale (both multiply exact bf16 weights by bf16 activations with fp32 sums).
"""

from __future__ import annotations

import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# (name, N, K, scale block) of the FP8 linears in V4-Flash and V4.1-Flash layers
SHAPES = [("v4 wq_a", 1024, 4096, (128, 128)), ("v4 wq_b", 32768, 1024, (128, 128)),
          ("v4 wkv", 512, 4096, (128, 128)), ("v4 wo_a", 8192, 4096, (128, 128)),
          ("v4 wo_b", 4096, 8192, (128, 128)), ("v4 shared w1", 2048, 4096, (128, 128)),
          ("v4 shared w2", 4096, 2048, (128, 128)), ("v4.1 wq_a", 1280, 5120, (32, 32)),
          ("v4.1 wq_b", 32768, 1280, (32, 32)), ("v4.1 wkv", 25600, 6144, (32, 32))]


def _weight(key, n: int, k: int, block: tuple[int, int]):
    from dinfer_jax.models.qweights import QuantizedWeight

    k1, k2 = jax.random.split(key)
    codes = jax.random.randint(k1, (n, k), 0, 0x7E, jnp.int32).astype(jnp.uint8)       # finite positive codes
    codes = jnp.where(jax.random.bernoulli(k2, 0.5, (n, k)), codes | 0x80, codes)      # and their negatives
    codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    sbits = jax.random.randint(k2, (-(-n // block[0]), -(-k // block[1])), 112, 124, jnp.int32).astype(jnp.uint8)
    scale = jax.lax.bitcast_convert_type(sbits, jnp.float8_e8m0fnu)
    return codes, scale, QuantizedWeight(codes, scale, "fp8", block)


def _compile_s(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0


def bench_linear(tokens_list: list[int], device_times, copy_bw: float, peak_flops: float,
                 on_row=lambda rows: None) -> list[dict]:
    from dinfer_jax.models.ops import linear
    from pallas_kernels.linear.kernel_sm90 import fp8_linear_sm90
    from pallas_kernels.linear.tuning import config_for

    rows: list[dict] = []
    for name, n, k, block in SHAPES:
        codes, scale, qw = _weight(jax.random.key(n + k), n, k, block)
        wbytes = codes.nbytes + scale.nbytes
        for t in tokens_list:
            row = dict(shape=name, n=n, k=k, tokens=t)
            try:
                x = jax.random.normal(jax.random.key(t), (t, k), jnp.bfloat16)
                cfg = config_for(t, n, k)
                row["config"] = f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} split{cfg.split_k} s{cfg.stages}"

                def kern(x, c, s, cfg=cfg, block=block):
                    return fp8_linear_sm90(x, c, s, config=cfg, block=block)

                def xla(x, w):
                    return linear(x, w, jnp.float32)

                row["kernel_compile_s"] = _compile_s(kern, x, codes, scale)
                row["xla_compile_s"] = _compile_s(xla, x, qw)
                kj, xj = jax.jit(kern), jax.jit(xla)
                row["kernel_ms"], _ = device_times(kj, x, codes, scale)
                row["xla_ms"], _ = device_times(xj, x, qw)
                got, want = np.asarray(kj(x, codes, scale)), np.asarray(xj(x, qw))
                sc = float(np.abs(want).max()) or 1.0
                row["err_max"] = float(np.abs(got - want).max()) / sc
                row["err_mean"] = float(np.abs(got - want).mean()) / sc
                for key in ("kernel", "xla"):
                    sec = row[f"{key}_ms"] * 1e-3
                    row[f"{key}_GBps"] = wbytes / sec / 1e9
                    row[f"{key}_TFLOPs"] = 2 * t * n * k / sec / 1e12
                row["copy_GBps"], row["peak_TFLOPs"] = copy_bw / 1e9, peak_flops / 1e12
            except Exception as e:  # noqa: BLE001 - one failing shape must not lose the rest of the table
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
            print(row, flush=True)
            on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| weight | N × K | tokens | kernel config | kernel ms | XLA ms | kernel GB/s (% copy) "
             "| kernel TFLOP/s (% peak) | compile s kernel / XLA | err max / mean |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        head = f"| {r['shape']} | {r['n']} × {r['k']} | {r['tokens']} |"
        if "error" in r:
            lines.append(f"{head} FAILED: {r['error'][:100]} | | | | | | |")
            continue
        lines.append(f"{head} {r['config']} | {r['kernel_ms']:.4f} | {r['xla_ms']:.4f} | "
                     f"{r['kernel_GBps']:.0f} ({100 * r['kernel_GBps'] / r['copy_GBps']:.0f}%) | "
                     f"{r['kernel_TFLOPs']:.1f} ({100 * r['kernel_TFLOPs'] / r['peak_TFLOPs']:.0f}%) | "
                     f"{r['kernel_compile_s']:.1f} / {r['xla_compile_s']:.1f} | "
                     f"{r['err_max']:.1e} / {r['err_mean']:.1e} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Block-size sweep at decode shapes (``python scripts/bench_kernels.py linear-sweep --tokens 64``)
#
# Why: at 64 tokens the kernel reached only 24-34% of copy on the H200 with the block table's one configuration
# per shape (docs/perf/linear_kernel_h200.md), and the FP8 linears are 0.43-0.53 ms of a V4-Flash slice's batch-64
# decode step (docs/perf/serving_h200.md). Each configuration is timed the way a decode step uses it: one call per
# weight, over enough distinct copies of the weight (>= 120 MB, or 32 copies) that little of one is still in L2 when
# it is read again.

# the model's V4 decode calls, largest first (wo_a runs grouped: attention.output_projection)
SWEEP_SHAPES = [("v4 wq_b", 32768, 1024, (128, 128)), ("v4 wo_b", 4096, 8192, (128, 128)),
                ("v4 wo_a grouped 8", 8192, 4096, (128, 128)), ("v4 shared w1", 2048, 4096, (128, 128)),
                ("v4 shared w2", 4096, 2048, (128, 128)), ("v4 wq_a", 1024, 4096, (128, 128)),
                ("v4 wkv", 512, 4096, (128, 128))]
SWEEP_BYTES = 120e6   # > twice the H100's / H200's 50 MB L2


def _phase1(tokens: int, n: int, k: int) -> list:
    """Tile sizes, pipeline depth and CTAs per SM at the block table's K split."""
    from pallas_kernels.linear.kernel_sm90 import LinearConfig
    from pallas_kernels.linear.tuning import config_for

    base = config_for(tokens, n, k)
    out = [base]
    for bn in (64, 128):
        for bk, stages in ((128, 2), (128, 3), (128, 4), (128, 6), (64, 8)):
            for ctas in (1, 2):
                out.append(LinearConfig(base.block_m, bn, bk, base.split_k, stages, ctas))
    return out


def _phase2(best, n: int, k: int) -> list:
    """The best phase-1 configuration at other K splits (powers of two, 1-32)."""
    from pallas_kernels.linear.kernel_sm90 import LinearConfig

    return [LinearConfig(best.block_m, best.block_n, best.block_k, s, best.stages, best.ctas_per_sm)
            for s in (1, 2, 4, 8, 16, 32) if s != best.split_k]


def _valid(cfg, n: int, k: int) -> bool:
    from pallas_kernels.linear.tuning import SMEM_LIMIT

    try:
        cfg.check(n, k)
    except ValueError:
        return False
    # two CTAs share the SM's 228 KiB, each with 1 KiB reserved
    return cfg.smem_bytes(k) <= (SMEM_LIMIT if cfg.ctas_per_sm == 1 else 113 * 1024)


def _cfg_label(cfg) -> str:
    extra = f" x{cfg.ctas_per_sm}" if cfg.ctas_per_sm > 1 else ""
    return f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} split{cfg.split_k} s{cfg.stages}{extra}"


def _reference(case: dict) -> np.ndarray:
    """XLA's fp32 product of the case's activations and its first weight copy, dequantised (an independent path:
    no kernel), per group for the grouped form."""
    from dinfer_jax.models.qweights import QuantizedWeight, dequantize

    codes, scale = case["ws"][0]
    dense = dequantize(QuantizedWeight(codes, scale, "fp8", case["block"]), jnp.float32)
    x = case["x"].astype(jnp.float32)
    if case["grouped"]:
        g = x.shape[1]
        out = jnp.einsum("mgk,grk->mgr", x, dense.reshape(g, -1, dense.shape[1]), precision=jax.lax.Precision.HIGHEST)
    else:
        out = jnp.dot(x, dense.T, precision=jax.lax.Precision.HIGHEST)
    return np.asarray(out)


def _time_config(cfg, case: dict, device_times, copy_bw: float) -> dict:
    """One configuration on one (shape, tokens) case: device time per call (kernel, scale bytes, split-K sum) and
    of the kernel alone, averaged over the case's weight copies, and the first copy's max error against
    :func:`_reference` relative to the output's scale (a wrong configuration shows as order 1; exact ones ~1e-6)."""
    from pallas_kernels.linear.kernel_sm90 import fp8_grouped_linear_sm90, fp8_linear_sm90
    from pallas_kernels.lowering_reuse import kernel_call, reuse_kernel_lowerings

    fn = fp8_grouped_linear_sm90 if case["grouped"] else fp8_linear_sm90
    block, copies = case["block"], case["copies"]

    def calls(x, ws):
        with reuse_kernel_lowerings("cuda"):
            return [kernel_call(fn, x, c, s, config=cfg, block=block) for c, s in ws]

    row = dict(shape=case["name"], n=case["n"], k=case["k"], tokens=case["tokens"], config=_cfg_label(cfg),
               rule=cfg == case["rule"], copies=copies)
    try:
        f = jax.jit(calls)
        got, want = np.asarray(f(case["x"], case["ws"])[0]), case["want"]
        row["err"] = float(np.abs(got - want).max() / (np.abs(want).max() or 1.0))
        total, per_name = device_times(f, case["x"], case["ws"])
        row["ms"] = total / copies
        row["kernel_ms"] = sum(v for key, v in per_name.items() if "fp8_linear" in key) / copies
        row["GBps"] = case["wbytes"] / (row["ms"] * 1e-3) / 1e9
        row["copy_GBps"] = copy_bw / 1e9
    except Exception as e:  # noqa: BLE001 - one failing configuration must not lose the sweep
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(row, flush=True)
    return row


def sweep_linear(tokens_list: list[int], device_times, copy_bw: float, on_row=lambda rows: None) -> list[dict]:
    """Every configuration of :func:`_phase1`, then :func:`_phase2` around the fastest, per V4 decode shape."""
    from pallas_kernels.linear.tuning import config_for

    rows: list[dict] = []
    for name, n, k, block in SWEEP_SHAPES:
        grouped = "grouped" in name
        codes, scale, _ = _weight(jax.random.key(n + k), n, k, block)
        wbytes = codes.nbytes + scale.nbytes
        copies = int(min(32, max(2, -(-SWEEP_BYTES // wbytes))))
        ws = [(jnp.array(codes, copy=True), jnp.array(scale, copy=True)) for _ in range(copies)]
        for t in tokens_list:
            case = dict(name=name, n=n, k=k, block=block, grouped=grouped, tokens=t, wbytes=wbytes, copies=copies,
                        ws=ws, rule=config_for(t, n, k),
                        x=jax.random.normal(jax.random.key(t), (t, 8, k) if grouped else (t, k), jnp.bfloat16))
            case["want"] = _reference(case)
            timed = []
            for cfg in dict.fromkeys(_phase1(t, n, k)):
                if _valid(cfg, n, k):
                    rows.append(_time_config(cfg, case, device_times, copy_bw))
                    on_row(rows)
                    if "ms" in rows[-1]:
                        timed.append((rows[-1]["ms"], cfg))
            if timed:
                for cfg in _phase2(min(timed, key=lambda p: p[0])[1], n, k):
                    if _valid(cfg, n, k):
                        rows.append(_time_config(cfg, case, device_times, copy_bw))
                        on_row(rows)
    return rows


def sweep_table(rows: list[dict]) -> str:
    """One row per configuration, the block table's marked `rule`, the fastest per (shape, tokens) in bold."""
    best: dict[tuple, float] = {}
    for r in rows:
        if "ms" in r:
            key = (r["shape"], r["tokens"])
            best[key] = min(best.get(key, float("inf")), r["ms"])
    lines = ["| weight | N × K | tokens | config | ms / call | kernel ms | GB/s (% copy) | vs rule | max err |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    rule_ms = {(r["shape"], r["tokens"]): r["ms"] for r in rows if r.get("rule") and "ms" in r}
    for r in rows:
        head = f"| {r['shape']} | {r['n']} × {r['k']} | {r['tokens']} |"
        label = r["config"] + (" (rule)" if r.get("rule") else "")
        if "error" in r:
            lines.append(f"{head} {label} | FAILED: {r['error'][:80]} | | | | |")
            continue
        key = (r["shape"], r["tokens"])
        ms = f"**{r['ms']:.4f}**" if r["ms"] == best[key] else f"{r['ms']:.4f}"
        vs = f"{rule_ms[key] / r['ms']:.2f}x" if key in rule_ms else "-"
        lines.append(f"{head} {label} | {ms} | {r['kernel_ms']:.4f} | {r['GBps']:.0f} "
                     f"({100 * r['GBps'] / r['copy_GBps']:.0f}%) | {vs} | {r['err']:.1e} |")
    return "\n".join(lines)
