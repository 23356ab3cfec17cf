"""The llguidance tokenizer shared by every grammar of an engine (built once, read-only, thread-safe)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance


def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """Build the :class:`llguidance.LLTokenizer` for a HuggingFace ``tokenizer.json``.

    Args:
        tokenizer_json: the *contents* of ``tokenizer.json`` (a JSON string, not a path).
        vocab_size: the model's vocabulary (logit width). It may exceed the tokenizer's own vocabulary: the
            tokenizer is then padded to ``vocab_size`` and llguidance treats the extra ids as byte-less special
            tokens that no grammar ever allows. When it is smaller, the tokenizer keeps its own size and
            :class:`StructuredMatcher` drops the ids beyond ``vocab_size`` from its masks.
        eos_token_ids: the end-of-sequence ids (non-empty). The grammar allows them exactly where it may end.

    Returns:
        The tokenizer; its ``vocab_size`` is ``max(vocab_size, tokenizer's own size)``.
    """
    eos = [int(t) for t in eos_token_ids]
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if not eos:
        raise ValueError("eos_token_ids must be non-empty")
    try:
        tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    except Exception as padded_error:  # "vocab size too small": the tokenizer has more ids than the model
        try:
            tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        except Exception:
            raise padded_error from None
        if tok.vocab_size <= vocab_size:
            raise padded_error from None
    bad = [t for t in eos if not 0 <= t < tok.vocab_size]
    if bad:
        raise ValueError(f"eos_token_ids {bad} out of range for a vocabulary of {tok.vocab_size}")
    return tok
