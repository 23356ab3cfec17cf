"""Notebook-facing model API: :func:`load_config`, :func:`load_model`, :func:`forward_logits`, :func:`inspect`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dinfer_jax.models.config import ConfigError, ModelConfig, load_config
from dinfer_jax.models.params import abstract_params, check_weights_mode, count_params, init_params, param_specs
from dinfer_jax.models.qweights import QuantizedWeight, dequantize, tree_nbytes
from dinfer_jax.models.v4 import ForwardOptions, ForwardOutput, forward, forward_jit, mtp_forward_jit
from sharding.rules import Sharder

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class EngramRuntime:
    """V4.1 Engram state: one (memory-mapped) host table per Engram layer and the raw → compressed id map. The
    full forward gathers from the host tables; serving engines read copies placed once per placement
    (:meth:`state`)."""

    tables: list[Any]
    compressed_map: np.ndarray
    # placed copies for the compiled steps, by (placement, sharding): engines over one model share them
    _placed: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def table_bytes(self) -> int:
        """Bytes of the tables as stored (codes and scales)."""
        return sum(t.weight.nbytes + (0 if t.scale is None else t.scale.nbytes) for t in self.tables)

    def state(self, where: str = "device", sharding: Any = None) -> Any:
        """The :class:`~dinfer_jax.models.engram_lookup.EngramState` a compiled step reads: the id map and the
        tables placed in device memory (``where="device"``) or pinned host memory (``"host"``; ``"host-direct"``:
        as line tables for the device's gather kernel), each array with
        ``sharding`` (default: the first local device). Placed once per (where, sharding) and kept."""
        from dinfer_jax.models.engram_lookup import EngramState, place_tables

        key = (where, sharding)
        if key not in self._placed:
            cmap = np.asarray(self.compressed_map, np.int32)
            cmap = jnp.asarray(cmap) if sharding is None else jax.device_put(cmap, sharding)  # as place_tables
            self._placed[key] = EngramState(cmap, place_tables(self.tables, where, sharding))
        return self._placed[key]


@dataclasses.dataclass
class Model:
    """A config plus its parameter pytree. ``dtype`` is the activation/weight dtype ("float32" or "bfloat16").

    ``engram`` (V4.1) holds the host-side Engram tables; they never enter device memory. ``mhc_impl``: the mHC
    Sinkhorn's implementation in every forward and serving step (:func:`~dinfer_jax.models.mhc.sinkhorn`:
    ``"auto"``: the Mosaic GPU kernel on a GPU, XLA elsewhere; ``"jnp"``; or ``"pallas"``, the kernel; set it with
    ``dataclasses.replace``). ``linear_impl``: the FP8 linears in the serving steps
    (:mod:`~dinfer_jax.models.linear_impl`: ``"auto"``, the default: the kernel on a GPU in the one-device engine,
    else XLA; ``"xla"``; or ``"pallas"``, the Mosaic GPU kernel for calls of up to 64 tokens, XLA's GEMM above;
    ``docs/perf/linear_kernel_h200.md``). ``attention_impl``: what attends to
    the gathered rows in the serving steps (:func:`~dinfer_jax.models.attention.selected_attention_impl`:
    ``"auto"``, the Mosaic GPU decode-attention kernel for steps of up to 8 queries a row on a GPU, fetching the
    selected rows from the cache itself as ``"pallas_gather"`` does, and XLA elsewhere; ``"jnp"``; ``"pallas"``,
    the kernel on XLA-gathered rows for every step that gathers rows, prefill chunks included; or
    ``"pallas_gather"``, as ``"pallas"`` with the kernel fetching the selected rows from the cache itself where it
    can read them — V4's exact bf16 cache, V4.1's ``v41_fp4`` rows — for steps of more than 8 query rows),
    and whether the indexer's kernel scores them (the same switch: :func:`~dinfer_jax.models.attention.index_impl`).
    """

    config: ModelConfig
    params: Any
    dtype: str = "float32"
    sharder: Sharder | None = None
    moe_impl: str = "auto"
    engram: EngramRuntime | None = None
    mhc_impl: str = "auto"
    linear_impl: str = "auto"
    attention_impl: str = "auto"

    def options(self, collect: bool = False, yoco: str = "off", yoco_keep: int = 140,
                attention: str = "auto") -> ForwardOptions:
        return ForwardOptions(collect=collect, moe_impl=self.moe_impl, sharder=self.sharder, yoco=yoco,
                              yoco_keep=yoco_keep, attention=attention, mhc_impl=self.mhc_impl)

    @property
    def num_params(self) -> int:
        """Logical parameter count (a quantised weight counts its dense shape)."""
        return count_params(self.params)

    @property
    def param_bytes(self) -> int:
        """Device bytes of the parameters: every array leaf, quantised codes and scales included."""
        return tree_nbytes(self.params)


def _check_dtype(dtype: str) -> str:
    dtype = jnp.dtype(dtype).name
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype


def load_model(path: str | Path, dtype: str = "float32", sharder: Sharder | None = None,
               moe_impl: str | None = None, weights: str | None = None, progress: bool = True,
               stacked: bool = False) -> Model:
    """Load a Hugging Face checkpoint directory (DeepSeek release or transformers ``save_pretrained`` layout), or a
    registered name such as ``"default"`` (the bundled model, see :mod:`dinfer_jax.checkpoints`).

    ``weights``: ``"native"`` (the default for checkpoints with a ``quantization_config``) keeps FP8/FP4 weights in
    their stored form on the device, decoded exactly inside the forward; ``"dequantized"`` (the default otherwise)
    dequantises them exactly at load into ``dtype``. With a ``sharder`` the parameters are placed by its rules
    (experts over ``ep``) and the forward uses expert parallelism (``moe_impl="ep"``, docs/expert_parallel.md).
    ``progress`` draws a bar over the parameters and bytes placed (:mod:`dinfer_jax.progress`; ``False`` or
    ``DINFER_JAX_PROGRESS=0`` silences it). ``stacked``: the backbone layers in the engine's scan layout, each
    stacked weight filled layer by layer as read (device memory: the weights once, plus one layer's weight), where
    a checkpoint-layout Model handed to an engine is stacked into a second copy (``LLM(path)`` loads this way).
    """
    from dinfer_jax.checkpoints import resolve_checkpoint
    from dinfer_jax.loading import load_params

    path = resolve_checkpoint(str(path)) or path
    dtype = _check_dtype(dtype)
    cfg = load_config(path)
    if not Path(path).is_dir():
        raise ConfigError(f"{path} is not a checkpoint directory (a preset has no weights; use random_model)")
    mode = _load_mode(weights, cfg)
    impl = moe_impl or ("ep" if sharder is not None else "auto")
    # the expert kernel's layout applied to each routed-expert weight as it is placed (before any stacking)
    transform = _expert_kernel_leaf if _uses_expert_kernel(dtype, impl) else None
    params = load_params(path, cfg, dtype=dtype, sharder=sharder, weights=mode, progress=progress, stacked=stacked,
                         transform=transform)
    return Model(cfg, params, dtype, sharder, impl, _load_engram(cfg, Path(path)))


def _uses_expert_kernel(dtype: str, impl: str) -> bool:
    """Whether the forward will run routed experts through the Mosaic GPU kernel: on a GPU, bf16, ``moe_impl``
    "auto" or "pallas" (no expert parallelism). Its MXFP4 weights are then rearranged once into the kernel's
    register order (``fp4_mma``: same bytes, 2–3× faster to decode; docs/quantized_weights.md)."""
    return impl in ("auto", "pallas") and dtype == "bfloat16" and jax.default_backend() == "gpu"


def _expert_kernel_leaf(spec: Any, leaf: Any) -> Any:
    """One loaded parameter in the expert kernel's layout when it is a routed-expert MXFP4 weight the kernel takes
    (the released-layout arrays are freed), else as given."""
    from dinfer_jax.models.qweights import kernel_layout_fits, to_kernel_layout

    if not (spec.stacked_experts and kernel_layout_fits(leaf)):
        return leaf
    return to_kernel_layout({"experts": leaf}, release=True)["experts"]


def _for_expert_kernel(params: Any, dtype: str, impl: str) -> Any:
    """``params`` with its routed-expert MXFP4 weights in the expert kernel's layout where the forward will use the
    kernel (:func:`_uses_expert_kernel`); elsewhere as given."""
    if _uses_expert_kernel(dtype, impl):
        from dinfer_jax.models.qweights import to_kernel_layout

        return to_kernel_layout(params, release=True)
    return params


LOAD_MODES = ("native", "dequantized")


def _load_mode(weights: str | None, cfg: ModelConfig) -> str:
    """``load_model``'s ``weights`` argument → the loader's mode (``"native"`` / ``"dense"``)."""
    if weights is None:
        weights = "native" if cfg.quantization is not None else "dequantized"
    if weights not in LOAD_MODES:
        raise ValueError(f"weights must be one of {LOAD_MODES}, got {weights!r}")
    return "native" if weights == "native" else "dense"


def _load_engram(cfg: ModelConfig, path: Path) -> EngramRuntime | None:
    if not cfg.engram_layer_ids:
        return None
    from dinfer_jax.models.engram import load_compressed_token_map, load_engram_tables

    tok = path / "tokenizer.json"
    if not tok.is_file():
        raise ConfigError(f"{path}: Engram layers need the checkpoint's tokenizer.json (compressed vocabulary)")
    return EngramRuntime(load_engram_tables(cfg, path), load_compressed_token_map(cfg, tok))


def _random_engram(cfg: ModelConfig, seed: int, release_format: bool = False) -> EngramRuntime | None:
    """Random in-memory Engram tables; compressed ids = raw id mod the compressed vocabulary (no tokenizer).
    ``release_format``: FP8 E4M3 codes (uniform random bytes, NaN codes excluded) with UE8M0 scales 2^-8, as the
    release stores them (a byte a value, drawn fast enough for tables of tens of millions of rows); otherwise
    standard-normal fp32 rows."""
    if not cfg.engram_layer_ids:
        return None
    from dinfer_jax.models.engram import SCALE_BLOCK, EngramTable

    rng = np.random.default_rng(seed + 99)
    tables = []
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, strict=False):
        shape = (rows, cfg.engram_head_dim)
        if release_format:
            codes = np.frombuffer(rng.bytes(rows * cfg.engram_head_dim), np.uint8).reshape(shape).copy()
            codes[(codes & 0x7F) == 0x7F] ^= 1                      # 0x7F / 0xFF are NaN in E4M3FN
            scale = np.full((rows, cfg.engram_head_dim // SCALE_BLOCK), 127 - 8, np.uint8)
            tables.append(EngramTable(codes.view(ml_dtypes.float8_e4m3fn), scale.view(ml_dtypes.float8_e8m0fnu),
                                      name=f"layer {layer}"))
        else:
            tables.append(EngramTable(rng.standard_normal(shape).astype(np.float32), name=f"layer {layer}"))
    return EngramRuntime(tables, np.arange(cfg.vocab_size, dtype=np.int64) % cfg.engram_compressed_vocab_size)


def random_model(config: ModelConfig | str, seed: int = 0, dtype: str = "float32", include_mtp: bool = True,
                 sharder: Sharder | None = None, std: float = 0.02, weights: str = "dense",
                 stacked: bool = False) -> Model:
    """A model with random parameters for experiments and tests.

    ``weights="dense"``: :func:`init_params` (host numpy RNG, every weight dense). ``weights="native"``: built on
    the device with ``jax.random`` (:func:`~dinfer_jax.models.random_init.init_params_native`), the weights the
    config's ``quantization_config`` declares FP8/FP4 in those formats, and V4.1 Engram tables in the release's
    FP8 format. ``stacked``: the backbone layers in scan layout from the start (same values), so that an engine
    built from this Model while the caller keeps it does not hold the layer weights twice (``LLM`` stacks a
    checkpoint-layout Model into a copy; for a real-dimension slice that doubles its weight memory).
    """
    cfg = load_config(config) if isinstance(config, (str, Path)) else config
    dtype = _check_dtype(dtype)
    if check_weights_mode(weights) == "native":
        from dinfer_jax.models.random_init import init_params_native

        params = init_params_native(cfg, seed=seed, dtype=dtype, include_mtp=include_mtp, std=std, sharder=sharder,
                                    stacked=stacked)
    else:
        params = init_params(cfg, seed=seed, dtype=dtype, include_mtp=include_mtp, std=std)
        if stacked:
            from dinfer_jax.models.layer_plan import stack_params

            params = stack_params(cfg, params)
    if sharder is not None and weights == "dense":
        from dinfer_jax.models.params import map_specs

        shardings = map_specs(lambda s: sharder.named(s.axes, s.shape), param_specs(cfg, include_mtp))
        params = jax.device_put(params, shardings)
    impl = "ep" if sharder is not None else "auto"
    return Model(cfg, _for_expert_kernel(params, dtype, impl), dtype, sharder, impl,
                 _random_engram(cfg, seed, release_format=weights == "native"))


def _validate_ids(model: Model, token_ids: Any, image_mask: np.ndarray | None = None) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 2:
        raise ValueError(f"token_ids must be [B, S], got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got {ids.dtype}")
    if ids.shape[1] == 0:
        raise ValueError("token_ids has an empty sequence")
    bad = (ids < 0) | (ids >= model.config.vocab_size)
    if image_mask is not None:
        bad &= ~image_mask
    if bad.any():
        b, s = np.argwhere(bad)[0]
        raise ValueError(f"token id {int(ids[b, s])} at [{b}, {s}] is outside the vocabulary "
                         f"[0, {model.config.vocab_size})")
    if ids.shape[1] > model.config.max_position_embeddings:
        raise ValueError(f"sequence length {ids.shape[1]} exceeds max_position_embeddings "
                         f"{model.config.max_position_embeddings}")
    return ids.astype(np.int32)


def run(model: Model, token_ids: Any, collect: bool = False, *, image_embeds: Any = None, image_mask: Any = None,
        yoco: str = "off", yoco_keep: int = 140, attention: str = "auto") -> ForwardOutput:
    """Jitted full-sequence forward of ``token_ids [B,S]`` from position 0 (device arrays).

    V4.1: ``image_embeds [B,S,D]`` + ``image_mask [B,S]`` supply image rows (their ids may lie outside the text
    vocabulary); ``yoco`` selects the prefill truncation mode (``"compact"`` returns logits of the last
    ``yoco_keep`` rows only). Engram rows are gathered on the host here. ``attention``: how queries read compressed
    rows (``"auto"``, ``"sparse"``, ``"dense"``; the same attention, see ``LLM``).
    """
    mask = None if image_mask is None else np.asarray(image_mask, bool)
    ids = _validate_ids(model, token_ids, mask)
    cfg = model.config
    if not cfg.is_v41 and (image_embeds is not None or yoco != "off"):
        raise ValueError("image rows and YOCO truncation are V4.1 features")
    if yoco == "compact" and yoco_keep < cfg.sliding_window:
        raise ValueError(f"yoco_keep={yoco_keep} must cover the sliding window ({cfg.sliding_window}) "
                         "plus the backtracking tokens")
    emb = None
    if model.engram is not None:
        from dinfer_jax.models.engram import engram_embeddings

        emb = jnp.asarray(engram_embeddings(cfg, model.engram.tables, ids, model.engram.compressed_map, mask),
                          dtype=model.dtype)
    return forward_jit(model.params, jnp.asarray(ids), cfg=cfg, dtype=model.dtype,
                       options=model.options(collect, yoco, yoco_keep, attention), engram_emb=emb,
                       image_embeds=None if image_embeds is None else jnp.asarray(image_embeds),
                       image_mask=None if mask is None else jnp.asarray(mask))


def forward_logits(model: Model, token_ids: Any) -> np.ndarray:
    """Float32 logits ``[B, S, vocab]`` of the full-sequence forward from position 0."""
    return np.asarray(run(model, token_ids).logits, dtype=np.float32)


def inspect(model: Model, token_ids: Any, **kwargs: Any) -> dict[str, Any]:
    """Logits plus intermediates as numpy: ``hidden_states [L+1,B,S,n,D]``, ``final_hidden``, per-layer
    ``indexer_topk`` / ``indexer_scores`` (CSA / index-source layers) and ``router_indices`` /
    ``router_weights``; V4.1 adds ``premix`` ``[L+1,B,S,n]``, ``candidate_blocks`` and ``dspark_features``.
    Keyword arguments go to :func:`run`."""
    out = run(model, token_ids, collect=True, **kwargs)
    result = jax.tree_util.tree_map(np.asarray, out.intermediates)
    result["logits"] = np.asarray(out.logits)
    return result


def mtp_logits(model: Model, token_ids: Any, depth: int = 0) -> np.ndarray:
    """MTP block logits ``[B, S-1, V]``: position t predicts token t+2 from the backbone state at t and token t+1."""
    if not model.params.get("mtp"):
        raise ValueError("this model has no MTP parameters (transformers-saved checkpoints drop them)")
    if model.config.is_v41:
        raise ValueError("V4.1's draft layers are the DSpark drafter (dinfer_jax.models.dspark), not V4 MTP")
    ids = jnp.asarray(_validate_ids(model, token_ids))
    out = forward_jit(model.params, ids, cfg=model.config, dtype=model.dtype, options=model.options(True))
    streams = out.intermediates["hidden_states"][-1][:, :-1]
    logits, _ = mtp_forward_jit(model.params, streams, ids[:, 1:], cfg=model.config, depth=depth, dtype=model.dtype,
                                options=model.options(False))
    return np.asarray(logits, np.float32)


__all__ = [
    "ConfigError", "ForwardOptions", "ForwardOutput", "Model", "ModelConfig", "QuantizedWeight", "abstract_params",
    "count_params", "dequantize", "forward", "forward_logits", "init_params", "inspect", "load_config", "load_model",
    "mtp_logits", "param_specs", "random_model", "run",
]
