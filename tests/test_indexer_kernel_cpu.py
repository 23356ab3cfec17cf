"""The indexer-score kernel's pieces that a CPU can check (``pallas_kernels.indexer``).

* The register decode (:func:`host_decode_tile`, the kernel's shifts and masks on the host) against the
  ``fp4_index`` format as :mod:`dinfer_jax.engine.kv_formats` decodes it (itself byte-equal to DeepInfer's
  reference cast): every value exact, in the column order :func:`key_permutation` states, times 2^-64.
* The reference's own decode against ``kv_formats.decode``, and the reference scores against an independent float64
  NumPy computation.
* The kernel lowers for CUDA on this CPU-only machine (Pallas → Mosaic GPU: layouts, register decode, WGMMA operand
  shapes, TMA boxes, barriers); its numbers are checked on the H200 (tests/test_indexer_kernel_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.engine.kv_formats import decode, encode
from pallas_kernels.indexer.reference import decode_rows, index_scores_rows_ref
from pallas_kernels.indexer.scores_sm90 import (
    check_config,
    host_decode_tile,
    index_scores_rows,
    key_permutation,
    multiplier_bits,
    padded_pages,
    query_operand,
    register_bits,
    smem_bytes,
    traffic,
)


def _rows(key, n: int, scale: np.ndarray | float = 1.0) -> np.ndarray:
    """``n`` fp4_index rows of random keys (per-row magnitudes ``scale``), as the cache stores them."""
    x = jax.random.normal(key, (n, 128), jnp.float32) * jnp.asarray(scale, jnp.float32).reshape(-1, 1)
    data, scales = encode(x.astype(jnp.bfloat16), "fp4_index")
    return np.concatenate([np.asarray(data), np.asarray(scales)], axis=-1)


def test_key_permutation_is_a_bijection_within_scale_groups_per_thread():
    perm = key_permutation()
    assert sorted(perm.tolist()) == list(range(128))
    for col, dim in enumerate(perm):   # thread lane c = (col % 8) // 2 reads only scale group c
        assert dim // 32 == (col % 8) // 2


def test_register_bits_are_e2m1_times_2_pow_minus_126():
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for lo in range(16):
        for hi in range(16):
            for j in range(4):
                word = (lo << 4 * j) | (hi << 4 * (j + 4))
                bits = register_bits(word, j)
                for half, code in ((0, lo), (1, hi)):
                    b16 = np.uint32((bits >> 16 * half) & 0xFFFF) << 16
                    got = float(np.array(b16, np.uint32).view(np.float32))
                    want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * 2.0 ** -126
                    assert got == want, (lo, hi, j, half)


def test_multiplier_bits():
    for s in (0, 1, 62, 127, 128, 150, 192):
        b16 = np.uint32(multiplier_bits(s) & 0xFFFF) << 16
        assert float(np.array(b16, np.uint32).view(np.float32)) == 2.0 ** (s - 65)
        assert multiplier_bits(s) >> 16 == multiplier_bits(s) & 0xFFFF


@pytest.mark.parametrize("seed", [0, 1])
def test_host_decode_tile_equals_the_format(seed):
    """Keys of very different magnitudes per row (scale exponents 127 ± 40, and all-zero rows)."""
    mags = 2.0 ** np.random.default_rng(seed).integers(-40, 40, 64)
    mags[::7] = 0.0
    rows = _rows(jax.random.key(seed), 64, mags)
    want = np.asarray(decode(jnp.asarray(rows[:, :64]), jnp.asarray(rows[:, 64:]), "fp4_index", dtype=jnp.float32))
    got = host_decode_tile(rows)
    np.testing.assert_array_equal(got * 2.0 ** 64, want[:, key_permutation()].astype(np.float64))


def test_reference_decode_equals_kv_formats():
    rows = _rows(jax.random.key(3), 300, 2.0 ** np.arange(-5, 5).repeat(30))
    want = decode(jnp.asarray(rows[:, :64]), jnp.asarray(rows[:, 64:]), "fp4_index", dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(decode_rows(jnp.asarray(rows), 128)), np.asarray(want))


def test_reference_scores_against_float64():
    b, s, h, t = 2, 3, 32, 70
    rows = _rows(jax.random.key(4), b * t).reshape(b, t, 68)
    q = np.asarray(jax.random.normal(jax.random.key(5), (b, s, h, 128)))
    w = np.asarray(jax.random.normal(jax.random.key(6), (b, s, h)))
    k = np.asarray(decode_rows(jnp.asarray(rows), 128), np.float64)
    want = np.einsum("bsht,bsh->bst", np.maximum(np.einsum("bshd,btd->bsht", q, k), 0), w)
    got = np.asarray(index_scores_rows_ref(jnp.asarray(q), jnp.asarray(w), jnp.asarray(rows)))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale    # fp32 sums of ~128·32 terms


def test_query_operand_is_permuted_scaled_transposed():
    q = jax.random.normal(jax.random.key(7), (1, 2, 32, 128)).astype(jnp.bfloat16).astype(jnp.float32)
    qt = np.asarray(query_operand(q).astype(jnp.float32))
    assert qt.shape == (1, 2, 128, 32)
    np.testing.assert_array_equal(qt, np.swapaxes(np.asarray(q)[..., key_permutation()], -1, -2) * 2.0 ** 64)


def test_check_config():
    assert check_config(64, 1, 64, 128, 4096, stages=4, splits=None, tile_rows=64) == (8, 4)
    assert check_config(1, 1, 32, 128, 128, stages=4, splits=None, tile_rows=64) == (2, 1)
    # 128-row tiles: half as many tiles to split over; stages capped by the tiles a CTA has
    assert check_config(64, 1, 64, 128, 4096, stages=4, splits=None, tile_rows=128) == (8, 4)
    assert check_config(1, 1, 32, 128, 256, stages=4, splits=None, tile_rows=256) == (1, 1)
    for kw, msg in [(dict(d=64), "head width"), (dict(h=48), "index heads"), (dict(s=9), "query tokens"),
                    (dict(t=100), "multiple of tile_rows=64"), (dict(splits=3), "splits=3"),
                    (dict(s=8, h=128), "shared memory"), (dict(tile_rows=96), "tile_rows=96"),
                    (dict(t=64 * 3, tile_rows=128), "multiple of tile_rows=128")]:
        args = dict(b=2, s=1, h=64, d=128, t=1024, stages=2, splits=None, tile_rows=64) | kw
        with pytest.raises(ValueError, match=msg):
            check_config(args.pop("b"), args.pop("s"), args.pop("h"), args.pop("d"), args.pop("t"), **args)


def test_smem_bytes_matches_mosaic(monkeypatch):
    """:func:`smem_bytes` is what Mosaic GPU allocates (its error under a 1-byte bound reports the figure)."""
    from jax.experimental.mosaic.gpu import core

    monkeypatch.setattr(core, "_SMEM_SIZE_BOUND", 1)
    sds = jax.ShapeDtypeStruct
    for b, s, h, t, tr in [(2, 1, 64, 1024, 64), (1, 3, 32, 256, 64), (2, 2, 32, 1024, 128), (1, 1, 64, 512, 256)]:
        splits = check_config(b, s, h, 128, t, stages=4, splits=None, tile_rows=tr)[0]
        want = smem_bytes(s, h, min(4, t // tr // splits), tr)
        fn = functools.partial(index_scores_rows, tile_rows=tr)
        with pytest.raises(ValueError, match=f"smem_bytes={want} "):
            jax.jit(fn).trace(sds((b, s, h, 128), jnp.float32), sds((b, s, h), jnp.float32),
                              sds((b, t, 68), jnp.uint8)).lower(lowering_platforms=("cuda",))


def test_padded_pages():
    assert padded_pages(5, 32, 64) == 6 and padded_pages(4, 32, 64) == 4
    assert padded_pages(3, 64, 128) == 4 and padded_pages(1, 128, 128) == 1
    assert padded_pages(1, 96, 64) == 2 and padded_pages(3, 96, 256) == 8   # 192 rows, 768 rows
    assert padded_pages(2, 32, 256) == 8


def test_traffic():
    t = traffic(64, 1, 32, 4096)
    assert t["bytes_read"] == 64 * 4096 * 68 + 64 * 32 * 128 * 2 + 64 * 32 * 4
    assert t["bytes"] == t["bytes_read"] + 64 * 4096 * 4 and t["flops"] == 2 * 64 * 32 * 4096 * 128


@pytest.mark.parametrize("b,s,h,t,tr", [(64, 1, 32, 2048, 64), (2, 5, 64, 1000, 64), (1, 6, 128, 64, 64),
                                        (3, 8, 64, 128, 64), (64, 1, 32, 2048, 128), (2, 2, 64, 1000, 256)])
def test_kernel_lowers_for_cuda(b, s, h, t, tr):
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(functools.partial(index_scores_rows, tile_rows=tr))
    traced = fn.trace(sds((b, s, h, 128), jnp.float32), sds((b, s, h), jnp.float32), sds((b, t, 68), jnp.uint8))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_model_uses_the_jnp_indexer_on_cpu():
    from dinfer_jax.models.attention import index_impl, index_kernel_unsupported
    from dinfer_jax.models.config import load_config

    cfg = load_config("deepseek-v4.1-flash")
    assert "backend" in index_kernel_unsupported(cfg, 1)
    assert index_impl("auto", cfg, 1) == "jnp"
    for impl in ("pallas", "pallas_gather"):
        with pytest.raises(ValueError, match=f"attention_impl='{impl}' cannot run the indexer kernel"):
            index_impl(impl, cfg, 1)


@pytest.mark.parametrize("impl", ["pallas", "pallas_gather"])
def test_kernel_switch_on_a_gpu_scores_with_xla_where_the_indexer_kernel_cannot_read(impl):
    """On a GPU the attention-kernel switch keeps the indexer kernel for V4.1's fp4_index keys at decode widths and
    leaves XLA the rest: prefill widths, and V4's exact cache whose index keys are plain values (the H100 run of
    2026-12-06 stopped V4's pallas_gather serving bench on a ValueError here)."""
    import dataclasses

    from dinfer_jax.models.attention import index_impl, index_kernel_unsupported
    from dinfer_jax.models.config import load_config

    v41 = load_config("deepseek-v4.1-flash")
    v4 = load_config("deepseek-v4-flash")
    assert not v4.kv_fake_quant
    assert index_impl(impl, v41, 1, backend="gpu") == "pallas"
    assert index_impl(impl, v41, 64, backend="gpu") == "jnp"
    assert "fp4_index" in index_kernel_unsupported(v4, 1, backend="gpu")
    assert index_impl(impl, v4, 1, backend="gpu") == "jnp"
    assert index_impl(impl, dataclasses.replace(v4, kv_fake_quant=True), 1, backend="gpu") == "pallas"


@pytest.mark.parametrize("rpb,pages", [(64, 7), (32, 5), (128, 3)])
def test_paged_kernel_lowers_for_cuda(rpb, pages):
    """Through the page table: V4.1 (ratio 2, 64 rows a 128-token page), V4 (ratio 4, 32 rows), 128-row pages;
    page counts whose rows are not a multiple of 64 are padded with page 0."""
    from pallas_kernels.indexer.scores_sm90 import index_scores_paged

    sds = jax.ShapeDtypeStruct
    traced = jax.jit(index_scores_paged).trace(
        sds((3, 1, 32, 128), jnp.float32), sds((3, 1, 32), jnp.float32), sds((4, 50, rpb, 68), jnp.uint8),
        sds((), jnp.int32), sds((3, pages), jnp.int32))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("rpb", [0, 8, 16, 48])
def test_paged_kernel_rejects_page_sizes_it_cannot_copy(rpb):
    from pallas_kernels.indexer.scores_sm90 import copy_rows

    with pytest.raises(ValueError, match="rows per page"):
        copy_rows(rpb)


def test_index_keys_are_passed_on_only_where_a_later_layer_reads_them():
    """``LayerInfo.shares_index_k``: V4.1-Flash's index sources 24–36 score against layer 20's keys (which must be
    carried to them); layers 2, 8 and 14 are their own indexers' only readers."""
    from dinfer_jax.models.config import load_config
    from dinfer_jax.models.layer_plan import layer_info

    for name, want in [("deepseek-v4.1-flash", {20}), ("tiny-v41", {6})]:
        cfg = load_config(name)
        assert {i for i in range(cfg.num_layers) if layer_info(cfg, i).shares_index_k} == want, name
