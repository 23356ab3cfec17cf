"""MTP block (``docs/spec/model-v4.md`` §3.10) against the formula, with transformers' own decoder layer, HC head, norm
as the block reference (transformers does not build MTP, but the MTP block is a standard sliding-only V4 block
with learned routing). The backbone streams fed to MTP are ours; their parity is covered by
test_parity_transformers. Tolerance 1e-4 × max |reference logit| as for the backbone (fp32 both sides)."""

from __future__ import annotations

import numpy as np

from helpers import rel_err, require_reference


def _load_block_into_hf(layer, p):
    import torch

    t = lambda x: torch.as_tensor(np.array(x, np.float32))  # noqa: E731
    a, f = p["attn"], p["ffn"]
    sd = {
        "self_attn.q_a_proj.weight": a["wq_a"], "self_attn.q_a_norm.weight": a["q_norm"],
        "self_attn.q_b_proj.weight": a["wq_b"], "self_attn.kv_proj.weight": a["wkv"],
        "self_attn.kv_norm.weight": a["kv_norm"], "self_attn.o_a_proj.weight": a["wo_a"],
        "self_attn.o_b_proj.weight": a["wo_b"], "self_attn.sinks": a["attn_sink"],
        "input_layernorm.weight": p["attn_norm"], "post_attention_layernorm.weight": p["ffn_norm"],
        "mlp.gate.weight": f["gate"]["weight"], "mlp.gate.e_score_correction_bias": f["gate"]["bias"],
        "mlp.experts.gate_up_proj": np.concatenate([np.asarray(f["experts"]["w1"]), np.asarray(f["experts"]["w3"])], 1),
        "mlp.experts.down_proj": f["experts"]["w2"],
        "mlp.shared_experts.gate_proj.weight": f["shared_experts"]["w1"],
        "mlp.shared_experts.up_proj.weight": f["shared_experts"]["w3"],
        "mlp.shared_experts.down_proj.weight": f["shared_experts"]["w2"],
    }
    for site, hf_site in (("hc_attn", "attn_hc"), ("hc_ffn", "ffn_hc")):
        for k in ("fn", "base", "scale"):
            sd[f"{hf_site}.{k}"] = p[site][k]
    layer.load_state_dict({k: t(v) for k, v in sd.items()}, strict=True)


def test_mtp_block_matches_formula_with_transformers_block():
    torch = require_reference()
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4DecoderLayer,
        DeepseekV4HyperHead,
        DeepseekV4RotaryEmbedding,
    )

    from dinfer_jax.models import inspect, load_config, mtp_logits, random_model
    from dinfer_jax.reference.transformers_v4 import hf_config_kwargs

    cfg = load_config("tiny-v4")
    model = random_model(cfg, seed=3, std=0.1)
    S = 30
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, S))
    ours = mtp_logits(model, ids)
    streams = inspect(model, ids)["hidden_states"][-1][:, :-1]

    hf_cfg = DeepseekV4Config(**hf_config_kwargs(layer_kinds=["sliding"], hash_layers=0, sliding_window=8))
    P = model.params
    p = P["mtp"][0]
    T = lambda x: torch.as_tensor(np.array(x, np.float32))  # noqa: E731
    eps = cfg.norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        e = rms(T(P["embed"])[torch.as_tensor(ids[:, 1:])], T(p["enorm"]))
        x = rms(T(streams), T(p["hnorm"]))
        X = (e @ T(p["e_proj"]).T)[:, :, None, :] + x @ T(p["h_proj"]).T
        layer = DeepseekV4DecoderLayer(hf_cfg, 0).float().eval()
        _load_block_into_hf(layer, p)
        pos = torch.arange(S - 1)[None]
        rotary = DeepseekV4RotaryEmbedding(hf_cfg)
        pe = {k: rotary(X, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        q, k = torch.arange(S - 1)[:, None], torch.arange(S - 1)[None, :]
        allowed = (k <= q) & (k > q - cfg.sliding_window)
        mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
        Xo = layer(X, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=None, cache=None)
        head = DeepseekV4HyperHead(hf_cfg).float()
        head.load_state_dict({"hc_fn": T(p["hc_head"]["fn"]), "hc_base": T(p["hc_head"]["base"]),
                              "hc_scale": T(p["hc_head"]["scale"])})
        h = rms(head(Xo), T(p["norm"]))
        ref = (h @ T(P["head"]).T).numpy()
    max_rel, mean_rel = rel_err(ours, ref)
    print(f"MTP logits: max rel err {max_rel:.2e}, mean {mean_rel:.2e}")
    assert max_rel <= 1e-4
