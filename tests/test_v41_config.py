"""V4.1 config parsing and validation, the V4.1-Flash preset, its parameter count, and image rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dinfer_jax.models import abstract_params, count_params, load_config
from dinfer_jax.models.config import ATTN_SHARED, ATTN_SLIDING, PRESET_DIR, ConfigError, config_from_dict
from dinfer_jax.models.params import engram_table_rows


def _preset_raw() -> dict:
    return json.loads((PRESET_DIR / "deepseek-v4.1-flash.json").read_text())


def test_flash_preset_layer_roles():
    c = load_config("deepseek-v4.1-flash")
    assert c.is_v41 and c.hc_shifted and not c.use_qnorm and c.kv_fake_quant
    assert c.attn_kinds[:2] == (ATTN_SLIDING, ATTN_SLIDING) and set(c.attn_kinds[2:]) == {ATTN_SHARED}
    assert c.n_prefill_layer == 20 and c.mtp_compress_ratios == (0, 0, 0)
    # docs/spec/model-v41.md §1.2 role table
    assert [c.kv_source(i) for i in (2, 7, 8, 13, 14, 19, 20, 39)] == [2, 2, 8, 8, 14, 14, 20, 20]
    assert [c.index_source(i) for i in (3, 20, 23, 24, 27, 36, 39)] == [2, 20, 20, 24, 24, 36, 36]
    assert [c.uses_candidates(i) for i in (20, 21, 24, 28, 36)] == [False, False, True, True, True]
    assert c.engram_layer_ids == (1, 14) and c.engram_pad_id == 2 and c.quantization.weight_block_size == (32, 32)
    assert not any(c.hash_layers)


def test_flash_param_count_matches_published():
    """Published V4.1-Flash: about 552B backbone parameters plus about 197B in the two Engram tables."""
    c = load_config("deepseek-v4.1-flash")
    backbone = count_params(abstract_params(c, include_mtp=False))
    engram = engram_table_rows(c)
    drafter = count_params(abstract_params(c)) - backbone
    print(f"V4.1-Flash: backbone {backbone / 1e9:.2f}B, Engram tables {engram / 1e9:.2f}B, DSpark {drafter / 1e9:.2f}B")
    assert abs(backbone - 552e9) / 552e9 <= 0.02
    assert abs(engram - 197e9) / 197e9 <= 0.02
    p = abstract_params(c)
    assert p["layers"][2]["attn"]["compressor"]["wgate"].shape == (512, 5120)
    assert "wgate" not in p["layers"][20]["attn"]["compressor"]  # ratio-1 source has no gate
    assert p["layers"][20]["attn"]["indexer"]["wk"].shape == (128, 512)
    assert "compressor" not in p["layers"][21]["attn"] and "indexer" not in p["layers"][21]["attn"]
    assert p["layers"][24]["attn"]["indexer"]["wq_b"].shape == (4096, 1280)
    assert "wk" not in p["layers"][24]["attn"]["indexer"]
    assert p["layers"][1]["engram"]["wkv"].shape == (25600, 6144)
    assert p["layers"][5]["ffn"]["gate"]["bias_vl"].shape == (384,)
    assert p["mtp"][0]["main_proj"].shape == (5120, 15360) and p["mtp"][0]["ffn"]["experts"]["w1"].shape[0] == 128
    assert p["mtp"][2]["confidence_proj"].shape == (1, 5376) and "hc_head" not in p


def test_fixture_config_roundtrip():
    c = load_config(PRESET_DIR / "tiny-v41.json")
    assert config_from_dict(c.to_dict()) == c


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.__setitem__("compress_ratios", [0, 0] + [2] * 18 + [4] * 20 + [0, 0, 0]), "compress_ratios"),
    (lambda t: t.__setitem__("kv_source_layer_ids", [8, 14, 20]), "kv_source_layer_ids"),
    (lambda t: t.__setitem__("kv_source_layer_ids", [2, 8, 14]), "layer 20"),
    (lambda t: t.__setitem__("index_source_layer_ids", [2, 8, 14, 22]), "index_source_layer_ids"),
    (lambda t: t.__setitem__("candidate_source_layer_id", 21), "candidate_source_layer_id"),
    (lambda t: t.__setitem__("engram_num_embeddings", [5]), "engram_num_embeddings"),
    (lambda t: t.__setitem__("engram_layer_ids", [1, 99]), "engram_layer_ids"),
    (lambda t: t.__setitem__("dspark_num_experts_per_tok", 0), "dspark_num_experts_per_tok"),
    (lambda t: t.__setitem__("num_key_value_heads", 4), "num_key_value_heads"),
])
def test_invalid_v41_config_names_the_field(edit, needle):
    raw = _preset_raw()
    edit(raw["text_config"])
    with pytest.raises(ConfigError, match=needle):
        config_from_dict(raw)


def test_image_rows_use_bias_vl_and_close_the_engram_gate():
    """Image rows (supplied embeddings + mask): MoE selection uses ``bias_vl`` and the Engram gate is zero.
    Made decisive by a huge ``bias_vl`` on one expert: image rows must route to it in every layer, text rows must
    not (their bias is untouched)."""
    import jax.numpy as jnp

    from dinfer_jax.models import inspect, random_model

    cfg = load_config("tiny-v41")
    model = random_model(cfg, seed=2, include_mtp=False)
    for lp in model.params["layers"]:
        lp["ffn"]["gate"]["bias_vl"] = jnp.zeros_like(lp["ffn"]["gate"]["bias_vl"]).at[5].set(1e4)
    S = 24
    ids = (np.arange(S) % 60 + 4)[None]
    mask = np.zeros((1, S), bool)
    mask[0, 8:14] = True
    ids_img = ids.copy()
    ids_img[mask] = cfg.vocab_size + 2  # image special ids lie above the text vocabulary
    emb = np.random.default_rng(0).standard_normal((1, S, cfg.hidden_size)).astype(np.float32)
    out = inspect(model, ids_img, image_embeds=emb, image_mask=mask)
    for layer, idx in out["router_indices"].items():
        assert (idx[0][mask[0]] == 5).any(-1).all(), f"layer {layer}: image rows ignore bias_vl"
        assert not (idx[0][~mask[0]] == 5).all(-1).all(), f"layer {layer}: text rows follow bias_vl"
    # Engram gate closed on image rows: at an Engram layer the image rows' streams pass through unchanged.
    from dinfer_jax.models.engram import engram_gate

    lp = model.params["layers"][cfg.engram_layer_ids[0]]
    streams = jnp.asarray(np.random.default_rng(1).standard_normal((1, S, cfg.hc_mult, cfg.hidden_size)), jnp.float32)
    e_in = lp["engram"]["wkv"].shape[1]
    rows = jnp.asarray(np.random.default_rng(3).standard_normal((1, S, e_in)), jnp.float32)
    gated = np.asarray(engram_gate(streams, rows, lp["engram"], norm_eps=cfg.norm_eps, image_mask=jnp.asarray(mask)))
    np.testing.assert_array_equal(gated[0][mask[0]], np.asarray(streams)[0][mask[0]])
    assert np.abs(gated[0][~mask[0]] - np.asarray(streams)[0][~mask[0]]).max() > 1e-3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        inspect(model, ids_img)  # image ids without the mask are rejected
