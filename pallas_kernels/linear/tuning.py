"""Block table of the FP8 linear kernel, by token count and weight shape.

Not yet measured on the H200 (the first GPU run of ``scripts/bench_kernels.py linear`` fills it): the sizes follow
the expert kernel's single-warpgroup rows (``pallas_kernels/moe/tuning.py``), which ran at 79% of copy bandwidth
for 64 decode tokens and 76% of bf16 peak at prefill in their warp-specialised form.
"""

from __future__ import annotations

from pallas_kernels.linear.kernel_sm90 import LinearConfig

NUM_SMS = 132                 # H200
SMEM_LIMIT = 227 * 1024       # bytes of shared memory a Hopper CTA may use
DECODE_MAX_TOKENS = 256       # up to this many tokens a call is weight-bandwidth bound: small token tiles, split K


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


__all__ = ["DECODE_MAX_TOKENS", "config_for"]
