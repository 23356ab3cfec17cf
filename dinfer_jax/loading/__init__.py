"""Checkpoint I/O: safetensors (with FP8/FP4), release/transformers names, dequantisation, orbax save/restore."""

from dinfer_jax.loading.loader import checkpoint_has_mtp, load_params, place_host_value
from dinfer_jax.loading.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "checkpoint_has_mtp", "load_params", "place_host_value"]
