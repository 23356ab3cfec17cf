"""Lightning-indexer scores over FP4 index-key rows (DeepInfer's ``fp4_index`` bytes): Mosaic GPU kernel for Hopper
(:mod:`pallas_kernels.indexer.scores_sm90`) and its pure-``jnp`` reference (:mod:`pallas_kernels.indexer.reference`)."""
