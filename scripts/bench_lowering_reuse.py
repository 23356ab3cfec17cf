"""Lowering time of programs that share kernels, with and without reusing kernel lowerings across programs
(``pallas_kernels/lowering_reuse.py``; ``docs/perf/compile_time_gpu.md``). Lowers for CUDA, so it runs on a machine
without a GPU. Each program has two FP8 linears, one routed-expert layer and one mHC Sinkhorn at fixed shapes
and differs from the others outside them (as the engine's page-width buckets do)::

    python3 scripts/bench_lowering_reuse.py [--programs 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import lowering_reuse  # noqa: E402
from pallas_kernels.lowering_reuse import kernel_call, reuse_kernel_lowerings  # noqa: E402


def sample_program(variant: int) -> Any:
    """The program: the shapes of ``tests/test_linear_kernel_cpu.py`` and ``tests/test_moe_kernel_cpu.py``, each
    kernel called as the model calls it (through :func:`kernel_call`)."""
    from pallas_kernels.linear.kernel_sm90 import fp8_linear_sm90
    from pallas_kernels.linear.tuning import config_for
    from pallas_kernels.mhc.sinkhorn_sm90 import sinkhorn_projection
    from pallas_kernels.moe.kernel_sm90 import experts_sm90
    from pallas_kernels.moe.tuning import configs_for

    up, down = configs_for(16 * 6)

    def step(x_a, w_a, s_a, x_b, w_b, s_b, x, ids, rw, w1, w3, w2, comb):
        a = kernel_call(fp8_linear_sm90, x_a, w_a, s_a, config=config_for(16, 4096, 1280), block=(32, 32))
        b = kernel_call(fp8_linear_sm90, x_b, w_b, s_b, config=config_for(1, 512, 4096), block=(128, 128))
        y = kernel_call(experts_sm90, x, ids, rw, w1, w3, w2, swiglu_limit=10.0, up_config=up, down_config=down)
        c = kernel_call(sinkhorn_projection, comb, iters=20, eps=1e-6)
        return jnp.tanh(y).sum() + a.sum() + b.sum() + c.sum() + variant

    return step


def sample_args() -> tuple[Any, ...]:
    """Abstract operands of :func:`sample_program` (FP8 weights with UE8M0 scales, FP4 experts)."""
    from pallas_kernels.moe import reference

    s = jax.ShapeDtypeStruct
    g, d, i = 16, 1024, 512

    def fp4w(o: int, inn: int) -> Any:
        return reference.ExpertWeight(s((g, o, inn // 2), jnp.uint8), s((g, o, inn // 32), jnp.uint8), "fp4")

    return (s((16, 1280), jnp.bfloat16), s((4096, 1280), jnp.float8_e4m3fn), s((128, 40), jnp.float8_e8m0fnu),
            s((1, 4096), jnp.bfloat16), s((512, 4096), jnp.float8_e4m3fn), s((4, 32), jnp.float8_e8m0fnu),
            s((16, d), jnp.bfloat16), s((16, 6), jnp.int32), s((16, 6), jnp.float32), fp4w(i, d), fp4w(i, d),
            fp4w(d, i), s((64, 1, 4, 4), jnp.float32))


def lower_for_cuda(variant: int, platform: str | None) -> str:
    """StableHLO text of :func:`sample_program` lowered for CUDA, reusing kernel lowerings for ``platform``
    (None: each program lowers its kernels)."""
    with reuse_kernel_lowerings(platform):
        return jax.jit(sample_program(variant)).trace(*sample_args()).lower(lowering_platforms=("cuda",)).as_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=4)
    args = ap.parse_args()
    n = args.programs
    print(f"jax {jax.__version__}; seconds to lower each program for CUDA, in order")
    print("| kernel lowerings | " + " | ".join(f"program {i + 1}" for i in range(n)) + " |")
    print("|---|" + "---:|" * n)
    for platform, what in ((None, "each program lowers its kernels"), ("cuda", "reused")):
        lowering_reuse._exported.cache_clear()
        times = []
        for v in range(n):
            t0 = time.perf_counter()
            lower_for_cuda(v + (n if platform else 0), platform)
            times.append(time.perf_counter() - t0)
        print(f"| {what} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
