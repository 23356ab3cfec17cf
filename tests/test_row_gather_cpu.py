"""The in-kernel row gather of the decode-attention kernel (``pallas_kernels.attention.row_gather_sm90`` and
``decode_sm90.sparse_decode_attention_rows``) on CPU: the placement formula against Mosaic GPU's tiled + swizzled
layout written out independently, the wrapper's checks, and the kernel's lowering for CUDA.

What CPU cannot check: the ``cp.async`` copies are inline Mosaic GPU code, which the Mosaic GPU interpreter does not
run, so the kernel's result is tested on the GPU only (tests/test_decode_attention_rows_gpu.py: bit-equal to the
kernel on ``pool[rows]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.decode_sm90 import sparse_decode_attention_rows
from pallas_kernels.attention.row_gather_sm90 import (
    check_gather_shape,
    host_decode_fp4_unit,
    host_tile_image,
    producer_wait_pending,
    unit_offset,
)


def _mosaic_layout(block: np.ndarray, swizzle: int = 128) -> np.ndarray:
    """A ``[rows, cols]`` 2-byte block as Mosaic GPU stores it under ``TilingTransform((8, w))`` +
    ``SwizzleTransform(swizzle)`` (``w = swizzle / 2`` elements), written from the definitions: tiling makes the
    buffer ``[rows/8, cols/w, 8, w]`` (row-major); swizzling moves the 16-byte unit at unit address ``a`` (counted
    from the aligned base) to ``a XOR ((a // 8) mod (swizzle / 16))`` — its 128-byte chunk's index modulo the number
    of units a swizzle span holds, as Mosaic's ``transfer_tiled`` computes it (and the hardware's 128B / 64B modes:
    address bits 4-6 / 4-5 XOR bits 7-9 / 7-8). Returned as 16-byte units in address order."""
    rows, cols = block.shape
    w = swizzle // 2
    tiled = block.reshape(rows // 8, 8, cols // w, w).transpose(0, 2, 1, 3)      # [rt, ct, 8, w]
    units = tiled.reshape(-1, 8)                                                 # [unit address, 8 elements]
    out = np.empty_like(units)
    for a in range(units.shape[0]):
        out[a ^ ((a // 8) % (swizzle // 16))] = units[a]
    return out


@pytest.mark.parametrize("swizzle", [128, 64])
@pytest.mark.parametrize("rows,cols", [(64, 256), (64, 128), (64, 64), (128, 256), (8, 512), (32, 256)])
def test_placement_matches_mosaic_tiled_swizzled_layout(rows, cols, swizzle):
    block = np.arange(rows * cols, dtype=np.int32).astype(np.uint16).reshape(rows, cols)
    np.testing.assert_array_equal(host_tile_image(block, swizzle=swizzle), _mosaic_layout(block, swizzle))


@pytest.mark.parametrize("rows,swizzle", [(64, 128), (32, 64)])
def test_placement_is_a_bijection_onto_the_buffer(rows, swizzle):
    """Every 16-byte unit of a [rows, 256] tile gets exactly one destination inside the buffer: no piece lands on
    another and none outside."""
    offsets = [unit_offset(r, k, 256, swizzle=swizzle) for r in range(rows) for k in range(32)]
    assert sorted(offsets) == list(range(rows * 32))


def test_kernel_swizzle_rule():
    """The gather writes the tiles the kernel declares: 64-byte lines for 32-row steps, 128-byte ones otherwise."""
    from pallas_kernels.attention.decode_sm90 import kv_swizzle

    assert [kv_swizzle(b) for b in (32, 64, 96, 128)] == [64, 128, 64, 128]
    with pytest.raises(ValueError, match="swizzle must be"):
        unit_offset(0, 0, 256, swizzle=32)


def test_gather_shape_checks():
    check_gather_shape(64, 256)
    with pytest.raises(ValueError, match=r"whole \(8, 64\) tiles"):
        check_gather_shape(64, 96)
    check_gather_shape(32, 96, swizzle=64)
    with pytest.raises(ValueError, match=r"whole \(8, 32\) tiles"):
        check_gather_shape(32, 80, swizzle=64)
    with pytest.raises(ValueError, match="per thread"):
        check_gather_shape(8, 64)          # 64 units for 128 threads


S = jax.ShapeDtypeStruct


def _trace(n=4, h=64, d=512, length=640, pool_rows=4096, *, pool_dtype=jnp.bfloat16, rows_dtype=jnp.int32,
           window=0, **kw):
    """Traces the wrapper on abstract inputs: ``length`` rows per query, the first ``window`` of them from a
    window source."""
    def f(q, pool, rows, valid, sink, *win):
        return sparse_decode_attention_rows(q, pool, rows, valid, sink, scale=d ** -0.5,
                                            window=win[0] if win else None, **kw)

    win = (S((n, window, d), jnp.bfloat16),) if window else ()
    width = d // 2 + d // 16 if pool_dtype == jnp.uint8 else d          # uint8: v41_fp4 rows
    return jax.jit(f).trace(S((n, h, d), jnp.bfloat16), S((pool_rows, width), pool_dtype),
                            S((n, length - window), rows_dtype), S((n, length), jnp.bool_), S((h,), jnp.float32),
                            *win)


@pytest.mark.parametrize("n,h,d,length,kw", [
    (64, 64, 512, 640, {}),                                    # the real decode size
    (64, 64, 512, 640, dict(early_release=True)),              # the model's rule at 64 queries
    (1, 128, 512, 64, {}),                                     # two head blocks, one KV step
    (4, 64, 512, 256, dict(v_split=4, early_release=True)),
    (4, 64, 256, 640, dict(v_split=1, num_stages=3)),
    (4, 64, 256, 256, dict(block_kv=128, num_stages=1)),
    (4, 64, 128, 256, dict(v_split=1)),
    (64, 64, 512, 640, dict(window=128, early_release=True)),  # the model's layout: 128 window rows + top-k 512
    (4, 64, 512, 256, dict(window=64, num_stages=1)),          # a window step refilled in the loop
    (64, 64, 512, 640, dict(window=128, early_release=True, pool_dtype=jnp.uint8)),   # V4.1: v41_fp4 pool rows
    (64, 64, 512, 640, dict(block_kv=32, num_stages=4, early_release=True)),          # deeper copy pipeline
    (64, 64, 512, 640, dict(block_kv=32, num_stages=4, window=128, pool_dtype=jnp.uint8)),
    # V4.1's rows staged whole one step ahead, decoded from shared memory (with and without early release, 4 chunks)
    (64, 64, 512, 640, dict(block_kv=32, num_stages=4, window=128, early_release=True, pool_dtype=jnp.uint8,
                            fp4_prefetch=True)),
    (4, 64, 512, 640, dict(block_kv=32, num_stages=3, pool_dtype=jnp.uint8, fp4_prefetch=True)),
    (4, 64, 512, 256, dict(block_kv=32, num_stages=4, window=64, v_split=4, pool_dtype=jnp.uint8,
                           fp4_prefetch=True)),
    # few queries: shared_qk, each of l_split CTAs gathering its part of the rows (the model's rule at 1-8 queries)
    (1, 64, 512, 640, dict(organisation="shared_qk", l_split=10, window=128)),
    (8, 64, 512, 640, dict(organisation="shared_qk", l_split=10, window=128, pool_dtype=jnp.uint8)),
    (2, 64, 512, 640, dict(organisation="shared_qk", l_split=2, num_stages=1, window=128)),
    (4, 64, 512, 256, dict(organisation="shared_qk", num_stages=1, pool_dtype=jnp.uint8)),
    (4, 64, 512, 256, dict(v_split=4, pool_dtype=jnp.uint8)),
])
def test_gathered_kernel_lowers_for_cuda(n, h, d, length, kw):
    """Lowers for CUDA on this CPU-only machine (jax 0.10.2 here; 0.11.2 checked by hand): the inline Mosaic GPU
    code that issues, commits and waits for the ``cp.async`` copies (and decodes ``v41_fp4`` rows) is built into
    the kernel's module."""
    text = _trace(n, h, d, length, **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    copies = kw.get("pool_dtype") != jnp.uint8 or kw.get("window")    # fp4 pool rows are loaded, not copied
    for op in ("cp.async.shared.global",) * bool(copies) + ("cp.async.commit.group", "cp.async.wait.group"):
        assert op in text, op


def test_wrapper_rejects_bad_inputs():
    with pytest.raises(ValueError, match="pool must be"):
        jax.jit(lambda *a: sparse_decode_attention_rows(*a, scale=1.0)).trace(
            S((4, 64, 512), jnp.bfloat16), S((4096, 256), jnp.bfloat16), S((4, 640), jnp.int32),
            S((4, 640), jnp.bool_), S((64,), jnp.float32))
    with pytest.raises(ValueError, match="bf16 rows or uint8"):
        _trace(pool_dtype=jnp.float32)
    with pytest.raises(ValueError, match="integer row indices"):
        _trace(rows_dtype=jnp.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        _trace(block_kv=48)
    with pytest.raises(ValueError, match="dividing the window"):
        _trace(window=96)
    with pytest.raises(ValueError, match="shared memory"):
        _trace(num_stages=3)                                   # 3 × 128 KiB of stages do not fit


def test_fp4_unit_decode_is_the_formats_decode_for_every_code_and_scale():
    """The kernel's bit-level decode of a v41_fp4 unit (8 e2m1 codes + their e4m3 scale; ``host_decode_fp4_unit``
    runs the same formulas and bf16 products) against ``kv_formats.decode`` — the format's definition, computed in
    fp32 and rounded to bf16 — for all 16 codes in every position and every positive finite e4m3 scale byte
    (subnormal scales included): equal bit for bit."""
    from dinfer_jax.engine.kv_formats import decode

    codes = np.arange(16, dtype=np.uint32)
    words = [int(sum(((c + j) % 16) << (4 * j) for j in range(8))) for c in codes]      # every code, every slot
    scales = [b for b in range(1, 127) if b != 0x7F]                                   # positive, finite e4m3
    data = np.array([[w >> (8 * i) & 0xFF for i in range(4)] for w in words], np.uint8)  # little-endian bytes
    for b in scales:
        # one 16-value row per word: its 8 bytes are the word twice, one scale byte
        row_data = np.concatenate([data, data], axis=1)                                  # [16 words, 8 bytes]
        want = np.asarray(decode(jnp.asarray(row_data), jnp.full((16, 1), b, jnp.uint8), "v41_fp4",
                                 dtype=jnp.bfloat16).astype(jnp.float32))[:, :8]
        got = np.stack([host_decode_fp4_unit(w, b) for w in words])
        np.testing.assert_array_equal(got, want, err_msg=f"scale byte {b:#x}")


def _announced_before_landed(stages: int, kv_steps: int, pending: int) -> list[int]:
    """Steps the gathering producer would announce while some of their copies may still be in flight, simulating its
    loop as ``decode_sm90._produce_gathered`` runs it: the first ``stages`` steps issued and committed one group each;
    then per iteration ``i`` (one stage: refill with step ``i`` and commit first), ``cp.async.wait_group pending``
    (every group but the newest ``pending`` has landed), the announcement of step ``i``, and (several stages) the
    refill of step ``i − 1``'s stage with step ``i − 1 + stages`` (when it exists) in one more committed group."""
    groups: list[set[int]] = [{s} for s in range(stages)]   # committed groups, oldest first
    landed = 0                                    # groups 0 … landed − 1 have completed
    early = []
    for i in range(kv_steps):
        if stages == 1:
            groups.append({i} if i >= 1 else set())
        landed = max(landed, len(groups) - pending)
        if any(i in g for g in groups[landed:]):
            early.append(i)
        if stages > 1:
            groups.append({i - 1 + stages} if i >= 1 and i - 1 + stages < kv_steps else set())
    return early


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_gathering_producer_waits_for_each_step_before_announcing_it(stages):
    """The wait count the kernel uses (``producer_wait_pending``) covers every step at every length; one more pending
    group — the count the first H100 run used, ``stages − 1`` — announces steps early (the race it measured)."""
    for kv_steps in range(stages, 13):      # check_config caps the stages at the number of steps
        assert _announced_before_landed(stages, kv_steps, producer_wait_pending(stages)) == []
    if stages > 1:
        assert _announced_before_landed(stages, 10, stages - 1) != []


def _prefetch_violations(stages: int, kv_steps: int, window_steps: int, pending: int = 1,
                         buffers: int = 2) -> list[str]:
    """What would go wrong in the FP4 prefetching producer, simulating ``decode_sm90._produce_fp4_prefetch``'s order:
    one group with the window's copies, one with step ``W``'s staged rows, announcement of the window's steps after
    ``wait_group(pending)``; then per iteration ``t``: stage step ``t + 1``'s rows into buffer ``(t + 1) mod buffers``
    and commit, ``wait_group(pending)``, decode step ``t`` from buffer ``t mod buffers``, announce. Violations: a
    step announced or decoded before its copies landed, or a staging buffer overwritten before its rows were
    decoded."""
    groups: list[set] = [{("window", i) for i in range(window_steps)},
                         {("rows", window_steps)} if window_steps < kv_steps else set()]
    landed = 0
    holds: dict[int, int] = {}           # staging buffer -> step whose rows it holds until decoded
    if window_steps < kv_steps:
        holds[window_steps % buffers] = window_steps
    bad = []
    if window_steps:
        landed = max(landed, len(groups) - pending)
        bad += [f"window step {i} announced in flight" for i in range(window_steps)
                if any(("window", i) in g for g in groups[landed:])]
    for t in range(window_steps, kv_steps):
        if t + 1 < kv_steps:
            if (t + 1) % buffers in holds:
                bad.append(f"step {t + 1} staged over step {holds[(t + 1) % buffers]}'s undecoded rows")
            holds[(t + 1) % buffers] = t + 1
        groups.append({("rows", t + 1)} if t + 1 < kv_steps else set())
        landed = max(landed, len(groups) - pending)
        if any(("rows", t) in g for g in groups[landed:]):
            bad.append(f"step {t} decoded before its rows landed")
        if holds.get(t % buffers) != t:
            bad.append(f"step {t} decoded from a buffer holding step {holds.get(t % buffers)}")
        holds.pop(t % buffers, None)
    return bad


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_fp4_prefetching_producer_order(stages):
    """The prefetching producer's order (``wait_group(1)`` with two staging buffers) at every length and every window
    that fits the stages: no step decoded before its rows landed, no buffer overwritten early; a wait for one more
    pending group, or a single buffer, breaks it (so the simulation can fail)."""
    for kv_steps in range(stages, 13):
        for window_steps in range(stages + 1):
            assert _prefetch_violations(stages, kv_steps, window_steps) == [], (kv_steps, window_steps)
    assert _prefetch_violations(stages, 10, 0, pending=2) != []
    assert _prefetch_violations(stages, 10, 0, buffers=1) != []


def test_fp4_prefetch_wrapper_checks():
    with pytest.raises(ValueError, match="must be uint8 v41_fp4"):
        _trace(block_kv=32, num_stages=4, fp4_prefetch=True)
    with pytest.raises(ValueError, match="must fit the 3 stages"):
        _trace(n=64, block_kv=32, num_stages=3, window=128, pool_dtype=jnp.uint8, fp4_prefetch=True)
    with pytest.raises(ValueError, match="shared memory"):
        _trace(block_kv=64, num_stages=2, pool_dtype=jnp.uint8, fp4_prefetch=True)   # 2 × 18 KiB of staging


def test_shared_qk_gather_wrapper_checks():
    """The gathering form of shared_qk: one stage per CTA (two do not fit beside the row indices at d = 512, which the
    model's rule never asks for: its L split leaves one KV step per CTA), no FP4 staging, and the register split
    fits the pool the CTA is launched with: 384 threads get 168 registers each (65536 / 384 = 170.7, rounded down to
    a multiple of 8), so the three warpgroups' setmaxnreg counts may sum to at most 3 · 168 = 504 (more, and the
    consumers' "increase" waits forever: 232 + 232 + 48 hung on an H100)."""
    from pallas_kernels.attention.decode_sm90 import (
        SHARED_QK_COMPUTE_REGISTERS,
        SHARED_QK_CONSUMERS,
        SHARED_QK_GATHER_REGISTERS,
    )

    assert SHARED_QK_CONSUMERS == 2
    assert SHARED_QK_CONSUMERS * SHARED_QK_COMPUTE_REGISTERS + SHARED_QK_GATHER_REGISTERS <= 3 * 168
    assert SHARED_QK_GATHER_REGISTERS % 8 == 0 and SHARED_QK_GATHER_REGISTERS >= 24    # setmaxnreg's rule
    with pytest.raises(ValueError, match="shared memory"):
        _trace(n=2, organisation="shared_qk", l_split=2, num_stages=2)
    with pytest.raises(ValueError, match="split_cta producer"):
        _trace(block_kv=32, num_stages=4, pool_dtype=jnp.uint8, fp4_prefetch=True, organisation="shared_qk")
    with pytest.raises(ValueError, match="organisation must be"):
        _trace(organisation="pingpong")
    with pytest.raises(ValueError, match="must divide"):
        _trace(organisation="shared_qk", l_split=3, num_stages=1)


def test_raw_row_copy_split():
    """Whole 288-byte rows in 16-byte units over 128 threads: 32 rows = 576 units (5 passes, the last clamped), 64
    rows = 1152 (9 passes); rows that are not whole units are refused."""
    from pallas_kernels.attention.row_gather_sm90 import raw_copy_units

    assert raw_copy_units(32, 288) == (576, 5)
    assert raw_copy_units(64, 288) == (1152, 9)
    with pytest.raises(ValueError, match="16-byte units"):
        raw_copy_units(32, 68)


@pytest.mark.parametrize("pool_dtype,window", [(jnp.bfloat16, 128), (jnp.uint8, 128), (jnp.bfloat16, 100)])
def test_model_pooled_path_lowers_for_cuda(pool_dtype, window):
    """The model's call of the gathering kernel (``attention.attend_selected_pooled``: per-query windows padded to 64
    rows, the selected rows' indices padded to a multiple of 64, masks, the kernel through ``kernel_call``) lowers
    for CUDA at V4-Flash's width with a bf16 pool (V4) and ``v41_fp4`` rows (V4.1), and with a window that needs
    padding; its numbers are checked on the GPU (tests/test_decode_attention_rows_gpu.py)."""
    from dinfer_jax.models.attention import attend_selected_pooled

    b, s, h, d, k = 16, 1, 64, 512, 512
    width = d // 2 + d // 16 if pool_dtype == jnp.uint8 else d
    traced = jax.jit(attend_selected_pooled).trace(
        S((b, s, h, d), jnp.bfloat16), S((b, s, window, d), jnp.bfloat16), S((b, s, window), jnp.bool_),
        S((8192, width), pool_dtype), S((b, s, k), jnp.int32), S((b, s, k), jnp.bool_), S((h,), jnp.float32))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n", [1, 8, 9, 64, 66, 67, 384])
def test_model_gather_options_are_valid_kernel_configs(n):
    """The model's rule for the gathering kernel (``tuning.gather_options``) gives options the kernel accepts at every
    query count: early release (which needs v_split ≥ 2 and split_cta) from ``SMALL_N_MAX`` + 1 queries, except bf16
    pools above ``SPLIT_CTA_MAX`` queries, which take ``shared_qk`` (one CTA a query, one stage)."""
    from pallas_kernels.attention.tuning import SMALL_N_MAX, SPLIT_CTA_MAX, gather_options

    for stored, pool_dtype in (("bf16", jnp.bfloat16), ("v41_fp4", jnp.uint8)):
        for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
            options = gather_options(n, stored, kind)
            many = stored == "bf16" and n > SPLIT_CTA_MAX
            assert options.get("organisation", "split_cta") == ("shared_qk" if many else "split_cta")
            assert options.get("early_release", False) == (n > SMALL_N_MAX and not many)
            # 32-row steps only where measured faster: bf16 pools from SMALL_N_MAX + 1 to SPLIT_CTA_MAX queries on an
            # H100
            assert options.get("block_kv", 64) == (32 if stored == "bf16" and n > SMALL_N_MAX and not many
                                                   and "H100" in kind else 64)
            text = _trace(n, 64, 512, 640, window=128, pool_dtype=pool_dtype, **options).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="n_queries > 0"):
        gather_options(0)
    with pytest.raises(ValueError, match="stored must be"):
        gather_options(4, "fp8")
