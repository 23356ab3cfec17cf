"""The transformers ``DeepseekV4ForCausalLM`` reference (``pip install -e .[reference]``: torch 2.13.0 +
transformers 5.24.0): build random tiny models, randomise what transformers zero-initialises, run and record.

Used by the parity tests and ``scripts/compare_torch.py``. torch is imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

REFERENCE_TRANSFORMERS = "5.24.0"

_KIND_TO_HF = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
               "hca": "heavily_compressed_attention"}


def hf_config_kwargs(*, layer_kinds: list[str], hash_layers: int = 2, csa_ratio: int = 4, hca_ratio: int = 16,
                     yarn: bool = True, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of a tiny ``DeepseekV4Config`` (``docs/spec/model-v4.md`` §7.2) with an explicit pattern."""
    n = len(layer_kinds)
    kw: dict[str, Any] = dict(
        vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=n,
        layer_types=[_KIND_TO_HF[k] for k in layer_kinds],
        mlp_layer_types=["hash_moe" if i < hash_layers else "moe" for i in range(n)],
        compress_rates={"compressed_sparse_attention": csa_ratio, "heavily_compressed_attention": hca_ratio},
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
        sliding_window=8, index_n_heads=4, index_head_dim=16, index_topk=64, max_position_embeddings=4096,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
        tie_word_embeddings=False,
    )
    if yarn:
        kw["rope_parameters"] = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                                 "beta_fast": 32.0, "beta_slow": 1.0}
    kw.update(overrides)
    return kw


def build_random_hf_model(config_kwargs: dict[str, Any], seed: int = 0, weight_std: float = 0.1):
    """A random fp32 ``DeepseekV4ForCausalLM`` in eval mode, with every zero-initialised path randomised.

    Matrices get N(0, weight_std²) so activations are O(1) and every sublayer moves the logits; sinks, compressor
    ``position_bias`` and mHC bases N(0, 0.5²); router bias N(0, 0.1²); ``tid2eid`` k distinct experts per token.
    """
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**config_kwargs)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed + 1)
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary_emb" in name:
                continue
            if name.endswith("tid2eid"):
                t.copy_(torch.argsort(torch.rand(t.shape[0], E, generator=gen), dim=1)[:, :k])
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith((".scale", "hc_scale")):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
            elif t.ndim == 1:  # RMSNorm weights
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
            elif t.is_floating_point():
                t.copy_(weight_std * torch.randn(t.shape, generator=gen))
    return model


def save_hf_model(model, directory: str | Path) -> Path:
    """``save_pretrained`` into ``directory`` (safetensors)."""
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def hf_logits(model, token_ids: np.ndarray) -> np.ndarray:
    """Stateless (``use_cache=False``) fp32 logits ``[B,S,V]``."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(token_ids), dtype=torch.long), use_cache=False)
    return out.logits.float().numpy()


def hf_logits_and_layers(model, token_ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], dict[int, np.ndarray]]:
    """Logits, the streams after each decoder layer ``[B,S,n,D]`` and the indexer picks per CSA layer ``[B,S,k]``
    (−1 = invalid), recorded with forward hooks (stateless path)."""
    layers_out: list[np.ndarray] = []
    picks: dict[int, np.ndarray] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(lambda m, a, o: layers_out.append(o.detach().float().numpy())))
        comp = getattr(layer.self_attn, "compressor", None)
        if comp is not None and hasattr(comp, "indexer"):
            handles.append(comp.indexer.register_forward_hook(
                lambda m, a, o, i=i: picks.__setitem__(i, o.detach().numpy())))
    try:
        logits = hf_logits(model, token_ids)
    finally:
        for h in handles:
            h.remove()
    return logits, layers_out, picks


def hf_tensor_name(release_name: str) -> str:
    """Spelling that transformers' ``save_pretrained`` uses for a release tensor name (third column of the table
    in ``docs/spec/model-v4.md`` §6.2)."""
    import re

    if release_name == "head.weight":
        return "head.weight"
    if release_name == "embed.weight":
        return "model.embed_tokens.weight"
    m = re.fullmatch(r"hc_head_(fn|base|scale)", release_name)
    if m:
        return f"model.hc_head.hc_{m.group(1)}"
    m = re.fullmatch(r"(layers\.\d+\.attn)\.kv_norm\.weight", release_name)
    if m:
        return f"model.{m.group(1)}.norm.weight"
    return f"model.{release_name}"


def hf_config_dict(cfg) -> dict[str, Any]:
    """transformers ``DeepseekV4Config`` keyword arguments equivalent to a :class:`ModelConfig`."""
    rates: dict[str, int] = {}
    for kind, ratio in zip(cfg.attn_kinds, cfg.compress_ratios, strict=True):
        if kind == "sliding":
            continue
        key = _KIND_TO_HF[kind]
        if rates.setdefault(key, ratio) != ratio:
            raise ValueError(f"transformers needs one compress rate per layer type; {key} has {rates[key]} and {ratio}")
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta}
    if cfg.yarn is not None:
        compress = {"rope_type": "yarn", "rope_theta": cfg.compress_rope_theta, "factor": cfg.yarn.factor,
                    "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
                    "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow, "attention_factor": 1.0}
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.num_layers, layer_types=[_KIND_TO_HF[k] for k in cfg.attn_kinds],
        mlp_layer_types=["hash_moe" if h else "moe" for h in cfg.hash_layers],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **rates},
        num_attention_heads=cfg.num_heads, num_key_value_heads=1, head_dim=cfg.head_dim,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.n_activated_experts, n_shared_experts=cfg.n_shared_experts,
        routed_scaling_factor=cfg.route_scale, swiglu_limit=cfg.swiglu_limit,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "compress": compress},
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta, sliding_window=cfg.sliding_window,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        max_position_embeddings=cfg.max_position_embeddings, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_norm_eps=cfg.norm_eps,
        num_nextn_predict_layers=cfg.n_mtp_layers, tie_word_embeddings=False,
    )


def hf_model_from_params(cfg, params):
    """A transformers model (fp32, eval) holding exactly the given parameters (MTP blocks are not built by HF)."""
    import tempfile

    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dinfer_jax.loading.safetensors_io import save_file
    from dinfer_jax.loading.writer import iter_release_tensors

    tensors = {}
    for name, value in iter_release_tensors(cfg, params):
        if name.startswith("mtp."):
            continue
        v = np.asarray(value)
        tensors[hf_tensor_name(name)] = v.astype(np.int64) if name.endswith("tid2eid") else v.astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        DeepseekV4Config(**hf_config_dict(cfg)).save_pretrained(d)
        save_file(tensors, Path(d) / "model.safetensors", metadata={"format": "pt"})
        model = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    return model
