"""Grouping of backbone layers for ``jax.lax.scan``: static per-layer facts, the scan plan, stacked parameters.

Layers differ by kind (V4: sliding / CSA / HCA and hash routing; V4.1: compress ratio, KV / index / candidate source
roles, Engram, DSpark targets, the YOCO region). Each layer gets a :class:`LayerInfo` (the static facts its math
branches on) and a signature (info plus the shapes and dtypes of its parameter leaves). :func:`plan_layers` splits
the signature sequence greedily into :class:`LayerGroup` runs: a *period* of consecutive layers (a "super-layer"
of possibly different kinds) repeated ``repeats`` times. The model step runs each group as one ``lax.scan`` over
its repeats whose body unrolls the period, so compiled code grows with the number of distinct periods, not with
depth (V4-Flash: ``[sliding+hash]×2, [CSA+hash]×1, [HCA, CSA]×20``).

Parameters keep the checkpoint layout (``params["layers"][i]``, one dict per layer, as :func:`param_specs`
declares them); :func:`stack_params` turns ``params["layers"]`` into :class:`StackedLayers`, group by group and
period position by period position, with ``jax.tree.map(lambda *xs: jnp.stack(xs), *layers)`` so any registered
pytree leaf (e.g. a quantized weight) stacks along a new leading axis of size ``repeats``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.models.config import ATTN_SLIDING, ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """Static facts one layer's math branches on (everything else comes from its parameters and the step input).

    V4: ``kind`` ∈ {sliding, csa, hca}, ``ratio``, ``hash_routed``. V4.1 adds the cross-layer roles: ``kv_source``
    (owns compressed KV pages), ``has_index_k`` (owns index-key pages), ``shares_index_k`` (owns index keys that a
    later index source scores against, so the layer passes them on), ``index_source`` (runs the indexer),
    ``candidate_source`` / ``uses_candidates`` (two-level top-k), ``engram``, ``dspark_target`` (its attention
    input feeds the drafter) and ``yoco_region`` (at or after the first ratio-1 layer).
    """

    kind: str
    ratio: int
    hash_routed: bool = False
    kv_source: bool = False
    has_index_k: bool = False
    shares_index_k: bool = False
    index_source: bool = False
    candidate_source: bool = False
    uses_candidates: bool = False
    engram: bool = False
    dspark_target: bool = False
    yoco_region: bool = False


def layer_info(cfg: ModelConfig, layer: int) -> LayerInfo:
    """:class:`LayerInfo` of backbone layer ``layer``."""
    ratio = cfg.compress_ratios[layer]
    if not cfg.is_v41:
        return LayerInfo(kind=cfg.attn_kinds[layer], ratio=ratio, hash_routed=cfg.hash_layers[layer])
    compressed = ratio > 0
    has_index_k = (compressed and layer in cfg.kv_source_layer_ids
                   and layer in (cfg.index_k_source_layer_ids or cfg.kv_source_layer_ids))
    return LayerInfo(
        kind=cfg.attn_kinds[layer], ratio=ratio,
        kv_source=compressed and layer in cfg.kv_source_layer_ids,
        has_index_k=has_index_k,
        shares_index_k=has_index_k and any(
            other != layer and cfg.compress_ratios[other] > 0 and cfg.index_k_source(other) == layer
            for other in cfg.index_source_layer_ids),
        index_source=compressed and layer in cfg.index_source_layer_ids,
        candidate_source=compressed and layer == cfg.candidate_source_layer_id,
        uses_candidates=compressed and cfg.uses_candidates(layer),
        engram=layer in cfg.engram_layer_ids,
        dspark_target=layer in cfg.dspark_target_layer_ids,
        yoco_region=layer >= cfg.n_prefill_layer)


SLIDING_INFO = LayerInfo(kind=ATTN_SLIDING, ratio=0)  # MTP / DSpark-style extra blocks


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers ``start … start + period·repeats − 1``: a period of ``period`` layers repeated ``repeats`` times."""

    start: int
    period: int
    repeats: int

    def layer(self, rep: int, pos: int) -> int:
        return self.start + rep * self.period + pos

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats


def _signature(cfg: ModelConfig, layer: int) -> tuple[Any, ...]:
    from dinfer_jax.models.params import is_spec, param_specs_layer

    spec = param_specs_layer(cfg, layer)
    leaves, tree = jax.tree_util.tree_flatten(spec, is_leaf=is_spec)
    return layer_info(cfg, layer), tree, tuple((s.shape, s.keep_fp32, s.integer) for s in leaves)


def segment(signatures: Sequence[Any], max_period: int = 8) -> tuple[LayerGroup, ...]:
    """Greedy split of a signature sequence into groups: at each layer take the period (≤ ``max_period``) whose
    consecutive repeats cover the most layers (ties: the shorter period); a layer no period repeats from becomes a
    group of one."""
    groups, i, n = [], 0, len(signatures)
    while i < n:
        best = (1, 1)  # (period, repeats)
        for p in range(1, min(max_period, n - i) + 1):
            c = 1
            while i + (c + 1) * p <= n and signatures[i + c * p: i + (c + 1) * p] == signatures[i: i + p]:
                c += 1
            if c >= 2 and p * c > best[0] * best[1]:
                best = (p, c)
        groups.append(LayerGroup(i, *best))
        i += best[0] * best[1]
    return tuple(groups)


@functools.lru_cache(maxsize=64)
def plan_layers(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
    """The scan plan of ``cfg``'s backbone (cached per config)."""
    return segment([_signature(cfg, i) for i in range(cfg.num_layers)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayers:
    """Backbone parameters in scan layout: ``groups[g][j]`` is the parameter pytree of period position ``j`` of
    group ``g`` with every leaf stacked along a new leading axis of size ``repeats`` (order of the plan)."""

    groups: tuple[tuple[Any, ...], ...]


def stack_tree(trees: Sequence[Any], on_host: bool = False) -> Any:
    """Stack equally structured pytrees along a new leading axis (works for any registered leaf type); ``on_host``:
    with ``np.stack`` (host arrays stay on the host) instead of ``jnp.stack`` (the default device)."""
    stack = np.stack if on_host else jnp.stack
    return jax.tree.map(lambda *xs: stack(xs), *trees)


def stack_layers(cfg: ModelConfig, layers: Sequence[Any], on_host: bool = False) -> StackedLayers:
    """``layers`` (checkpoint layout, one pytree per layer) → :class:`StackedLayers` by :func:`plan_layers`
    (``on_host``: see :func:`stack_tree`)."""
    if len(layers) != cfg.num_layers:
        raise ValueError(f"got {len(layers)} layer parameter trees for num_layers={cfg.num_layers}")
    return StackedLayers(tuple(
        tuple(stack_tree([layers[g.layer(r, j)] for r in range(g.repeats)], on_host) for j in range(g.period))
        for g in plan_layers(cfg)))


def stack_params(cfg: ModelConfig, params: Any, on_host: bool = False) -> Any:
    """``params`` with ``"layers"`` in scan layout (returned unchanged when it already is); ``on_host``: stacked with
    numpy (for host values about to be placed on a mesh, which a ``jnp.stack`` would first gather on one device)."""
    if isinstance(params["layers"], StackedLayers):
        return params
    return {**params, "layers": stack_layers(cfg, params["layers"], on_host)}


def unstack_layers(cfg: ModelConfig, stacked: StackedLayers) -> list[Any]:
    """Inverse of :func:`stack_layers`: one parameter pytree per layer, in layer order."""
    out: list[Any] = [None] * cfg.num_layers
    for g, group in zip(plan_layers(cfg), stacked.groups, strict=False):
        for j, tree in enumerate(group):
            for r in range(g.repeats):
                out[g.layer(r, j)] = jax.tree.map(lambda x, r=r: x[r], tree)
    return out
