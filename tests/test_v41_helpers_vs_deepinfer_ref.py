"""V4.1 helpers (fake quantisers, compressor pooling, candidate top-k) against DeepInfer's / tile-kernels' ``_ref``s.

The references are the pure-PyTorch twins of the GPU kernels, loaded from source by ``deepinfer_refs`` (no
TileLang needed). Every comparison is exact unless a comment says why not.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_refs import load_refs, require_refs, tile_kernels_clamp_overrides
from dinfer_jax.models import csa2
from dinfer_jax.models import fake_quant as fq
from provision import require_module

torch = require_module("torch")

OPS = "deepinfer/model_executor/layers/tilelang_ops/"
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def refs() -> SimpleNamespace:
    """The ``_ref`` functions used below, loaded once."""
    require_refs()
    overrides = tile_kernels_clamp_overrides(OPS)
    ns = SimpleNamespace()
    ns.cast, ns.cast_back, ns.unpack_e2m1 = load_refs(
        "tile_kernels/torch/cast.py", "cast", "cast_back", "unpack_from_e2m1fn_x2", overrides=overrides)
    ns.cast_from_bf16, ns.cast_to_bf16, ns.fp4_format = load_refs(
        OPS + "cache_common.py", "ref_cast_from_bf16", "ref_cast_to_bf16", "V41_FP4_FORMAT", overrides=overrides)
    (ns.compress_prefill,) = load_refs(OPS + "compress.py", "compress_and_update_state_prefill_ref")
    ns.block_max, ns.compact_lens, ns.restore = load_refs(
        OPS + "candidate_blocks.py", "candidate_block_max_ref", "get_candidate_compact_lens_ref",
        "restore_candidate_indices_inplace_ref")
    return ns


# --- quantiser inputs ------------------------------------------------------------------------------------------

E4M3_GRID = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # 0 … 448
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def _midpoints(grid: np.ndarray) -> np.ndarray:
    return (grid[:-1] + grid[1:]) / 2


def _tie_rows(grid: np.ndarray, qmax: float, block: int, scales: list[float], width: int) -> np.ndarray:
    """Rows whose blocks have amax ``qmax·scale`` (so the scale is ``scale``) and otherwise hold ±grid midpoints
    times ``scale``: every element sits exactly on a rounding tie of the target grid."""
    mids = np.concatenate([_midpoints(grid), -_midpoints(grid), grid[1:3]])
    rows = []
    for i, sc in enumerate(scales):
        vals = np.resize(np.roll(mids, 7 * i), width).reshape(-1, block)
        vals[:, 0] = qmax
        rows.append(vals.reshape(width) * sc)
    return np.stack(rows)


def _quant_inputs(seed: int, width: int, tie_rows: np.ndarray) -> np.ndarray:
    """fp64 rows: random normals at scales 1e−6 … 1e6, zeros, tiny / subnormal / huge values, exact ties."""
    rng = np.random.default_rng(seed)
    rand = rng.standard_normal((24, width)) * 10.0 ** rng.uniform(-6, 6, (24, 1))
    # Blocks of one row with very different magnitudes (the scale is per block, not per row).
    mixed = rng.standard_normal((2, width)) * 10.0 ** rng.integers(-30, 30, (2, width // 16)).repeat(16, axis=1)
    special = np.stack([np.zeros(width), np.full(width, 1e-30), rng.standard_normal(width) * 1e-40,
                        np.resize([3e38, -1e38, 1.0, -0.0], width), rng.standard_normal(width) * 1e4])
    return np.concatenate([rand, mixed, special, tie_rows])


def _as(x: np.ndarray, dtype: str) -> tuple[jax.Array, torch.Tensor]:
    """The same values as a JAX array and a torch tensor of ``dtype`` (rounded once, by ml_dtypes)."""
    xn = x.astype(np.float32).astype(BF16) if dtype == "bfloat16" else x.astype(np.float32)
    t = torch.from_numpy(xn.astype(np.float32))
    return jnp.asarray(xn), (t.bfloat16() if dtype == "bfloat16" else t)


def _np(x) -> np.ndarray:
    return np.asarray(x.float().numpy() if isinstance(x, torch.Tensor) else jnp.asarray(x, jnp.float32))


# --- grids ------------------------------------------------------------------------------------------------------


def test_e4m3_rne_matches_ml_dtypes_cast():
    """Our explicit e4m3 rounding equals ml_dtypes' RNE cast on every tie, its neighbours and random values."""
    mids = _midpoints(E4M3_GRID).astype(np.float32)
    rng = np.random.default_rng(1)
    x = np.concatenate([E4M3_GRID.astype(np.float32), mids, np.nextafter(mids, 0), np.nextafter(mids, 500),
                        rng.uniform(0, 448, 20000).astype(np.float32), rng.uniform(0, 2**-6, 20000).astype(np.float32),
                        np.float32([1e-40, 2**-10, 2**-11])])
    x = np.concatenate([x, -x])
    want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(fq.e4m3_rne)(x)), want)


def test_e2m1_rne_ties_follow_spec():
    """The spec's tie table (docs/spec/model-v41.md §2), clamping at ±6 and the sign."""
    x = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7, 0.2499, 5.01, -0.75, -5, -1e9])
    want = np.float32([0, 1, 1, 2, 2, 4, 4, 6, 0, 6, -1, -4, -6])
    np.testing.assert_array_equal(np.asarray(fq.e2m1_rne(x)), want)


def test_pow2ceil_bit_definition():
    """exp_field − 127 + (mantissa ≠ 0), including subnormals (→ 2^−126) and exact powers of two."""
    t = np.float32([1.0, 1.5, 2.0, 0.75, 2**-126, 2**-130, 1.7e38, 448 * 2**-20])
    want = np.float32([1.0, 2.0, 2.0, 1.0, 2**-126, 2**-126, 2.0**127, 2**-11])
    np.testing.assert_array_equal(np.asarray(fq.pow2ceil(t)), want)


def _subnormal(x: np.ndarray) -> np.ndarray:
    return (np.abs(x) < 2.0**-126) & (x != 0)


def _flushes_denormals() -> bool:
    """Whether the default JAX backend flushes fp32 subnormals to zero (XLA:CPU does)."""
    return float(jax.jit(lambda v: v * 0.5)(np.float32(2.0**-140))) == 0.0


# --- (a) quantisers vs the references ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q8_matches_tile_kernels_cast(refs, dtype):
    """Q8 = tile-kernels ``cast(x, "e4m3", (1, 32), round_sf=True)`` + ``cast_back``: the PyTorch twin of
    ``per_token_cast``, which DeepInfer's ``ref_cast_from_bf16`` calls for ``V41_FORMAT`` (SWA KV) and its NPU path
    calls directly. Codes, scales and dequantised values exactly equal."""
    ties = _tie_rows(E4M3_GRID, 448.0, 32, [1.0, 2.0**-20, 2.0**10], 512)
    xj, xt = _as(_quant_inputs(10, 512, ties), dtype)
    q, s = jax.jit(fq.q8_quantize)(xj)
    codes, sf = refs.cast(xt, "e4m3", block_size=(1, 32), round_sf=True)
    np.testing.assert_array_equal(_np(q), _np(codes))
    np.testing.assert_array_equal(_np(s), _np(sf))
    out = jax.jit(fq.q8_fake)(xj)
    assert out.dtype == xj.dtype
    back = refs.cast_back((codes, sf), "bf16" if dtype == "bfloat16" else "fp32", block_size=(1, 32))
    np.testing.assert_array_equal(_np(out), _np(back))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4u_matches_tile_kernels_cast(refs, dtype):
    """Q4u = tile-kernels ``cast(x, "e2m1", (1, 32), round_sf=True)`` + ``cast_back`` (what ``per_token_cast``
    computes for ``FP4_INDEX_KV_FORMAT`` and the index queries): exactly equal codes (unpacked), scales and
    dequantised values."""
    ties = _tie_rows(E2M1_GRID, 6.0, 32, [1.0, 2.0**-100, 2.0**-126, 2.0**20], 512)
    xj, xt = _as(_quant_inputs(11, 512, ties), dtype)
    q, s = jax.jit(fq.q4u_quantize)(xj)
    packed, sf = refs.cast(xt, "e2m1", block_size=(1, 32), round_sf=True)
    back = _np(refs.cast_back((packed, sf), "bf16" if dtype == "bfloat16" else "fp32", block_size=(1, 32)))
    # The 2^-126-scale tie row has subnormal inputs and outputs. A backend that flushes denormals (XLA:CPU runs
    # with FTZ/DAZ) reads and writes those as 0, so there (only) the comparison skips elements whose input or
    # reference output is subnormal; everything else must match exactly. (Q8 and Q4e are immune: their minimum
    # scales round every subnormal input to code 0 and keep every output normal.)
    keep = ~(_subnormal(_np(xj)) | _subnormal(back)) if _flushes_denormals() else np.ones(back.shape, bool)
    assert keep.mean() > 0.95  # only the 1e-40 row and part of the 2^-126 tie row are skipped
    np.testing.assert_array_equal(_np(q)[keep], _np(refs.unpack_e2m1(packed))[keep])
    np.testing.assert_array_equal(_np(s), _np(sf))
    np.testing.assert_array_equal(_np(jax.jit(fq.q4u_fake)(xj))[keep], back[keep])


def _q4e_inputs() -> tuple[jax.Array, torch.Tensor, int]:
    """bf16 rows of 512 (the V41 FP4 cache width; DeepInfer's ref takes bf16 only) and the first tie row."""
    # e4m3 scales, not powers of two. With mantissa 1.875 the ties 1.25, 2.5, 5 (× s) are where x · fp32(1/s)
    # lands one fp32 ulp above the tie while x / s is exact (found by brute force over all bf16 x and e4m3 s).
    e4m3_scales = [1.875, 1.875 * 2.0**-3, 240.0, 1.125, 13.0, 2.0**-9 * 3]
    ties = _tie_rows(E2M1_GRID, 6.0, 16, e4m3_scales, 512)
    x = _quant_inputs(12, 512, ties)
    xj, xt = _as(x, "bfloat16")
    return xj, xt, len(x) - len(ties)


def test_q4e_reciprocal_matches_deepinfer_fp4_cache_ref(refs):
    """Q4e with ``reciprocal=True`` = DeepInfer ``ref_cast_from_bf16`` / ``ref_cast_to_bf16`` for
    ``V41_FP4_FORMAT`` (e4m3 scale per 16, ``x · (1/s)``): codes, scales and bf16 values exactly equal."""
    xj, xt, _ = _q4e_inputs()
    q, s = jax.jit(lambda x: fq.q4e_quantize(x, reciprocal=True))(xj)
    enc = refs.cast_from_bf16(xt, refs.fp4_format)
    np.testing.assert_array_equal(_np(q), _np(refs.unpack_e2m1(enc.quantized_data)))
    np.testing.assert_array_equal(_np(s), _np(enc.sf_data))
    out = jax.jit(lambda x: fq.q4e_fake(x, reciprocal=True))(xj)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_np(out), _np(refs.cast_to_bf16(enc, refs.fp4_format)))


def test_q4e_division_differs_from_deepinfer_only_across_ties(refs):
    """Q4e as specified (``x / s``, HF) vs DeepInfer (``x · (1/s)``): same scales; a code differs exactly where
    fp32 ``x / s`` and ``x · fp32(1/s)`` fall on different sides of an e2m1 rounding tie — the exact-tie rows
    must show such differences."""
    xj, xt, first_tie = _q4e_inputs()
    q, s = jax.jit(fq.q4e_quantize)(xj)
    enc = refs.cast_from_bf16(xt, refs.fp4_format)
    q_ref = _np(refs.unpack_e2m1(enc.quantized_data))
    np.testing.assert_array_equal(_np(s), _np(enc.sf_data))
    x = _np(xj).reshape(len(q_ref), -1, 16)
    sb = _np(s)[..., None]
    by_div = _np(fq.e2m1_rne(x / sb)).reshape(q_ref.shape)  # numpy fp32 division: correctly rounded
    by_mul = _np(fq.e2m1_rne(x * (np.float32(1) / sb))).reshape(q_ref.shape)
    np.testing.assert_array_equal(_np(q), by_div)
    np.testing.assert_array_equal(q_ref, by_mul)
    assert (by_div != by_mul)[first_tie:].any()


def test_q4e_scale_division_vs_reciprocal_same_for_bf16():
    """``a / 6`` (spec) vs ``a · fp32(1/6)`` (DeepInfer) never changes the e4m3 scale when amax is a bf16 value —
    checked for every positive finite bf16 amax, so the choice only matters for fp32 inputs."""
    a = np.arange(1, 0x7F80, dtype=np.uint16).view(BF16)
    x = jnp.asarray(np.zeros((len(a), 16), BF16)).at[:, 3].set(jnp.asarray(a))
    _, s_div = jax.jit(fq.q4e_quantize)(x)
    _, s_mul = jax.jit(lambda v: fq.q4e_quantize(v, reciprocal=True))(x)
    np.testing.assert_array_equal(np.asarray(s_div), np.asarray(s_mul))


# --- (b) compressor pooling vs compress_and_update_state_prefill_ref ----------------------------------------------


@pytest.mark.parametrize("ratio", [1, 2])
def test_pool_groups_matches_compress_prefill_ref(refs, ratio):
    """Several sequences (odd / even lengths, one shorter than a group) prefilled from position 0 with a fresh
    state: DeepInfer's ref pools each group and rounds to bf16; we round our fp32 pool to bf16.

    Tolerance: ≤ 1 bf16 ulp, and ≥ 99 % bit-identical. Both sides compute ``Σ softmax ⊙ latent`` in fp32, but
    torch's CPU softmax (vectorised exp, its own normalisation) and XLA's exp / division differ by an fp32 ulp on
    a few percent of elements, which flips the bf16 rounding only when the fp32 value sits next to a bf16 tie.
    Ratio 1 is exact (softmax of one element is 1)."""
    rng = np.random.default_rng(20 + ratio)
    lens, dim = [7, 12, 1, 33, 2, 40], 512
    b, s = len(lens), max(lens)
    score = (rng.standard_normal((b, s, dim)) * 4).astype(np.float32)
    score[0, :4] = 0.5  # equal scores: weights exactly 1/2
    score[1, :2, ::2] = [[80.0], [-80.0]]  # saturated softmax
    latent = rng.standard_normal((b, s, dim)).astype(np.float32)
    ours = np.asarray(jax.jit(csa2.pool_groups, static_argnums=2)(score, latent, ratio).astype(jnp.bfloat16))

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    groups = [n // ratio for n in lens]
    cu_c = np.concatenate([[0], np.cumsum([max(g, 1) for g in groups])]).astype(np.int32)  # ≥ 1 entry each
    cat = lambda a: torch.from_numpy(np.concatenate([a[i, :n] for i, n in enumerate(lens)]))  # noqa: E731
    ref = refs.compress_prefill(
        cat(score), cat(latent), torch.zeros(b, ratio + 6 - 1, 2, dim), torch.arange(b, dtype=torch.int32),
        torch.zeros(int(cu_c[-1]), dtype=torch.int32), torch.from_numpy(cu), torch.from_numpy(cu),
        torch.from_numpy(cu_c), ratio).float().numpy()

    ulps = []
    for i, g in enumerate(groups):
        mine = ours[i, :g].astype(np.float32).view(np.int32) >> 16
        theirs = ref[cu_c[i]: cu_c[i] + g].view(np.int32) >> 16
        ulps.append(np.abs(mine.astype(np.int64) - theirs).ravel())
    ulps = np.concatenate(ulps)
    assert ulps.max() <= 1 and (ulps == 0).mean() >= 0.99
    if ratio == 1:
        assert ulps.max() == 0


# --- (c) candidate blocks and top-k vs candidate_blocks.py refs -------------------------------------------------------


def _index_scores(seed: int, b: int, s: int, t: int, visible: np.ndarray, ties: bool) -> np.ndarray:
    """bf16-valued fp32 scores ``[b, s, t]``, −inf at ``t ≥ visible``; ``ties`` draws from 9 values so blocks tie."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, (b, s, t)) * 0.5 if ties else rng.standard_normal((b, s, t)) * 3
    x = x.astype(np.float32).astype(BF16).astype(np.float32)
    return np.where(np.arange(t) < visible[..., None], x, -np.inf).astype(np.float32)


def _ref_topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k with ties to the lowest index (stable descending sort), −inf dropped; ascending ids, −1 fill."""
    k = min(k, scores.shape[-1])
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx = torch.where(vals[:, :k] > -torch.inf, idx[:, :k], torch.iinfo(torch.int32).max)
    idx = torch.sort(idx, dim=-1).values
    return torch.where(idx == torch.iinfo(torch.int32).max, -1, idx).to(torch.int32)


CASES = [  # (ratio, block_size, topk_blocks, ties, random visible lengths)
    (1, 8, 3, True, False),
    (2, 8, 2, False, False),
    (1, 16, 2, True, True),
    (1, 8, 50, False, True),  # more blocks requested than exist
]


@pytest.mark.parametrize("ratio,block_size,topk_blocks,ties,random_visible", CASES)
def test_candidate_blocks_match_deepinfer_ref(refs, ratio, block_size, topk_blocks, ties, random_visible):
    """Block scores = ``candidate_block_max_ref`` (max of visible entries, newest visible block +inf) exactly;
    the selected blocks = the ref's scores ranked by a stable top-k over blocks with score > −inf (DeepInfer
    selects with ``end = valid_blocks``; for finite logits that is the same set) — exact, ties included; the
    mask's per-row count = ``get_candidate_compact_lens_ref`` of our block ids."""
    b, s = 2, 70
    t = s // ratio
    if random_visible:
        visible = np.random.default_rng(30).integers(0, t + 1, (b, s))
        visible[0, :3] = [0, t, 1]
    else:
        visible = np.broadcast_to((np.arange(s) + 1) // ratio, (b, s))
    scores = _index_scores(31 + block_size, b, s, t, visible, ties)
    vis = jnp.asarray(visible if random_visible else visible[0])  # exercise both [S] and [B, S]

    ours_scores = jax.jit(csa2.candidate_block_scores, static_argnums=2)(scores, vis, block_size)
    mask, ids = jax.jit(csa2.candidate_blocks, static_argnums=(2, 3))(scores, vis, block_size, topk_blocks)
    assert mask.shape == (b, s, t) and ids.shape == (b, s, topk_blocks) and ids.dtype == jnp.int32

    logits = torch.from_numpy(scores.reshape(b * s, t)).bfloat16()
    valid = torch.from_numpy(np.ascontiguousarray(visible).reshape(-1).astype(np.int32))
    ref_scores, _ = refs.block_max(logits, valid, block_size)
    np.testing.assert_array_equal(np.asarray(ours_scores).reshape(b * s, -1), ref_scores.float().numpy())

    ref_ids = _ref_topk_sorted(ref_scores.float(), topk_blocks).numpy()
    np.testing.assert_array_equal(np.asarray(ids).reshape(b * s, -1)[:, : ref_ids.shape[1]], ref_ids)
    assert (np.asarray(ids)[..., ref_ids.shape[1]:] == -1).all()
    counts = refs.compact_lens(torch.from_numpy(np.array(ids).reshape(b * s, -1)), valid, block_size)
    np.testing.assert_array_equal(np.asarray(mask).sum(-1).reshape(-1), counts.numpy())


@pytest.mark.parametrize("k", [5, 24])
def test_second_level_topk_matches_compact_restore_ref(refs, k):
    """Later index sources: top-k restricted to the candidate blocks. DeepInfer scores the compacted candidate
    entries, takes top-k there and maps back with ``restore_candidate_indices_inplace_ref``; we take
    :func:`csa2.topk_select` over the full row masked to the candidates. With ascending block ids the compact
    order preserves sequence order, so the lowest-index tie rule agrees: indices must be equal exactly."""
    b, s, block_size, topk_blocks = 2, 64, 8, 3
    visible = np.broadcast_to(np.arange(1, s + 1), (b, s))
    scores = _index_scores(40 + k, b, s, s, visible, ties=True)
    mask, ids = csa2.candidate_blocks(scores, jnp.asarray(visible[0]), block_size, topk_blocks)
    restricted = jnp.where(mask, scores, -jnp.inf)
    idx, sel = jax.jit(csa2.topk_select, static_argnums=1)(restricted, k)

    ids_t = torch.from_numpy(np.array(ids).reshape(b * s, -1))
    offsets = torch.arange(topk_blocks * block_size)
    seq = ids_t.repeat_interleave(block_size, dim=1) * block_size + offsets % block_size
    ok = (ids_t.repeat_interleave(block_size, dim=1) >= 0) & (seq < torch.from_numpy(visible.reshape(-1, 1)))
    flat = torch.from_numpy(scores.reshape(b * s, s))
    compact = torch.where(ok, flat.gather(1, seq.clamp(0, s - 1)), -torch.inf)
    compact_idx = _ref_topk_sorted(compact, k)
    refs.restore(compact_idx, ids_t, block_size)  # in place: compact → sequence indices, −1 kept
    want = torch.sort(torch.where(compact_idx < 0, s, compact_idx), dim=-1).values
    want = torch.where(want == s, -1, want).numpy()
    np.testing.assert_array_equal(np.asarray(idx).reshape(b * s, -1), want)
    assert (np.asarray(sel).sum(-1) == (np.asarray(idx) >= 0).sum(-1)).all()


def test_topk_select_edges():
    """k clipped to T, −inf never picked (−1 fill), ties to the lowest index, ascending output."""
    x = jnp.asarray([[1.0, 3.0, 3.0, -jnp.inf, 3.0], [-jnp.inf] * 5, [0.0, 0.0, 0.0, 0.0, 0.0]])
    idx, mask = csa2.topk_select(x, 2)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2], [-1, -1], [0, 1]])
    np.testing.assert_array_equal(np.asarray(mask).sum(-1), [2, 0, 2])
    idx, mask = csa2.topk_select(x, 9)
    assert idx.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(idx)[0], [0, 1, 2, 4, -1])
