"""Structured outputs (JSON schema / regex / EBNF constrained decoding) on llguidance; see docs/structured_outputs.md.

Host side, per request:

* :func:`parse_so_args` -> :class:`StructuredSpec` — validate a request's ``so_args`` (no compilation).
* :class:`MatcherBuilder` -> :class:`MatcherFuture` -> :class:`StructuredMatcher` — compile on a thread pool (LRU
  cache of compiled grammars, timeout), then track the request's trigger / grammar / after-EOS state, fill its
  token bitmask row, accept sampled tokens and roll back speculative ones.
* :func:`grammar_tokenizer` — the llguidance tokenizer for the engine's ``tokenizer.json``.
* :func:`compile_grammar` — schema text -> llguidance grammar (what the builder runs).

Device side: :func:`apply_token_bitmask` (jit-friendly, ``-inf`` for disallowed ids), :func:`full_mask`,
:func:`mask_words`.

Modules: ``spec.py``, ``tokenizer.py``, ``compiler.py``, ``matcher.py``, ``builder.py``, ``bitmask.py``.
"""

from .bitmask import apply_token_bitmask, full_mask, mask_words
from .builder import MatcherBuilder, MatcherFuture
from .compiler import GrammarCompileError, close_json_objects, compile_grammar
from .matcher import DEFAULT_MAX_ROLLBACK, StructuredMatcher
from .spec import SCHEMA_TYPES, StructuredSpec, parse_so_args
from .tokenizer import grammar_tokenizer

__all__ = [
    "DEFAULT_MAX_ROLLBACK",
    "SCHEMA_TYPES",
    "GrammarCompileError",
    "MatcherBuilder",
    "MatcherFuture",
    "StructuredMatcher",
    "StructuredSpec",
    "apply_token_bitmask",
    "close_json_objects",
    "compile_grammar",
    "full_mask",
    "grammar_tokenizer",
    "mask_words",
    "parse_so_args",
]
