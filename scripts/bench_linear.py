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
