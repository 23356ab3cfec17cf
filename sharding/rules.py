"""Logical-axis → rank-group rules: the one object a sharding study edits.

Parameters and activations name their dimensions with logical axes (``"experts"``, ``"act_batch"``, ...). A
:class:`ShardingRules` maps every logical axis the model uses to a rank-group kind — ``"dp"``, ``"cp"`` or ``"ep"``
(DeepInfer's data-, context- and expert-parallel groups) — or to ``None`` (replicated on purpose). A dimension
mapped to a kind is split over that group's mesh axes (:data:`sharding.mesh.GROUP_AXES`), in group-rank order.

Nothing is replicated by accident: a logical axis the rules do not declare, a kind used by two dimensions of one
tensor, or two kinds that share a (non-trivial) mesh axis within one tensor — DP and EP overlap when an EP group
spans engines, CP and EP when it spans CP ranks — raise :class:`ShardingError` naming the axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import GROUP_AXES, MESH_AXES

GROUP_KINDS = tuple(GROUP_AXES)

# Every logical axis the model uses. Parameters:
#   vocab, embed (D), q_lora, heads_dim (H*d), heads (H), kv (d), o_group_in, o_rank, idx_heads_dim, experts_gate,
#   experts (E), expert_mlp (I), mlp (shared-expert I), hc (mHC mix rows).
# Activations: act_batch (B), act_seq (S), act_heads (H), act_streams (n), act_embed (D), act_experts (E).
DEFAULT_RULES: dict[str, str | None] = {
    "vocab": None,
    "embed": None,
    "q_lora": None,
    "heads_dim": None,
    "heads": None,
    "kv": None,
    "o_group_in": None,
    "o_rank": None,
    "idx_heads_dim": None,
    "experts_gate": None,
    "experts": "ep",
    "expert_mlp": None,
    "mlp": None,
    "hc": None,
    "act_batch": "dp",
    "act_seq": "cp",
    "act_heads": None,
    "act_streams": None,
    "act_embed": None,
    "act_experts": "ep",
}


class ShardingError(ValueError):
    """A logical axis the rules do not declare, or a mesh axis used twice by one tensor."""


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Maps every logical axis name to a group kind (``"dp"``, ``"cp"``, ``"ep"``) or ``None`` (replicated)."""

    mapping: tuple[tuple[str, str | None], ...] = tuple(sorted(DEFAULT_RULES.items()))

    @classmethod
    def from_dict(cls, mapping: Mapping[str, str | None]) -> ShardingRules:
        """Rules from a complete mapping (start from ``{**DEFAULT_RULES, ...}`` to change a few axes)."""
        for k, v in mapping.items():
            if v is not None and v not in GROUP_KINDS:
                raise ShardingError(f"sharding rule {k!r} -> {v!r}: must be one of {GROUP_KINDS} or None")
        return cls(tuple(sorted(mapping.items())))

    def group(self, logical: str | None) -> str | None:
        """The group kind of ``logical`` (``None`` for a ``None`` axis). Raises ShardingError when undeclared."""
        if logical is None:
            return None
        table = dict(self.mapping)
        if logical not in table:
            raise ShardingError(f"logical axis {logical!r} has no sharding rule; declare it (None = replicated) "
                                f"among {sorted(table)}")
        return table[logical]

    def groups(self, logical_axes: Sequence[str | None]) -> tuple[str | None, ...]:
        """Group kind per dimension. Raises ShardingError on an undeclared axis or a kind used twice."""
        kinds = tuple(self.group(a) for a in logical_axes)
        for i, k in enumerate(kinds):
            if k is not None and k in kinds[:i]:
                j = kinds.index(k)
                raise ShardingError(f"logical axes {logical_axes[j]!r} and {logical_axes[i]!r} of "
                                    f"{tuple(logical_axes)} both map to group {k!r}")
        return kinds


def partition_spec(rules: ShardingRules, logical_axes: Sequence[str | None], shape: Sequence[int] | None,
                   axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """PartitionSpec over a mesh with ``axis_sizes`` (as ``Mesh.shape``) for a tensor with ``logical_axes``.

    A dimension mapped to a group kind takes that group's mesh axes of size > 1 (size-1 axes split nothing). Raises
    ShardingError when two dimensions would use one mesh axis. A dimension of ``shape`` that the group size does
    not divide stays whole (block-scale grids of quantised weights are smaller than their codes).
    """
    kinds = rules.groups(logical_axes)
    out: list[Any] = []
    owner: dict[str, str | None] = {}
    for i, k in enumerate(kinds):
        axes = tuple(a for a in GROUP_AXES[k] if axis_sizes[a] > 1) if k is not None else ()
        for a in axes:
            if a in owner:
                raise ShardingError(f"mesh axis {a!r} is used by both logical axes {owner[a]!r} and "
                                    f"{logical_axes[i]!r} of {tuple(logical_axes)} (their groups overlap on this "
                                    f"mesh {dict(axis_sizes)})")
            owner[a] = logical_axes[i]
        if shape is not None and axes and shape[i] % math.prod(axis_sizes[a] for a in axes):
            axes = ()
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def num_shards(spec: PartitionSpec, axis_sizes: Mapping[str, int]) -> int:
    """Into how many pieces ``spec`` splits a tensor (each device holds ``1/num_shards`` of it)."""
    n = 1
    for entry in spec:
        for a in (entry if isinstance(entry, tuple) else (entry,)):
            if a is not None:
                n *= axis_sizes[a]
    return n


@dataclasses.dataclass(frozen=True)
class Sharder:
    """A mesh plus its rules; passed (static) into jitted model code to constrain activations."""

    mesh: Mesh
    rules: ShardingRules = ShardingRules()

    def __post_init__(self) -> None:
        if tuple(self.mesh.axis_names) != MESH_AXES:
            raise ShardingError(f"Sharder needs a mesh with axes {MESH_AXES} (sharding.make_mesh), got "
                                f"{tuple(self.mesh.axis_names)}")

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> PartitionSpec:
        """See :func:`partition_spec`."""
        return partition_spec(self.rules, logical_axes, shape, self.mesh.shape)

    def named(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        """NamedSharding for ``logical_axes`` (see :func:`partition_spec`)."""
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def named_tree(self, logical_axes: Sequence[str | None], x: Any) -> Any:
        """Shardings for a parameter ``x`` with ``logical_axes``: one NamedSharding per array leaf, in ``x``'s
        structure. A quantised weight's codes and block scales both take the dense weight's logical axes; each
        axis is sharded only where that leaf's dimension divides evenly (scale grids are smaller)."""
        return jax.tree_util.tree_map(lambda leaf: self.named(logical_axes, leaf.shape), x)

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        """``with_sharding_constraint`` of ``x`` to its logical axes."""
        return jax.lax.with_sharding_constraint(x, self.named(logical_axes, x.shape))


def constrain(sharder: Sharder | None, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Apply a sharding constraint when running under a mesh; identity otherwise."""
    if sharder is None:
        return x
    return sharder.constrain(x, logical_axes)
