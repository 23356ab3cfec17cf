"""Engram line tables and the gather kernel's pieces that run on CPU (``pallas_kernels/engram``): the line layout of
every Engram table format, the host view's bytes against NumPy's own byte order, the row cut and bit cast against
NumPy indexing, the kernel's input checks, and the kernel lowered for CUDA with a pinned-host table. Whether the
kernel reads the right rows on a GPU, from device and from pinned host memory, is
tests/test_engram_gather_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.engram import reference as ref
from pallas_kernels.engram.gather_sm90 import check_inputs, gather_lines


@pytest.mark.parametrize("row_bytes,want", [(256, (2, 128)), (8, (64, 128)), (1024, (1, 256)), (512, (1, 128)),
                                            (1, (512, 128)), (32, (16, 128))])
def test_line_layout_of_the_table_formats(row_bytes, want):
    """E4M3 codes (256 B), UE8M0 scales (8 B), fp32 rows (1 KiB), bf16 rows (512 B), the tiny test model's one
    scale byte and 32 codes."""
    layout = ref.line_layout(row_bytes)
    assert (layout.rows_per_line, layout.line_words) == want


@pytest.mark.parametrize("row_bytes", [0, 6, 12, 640])
def test_rows_that_fit_no_line_are_refused(row_bytes):
    with pytest.raises(ValueError, match="line"):
        ref.line_layout(row_bytes)


def _fp8_table(rows: int, width: int, seed: int = 0) -> np.ndarray:
    codes = np.random.default_rng(seed).integers(0, 256, size=(rows, width), dtype=np.uint8)
    codes[codes & 0x7F == 0x7F] = 0   # no NaN codes: the comparison below is by value as well
    return codes.view(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("rows", [64, 67])
def test_line_table_holds_the_stored_bytes_in_order(rows):
    """The line table is the table's bytes, in order, with whole zero rows appended to fill the last line; a view
    (no copy) when the rows fill whole lines."""
    table = _fp8_table(rows, 256)
    lines = ref.to_lines(table)
    assert lines.dtype == np.int32 and lines.shape == ref.line_table_shape(table.shape, table.dtype)
    flat = lines.reshape(-1).view(np.uint8)
    np.testing.assert_array_equal(flat[:table.nbytes], table.view(np.uint8).reshape(-1))
    assert not flat[table.nbytes:].any()
    assert np.shares_memory(lines, table) == (rows % 2 == 0)


@pytest.mark.parametrize("dtype,width", [(ml_dtypes.float8_e4m3fn, 256), (ml_dtypes.float8_e8m0fnu, 8),
                                         (np.float32, 256), (ml_dtypes.bfloat16, 256),
                                         (ml_dtypes.float8_e8m0fnu, 1)])
def test_gather_cut_and_bit_cast_give_the_rows(dtype, width):
    """Reference gather → row cut → bit cast = NumPy's ``table[ids]``, bit for bit (ids at line edges, repeats)."""
    rng = np.random.default_rng(width)
    rows = 1301   # more than one line of the smallest rows (512 per line)
    raw = rng.integers(0, 256, size=(rows, width * np.dtype(dtype).itemsize), dtype=np.uint8)
    if dtype == ml_dtypes.float8_e4m3fn:
        raw[raw & 0x7F == 0x7F] = 0
    table = raw.view(dtype)
    layout = ref.line_layout(table.shape[1] * table.dtype.itemsize)
    ids = np.concatenate([[0, rows - 1, layout.rows_per_line - 1, layout.rows_per_line, 5, 5],
                          rng.integers(0, rows, size=200)]).astype(np.int32)

    @jax.jit
    def rows_of(lines, ids):
        got = ref.gather_lines_ref(lines, ids // layout.rows_per_line)
        return ref.from_words(ref.select_rows(got, ids, layout), jnp.dtype(dtype), width)

    got = np.asarray(rows_of(jnp.asarray(ref.to_lines(table)), jnp.asarray(ids)))
    assert got.dtype == table.dtype
    np.testing.assert_array_equal(got.view(np.uint8), table[ids].view(np.uint8))


def test_kernel_inputs_are_checked():
    with pytest.raises(ValueError, match="line table"):
        check_inputs(jnp.zeros((4, 66), jnp.int32), jnp.zeros((3,), jnp.int32), 8)
    with pytest.raises(ValueError, match="line table"):
        check_inputs(jnp.zeros((4, 128), jnp.float32), jnp.zeros((3,), jnp.int32), 8)
    with pytest.raises(ValueError, match="line ids"):
        check_inputs(jnp.zeros((4, 128), jnp.int32), jnp.zeros((3, 1), jnp.int32), 8)
    with pytest.raises(ValueError, match="group"):
        check_inputs(jnp.zeros((4, 128), jnp.int32), jnp.zeros((3,), jnp.int32), 0)


@pytest.mark.parametrize("width,n", [(128, 1536), (256, 5)])
def test_kernel_lowers_for_cuda_on_a_pinned_host_table(width, n):
    """The Pallas → Mosaic GPU lowering runs for CUDA on this CPU-only machine with the table in pinned host
    memory: one Mosaic GPU custom call, and the table reaches it as the program's pinned-host argument."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    table = jax.ShapeDtypeStruct((1000, width), jnp.int32, sharding=host)
    ids = jax.ShapeDtypeStruct((n,), jnp.int32)
    text = jax.jit(gather_lines).trace(table, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert '"pinned_host"' in text
