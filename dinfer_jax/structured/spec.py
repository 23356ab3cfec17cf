"""A request's structured-output options: ``so_args`` parsed and validated into a :class:`StructuredSpec`.

``so_args`` is the request-level mapping DeepInfer accepts (``SamplingParams.so_args``)::

    {"schema_type": "json" | "regex" | "ebnf",   # required
     "schema": str,                               # required: JSON Schema text, a regex, or a GBNF/Lark grammar
     "trigger_token_ids": [int, ...],             # optional: the grammar applies only after this token sequence
     "bound_token_id": int}                       # optional: once seen, the trigger is forced (needs a trigger)

Parsing checks shapes and types only; it never compiles the schema (that is :class:`MatcherBuilder`'s job, off the
engine's critical path), so a syntactically broken schema is reported later as a failed matcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

SCHEMA_TYPES: tuple[str, ...] = ("json", "regex", "ebnf")
"""The accepted ``schema_type`` values (DeepInfer's set)."""

_KEYS = frozenset({"schema_type", "schema", "trigger_token_ids", "bound_token_id"})


def _is_int(value: object) -> bool:
    """A Python or numpy integer, never a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


@dataclasses.dataclass(frozen=True)
class StructuredSpec:
    """One request's structured-output request, validated (construction raises ``ValueError`` when invalid).

    Attributes:
        schema_type: one of :data:`SCHEMA_TYPES`.
        schema: the schema or grammar text (JSON Schema text for ``"json"``).
        trigger_token_ids: token ids that must appear (contiguously, as free text) before the grammar applies;
            empty = the grammar applies from the first generated token.
        bound_token_id: when not None, seeing this token while the trigger is pending forces the rest of the
            trigger token by token. Requires a non-empty trigger.
    """

    schema_type: str
    schema: str
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.schema_type not in SCHEMA_TYPES:
            raise ValueError(f"unknown schema_type {self.schema_type!r}; expected one of {', '.join(SCHEMA_TYPES)}")
        if not isinstance(self.schema, str):
            raise ValueError(f"schema must be a str, got {type(self.schema).__name__}")
        if not isinstance(self.trigger_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.trigger_token_ids
        ):
            raise ValueError("trigger_token_ids must be a list of non-negative integers")
        object.__setattr__(self, "trigger_token_ids", tuple(int(t) for t in self.trigger_token_ids))
        if self.bound_token_id is not None:
            if not _is_int(self.bound_token_id) or self.bound_token_id < 0:
                raise ValueError("bound_token_id must be a non-negative integer")
            if not self.trigger_token_ids:
                raise ValueError("bound_token_id requires non-empty trigger_token_ids")
            object.__setattr__(self, "bound_token_id", int(self.bound_token_id))


def parse_so_args(so_args: Mapping[str, Any]) -> StructuredSpec:
    """Validate a request's ``so_args`` mapping and return its :class:`StructuredSpec`.

    Raises ``ValueError`` naming the problem for: a non-mapping; the removed keys ``"serialized"`` (pre-compiled
    grammars are not accepted) and ``"bound_token_ids"`` (replaced by the single ``bound_token_id``); any other
    unknown key; a missing or unknown ``schema_type``; a missing or non-str ``schema``; ``trigger_token_ids`` that is
    not a list (or tuple) of non-negative integers; ``bound_token_id`` that is not a non-negative integer or comes
    without a non-empty trigger. ``None`` for either optional key means "absent".
    """
    if not isinstance(so_args, Mapping):
        raise ValueError(f"so_args must be a mapping, got {type(so_args).__name__}")
    if "serialized" in so_args:
        raise ValueError(
            "so_args: serialized (pre-compiled) grammars are not accepted; provide schema_type and schema instead"
        )
    if "bound_token_ids" in so_args:
        raise ValueError(
            "so_args: bound_token_ids is no longer supported; use bound_token_id (a single non-negative int)"
        )
    unknown = sorted(str(k) for k in so_args if k not in _KEYS)
    if unknown:
        raise ValueError(
            f"so_args: unknown key(s) {', '.join(unknown)}; expected a subset of {', '.join(sorted(_KEYS))}"
        )
    if "schema_type" not in so_args:
        raise ValueError("so_args: missing schema_type")
    if "schema" not in so_args:
        raise ValueError("so_args: missing schema")
    trigger = so_args.get("trigger_token_ids")
    if trigger is None:
        trigger = ()
    elif not isinstance(trigger, list | tuple):
        raise ValueError("trigger_token_ids must be a list of non-negative integers")
    return StructuredSpec(
        schema_type=so_args["schema_type"],
        schema=so_args["schema"],
        trigger_token_ids=tuple(trigger),
        bound_token_id=so_args.get("bound_token_id"),
    )
