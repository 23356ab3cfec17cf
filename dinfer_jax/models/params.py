"""Declaration of every V4 parameter: shape, logical axes, dtype policy and checkpoint name.

One declaration drives random initialisation, abstract evaluation (parameter counts without allocation),
checkpoint loading and sharding. The parameter pytree mirrors DeepSeek's release names, e.g.
``params["layers"][1]["attn"]["wq_a"]`` is ``layers.1.attn.wq_a.weight``. Linear weights are stored ``[out, in]``
as in the checkpoint. Routed experts are stacked: ``ffn.experts.w1`` is ``[E, I, D]`` built from the per-expert
tensors ``layers.L.ffn.experts.{e}.w1.weight``.

Quantisation is declared here too: ``ParamSpec.quant`` names the released storage format of a weight (``"fp8"``
e4m3 with block scales, ``"fp4"`` MXFP4) for a config with a ``quantization_config``; ``abstract_params(...,
weights="native")`` turns those into :class:`~dinfer_jax.models.qweights.QuantizedWeight` leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.config import ATTN_CSA, ATTN_SLIDING, ModelConfig
from dinfer_jax.models.qweights import FP4_BLOCK, abstract_quantized, logical_size

WEIGHT_MODES = ("dense", "native")
Quant = tuple[str, tuple[int, int]] | None  # (fmt, block) of a released quantised weight, or None (dense)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter. ``ckpt`` is its release name; ``{e}`` marks a per-expert tensor stacked on axis 0.

    ``quant`` / ``block``: the released storage of a quantised weight (``"fp8"`` with ``block`` = the config's
    ``weight_block_size``, or ``"fp4"`` with ``block`` = (1, 32)); None for tensors released dense (bf16/fp32/int).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    ckpt: str
    init: str = "normal"  # normal | ones | zeros | bias | tid2eid
    keep_fp32: bool = False  # stored and used in fp32 whatever the model dtype (spec: reference keeps fp32)
    integer: bool = False
    quant: str | None = None
    block: tuple[int, int] | None = None

    @property
    def stacked_experts(self) -> bool:
        return "{e}" in self.ckpt

    def dtype(self, model_dtype: Any) -> jnp.dtype:
        if self.integer:
            return jnp.dtype(jnp.int32)
        return jnp.dtype(jnp.float32) if self.keep_fp32 else jnp.dtype(model_dtype)

    def abstract(self, model_dtype: Any, weights: str = "dense", scale_dtype: Any = jnp.float8_e8m0fnu) -> Any:
        """``ShapeDtypeStruct`` of the dense parameter, or a ``QuantizedWeight`` of them (``weights="native"``)."""
        if weights == "native" and self.quant is not None:
            return abstract_quantized(self.shape, self.quant, self.block, scale_dtype)
        return jax.ShapeDtypeStruct(self.shape, self.dtype(model_dtype))


def linear_quant(c: ModelConfig) -> Quant:
    """Release storage of the FP8 linears (attention projections, shared experts, ...): e4m3 with the config's
    ``weight_block_size`` block scales, when the config carries a ``quantization_config``."""
    return None if c.quantization is None else ("fp8", tuple(c.quantization.weight_block_size))


def expert_quant(c: ModelConfig) -> Quant:
    """Release storage of routed experts: MXFP4 (1×32 scales) for ``expert_dtype="fp4"``, bf16 for ``"bf16"``,
    otherwise FP8 like the other linears (Flash-Base)."""
    q = c.quantization
    if q is None or q.expert_dtype == "bf16":
        return None
    if q.expert_dtype == "fp4":
        return "fp4", FP4_BLOCK
    return linear_quant(c)


def _lin(out: int, inn: int, axes: tuple[str | None, str | None], name: str, fp32: bool = False,
         quant: Quant = None) -> ParamSpec:
    fmt, block = quant if quant is not None else (None, None)
    return ParamSpec((out, inn), axes, f"{name}.weight", keep_fp32=fp32, quant=fmt, block=block)


def _norm(dim: int, name: str) -> ParamSpec:
    return ParamSpec((dim,), (None,), f"{name}.weight", init="ones", keep_fp32=True)


def _hc_site(c: ModelConfig, prefix: str, site: str) -> dict[str, ParamSpec]:
    n, d = c.hc_mult, c.hidden_size
    rows = (2 + n) * n
    return {
        "fn": ParamSpec((rows, n * d), ("hc", None), f"{prefix}hc_{site}_fn", keep_fp32=True),
        "base": ParamSpec((rows,), ("hc",), f"{prefix}hc_{site}_base", init="bias", keep_fp32=True),
        "scale": ParamSpec((3,), (None,), f"{prefix}hc_{site}_scale", init="ones", keep_fp32=True),
    }


def _compressor(c: ModelConfig, name: str, ratio: int, dim: int, overlap: bool) -> dict[str, ParamSpec]:
    coff = 2 if overlap else 1
    return {
        "wkv": _lin(coff * dim, c.hidden_size, (None, "embed"), f"{name}.wkv", fp32=True),
        "wgate": _lin(coff * dim, c.hidden_size, (None, "embed"), f"{name}.wgate", fp32=True),
        "ape": ParamSpec((ratio, coff * dim), (None, None), f"{name}.ape", init="bias", keep_fp32=True),
        "norm": _norm(dim, f"{name}.norm"),
    }


def _attention(c: ModelConfig, name: str, kind: str, ratio: int) -> dict[str, Any]:
    H, d, D = c.num_heads, c.head_dim, c.hidden_size
    G, R = c.o_groups, c.o_lora_rank
    q8 = linear_quant(c)
    p: dict[str, Any] = {
        "wq_a": _lin(c.q_lora_rank, D, ("q_lora", "embed"), f"{name}.wq_a", quant=q8),
        "q_norm": _norm(c.q_lora_rank, f"{name}.q_norm"),
        "wq_b": _lin(H * d, c.q_lora_rank, ("heads_dim", "q_lora"), f"{name}.wq_b", quant=q8),
        "wkv": _lin(d, D, ("kv", "embed"), f"{name}.wkv", quant=q8),
        "kv_norm": _norm(d, f"{name}.kv_norm"),
        "wo_a": _lin(G * R, H * d // G, ("o_rank", "o_group_in"), f"{name}.wo_a", quant=q8),
        "wo_b": _lin(D, G * R, ("embed", "o_rank"), f"{name}.wo_b", quant=q8),
        "attn_sink": ParamSpec((H,), ("heads",), f"{name}.attn_sink", init="bias", keep_fp32=True),
    }
    if kind != ATTN_SLIDING:
        p["compressor"] = _compressor(c, f"{name}.compressor", ratio, d, overlap=kind == ATTN_CSA)
    if kind == ATTN_CSA:
        Hi, di = c.index_n_heads, c.index_head_dim
        p["indexer"] = {
            "wq_b": _lin(Hi * di, c.q_lora_rank, ("idx_heads_dim", "q_lora"), f"{name}.indexer.wq_b",
                         quant=linear_quant(c)),
            "weights_proj": _lin(Hi, D, (None, "embed"), f"{name}.indexer.weights_proj", fp32=True),
            "compressor": _compressor(c, f"{name}.indexer.compressor", ratio, di, overlap=True),
        }
    return p


def _ffn(c: ModelConfig, name: str, hash_routed: bool, n_experts: int | None = None) -> dict[str, Any]:
    E, I, D = n_experts or c.n_routed_experts, c.moe_inter_dim, c.hidden_size
    gate: dict[str, ParamSpec] = {"weight": _lin(E, D, ("experts_gate", "embed"), f"{name}.gate", fp32=True)}
    if hash_routed:
        gate["tid2eid"] = ParamSpec((c.vocab_size, c.n_activated_experts), ("vocab", None), f"{name}.gate.tid2eid",
                                    init="tid2eid", integer=True)
    else:
        gate["bias"] = ParamSpec((E,), (None,), f"{name}.gate.bias", init="bias", keep_fp32=True)
    if c.is_v41:
        gate["bias_vl"] = ParamSpec((E,), (None,), f"{name}.gate.bias_vl", init="bias", keep_fp32=True)
    efmt, eblock = expert_quant(c) or (None, None)

    def expert(shape: tuple[int, int, int], axes: tuple[str, str, str], w: str) -> ParamSpec:
        return ParamSpec(shape, axes, f"{name}.experts.{{e}}.{w}.weight", quant=efmt, block=eblock)

    p: dict[str, Any] = {
        "gate": gate,
        "experts": {
            "w1": expert((E, I, D), ("experts", "expert_mlp", "embed"), "w1"),
            "w2": expert((E, D, I), ("experts", "embed", "expert_mlp"), "w2"),
            "w3": expert((E, I, D), ("experts", "expert_mlp", "embed"), "w3"),
        },
    }
    if c.n_shared_experts:
        q8 = linear_quant(c)
        p["shared_experts"] = {
            "w1": _lin(I, D, ("mlp", "embed"), f"{name}.shared_experts.w1", quant=q8),
            "w2": _lin(D, I, ("embed", "mlp"), f"{name}.shared_experts.w2", quant=q8),
            "w3": _lin(I, D, ("mlp", "embed"), f"{name}.shared_experts.w3", quant=q8),
        }
    return p


def _block(c: ModelConfig, prefix: str, kind: str, ratio: int, hash_routed: bool) -> dict[str, Any]:
    return {
        "attn_norm": _norm(c.hidden_size, f"{prefix}attn_norm"),
        "ffn_norm": _norm(c.hidden_size, f"{prefix}ffn_norm"),
        "hc_attn": _hc_site(c, prefix, "attn"),
        "hc_ffn": _hc_site(c, prefix, "ffn"),
        "attn": _attention(c, f"{prefix}attn", kind, ratio),
        "ffn": _ffn(c, f"{prefix}ffn", hash_routed),
    }


def _hc_head(c: ModelConfig, prefix: str) -> dict[str, ParamSpec]:
    n, d = c.hc_mult, c.hidden_size
    return {
        "fn": ParamSpec((n, n * d), (None, None), f"{prefix}hc_head_fn", keep_fp32=True),
        "base": ParamSpec((n,), (None,), f"{prefix}hc_head_base", init="bias", keep_fp32=True),
        "scale": ParamSpec((1,), (None,), f"{prefix}hc_head_scale", init="ones", keep_fp32=True),
    }


def _v41_attention(c: ModelConfig, name: str, layer: int) -> dict[str, Any]:
    """V4.1 attention: V4's projections; compressor (no overlap, no APE; ``wgate`` only at ratio 2) and index-key
    projection on KV sources; query side of the indexer on index sources."""
    p = _attention(c, name, ATTN_SLIDING, 0)
    ratio = c.compress_ratios[layer] if layer >= 0 else 0
    d, di, Hi = c.head_dim, c.index_head_dim, c.index_n_heads
    if layer in c.kv_source_layer_ids:
        comp = {"wkv": _lin(d, c.hidden_size, (None, "embed"), f"{name}.compressor.wkv", fp32=True),
                "norm": _norm(d, f"{name}.compressor.norm")}
        if ratio == 2:
            comp["wgate"] = _lin(d, c.hidden_size, (None, "embed"), f"{name}.compressor.wgate", fp32=True)
        p["compressor"] = comp
    indexer: dict[str, ParamSpec] = {}
    if layer in (c.index_k_source_layer_ids or c.kv_source_layer_ids):
        indexer["wk"] = _lin(di, d, (None, "kv"), f"{name}.indexer.wk")
        indexer["k_norm"] = _norm(di, f"{name}.indexer.k_norm")
    if layer in c.index_source_layer_ids:
        indexer["wq_b"] = _lin(Hi * di, c.q_lora_rank, ("idx_heads_dim", "q_lora"), f"{name}.indexer.wq_b",
                               quant=linear_quant(c))
        indexer["weights_proj"] = _lin(Hi, c.hidden_size, (None, "embed"), f"{name}.indexer.weights_proj", fp32=True)
    if indexer:
        p["indexer"] = indexer
    return p


def _v41_block(c: ModelConfig, prefix: str, layer: int, n_experts: int | None = None) -> dict[str, Any]:
    """``layer`` < 0 marks a DSpark draft block (sliding-only, its own expert count)."""
    D = c.hidden_size
    blk = {
        "attn_norm": _norm(D, f"{prefix}attn_norm"),
        "ffn_norm": _norm(D, f"{prefix}ffn_norm"),
        "hc_attn": _hc_site(c, prefix, "attn"),
        "hc_ffn": _hc_site(c, prefix, "ffn"),
        "attn": _v41_attention(c, f"{prefix}attn", layer),
        "ffn": _ffn(c, f"{prefix}ffn", False, n_experts),
    }
    if layer in c.engram_layer_ids:
        n = c.hc_mult
        e_in = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
        blk["engram"] = {
            "wkv": _lin((n + 1) * D, e_in, (None, None), f"{prefix}engram.wkv", quant=linear_quant(c)),
            "q_weight": ParamSpec((n, D), (None, "embed"), f"{prefix}engram.q_weight", init="ones", keep_fp32=True),
            "k_weight": ParamSpec((n, D), (None, "embed"), f"{prefix}engram.k_weight", init="ones", keep_fp32=True),
        }
    return blk


def _v41_specs(c: ModelConfig, include_mtp: bool) -> dict[str, Any]:
    D, V = c.hidden_size, c.vocab_size
    specs: dict[str, Any] = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), "embed.weight"),
        "head": ParamSpec((V, D), ("vocab", "embed"), "head.weight"),
        "norm": _norm(D, "norm"),
        "layers": [_v41_block(c, f"layers.{i}.", i) for i in range(c.num_layers)],
        "mtp": [],
    }
    if include_mtp and c.n_mtp_layers:
        for j in range(c.n_mtp_layers):
            pre = f"mtp.{j}."
            blk = _v41_block(c, pre, -1, n_experts=c.dspark_n_routed_experts)
            if j == 0:
                n_t = len(c.dspark_target_layer_ids)
                blk["main_proj"] = _lin(D, n_t * D, ("embed", None), f"{pre}main_proj", quant=linear_quant(c))
                blk["main_norm"] = _norm(D, f"{pre}main_norm")
            if j == c.n_mtp_layers - 1:
                r = c.dspark_markov_rank
                blk["norm"] = _norm(D, f"{pre}norm")
                blk["markov_embed"] = ParamSpec((V, r), ("vocab", None), f"{pre}markov_head.embed.weight")
                blk["markov_head"] = ParamSpec((V, r), ("vocab", None), f"{pre}markov_head.head.weight")
                blk["confidence_proj"] = ParamSpec((1, D + r), (None, None), f"{pre}confidence_head.proj.weight",
                                                   keep_fp32=True)
            specs["mtp"].append(blk)
    return specs


def param_specs(c: ModelConfig, include_mtp: bool = True) -> dict[str, Any]:
    """The pytree of :class:`ParamSpec` for config ``c`` (MTP blocks included when ``include_mtp``).

    V4.1 Engram tables are not parameters: they stay memory-mapped on the host (see ``engram_table_rows``).
    """
    if c.is_v41:
        return _v41_specs(c, include_mtp)
    D = c.hidden_size
    specs: dict[str, Any] = {
        "embed": ParamSpec((c.vocab_size, D), ("vocab", "embed"), "embed.weight"),
        "head": ParamSpec((c.vocab_size, D), ("vocab", "embed"), "head.weight"),
        "norm": _norm(D, "norm"),
        "hc_head": _hc_head(c, ""),
        "layers": [
            _block(c, f"layers.{i}.", c.attn_kinds[i], c.compress_ratios[i], c.hash_layers[i])
            for i in range(c.num_layers)
        ],
        "mtp": [],
    }
    if include_mtp:
        for j in range(c.n_mtp_layers):
            pre = f"mtp.{j}."
            blk = _block(c, pre, ATTN_SLIDING, 0, hash_routed=False)
            blk.update({
                "e_proj": _lin(D, D, ("embed", None), f"{pre}e_proj", quant=linear_quant(c)),
                "h_proj": _lin(D, D, ("embed", None), f"{pre}h_proj", quant=linear_quant(c)),
                "enorm": _norm(D, f"{pre}enorm"),
                "hnorm": _norm(D, f"{pre}hnorm"),
                "norm": _norm(D, f"{pre}norm"),
                "hc_head": _hc_head(c, pre),
            })
            specs["mtp"].append(blk)
    return specs


def param_specs_layer(c: ModelConfig, layer: int) -> dict[str, Any]:
    """The :class:`ParamSpec` pytree of backbone layer ``layer`` (same as ``param_specs(c)["layers"][layer]``)."""
    if c.is_v41:
        return _v41_block(c, f"layers.{layer}.", layer)
    return _block(c, f"layers.{layer}.", c.attn_kinds[layer], c.compress_ratios[layer], c.hash_layers[layer])


def engram_table_rows(c: ModelConfig) -> int:
    """Scalars held by the host-side Engram tables (rows × head_dim summed over Engram layers)."""
    return sum(c.engram_num_embeddings) * c.engram_head_dim


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
    return jax.tree_util.tree_map(fn, specs, is_leaf=is_spec)


def check_weights_mode(weights: str) -> str:
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    return weights


def abstract_params(c: ModelConfig, dtype: Any = jnp.bfloat16, include_mtp: bool = True, weights: str = "dense",
                    scale_dtype: Any = jnp.float8_e8m0fnu) -> Any:
    """``jax.ShapeDtypeStruct`` pytree of the parameters: no memory is allocated.

    ``weights="native"``: weights the release stores quantised (``ParamSpec.quant``) become ``QuantizedWeight``
    of ``ShapeDtypeStruct`` (codes + ``scale_dtype`` scales), so device bytes can be computed with
    :func:`~dinfer_jax.models.qweights.tree_nbytes`. A config without ``quantization_config`` has none.
    """
    check_weights_mode(weights)
    return map_specs(lambda s: s.abstract(dtype, weights, scale_dtype), param_specs(c, include_mtp))


def count_params(tree: Any) -> int:
    """Number of logical scalars in a pytree of arrays, ``ShapeDtypeStruct`` or ``QuantizedWeight``."""
    return logical_size(tree)


def init_params(c: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, include_mtp: bool = True,
                std: float = 0.02) -> Any:
    """Random parameters (numpy RNG, host side) for tests and experiments.

    Matrices ~ N(0, std²); norms 1; everything a framework would zero-initialise (sinks, compressor ``ape``,
    mHC bases, router bias) ~ N(0, 0.5²) or N(0, 0.1²) so every path of the forward matters; ``tid2eid`` holds k
    distinct experts per token id.
    """
    rng = np.random.default_rng(seed)
    E, k = c.n_routed_experts, c.n_activated_experts

    def make(s: ParamSpec) -> jax.Array:
        if s.init == "ones":
            x = 1.0 + 0.1 * rng.standard_normal(s.shape)
        elif s.init == "zeros":
            x = np.zeros(s.shape)
        elif s.init == "bias":
            x = (0.1 if "gate.bias" in s.ckpt else 0.5) * rng.standard_normal(s.shape)
        elif s.init == "tid2eid":
            x = np.argsort(rng.random((s.shape[0], E)), axis=1)[:, :k]
        else:
            x = std * rng.standard_normal(s.shape)
        return jnp.asarray(x, dtype=s.dtype(dtype))

    return map_specs(make, param_specs(c, include_mtp))
