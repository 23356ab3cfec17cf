"""The engine's side of structured outputs: grammar builds before admission, per-step token masks, matcher updates.

A request with ``SamplingParams.so_args`` is not given to the scheduler until its matcher is compiled (on the
builder's threads, off the step loop; DeepInfer's ``schedulable=False``). Afterwards, each step that samples one
of its rows is dispatched with ``defer_sample``: the model runs while the host folds the previous step's tokens
into the matchers (:meth:`StructuredOutputs.advance`), then :meth:`StructuredOutputs.masks` fills the rows' token
masks from that committed state and the sampler is launched with them. Under asynchronous scheduling the model of
step N therefore overlaps the host's work for step N − 1 and the masks of step N; the device waits only for the
masks themselves (``metrics()["structured_mask_seconds"]`` is the host time spent filling them).

A grammar that fails to compile (or times out), a matcher error, or a token the grammar rejects ends only that
request, with ``finish_reason="error"`` and the cause (DeepInfer's ``FINISHED_SO_FAILED``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from dinfer_jax.engine.records import ScheduledStep
from dinfer_jax.engine.scheduler import Scheduler
from dinfer_jax.structured import MatcherBuilder, MatcherFuture, StructuredMatcher, grammar_tokenizer, mask_words

__all__ = ["StructuredOutputs"]


class StructuredOutputs:
    """Structured-output bookkeeping of one engine (the builder and its grammar cache live as long as the engine).

    Args:
        tokenizer_json: the engine's ``tokenizer.json`` text (None: structured requests end with an error).
        vocab_size: the model's vocabulary (mask width ``ceil(vocab_size / 32)`` int32 words per row).
        eos_token_ids: end-of-sequence ids (allowed by the grammar once it is complete).
        timeout_s: compilation limit per request; workers: compilation threads.
    """

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: Sequence[int], *,
                 timeout_s: float = 20.0, workers: int = 2) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = int(vocab_size)
        self._eos = tuple(int(t) for t in eos_token_ids)
        self._timeout_s = float(timeout_s)
        self._workers = int(workers)
        self._builder: MatcherBuilder | None = None
        self.words = mask_words(vocab_size)
        self.mask_seconds = 0.0   # host time filling masks
        self.build_wait_seconds = 0.0  # host time blocked on a compilation with nothing else to do
        self.requests = 0
        self.failed = 0

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        """A new limit applies to requests submitted from now on (the builder and its grammar cache restart)."""
        if not value > 0:
            raise ValueError(f"structured_timeout_s must be > 0, got {value!r}")
        self.close()
        self._timeout_s = float(value)

    # ------------------------------------------------------------------ admission
    def submit(self, rec: dict[str, Any]) -> str | None:
        """Start compiling the grammar of ``rec`` (a request record with ``params.structured``); returns an error
        message instead when this engine cannot build one (no tokenizer)."""
        self.requests += 1
        if self._tokenizer_json is None:
            self.failed += 1
            return ("structured output needs a tokenizer: this model has no tokenizer.json (pass LLM(tokenizer=...))")
        if self._builder is None:
            tok = grammar_tokenizer(self._tokenizer_json, self._vocab_size, self._eos)
            self._builder = MatcherBuilder(tok, self._vocab_size, self._eos, workers=self._workers,
                                           timeout_s=self._timeout_s)
        rec["build"] = self._builder.submit(rec["params"].structured)
        return None

    def ready(self, pending: Iterable[dict[str, Any]], block: bool) -> list[tuple[dict[str, Any], StructuredMatcher]]:
        """The pending records whose matcher is built (or failed), with it. ``block``: nothing else can run, so
        wait for the first pending build (up to its timeout) rather than spin."""
        out = []
        pending = list(pending)
        for i, rec in enumerate(pending):
            fut: MatcherFuture = rec["build"]
            if block and i == 0:
                t0 = time.perf_counter()
                m = fut.result()
                self.build_wait_seconds += time.perf_counter() - t0
            else:
                m = fut.try_result()
            if m is not None:
                rec["build"] = None
                if m.error is not None:
                    self.failed += 1
                out.append((rec, m))
        return out

    # ------------------------------------------------------------------ per step
    @staticmethod
    def needs_masks(step: ScheduledStep, by_id: dict[int, dict[str, Any]]) -> bool:
        """Some row of ``step`` samples a token of a structured request."""
        return any(r.sample and by_id[r.request_id].get("matcher") is not None for r in step.rows)

    def masks(self, step: ScheduledStep, batch: int, by_id: dict[int, dict[str, Any]],
              sched: Scheduler) -> np.ndarray:
        """Token masks ``int32 [batch, words]`` for ``step``'s rows (all bits set for free rows and padding), from
        each structured request's committed tokens. A matcher that fails here ends its request."""
        t0 = time.perf_counter()
        mask = np.full((batch, self.words), -1, np.int32)
        for i, row in enumerate(step.rows):
            rec = by_id[row.request_id]
            m: StructuredMatcher | None = rec.get("matcher")
            if not row.sample or m is None or rec["seq"].finished:
                continue
            m.fill_mask(mask[i])
            self._check(sched, rec, m, mask[i])
        self.mask_seconds += time.perf_counter() - t0
        return mask

    def spec_masks(self, step: ScheduledStep, k: int, by_id: dict[int, dict[str, Any]], sched: Scheduler,
                   draft_tokens: Callable[[], np.ndarray]) -> np.ndarray:
        """Token masks ``int32 [len(step.rows), 1 + k, words]`` of a speculative step: for each structured row,
        position 0 from its committed state, then each draft it verifies is tentatively accepted and the mask of
        the next position filled, and the drafts are rolled back (DeepInfer's per-draft-step masks). A draft the
        grammar rejects leaves the later positions all allowed: verification rejects that draft at its own masked
        position, so nothing after it is used. ``draft_tokens()`` reads the drafts ``[slots, k]`` from the device
        (called only when some row verifies drafts)."""
        t0 = time.perf_counter()
        mask = np.full((len(step.rows), 1 + k, self.words), -1, np.int32)
        drafts = None
        for i, row in enumerate(step.rows):
            rec = by_id[row.request_id]
            m: StructuredMatcher | None = rec.get("matcher")
            if not row.sample or m is None or rec["seq"].finished:
                continue
            m.fill_mask(mask[i, 0])
            accepted = 0
            if row.num_drafts:
                drafts = draft_tokens() if drafts is None else drafts
                for j, tok in enumerate(drafts[rec["seq"].state_slot, : row.num_drafts]):
                    if not m.accept_token(int(tok)):
                        break
                    accepted += 1
                    m.fill_mask(mask[i, j + 1])
                m.rollback(accepted)
            self._check(sched, rec, m, mask[i, 0])
        self.mask_seconds += time.perf_counter() - t0
        return mask

    def advance(self, step: ScheduledStep, by_id: dict[int, dict[str, Any]], sched: Scheduler) -> None:
        """Feed each structured request of ``step`` the output tokens the scheduler committed since the last call
        (after ``Scheduler.process_step``). A token the grammar rejects ends the request."""
        for row in step.rows:
            rec = by_id[row.request_id]
            m: StructuredMatcher | None = rec.get("matcher")
            if m is None:
                continue
            seq = rec["seq"]
            out = seq.output_token_ids
            for tok in out[rec["so_fed"]:]:
                if not m.accept_token(tok):
                    if not seq.finished:
                        why = m.error or f"the grammar rejected token {tok} (output position {rec['so_fed']})"
                        self._fail(sched, rec, f"structured output: {why}")
                    break
                rec["so_fed"] += 1
            rec["so_fed"] = len(out)

    def _check(self, sched: Scheduler, rec: dict[str, Any], m: StructuredMatcher, first: np.ndarray) -> None:
        """End the request when its matcher failed, or when its mask for the next token (``first``) is empty (e.g.
        the grammar's only continuations lie beyond the model's vocabulary)."""
        if m.error is not None:
            self._fail(sched, rec, f"structured output: {m.error}")
        elif not first.any():
            self._fail(sched, rec, "structured output: no token of the model's vocabulary "
                       f"({self._vocab_size}) continues the grammar after {len(rec['seq'].output_token_ids)} "
                       "output tokens")

    def refuse(self, reason: str) -> str:
        """Count a structured request this engine cannot serve; returns ``reason`` (its error)."""
        self.requests += 1
        self.failed += 1
        return reason

    def _fail(self, sched: Scheduler, rec: dict[str, Any], message: str) -> None:
        self.failed += 1
        rec["matcher"] = None
        sched.fail(rec["id"], message)

    def close(self) -> None:
        if self._builder is not None:
            self._builder.close(wait=False)
            self._builder = None
