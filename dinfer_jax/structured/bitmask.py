"""Token bitmasks: the host layout and the device-side application to logits (pure ``jnp``, jit-friendly).

Layout (llguidance's and xgrammar's): a row of ``W = ceil(V / 32)`` int32 words; token ``t`` is allowed iff bit
``t % 32`` (little-endian: bit 0 is the least significant) of word ``t // 32`` is set. Bits for ids ``>= V`` (the
padding of the last word) carry no meaning and are ignored here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mask_words(vocab_size: int) -> int:
    """Words per mask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def full_mask(rows: int, vocab_size: int) -> np.ndarray:
    """An all-allowed mask: int32 ``[rows, mask_words(vocab_size)]``, every bit set (padding bits included)."""
    return np.full((rows, mask_words(vocab_size)), -1, dtype=np.int32)


def apply_token_bitmask(logits: jax.Array, words: jax.Array) -> jax.Array:
    """Set the logits of disallowed tokens to ``-inf``.

    Args:
        logits: float ``[B, V]`` (any float dtype).
        words: int32 ``[B, W]``, the packed allowed-sets (module docstring). ``W >= ceil(V / 32)`` is the normal
            case (extra words are ignored); when ``32 * W < V``, ids ``>= 32 * W`` are disallowed (as llguidance's
            own ``apply_token_bitmask_inplace`` does; e.g. a vocabulary padded beyond the tokenizer's).

    Returns:
        ``[B, V]`` of ``logits.dtype``: ``logits`` where allowed, ``-inf`` elsewhere. An all-ones row (covering V)
        returns that row bit-identical.
    """
    if logits.ndim != 2 or words.ndim != 2 or logits.shape[0] != words.shape[0]:
        raise ValueError(f"expected logits [B, V] and words [B, W], got {logits.shape} and {words.shape}")
    batch, vocab = logits.shape
    n_words = min(words.shape[1], mask_words(vocab))
    shifts = jnp.arange(32, dtype=jnp.int32)
    # [B, n_words, 32] bits -> [B, 32 * n_words]; arithmetic shift of negative words is harmless after "& 1".
    bits = (words[:, :n_words, None].astype(jnp.int32) >> shifts) & 1
    allowed = bits.reshape(batch, 32 * n_words)[:, :vocab] != 0
    if allowed.shape[1] < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])), constant_values=False)
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, dtype=logits.dtype))
