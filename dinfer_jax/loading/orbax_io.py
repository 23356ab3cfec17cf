"""Save converted parameters with orbax-checkpoint and restore them without re-reading safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dinfer_jax.models.config import ModelConfig, config_from_dict
from dinfer_jax.models.params import abstract_params

_META = "dinfer_meta.json"


def save_params(directory: str | Path, cfg: ModelConfig, params: Any, dtype: str) -> None:
    """Write ``params`` (a pytree of arrays for ``cfg``) under ``directory`` (must not exist yet)."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=False)
    meta = {"config": cfg.to_dict(), "dtype": dtype, "include_mtp": len(params.get("mtp", [])) > 0}
    (directory / _META).write_text(json.dumps(meta, indent=1))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "params", params)


def restore_params(directory: str | Path) -> tuple[ModelConfig, Any, str]:
    """Read back what :func:`save_params` wrote: ``(config, params, dtype)``."""
    directory = Path(directory).absolute()
    meta = json.loads((directory / _META).read_text())
    cfg = config_from_dict(meta["config"])
    target = abstract_params(cfg, dtype=meta["dtype"], include_mtp=meta["include_mtp"])
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(directory / "params", target)
    return cfg, jax.tree_util.tree_map(lambda x: x, params), meta["dtype"]
