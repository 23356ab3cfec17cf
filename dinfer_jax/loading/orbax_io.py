"""Save converted parameters with orbax-checkpoint and restore them without re-reading safetensors.

Native (quantised) parameters are saved as they sit on the device: codes and scales of each
:class:`~dinfer_jax.models.qweights.QuantizedWeight` are two arrays; the metadata file records the weight mode and
the scale dtype of each format so the restore target has the same pytree and dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dinfer_jax.models.config import ModelConfig, config_from_dict
from dinfer_jax.models.params import abstract_params
from dinfer_jax.models.qweights import QuantizedWeight, is_quantized, released_layout

_META = "dinfer_meta.json"


def _quantized_leaves(params: Any) -> list[QuantizedWeight]:
    return [x for x in jax.tree_util.tree_leaves(params, is_leaf=is_quantized) if is_quantized(x)]


def save_params(directory: str | Path, cfg: ModelConfig, params: Any, dtype: str) -> None:
    """Write ``params`` (a pytree of arrays, dense or native, for ``cfg``) under ``directory`` (must not exist)."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=False)
    # saved in the released layouts (a GPU model may hold experts in the kernel's fp4_mma order)
    params = jax.tree_util.tree_map(released_layout, params, is_leaf=is_quantized)
    quantized = _quantized_leaves(params)
    scale_dtypes: dict[str, str] = {}
    for q in quantized:
        name = jax.numpy.dtype(q.scale.dtype).name
        if scale_dtypes.setdefault(q.fmt, name) != name:
            raise ValueError(f"{q.fmt} weights mix scale dtypes {scale_dtypes[q.fmt]} and {name}")
    meta = {"config": cfg.to_dict(), "dtype": dtype, "include_mtp": len(params.get("mtp", [])) > 0,
            "weights": "native" if quantized else "dense", "scale_dtypes": scale_dtypes}
    (directory / _META).write_text(json.dumps(meta, indent=1))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "params", params)


def restore_params(directory: str | Path) -> tuple[ModelConfig, Any, str]:
    """Read back what :func:`save_params` wrote: ``(config, params, dtype)``."""
    directory = Path(directory).absolute()
    meta = json.loads((directory / _META).read_text())
    cfg = config_from_dict(meta["config"])
    target = abstract_params(cfg, dtype=meta["dtype"], include_mtp=meta["include_mtp"],
                             weights=meta.get("weights", "dense"))
    scale_dtypes = meta.get("scale_dtypes", {})

    def with_saved_scale(x: Any) -> Any:
        if not is_quantized(x) or x.fmt not in scale_dtypes:
            return x
        scale = jax.ShapeDtypeStruct(x.scale.shape, jax.numpy.dtype(scale_dtypes[x.fmt]))
        return QuantizedWeight(x.data, scale, x.fmt, x.block)

    target = jax.tree_util.tree_map(with_saved_scale, target, is_leaf=is_quantized)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(directory / "params", target)
    return cfg, jax.tree_util.tree_map(lambda x: x, params), meta["dtype"]
