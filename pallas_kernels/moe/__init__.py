"""Routed-expert kernel: padded expert-sorted layout, Mosaic GPU grouped GEMM with in-register FP4 dequantisation,
jnp reference."""
