"""One request's grammar state: DeepInfer's ``XGrammarMatcher`` semantics on an llguidance ``LLMatcher``.

A request goes through up to three phases, one token at a time:

1. **trigger** (only with ``trigger_token_ids``): tokens are free text while the matcher tracks, KMP style, how much of
   the trigger sequence the recent tokens spell. The trigger tokens themselves are free text too. If
   ``bound_token_id`` is seen in this phase, every following token must be the next trigger token (the trigger is
   forced token by token); others are rejected.
2. **grammar**: from the token after the full trigger (or from the first token without a trigger), each token must
   be allowed by the grammar; a rejected token leaves the state unchanged. EOS is allowed exactly where the grammar
   may end.
3. **after EOS**: once the grammar accepted EOS, everything is allowed (DeepInfer's ``mask_after_eos``; this matters
   for speculative drafts past the end).

Every accepted token can be undone (:meth:`StructuredMatcher.rollback`, up to ``max_rollback`` tokens), across phases,
for speculative decoding: accept draft k, fill the mask for position k + 1, ..., then roll back.

Failures never raise from the per-step methods: a matcher that failed to build (:meth:`StructuredMatcher.failed`) or
whose llguidance state broke reports it through :attr:`StructuredMatcher.error`, rejects every token, writes
all-allowed masks (never an empty row: an all ``-inf`` row would turn sampling into NaNs), and ignores rollbacks. The
engine is expected to check ``error`` and abort the request with that message.

A matcher is not thread-safe: one thread (the engine's) drives it at a time.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import llguidance
import numpy as np

from .bitmask import mask_words

DEFAULT_MAX_ROLLBACK = 16
"""Default rollback depth: enough for a speculative window of a few draft tokens (DeepInfer: nextn + 2)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Undo:
    """The matcher's state just before one accepted token, and whether that token went into llguidance."""

    trigger_progress: int
    bound_fired: bool
    finished: bool
    in_grammar: bool


def _kmp_borders(seq: Sequence[int]) -> list[int]:
    """``borders[i]``: length of the longest proper prefix of ``seq[: i + 1]`` that is also its suffix."""
    borders = [0] * len(seq)
    length = 0
    for i in range(1, len(seq)):
        while length and seq[i] != seq[length]:
            length = borders[length - 1]
        if seq[i] == seq[length]:
            length += 1
        borders[i] = length
    return borders


class StructuredMatcher:
    """Grammar state of one request (module docstring for the phases).

    Args:
        tokenizer: the engine's :func:`grammar_tokenizer`.
        grammar: llguidance's grammar JSON (``LLMatcher.grammar_from_*``, or :func:`compile_grammar`). An invalid
            grammar does not raise: the matcher comes out failed (``error`` set).
        vocab_size: the model's vocabulary; masks are int32 rows of ``ceil(vocab_size / 32)`` words.
        eos_token_ids: end-of-sequence ids; accepting one in the grammar phase ends the grammar.
        trigger_token_ids: the trigger sequence (empty: the grammar applies from the first token).
        bound_token_id: the token that makes the rest of the trigger forced (needs a non-empty trigger).
        max_rollback: how many of the most recent accepted tokens :meth:`rollback` can undo.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        grammar: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        trigger_token_ids: Sequence[int] = (),
        bound_token_id: int | None = None,
        max_rollback: int = DEFAULT_MAX_ROLLBACK,
    ) -> None:
        trigger = tuple(int(t) for t in trigger_token_ids)
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        bad = [t for t in trigger if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"trigger_token_ids {bad} out of range for vocab_size {vocab_size}")
        if bound_token_id is not None:
            if not trigger:
                raise ValueError("bound_token_id requires non-empty trigger_token_ids")
            if not 0 <= bound_token_id < vocab_size:
                raise ValueError(f"bound_token_id {bound_token_id} out of range for vocab_size {vocab_size}")
        self._error: str | None = None
        self._vocab_size = vocab_size
        self._n_words = mask_words(vocab_size)
        self._max_rollback = max_rollback
        self._trigger = trigger
        self._borders = _kmp_borders(trigger)
        self._bound = None if bound_token_id is None else int(bound_token_id)
        self._eos = frozenset(int(t) for t in eos_token_ids) | frozenset(tokenizer.eos_tokens)
        self._history: collections.deque[_Undo] = collections.deque(maxlen=max_rollback)
        self._progress = 0
        self._bound_fired = False
        self._finished = False
        self._tok_vocab = tokenizer.vocab_size
        self._tok_words = mask_words(self._tok_vocab)
        self._scratch: np.ndarray | None = None
        # Model ids the tokenizer covers beyond the last full word are cleared after a copy from a larger mask.
        self._tail = None
        if self._tok_vocab > vocab_size and vocab_size % 32:
            self._tail = np.array((1 << (vocab_size % 32)) - 1, dtype=np.uint32).view(np.int32)
        self._llm: llguidance.LLMatcher | None = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._llm.is_error():
            self._set_error(f"invalid grammar: {self._llm.get_error()}")

    @classmethod
    def failed(cls, message: str) -> StructuredMatcher:
        """A matcher that carries only an error (compilation failed or timed out): ``error == message``."""
        if not message:
            raise ValueError("a failed matcher needs a non-empty message")
        self = cls.__new__(cls)
        self._error = message
        self._vocab_size = 0
        self._n_words = None  # any row shape is accepted
        self._max_rollback = 0
        self._trigger = ()
        self._borders = []
        self._bound = None
        self._eos = frozenset()
        self._history = collections.deque(maxlen=0)
        self._progress = 0
        self._bound_fired = False
        self._finished = False
        self._tok_vocab = 0
        self._tok_words = 0
        self._scratch = None
        self._tail = None
        self._llm = None
        return self

    # ---- state -----------------------------------------------------------------------------------------------

    @property
    def error(self) -> str | None:
        """Why this matcher cannot constrain its request (build failure, timeout, llguidance error), else None."""
        return self._error

    @property
    def vocab_size(self) -> int:
        """The model vocabulary the masks cover (0 for a failed matcher)."""
        return self._vocab_size

    @property
    def max_rollback(self) -> int:
        """How many of the most recent accepted tokens :meth:`rollback` can undo."""
        return self._max_rollback

    def _forcing(self) -> bool:
        return self._bound_fired and self._progress < len(self._trigger)

    def constrained(self) -> bool:
        """Whether the next token is restricted: the grammar is active, or the bound token forces the trigger.

        False in the free part of the trigger phase, after EOS, and for a failed matcher (its masks are all-ones).
        """
        if self._error is not None or self._finished:
            return False
        return self._bound_fired or self._progress >= len(self._trigger)

    def finished(self) -> bool:
        """Whether the grammar accepted EOS (everything is allowed afterwards)."""
        return self._finished

    def _set_error(self, message: str) -> None:
        self._error = message
        self._llm = None

    # ---- per step ----------------------------------------------------------------------------------------------

    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token. Returns False, with the state unchanged, when the token is not allowed.

        Trigger phase: True (free text; KMP progress over the trigger), except after the bound token, where only
        the next trigger token is accepted. Grammar phase: whatever the grammar allows (EOS where it may end; never
        an id beyond the tokenizer). After EOS: always True. A failed matcher: always False.
        """
        if self._error is not None:
            return False
        token = int(token)
        undo = _Undo(self._progress, self._bound_fired, self._finished, in_grammar=False)
        if self._progress < len(self._trigger):
            if self._bound_fired:
                if token != self._trigger[self._progress]:
                    return False
                self._progress += 1
            else:
                progress = self._progress
                while progress and token != self._trigger[progress]:
                    progress = self._borders[progress - 1]
                if token == self._trigger[progress]:
                    progress += 1
                self._progress = progress
                if token == self._bound:
                    self._bound_fired = True
            self._history.append(undo)
            return True
        if self._finished:
            self._history.append(undo)
            return True
        if not 0 <= token < self._tok_vocab:
            return False  # llguidance would enter its (permanent) error state on an out-of-range id
        assert self._llm is not None
        if token in self._eos and self._llm.is_stopped() and not self._llm.is_error():
            # The grammar cannot extend (e.g. a closed JSON object): its mask allows only EOS, yet llguidance's
            # try_consume_tokens / validate_tokens refuse EOS in this state, and consume_token would accept it
            # without recording a token (so a rollback would not count it). Finish without touching llguidance.
            self._finished = True
            self._history.append(undo)
            return True
        try:
            consumed = self._llm.try_consume_tokens([token])  # a rejected token is not consumed, no error state
        except Exception as exc:  # API-level failure inside llguidance
            self._set_error(f"llguidance error on token {token}: {exc}")
            return False
        if self._llm.is_error():
            self._set_error(f"llguidance error on token {token}: {self._llm.get_error()}")
            return False
        if consumed != 1:
            return False
        if token in self._eos:
            self._finished = True
        self._history.append(dataclasses.replace(undo, in_grammar=True))
        return True

    def fill_mask(self, words: np.ndarray) -> None:
        """Write the allowed set of the next token into ``words``.

        Args:
            words: int32 ``[ceil(vocab_size / 32)]``, writable (typically a row view of the engine's batch mask);
                bit ``t % 32`` of word ``t // 32`` = token ``t`` allowed.

        Written: all bits set (every id, padding bits included) when not :meth:`constrained` (free trigger phase,
        after EOS, failed matcher); exactly the next trigger token while the bound token forces the trigger;
        otherwise llguidance's mask, with every id the tokenizer does not cover (and the padding bits) clear. A
        constrained mask is never empty: the grammar always allows some continuation or EOS.

        Raises ``ValueError`` only for a ``words`` of the wrong dtype / shape / writability (a caller bug); a failed
        matcher accepts any shape.
        """
        if self._n_words is not None and (
            words.dtype != np.int32 or words.shape != (self._n_words,) or not words.flags.writeable
        ):
            raise ValueError(
                f"words must be a writable int32 [{self._n_words}] row, got {words.dtype} {words.shape}"
                f"{'' if words.flags.writeable else ' (read-only)'}"
            )
        if not self.constrained():
            words[...] = -1
            return
        if self._forcing():
            expected = self._trigger[self._progress]
            words[...] = 0
            words.view(np.uint32)[expected >> 5] = np.uint32(1 << (expected & 31))
            return
        direct = self._tok_words == self._n_words and words.flags.c_contiguous
        if direct:
            target = words
        else:
            if self._scratch is None:
                self._scratch = np.zeros(self._tok_words, dtype=np.int32)
            target = self._scratch
        assert self._llm is not None
        try:
            self._llm.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        except Exception as exc:
            self._set_error(f"llguidance error computing the mask: {exc}")
        else:
            if self._llm.is_error():
                self._set_error(f"llguidance error computing the mask: {self._llm.get_error()}")
        if self._error is not None:
            words[...] = -1
            return
        if not direct:
            n = min(self._n_words, self._tok_words)
            words[:n] = target[:n]
            words[n:] = 0
            if self._tail is not None:
                words[-1] &= self._tail

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens, whichever phases they were accepted in.

        Raises ``ValueError`` when ``n`` is negative or more than the retained history (at most ``max_rollback``
        tokens, and never more than were accepted). A failed matcher ignores rollbacks.
        """
        if self._error is not None:
            return
        if n < 0:
            raise ValueError(f"rollback count must be >= 0, got {n}")
        if n > len(self._history):
            raise ValueError(
                f"cannot roll back {n} tokens: only the last {len(self._history)} are retained "
                f"(max_rollback={self._max_rollback})"
            )
        if n == 0:
            return
        undone = [self._history.pop() for _ in range(n)]
        in_grammar = sum(u.in_grammar for u in undone)
        oldest = undone[-1]
        self._progress, self._bound_fired, self._finished = oldest.trigger_progress, oldest.bound_fired, oldest.finished
        if in_grammar:
            assert self._llm is not None
            try:
                ok = self._llm.rollback(in_grammar)
            except Exception as exc:
                self._set_error(f"llguidance rollback of {in_grammar} tokens failed: {exc}")
                return
            if not ok or self._llm.is_error():
                reason = self._llm.get_error() if self._llm.is_error() else "refused"
                self._set_error(f"llguidance rollback of {in_grammar} tokens failed: {reason}")

    def __repr__(self) -> str:
        if self._error is not None:
            return f"StructuredMatcher(error={self._error!r})"
        phase = "after-eos" if self._finished else "grammar" if self._progress >= len(self._trigger) else "trigger"
        return (
            f"StructuredMatcher(phase={phase}, trigger_progress={self._progress}/{len(self._trigger)}, "
            f"bound_fired={self._bound_fired}, history={len(self._history)}/{self._max_rollback})"
        )
