"""mHC Sinkhorn projection: Mosaic GPU kernel for Hopper (:mod:`pallas_kernels.mhc.sinkhorn_sm90`) and its
pure-``jnp`` reference (:mod:`pallas_kernels.mhc.reference`)."""
