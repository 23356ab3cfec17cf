"""V4.1 Engram lookups inside the compiled step: the n-gram hash in 32-bit integer arithmetic and the table gather,
with the tables in device memory or in pinned host memory. No host callback: the step never waits for Python.

The host reference is :func:`dinfer_jax.models.engram.engram_hash` (int64 numpy). The device has no 64-bit
integers (x64 stays off), so each 63-bit product ``token · multiplier`` is built from 16-bit limbs as a (hi, lo)
pair of uint32, the pairs are XOR-ed, and ``h mod P`` is Horner's rule over the eight bytes of ``h`` (``r ← (256·r +
byte) mod P`` stays below 2^32 while ``P < 2^24``; the released tables' primes lie just above 16,000,000 < 2^24).
The result is bit-identical to the int64 hash (tested over the full id range).

Placement (``where``):

* ``"device"``: codes and scales are device arrays; the gather is an ordinary XLA gather.
* ``"host"``: codes and scales live in pinned host memory (``memory_kind="pinned_host"``); the row ids move to the
  host, the gather runs there inside the same program (``compute_on("device_host")``, XLA host offloading) and only
  the gathered rows come back. The table never crosses to the device, but the device waits for the host gather.
* ``"host-direct"``: codes and scales live in pinned host memory as int32 line tables (the stored bytes, viewed;
  :mod:`pallas_kernels.engram.reference`), and a Mosaic GPU kernel on the device reads the rows it needs over
  PCIe (:mod:`pallas_kernels.engram.gather_sm90`; DeepInfer's ``EngramBuffer``). No host computation: the step
  stays on the device. GPU only.

FP8 tables (release format: E4M3 codes + UE8M0 scale per 32 columns) stay FP8 in memory and are decoded after the
gather (exact in fp32), so a gathered row moves as ``head_dim + head_dim/32`` bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.engram import SCALE_BLOCK, EngramTable, engram_layout

__all__ = ["ENGRAM_PLACEMENTS", "LINE_GATHERS", "EngramLookup", "EngramState", "EngramTables", "abstract_state",
           "device_hash", "place_tables"]

ENGRAM_PLACEMENTS = ("device", "host", "host-direct")
LINE_GATHERS = ("kernel", "reference")
_U32 = jnp.uint32
_MAX_PRIME = (2**32 - 256) // 256  # 256·r + 255 < 2^32 for every r < P ≤ this


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngramTables:
    """One entry per Engram layer (``engram_layer_ids`` order): ``codes [rows, head_dim]`` (float8_e4m3fn, or a
    float dtype for HF-format tables) and ``scales [rows, head_dim/32]`` float8_e8m0fnu (None for float tables).

    Line tables (placement ``"host-direct"``) hold each as its int32 line table instead and name the stored dtypes
    in ``row_dtypes`` (static): ``(codes dtype, scales dtype or None)`` per table; empty for row tables."""

    codes: tuple[jax.Array, ...]
    scales: tuple[jax.Array | None, ...]
    row_dtypes: tuple[tuple[str, str | None], ...] = dataclasses.field(default=(), metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngramState:
    """What a compiled step reads for Engram: the raw → compressed id map ``cmap [vocab]`` int32 and the tables."""

    cmap: jax.Array
    tables: EngramTables


def _mul_u32_u64(t: jax.Array, m_hi: jax.Array, m_lo: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``t · (m_hi·2^32 + m_lo)`` mod 2^64 as (hi, lo) uint32, for uint32 ``t`` (16-bit limbs: no partial product
    exceeds 2^32)."""
    t0, t1 = t & 0xFFFF, t >> 16
    m0, m1 = m_lo & 0xFFFF, m_lo >> 16
    p00, p01, p10, p11 = t0 * m0, t0 * m1, t1 * m0, t1 * m1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(_U32)  # the 2^32 that wrapped sits at bit 48 of the product
    lo = p00 + (mid << 16)
    lo_carry = (lo < p00).astype(_U32)
    hi = p11 + (mid >> 16) + (mid_carry << 16) + lo_carry + t * m_hi
    return hi, lo


def _mod_u64(hi: jax.Array, lo: jax.Array, p: jax.Array) -> jax.Array:
    """``(hi·2^32 + lo) mod p`` for uint32 ``p ≤ _MAX_PRIME`` (Horner over the eight bytes, most significant first)."""
    r = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), _U32)
    for word in (hi, lo):
        for shift in (24, 16, 8, 0):
            r = (r * 256 + ((word >> shift) & 0xFF)) % p
    return r


def device_hash(cfg: ModelConfig, ngram_ids: jax.Array) -> jax.Array:
    """Table row ids int32 ``[L, ..., (M−1)·n_heads]`` of compressed n-gram rows ``[..., M]`` — the same values as
    :func:`~dinfer_jax.models.engram.engram_hash`, computed without 64-bit integers. Ids must lie in
    ``[0, engram_compressed_vocab_size)`` (the step's rows come from the compressed map, so they do)."""
    mult, primes, offsets = engram_layout(cfg)
    if int(primes.max()) > _MAX_PRIME:
        raise ValueError(f"Engram table sizes up to {int(primes.max())} exceed the 32-bit device hash's limit "
                         f"{_MAX_PRIME}")
    if int(offsets.max() + primes.reshape(primes.shape[0], -1).max()) >= 2**31:
        raise ValueError("Engram tables of 2^31 rows or more need 64-bit row ids")
    L, M = mult.shape
    lead = ngram_ids.shape[:-1]
    tok = ngram_ids.reshape(1, -1, M).astype(_U32)                                    # [1, T, M]
    m = mult.astype(np.uint64)
    m_hi = jnp.asarray((m >> np.uint64(32)).astype(np.uint32))[:, None, :]           # [L, 1, M]
    m_lo = jnp.asarray((m & np.uint64(0xFFFFFFFF)).astype(np.uint32))[:, None, :]
    hi, lo = _mul_u32_u64(tok, m_hi, m_lo)                                            # [L, T, M]
    h_hi, h_lo = hi[:, :, 0], lo[:, :, 0]
    cols = []
    for n in range(1, M):
        h_hi, h_lo = h_hi ^ hi[:, :, n], h_lo ^ lo[:, :, n]
        p = jnp.asarray(primes[:, n - 1, :].astype(np.uint32))[:, None, :]            # [L, 1, n_heads]
        cols.append(_mod_u64(h_hi[:, :, None], h_lo[:, :, None], p))
    ids = jnp.concatenate(cols, axis=-1).astype(jnp.int32) + jnp.asarray(offsets.astype(np.int32))[:, None, :]
    return ids.reshape((L, *lead, ids.shape[-1]))


def _gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` ``[..., head_dim]`` for in-range ids, as one plain gather (no bounds-check ops, which the host
    computation could not mix with device constants)."""
    flat = ids.reshape(-1, 1)
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    rows = jax.lax.gather(table, flat, dn, slice_sizes=(1, table.shape[1]),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return rows.reshape((*ids.shape, table.shape[1]))


def _decode(codes: jax.Array, scales: jax.Array | None) -> jax.Array:
    """Gathered rows → float32: E4M3 codes times their UE8M0 block scales (exact), or a float table as stored."""
    values = codes.astype(jnp.float32)
    if scales is None:
        return values
    blocks = values.reshape(*values.shape[:-1], -1, SCALE_BLOCK) * scales.astype(jnp.float32)[..., None]
    return blocks.reshape(values.shape)


def _gather_table(codes: jax.Array, scales: jax.Array | None, ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    return _gather_rows(codes, ids), (None if scales is None else _gather_rows(scales, ids))


def _on_host(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` computed on the host inside the step (XLA host offloading), outputs in host memory. jax 0.10
    names the function form ``compute_on2``; jax 0.11 gives that form the name ``compute_on`` (0.10's
    ``compute_on`` is a context manager)."""
    from jax.experimental import compute_on as offload

    transform = getattr(offload, "compute_on2", None) or offload.compute_on
    return transform(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)


def _gather_line_rows(lines: jax.Array, ids: jax.Array, dtype: str, width: int, line_gather: str) -> jax.Array:
    """Rows ``ids [...]`` of a line table → ``[..., width]`` of ``dtype``: whole lines gathered by the Mosaic GPU
    kernel (or its reference), each row cut out of its line and bit-cast back."""
    from pallas_kernels.engram import reference as lines_ref

    layout = lines_ref.line_layout(width * jnp.dtype(dtype).itemsize)
    flat = ids.reshape(-1)
    line_ids = flat // layout.rows_per_line
    if line_gather == "kernel":
        from pallas_kernels.engram.gather_sm90 import gather_lines

        gathered = gather_lines(lines, line_ids)
    else:
        gathered = lines_ref.gather_lines_ref(lines, line_ids)
    data = lines_ref.select_rows(gathered, flat, layout)
    return lines_ref.from_words(data, dtype, width).reshape(*ids.shape, width)


@dataclasses.dataclass(frozen=True)
class EngramLookup:
    """The compiled step's Engram lookup (a static argument: hashable by value, so engines over one config share
    compiled steps). ``placement``: where the tables are and who gathers them (:data:`ENGRAM_PLACEMENTS`, module
    docstring). ``line_gather`` (``"host-direct"`` only): ``"kernel"``, the Mosaic GPU kernel, or ``"reference"``,
    its ``jnp`` contract (for CPU tests of everything around the kernel, with line tables in device memory)."""

    cfg: ModelConfig
    placement: str = "device"
    line_gather: str = "kernel"

    def __post_init__(self) -> None:
        if self.placement not in ENGRAM_PLACEMENTS:
            raise ValueError(f"Engram placement must be one of {ENGRAM_PLACEMENTS}, got {self.placement!r}")
        if self.line_gather not in LINE_GATHERS:
            raise ValueError(f"line_gather must be one of {LINE_GATHERS}, got {self.line_gather!r}")

    def __call__(self, tables: EngramTables, rows: jax.Array) -> jax.Array:
        """Compressed n-gram rows ``[B, Q, M]`` int32 → Engram rows ``[n_engram, B, Q, (M−1)·n_heads·head_dim]``
        float32."""
        ids = device_hash(self.cfg, rows)                                             # [L, B, Q, H]
        head_dim = self.cfg.engram_head_dim
        if self.placement == "host-direct" and len(tables.row_dtypes) != len(tables.codes):
            raise ValueError("placement 'host-direct' reads line tables (place_tables(..., 'host-direct'))")
        out = []
        for i, (codes, scales) in enumerate(zip(tables.codes, tables.scales, strict=True)):
            if self.placement == "host":
                host_ids = jax.device_put(ids[i], jax.memory.Space.Host)
                c, s = _on_host(_gather_table, codes, scales, host_ids)
                c = jax.device_put(c, jax.memory.Space.Device)
                s = None if s is None else jax.device_put(s, jax.memory.Space.Device)
            elif self.placement == "host-direct":
                code_dtype, scale_dtype = tables.row_dtypes[i]
                c = _gather_line_rows(codes, ids[i], code_dtype, head_dim, self.line_gather)
                s = (None if scale_dtype is None
                     else _gather_line_rows(scales, ids[i], scale_dtype, head_dim // SCALE_BLOCK, self.line_gather))
            else:
                c = _gather_rows(codes, ids[i])
                s = None if scales is None else _gather_rows(scales, ids[i])
            v = _decode(c, s)                                                         # [B, Q, H, head_dim]
            out.append(v.reshape(*v.shape[:-2], -1))
        return jnp.stack(out)


def place_tables(tables: Sequence[EngramTable], where: str, sharding: Any = None) -> EngramTables:
    """Copy host tables (memory-mapped or in RAM) into device memory (``where="device"``) or pinned host memory
    (``"host"``), in their stored formats, or into pinned host memory as line tables (``"host-direct"``: the same
    bytes viewed as int32 lines, :func:`pallas_kernels.engram.reference.to_lines`). ``sharding``: a sharding to
    place each array with (its memory kind is set from ``where``). Default: device tables go to the default device
    uncommitted, like the engine's other one-device state (a committed argument makes a jitted step's outputs
    committed, and feeding those back would compile every step a second time); host tables are committed to the
    first local device (a memory kind needs a sharding)."""
    if where not in ENGRAM_PLACEMENTS:
        raise ValueError(f"Engram table placement must be one of {ENGRAM_PLACEMENTS}, got {where!r}")
    if sharding is None and where == "device":
        return EngramTables(tuple(jnp.asarray(t.weight) for t in tables),
                            tuple(None if t.scale is None else jnp.asarray(t.scale) for t in tables))
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    sharding = sharding.with_memory_kind("device" if where == "device" else "pinned_host")
    return _put_tables(tables, sharding, lines=where == "host-direct")


def _put_tables(tables: Sequence[EngramTable], sharding: Any, lines: bool) -> EngramTables:
    """Each table's codes and scales put with ``sharding``: as stored, or as int32 line tables (``lines``)."""
    from pallas_kernels.engram.reference import to_lines

    def put(a: np.ndarray | None) -> jax.Array | None:
        if a is None:
            return None
        return jax.device_put(to_lines(a) if lines else np.asarray(a), sharding)

    codes = tuple(put(t.weight) for t in tables)
    scales = tuple(put(t.scale) for t in tables)
    if not lines:
        return EngramTables(codes, scales)
    dtypes = tuple((np.dtype(t.weight.dtype).name, None if t.scale is None else np.dtype(t.scale.dtype).name)
                   for t in tables)
    return EngramTables(codes, scales, dtypes)


def abstract_state(cfg: ModelConfig, release_format: bool = True, where: str = "device") -> EngramState:
    """Shapes and dtypes of the :class:`EngramState` a step reads for ``cfg`` (``jax.ShapeDtypeStruct`` leaves), to
    lower and compile steps without building tables. ``release_format``: FP8 codes + UE8M0 scales, else fp32 rows;
    ``where="host-direct"``: their line tables (memory kinds are not set: lowering for shapes only)."""
    from pallas_kernels.engram.reference import line_table_shape

    sds = jax.ShapeDtypeStruct
    rows = cfg.engram_num_embeddings
    scale_width = cfg.engram_head_dim // SCALE_BLOCK
    code_dtype, scale_dtype = ((jnp.float8_e4m3fn, jnp.float8_e8m0fnu) if release_format else (jnp.float32, None))
    codes = tuple(sds((r, cfg.engram_head_dim), code_dtype) for r in rows)
    scales = tuple(None if scale_dtype is None else sds((r, scale_width), scale_dtype) for r in rows)
    if where == "host-direct":
        def lines(a: Any) -> Any:
            return None if a is None else sds(line_table_shape(a.shape, a.dtype), jnp.int32)

        dtypes = tuple((np.dtype(code_dtype).name, None if scale_dtype is None else np.dtype(scale_dtype).name)
                       for _ in rows)
        return EngramState(sds((cfg.vocab_size,), jnp.int32),
                           EngramTables(tuple(map(lines, codes)), tuple(map(lines, scales)), dtypes))
    return EngramState(sds((cfg.vocab_size,), jnp.int32), EngramTables(codes, scales))
