"""Line tables for the Engram gather kernel, and the kernel's pure-``jnp`` reference.

A Mosaic GPU warpgroup loads a row of a table into registers in one vector load only when the row holds a multiple
of 128 elements (one or more per thread). Engram rows are not that shape: a release-format row is 256 E4M3 codes
(64 int32 words) and 8 UE8M0 scales (2 words). So each table is viewed, bytes unchanged, as a **line table**:
int32 ``[lines, line_words]`` with lines of 512 bytes (128 words) holding ``rows_per_line = 512 // row_bytes``
consecutive rows, or, for rows of one or more whole lines, one row per line. Row ``r`` lies in line ``r //
rows_per_line`` at byte ``(r % rows_per_line) · row_bytes``. The kernel gathers whole lines; the row is cut out of
its line and bit-cast back to its dtype afterwards, on the device (:func:`select_rows`, :func:`from_words`).

The view costs no host memory when the row count divides evenly (``numpy`` views of the stored, possibly
memory-mapped, arrays) and reads at most ``line_words · 4`` bytes per row: 512 B for a 256 B code row, 512 B for an
8 B scale row — the price of one aligned vector load per row, small next to a step's other traffic (1536 rows a
batch-64 V4.1 decode step per Engram layer: 1.5 MB).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LINE_WORDS", "LineLayout", "from_words", "gather_lines_ref", "line_layout", "line_table_shape",
           "select_rows", "to_lines"]

LINE_WORDS = 128  # one int32 per thread of a warpgroup


LINE_BYTES = 4 * LINE_WORDS


@dataclasses.dataclass(frozen=True)
class LineLayout:
    """How rows of ``row_bytes`` bytes sit in lines of ``line_words`` int32 words (``rows_per_line`` rows each)."""

    row_bytes: int
    rows_per_line: int
    line_words: int


def line_layout(row_bytes: int) -> LineLayout:
    """The line layout for rows of ``row_bytes`` bytes. ValueError unless a row divides a 512-byte line or is a
    whole number of them (every Engram table format: 256 E4M3 codes, 8 UE8M0 scales, 256 bf16 or fp32 values, and
    the small test models' rows)."""
    if row_bytes <= 0:
        raise ValueError(f"a line-table row must have a positive size, got {row_bytes} bytes")
    if row_bytes <= LINE_BYTES:
        if LINE_BYTES % row_bytes:
            raise ValueError(f"a row of {row_bytes} bytes does not divide a {LINE_BYTES}-byte line")
        return LineLayout(row_bytes, LINE_BYTES // row_bytes, LINE_WORDS)
    if row_bytes % LINE_BYTES:
        raise ValueError(f"a row of {row_bytes} bytes is not a whole number of {LINE_BYTES}-byte lines")
    return LineLayout(row_bytes, 1, row_bytes // 4)


def _row_bytes(table_shape: tuple[int, ...], itemsize: int) -> int:
    return int(np.prod(table_shape[1:], dtype=np.int64)) * itemsize


def line_table_shape(table_shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, int]:
    """Shape of the line table of a ``[rows, ...]`` table of ``dtype``."""
    layout = line_layout(_row_bytes(table_shape, np.dtype(dtype).itemsize))
    return -(-table_shape[0] // layout.rows_per_line), layout.line_words


def to_lines(table: np.ndarray) -> np.ndarray:
    """``[rows, ...]`` table (any dtype, e.g. memory-mapped E4M3 codes) → its int32 line table ``[lines,
    line_words]``, the same bytes in the same order (a view when ``rows`` is a multiple of ``rows_per_line``;
    otherwise a copy with zero rows appended)."""
    rows = table.shape[0]
    layout = line_layout(_row_bytes(table.shape, table.dtype.itemsize))
    data = np.ascontiguousarray(table).reshape(rows, -1).view(np.uint8)                 # [rows, row_bytes]
    pad = -rows % layout.rows_per_line
    if pad:
        data = np.concatenate([data, np.zeros((pad, layout.row_bytes), np.uint8)])
    return data.reshape(-1, 4 * layout.line_words).view(np.int32)


def gather_lines_ref(lines: jax.Array, line_ids: jax.Array) -> jax.Array:
    """The kernel's contract: ``lines[line_ids]``, int32 ``[N, line_words]`` for in-range ``line_ids [N]``."""
    return jnp.take(lines, line_ids, axis=0, mode="clip")


def select_rows(gathered: jax.Array, row_ids: jax.Array, layout: LineLayout) -> jax.Array:
    """Cut each row out of its gathered line: ``[N, line_words]`` int32 and the rows' ids ``[N]`` → the rows'
    bytes ``[N, row_bytes]`` uint8 (little-endian, as the host views the stored bytes)."""
    data = jax.lax.bitcast_convert_type(gathered, jnp.uint8).reshape(gathered.shape[0], -1)   # [N, line bytes]
    if layout.rows_per_line == 1:
        return data
    k = layout.rows_per_line
    slots = data.reshape(data.shape[0], k, layout.row_bytes)
    return jnp.take_along_axis(slots, (row_ids % k)[:, None, None], axis=1)[:, 0]


def from_words(data: jax.Array, dtype: jnp.dtype, width: int) -> jax.Array:
    """Rows' bytes ``[N, width · itemsize]`` uint8 → the rows ``[N, width]`` of ``dtype`` (a bit cast)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(data, dtype)
    return jax.lax.bitcast_convert_type(data.reshape(data.shape[0], width, dtype.itemsize), dtype)
