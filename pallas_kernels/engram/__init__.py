"""Engram row gather from line tables: a Mosaic GPU kernel that reads table rows where they lie — device memory or
pinned host memory (:mod:`pallas_kernels.engram.gather_sm90`) — and its pure-``jnp`` reference with the line
layout (:mod:`pallas_kernels.engram.reference`)."""
