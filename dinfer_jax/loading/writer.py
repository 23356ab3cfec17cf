"""Write parameters as a checkpoint in DeepSeek's released V4 layout (names, dtypes and quantised formats).

Release dtypes (spec ``docs/spec/model-v4.md`` §6.1, ``docs/spec/model-v41.md`` §5): the weights ``ParamSpec.quant``
declares quantised
(attention projections, the indexer's ``wq_b``, shared experts, MTP ``e_proj``/``h_proj``, V4.1 Engram ``wkv`` and
DSpark ``main_proj``) in FP8 e4m3 with UE8M0 block scales; routed experts in MXFP4 (or FP8, or BF16); mHC tensors,
sinks, ``ape`` and router bias in F32; ``tid2eid`` as I32; everything else BF16.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dinfer_jax.loading.quant import dequant_fp4, dequant_fp8, quantize_fp4, quantize_fp8
from dinfer_jax.loading.safetensors_io import save_file
from dinfer_jax.models.config import ModelConfig, QuantConfig
from dinfer_jax.models.params import ParamSpec, is_spec, param_specs
from dinfer_jax.models.qweights import dequantize, is_quantized

_F32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|\.ape|gate\.bias)$")


def iter_release_tensors(cfg: ModelConfig, params: Any) -> Iterator[tuple[str, np.ndarray]]:
    """``(release name, host array)`` for every parameter; stacked experts are split per expert; quantised
    weights are dequantised (exactly)."""
    for _spec, name, value in _iter_spec_tensors(cfg, params):
        yield name, value


def _iter_spec_tensors(cfg: ModelConfig, params: Any) -> Iterator[tuple[ParamSpec, str, np.ndarray]]:
    import jax

    specs = param_specs(cfg, include_mtp=bool(params.get("mtp")))
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=is_spec)
    flat_vals = jax.tree_util.tree_leaves(params, is_leaf=is_quantized)
    assert len(flat_specs) == len(flat_vals)
    for spec, val in zip(flat_specs, flat_vals, strict=False):
        arr = np.asarray(dequantize(val) if is_quantized(val) else val)
        if spec.stacked_experts:
            for e in range(spec.shape[0]):
                yield spec, spec.ckpt.format(e=e), arr[e]
        else:
            yield spec, spec.ckpt, arr


def release_format(spec: ParamSpec) -> str:
    """Released storage of a parameter: its declared quantisation (``fp8`` | ``fp4``), else ``i32`` | ``f32`` |
    ``bf16`` by name (spec ``docs/spec/model-v4.md`` §6.1)."""
    if spec.quant is not None:
        return spec.quant
    if spec.integer:
        return "i32"
    if _F32.search(spec.ckpt):
        return "f32"
    return "bf16"


def encode(name: str, value: np.ndarray, fmt: str, block: tuple[int, int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Stored tensors for one parameter and the exact values a loader recovers from them (fp32, or int)."""
    v = np.asarray(value)
    if fmt == "i32":
        return {name: v.astype(np.int32)}, v.astype(np.int64)
    v = v.astype(np.float32)
    base = name[: -len(".weight")]
    if fmt == "fp8":
        code, scale = quantize_fp8(v, block)
        return {name: code, f"{base}.scale": scale}, dequant_fp8(code, scale, block)
    if fmt == "fp4":
        packed, scale = quantize_fp4(v)
        return {name: packed, f"{base}.scale": scale}, dequant_fp4(packed, scale)
    if fmt == "f32":
        return {name: v}, v
    bf = v.astype(ml_dtypes.bfloat16)
    return {name: bf}, bf.astype(np.float32)


def write_release_checkpoint(cfg: ModelConfig, params: Any, directory: str | Path, *, expert_dtype: str = "fp4",
                             block: tuple[int, int] = (128, 128), shard_bytes: int | None = None,
                             extra_config: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Write ``params`` in the released quantised layout under ``directory``.

    Shards of at most ``shard_bytes`` (with ``model.safetensors.index.json``) when given, else one file.
    Returns ``{release name: dequantised value}``: exactly what a correct loader must reconstruct.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    qcfg = cfg.replace(quantization=QuantConfig(weight_block_size=block, scale_fmt="ue8m0", expert_dtype=expert_dtype))
    fp4_block = (1, 32)
    config = qcfg.to_dict()
    config["architectures"] = ["DeepseekV4ForCausalLM"]
    config.update(extra_config or {})
    (directory / "config.json").write_text(json.dumps(config, indent=1))

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    recovered: dict[str, np.ndarray] = {}
    for spec, name, value in _iter_spec_tensors(qcfg, params):
        fmt = release_format(spec)
        if fmt == "fp4" and spec.block != fp4_block:
            raise ValueError(f"{name}: fp4 storage needs block {fp4_block}, the spec declares {spec.block}")
        stored, exact = encode(name, value, fmt, block)
        recovered[name] = exact
        nbytes = sum(a.nbytes for a in stored.values())
        if shard_bytes is not None and size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(stored)
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, directory / fname)
            weight_map.update({k: fname for k in shard})
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return recovered
