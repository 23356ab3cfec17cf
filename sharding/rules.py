"""Logical-axis → mesh-axis rules: the one object a sharding study edits.

Parameters and activations name their dimensions with logical axes (``"experts"``, ``"act_batch"``, ...). A
:class:`ShardingRules` maps each logical axis to a mesh axis of the ``("dp", "cp", "ep")`` mesh (mirroring
DeepInfer's data-, context- and expert-parallel rank groups) or to ``None`` (replicated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("dp", "cp", "ep")

# Logical axes used by the model. Parameters:
#   vocab, embed (D), q_lora, heads_dim (H*d), kv (d), o_group_in, o_rank, experts (E), expert_mlp (I),
#   hc (mHC mix rows), idx_heads_dim, none.
# Activations: act_batch (B), act_seq (S), act_heads (H), act_streams (n), act_embed (D), act_experts (E).
DEFAULT_RULES: dict[str, str | None] = {
    "experts": "ep",
    "act_batch": "dp",
    "act_seq": "cp",
    "act_experts": "ep",
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Maps logical axis names to mesh axes. Unknown logical names are replicated."""

    mapping: tuple[tuple[str, str | None], ...] = tuple(DEFAULT_RULES.items())

    @classmethod
    def from_dict(cls, mapping: Mapping[str, str | None]) -> ShardingRules:
        for k, v in mapping.items():
            if v is not None and v not in MESH_AXES:
                raise ValueError(f"sharding rule {k!r} -> {v!r}: mesh axis must be one of {MESH_AXES} or None")
        return cls(tuple(sorted(mapping.items())))

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        return dict(self.mapping).get(logical)

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for a tensor whose dimensions carry ``logical_axes``; a mesh axis is used at most once."""
        used: set[str] = set()
        out: list[str | None] = []
        for name in logical_axes:
            ax = self.mesh_axis(name)
            if ax is not None and ax in used:
                ax = None
            if ax is not None:
                used.add(ax)
            out.append(ax)
        return PartitionSpec(*out)


@dataclasses.dataclass(frozen=True)
class Sharder:
    """A mesh plus its rules; passed (static) into jitted model code to constrain activations."""

    mesh: Mesh
    rules: ShardingRules = ShardingRules()

    def named(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        """NamedSharding for ``logical_axes``; axes that do not divide ``shape`` evenly are replicated."""
        spec = list(self.rules.spec(logical_axes))
        if shape is not None:
            for i, ax in enumerate(spec):
                if ax is not None and shape[i] % self.mesh.shape[ax] != 0:
                    spec[i] = None
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def named_tree(self, logical_axes: Sequence[str | None], x: Any) -> Any:
        """Shardings for a parameter ``x`` with ``logical_axes``: one NamedSharding per array leaf, in ``x``'s
        structure. A quantised weight's codes and block scales both take the dense weight's logical axes; each
        axis is sharded only where that leaf's dimension divides evenly (scale grids are smaller)."""
        return jax.tree_util.tree_map(lambda leaf: self.named(logical_axes, leaf.shape), x)

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.named(logical_axes, x.shape))


def constrain(sharder: Sharder | None, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Apply a sharding constraint when running under a mesh; identity otherwise."""
    if sharder is None:
        return x
    return sharder.constrain(x, logical_axes)
