"""Typed configuration of the DeepSeek-V4 family, read from a checkpoint's ``config.json``.

Two spellings of the same model exist (spec ``docs/spec/model-v4.md`` §1):

* DeepSeek's release: ``compress_ratios`` (one entry per layer plus one per MTP block), ``num_hash_layers``,
  ``qk_rope_head_dim``, ``rope_scaling`` (or the ``inference/config.json`` names ``dim``, ``n_layers``, ...).
* transformers' ``save_pretrained``: ``layer_types`` + ``compress_rates``, ``mlp_layer_types``,
  ``partial_rotary_factor`` and nested ``rope_parameters`` ``{main: ..., compress: ...}``.

Both are parsed into one frozen :class:`ModelConfig`. Invalid values raise :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ATTN_SLIDING = "sliding"
ATTN_CSA = "csa"
ATTN_HCA = "hca"
ATTN_SHARED = "shared"  # V4.1: ratio 1 or 2 compressed KV, possibly owned by an earlier (source) layer
ATTENTION_KINDS = (ATTN_SLIDING, ATTN_CSA, ATTN_HCA, ATTN_SHARED)
MODEL_V4 = "deepseek_v4"
MODEL_V41 = "deepseek_v41"

_HF_LAYER_TYPE_TO_KIND = {
    "sliding_attention": ATTN_SLIDING,
    "compressed_sparse_attention": ATTN_CSA,
    "heavily_compressed_attention": ATTN_HCA,
}
_CSA_RATIO = 4  # DeepSeek's reference: overlap + indexer iff compress_ratio == 4

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or violates a model constraint."""


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation (no magnitude scaling), applied to the compress rope only."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Quantised checkpoint format: FP8 e4m3 linears with block scales, optionally FP4 routed experts."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str | None = None  # "fp4" (MXFP4, 1x32 scales) or "fp8"/None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One DeepSeek-V4 model. Notation follows ``docs/spec/model-v4.md``: D, H, d, r, n, m, W, G, R, E, k, I."""

    vocab_size: int
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H
    head_dim: int  # d
    rope_head_dim: int  # r
    q_lora_rank: int
    o_groups: int  # G
    o_lora_rank: int  # R
    sliding_window: int  # W
    attn_kinds: tuple[str, ...]  # per backbone layer: "sliding" | "csa" | "hca"
    compress_ratios: tuple[int, ...]  # per backbone layer, 0 for sliding
    hash_layers: tuple[bool, ...]  # per backbone layer: MoE routed by tid2eid
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnConfig | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_inter_dim: int  # I
    n_routed_experts: int  # E
    n_shared_experts: int
    n_activated_experts: int  # k
    route_scale: float
    swiglu_limit: float
    hc_mult: int  # n
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    n_mtp_layers: int = 0
    mtp_compress_ratios: tuple[int, ...] = ()
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    quantization: QuantConfig | None = None
    model_type: str = MODEL_V4
    # ---- DeepSeek-V4.1 (docs/spec/model-v41.md); V4 keeps the defaults ----
    hc_shifted: bool = False  # shifted single-pass mHC, no HC head
    use_qnorm: bool = True  # per-head unweighted RMSNorm of q (V4 only)
    kv_fake_quant: bool = False  # Q8 SWA KV, Q4e compressed KV, Q4u indexer Q/K (V4.1 reference numerics)
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    index_k_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1  # < 0: no candidate blocks
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    gate_temp: float = 1.0
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 0
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    image_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        validate(self)

    @property
    def is_v41(self) -> bool:
        return self.model_type == MODEL_V41

    @staticmethod
    def _nearest(source_ids: tuple[int, ...], layer: int) -> int:
        below = [s for s in source_ids if s <= layer]
        return max(below) if below else -1

    def kv_source(self, layer: int) -> int:
        """V4.1: the layer whose compressed KV ``layer`` reads (−1 for sliding-only layers)."""
        if self.compress_ratios[layer] == 0:
            return -1
        return self._nearest(self.kv_source_layer_ids, layer)

    def index_source(self, layer: int) -> int:
        """V4.1: the layer whose top-k selection ``layer`` uses (itself for an index source)."""
        if self.compress_ratios[layer] == 0:
            return -1
        return self._nearest(self.index_source_layer_ids, layer)

    def index_k_source(self, layer: int) -> int:
        """V4.1: the layer that owns the index keys ``layer``'s indexer scores against."""
        return self._nearest(self.index_k_source_layer_ids or self.kv_source_layer_ids, layer)

    def uses_candidates(self, layer: int) -> bool:
        """V4.1: index source restricted to the candidate blocks of an earlier candidate source."""
        c = self.candidate_source_layer_id
        return (c >= 0 and layer > c and layer in self.index_source_layer_ids
                and self.kv_source(layer) == self.kv_source(c))

    @property
    def n_prefill_layer(self) -> int:
        """V4.1 YOCO boundary: the first ratio-1 layer (all layers when there is none)."""
        return next((i for i, r in enumerate(self.compress_ratios) if r == 1), self.num_layers)

    @property
    def qk_nope_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def layer_kind(self, layer: int) -> str:
        return self.attn_kinds[layer]

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable DeepSeek-release spelling (readable back by :func:`config_from_dict`)."""
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios) + list(self.mtp_compress_ratios),
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "moe_intermediate_size": self.moe_inter_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": self.route_scale,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id),
        }
        derived = tuple(ATTN_SLIDING if r == 0 else ATTN_CSA if r == _CSA_RATIO else ATTN_HCA
                        for r in self.compress_ratios)
        if derived != self.attn_kinds:  # not expressible with DeepSeek's keys alone
            out["layer_kinds"] = list(self.attn_kinds)
        n_hash = sum(self.hash_layers)
        if self.hash_layers == tuple(i < n_hash for i in range(self.num_layers)):
            out["num_hash_layers"] = n_hash
        else:
            out["hash_layers"] = list(self.hash_layers)
        if self.is_v41:
            out.pop("layer_kinds", None)
            for f in _V41_FIELDS:
                v = getattr(self, f)
                out[f] = list(v) if isinstance(v, tuple) else v
            out["engram_pad_token_id"] = out.pop("engram_pad_id")
        if self.yarn is not None:
            out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.yarn)}
        if self.quantization is not None:
            q = self.quantization
            out["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(q.weight_block_size),
                "scale_fmt": q.scale_fmt,
            }
            if q.expert_dtype:
                out["quantization_config"]["expert_dtype"] = q.expert_dtype
        return out


# ----------------------------------------------------------------------------------------------------------------
# validation


_V41_FIELDS = ("hc_shifted", "use_qnorm", "kv_fake_quant", "kv_source_layer_ids", "index_source_layer_ids",
               "index_k_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
               "candidate_block_size", "gate_temp", "engram_layer_ids", "engram_vocab_size", "engram_num_embeddings",
               "engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_pad_id",
               "engram_compressed_vocab_size", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
               "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok", "image_token_id",
               "pad_token_id")


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"invalid config field `{field}`: {msg}")


def validate(c: ModelConfig) -> None:
    """Raise :class:`ConfigError` naming the first field that breaks a constraint of the V4 architecture."""
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups",
              "o_lora_rank", "sliding_window", "moe_inter_dim", "n_routed_experts", "n_activated_experts",
              "hc_mult", "hc_sinkhorn_iters", "index_n_heads", "index_head_dim", "index_topk"):
        v = getattr(c, f)
        _check(isinstance(v, int) and not isinstance(v, bool) and v > 0, f, f"must be a positive integer, got {v!r}")
    _check(isinstance(c.n_shared_experts, int) and c.n_shared_experts in (0, 1), "n_shared_experts",
           f"must be 0 or 1, got {c.n_shared_experts!r}")
    _check(isinstance(c.rope_head_dim, int) and 0 < c.rope_head_dim <= c.head_dim and c.rope_head_dim % 2 == 0,
           "qk_rope_head_dim", f"must be an even integer in (0, head_dim={c.head_dim}], got {c.rope_head_dim!r}")
    _check(c.rope_head_dim <= c.index_head_dim, "index_head_dim",
           f"must be >= qk_rope_head_dim ({c.rope_head_dim}), got {c.index_head_dim}")
    _check((c.num_heads * c.head_dim) % c.o_groups == 0, "o_groups",
           f"num_attention_heads*head_dim ({c.num_heads * c.head_dim}) must be divisible by o_groups ({c.o_groups})")
    _check(c.n_activated_experts <= c.n_routed_experts, "num_experts_per_tok",
           f"{c.n_activated_experts} exceeds n_routed_experts {c.n_routed_experts}")
    _check(len(c.attn_kinds) == c.num_layers, "layer_types",
           f"has {len(c.attn_kinds)} entries for num_hidden_layers={c.num_layers}")
    _check(len(c.compress_ratios) == c.num_layers, "compress_ratios",
           f"has {len(c.compress_ratios)} backbone entries for num_hidden_layers={c.num_layers}")
    _check(len(c.hash_layers) == c.num_layers, "mlp_layer_types",
           f"has {len(c.hash_layers)} entries for num_hidden_layers={c.num_layers}")
    for i, (kind, ratio) in enumerate(zip(c.attn_kinds, c.compress_ratios, strict=False)):
        _check(kind in ATTENTION_KINDS, "layer_types", f"layer {i}: unknown attention kind {kind!r}")
        if c.is_v41:
            _check(ratio in (0, 1, 2), "compress_ratios", f"layer {i}: V4.1 supports ratios 0, 1, 2, got {ratio}")
            _check(kind == (ATTN_SLIDING if ratio == 0 else ATTN_SHARED), "compress_ratios",
                   f"layer {i}: kind {kind!r} does not match ratio {ratio}")
        elif kind == ATTN_SLIDING:
            _check(ratio == 0, "compress_ratios", f"layer {i}: sliding layer must have ratio 0, got {ratio}")
        else:
            _check(isinstance(ratio, int) and ratio >= 2, "compress_ratios",
                   f"layer {i}: compressed layer needs an integer ratio >= 2, got {ratio!r}")
    _check(c.n_mtp_layers >= 0, "num_nextn_predict_layers", f"must be >= 0, got {c.n_mtp_layers}")
    _check(len(c.mtp_compress_ratios) == c.n_mtp_layers, "compress_ratios",
           f"has {len(c.mtp_compress_ratios)} MTP entries for num_nextn_predict_layers={c.n_mtp_layers}")
    _check(all(r == 0 for r in c.mtp_compress_ratios), "compress_ratios", "MTP blocks must be sliding-only (ratio 0)")
    for f in ("rope_theta", "compress_rope_theta", "route_scale", "swiglu_limit"):
        v = getattr(c, f)
        _check(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f, f"must be a positive number, got {v!r}")
    for f in ("hc_eps", "norm_eps"):
        v = getattr(c, f)
        _check(isinstance(v, (int, float)) and 0 <= v < 1, f, f"must be in [0, 1), got {v!r}")
    if c.yarn is not None:
        _check(c.yarn.factor >= 1, "rope_scaling.factor", f"must be >= 1, got {c.yarn.factor}")
        _check(c.yarn.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings",
               "must be positive")
    if c.is_v41:
        _validate_v41(c)
    if c.quantization is not None:
        bs = c.quantization.weight_block_size
        _check(len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs),
               "quantization_config.weight_block_size", f"must be two positive integers, got {bs!r}")
        _check(c.quantization.expert_dtype in (None, "fp4", "fp8", "bf16"), "quantization_config.expert_dtype",
               f"unsupported {c.quantization.expert_dtype!r}")


def _validate_v41(c: ModelConfig) -> None:
    """Constraints DeepInfer asserts for V4.1's cross-layer sharing, Engram and DSpark (docs/spec/model-v41.md §1)."""
    L = c.num_layers
    for f in ("kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids", "engram_layer_ids",
              "dspark_target_layer_ids"):
        ids = getattr(c, f)
        _check(all(isinstance(i, int) and 0 <= i < L for i in ids), f, f"layer ids must lie in [0, {L}), got {ids}")
        _check(list(ids) == sorted(set(ids)), f, f"must be strictly increasing, got {ids}")
    for i in c.kv_source_layer_ids:
        _check(c.compress_ratios[i] > 0, "kv_source_layer_ids", f"layer {i} has ratio 0 and cannot own compressed KV")
    for i, r in enumerate(c.compress_ratios):
        if r == 0:
            continue
        src = c.kv_source(i)
        _check(src >= 0, "kv_source_layer_ids", f"compressed layer {i} has no KV source at or before it")
        _check(c.compress_ratios[src] == r, "compress_ratios",
               f"layer {i} (ratio {r}) shares KV of layer {src} with ratio {c.compress_ratios[src]}")
        _check(c.index_source(i) >= 0, "index_source_layer_ids", f"compressed layer {i} has no index source")
        _check(c.kv_source(c.index_source(i)) == src, "index_source_layer_ids",
               f"layer {i}: its index source {c.index_source(i)} reads a different KV segment (index ⊆ KV violated)")
    for i in c.index_source_layer_ids:
        _check(c.compress_ratios[i] > 0, "index_source_layer_ids", f"layer {i} has ratio 0")
        ks = c.index_k_source(i)
        k_sources = c.index_k_source_layer_ids or c.kv_source_layer_ids
        _check(ks >= 0 and ks in k_sources and c.kv_source(ks) == c.kv_source(i),
               "index_k_source_layer_ids", f"index source {i} has no index-K source in its KV segment")
    for i in c.index_k_source_layer_ids:
        _check(i in c.kv_source_layer_ids, "index_k_source_layer_ids",
               f"layer {i}: index keys are projected from the compressed latent, so it must be a KV source")
    npl = c.n_prefill_layer
    if npl < L:
        _check(c.kv_source(npl) == npl, "kv_source_layer_ids",
               f"KV sharing crosses the YOCO boundary at layer {npl} (the first ratio-1 layer must be a KV source)")
    if c.candidate_source_layer_id >= 0:
        _check(c.candidate_source_layer_id in c.index_source_layer_ids, "candidate_source_layer_id",
               f"{c.candidate_source_layer_id} is not an index source")
        _check(c.candidate_topk_blocks > 0 and c.candidate_block_size > 0, "candidate_topk_blocks",
               "candidate blocks need positive candidate_topk_blocks and candidate_block_size")
    if c.engram_layer_ids:
        for f in ("engram_vocab_size", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
                  "engram_compressed_vocab_size"):
            _check(getattr(c, f) > 0, f, "must be positive when engram_layer_ids is set")
        _check(c.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
        _check(len(c.engram_num_embeddings) == len(c.engram_layer_ids), "engram_num_embeddings",
               f"needs one table size per Engram layer ({len(c.engram_layer_ids)})")
    if c.n_mtp_layers:
        _check(c.dspark_block_size > 0, "dspark_block_size", "must be positive with DSpark layers")
        _check(c.dspark_n_routed_experts >= c.dspark_num_experts_per_tok > 0, "dspark_num_experts_per_tok",
               "must be in [1, dspark_n_routed_experts]")
        _check(len(c.dspark_target_layer_ids) > 0, "dspark_target_layer_ids", "must name the target layers")
    _check(c.n_shared_experts == 1 or c.n_shared_experts == 0, "n_shared_experts", "must be 0 or 1")
    _check(c.gate_temp > 0, "gate_temp", f"must be positive, got {c.gate_temp}")


# ----------------------------------------------------------------------------------------------------------------
# parsing


def _get(d: Mapping[str, Any], *names: str, default: Any = KeyError) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    if default is KeyError:
        raise ConfigError(f"missing config field `{names[0]}`" + (f" (or {', '.join(names[1:])})" if names[1:] else ""))
    return default


def _int(d: Mapping[str, Any], *names: str, default: Any = KeyError) -> int:
    v = _get(d, *names, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"invalid config field `{names[0]}`: expected an integer, got {v!r}")
    return int(v)


def _float(d: Mapping[str, Any], *names: str, default: Any = KeyError) -> float:
    v = _get(d, *names, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"invalid config field `{names[0]}`: expected a number, got {v!r}")
    return float(v)


def _parse_layers(d: Mapping[str, Any], n_layers: int,
                  n_mtp: int) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Per-layer attention kinds and ratios from ``layer_kinds``/``layer_types``+``compress_rates`` or
    ``compress_ratios``."""
    if "layer_types" in d and d["layer_types"] is not None:
        rates = d.get("compress_rates") or {}
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **rates}
        if "compress_rate_csa" in d:
            rates["compressed_sparse_attention"] = d["compress_rate_csa"]
        if "compress_rate_hca" in d:
            rates["heavily_compressed_attention"] = d["compress_rate_hca"]
        kinds, ratios = [], []
        for i, t in enumerate(d["layer_types"]):
            if t not in _HF_LAYER_TYPE_TO_KIND:
                raise ConfigError(f"invalid config field `layer_types`: layer {i} has unknown type {t!r}")
            kinds.append(_HF_LAYER_TYPE_TO_KIND[t])
            ratios.append(0 if t == "sliding_attention" else int(rates[t]))
        if len(kinds) < n_layers:
            raise ConfigError(f"invalid config field `layer_types`: {len(kinds)} entries for {n_layers} layers")
        return tuple(kinds[:n_layers]), tuple(ratios[:n_layers]), (0,) * n_mtp
    if "compress_ratios" not in d:
        raise ConfigError("missing config field `compress_ratios` (or `layer_types`): "
                          "the layer pattern must be explicit")
    all_ratios = d["compress_ratios"]
    if not isinstance(all_ratios, (list, tuple)) or not all(isinstance(r, int) for r in all_ratios):
        raise ConfigError(f"invalid config field `compress_ratios`: expected a list of integers, got {all_ratios!r}")
    if len(all_ratios) < n_layers:
        raise ConfigError(f"invalid config field `compress_ratios`: {len(all_ratios)} entries for {n_layers} layers")
    ratios = tuple(all_ratios[:n_layers])
    if "layer_kinds" in d:
        kinds = tuple(d["layer_kinds"])
    else:
        kinds = tuple(ATTN_SLIDING if r == 0 else ATTN_CSA if r == _CSA_RATIO else ATTN_HCA for r in ratios)
    mtp = tuple(all_ratios[n_layers:n_layers + n_mtp])
    mtp = mtp + (0,) * (n_mtp - len(mtp))
    return kinds, ratios, mtp


def _parse_hash_layers(d: Mapping[str, Any], n_layers: int) -> tuple[bool, ...]:
    if d.get("hash_layers") is not None:
        return tuple(bool(x) for x in d["hash_layers"])
    if d.get("mlp_layer_types") is not None:
        out = []
        for i, t in enumerate(d["mlp_layer_types"]):
            if t not in ("hash_moe", "moe"):
                raise ConfigError(f"invalid config field `mlp_layer_types`: layer {i} has unknown type {t!r}")
            out.append(t == "hash_moe")
        return tuple(out[:n_layers])
    n_hash = _int(d, "num_hash_layers", "n_hash_layers", default=0)
    if n_hash < 0 or n_hash > n_layers:
        raise ConfigError(f"invalid config field `num_hash_layers`: {n_hash} not in [0, {n_layers}]")
    return tuple(i < n_hash for i in range(n_layers))


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, float, YarnConfig | None]:
    rope_theta = _float(d, "rope_theta", default=10000.0)
    compress_theta = _float(d, "compress_rope_theta", default=160000.0)
    yarn_src: Mapping[str, Any] | None = None
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
        rope_theta = float(rp["main"].get("rope_theta", rope_theta))
        comp = rp["compress"]
        compress_theta = float(comp.get("rope_theta", compress_theta))
        if rp["main"].get("rope_type", "default") != "default":
            raise ConfigError("invalid config field `rope_parameters.main.rope_type`: V4 main rope has no scaling")
        if comp.get("rope_type", comp.get("type", "default")) == "yarn":
            yarn_src = comp
    elif isinstance(rp, Mapping) and rp.get("rope_type", rp.get("type")) == "yarn":
        yarn_src = rp
    rs = d.get("rope_scaling")
    if yarn_src is None and isinstance(rs, Mapping) and rs.get("type", rs.get("rope_type")) == "yarn":
        yarn_src = rs
    if yarn_src is None and "rope_factor" in d:  # DeepSeek inference/config.json
        yarn_src = {"factor": d["rope_factor"], "original_max_position_embeddings": d.get("original_seq_len"),
                    "beta_fast": d.get("beta_fast", 32), "beta_slow": d.get("beta_slow", 1)}
    yarn = None
    if yarn_src is not None:
        mscale = yarn_src.get("attention_factor", 1.0)
        if mscale not in (None, 1, 1.0):
            raise ConfigError(f"invalid config field `rope_scaling.attention_factor`: V4 uses none, got {mscale!r}")
        yarn = YarnConfig(
            factor=_float(yarn_src, "factor", "rope_factor"),
            original_max_position_embeddings=_int(yarn_src, "original_max_position_embeddings", "original_seq_len"),
            beta_fast=_float(yarn_src, "beta_fast", default=32.0),
            beta_slow=_float(yarn_src, "beta_slow", default=1.0),
        )
    return rope_theta, compress_theta, yarn


def _parse_quant(d: Mapping[str, Any]) -> QuantConfig | None:
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"invalid config field `quantization_config`: expected an object, got {q!r}")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise ConfigError(f"invalid config field `quantization_config.quant_method`: unsupported {method!r}")
    bs = q.get("weight_block_size", [128, 128])
    if not isinstance(bs, (list, tuple)) or len(bs) != 2:
        raise ConfigError(f"invalid config field `quantization_config.weight_block_size`: {bs!r}")
    return QuantConfig(
        weight_block_size=(int(bs[0]), int(bs[1])),
        scale_fmt=q.get("scale_fmt"),
        expert_dtype=q.get("expert_dtype", d.get("expert_dtype")),
    )


def config_from_dict(raw: Mapping[str, Any]) -> ModelConfig:
    """Parse a V4 ``config.json`` dict in either the DeepSeek or the transformers spelling."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    d = dict(raw)
    model_type = d.get("model_type", MODEL_V4)
    if model_type == MODEL_V41 and isinstance(d.get("text_config"), Mapping):
        # Composite V4.1 config: the text model's keys live in text_config; quantisation and special ids on top.
        top = d
        d = dict(top["text_config"])
        for key in ("quantization_config", "image_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
            if key in top and top[key] is not None:
                d[key] = top[key]
        model_type = MODEL_V41
    elif model_type in (MODEL_V41, "deepseek_v41_text"):
        model_type = MODEL_V41
    elif model_type != MODEL_V4:
        raise ConfigError(f"invalid config field `model_type`: {model_type!r} is not supported by this loader")
    if _int(d, "num_key_value_heads", default=1) != 1:
        raise ConfigError("invalid config field `num_key_value_heads`: V4 has exactly one shared KV head")
    for f, want in (("scoring_func", "sqrtsoftplus"), ("score_func", "sqrtsoftplus"), ("topk_method", "noaux_tc"),
                    ("hidden_act", "silu")):
        if f in d and d[f] is not None and d[f] != want:
            raise ConfigError(f"invalid config field `{f}`: V4 requires {want!r}, got {d[f]!r}")
    if d.get("norm_topk_prob", True) is not True:
        raise ConfigError("invalid config field `norm_topk_prob`: V4 requires true")
    if d.get("tie_word_embeddings", False):
        raise ConfigError("invalid config field `tie_word_embeddings`: V4 head is not tied to the embedding")

    n_layers = _int(d, "num_hidden_layers", "n_layers")
    n_mtp = _int(d, "num_nextn_predict_layers", "n_mtp_layers", default=0)
    head_dim = _int(d, "head_dim", default=512)
    if "qk_rope_head_dim" in d or "rope_head_dim" in d:
        rope_dim = _int(d, "qk_rope_head_dim", "rope_head_dim")
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
    else:
        rope_dim = 64
    if model_type == MODEL_V41:
        if not isinstance(d.get("compress_ratios"), (list, tuple)):
            raise ConfigError("missing config field `compress_ratios` (V4.1 needs the per-layer ratios)")
        d = {k: v for k, v in d.items() if k not in ("layer_types", "layer_kinds")}
        d["layer_kinds"] = [ATTN_SLIDING if r == 0 else ATTN_SHARED for r in d["compress_ratios"][:n_layers]]
    kinds, ratios, mtp_ratios = _parse_layers(d, n_layers, n_mtp)
    rope_theta, compress_theta, yarn = _parse_rope(d)
    eos = d.get("eos_token_id", 1)
    eos_t = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelConfig(
        vocab_size=_int(d, "vocab_size"),
        hidden_size=_int(d, "hidden_size", "dim"),
        num_layers=n_layers,
        num_heads=_int(d, "num_attention_heads", "n_heads"),
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=_int(d, "q_lora_rank"),
        o_groups=_int(d, "o_groups"),
        o_lora_rank=_int(d, "o_lora_rank"),
        sliding_window=_int(d, "sliding_window", "window_size"),
        attn_kinds=kinds,
        compress_ratios=ratios,
        hash_layers=_parse_hash_layers(d, n_layers),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        index_n_heads=_int(d, "index_n_heads"),
        index_head_dim=_int(d, "index_head_dim"),
        index_topk=_int(d, "index_topk"),
        moe_inter_dim=_int(d, "moe_intermediate_size", "moe_inter_dim"),
        n_routed_experts=_int(d, "n_routed_experts"),
        n_shared_experts=_int(d, "n_shared_experts", default=1),
        n_activated_experts=_int(d, "num_experts_per_tok", "n_activated_experts"),
        route_scale=_float(d, "routed_scaling_factor", "route_scale", default=1.0),
        swiglu_limit=_float(d, "swiglu_limit", default=10.0),
        hc_mult=_int(d, "hc_mult", default=4),
        hc_sinkhorn_iters=_int(d, "hc_sinkhorn_iters", default=20),
        hc_eps=_float(d, "hc_eps", default=1e-6),
        norm_eps=_float(d, "rms_norm_eps", "norm_eps", default=1e-6),
        n_mtp_layers=n_mtp,
        mtp_compress_ratios=mtp_ratios,
        max_position_embeddings=_int(d, "max_position_embeddings", "max_seq_len", default=1048576),
        bos_token_id=d.get("bos_token_id", 0),
        eos_token_id=eos_t,
        quantization=_parse_quant(d),
        model_type=model_type,
        **(_parse_v41_fields(d) if model_type == MODEL_V41 else {}),
    )


def _int_tuple(d: Mapping[str, Any], name: str) -> tuple[int, ...]:
    v = d.get(name) or ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ConfigError(f"invalid config field `{name}`: expected a list of integers, got {v!r}")
    return tuple(v)


def _parse_v41_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """V4.1 keys, with DeepInfer's defaults for keys the checkpoint omits (hc_shifted, no q norm, KV fake-quant)."""
    cand = d.get("candidate_source_layer_id")
    return dict(
        hc_shifted=bool(d.get("hc_shifted", True)),
        use_qnorm=bool(d.get("use_qnorm", False)),
        kv_fake_quant=bool(d.get("kv_fake_quant", True)),
        kv_source_layer_ids=_int_tuple(d, "kv_source_layer_ids"),
        index_source_layer_ids=_int_tuple(d, "index_source_layer_ids"),
        index_k_source_layer_ids=_int_tuple(d, "index_k_source_layer_ids"),
        candidate_source_layer_id=-1 if cand is None or cand < 0 else _int(d, "candidate_source_layer_id"),
        candidate_topk_blocks=_int(d, "candidate_topk_blocks", default=0),
        candidate_block_size=_int(d, "candidate_block_size", default=0),
        gate_temp=_float(d, "gate_temp", default=1.0),
        engram_layer_ids=_int_tuple(d, "engram_layer_ids"),
        engram_vocab_size=_int(d, "engram_vocab_size", default=0),
        engram_num_embeddings=_int_tuple(d, "engram_num_embeddings"),
        engram_max_ngram_size=_int(d, "engram_max_ngram_size", default=0),
        engram_n_heads=_int(d, "engram_n_heads", default=0),
        engram_head_dim=_int(d, "engram_head_dim", default=0),
        engram_pad_id=_int(d, "engram_pad_token_id", "engram_pad_id", default=2),
        engram_compressed_vocab_size=_int(d, "engram_compressed_vocab_size", default=0),
        dspark_block_size=_int(d, "dspark_block_size", default=0),
        dspark_noise_token_id=_int(d, "dspark_noise_token_id", default=0),
        dspark_target_layer_ids=_int_tuple(d, "dspark_target_layer_ids"),
        dspark_markov_rank=_int(d, "dspark_markov_rank", default=0),
        dspark_n_routed_experts=_int(d, "dspark_n_routed_experts", default=0),
        dspark_num_experts_per_tok=_int(d, "dspark_num_experts_per_tok", default=0),
        image_token_id=d.get("image_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )


def preset_names() -> list[str]:
    """Names accepted by :func:`load_config` besides paths (the JSON files in ``configs/``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_config(path_or_preset: str | Path) -> ModelConfig:
    """Read a config from a checkpoint directory, a ``config.json`` path, a registered checkpoint name such as
    ``"default"`` (:mod:`dinfer_jax.checkpoints`), or a preset name in ``configs/``."""
    from dinfer_jax.checkpoints import resolve_checkpoint

    p = Path(path_or_preset)
    if not p.exists() and not (PRESET_DIR / f"{path_or_preset}.json").is_file():
        p = resolve_checkpoint(str(path_or_preset)) or p
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"checkpoint directory {path_or_preset} has no config.json")
    elif not p.is_file():
        preset = PRESET_DIR / f"{path_or_preset}.json"
        if not preset.is_file():
            raise ConfigError(f"{path_or_preset!r} is neither a checkpoint directory, a config.json path, nor a "
                              f"preset (known presets: {', '.join(preset_names())})")
        p = preset
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    return config_from_dict(raw)
