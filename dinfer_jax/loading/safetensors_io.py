"""Minimal safetensors reader/writer that understands the FP8 dtypes of released DeepSeek checkpoints.

numpy/flax safetensors backends cannot read ``F8_E4M3`` / ``F8_E8M0``; this reader parses the header itself and
memory-maps the data, so a tensor is a zero-copy view until the caller converts it. Headers are validated
(length, JSON, offsets inside the file, byte count = dtype size × shape) and violations raise
:class:`CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAME_OF = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, or its tensors do not match what the model expects."""


class SafetensorsFile:
    """Lazy, memory-mapped view of one ``.safetensors`` file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes)")
                (n,) = struct.unpack("<Q", raw_len)
                if n > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{self.path}: corrupt safetensors header length {n} (file has {size} bytes)")
                header_bytes = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e}") from e
        try:
            header = json.loads(header_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not JSON): {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype_name, shape = info["dtype"], tuple(int(s) for s in info["shape"])
                start, end = info["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{self.path}: corrupt header entry for tensor {name!r}: {info!r}") from e
            if dtype_name not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
            dt = DTYPES[dtype_name]
            if not (0 <= start <= end <= data_len) or end - start != math.prod(shape) * dt.itemsize:
                raise CheckpointError(
                    f"{self.path}: corrupt tensor {name!r}: offsets [{start}, {end}) do not hold "
                    f"{dtype_name}{list(shape)} "
                    f"inside a data section of {data_len} bytes")
            self._entries[name] = (dt, shape, start, end)
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype_name(self, name: str) -> str:
        return _NAME_OF[self._entries[name][0]]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of tensor ``name`` in its stored dtype."""
        dt, shape, start, end = self._entries[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[self._data_start + start:self._data_start + end].view(dt).reshape(shape)

    def close(self) -> None:
        self._mmap = None


def save_file(tensors: Mapping[str, np.ndarray], path: str | Path, metadata: Mapping[str, str] | None = None) -> None:
    """Write numpy arrays (including ml_dtypes FP8/bf16) as a safetensors file, tensors in sorted order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    names = sorted(tensors)
    arrays = []
    for name in names:
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAME_OF:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _NAME_OF[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for a in arrays:
            f.write(a.tobytes())


class CheckpointFiles:
    """All tensors of a Hugging Face checkpoint directory (``model.safetensors`` or an index with shards)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: corrupt index file: {e}") from e
            for shard in sorted(set(weight_map.values())):
                if not (self.dir / shard).is_file():
                    raise CheckpointError(f"{index}: lists shard {shard!r}, which is missing from {self.dir}")
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.dir}: no model.safetensors, no index and no *.safetensors files")
        for shard in shards:
            f = SafetensorsFile(self.dir / shard)
            self._files[shard] = f
            for k in f.keys():
                if k in self._where:
                    raise CheckpointError(f"tensor {k!r} appears in both {self._where[k]} and {shard}")
                self._where[k] = shard

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def file_of(self, name: str) -> SafetensorsFile:
        return self._files[self._where[name]]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
