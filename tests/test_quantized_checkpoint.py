"""Released quantised format: FP8 e4m3 block-128 + MXFP4 experts + BF16/F32 rest, DeepSeek names and config keys,
sharded with an index. The reference is transformers run on the *dequantised* weights, so the tolerance is the fp32
parity bound (1e-4 × max |logit|): dequantisation at load must be exact, not approximately right."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from helpers import check_resident_bytes, rel_err, require_reference


def test_quantizers_roundtrip_exactly():
    from dinfer_jax.loading.quant import E2M1_GRID, dequant_fp4, dequant_fp8, quantize_fp4, quantize_fp8

    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 96)).astype(np.float32)
    code, scale = quantize_fp8(w, (128, 128))
    assert code.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == ml_dtypes.float8_e8m0fnu
    assert scale.shape == (2, 1)
    dq = dequant_fp8(code, scale, (128, 128))
    # Closed form: e4m3 has 3 mantissa bits, so relative rounding error ≤ 2^-4 of the value (normal range).
    big = np.abs(w) > 0.05
    assert np.all(np.abs(dq - w)[big] <= np.abs(w)[big] * 2.0 ** -4 + 1e-7)
    # Every dequantised value is code × power-of-two scale: re-quantising is the identity.
    code2, scale2 = quantize_fp8(dq, (128, 128))
    np.testing.assert_array_equal(dequant_fp8(code2, scale2, (128, 128)), dq)

    packed, s4 = quantize_fp4(w)
    assert packed.dtype == np.int8 and packed.shape == (200, 48) and s4.shape == (200, 3)
    dq4 = dequant_fp4(packed, s4)
    grid_vals = dq4 / np.repeat(s4.astype(np.float32), 32, axis=1)
    assert np.isin(grid_vals, E2M1_GRID).all()
    # Nibble order: low nibble is the even column. Hand-built byte 0x2F = codes (0xF, 0x2) = (-6.0, 1.0).
    one = dequant_fp4(np.full((1, 16), 0x2F, np.uint8).view(np.int8), np.full((1, 1), 1.0, ml_dtypes.float8_e8m0fnu))
    assert one[0, 0] == -6.0 and one[0, 1] == 1.0


def test_release_quantized_checkpoint_matches_reference_on_dequantized_weights(tmp_path):
    require_reference()
    from transformers import DeepseekV4ForCausalLM

    from dinfer_jax.loading.names import normalize_name
    from dinfer_jax.loading.safetensors_io import SafetensorsFile, save_file
    from dinfer_jax.loading.writer import write_release_checkpoint
    from dinfer_jax.models import forward_logits, load_model
    from dinfer_jax.reference import transformers_v4 as ref

    kw = ref.hf_config_kwargs(layer_kinds=["sliding", "csa", "hca", "csa"], hash_layers=2)
    hf = ref.build_random_hf_model(kw, seed=3)
    hf_dir, rel_dir, deq_dir = tmp_path / "hf", tmp_path / "release", tmp_path / "dequantized"
    ref.save_hf_model(hf, hf_dir)

    fp32_model = load_model(hf_dir)
    recovered = write_release_checkpoint(fp32_model.config, fp32_model.params, rel_dir, shard_bytes=200_000)
    index = json.loads((rel_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the test should exercise a sharded checkpoint"
    raw_cfg = json.loads((rel_dir / "config.json").read_text())
    assert "compress_ratios" in raw_cfg and "layer_types" not in raw_cfg  # DeepSeek's spelling
    stored = SafetensorsFile(rel_dir / index["weight_map"]["layers.1.attn.wq_a.weight"])
    assert stored.dtype_name("layers.1.attn.wq_a.weight") == "F8_E4M3"
    assert stored.dtype_name("layers.1.attn.wq_a.scale") == "F8_E8M0"
    ex = SafetensorsFile(rel_dir / index["weight_map"]["layers.2.ffn.experts.0.w1.weight"])
    assert ex.dtype_name("layers.2.ffn.experts.0.w1.weight") == "I8"

    # Reference weights: the HF file with each tensor replaced by its dequantised value.
    shutil.copytree(hf_dir, deq_dir)
    src = SafetensorsFile(hf_dir / "model.safetensors")
    replaced = {}
    for k in src.keys():
        v = recovered[normalize_name(k)]
        replaced[k] = v.astype(src.get(k).dtype)
    save_file(replaced, deq_dir / "model.safetensors", metadata={"format": "pt"})
    hf_deq = DeepseekV4ForCausalLM.from_pretrained(deq_dir, dtype="float32").eval()
    changed = max(float(np.abs(recovered[normalize_name(k)] - src.get(k)).max()) for k in src.keys()
                  if src.get(k).dtype == np.float32)
    assert changed > 1e-3, "quantisation should have changed the weights (else the test is vacuous)"

    ids = np.random.default_rng(4).integers(0, kw["vocab_size"], size=(2, 29))
    ref_logits = ref.hf_logits(hf_deq, ids)
    native = load_model(rel_dir)  # the release carries quantization_config: FP8/FP4 stay resident by default
    check_resident_bytes(native, rel_dir)
    ours = forward_logits(native, ids)
    max_rel, mean_rel = rel_err(ours, ref_logits)
    print(f"quantized release checkpoint: max rel err {max_rel:.2e}, mean {mean_rel:.2e}")
    assert max_rel <= 1e-4
    # And it really differs from the unquantised model (quantisation error is visible in the logits).
    assert rel_err(forward_logits(fp32_model, ids), ref_logits)[0] > 1e-3


@pytest.mark.parametrize("scale_kind", ["e8m0", "fp32_weight_scale_inv"])
def test_fp8_scale_spellings(tmp_path, scale_kind):
    """Both scale spellings load: ``X.scale`` as E8M0 and ``X.weight_scale_inv`` as fp32."""
    from dinfer_jax.loading.loader import load_params
    from dinfer_jax.loading.quant import quantize_fp8
    from dinfer_jax.loading.safetensors_io import SafetensorsFile, save_file
    from dinfer_jax.loading.writer import write_release_checkpoint
    from dinfer_jax.models import load_config, random_model

    cfg = load_config("tiny-v4")
    model = random_model(cfg, seed=1, include_mtp=False)
    write_release_checkpoint(cfg, model.params, tmp_path, expert_dtype="fp8")
    f = SafetensorsFile(tmp_path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    if scale_kind == "fp32_weight_scale_inv":
        for k in [k for k in tensors if k.endswith(".scale")]:
            tensors[k[: -len(".scale")] + ".weight_scale_inv"] = tensors.pop(k).astype(np.float32)
    f.close()
    save_file(tensors, tmp_path / "model.safetensors")
    params = load_params(tmp_path, cfg)
    w = np.asarray(model.params["layers"][0]["attn"]["wq_b"])
    code, scale = quantize_fp8(w, (128, 128))
    block_scale = np.repeat(np.repeat(scale.astype(np.float32), 128, 0), 128, 1)
    expect = code.astype(np.float32) * block_scale[: w.shape[0], : w.shape[1]]
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["attn"]["wq_b"]), expect)
