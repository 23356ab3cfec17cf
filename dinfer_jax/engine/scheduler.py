"""Host-side request scheduler (the policy): FCFS prefill admission, chunked prefill, decode, preemption, and
one-step-late ("ZOS") output processing over the records of :mod:`dinfer_jax.engine.records`.

Ports the semantics (not the code) of DeepInfer's ``csrc/engine/scheduler.hpp`` / ``sequence.hpp`` / ``zos.cpp``
and ``deepinfer/engine/llm_engine.py`` (``docs/spec/engine.md`` §2, §3, §4, §12, §14). Pure Python; no jax.
The step-loop contract, the lengths under the one-step lag, resource release and every policy are described in
``docs/architecture.md`` ("Scheduler").
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

from .block_manager import BlockManager, StateSlots
from .records import (
    FINISH_REASONS,
    NONFINITE_TOKEN,
    RequestOutput,
    ScheduledRow,
    ScheduledStep,
    Sequence,
    SequenceStatus,
)

__all__ = [
    "FINISH_REASONS",
    "RequestOutput",
    "ScheduledRow",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
]

PREEMPTION_MODES = ("stop", "recompute")


def _is_int(x: object) -> bool:
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


# The speculative decode step's draft cap: called with the step's id and, per granted row, (sequence, drafts it
# could verify, one past the furthest position it could write); returns the most drafts any row verifies.
DraftWidthPolicy = Callable[[int, list[tuple["Sequence", int, int]]], int]


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class SchedulerConfig:
    """Scheduler limits and policies.

    max_num_seqs: at most this many sequences hold resources as running or partially prefilled (= max decode rows).
    max_num_batched_tokens: query tokens per step (prefill chunk budget); must be >= max_num_seqs.
    max_model_len: a sequence (prompt + generated) never exceeds this many tokens.
    block_size: tokens per KV block; must equal the BlockManager's.
    enable_chunked_prefill: split prompts longer than the remaining budget.
    preemption_mode: "stop" (DeepInfer default) or "recompute".
    prefill_attempt_interval: attempt prefill when (decode steps since the last prefill step) % interval == 0
        (DeepInfer DEEPINFER_PREFILL_ATTEMPT_INTERVAL = 70; default 1 = before every step).
    max_consecutive_prefill_steps: force a decode step (if any sequence can decode) after this many prefill steps in
        a row; None = no cap (DeepInfer).
    prefill_kv_watermark: admit new prompts only while used/usable KV blocks <= this, unless nothing can decode
        (DeepInfer GPU_CACHE_PREFILL_WATERMARK = 0.9; default 1.0 = off).
    max_prefill_seqs: rows per prefill step (default max_num_seqs); the engine sets it to its largest compiled
        prefill batch.
    cp_align: DeepInfer's ``cp_align`` (``2·cp_size`` with context parallelism, else 1): a prompt is chunked only
        when it exceeds the remaining budget rounded down to a multiple of it, the chunk then being that multiple,
        and each row charges the budget its length rounded up to it (``docs/spec/engine.md`` §3, §9).
    num_speculative_tokens: k > 0 turns on speculative decoding: a decode row of a sequence whose drafts are
        published verifies up to k of them (fewer near max_model_len / max_tokens), blocks are reserved for them,
        and process_step takes the row's emitted run (a list of ints). Under the asynchronous loop a sequence
        whose verify row is in flight gets its next row chained behind it (the device corrects its start by the
        drafts that row accepts; ``ScheduledRow.chained``). The Scheduler's ``draft_width`` policy may cap the
        drafts of a decode step's rows (confidence-scheduled verification).
    yoco_split_keep: k > 0 (V4.1 ``yoco="compact"``): a prefill chunk never straddles a sequence's kept suffix
        ``[prefill_len − k, prefill_len)``, so a step's rows lie either all below it or reach into it.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    preemption_mode: str = "stop"
    prefill_attempt_interval: int = 1
    max_consecutive_prefill_steps: int | None = None
    prefill_kv_watermark: float = 1.0
    max_prefill_seqs: int | None = None
    cp_align: int = 1
    num_speculative_tokens: int = 0  # drafts verified per decode row (0: no speculative decoding); sync loop only
    yoco_split_keep: int = 0

    def __post_init__(self) -> None:
        if self.max_prefill_seqs is None:
            self.max_prefill_seqs = self.max_num_seqs
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "prefill_attempt_interval", "max_prefill_seqs", "cp_align"):
            v = getattr(self, name)
            if not _is_int(v):
                raise TypeError(f"SchedulerConfig.{name} must be an int, got {v!r}")
            setattr(self, name, operator.index(v))
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {v}")
        if self.max_model_len < 2:
            raise ValueError(f"SchedulerConfig.max_model_len must be >= 2 (a 1-token prompt plus 1 generated token), "
                             f"got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): a decode step has one token per running sequence")
        if self.cp_align > self.max_num_batched_tokens:
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"cp_align ({self.cp_align}): a prefill chunk is a multiple of cp_align")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise TypeError(
                f"SchedulerConfig.enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"SchedulerConfig.preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        m = self.max_consecutive_prefill_steps
        if m is not None:
            if not _is_int(m) or operator.index(m) < 1:
                raise ValueError(
                    f"SchedulerConfig.max_consecutive_prefill_steps must be None or an int >= 1, got {m!r}")
            self.max_consecutive_prefill_steps = operator.index(m)
        w = self.prefill_kv_watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0.0 < float(w) <= 1.0):
            raise ValueError(f"SchedulerConfig.prefill_kv_watermark must be in (0, 1], got {w!r}")

    @property
    def max_prefill_len(self) -> int:
        """Longest prompt accepted: room for one generated token, and the whole budget if prompts cannot be split."""
        limit = self.max_model_len - 1
        return limit if self.enable_chunked_prefill else min(limit, self.max_num_batched_tokens)


# ---------------------------------------------------------------------------------------------------------------------
# Scheduler
# ---------------------------------------------------------------------------------------------------------------------
class Scheduler:
    """FCFS prefill/decode scheduler with chunked prefill, preemption and one-step-late output processing."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, state_slots: StateSlots,
                 vocab_size: int, draft_width: DraftWidthPolicy | None = None) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        if block_manager.block_size != config.block_size:
            raise ValueError(f"block size mismatch: config {config.block_size}, "
                             f"block manager {block_manager.block_size}")
        if not _is_int(vocab_size) or operator.index(vocab_size) < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        self.config = config
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.vocab_size = operator.index(vocab_size)
        # speculative decoding: picks the most drafts each row of a decode step verifies (confidence-scheduled
        # verification, engine/spec_schedule.py); None: every row verifies all it can
        self.draft_width = draft_width
        self._draft_cap: int | None = None

        self.waiting: deque[Sequence] = deque()  # not admitted, FCFS (recompute victims at the front)
        self.prefilling: list[Sequence] = []  # admitted, prefill partially scheduled (at most one)
        self.running: list[Sequence] = []  # admitted, prefill fully scheduled; in admission order
        self._inflight: deque[ScheduledStep] = deque()
        self._finished_outbox: list[Sequence] = []
        self._live: dict[Any, Sequence] = {}
        self._stopping: dict[Sequence, str] = {}  # stop-mode victims waiting for their in-flight rows
        self._draining: set[Sequence] = set()  # finished, resources held until their in-flight steps are processed
        self._next_step_id = 0
        self._next_arrival = 0
        self._decode_steps_since_prefill = 0
        self._consecutive_prefill_steps = 0
        # statistics
        self.num_preemptions = 0
        self.num_discarded_rows = 0

    # ================================================================= requests
    def add_request(self, request_id: Any, prompt_token_ids: Iterable[int], sampling_params: Any = None,
                    eos_token_ids: int | Iterable[int] | None = ()) -> Sequence:
        """Queue a request (FCFS). An invalid request is returned already FINISHED with finish_reason "error"."""
        arrival = self._next_arrival
        self._next_arrival += 1
        errors: list[str] = []

        prompt: list[int] = []
        try:
            raw = list(prompt_token_ids)
        except TypeError:
            raw = None
            errors.append(f"prompt_token_ids is not a sequence (got {type(prompt_token_ids).__name__})")
        if raw is not None:
            bad = [(i, t) for i, t in enumerate(raw) if not _is_int(t)]
            if bad:
                errors.append(f"prompt_token_ids[{bad[0][0]}] = {bad[0][1]!r} is not an int")
            else:
                prompt = [operator.index(t) for t in raw]

        try:
            eos = (() if eos_token_ids is None else
                   (operator.index(eos_token_ids),) if _is_int(eos_token_ids) else
                   tuple(operator.index(t) for t in eos_token_ids))
        except TypeError:
            eos = ()
            errors.append(f"eos_token_ids must be an int or a sequence of ints, got {eos_token_ids!r}")

        max_tokens = getattr(sampling_params, "max_tokens", None)
        if max_tokens is not None:
            if not _is_int(max_tokens) or operator.index(max_tokens) < 1:
                errors.append(f"sampling_params.max_tokens must be None or an int >= 1, got {max_tokens!r}")
                max_tokens = None
            else:
                max_tokens = operator.index(max_tokens)
        stop_ids_raw = getattr(sampling_params, "stop_token_ids", None) or ()
        try:
            stop_ids = frozenset(operator.index(t) for t in stop_ids_raw)
        except TypeError:
            stop_ids = frozenset()
            errors.append(f"sampling_params.stop_token_ids must be a sequence of ints, got {stop_ids_raw!r}")
        ignore_eos = bool(getattr(sampling_params, "ignore_eos", False))
        recomputable = getattr(sampling_params, "so_args", None) is None

        seq = Sequence(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling_params,
                       eos_token_ids=eos, arrival_index=arrival, max_tokens=max_tokens, stop_token_ids=stop_ids,
                       ignore_eos=ignore_eos, recomputable=recomputable)

        if not errors:
            errors.extend(self._validate_prompt(prompt))
        if not errors and request_id in self._live:
            errors.append(f"request_id {request_id!r} is already in use by an unfinished request")
        if errors:
            self._finish(seq, "error", f"request {request_id!r}: " + "; ".join(errors), report=False)
            return seq
        self._live[request_id] = seq
        self.waiting.append(seq)
        return seq

    def _validate_prompt(self, prompt: list[int]) -> list[str]:
        cfg = self.config
        n = len(prompt)
        if n == 0:
            return ["empty prompt"]
        errors = []
        bad = next(((i, t) for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            errors.append(f"prompt token id {bad[1]} at index {bad[0]} is outside the vocabulary "
                          f"[0, {self.vocab_size})")
        if n > cfg.max_model_len - 1:
            errors.append(f"prompt has {n} tokens but max_model_len is {cfg.max_model_len}; a prompt may have at most "
                          f"max_model_len - 1 = {cfg.max_model_len - 1} tokens (room for one generated token)")
        elif not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            errors.append(f"prompt has {n} tokens, more than max_num_batched_tokens = {cfg.max_num_batched_tokens}, "
                          f"and chunked prefill is disabled")
        need = self.block_manager.blocks_for(n)
        if need > self.block_manager.capacity:
            errors.append(f"prompt needs {need} KV blocks of {self.config.block_size} tokens but the pool has only "
                          f"{self.block_manager.capacity} usable blocks; it can never be scheduled")
        return errors

    def fail(self, request_id: Any, message: str) -> Sequence | None:
        """Finish a live request with finish_reason "error" and ``message`` (e.g. its grammar failed); reported by
        take_finished. Its in-flight rows are discarded when processed."""
        seq = self._live.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "error", message)
        return seq

    def abort(self, request_id: Any) -> Sequence | None:
        """Finish a live request with finish_reason "abort". Its in-flight rows are discarded when processed."""
        seq = self._live.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort", None, report=False)
        return seq

    # ================================================================== queries
    def has_unfinished(self) -> bool:
        """Some request is not finished (waiting, prefilling or running)."""
        return bool(self.waiting or self.prefilling or self.running or self._stopping)

    @property
    def num_inflight_steps(self) -> int:
        """Steps returned by schedule() and not yet passed to process_step()."""
        return len(self._inflight)

    def has_pending_work(self) -> bool:
        return self.has_unfinished() or bool(self._inflight)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running) + len(self._stopping)

    def kv_usage(self) -> float:
        bm = self.block_manager
        return bm.num_used / bm.capacity

    def take_finished(self) -> list[Sequence]:
        """Sequences finished inside schedule() / process_step() since the last drain, in finishing order.

        Together with the return values of add_request() (invalid requests) and abort(), every finished sequence is
        reported exactly once.
        """
        out, self._finished_outbox = self._finished_outbox, []
        return out

    def get_sequence(self, request_id: Any) -> Sequence | None:
        return self._live.get(request_id)

    # ================================================================= schedule
    def schedule(self) -> ScheduledStep | None:
        """Plan the next step (all prefill or all decode), or None if nothing can run now."""
        cfg = self.config
        decodable = [s for s in self.running if self._can_decode(s)]
        if self.config.num_speculative_tokens:
            # a sequence whose row is in flight does not know its next position (the row may accept drafts): it
            # continues only behind a row of the step just scheduled, its start corrected on the device
            decodable = [s for s in decodable if not s.num_inflight or self._can_chain(s)]
        step: ScheduledStep | None = None
        tried_prefill = False
        if self.prefilling or self.waiting:
            turn = self._decode_steps_since_prefill % cfg.prefill_attempt_interval == 0 and (
                cfg.max_consecutive_prefill_steps is None
                or self._consecutive_prefill_steps < cfg.max_consecutive_prefill_steps)
            if turn or not decodable:
                tried_prefill = True
                step = self._schedule_prefill(decode_possible=bool(decodable))
        if step is None and decodable:
            step = self._schedule_decode(decodable)
        if step is None and (self.prefilling or self.waiting) and (not tried_prefill or self.waiting):
            # decode impossible, or emptied by preemption (recompute victims may be admissible now)
            step = self._schedule_prefill(decode_possible=False)
        if step is None:
            if self.has_unfinished() and not self._inflight:
                raise RuntimeError("scheduler stalled: unfinished requests but nothing schedulable and nothing in "
                                   "flight (internal error)")
            return None
        if step.kind == "prefill":
            self._consecutive_prefill_steps += 1
            self._decode_steps_since_prefill = 0
        else:
            self._consecutive_prefill_steps = 0
            self._decode_steps_since_prefill += 1
        for row in step.rows:
            row.seq.num_inflight_steps += 1
        self._inflight.append(step)
        return step

    def _can_decode(self, seq: Sequence) -> bool:
        if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens < seq.prefill_len:
            return False
        # a length limit already reached by in-flight tokens: it will finish when they are processed
        if seq.max_tokens is not None and seq.num_output_tokens_total >= seq.max_tokens:
            return False
        return seq.num_tokens_total < self.config.max_model_len

    def _can_chain(self, seq: Sequence) -> bool:
        """Whether ``seq``, with a sampling row in flight, may get a decode row now (speculative decoding): only
        behind one row, of the step scheduled last (the device reads that step's outputs), and only if every
        position the new row can reach — its start moves up by the drafts the in-flight row accepts — stays inside
        ``max_model_len`` and the in-flight row cannot end the request by length."""
        src = seq.last_sample_src
        if seq.num_inflight != 1 or src is None or src[0] != self._next_step_id - 1:
            return False
        worst = seq.num_tokens_total + seq.inflight_drafts      # tokens known once the in-flight run is all accepted
        if worst >= self.config.max_model_len:
            return False
        return seq.max_tokens is None or seq.num_output_tokens_total + seq.inflight_drafts < seq.max_tokens

    def _new_step(self, kind: str, rows: list[ScheduledRow]) -> ScheduledStep:
        step = ScheduledStep(self._next_step_id, kind, rows)  # type: ignore[arg-type]
        self._next_step_id += 1
        for i, row in enumerate(rows):
            if row.sample:
                row.seq.last_sample_src = (step.step_id, i)
        return step

    # ---------------------------------------------------------------- prefill
    def _schedule_prefill(self, decode_possible: bool) -> ScheduledStep | None:
        cfg, bm, slots = self.config, self.block_manager, self.state_slots
        budget = cfg.max_num_batched_tokens
        rows: list[ScheduledRow] = []

        # 1. the partially prefilled sequence continues first (it already holds its blocks and slot)
        assert len(self.prefilling) <= 1
        if self.prefilling:
            seq = self.prefilling[0]
            n = self._split_at_floor(seq.prefill_len, seq.num_computed_tokens,
                                     self._chunk_len(seq.prefill_len - seq.num_computed_tokens, budget))
            rows.append(self._prefill_row(seq, n))
            budget -= self._charge(n)
            if seq.is_prefilling:
                return self._new_step("prefill", rows)  # still chunked: it ends the batch
            self.prefilling.remove(seq)
            self.running.append(seq)

        # 2. FCFS admission
        admit = not (decode_possible and self.kv_usage() > cfg.prefill_kv_watermark)
        while admit and self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + len(self.prefilling) >= cfg.max_num_seqs:
                break
            if len(rows) >= cfg.max_prefill_seqs:
                break  # rows per prefill step (the largest compiled prefill batch)
            plen = seq.num_tokens  # prompt (+ outputs kept by a recompute preemption)
            need = bm.blocks_for(plen)
            recompute = seq.num_preemptions > 0
            if need > bm.capacity or plen > cfg.max_prefill_len:  # NEVER
                self.waiting.popleft()
                if recompute:
                    self._finish(seq, "preempted", f"request {seq.request_id!r}: preempted; its {plen} tokens no "
                                 f"longer fit a recompute prefill")
                else:
                    self._finish(seq, "error", f"request {seq.request_id!r}: prompt of {plen} tokens can never be "
                                 f"scheduled ({need} blocks needed, {bm.capacity} usable)")
                continue
            n = self._split_at_floor(plen, 0, self._chunk_len(plen, budget))
            if n == 0 or (not cfg.enable_chunked_prefill and n < plen):
                break  # no room for an aligned chunk / the whole prompt next step
            if bm.num_free < need or slots.num_free < 1:
                break  # LATER: head-of-line blocking keeps FCFS
            self.waiting.popleft()
            seq.block_ids = bm.allocate(need)
            seq.state_slot = slots.allocate()
            seq.status = SequenceStatus.RUNNING
            seq.prefill_len = plen
            seq.num_computed_tokens = 0
            seq.num_inflight = 0
            rows.append(self._prefill_row(seq, n))
            budget -= self._charge(n)
            if seq.is_prefilling:
                self.prefilling.append(seq)
                break  # a chunked sequence ends the batch
            self.running.append(seq)

        return self._new_step("prefill", rows) if rows else None

    def _chunk_len(self, remaining: int, budget: int) -> int:
        """Tokens of a prompt with ``remaining`` tokens left that fit ``budget``: all of them when they fit the
        budget rounded down to ``cp_align``, else that rounded budget (DeepInfer ``_schedule_prefill``)."""
        a = self.config.cp_align
        room = max(budget, 0) // a * a
        return remaining if remaining <= room else room

    def _split_at_floor(self, prefill_len: int, start: int, n: int) -> int:
        """``n`` cut so that a chunk from ``start`` ends at the kept suffix's floor when it would cross it
        (``yoco_split_keep``)."""
        floor = prefill_len - self.config.yoco_split_keep
        if self.config.yoco_split_keep and start < floor < start + n:
            return floor - start
        return n

    def _charge(self, n: int) -> int:
        """Budget a row of ``n`` tokens uses: ``n`` rounded up to ``cp_align``."""
        a = self.config.cp_align
        return -(-n // a) * a

    def _prefill_row(self, seq: Sequence, n: int) -> ScheduledRow:
        start = seq.num_computed_tokens
        end = start + n
        assert 0 < n and end <= seq.prefill_len
        sample = end == seq.prefill_len
        row = ScheduledRow(seq=seq, start_pos=start, num_tokens=n, token_ids=seq.known_tokens(start, end),
                           sample=sample, block_ids=seq.block_ids[:self.block_manager.blocks_for(end)],
                           state_slot=seq.state_slot, input_src=None, epoch=seq.num_preemptions,
                           next_token=seq.token_at(end) if end < seq.num_tokens else 0)
        seq.num_computed_tokens = end
        if sample:
            seq.num_inflight += 1
            seq.inflight_drafts = 0
        return row

    # ----------------------------------------------------------------- decode
    def _schedule_decode(self, candidates: list[Sequence]) -> ScheduledStep | None:
        bm = self.block_manager
        order = sorted(candidates, key=lambda s: (s.num_output_tokens_total, s.arrival_index))
        # Blocks that processing the in-flight steps will certainly free: held by finished sequences still referenced
        # by an in-flight step, and by running sequences whose in-flight tokens reach a length limit. Always 0 in
        # synchronous mode. A sequence that could grow into them sits this step out instead of preempting anyone.
        soon_free = sum(len(s.block_ids) for s in self._draining)
        soon_free += sum(len(s.block_ids) for s in self.running if not s.is_prefilling and not self._can_decode(s))
        lo, hi = 0, len(order)
        granted: list[Sequence] = []
        victims: list[Sequence] = []
        while lo < hi:
            seq = order[lo]
            lo += 1
            # (negative after a step narrower than its reservation: the sequence already holds those blocks)
            need = max(0, bm.blocks_for(seq.num_computed_tokens + 1 + self._reach(seq)) - len(seq.block_ids))
            assert need <= 2 + 2 * self.config.num_speculative_tokens, need
            if need:
                if bm.num_free < need and soon_free >= need:
                    soon_free -= need  # wait one step for the lagging release
                    continue
                while bm.num_free < need and hi > lo:
                    hi -= 1
                    victims.append(order[hi])
                    self._preempt(order[hi])
                if bm.num_free < need:
                    victims.append(seq)
                    self._preempt(seq)
                    continue
                seq.block_ids.extend(bm.allocate(need))
            granted.append(seq)
        requeue = sorted((v for v in victims if v.status is SequenceStatus.WAITING), key=lambda s: s.arrival_index)
        self.waiting.extendleft(reversed(requeue))
        if not granted:
            return None
        granted.sort(key=lambda s: s.arrival_index)
        if self.draft_width is not None and self.config.num_speculative_tokens:
            # blocks above were reserved for every draft: a narrower step leaves a few of them for the next steps
            self._draft_cap = self.draft_width(self._next_step_id, [
                (seq, self._num_drafts(seq), seq.num_computed_tokens + 1 + self._reach(seq)) for seq in granted])
        try:
            rows = self._decode_rows(granted)
        finally:
            self._draft_cap = None
        return self._new_step("decode", rows)

    def _decode_rows(self, granted: list[Sequence]) -> list[ScheduledRow]:
        rows = []
        for seq in granted:
            pos = seq.num_computed_tokens
            if pos < seq.num_tokens:
                tokens, src = [seq.token_at(pos)], None
            else:
                assert pos == seq.num_tokens_total - 1 and seq.last_sample_src is not None
                tokens, src = None, seq.last_sample_src
            nd, shift = self._num_drafts(seq), self._max_shift(seq)
            row = ScheduledRow(seq=seq, start_pos=pos, num_tokens=1 + nd, token_ids=tokens, sample=True,
                               block_ids=list(seq.block_ids), state_slot=seq.state_slot, input_src=src,
                               epoch=seq.num_preemptions, num_drafts=nd, chained=shift > 0,
                               slack=self._reach(seq) - nd, draft_room=self._draft_room(seq))
            rows.append(row)
            if shift:
                seq.chained_row = row
            seq.num_computed_tokens = pos + 1
            seq.num_inflight += 1
            seq.inflight_drafts = nd
        return rows

    @staticmethod
    def _max_shift(seq: Sequence) -> int:
        """How far the device may move a new decode row's start: the drafts its in-flight verify row may accept."""
        return seq.inflight_drafts if seq.num_inflight else 0

    def _draft_room(self, seq: Sequence) -> int:
        """Emitted tokens (minus one) that still fit max_model_len and max_tokens after what the host knows of
        ``seq``, counting an in-flight row as one token (its accepted drafts, up to :meth:`_max_shift`, come off on
        the device)."""
        room = self.config.max_model_len - 1 - seq.num_tokens_total
        if seq.max_tokens is not None:
            room = min(room, seq.max_tokens - seq.num_output_tokens_total - 1)
        return room

    def _num_drafts(self, seq: Sequence) -> int:
        """Drafts a decode row of ``seq`` verifies now (at most: a chained row verifies fewer when the row it
        follows accepts drafts): k once the drafter has published drafts for it (or will have, in the in-flight
        step the row follows), fewer where its emitted run (drafts + 1) would pass max_model_len or max_tokens."""
        k = self.config.num_speculative_tokens
        if not k or not (seq.has_drafts or seq.num_inflight):
            return 0
        if self._draft_cap is not None:
            k = min(k, self._draft_cap)
        return max(0, min(k, self._draft_room(seq)))

    def _reach(self, seq: Sequence) -> int:
        """The furthest position a new decode row of ``seq`` can write, minus its start: its drafts, or for a
        chained row the largest ``shift + min(drafts, room − shift)`` (at least the full shift: _can_chain keeps
        that inside max_model_len)."""
        nd, shift = self._num_drafts(seq), self._max_shift(seq)
        if not shift:
            return nd
        return max(min(shift + nd, self._draft_room(seq)), shift)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt a RUNNING sequence: release its blocks/slot now, then stop it or requeue it for recompute.

        Tokens its in-flight rows sample are still accepted while it is not re-admitted (see process_step); a stopped
        victim with rows in flight is parked in ``_stopping`` and finishes "preempted" once they are processed (or
        earlier, "stop"/"length", if one of those tokens ends it), so it keeps every token computed for it.
        """
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        bm, cfg = self.block_manager, self.config
        total = seq.num_tokens_total
        can_progress = bm.blocks_for(total + 1) <= bm.capacity and total <= cfg.max_prefill_len
        seq.num_preemptions += 1  # also the epoch: rows scheduled before now become stale
        seq.num_computed_tokens = 0
        seq.num_inflight = 0
        seq.prefill_len = 0
        seq.last_sample_src = None
        seq.has_drafts = False
        seq.inflight_drafts = 0
        seq.chained_row = None
        seq.draft_rates.clear()
        if cfg.preemption_mode == "stop" or not can_progress or not seq.recomputable:
            why = ("" if cfg.preemption_mode == "stop" else
                   " (structured-output requests are not recomputed)" if not seq.recomputable else
                   " (recompute could not make progress in this KV pool)")
            msg = f"request {seq.request_id!r}: preempted for lack of KV blocks{why}"
            if seq.num_inflight_steps == 0:
                self._finish(seq, "preempted", msg)
            else:
                self._stopping[seq] = msg
            return
        seq.status = SequenceStatus.WAITING
        # the caller puts it back at the front of `waiting`

    # ================================================================== process
    def process_step(self, step: ScheduledStep, sampled_token_ids: SequenceABC[int | None]) -> list[Sequence]:
        """Consume the sampled tokens of the oldest in-flight step.

        ``sampled_token_ids`` has one entry per row (a list or a numpy array): an int for every sampling row (the value
        is ignored for rows that are discarded), anything (None) for non-sampling rows. Malformed input raises
        ValueError before anything changes. Returns the sequences finished inside schedule() / process_step() since
        the last drain (see take_finished).
        """
        if not self._inflight or self._inflight[0] is not step:
            raise ValueError(f"process_step got step {getattr(step, 'step_id', step)!r}, expected the oldest in-flight "
                             f"step {self._inflight[0].step_id if self._inflight else None}; steps must be processed "
                             f"once each, in schedule order")
        if len(sampled_token_ids) != len(step.rows):
            raise ValueError(f"step {step.step_id} has {len(step.rows)} rows but {len(sampled_token_ids)} sampled "
                             f"token ids were given")
        for i, row in enumerate(step.rows):
            if row.sample and row.num_drafts and not (isinstance(sampled_token_ids[i], (list, tuple))
                                                      and sampled_token_ids[i]
                                                      and all(_is_int(t) for t in sampled_token_ids[i])):
                raise ValueError(f"step {step.step_id} row {i} (request {row.request_id!r}) verifies drafts: "
                                 f"expected a non-empty list of ints, got {sampled_token_ids[i]!r}")
            if row.sample and not row.num_drafts and not _is_int(sampled_token_ids[i]):
                raise ValueError(f"step {step.step_id} row {i} (request {row.request_id!r}) samples a token but got "
                                 f"{sampled_token_ids[i]!r}")
        self._inflight.popleft()
        for i, row in enumerate(step.rows):
            seq = row.seq
            seq.num_inflight_steps -= 1
            if seq.finished:
                self.num_discarded_rows += 1
            elif row.epoch != seq.num_preemptions:
                # scheduled before a preemption: keep a sampled token only if it is exactly the next token of a victim
                # that has not been re-admitted (it was computed from a complete, correct context)
                not_readmitted = seq.status is SequenceStatus.WAITING or seq in self._stopping
                if row.sample and not row.num_drafts and not_readmitted and row.end_pos == seq.num_tokens:
                    self._accept(seq, row, sampled_token_ids[i], step.step_id)
                else:
                    self.num_discarded_rows += 1
            elif row.sample and row.num_drafts:
                assert row.start_pos + 1 == seq.num_tokens, (row.start_pos, seq.num_tokens)
                seq.num_inflight -= 1
                run = list(sampled_token_ids[i])[: row.num_drafts + 1]
                row.accepted_tokens = []
                for tok in run:  # stop conditions after each token: the rest of the run is dropped
                    before = len(seq.output_token_ids)
                    self._accept(seq, row, tok, step.step_id)
                    if len(seq.output_token_ids) > before:
                        row.accepted_tokens.append(int(tok))
                    if seq.finished:
                        break
                else:
                    seq.num_computed_tokens += len(run) - 1  # accepted drafts' KV is committed
                    nxt = seq.chained_row
                    if nxt is not None:   # the row behind this one now knows its start (the device did the same)
                        shift = len(run) - 1
                        nxt.start_pos += shift
                        nxt.num_drafts = max(0, min(nxt.num_drafts, nxt.draft_room - shift))
                        nxt.num_tokens = 1 + nxt.num_drafts
                        nxt.chained, seq.chained_row = False, None
            elif row.sample:
                assert row.end_pos == seq.num_tokens, (row.end_pos, seq.num_tokens)
                seq.num_inflight -= 1
                self._accept(seq, row, sampled_token_ids[i], step.step_id)
                if self.config.num_speculative_tokens and not seq.finished:
                    seq.has_drafts = True  # the drafter ran in this step and published for the slot
            if seq.num_inflight_steps == 0:
                if seq in self._stopping:
                    self._finish(seq, "preempted", self._stopping[seq])
                elif seq.finished:
                    self._release(seq)
        return self.take_finished()

    def _accept(self, seq: Sequence, row: ScheduledRow, token: int, step_id: int) -> None:
        token = operator.index(token)
        if token == NONFINITE_TOKEN:
            self._finish(seq, "error", f"request {seq.request_id!r}: the model's logits were not finite (NaN or inf) "
                         f"for output token {len(seq.output_token_ids)} (position {seq.num_tokens}, step {step_id})")
            return
        if not 0 <= token < self.vocab_size:
            self._finish(seq, "error", f"request {seq.request_id!r}: sampled token id {token} outside the vocabulary "
                         f"[0, {self.vocab_size})")
            return
        seq.output_token_ids.append(token)
        row.accepted_token = token
        if token in seq.stop_token_ids or (not seq.ignore_eos and token in seq.eos_token_ids):
            self._finish(seq, "stop", None)
        elif seq.max_tokens is not None and len(seq.output_token_ids) >= seq.max_tokens:
            self._finish(seq, "length", None)
        elif seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, "length", None)

    # =============================================================== lifecycle
    def _finish(self, seq: Sequence, reason: str, error: str | None, report: bool = True) -> None:
        assert reason in FINISH_REASONS and not seq.finished
        if seq.status is SequenceStatus.WAITING:
            if seq in self.waiting:
                self.waiting.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self._stopping.pop(seq, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if self._live.get(seq.request_id) is seq:
            del self._live[seq.request_id]
        if report:  # add_request() / abort() report through their return value instead
            self._finished_outbox.append(seq)
        if seq.num_inflight_steps == 0:
            self._release(seq)
        elif seq.block_ids or seq.state_slot != -1:
            self._draining.add(seq)  # released by process_step once its last in-flight step is processed

    def _release(self, seq: Sequence) -> None:
        self._draining.discard(seq)
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        if seq.state_slot != -1:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = -1
