"""Config parsing (DeepSeek and transformers spellings), presets, validation errors, published parameter counts."""

from __future__ import annotations

import json

import pytest

from dinfer_jax.models import abstract_params, count_params, load_config
from dinfer_jax.models.config import ATTN_CSA, ATTN_HCA, ATTN_SLIDING, PRESET_DIR, ConfigError, config_from_dict


def test_flash_preset_has_published_layout():
    c = load_config("deepseek-v4-flash")
    assert c.num_layers == 43 and c.hidden_size == 4096 and c.n_routed_experts == 256
    assert c.attn_kinds[:2] == (ATTN_SLIDING, ATTN_SLIDING)
    assert all(c.attn_kinds[i] == ATTN_CSA for i in range(2, 43, 2))
    assert all(c.attn_kinds[i] == ATTN_HCA and c.compress_ratios[i] == 128 for i in range(3, 42, 2))
    assert c.hash_layers[:3] == (True, True, True) and not any(c.hash_layers[3:])
    assert c.mtp_compress_ratios == (0,) and c.n_mtp_layers == 1
    assert c.yarn is not None and c.yarn.factor == 16 and c.yarn.original_max_position_embeddings == 65536


def test_pro_preset_has_published_layout():
    c = load_config("deepseek-v4-pro")
    assert c.num_layers == 61 and c.hidden_size == 7168 and c.n_routed_experts == 384 and c.index_topk == 1024
    assert c.attn_kinds.count(ATTN_HCA) == 31 and c.attn_kinds.count(ATTN_CSA) == 30
    assert ATTN_SLIDING not in c.attn_kinds


# Published totals: V4-Flash 284B, V4-Pro 1.6T (model cards). The cards' totals match the backbone count (MTP
# excluded) within 0.1% / 1.7%; the MTP block adds 6.6B / 26B and is reported separately.
@pytest.mark.parametrize("preset,published", [("deepseek-v4-flash", 284e9), ("deepseek-v4-pro", 1.6e12)])
def test_param_count_matches_published(preset, published):
    c = load_config(preset)
    backbone = count_params(abstract_params(c, include_mtp=False))
    total = count_params(abstract_params(c))
    print(f"{preset}: backbone {backbone / 1e9:.2f}B, with MTP {total / 1e9:.2f}B, published {published / 1e9:.0f}B")
    assert abs(backbone - published) / published <= 0.02
    assert total > backbone


def test_flash_shapes_match_spec_table():
    """Spec docs/spec/model-v4.md §1.1 derived shapes (Flash), from abstract evaluation: nothing is allocated."""
    p = abstract_params(load_config("deepseek-v4-flash"))
    L2, L3 = p["layers"][2], p["layers"][3]
    a = L2["attn"]
    assert a["wq_a"].shape == (1024, 4096) and a["wq_b"].shape == (32768, 1024)
    assert a["wkv"].shape == (512, 4096) and a["wo_a"].shape == (8192, 4096) and a["wo_b"].shape == (4096, 8192)
    assert a["attn_sink"].shape == (64,) and str(a["attn_sink"].dtype) == "float32"
    assert L2["hc_attn"]["fn"].shape == (24, 16384) and L2["hc_attn"]["scale"].shape == (3,)
    assert a["compressor"]["wkv"].shape == (1024, 4096) and a["compressor"]["ape"].shape == (4, 1024)
    assert L3["attn"]["compressor"]["wkv"].shape == (512, 4096) and L3["attn"]["compressor"]["ape"].shape == (128, 512)
    assert a["indexer"]["wq_b"].shape == (8192, 1024) and a["indexer"]["weights_proj"].shape == (64, 4096)
    assert a["indexer"]["compressor"]["wkv"].shape == (256, 4096) and a["indexer"]["compressor"]["norm"].shape == (128,)
    assert L3["ffn"]["gate"]["weight"].shape == (256, 4096) and L3["ffn"]["gate"]["bias"].shape == (256,)
    assert p["layers"][0]["ffn"]["gate"]["tid2eid"].shape == (129280, 6)
    assert L3["ffn"]["experts"]["w1"].shape == (256, 2048, 4096)
    assert L3["ffn"]["experts"]["w2"].shape == (256, 4096, 2048)
    assert p["embed"].shape == (129280, 4096) and p["hc_head"]["fn"].shape == (4, 16384)
    assert "compressor" not in p["layers"][0]["attn"] and "indexer" not in L3["attn"]


def test_transformers_and_deepseek_spellings_agree():
    release = json.loads(open(PRESET_DIR / "tiny-v4.json").read())
    hf = {
        "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.25,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                                         "original_max_position_embeddings": 256, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "attention_factor": 1.0}},
        "max_position_embeddings": 4096, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1,
    }
    assert config_from_dict(hf) == config_from_dict(release)
    c = config_from_dict(release)
    assert config_from_dict(c.to_dict()) == c


def test_deepseek_inference_config_names():
    d = {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "head_dim": 32, "rope_head_dim": 8,
         "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "window_size": 8, "compress_ratios": [4, 128, 0],
         "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "moe_inter_dim": 32, "n_routed_experts": 8,
         "n_activated_experts": 2, "route_scale": 1.5, "n_hash_layers": 1, "rope_factor": 16,
         "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1, "n_mtp_layers": 1, "norm_eps": 1e-6}
    c = config_from_dict(d)
    assert c.attn_kinds == (ATTN_CSA, ATTN_HCA) and c.hash_layers == (True, False) and c.yarn.factor == 16


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", -4, "hidden_size"),
    ("num_experts_per_tok", 99, "num_experts_per_tok"),
    ("o_groups", 3, "o_groups"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("compress_ratios", [0, 4], "compress_ratios"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("scoring_func", "softmax", "scoring_func"),
    ("vocab_size", "big", "vocab_size"),
])
def test_invalid_config_names_the_field(field, value, needle):
    d = json.loads(open(PRESET_DIR / "tiny-v4.json").read())
    d[field] = value
    with pytest.raises(ConfigError, match=needle):
        config_from_dict(d)


def test_missing_field_and_unknown_preset():
    d = json.loads(open(PRESET_DIR / "tiny-v4.json").read())
    del d["q_lora_rank"]
    with pytest.raises(ConfigError, match="q_lora_rank"):
        config_from_dict(d)
    with pytest.raises(ConfigError, match="known presets"):
        load_config("deepseek-v9")


def test_pro_shapes_match_spec_table():
    p = abstract_params(load_config("deepseek-v4-pro"))
    a = p["layers"][2]["attn"]
    assert a["wq_a"].shape == (1536, 7168) and a["wq_b"].shape == (65536, 1536)
    assert a["wo_a"].shape == (16384, 4096) and a["wo_b"].shape == (7168, 16384) and a["attn_sink"].shape == (128,)
    assert p["layers"][2]["hc_attn"]["fn"].shape == (24, 28672)
    assert a["indexer"]["wq_b"].shape == (8192, 1536) and a["indexer"]["weights_proj"].shape == (64, 7168)
    assert p["layers"][0]["attn"]["compressor"]["ape"].shape == (128, 512)  # layer 0 is HCA in Pro
    assert p["layers"][3]["ffn"]["experts"]["w1"].shape == (384, 3072, 7168)
    assert p["layers"][3]["ffn"]["gate"]["bias"].shape == (384,) and p["hc_head"]["fn"].shape == (4, 28672)
