"""Stream a Hugging Face V4 checkpoint into the parameter pytree, tensor by tensor.

Each parameter is read from its memory-mapped shard, dequantised if stored as FP8/FP4, cast to its target dtype and
placed on device before the next one is read, so the host never holds a second copy of the model (peak extra host
memory: one parameter, or one layer's stack of experts). Missing, unexpected, mis-shaped and wrongly typed tensors
raise :class:`CheckpointError` with the tensor's name.

``weights="native"`` keeps the tensors the parameter specs declare quantised (``ParamSpec.quant``) in their stored
FP8/FP4 form: codes and scales go to the device as a :class:`QuantizedWeight`, decoded inside the model's jitted
computation. ``weights="dense"`` dequantises exactly on the host (fp32, then cast to the model dtype).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dinfer_jax.loading.names import normalize_name
from dinfer_jax.loading.quant import dequant_fp4, dequant_fp8
from dinfer_jax.loading.safetensors_io import CheckpointError, CheckpointFiles
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.params import ParamSpec, check_weights_mode, is_spec, map_specs, param_specs
from dinfer_jax.models.qweights import QuantizedWeight, expected_scale_shape, tree_nbytes
from dinfer_jax.progress import PhaseProgress
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


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def _read_float(idx: _TensorIndex, name: str, shape: tuple[int, ...], block: tuple[int, int]) -> np.ndarray:
    """One float parameter as fp32 (a view when already fp32), dequantising FP8/FP4 storage."""
    if not idx.has(name):
        raise CheckpointError(f"missing tensor {name!r} (expected shape {list(shape)})")
    dt = idx.dtype(name)
    scale_name = _scale_name(name)
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


_STORED_AS = {"fp8": ("F8_E4M3",), "fp4": ("I8", "U8")}
_SCALE_DTYPES = {"fp8": ("F8_E8M0", "F32"), "fp4": ("F8_E8M0",)}


def _read_quantized(idx: _TensorIndex, spec: ParamSpec, name: str,
                    shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Stored codes (float8_e4m3fn, or uint8 packed e2m1) and scales of one weight, as host views, checked against
    the format ``spec`` declares."""
    fmt, block = spec.quant, spec.block
    if not idx.has(name):
        raise CheckpointError(f"missing tensor {name!r} (expected {fmt} codes of logical shape {list(shape)})")
    dt = idx.dtype(name)
    if dt not in _STORED_AS[fmt]:
        raise CheckpointError(f"tensor {name!r} is stored as {dt} but the config's quantization_config declares it "
                              f"{fmt} (expected {' or '.join(_STORED_AS[fmt])}); load it dequantized instead "
                              "(load_model(..., weights='dequantized'))")
    sname = _scale_name(name)
    if not idx.has(sname):
        raise CheckpointError(f"{fmt} tensor {name!r} has no scale tensor {sname!r}")
    sdt = idx.dtype(sname)
    if sdt not in _SCALE_DTYPES[fmt]:
        raise CheckpointError(f"scale {sname!r} has dtype {sdt}, expected one of {_SCALE_DTYPES[fmt]}")
    data = idx.read(name)
    if fmt == "fp4":
        data = data.view(np.uint8)
    want = tuple(shape[:-1]) + ((shape[-1] // 2,) if fmt == "fp4" else (shape[-1],))
    if tuple(data.shape) != want:
        raise CheckpointError(f"tensor {name!r} has shape {list(data.shape)}, expected {list(want)} "
                              f"({fmt} codes of logical shape {list(shape)})")
    scale = idx.read(sname)
    want_s = expected_scale_shape(fmt, want, block)
    if tuple(scale.shape) != want_s:
        raise CheckpointError(f"{fmt} scale shape {list(scale.shape)} of {sname!r} does not match the weight "
                              f"{list(data.shape)} with block {list(block)} (expected {list(want_s)})")
    return data, scale


def _native_host_value(spec: ParamSpec, idx: _TensorIndex) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of a quantised parameter; per-expert tensors are stacked (one layer's stack on the host)."""
    if not spec.stacked_experts:
        return _read_quantized(idx, spec, spec.ckpt, spec.shape)
    parts = [_read_quantized(idx, spec, spec.ckpt.format(e=e), spec.shape[1:]) for e in range(spec.shape[0])]
    sdts = {p[1].dtype for p in parts}
    if len(sdts) > 1:
        raise CheckpointError(f"experts of {spec.ckpt!r} mix scale dtypes {sorted(map(str, sdts))}")
    data = np.empty((spec.shape[0], *parts[0][0].shape), parts[0][0].dtype)
    scale = np.empty((spec.shape[0], *parts[0][1].shape), parts[0][1].dtype)
    for e, (d, sc) in enumerate(parts):
        data[e], scale[e] = d, sc
    return data, scale


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
                include_mtp: bool | None = None, weights: str = "dense", progress: bool = False,
                stacked: bool = False, transform: Callable[[Any, Any], Any] | None = None) -> Any:
    """Parameters of ``cfg`` read from ``directory``; ``include_mtp=None`` loads MTP blocks iff the files have them.

    Returns the pytree of ``jax.Array`` (sharded by ``sharder``'s rules when given). ``weights="native"`` keeps
    the weights ``cfg``'s specs declare quantised as :class:`QuantizedWeight` (stored codes and scales, never a
    dense copy); ``"dense"`` dequantises them exactly. ``progress`` draws a bar over parameters and bytes placed.
    ``stacked``: the backbone layers in scan layout (:class:`~dinfer_jax.models.layer_plan.StackedLayers`), each
    stacked leaf allocated once on the device and filled layer by layer as they are read (:func:`_stacked_leaf`),
    so the device holds one copy of the weights plus one layer's leaf, never a checkpoint-layout copy beside the
    stacked one. ``transform(spec, leaf)``: applied to each placed leaf (before stacking; e.g. the expert
    kernel's layout), the caller's to free the input leaf if it wants.
    """
    check_weights_mode(weights)
    files = CheckpointFiles(directory)
    idx = _TensorIndex(files)
    if include_mtp is None:
        include_mtp = any(n.startswith("mtp.") for n in idx.by_name)
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    specs = param_specs(cfg, include_mtp=include_mtp)
    bar = PhaseProgress(f"load {Path(directory).name}", len(jax.tree_util.tree_leaves(specs, is_leaf=is_spec)),
                        enabled=progress, unit_bytes=True)

    def load_one(spec: ParamSpec) -> jax.Array | QuantizedWeight:
        if weights == "native" and spec.quant is not None:
            data, scale = _native_host_value(spec, idx)
            host: Any = QuantizedWeight(data, scale, spec.quant, spec.block)
        else:
            host = _host_value(spec, idx, dtype, block, cfg)
        placed = place_host_value(host, None if sharder is None else sharder.named_tree(spec.axes, host))
        bar.advance(nbytes=tree_nbytes(placed))
        return placed if transform is None else transform(spec, placed)

    def load_stacked(layer_specs: list[Any]) -> Any:
        """One scan-group position: every leaf of its ``repeats`` layers, stacked as read."""
        def leaf(*leaf_specs: ParamSpec) -> Any:
            return _stacked_leaf([functools.partial(load_one, s) for s in leaf_specs], leaf_specs[0].axes, sharder)

        return jax.tree_util.tree_map(leaf, *layer_specs, is_leaf=is_spec)

    try:
        with bar:
            if stacked:
                from dinfer_jax.models.layer_plan import StackedLayers, plan_layers

                params = {k: map_specs(load_one, v) for k, v in specs.items() if k != "layers"}
                params["layers"] = StackedLayers(tuple(
                    tuple(load_stacked([specs["layers"][g.layer(r, j)] for r in range(g.repeats)])
                          for j in range(g.period)) for g in plan_layers(cfg)))
            else:
                params = map_specs(load_one, specs)
        unexpected = sorted(n for n in set(idx.by_name) - idx.used if not _handled_elsewhere(n, cfg))
        if unexpected:
            more = f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else ""
            raise CheckpointError(f"unexpected tensors in {directory} not used by the model: {unexpected[:8]}{more}")
    finally:
        files.close()
    return params


def place_host_value(host: Any, shardings: Any) -> Any:
    """``host`` (numpy leaves) on the device, or placed by ``shardings`` (a tree of them in ``host``'s structure).
    A sharding that spans other processes' devices (``jax.distributed``) is filled from each process's own copy of
    the value, its addressable shards only: no cross-process transfer or equality check of the whole weight."""
    if shardings is None:
        return jax.device_put(host)

    def put(x: np.ndarray, sharding: Any) -> jax.Array:
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index]))

    return jax.tree.map(put, host, shardings)


def _stacked_leaf(loaders: list[Callable[[], Any]], axes: tuple, sharder: Sharder | None) -> Any:
    """``stack([load() for load in loaders])`` without holding the layers and their stack at once: the first layer's
    leaf fixes the stacked buffer (allocated on the device, sharded with a leading unsharded axis), then each
    layer is written into its row by a donating update and freed — peak: the stack plus one layer."""
    first = loaders[0]()
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((len(loaders),) + x.shape, x.dtype), first)
    out_shardings = None if sharder is None else sharder.named_tree((None, *axes), shapes)
    stack = _allocate_stack(first, repeats=len(loaders), shardings=out_shardings)
    _free(first)
    for r, load in enumerate(loaders[1:], start=1):
        x = load()
        stack = _write_row(stack, x, r)
        _free(x)
    return stack


def _free(tree: Any) -> None:
    for a in jax.tree_util.tree_leaves(tree):
        a.delete()


@functools.partial(jax.jit, static_argnames=("repeats", "shardings"))
def _allocate_stack(first: Any, *, repeats: int, shardings: Any = None) -> Any:
    """A ``[repeats, ...]`` buffer per leaf of ``first``, every row a copy of it until overwritten (a fill value
    would need one in every dtype; UE8M0 scales have no zero)."""
    out = jax.tree.map(lambda x: jnp.broadcast_to(x[None], (repeats,) + x.shape), first)
    return out if shardings is None else jax.lax.with_sharding_constraint(out, shardings)


@functools.partial(jax.jit, donate_argnums=0)
def _write_row(stack: Any, x: Any, r: int) -> Any:
    """``stack`` with row ``r`` of every leaf replaced by ``x``'s leaf, in place (the stack is donated)."""
    return jax.tree.map(lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v, r, 0), stack, x)
