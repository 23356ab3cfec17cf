"""Decode attention over gathered rows (DeepSeek-V4 MQA, shared latent K = V, per-head sink): Mosaic GPU kernel
for Hopper (:mod:`pallas_kernels.attention.decode_sm90`) and its pure-``jnp`` reference
(:mod:`pallas_kernels.attention.reference`)."""
