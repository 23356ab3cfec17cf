"""Quantised weights resident on the device (``QuantizedWeight``): exact decode, native loading, device bytes.

References are independent of the code under test: FP8/FP4/E8M0 values are decoded here from the bit-field
definitions of the formats (OCP MX / FP8 specs, ``docs/spec/model-v4.md`` §6.1), checkpoint bytes are summed from the
safetensors JSON headers, and V4-Flash's released size is a closed form over the config's dimensions.
"""

from __future__ import annotations

import gc
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dinfer_jax.models.qweights import QuantizedWeight, abstract_quantized, dequantize, tree_nbytes
from helpers import check_resident_bytes, e2m1_value
from provision import fixture_dir

# ---- closed-form decoders, written from the format definitions -------------------------------------------------

def e4m3_value(byte: int) -> float:
    """OCP FP8 E4M3 (fn): sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0 is subnormal
    (m/8 · 2^-6); S.1111.111 is NaN; no infinities."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7)
    return -mag if s else mag


def e8m0_value(byte: int) -> float:
    """UE8M0: 2^(byte - 127); 0xFF is NaN."""
    return math.nan if byte == 0xFF else math.ldexp(1.0, byte - 127)


def test_decode_tables_spot_values():
    # Independent anchors of the hand decoders: zero, min subnormal, max normal, grid ends.
    assert e4m3_value(0x00) == 0.0 and e4m3_value(0x01) == 2.0 ** -9 and e4m3_value(0x7E) == 448.0
    assert e4m3_value(0x80) == 0.0 and e4m3_value(0xFE) == -448.0 and e4m3_value(0x08) == 2.0 ** -6
    assert [e2m1_value(n) for n in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert e2m1_value(0xF) == -6.0 and e8m0_value(127) == 1.0 and e8m0_value(0) == 2.0 ** -127


def _np_fp8_reference(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float64 ``[..., out, in]``: element [i, j] = e4m3(code) · e8m0(scale[i // bo, j // bi])."""
    table = np.array([e4m3_value(b) for b in range(256)])
    stable = np.array([e8m0_value(b) for b in range(256)])
    out, inn = codes.shape[-2:]
    rows, cols = np.arange(out) // block[0], np.arange(inn) // block[1]
    return table[codes] * stable[scales][..., rows[:, None], cols[None, :]]


def _np_fp4_reference(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    table = np.array([e2m1_value(n) for n in range(16)])
    stable = np.array([e8m0_value(b) for b in range(256)])
    vals = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]))
    vals[..., 0::2] = table[packed & 0xF]   # low nibble = even column
    vals[..., 1::2] = table[packed >> 4]
    cols = np.arange(vals.shape[-1]) // 32
    return vals * stable[scales][..., cols]


def _fp8_weight(codes_u8: np.ndarray, scales_u8: np.ndarray, block) -> QuantizedWeight:
    return QuantizedWeight(jnp.asarray(codes_u8.view(ml_dtypes.float8_e4m3fn)),
                           jnp.asarray(scales_u8.view(ml_dtypes.float8_e8m0fnu)), "fp8", block)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_dequantize_every_code_exactly(dtype):
    """All 254 finite e4m3 codes (incl. ±0, min subnormal 0x01, max 0x7E) under scales 2^-20 … 2^20, stacked over a
    leading expert axis, with edge blocks (out, in not multiples of the block)."""
    rng = np.random.default_rng(0)
    finite = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], np.uint8)
    E, out, inn, block = 3, 37, 300, (16, 128)
    codes = rng.choice(finite, size=(E, out, inn)).astype(np.uint8)
    codes[0, 0, :254] = finite  # every code at least once
    scales = rng.integers(127 - 20, 127 + 21, size=(E, -(-out // 16), -(-inn // 128))).astype(np.uint8)
    w = _fp8_weight(codes, scales, block)
    assert w.shape == (E, out, inn) and w.nbytes == codes.nbytes + scales.nbytes
    ours = np.asarray(jax.jit(lambda w: dequantize(w, dtype))(w)).astype(np.float64)
    ref = _np_fp8_reference(codes, scales, block)
    if dtype == "bfloat16":  # every product needs ≤ 4 significant bits and lies inside bf16's range: exact
        assert np.all(ref.astype(ml_dtypes.bfloat16).astype(np.float64) == ref)
    np.testing.assert_array_equal(ours, ref)
    assert np.signbit(ours[0, 0, 127]) == np.signbit(ref[0, 0, 127])  # -0 stays -0 (code 0x80 at column 127)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp4_dequantize_every_code_and_nibble_order(dtype):
    rng = np.random.default_rng(1)
    E, out, inn = 2, 5, 128
    packed = rng.integers(0, 256, size=(E, out, inn // 2)).astype(np.uint8)
    packed[0, 0, :16] = np.arange(16) | (np.arange(16)[::-1] << 4)  # every code in both nibble positions
    scales = rng.integers(127 - 30, 127 + 31, size=(E, out, inn // 32)).astype(np.uint8)
    w = QuantizedWeight(jnp.asarray(packed), jnp.asarray(scales.view(ml_dtypes.float8_e8m0fnu)), "fp4", (1, 32))
    assert w.shape == (E, out, inn)
    ours = np.asarray(jax.jit(lambda w: dequantize(w, dtype))(w)).astype(np.float64)
    np.testing.assert_array_equal(ours, _np_fp4_reference(packed, scales))
    # Hand-checked byte: 0x2F with scale 2^0 is (-6.0, 1.0): low nibble 0xF is column 0.
    one = QuantizedWeight(jnp.full((1, 16), 0x2F, jnp.uint8), jnp.ones((1, 1), jnp.float8_e8m0fnu), "fp4", (1, 32))
    assert np.asarray(dequantize(one))[0, :2].tolist() == [-6.0, 1.0]


def test_fp32_scales_match_host_dequantiser():
    """``weight_scale_inv`` checkpoints: fp32 scales; one fp32 product per element, like the host loader."""
    from dinfer_jax.loading.quant import dequant_fp8

    rng = np.random.default_rng(2)
    codes = rng.integers(0, 0x7E, size=(130, 70)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    scales = rng.random((2, 1)).astype(np.float32)
    w = QuantizedWeight(jnp.asarray(codes), jnp.asarray(scales), "fp8", (128, 128))
    np.testing.assert_array_equal(np.asarray(dequantize(w)), dequant_fp8(codes, scales, (128, 128)))


def test_bad_shapes_and_dtypes_are_named():
    e8 = jnp.float8_e8m0fnu
    with pytest.raises(ValueError, match=r"fp8 scale shape \(2, 2\) does not match data shape \(200, 96\).*\(2, 1\)"):
        QuantizedWeight(jnp.zeros((200, 96), jnp.float8_e4m3fn), jnp.ones((2, 2), e8), "fp8", (128, 128))
    with pytest.raises(ValueError, match="fp4 data must be uint8"):
        QuantizedWeight(jnp.zeros((4, 16), jnp.int8), jnp.ones((4, 1), e8), "fp4", (1, 32))
    with pytest.raises(ValueError, match="fp4 scales must be float8_e8m0fnu"):
        QuantizedWeight(jnp.zeros((4, 16), jnp.uint8), jnp.ones((4, 1), jnp.float32), "fp4", (1, 32))
    with pytest.raises(ValueError, match="unknown quantised format"):
        QuantizedWeight(jnp.zeros((4, 16), jnp.uint8), jnp.ones((4, 1), e8), "int4", (1, 32))


def test_pytree_stacking_and_jit():
    """Layers stack with ``jax.tree.map(jnp.stack, ...)`` (fmt/block are static) and stay exact under jit."""
    rng = np.random.default_rng(3)
    ws = [_fp8_weight(rng.integers(0, 0x7E, (4, 40, 64)).astype(np.uint8),
                      rng.integers(120, 130, (4, 1, 1)).astype(np.uint8), (64, 64)) for _ in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *ws)
    assert isinstance(stacked, QuantizedWeight) and stacked.shape == (3, 4, 40, 64) and stacked.block == (64, 64)
    assert len(jax.tree_util.tree_leaves(stacked)) == 2
    dense = np.asarray(jax.jit(dequantize)(stacked))
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(dense[i], np.asarray(dequantize(w)))
    np.testing.assert_array_equal(np.asarray(dequantize(stacked[1][2])), dense[1, 2])
    out = jax.lax.scan(lambda c, w: (c + dequantize(w).sum(), None), jnp.float32(0), stacked)[0]
    assert np.isclose(float(out), dense.sum(), rtol=1e-5)


def test_consumers_decode_exactly():
    """``linear`` and the grouped expert FFN give the same numbers for a quantised weight and its dense decode."""
    from dinfer_jax.models.moe import grouped_expert_ffn
    from dinfer_jax.models.ops import linear

    rng = np.random.default_rng(4)
    w = _fp8_weight(rng.integers(0, 0x7E, (48, 64)).astype(np.uint8), np.full((1, 1), 120, np.uint8), (128, 128))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x, w)), np.asarray(linear(x, dequantize(w))))

    E, D, I = 4, 64, 32
    def fp4(shape):
        return QuantizedWeight(jnp.asarray(rng.integers(0, 256, (*shape[:-1], shape[-1] // 2)).astype(np.uint8)),
                               jnp.asarray(rng.integers(118, 124, (*shape[:-1], shape[-1] // 32)).astype(np.uint8)
                                           .view(ml_dtypes.float8_e8m0fnu)), "fp4", (1, 32))
    w1, w3, w2 = fp4((E, I, D)), fp4((E, I, D)), fp4((E, D, I))
    xs = jnp.asarray(rng.standard_normal((10, D)), jnp.bfloat16)
    sizes = jnp.array([3, 0, 5, 2], jnp.int32)
    rw = jnp.asarray(rng.random(10), jnp.float32)
    q = jax.jit(grouped_expert_ffn, static_argnames="swiglu_limit")(xs, sizes, w1, w3, w2, rw, swiglu_limit=7.0)
    d = grouped_expert_ffn(xs, sizes, *(dequantize(w, jnp.bfloat16) for w in (w1, w3, w2)), rw, swiglu_limit=7.0)
    assert np.abs(np.asarray(q)).max() > 0
    np.testing.assert_array_equal(np.asarray(q), np.asarray(d))


# ---- checkpoints ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory):
    from dinfer_jax.loading.writer import write_release_checkpoint
    from dinfer_jax.models import load_config, random_model

    cfg = load_config("tiny-v4")
    d = tmp_path_factory.mktemp("tiny_release_native")
    write_release_checkpoint(cfg, random_model(cfg, seed=7).params, d, shard_bytes=300_000)
    return d


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_native_load_keeps_release_bytes_and_matches_dequantized(tiny_release, dtype):
    from dinfer_jax.models import forward_logits, load_model, mtp_logits

    native = load_model(tiny_release, dtype=dtype)  # quantization_config present: native by default
    check_resident_bytes(native, tiny_release)
    dense = load_model(tiny_release, dtype=dtype, weights="dequantized")
    assert not any(isinstance(x, QuantizedWeight) for x in
                   jax.tree_util.tree_leaves(dense.params, is_leaf=lambda x: isinstance(x, QuantizedWeight)))
    assert native.num_params == dense.num_params and native.param_bytes < dense.param_bytes
    ids = np.random.default_rng(5).integers(0, native.config.vocab_size, size=(2, 25))
    # Same weights bit for bit (decode is exact): only XLA's fusion of the decode may reorder nothing numeric.
    np.testing.assert_array_equal(forward_logits(native, ids), forward_logits(dense, ids))
    np.testing.assert_array_equal(mtp_logits(native, ids), mtp_logits(dense, ids))


@pytest.fixture(scope="module")
def repeating_release(tmp_path_factory):
    """A tiny V4 release checkpoint whose last four layers are an HCA/CSA pair repeated twice (a scan group of
    period 2 × 2 repeats, as V4-Flash's 20 pairs), beside groups of one."""
    from dinfer_jax.loading.writer import write_release_checkpoint
    from dinfer_jax.models import load_config, random_model

    cfg = load_config("tiny-v4")
    cfg = cfg.replace(attn_kinds=cfg.attn_kinds[:5] + ("csa",), compress_ratios=cfg.compress_ratios[:5] + (4,))
    d = tmp_path_factory.mktemp("tiny_release_repeating")
    write_release_checkpoint(cfg, random_model(cfg, seed=9).params, d, shard_bytes=300_000)
    return d


@pytest.mark.parametrize("weights", ["native", "dense"])
def test_stacked_load_equals_stacking_the_loaded_layers(repeating_release, weights):
    """``load_params(..., stacked=True)`` fills each scan-group leaf layer by layer as it reads them: bit-equal to
    loading in checkpoint layout and stacking afterwards, and no checkpoint-layout layer left alive on the device
    (each is freed once written into its row)."""
    from dinfer_jax.loading import load_params
    from dinfer_jax.models import load_config
    from dinfer_jax.models.layer_plan import StackedLayers, plan_layers, stack_params

    cfg = load_config(repeating_release)
    assert any(g.repeats > 1 for g in plan_layers(cfg))       # the case that stacks
    want = stack_params(cfg, load_params(repeating_release, cfg, dtype="bfloat16", weights=weights))
    gc.collect()
    before = jax.live_arrays()       # strong references: no id of these can be reused below
    known = {id(a) for a in before}
    got = load_params(repeating_release, cfg, dtype="bfloat16", weights=weights, stacked=True)
    gc.collect()
    # measured before comparing: numpy conversions of float8 arrays below make jax arrays of their own
    left = sum(a.nbytes for a in jax.live_arrays() if id(a) not in known and not a.is_deleted())
    assert left == tree_nbytes(got)                           # nothing but the result stayed on the device
    assert isinstance(got["layers"], StackedLayers)
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_native_load_rejects_mismatched_storage(tiny_release, tmp_path):
    """A tensor the config declares FP8 but stored densely, and a scale that does not fit its block, fail clearly."""
    from dinfer_jax.loading import CheckpointError, load_params
    from dinfer_jax.loading.safetensors_io import SafetensorsFile, save_file
    from dinfer_jax.models import load_config

    cfg = load_config(tiny_release)
    for label, edit, message in [
        ("dense", lambda t: (t.__setitem__("layers.0.attn.wq_a.weight", np.zeros((32, 64), np.float32)),
                             t.pop("layers.0.attn.wq_a.scale")), "stored as F32 but .* declares it fp8"),
        ("scale", lambda t: t.__setitem__("layers.0.ffn.experts.1.w2.scale",
                                          np.ones((64, 2), ml_dtypes.float8_e8m0fnu)),
         r"fp4 scale shape \[64, 2\] .*\(expected \[64, 1\]\)"),
    ]:
        d = tmp_path / label
        d.mkdir()
        (d / "config.json").write_text((tiny_release / "config.json").read_text())
        tensors = {}
        for f in sorted(tiny_release.glob("*.safetensors")):
            sf = SafetensorsFile(f)
            tensors.update({k: np.array(sf.get(k)) for k in sf.keys()})
        edit(tensors)
        save_file(tensors, d / "model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            load_params(d, cfg, weights="native")


def test_v41_release_fixture_is_resident_native():
    """The independently written V4.1 release fixture (32×32 FP8 blocks, MXFP4 experts, FP8 Engram ``wkv``)."""
    from dinfer_jax.models import load_model

    d = fixture_dir("v41-tiny-quant")
    model = load_model(d, dtype="bfloat16")
    check_resident_bytes(model, d, host_only=r"\.engram\.embed\.")  # Engram tables stay memory-mapped on host
    assert model.params["layers"][1]["engram"]["wkv"].block == (32, 32)


def test_orbax_roundtrip_native(tiny_release, tmp_path):
    from dinfer_jax.loading.orbax_io import restore_params, save_params
    from dinfer_jax.models import load_model

    model = load_model(tiny_release)
    save_params(tmp_path / "o", model.config, model.params, model.dtype)
    _, params, _ = restore_params(tmp_path / "o")
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(model.params)
    for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(params), strict=False):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a),
                                      np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 else np.asarray(b))


# ---- random native weights, sharding, abstract bytes -------------------------------------------------------------

def _quant_cfg(expert_dtype="fp4"):
    from dinfer_jax.models import load_config
    from dinfer_jax.models.config import QuantConfig

    return load_config("tiny-v4").replace(quantization=QuantConfig((128, 128), "ue8m0", expert_dtype))


def test_random_native_weights_statistics():
    from dinfer_jax.models import forward_logits, random_model

    cfg = _quant_cfg()
    m = random_model(cfg, seed=3, weights="native", std=0.02)
    qs = [x for x in jax.tree_util.tree_leaves(m.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
          if isinstance(x, QuantizedWeight)]
    fmts = {q.fmt for q in qs}
    assert fmts == {"fp8", "fp4"}
    for q in qs:
        d = np.asarray(dequantize(q), np.float64)
        assert 0.6 * 0.02 < d.std() < 1.5 * 0.02, (q.fmt, q.shape, d.std())
        assert np.isfinite(d).all() and (d != 0).mean() > 0.8
    # FP4 codes use the whole grid: every nibble value occurs.
    fp4 = next(q for q in qs if q.fmt == "fp4")
    nibbles = np.concatenate([np.asarray(fp4.data) & 0xF, np.asarray(fp4.data) >> 4]).ravel()
    assert set(np.unique(nibbles)) == set(range(16))
    ids = np.arange(24)[None] % cfg.vocab_size
    logits = forward_logits(m, ids)
    assert np.isfinite(logits).all() and logits.std() > 0


def test_sharded_native_weights_match_single_device():
    from dinfer_jax.models import forward_logits, random_model
    from sharding import DEFAULT_RULES, Sharder, ShardingRules, make_mesh

    cfg = _quant_cfg()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 20))
    ref = forward_logits(random_model(cfg, seed=2, include_mtp=False, weights="native"), ids)
    # Experts over EP (4 CP ranks of an engine), embed over DP (2 engines): disjoint mesh axes. Every other logical
    # axis keeps its declared default rule.
    rules = ShardingRules.from_dict({**DEFAULT_RULES, "embed": "dp"})
    sharder = Sharder(make_mesh(dp=2, cp=4, ep=4), rules)
    m = random_model(cfg, seed=2, include_mtp=False, weights="native", sharder=sharder)
    def axis(x, i):
        spec = tuple(x.sharding.spec)
        return spec[i] if i < len(spec) else None

    w1 = m.params["layers"][2]["ffn"]["experts"]["w1"]
    assert axis(w1.data, 0) == "cp_ep" and axis(w1.scale, 0) == "cp_ep"
    wq_a = m.params["layers"][2]["attn"]["wq_a"]  # [32, 64]: codes split along embed; the 1×1 scale grid cannot be
    assert axis(wq_a.data, 1) == "dp_out" and axis(wq_a.scale, 1) is None
    assert np.abs(forward_logits(m, ids) - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_random_weights_built_stacked_equal_stacking_afterwards(preset):
    """``random_model(..., stacked=True)`` draws the backbone directly in scan layout: every leaf equals stacking
    the checkpoint-layout model's layers (``layer_plan.stack_params``) bit for bit, so an engine can be built from
    it without a second copy of the layer weights; the forward is the same."""
    from dinfer_jax.models import forward_logits, load_config, random_model
    from dinfer_jax.models.config import QuantConfig
    from dinfer_jax.models.layer_plan import StackedLayers, stack_params

    cfg = load_config(preset).replace(quantization=QuantConfig((128, 128), "ue8m0", "fp4"))
    flat = random_model(cfg, seed=7, include_mtp=False, weights="native")
    built = random_model(cfg, seed=7, include_mtp=False, weights="native", stacked=True)
    assert isinstance(built.params["layers"], StackedLayers)
    want = stack_params(cfg, flat.params)
    got_leaves, got_tree = jax.tree_util.tree_flatten(built.params)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    assert built.param_bytes == flat.param_bytes
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 17))
    np.testing.assert_array_equal(np.asarray(forward_logits(built, ids)), np.asarray(forward_logits(flat, ids)))


def test_llm_keeps_one_copy_of_stacked_weights():
    """An engine built from a stacked Model uses its arrays as they are (no scan-layout copy): the runner's layer
    weights are the Model's own buffers."""
    from dinfer_jax import LLM
    from dinfer_jax.models import random_model

    m = random_model(_quant_cfg(), seed=1, include_mtp=False, weights="native", stacked=True)
    llm = LLM(m, max_num_seqs=2, max_model_len=64, warmup=False, progress=False)
    ours = jax.tree_util.tree_leaves(m.params["layers"])
    runner = jax.tree_util.tree_leaves(llm.runner.params["layers"])
    assert len(ours) == len(runner) and all(a is b for a, b in zip(ours, runner, strict=True))


def _released_flash_bytes(c) -> int:
    """Closed-form bytes of DeepSeek-V4-Flash as released (docs/spec/model-v4.md §1.1 shapes, §6.1 storage): FP8 = 1
    B per
    weight + 1 B per 128×128 block; MXFP4 experts = 0.5 B per weight + 1 B per 32; F32 = 4 B; BF16 = 2 B;
    tid2eid taken as I32."""
    D, H, d, ql, G, R = c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank
    E, I, n, V = c.n_routed_experts, c.moe_inter_dim, c.hc_mult, c.vocab_size

    def fp8(o, i):
        return o * i + math.ceil(o / 128) * math.ceil(i / 128)

    def fp4(o, i):
        return o * i // 2 + o * i // 32

    hc = 4 * (2 * ((2 + n) * n * n * D + (2 + n) * n + 3))
    attn = fp8(ql, D) + fp8(H * d, ql) + fp8(d, D) + fp8(G * R, H * d // G) + fp8(D, G * R) + 2 * (ql + d) + 4 * H

    def compressor(dim, ratio, coff):
        return 2 * 2 * coff * dim * D + 4 * ratio * coff * dim + 2 * dim

    def ffn(hash_layer):
        gate = 2 * E * D + (4 * V * c.n_activated_experts if hash_layer else 4 * E)
        return gate + E * (3 * fp4(I, D)) + 3 * fp8(I, D)

    total = 2 * 2 * V * D + 2 * D + 4 * (n * n * D + n + 1)
    for layer in range(c.num_layers):
        ratio = c.compress_ratios[layer]
        blk = 2 * 2 * D + hc + attn + ffn(c.hash_layers[layer])
        if ratio == 4:
            blk += compressor(d, 4, 2) + fp8(c.index_n_heads * c.index_head_dim, ql) + 2 * c.index_n_heads * D
            blk += compressor(c.index_head_dim, 4, 2)
        elif ratio:
            blk += compressor(d, ratio, 1)
        total += blk
    mtp = 2 * 2 * D + hc + attn + ffn(False) + 2 * fp8(D, D) + 3 * 2 * D + 4 * (n * n * D + n + 1)
    return total + c.n_mtp_layers * mtp


def test_v4_flash_native_bytes_match_release_format():
    from dinfer_jax.models import abstract_params, load_config

    c = load_config("deepseek-v4-flash")
    native = tree_nbytes(abstract_params(c, jnp.bfloat16, weights="native"))
    released = _released_flash_bytes(c)
    print(f"V4-Flash native device bytes {native / 1e9:.2f} GB vs released format {released / 1e9:.2f} GB")
    assert abs(native - released) <= 0.05 * released
    assert 150e9 < released < 170e9  # the issue's ~160 GB
    dense = tree_nbytes(abstract_params(c, jnp.bfloat16, weights="dense"))
    assert dense > 3 * native


def test_abstract_quantized_shapes():
    q = abstract_quantized((256, 2048, 4096), "fp4", (1, 32))
    assert q.data.shape == (256, 2048, 2048) and q.scale.shape == (256, 2048, 128) and q.shape == (256, 2048, 4096)
    q8 = abstract_quantized((300, 200), "fp8", (128, 128))
    assert q8.scale.shape == (3, 2) and q8.nbytes == 300 * 200 + 6
