"""KV-cache byte formats (``dinfer_jax.engine.kv_formats``) and ``kv_cache.bytes_per_token``.

References: DeepInfer's ``ref_cast_from_bf16`` (v41, v41_fp4, fp4_index), loaded from source by ``deepinfer_refs``;
an independent NumPy transcription of FlashMLA's ``quantize_k_cache`` for MODEL1 (FlashMLA's test helper is not in
the fetched sources); the model's fake quantisers (decode∘encode must equal them); hand-computed byte counts.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_refs import load_refs, require_refs, tile_kernels_clamp_overrides
from dinfer_jax.engine import kv_formats as kf
from dinfer_jax.engine.kv_cache import bytes_per_token
from dinfer_jax.models import fake_quant as fq
from dinfer_jax.models.config import load_config
from provision import require_module

torch = require_module("torch")

OPS = "deepinfer/model_executor/layers/tilelang_ops/"
BF16 = ml_dtypes.bfloat16
ENCODE = jax.jit(kf.encode, static_argnames=("fmt", "rope_dim", "reciprocal"))
DECODE = jax.jit(kf.decode, static_argnames=("fmt", "rope_dim", "dtype"))


@pytest.fixture(scope="module")
def refs() -> SimpleNamespace:
    """DeepInfer's ``ref_cast_from_bf16`` and its three cache formats.

    Two CPU stand-ins, both DeepInfer's / tile-kernels' own values: the amax clamp table comes from DeepInfer's
    constants (tile-kernels computes it from TileLang dtype limits), and ``tile_kernels.quant.per_token_cast`` (a
    GPU kernel, used by ``ref_cast_from_bf16`` for V41_FORMAT and FP4_INDEX_KV_FORMAT) is replaced by tile-kernels'
    PyTorch reference ``cast(x, fmt, (1, n), round_sf=…, use_packed_ue8m0=…, use_tma_aligned_col_major_sf=…)``
    with the same arguments, the twin that kernel is specified by.
    """
    require_refs()
    overrides = tile_kernels_clamp_overrides(OPS)
    (cast,) = load_refs("tile_kernels/torch/cast.py", "cast", overrides=overrides)

    def per_token_cast(x, fmt, num_per_channels, *, round_sf=False, use_tma_aligned_col_major_sf=False,
                       use_packed_ue8m0=False):
        return cast(x, fmt, block_size=(1, num_per_channels), round_sf=round_sf,
                    use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)

    overrides[OPS.replace("/", ".")[:-1] + ".cache_common.quant"] = SimpleNamespace(per_token_cast=per_token_cast)
    ns = SimpleNamespace()
    ns.cast_from_bf16, v41, v41_fp4, fp4_index = load_refs(
        OPS + "cache_common.py", "ref_cast_from_bf16", "V41_FORMAT", "V41_FP4_FORMAT", "FP4_INDEX_KV_FORMAT",
        overrides=overrides)
    ns.formats = {"v41": v41, "v41_fp4": v41_fp4, "fp4_index": fp4_index}
    return ns


def _ref_bytes(refs: SimpleNamespace, x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """DeepInfer's (quantized_data, sf_data) of bf16 rows ``x`` as byte rows, as ``store_kv_cache_ref`` views them."""
    form = dataclasses.replace(refs.formats[fmt], quantized_elements=x.shape[-1])
    enc = refs.cast_from_bf16(torch.from_numpy(x.astype(np.float32)).bfloat16(), form)
    n = x.shape[0]
    data = enc.quantized_data.contiguous().view(torch.uint8).reshape(n, -1).numpy()
    sf = enc.sf_data.clone(memory_format=torch.contiguous_format).view(torch.uint8).reshape(n, -1).numpy()
    return data, sf


# --- inputs -----------------------------------------------------------------------------------------------------

E4M3_GRID = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E2M1_GRID = np.array(kf.E2M1_VALUES, np.float64)


def _tie_rows(grid: np.ndarray, qmax: float, block: int, scales: list[float], width: int) -> np.ndarray:
    """Rows whose blocks have amax ``qmax·scale`` and otherwise hold ±(grid midpoints)·scale: rounding ties."""
    mids = (grid[:-1] + grid[1:]) / 2
    mids = np.concatenate([mids, -mids, grid[1:3]])
    rows = []
    for i, sc in enumerate(scales):
        vals = np.resize(np.roll(mids, 7 * i), width).reshape(-1, block)
        vals[:, 0] = qmax
        rows.append(vals.reshape(width) * sc)
    return np.stack(rows)


def _inputs(seed: int, width: int, ties: np.ndarray | None = None) -> np.ndarray:
    """bf16-valued rows: random normals at 1e−6 … 1e6, blocks of wildly different magnitude, zeros, −0, tiny
    (1e−30), subnormal (1e−40 and subnormal-scale blocks), huge (±3e38) blocks, and rounding ties."""
    rng = np.random.default_rng(seed)
    rand = rng.standard_normal((16, width)) * 10.0 ** rng.uniform(-6, 6, (16, 1))
    mixed = rng.standard_normal((2, width)) * 10.0 ** rng.integers(-30, 30, (2, width // 16)).repeat(16, axis=1)
    special = np.stack([np.zeros(width), -np.zeros(width), np.full(width, 1e-30), rng.standard_normal(width) * 1e-40,
                        rng.standard_normal(width) * 2.0**-125, np.resize([3e38, -1e38, 1.0, -0.0], width),
                        rng.standard_normal(width) * 3e37])
    rows = [rand, mixed, special] + ([] if ties is None else [ties])
    return np.concatenate(rows).astype(np.float32).astype(BF16)


def _np(x) -> np.ndarray:
    return np.asarray(x)


# --- layouts ------------------------------------------------------------------------------------------------------


def test_release_row_bytes():
    """docs/spec/engine.md §12.1: 528, 288, 68 and 584 bytes a row at the release widths."""
    got = {f: kf.layout(f, w) for f, w in (("v41", 512), ("v41_fp4", 512), ("fp4_index", 128), ("model1", 512))}
    assert {f: (lay.data_bytes, lay.scale_bytes) for f, lay in got.items()} == {
        "v41": (512, 16), "v41_fp4": (256, 32), "fp4_index": (64, 4), "model1": (448 + 128, 7 + 1)}
    assert [got[f].bytes_per_row for f in kf.FORMATS] == [528, 288, 68, 584]


def test_release_byte_counts_match_deepinfer_format_objects(refs):
    """Our release byte counts equal DeepInfer's own ``KVCacheFormat`` properties."""
    for fmt, width in (("v41", 512), ("v41_fp4", 512), ("fp4_index", 128)):
        form, lay = refs.formats[fmt], kf.layout(fmt, width)
        assert (form.num_elements, form.quantized_bytes, form.sf_bytes) == (width, lay.data_bytes, lay.scale_bytes)


@pytest.mark.parametrize("fmt,width,match", [
    ("v41", 48, "multiple of 32"), ("v41_fp4", 40, "multiple of 16"), ("fp4_index", 16, "multiple of 32"),
    ("model1", 96, "multiple of 64"), ("model1", 64, "positive multiple of 64"), ("v41", 0, "positive int"),
    ("fp16", 512, "unknown KV format")])
def test_bad_widths_are_named(fmt, width, match):
    with pytest.raises(ValueError, match=match):
        kf.layout(fmt, width)
    if width > 0:
        with pytest.raises(ValueError, match=match):
            kf.encode(jnp.zeros((2, width), jnp.bfloat16), fmt)


def test_bad_dtypes_and_shapes_are_named():
    with pytest.raises(TypeError, match="bfloat16 or float32, got float16"):
        kf.encode(jnp.zeros((2, 64), jnp.float16), "v41")
    with pytest.raises(TypeError, match="must be uint8"):
        kf.decode(jnp.zeros((2, 64), jnp.int8), jnp.zeros((2, 2), jnp.uint8), "v41")
    with pytest.raises(ValueError, match="needs 64 and 2"):
        kf.decode(jnp.zeros((2, 64), jnp.uint8), jnp.zeros((2, 3), jnp.uint8), "v41")
    with pytest.raises(ValueError, match="share leading dims"):
        kf.decode(jnp.zeros((2, 64), jnp.uint8), jnp.zeros((3, 2), jnp.uint8), "v41")
    with pytest.raises(ValueError, match="rope_dim must be a positive int"):
        kf.layout("model1", 512, rope_dim=0)


# --- byte equality with DeepInfer ------------------------------------------------------------------------------

_TIES = {"v41": (E4M3_GRID, 448.0, 32, [1.0, 2.0**-20, 2.0**10]),
         "v41_fp4": (E2M1_GRID, 6.0, 16, [1.875, 1.875 * 2.0**-3, 240.0, 1.125, 13.0, 2.0**-9 * 3]),
         "fp4_index": (E2M1_GRID, 6.0, 32, [1.0, 2.0**-100, 2.0**-126, 2.0**20])}


@pytest.mark.parametrize("fmt,width", [("v41", 512), ("v41_fp4", 512), ("fp4_index", 128),
                                       ("v41", 128), ("v41_fp4", 64), ("fp4_index", 256)])
def test_encode_is_byte_equal_to_deepinfer(refs, fmt, width):
    """Every data byte and every scale byte equals DeepInfer's ``ref_cast_from_bf16`` (on CPU, in IEEE arithmetic,
    so subnormal inputs count too), at the release width and another one whose UE8M0 count is a multiple of 4."""
    x = _inputs(hash((fmt, width)) % 1000, width, _tie_rows(*_TIES[fmt], width))
    data, scales = ENCODE(jnp.asarray(x), fmt=fmt)
    want_data, want_sf = _ref_bytes(refs, x, fmt)
    np.testing.assert_array_equal(_np(data), want_data)
    np.testing.assert_array_equal(_np(scales), want_sf)
    assert not np.isnan(np.float32(DECODE(data, scales, fmt=fmt))).any()


@pytest.mark.parametrize("fmt,width", [("v41", 64), ("fp4_index", 32)])
def test_narrow_ue8m0_rows_are_deepinfers_unpadded(refs, fmt, width):
    """Where ``width/32`` is not a multiple of 4, DeepInfer's packed-int32 UE8M0 pads each row with zero bytes to
    4; our rows hold just the ``width/32`` scale bytes, equal to DeepInfer's before its padding."""
    x = _inputs(7, width)
    data, scales = ENCODE(jnp.asarray(x), fmt=fmt)
    want_data, want_sf = _ref_bytes(refs, x, fmt)
    n_sf = width // 32
    np.testing.assert_array_equal(_np(data), want_data)
    np.testing.assert_array_equal(_np(scales), want_sf[:, :n_sf])
    assert not want_sf[:, n_sf:].any()


def test_fp4_division_mode_differs_only_at_ties(refs):
    """``reciprocal=False`` (the model's ``x / s``) gives DeepInfer's scales and differs from its codes only where
    ``x / s`` is exactly an e2m1 rounding tie (``x·(1/s)`` can land one ulp past it); the tie rows make some."""
    x = _inputs(3, 512, _tie_rows(*_TIES["v41_fp4"], 512))
    d_rec, s_rec = ENCODE(jnp.asarray(x), fmt="v41_fp4")
    d_div, s_div = ENCODE(jnp.asarray(x), fmt="v41_fp4", reciprocal=False)
    np.testing.assert_array_equal(_np(s_rec), _np(s_div))
    nibbles = lambda d: np.stack([d & 0xF, d >> 4], -1).reshape(len(x), 512)  # noqa: E731
    differ = nibbles(_np(d_rec)) != nibbles(_np(d_div))
    s = _np(s_rec).view(ml_dtypes.float8_e4m3fn).astype(np.float64).repeat(16, axis=1)
    ratio = np.abs(x.astype(np.float64) / s)[differ]
    assert differ.any() and np.isin(ratio, (E2M1_GRID[:-1] + E2M1_GRID[1:]) / 2).all()


# --- MODEL1 ---------------------------------------------------------------------------------------------------


def _model1_reference(x: np.ndarray, rope_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """FlashMLA ``quantize_k_cache`` (MODEL1_FP8Sparse) per token, in NumPy: for each 64-dim tile of the non-RoPE
    dims, ``s = 2^ceil(log2(max(fp32(amax)/448, 1e−4)))`` (the ceiling taken exactly, from ``frexp``), codes
    ``e4m3(x / s)``; then the RoPE dims' bf16 bytes; scales as e8m0 bytes ``log2 s + 127`` and one padding byte."""
    n, width = x.shape
    nope = width - rope_dim
    xf = x.astype(np.float32)
    tiles = xf[:, :nope].reshape(n, nope // 64, 64)
    inv = np.maximum(np.abs(tiles).max(-1) / np.float32(448.0), np.float32(1e-4)).astype(np.float64)
    mant, exp = np.frexp(inv)  # inv = mant · 2^exp, mant in [0.5, 1)
    k = np.where(mant == 0.5, exp - 1, exp)
    codes = (tiles / np.ldexp(1.0, k)[..., None]).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    rope = x[:, nope:].astype(BF16).view(np.uint8).reshape(n, 2 * rope_dim)
    data = np.concatenate([codes.view(np.uint8).reshape(n, nope), rope], axis=1)
    scales = np.concatenate([(k + 127).astype(np.uint8), np.zeros((n, 1), np.uint8)], axis=1)
    return data, scales


@pytest.mark.parametrize("width,rope_dim", [(512, 64), (128, 64), (80, 16)])
def test_model1_matches_flashmla_layout(width, rope_dim):
    x = _inputs(5, width, _tie_rows(E4M3_GRID, 448.0, 16, [1.0, 2.0**-13, 2.0**-20, 2.0**10], width))
    data, scales = ENCODE(jnp.asarray(x), fmt="model1", rope_dim=rope_dim)
    want_data, want_scales = _model1_reference(x, rope_dim)
    np.testing.assert_array_equal(_np(data), want_data)
    np.testing.assert_array_equal(_np(scales), want_scales)
    back = np.float32(DECODE(data, scales, fmt="model1", rope_dim=rope_dim))
    np.testing.assert_array_equal(back[:, width - rope_dim:], np.float32(x[:, width - rope_dim:]))
    tiles = want_data[:, : width - rope_dim].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = np.ldexp(np.float32(1.0), want_scales[:, :-1].astype(np.int32) - 127).repeat(64, axis=1)
    np.testing.assert_array_equal(back[:, : width - rope_dim], (tiles * scale).astype(BF16).astype(np.float32))


# --- decode ∘ encode = the model's fake quantisation ------------------------------------------------------------

_FAKE = {"v41": lambda x: fq.q8_fake(x, 32), "fp4_index": lambda x: fq.q4u_fake(x, 32),
         "v41_fp4": lambda x: fq.q4e_fake(x, 16)}


def _flushes_denormals() -> bool:
    return float(jax.jit(lambda v: v * 0.5)(np.float32(2.0**-140))) == 0.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt,width", [("v41", 512), ("v41_fp4", 512), ("fp4_index", 128), ("v41", 64),
                                       ("v41_fp4", 64), ("fp4_index", 32)])
def test_decode_encode_is_the_models_fake_quant(fmt, width, dtype):
    """The values a byte cache returns are exactly the fake-quantised values the model computes today (Q4e with the
    model's ``x / s``, hence ``reciprocal=False``), so switching the caches to bytes changes no token."""
    x = _inputs(11, width, _tie_rows(*_TIES[fmt], width)).astype(np.float32)
    if dtype == jnp.float32:  # fp32 activations: values between the bf16 ones
        x = x * np.float32(1 + 2.0**-12)
    xj = jnp.asarray(x, dtype)
    data, scales = ENCODE(xj, fmt=fmt, reciprocal=False)
    got = np.float32(DECODE(data, scales, fmt=fmt, dtype=dtype))
    want = np.float32(jax.jit(_FAKE[fmt])(xj))
    keep = np.ones(got.shape, bool)
    if fmt == "fp4_index" and _flushes_denormals():
        # fake_quant's Q4u divides in floats, so on a flushing backend (XLA:CPU) it reads subnormal inputs as 0
        # and both flush subnormal outputs; our encode is exact there (checked against DeepInfer above).
        keep = (np.abs(x) >= 2.0**-126) | (x == 0)
        keep &= (np.abs(want) >= 2.0**-126) | (want == 0)
        assert keep.mean() > 0.9
    np.testing.assert_array_equal(got[keep], want[keep])
    assert not np.isnan(got).any()


# --- bytes_per_token ----------------------------------------------------------------------------------------------


def test_bytes_per_token_v41_flash_is_deepinfers_890():
    """V4.1-Flash, by hand: KV sources 2, 8, 14 (ratio 2) and 20 (ratio 1) page compressed KV in V41 FP4,
    256 + 32 = 288 B a compressed row, and own the index keys (index_k_source_layer_ids defaults to the KV
    sources) in FP4 index format, 64 + 4 = 68 B a row. Per token: KV 3·288/2 + 288 = 720, index K 3·68/2 + 68 = 170,
    total 890 B (DeepInfer's figure, issue 9). The SWA ring and compressor state are per sequence, not paged."""
    assert bytes_per_token(load_config("deepseek-v4.1-flash")) == 890


def test_bytes_per_token_v4_flash():
    """V4-Flash, by hand: 43 layers, ratios 0, 0, then 4 (CSA, layers 2, 4, …, 42: 21 layers) and 128 (HCA, layers
    3, 5, …, 41: 20 layers). fp8: MODEL1 448 + 128 + 8 = 584 B a compressed row, CSA index keys 68 B:
    21·584/4 + 20·584/128 + 21·68/4 = 3066 + 91.25 + 357 = 3514.25 B. auto (bf16 KV 512·2 = 1024 B a row, fp32
    index keys 128·4 = 512 B): 21·1024/4 + 20·1024/128 + 21·512/4 = 5376 + 160 + 2688 = 8224 B."""
    cfg = load_config("deepseek-v4-flash")
    assert bytes_per_token(cfg, kv_cache_dtype="fp8") == 3514.25
    assert bytes_per_token(cfg) == 8224
    assert bytes_per_token(cfg, dtype=jnp.float32) == 21 * 2048 / 4 + 20 * 2048 / 128 + 2688


def test_bytes_per_token_tiny_presets():
    """tiny-v41 (head 64, index head 32; KV sources 2, 4 at ratio 2 and 6 at ratio 1, which own the index keys):
    row 32 + 4 = 36 B KV, 16 + 1 = 17 B index K: 2·36/2 + 36 + 2·17/2 + 17 = 106 B. tiny-v4 (head 32, rope 8,
    index head 16; CSA ratio 4 at layers 1, 3, HCA ratio 16 at layers 2, 4) with bf16 KV: 2·64/4 + 2·64/16 +
    2·64/4 (fp32 index keys) = 32 + 8 + 32 = 72 B; MODEL1 cannot hold its 24 non-RoPE dims."""
    assert bytes_per_token(load_config("tiny-v41")) == 106
    tiny_v4 = load_config("tiny-v4")
    assert bytes_per_token(tiny_v4) == 72
    with pytest.raises(ValueError, match="24 non-RoPE dims"):
        bytes_per_token(tiny_v4, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        bytes_per_token(tiny_v4, kv_cache_dtype="int8")


# --- the live caches store these bytes (V4.1) -------------------------------------------------------------------


def test_v41_cache_arrays_hold_deepinfers_bytes():
    """V4.1-Flash's cache arrays (abstract, nothing allocated) are uint8 rows of the byte formats: ring 512 + 16 =
    528 B, compressed KV 288 B, index keys 68 B; so one 128-token page of all layers costs 128 × 890 B, DeepInfer's
    per-token figure (hand-computed above), and a bf16 V4 cache keeps value rows (on CPU as their 16-bit patterns,
    ``cache_codec.stores_bits``: the same two bytes a value)."""
    from dinfer_jax.engine.kv_cache import bytes_per_block_and_slot
    from dinfer_jax.models.step_state import CacheConfig, cache_shapes

    cfg = load_config("deepseek-v4.1-flash")
    shapes = cache_shapes(cfg, CacheConfig(num_slots=3, num_blocks=5, block_size=128), jnp.bfloat16)
    leaves = {}
    for group in shapes.layers:
        for lc in group:
            for name in ("swa", "ckv", "ik"):
                x = getattr(lc, name)
                if x is not None:
                    leaves.setdefault(name, set()).add((x.shape[-1], x.dtype))
    u8 = jnp.dtype(jnp.uint8)
    assert leaves == {"swa": {(528, u8)}, "ckv": {(288, u8)}, "ik": {(68, u8)}}
    per_block, _ = bytes_per_block_and_slot(cfg, 128, jnp.bfloat16)
    assert per_block == 128 * 890
    v4 = cache_shapes(load_config("deepseek-v4-flash"), CacheConfig(3, 5, 128), jnp.bfloat16)
    from dinfer_jax.models.cache_codec import stores_bits

    value_rows = jnp.dtype(jnp.uint16 if stores_bits(jnp.bfloat16) else jnp.bfloat16)
    assert {(lc.swa.shape[-1], lc.swa.dtype) for g in v4.layers for lc in g} == {(512, value_rows)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_codec_roundtrip_is_the_fake_quant(dtype):
    """What a V4.1 layer reads back from its byte cache is what it computed: ``unpack(pack(x))`` equals the fake
    quantisation the attention uses (Q8 ring, Q4e with ``x / s`` compressed KV, Q4u index keys), in the cache's
    value dtype."""
    from dinfer_jax.models.cache_codec import cache_codecs
    from dinfer_jax.models.fake_quant import q4e_fake, q4u_fake, q8_fake

    cfg = load_config("tiny-v41")
    c = cache_codecs(cfg, dtype)
    key = jax.random.split(jax.random.key(7), 3)
    x = (jax.random.normal(key[0], (4, 6, cfg.head_dim)) * 3).astype(dtype)
    np.testing.assert_array_equal(np.asarray(c.swa.unpack(c.swa.pack(x)), np.float32),
                                  np.asarray(q8_fake(x, 32).astype(dtype), np.float32))
    y = jax.random.normal(key[1], (4, 6, cfg.head_dim), jnp.float32) * 0.7
    np.testing.assert_array_equal(np.asarray(c.ckv.unpack(c.ckv.pack(y)), np.float32),
                                  np.asarray(q4e_fake(y, 16).astype(dtype), np.float32))
    z = jax.random.normal(key[2], (4, 6, cfg.index_head_dim), jnp.float32)
    np.testing.assert_array_equal(np.asarray(c.ik.unpack(c.ik.pack(z))), np.asarray(q4u_fake(z, 32)))
    assert c.packed and not cache_codecs(load_config("tiny-v4"), dtype).packed
