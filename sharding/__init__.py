"""Rank layout, device mesh and partition rules (DeepInfer's DP / CP / EP rank groups)."""

from sharding.layout import RankLayout, cp_split, layout
from sharding.mesh import GROUP_AXES, MESH_AXES, group_size, make_mesh, mesh_shape, mesh_size
from sharding.rules import (
    DEFAULT_RULES,
    GROUP_KINDS,
    Sharder,
    ShardingError,
    ShardingRules,
    constrain,
    num_shards,
    partition_spec,
)

__all__ = ["DEFAULT_RULES", "GROUP_AXES", "GROUP_KINDS", "MESH_AXES", "RankLayout", "Sharder", "ShardingError",
           "ShardingRules", "constrain", "cp_split", "group_size", "layout", "make_mesh", "mesh_shape", "mesh_size",
           "num_shards", "partition_spec"]
