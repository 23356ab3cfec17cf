"""Block table of the FP8 linear kernel, by token count and weight shape.

The sizes follow the expert kernel's single-warpgroup rows (``pallas_kernels/moe/tuning.py``). Measured on the H200
(``docs/perf/linear_kernel_h200.md``): against XLA's autotuned GEMM fusions the kernel is 1.2–3.7× faster up to 64
tokens on every V4 / V4.1 linear shape but one (V4.1 ``wq_a`` at 1 token), mixed at 256 tokens and 2–3× slower
at 8192 (one warpgroup, no warp specialisation: 235–404 TFLOP/s against XLA's 700–780). So the model takes the
kernel only up to :data:`KERNEL_MAX_TOKENS` tokens a call and keeps XLA's GEMMs above.
"""

from __future__ import annotations

from pallas_kernels.linear.kernel_sm90 import LinearConfig

NUM_SMS = 132                 # H200
SMEM_LIMIT = 227 * 1024       # bytes of shared memory a Hopper CTA may use
DECODE_MAX_TOKENS = 256       # up to this many tokens a call is weight-bandwidth bound: small token tiles, split K
KERNEL_MAX_TOKENS = 64        # measured crossover: above it XLA's GEMM is as fast or faster (module docstring)


def _split_k(n: int, k: int, block_n: int, block_k: int, block_m: int) -> int:
    """The smallest power-of-two K split that gives every SM a work item (``n / block_n`` row blocks alone may
    not), keeping ≥ 2 pipeline steps per split and the partial sums' traffic (fp32 ``[split, n, block_m]``
    written and read back: ``8 · split · block_m / k`` of the weight's FP8 bytes) within a quarter of the weight's."""
    s = 1
    while (n // block_n) * s < NUM_SMS:
        nxt = 2 * s
        if k % (block_k * nxt) or k // (block_k * nxt) < 2 or 8 * nxt * block_m > k // 4:
            break
        s = nxt
    return s


def config_for(tokens: int, n: int, k: int) -> LinearConfig:
    """The tile configuration for ``tokens`` rows times a ``[n, k]`` weight; ValueError when no block size
    divides the shape (the caller then keeps XLA's GEMM)."""
    if tokens <= DECODE_MAX_TOKENS:
        bm = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
        cfg = LinearConfig(bm, 64, 128, _split_k(n, k, 64, 128, bm), 4)
    else:
        cfg = LinearConfig(128, 64, 128, 1, 4)
    while cfg.smem_bytes(k) > SMEM_LIMIT and cfg.stages > 2:
        cfg = LinearConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.stages - 1)
    cfg.check(n, k)
    if cfg.smem_bytes(k) > SMEM_LIMIT:
        raise ValueError(f"no FP8 linear tiles fit shared memory for a [{n}, {k}] weight")
    return cfg


__all__ = ["DECODE_MAX_TOKENS", "KERNEL_MAX_TOKENS", "config_for"]
