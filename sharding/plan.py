"""Per-device memory of each (dp, cp, ep) layout, from abstract shapes only (nothing is allocated).

For a model config and a device count, :func:`plan` lists every layout :func:`sharding.mesh.make_mesh` can build
on that many workers (``dp·cp = devices``, ``ep`` divides it, one of ``cp`` and ``ep`` divides the other) with:

* **weights**: per-device bytes of the native resident formats (``abstract_params(cfg, weights="native")``, MTP /
  DSpark blocks included): every array leaf (codes and block scales of quantised weights separately) split by the
  sharding rules' :func:`~sharding.rules.partition_spec` on that layout's mesh — routed experts over the EP group,
  everything the rules replicate (attention, embeddings, shared experts, ...) whole on every device.
* **KV**: one DP engine's pool on each of its devices (every CP rank keeps its engine's complete compressed KV and
  index keys for decode, ``docs/spec/engine.md`` §9): ``ceil(batch / dp)`` sequences of ``context`` tokens, paged at
  :func:`~dinfer_jax.engine.kv_cache.bytes_per_token` (DeepInfer's byte formats) in whole blocks plus the reserved
  null block, and one state slot (sliding-window and compressor rings, as this port stores them in ``ring_dtype``)
  per sequence plus the reserved null slot (``docs/spec/engine.md`` §12).
* **Engram**: host bytes of the release's Engram tables (FP8 E4M3 rows + one E8M0 scale per 32 columns), one
  memory-mapped copy per host.

A layout *fits* when weights + KV ≤ the HBM budget. Activations, compiled-program workspace and the runtime's own
reservation are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.engine.kv_cache import bytes_per_block_and_slot, bytes_per_token
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.params import ParamSpec, is_spec, param_specs
from sharding.mesh import mesh_shape
from sharding.rules import ShardingRules, num_shards, partition_spec

ENGRAM_SCALE_BLOCK = 32  # columns per E8M0 scale of a released Engram table row


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """Memory of one layout: bytes per device (weights, KV) and per host (Engram)."""

    dp: int
    cp: int
    ep: int
    weight_bytes: int
    kv_bytes: int
    engram_host_bytes: int
    seqs_per_engine: int
    hbm_bytes: int

    @property
    def device_bytes(self) -> int:
        """Weights + KV on one device."""
        return self.weight_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.hbm_bytes


def valid_layouts(devices: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, cp, ep)`` with ``dp·cp = devices`` that a mesh realises, in (dp, cp, ep) order."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    out = []
    for dp in range(1, devices + 1):
        if devices % dp:
            continue
        cp = devices // dp
        for ep in range(1, devices + 1):
            if devices % ep == 0 and (ep % cp == 0 or cp % ep == 0):
                out.append((dp, cp, ep))
    return out


def _leaf_bytes(x: Any) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def weight_bytes_per_device(cfg: ModelConfig, dp: int, cp: int, ep: int, rules: ShardingRules | None = None,
                            include_mtp: bool = True, dtype: Any = jnp.bfloat16) -> int:
    """Bytes of the native-format parameters one device holds under ``rules`` (default: the default rules) on the
    ``(dp, cp, ep)`` mesh."""
    sizes = mesh_shape(dp, cp, ep)
    rules = rules or ShardingRules()
    total = 0

    def add(spec: ParamSpec) -> None:
        nonlocal total
        for leaf in jax.tree_util.tree_leaves(spec.abstract(dtype, "native")):
            pieces = num_shards(partition_spec(rules, spec.axes, leaf.shape, sizes), sizes)
            total += _leaf_bytes(leaf) // pieces  # the rules only split dimensions the group size divides

    jax.tree_util.tree_map(add, param_specs(cfg, include_mtp), is_leaf=is_spec)
    return total


def kv_bytes_per_device(cfg: ModelConfig, context: int, seqs: int, block_size: int = 128,
                        ring_dtype: Any = jnp.bfloat16) -> int:
    """KV pool of ``seqs`` sequences of ``context`` tokens: paged blocks (+ the null block) at ``bytes_per_token``
    and state slots (+ the null slot) of ring bytes from the port's cache shapes."""
    if context < 0 or seqs < 0 or block_size < 1:
        raise ValueError(f"need context >= 0, seqs >= 0, block_size >= 1; got {context}, {seqs}, {block_size}")
    blocks = seqs * -(-context // block_size) + 1
    paged = math.ceil(blocks * block_size * bytes_per_token(cfg))
    _, per_slot = bytes_per_block_and_slot(cfg, block_size, ring_dtype)
    return paged + (seqs + 1) * per_slot


def engram_host_bytes(cfg: ModelConfig) -> int:
    """Host bytes of the released Engram tables: FP8 rows plus one E8M0 scale byte per 32 columns (0 without)."""
    rows, dim = sum(cfg.engram_num_embeddings), cfg.engram_head_dim
    return rows * dim + rows * -(-dim // ENGRAM_SCALE_BLOCK) if rows else 0


def plan(cfg: ModelConfig, devices: int, hbm_bytes: int, context: int, batch: int, *, block_size: int = 128,
         rules: ShardingRules | None = None, include_mtp: bool = True) -> list[LayoutPlan]:
    """One :class:`LayoutPlan` per valid layout of ``devices`` workers; ``batch`` sequences in all, split over
    the DP engines."""
    engram = engram_host_bytes(cfg)
    kv_cache: dict[int, int] = {}
    out = []
    for dp, cp, ep in valid_layouts(devices):
        seqs = -(-batch // dp)
        if seqs not in kv_cache:
            kv_cache[seqs] = kv_bytes_per_device(cfg, context, seqs, block_size)
        w = weight_bytes_per_device(cfg, dp, cp, ep, rules, include_mtp)
        out.append(LayoutPlan(dp, cp, ep, w, kv_cache[seqs], engram, seqs, hbm_bytes))
    return out


def format_table(rows: list[LayoutPlan], unit: float = 1e9) -> str:
    """A Markdown table of ``rows`` (bytes shown in GB of ``unit`` bytes)."""
    lines = ["| dp | cp | ep | seqs/engine | weights GB/dev | KV GB/dev | total GB/dev | Engram GB/host | fits |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for r in rows:
        lines.append(f"| {r.dp} | {r.cp} | {r.ep} | {r.seqs_per_engine} | {r.weight_bytes / unit:.2f} | "
                     f"{r.kv_bytes / unit:.2f} | {r.device_bytes / unit:.2f} | {r.engram_host_bytes / unit:.2f} | "
                     f"{'yes' if r.fits else '**NO**'} |")
    return "\n".join(lines)
