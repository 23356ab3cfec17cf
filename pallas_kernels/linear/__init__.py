"""FP8 block-scaled linear layer (DeepSeek's released FP8 weights): a Mosaic GPU kernel beside its ``jnp``
reference."""
