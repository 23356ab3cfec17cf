"""Rank layout, device mesh and partition rules (``dp``/``cp``/``ep`` axes, as DeepInfer's rank groups)."""

from sharding.mesh import make_mesh
from sharding.rules import DEFAULT_RULES, MESH_AXES, Sharder, ShardingRules, constrain

__all__ = ["DEFAULT_RULES", "MESH_AXES", "Sharder", "ShardingRules", "constrain", "make_mesh"]
