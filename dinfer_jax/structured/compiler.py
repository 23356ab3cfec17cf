"""Schema text -> llguidance grammar JSON (validated against the tokenizer). Pure function, no state.

* ``json``: the schema is parsed, closed (below), and compiled with ``LLMatcher.grammar_from_json_schema``.
* ``regex``: ``LLMatcher.grammar_from_regex`` (Rust ``regex`` syntax; the whole output must match).
* ``ebnf``: xgrammar's EBNF is GBNF-style (``root ::= ...``); ``llguidance.gbnf_to_lark.any_to_lark`` converts it to
  Lark (a grammar already in llguidance's Lark syntax, with ``start:`` or ``%llguidance``, passes through unchanged),
  then ``LLMatcher.grammar_from_lark``.

Then ``LLMatcher.validate_grammar_with_warnings`` builds the lexer and parser against the tokenizer; an error from any
step raises :class:`GrammarCompileError` whose message names the schema type.

**Closed objects** (``strict_json=True``, the default): DeepInfer compiles JSON schemas in xgrammar's strict mode, where
an object admits only the properties its schema lists. llguidance follows JSON Schema (extra properties allowed unless
``additionalProperties`` says otherwise), so every object schema that lists ``properties`` or ``patternProperties`` and
says nothing about ``additionalProperties`` / ``unevaluatedProperties`` gets ``"additionalProperties": false``. The
branches of an ``allOf`` are left open (closing each would reject the properties the other branches add); a bare
``{"type": "object"}`` keeps meaning "any object" (xgrammar's strict mode would restrict it to ``{}``).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from .spec import SCHEMA_TYPES

_MAX_MESSAGE = 2000

# JSON Schema keywords whose values are schemas (maps of schemas, lists of schemas, single schemas).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_SINGLE = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)

_KIND = {"json": "invalid JSON schema", "regex": "invalid regex", "ebnf": "invalid EBNF grammar"}


class GrammarCompileError(ValueError):
    """A schema that does not compile; the message starts with what kind of schema was invalid."""


def _short(message: object) -> str:
    text = str(message).strip()
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON outputs are laid out unless a schema's ``"x-guidance"`` says otherwise: one line, ``json.dumps``'s
separators. Free whitespace (JSON's own grammar, xgrammar's default) lets a model pad with blanks and newlines
until it runs out of tokens — measured on the bundled model, whose first JSON output was 60 tokens of blanks."""


def close_json_objects(schema: Any, *, _in_all_of: bool = False) -> Any:
    """Return a copy of ``schema`` whose listed-property objects forbid other properties (module docstring)."""
    if isinstance(schema, list):  # old-style tuple "items"
        return [close_json_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_json_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_json_objects(sub, _in_all_of=key == "allOf") for sub in out[key]]
    for key in _SCHEMA_SINGLE:
        if isinstance(out.get(key), dict | list):
            out[key] = close_json_objects(out[key])
    lists_properties = "properties" in out or "patternProperties" in out
    if lists_properties and not _in_all_of and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_grammar(schema: str, strict_json: bool) -> str:
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise GrammarCompileError(f"invalid JSON schema: not valid JSON: {exc}") from None
    if not isinstance(parsed, dict | bool):
        raise GrammarCompileError(f"invalid JSON schema: must be an object or a boolean, got {type(parsed).__name__}")
    if strict_json:
        parsed = close_json_objects(parsed)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(parsed), defaults=JSON_LAYOUT)
    except Exception as exc:
        raise GrammarCompileError(f"invalid JSON schema: {_short(exc)}") from None


def _ebnf_grammar(schema: str) -> str:
    try:
        lark = any_to_lark(schema)
    except Exception as exc:  # GbnfToLarkError, or a bare Exception for unresolved rules / a missing root
        raise GrammarCompileError(f"invalid EBNF grammar: {_short(exc)}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def compile_grammar(
    tokenizer: llguidance.LLTokenizer, schema_type: str, schema: str, *, strict_json: bool = True
) -> str:
    """Compile ``schema`` of ``schema_type`` (one of :data:`SCHEMA_TYPES`) into llguidance's grammar JSON.

    Raises :class:`GrammarCompileError` (a ``ValueError``) whose message starts with "invalid JSON schema",
    "invalid regex" or "invalid EBNF grammar" followed by llguidance's (or the converter's) reason.
    """
    if schema_type not in SCHEMA_TYPES:
        raise GrammarCompileError(f"unknown schema_type {schema_type!r}")
    if schema_type == "json":
        grammar = _json_grammar(schema, strict_json)
    elif schema_type == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(schema)
    else:
        grammar = _ebnf_grammar(schema)
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except Exception as exc:
        raise GrammarCompileError(f"{_KIND[schema_type]}: {_short(exc)}") from None
    if is_error:
        raise GrammarCompileError(f"{_KIND[schema_type]}: {_short(messages[0] if messages else 'rejected')}")
    return grammar
