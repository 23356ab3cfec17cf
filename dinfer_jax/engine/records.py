"""The scheduler's records: a request (``Sequence``) and its immutable snapshot (``RequestOutput``), and the plan of
one step (``ScheduledStep`` of ``ScheduledRow``). Plain data with derived properties; the policy that creates and
mutates them is ``scheduler.Scheduler`` (see ``docs/architecture.md`` section 5, "Scheduler"). Pure Python; no jax.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "FINISH_REASONS",
    "RequestOutput",
    "ScheduledRow",
    "ScheduledStep",
    "Sequence",
    "SequenceStatus",
]

FINISH_REASONS = ("stop", "length", "preempted", "error", "abort")


# ---------------------------------------------------------------------------------------------------------------------
# Sequence record
# ---------------------------------------------------------------------------------------------------------------------
NONFINITE_TOKEN = -1
"""What the device step reports instead of a token for a row whose logits were not all finite (NaN / ±inf from
the model: a corrupt weight, an overflow); the scheduler ends that request with an error naming the step and
position, and the other rows are untouched."""


class SequenceStatus(enum.Enum):
    """Where a request is in its life: queued, admitted (holding KV blocks and a state slot) or done."""

    WAITING = "waiting"  # in the waiting queue, holds no blocks / slot (new, or preempted for recompute)
    RUNNING = "running"  # admitted: holds blocks + a slot; prefill may still be in progress (`is_prefilling`)
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """Immutable snapshot of a request's state (``docs/spec/engine.md`` §14): a copy, valid forever, unlike
    DeepInfer's pooled records."""

    request_id: Any
    prompt_len: int
    output_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    error: str | None
    num_preemptions: int


@dataclass(eq=False)
class Sequence:
    """One request. Mutated only by the Scheduler; read freely.

    num_computed_tokens: positions whose KV is in the cache or will be written by an in-flight step.
    num_inflight: sampled tokens scheduled but not yet processed (current admission only).
    num_inflight_steps: unprocessed scheduled steps holding a row of this sequence (any admission); resources of a
        finished sequence are released when this reaches 0.
    prefill_len: tokens prefilled by the current admission (prompt + outputs known at admission; 0 while waiting).
    num_preemptions: times preempted; also the "epoch" stamped on rows to recognise stale ones.
    state_slot: -1 when none is held.
    """

    request_id: Any
    prompt_token_ids: list[int]
    sampling_params: Any
    eos_token_ids: tuple[int, ...]
    arrival_index: int
    max_tokens: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_computed_tokens: int = 0
    num_inflight: int = 0
    num_inflight_steps: int = 0
    prefill_len: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int = -1
    num_preemptions: int = 0
    # (step_id, row_index) of the row that samples the newest in-flight token
    last_sample_src: tuple[int, int] | None = None
    # speculative decoding: the drafter has published drafts for this admission in the sequence's state slot
    has_drafts: bool = False
    # speculative decoding: drafts verified by the newest in-flight sampling row (0 for a prefill row), and the row
    # scheduled behind an in-flight verify row whose start waits for that row's accepted count (see ScheduledRow)
    inflight_drafts: int = 0
    chained_row: ScheduledRow | None = None
    # confidence-scheduled verification: (step_id, acceptance rates [k]) of the drafts its latest steps published
    draft_rates: list[tuple[int, Any]] = field(default_factory=list)
    # False: a preemption ends the request ("preempted") even under preemption_mode="recompute" (structured
    # outputs: their grammar state is not replayed, as in DeepInfer)
    recomputable: bool = True

    # ---------------------------------------------------------------- derived
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Host-known tokens: prompt + processed outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_total(self) -> int:
        """Known tokens plus sampled tokens still in flight."""
        return self.num_tokens + self.num_inflight

    @property
    def num_output_tokens_total(self) -> int:
        return len(self.output_token_ids) + self.num_inflight

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """Admitted but the prefill is not fully scheduled yet (a chunked prompt)."""
        return self.status is SequenceStatus.RUNNING and self.num_computed_tokens < self.prefill_len

    def token_at(self, pos: int) -> int:
        p = self.prompt_len
        return self.prompt_token_ids[pos] if pos < p else self.output_token_ids[pos - p]

    def known_tokens(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    def snapshot(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_len, tuple(self.output_token_ids), self.finished,
                             self.finish_reason, self.error, self.num_preemptions)


# ---------------------------------------------------------------------------------------------------------------------
# Scheduled step
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class ScheduledRow:
    """One sequence's slice of a step.

    start_pos: absolute position of the row's first query token; num_tokens: query tokens (1 for decode).
    token_ids: prefill -> the chunk's tokens; decode -> [known input token], or None when the input token is the
        in-flight sampled token of row ``input_src = (step_id, row_index)`` of an earlier step.
    sample: the row's last token produces a sampled token (final prefill chunk, or decode); its position is
        ``end_pos``.
    block_ids: snapshot of the block table covering positions < end_pos (exactly blocks_for(end_pos) entries).
    state_slot: the sequence's state slot (never 0). epoch: the sequence's num_preemptions at schedule time.
    accepted_token: set by process_step to the sampled token when it was appended to the sequence's output; None for
        non-sampling and discarded rows (use it to keep per-token side outputs such as logprobs aligned).
    """

    seq: Sequence
    start_pos: int
    num_tokens: int
    token_ids: list[int] | None
    sample: bool
    block_ids: list[int]
    state_slot: int
    input_src: tuple[int, int] | None = None
    epoch: int = 0
    accepted_token: int | None = None
    # speculative decoding: drafts this decode row verifies (num_tokens = 1 + num_drafts; only the first token is in
    # token_ids, the drafts stay on the device); next_token: a non-final prefill chunk's following prompt token (the
    # drafter's input at the chunk's last position); accepted_tokens: every token process_step appended for the row
    num_drafts: int = 0
    next_token: int = 0
    accepted_tokens: list[int] | None = None
    # speculative decoding, asynchronous loop: a decode row scheduled while the sequence's verify row (in the step
    # just before) is in flight. Its true start is ``start_pos`` plus the drafts that row accepts (s), and it
    # verifies ``min(num_drafts, draft_room − s)`` drafts, as it would once the host knew s: the device applies both
    # (docs/spec/engine.md §4, DeepInfer's ZOS correction). ``slack``: how far past ``end_pos`` its positions may
    # reach while chained (the blocks and page table cover it). Processing the earlier row fixes ``start_pos`` /
    # ``num_drafts`` on the host and clears ``chained`` (``slack`` is then unused).
    chained: bool = False
    slack: int = 0
    draft_room: int = 0

    @property
    def request_id(self) -> Any:
        return self.seq.request_id

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens

    @property
    def reach_pos(self) -> int:
        """One past the furthest position the row may write: ``end_pos``, plus ``slack`` while chained (the device
        may move its start up by that much)."""
        return self.end_pos + (self.slack if self.chained else 0)

    @property
    def is_first_chunk(self) -> bool:
        """start_pos == 0: the state slot must be (re)initialised, not read."""
        return self.start_pos == 0


@dataclass(eq=False)
class ScheduledStep:
    """One planned device step: all-prefill or all-decode rows; ``step_id`` counts steps from 0 in schedule order."""

    step_id: int
    kind: Literal["prefill", "decode"]
    rows: list[ScheduledRow]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def num_sampling_rows(self) -> int:
        return sum(1 for r in self.rows if r.sample)
