"""EPLB placements on a whole model: every MoE layer's routed experts in physical-slot layout plus its tables.

:func:`with_placements` turns a model (logical experts, or already placed) into one whose layer ``l`` holds
``ffn["experts"]`` gathered into ``placements[l]``'s slots and ``ffn["expert_map"]`` (an
:class:`~dinfer_jax.models.eplb.ExpertMap`), with ``moe_impl="ep"``; the forward then dispatches every token
choice to the replica the map names. A rebalance is another call with new placements: the logical weights are
recovered from the current slots (replica 0 of each expert) and gathered again, one gather per weight, sharded
over the EP axes of the model's mesh. Such a parameter tree is a serving layout (like the stacked one): the loader
and writer work on logical experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dinfer_jax.models import Model
from dinfer_jax.models.eplb import Placement, expert_loads
from sharding.mesh import GROUP_AXES, group_size


def logical_experts(ffn: dict[str, Any]) -> dict[str, Any]:
    """Logical ``[E, ...]`` expert weights of a layer, placed or not (replica 0 of each expert)."""
    emap = ffn.get("expert_map")
    if emap is None:
        return ffn["experts"]
    first = emap.logical_to_physical[:, 0]
    return jax.tree_util.tree_map(lambda a: jnp.take(a, first, axis=0), ffn["experts"])


def with_placements(model: Model, placements: Sequence[Placement]) -> Model:
    """``model`` with layer ``l``'s experts placed by ``placements[l]`` (one per backbone layer, all with the same
    number of physical slots so the layers stack for the scan). Needs ``model.sharder`` with an EP group of
    ``placements[l].ep`` ranks. Raises ValueError otherwise."""
    if model.sharder is None:
        raise ValueError("EPLB placements need a model on a mesh (random_model / load_model with a sharder)")
    ep = group_size(model.sharder.mesh, "ep")
    layers = model.params["layers"]
    if not isinstance(layers, list) or len(placements) != len(layers):
        raise ValueError(f"need one placement per layer ({len(layers)}) and the checkpoint (list) layer layout")
    if {p.ep for p in placements} != {ep}:
        raise ValueError(f"placements are for ep={sorted({p.ep for p in placements})}, the mesh's EP group has {ep}")
    if len({p.num_physical for p in placements}) != 1:
        raise ValueError("every layer must have the same number of physical slots (the layers are stacked)")
    spec = PartitionSpec(tuple(a for a in GROUP_AXES["ep"] if model.sharder.mesh.shape[a] > 1) or None)
    sharding = NamedSharding(model.sharder.mesh, spec)
    new_layers = []
    for layer, placement in zip(layers, placements, strict=True):
        ffn = layer["ffn"]
        logical = logical_experts(ffn)
        if logical["w1"].shape[0] != placement.num_logical:
            raise ValueError(f"placement is for {placement.num_logical} experts, the layer has "
                             f"{logical['w1'].shape[0]}")
        p2l = jnp.asarray(placement.physical_to_logical)
        experts = jax.tree_util.tree_map(lambda a, p2l=p2l: jax.device_put(jnp.take(a, p2l, axis=0), sharding),
                                         logical)
        new_layers.append({**layer, "ffn": {**ffn, "experts": experts, "expert_map": placement.expert_map()}})
    return Model(model.config, {**model.params, "layers": new_layers}, model.dtype, model.sharder, "ep",
                 model.engram)


def measured_loads(router_indices: dict[Any, Any] | Sequence[Any], num_experts: int) -> jax.Array:
    """Per-layer per-expert token counts ``[layers, E]`` int32 from :func:`~dinfer_jax.models.inspect`'s
    ``router_indices`` (layer → ``[B, S, k]``, logical ids): one step's row of :func:`~eplb.rebalance_layers`'
    input."""
    items = sorted(router_indices.items()) if isinstance(router_indices, dict) else enumerate(router_indices)
    return jnp.stack([expert_loads(jnp.asarray(v), num_experts) for _, v in items])
