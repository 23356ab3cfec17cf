"""Checkpoint loading: name normalisation, clear errors for bad checkpoints, orbax round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dinfer_jax.loading import CheckpointError, load_params
from dinfer_jax.loading.names import normalize_name
from dinfer_jax.loading.safetensors_io import SafetensorsFile, save_file
from dinfer_jax.loading.writer import write_release_checkpoint
from dinfer_jax.models import forward_logits, load_config, load_model, random_model


@pytest.mark.parametrize("raw,norm", [
    ("model.embed_tokens.weight", "embed.weight"),
    ("head.weight", "head.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.layers.1.attn.norm.weight", "layers.1.attn.kv_norm.weight"),
    ("model.layers.1.attn.compressor.norm.weight", "layers.1.attn.compressor.norm.weight"),
    ("model.layers.1.attn.indexer.compressor.norm.weight", "layers.1.attn.indexer.compressor.norm.weight"),
    ("layers.1.attn.kv_norm.weight", "layers.1.attn.kv_norm.weight"),
    ("layers.3.ffn.experts.7.w2.weight", "layers.3.ffn.experts.7.w2.weight"),
    ("layers.3.attn.wq_a.weight_scale_inv", "layers.3.attn.wq_a.scale"),
    ("mtp.0.hc_head_fn", "mtp.0.hc_head_fn"),
])
def test_normalize_name(raw, norm):
    assert normalize_name(raw) == norm


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    cfg = load_config("tiny-v4")
    model = random_model(cfg, seed=5)
    d = tmp_path_factory.mktemp("tiny_release")
    write_release_checkpoint(cfg, model.params, d)
    return cfg, d


def _rewrite(src_dir, dst_dir, edit):
    dst_dir.mkdir()
    (dst_dir / "config.json").write_text((src_dir / "config.json").read_text())
    f = SafetensorsFile(src_dir / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    edit(tensors)
    save_file(tensors, dst_dir / "model.safetensors")


def test_release_checkpoint_with_mtp_loads_and_runs(tiny_checkpoint):
    cfg, d = tiny_checkpoint
    model = load_model(d)
    assert len(model.params["mtp"]) == 1
    from dinfer_jax.models import mtp_logits

    ids = np.arange(20)[None] % cfg.vocab_size
    assert np.isfinite(forward_logits(model, ids)).all()
    assert mtp_logits(model, ids).shape == (1, 19, cfg.vocab_size)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("layers.0.attn.wkv.weight"), "missing tensor 'layers.0.attn.wkv.weight'"),
    (lambda t: t.__setitem__("layers.0.attn.bogus.weight", np.zeros(3, np.float32)), "unexpected tensors"),
    (lambda t: t.__setitem__("norm.weight", np.zeros(7, np.float32)), "'norm.weight' has shape \\[7\\]"),
    (lambda t: t.__setitem__("layers.0.ffn.gate.tid2eid", t["layers.0.ffn.gate.tid2eid"].astype(np.float32)),
     "expected an integer"),
    (lambda t: t.__setitem__("layers.0.ffn.gate.tid2eid", t["layers.0.ffn.gate.tid2eid"] + 100), "expert ids outside"),
    (lambda t: t.__setitem__("embed.weight", np.zeros((512, 64), np.int64)), "expected a float"),
    (lambda t: t.pop("layers.0.attn.wq_a.scale"), "no scale tensor"),
    (lambda t: t.__setitem__("layers.0.attn.wq_a.scale", np.ones((5, 5), np.float32)), "scale shape"),
])
def test_bad_checkpoints_fail_clearly(tiny_checkpoint, tmp_path, edit, message):
    cfg, d = tiny_checkpoint
    _rewrite(d, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_params(tmp_path / "bad", cfg)


def test_corrupt_files_fail_clearly(tiny_checkpoint, tmp_path):
    cfg, d = tiny_checkpoint
    data = (d / "model.safetensors").read_bytes()
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_params(tmp_path / "truncated", cfg)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data)
    with pytest.raises(CheckpointError, match="not JSON"):
        load_params(tmp_path / "garbage", cfg)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        load_params(tmp_path / "tiny", cfg)
    (tmp_path / "index").mkdir()
    index = tmp_path / "index" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing"):
        load_params(tmp_path / "index", cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_params(tmp_path / "empty", cfg)


def test_orbax_roundtrip(tiny_checkpoint, tmp_path):
    from dinfer_jax.loading.orbax_io import restore_params, save_params

    cfg, d = tiny_checkpoint
    model = load_model(d)
    save_params(tmp_path / "orbax", model.config, model.params, model.dtype)
    cfg2, params2, dtype2 = restore_params(tmp_path / "orbax")
    assert cfg2 == model.config and dtype2 == "float32"
    import jax

    for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_token_ids_are_rejected(tiny_checkpoint):
    cfg, d = tiny_checkpoint
    model = load_model(d)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        forward_logits(model, np.array([[1, 2, cfg.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        forward_logits(model, np.array([[-1, 2]]))
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        forward_logits(model, np.array([1, 2, 3]))
