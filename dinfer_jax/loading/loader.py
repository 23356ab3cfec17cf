"""Stream a Hugging Face V4 checkpoint into the parameter pytree, tensor by tensor.

Each parameter is read from its memory-mapped shard, dequantised if stored as FP8/FP4, cast to its target dtype and
placed on device before the next one is read, so the host never holds a second copy of the model (peak extra host
memory: one parameter, or one layer's stack of experts). Missing, unexpected, mis-shaped and wrongly typed tensors
raise :class:`CheckpointError` with the tensor's name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from dinfer_jax.loading.names import normalize_name
from dinfer_jax.loading.quant import dequant_fp4, dequant_fp8
from dinfer_jax.loading.safetensors_io import CheckpointError, CheckpointFiles
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.params import ParamSpec, map_specs, param_specs
from sharding.rules import Sharder

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_INT_DTYPES = {"I64", "I32", "I16", "I8", "U8"}


class _TensorIndex:
    """Normalised release name → (file, stored name); tracks which tensors were consumed."""

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self.by_name: dict[str, str] = {}
        for raw in files.keys():
            norm = normalize_name(raw)
            if norm in self.by_name:
                raise CheckpointError(f"tensors {self.by_name[norm]!r} and {raw!r} are the same parameter {norm!r}")
            self.by_name[norm] = raw
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.by_name

    def dtype(self, name: str) -> str:
        raw = self.by_name[name]
        return self.files.file_of(raw).dtype_name(raw)

    def read(self, name: str) -> np.ndarray:
        if name not in self.by_name:
            raise CheckpointError(f"missing tensor {name!r} in {self.files.dir}")
        self.used.add(name)
        raw = self.by_name[name]
        return self.files.file_of(raw).get(raw)


def _read_float(idx: _TensorIndex, name: str, shape: tuple[int, ...], block: tuple[int, int]) -> np.ndarray:
    """One float parameter as fp32 (a view when already fp32), dequantising FP8/FP4 storage."""
    if not idx.has(name):
        raise CheckpointError(f"missing tensor {name!r} (expected shape {list(shape)})")
    dt = idx.dtype(name)
    scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"
    try:
        if dt == "F8_E4M3":
            if not idx.has(scale_name):
                raise CheckpointError(f"FP8 tensor {name!r} has no scale tensor {scale_name!r}")
            arr = dequant_fp8(idx.read(name), idx.read(scale_name), block)
        elif dt in ("I8", "U8") and idx.has(scale_name):
            arr = dequant_fp4(idx.read(name), idx.read(scale_name))
        elif dt in _FLOAT_DTYPES:
            arr = idx.read(name)
        else:
            raise CheckpointError(f"tensor {name!r} has dtype {dt}, expected a float (or FP8/FP4 with a scale)")
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"tensor {name!r}: {e}") from e
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(arr.shape)}, expected {list(shape)}")
    return arr


def _host_value(spec: ParamSpec, idx: _TensorIndex, dtype: Any, block: tuple[int, int], cfg: ModelConfig) -> np.ndarray:
    target = np.dtype(ml_dtypes.bfloat16) if np.dtype(spec.dtype(dtype)) == np.dtype(ml_dtypes.bfloat16) \
        else np.dtype(spec.dtype(dtype))
    if spec.integer:
        if not idx.has(spec.ckpt):
            raise CheckpointError(f"missing tensor {spec.ckpt!r} (expected shape {list(spec.shape)})")
        dt = idx.dtype(spec.ckpt)
        if dt not in _INT_DTYPES:
            raise CheckpointError(f"tensor {spec.ckpt!r} has dtype {dt}, expected an integer type")
        arr = idx.read(spec.ckpt)
        if tuple(arr.shape) != spec.shape:
            raise CheckpointError(f"tensor {spec.ckpt!r} has shape {list(arr.shape)}, expected {list(spec.shape)}")
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.n_routed_experts):
            raise CheckpointError(f"tensor {spec.ckpt!r} holds expert ids outside [0, {cfg.n_routed_experts})")
        return arr.astype(target)
    if spec.stacked_experts:
        out = np.empty(spec.shape, target)
        for e in range(spec.shape[0]):
            out[e] = _read_float(idx, spec.ckpt.format(e=e), spec.shape[1:], block).astype(target)
        return out
    return _read_float(idx, spec.ckpt, spec.shape, block).astype(target)


_HOST_TABLE = re.compile(r"^layers\.\d+\.engram\.embed\.(weight|scale)$")
_OUT_OF_SCOPE = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def _handled_elsewhere(name: str, cfg: ModelConfig) -> bool:
    """V4.1 tensors that are not device parameters: Engram tables (host-side, memory-mapped) and the vision
    tower / image delimiter vectors (image rows arrive as embeddings; the vision tower is out of scope)."""
    return cfg.is_v41 and (bool(_HOST_TABLE.match(name)) or name.startswith(_OUT_OF_SCOPE))


def checkpoint_has_mtp(directory: str | Path) -> bool:
    """Whether the checkpoint stores MTP blocks (transformers' ``save_pretrained`` drops them)."""
    files = CheckpointFiles(directory)
    return any(normalize_name(k).startswith("mtp.") for k in files.keys())


def load_params(directory: str | Path, cfg: ModelConfig, dtype: Any = "float32", sharder: Sharder | None = None,
                include_mtp: bool | None = None) -> Any:
    """Parameters of ``cfg`` read from ``directory``; ``include_mtp=None`` loads MTP blocks iff the files have them.

    Returns the pytree of ``jax.Array`` (sharded by ``sharder``'s rules when given).
    """
    files = CheckpointFiles(directory)
    idx = _TensorIndex(files)
    if include_mtp is None:
        include_mtp = any(n.startswith("mtp.") for n in idx.by_name)
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    specs = param_specs(cfg, include_mtp=include_mtp)

    def load_one(spec: ParamSpec) -> jax.Array:
        host = _host_value(spec, idx, dtype, block, cfg)
        if sharder is not None:
            return jax.device_put(host, sharder.named(spec.axes, spec.shape))
        return jax.device_put(host)

    try:
        params = map_specs(load_one, specs)
        unexpected = sorted(n for n in set(idx.by_name) - idx.used if not _handled_elsewhere(n, cfg))
        if unexpected:
            more = f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else ""
            raise CheckpointError(f"unexpected tensors in {directory} not used by the model: {unexpected[:8]}{more}")
    finally:
        files.close()
    return params
