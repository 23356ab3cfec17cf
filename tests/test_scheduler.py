"""Host scheduler tests: block pools, FCFS/budget/chunked prefill, decode growth, preemption, stop conditions,
request validation, and the asynchronous (one-step-late) processing order against the synchronous one.

A fake in-order "device" executes each step at dispatch time: it resolves in-flight decode inputs from the previous
step's sampled tokens (row.input_src), writes (request, position, token) into a paged KV store through the row's
block table, and then checks that every position the row attends to holds this request's correct token, i.e. block
tables never alias live data and the planned lengths are right. Sampled tokens are a deterministic function of
(request_id, position), so every request's output is independent of batching and of the processing order.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from dinfer_jax.engine.block_manager import NULL_BLOCK, AllocStatus, BlockManager, StateSlots
from dinfer_jax.engine.scheduler import (
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)

VOCAB = 1000
EOS = 1


@dataclass
class SP:
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    so_args: dict | None = None  # structured output: the scheduler only reads whether it is set


def tok(rid: int, pos: int) -> int:
    """The deterministic 'model': token sampled at position pos of request rid (never EOS or 0)."""
    return (rid * 7919 + pos * 104729 + 17) % (VOCAB - 2) + 2


def prompt_of(rid: int, n: int) -> list[int]:
    return [(rid * 31 + i * 7) % (VOCAB - 2) + 2 for i in range(n)]


class FakeDevice:
    def __init__(self, sched: Scheduler, token_fn=tok, overrides: dict[tuple[int, int], int] | None = None):
        self.sched = sched
        self.bs = sched.config.block_size
        self.token_fn = token_fn
        self.overrides = overrides if overrides is not None else {}
        self.kv: dict[tuple[int, int], tuple] = {}
        self.state: dict[int, tuple] = {}
        self.outputs: dict[int, list] = {}
        self.prompts: dict = {}

    def sample(self, rid, pos):
        return self.overrides.get((rid, pos), self.token_fn(rid, pos))

    def expected(self, seq: Sequence, pos: int) -> int:
        p = seq.prompt_token_ids
        return p[pos] if pos < len(p) else self.sample(seq.request_id, pos)

    def run(self, step: ScheduledStep) -> list:
        out = []
        for row in step.rows:
            seq, rid = row.seq, row.seq.request_id
            if row.token_ids is None:
                assert step.kind == "decode" and row.input_src is not None
                sid, ri = row.input_src
                assert sid == step.step_id - 1, "one step of lag: the input comes from the previous step"
                toks = [self.outputs[sid][ri]]
                assert toks[0] is not None
            else:
                assert row.input_src is None
                toks = list(row.token_ids)
            assert len(toks) == row.num_tokens
            assert len(row.block_ids) == math.ceil(row.end_pos / self.bs), "block table covers exactly < end_pos"
            assert NULL_BLOCK not in row.block_ids and row.state_slot > 0
            # per-sequence state slot: must continue from where this sequence left it
            if row.start_pos == 0:
                self.state[row.state_slot] = (rid, 0)
            assert self.state[row.state_slot] == (rid, row.start_pos), "state slot aliased / out of order"
            self.state[row.state_slot] = (rid, row.end_pos)
            for j, t in enumerate(toks):
                p = row.start_pos + j
                self.kv[(row.block_ids[p // self.bs], p % self.bs)] = (rid, p, t)
            for p in range(row.end_pos):  # "attention" reads every earlier position
                assert self.kv[(row.block_ids[p // self.bs], p % self.bs)] == (rid, p, self.expected(seq, p)), (
                    f"request {rid} position {p}: wrong KV")
            out.append(self.sample(rid, row.end_pos) if row.sample else None)
        self.outputs[step.step_id] = out
        self.outputs.pop(step.step_id - 3, None)
        return out


def check_step(sched: Scheduler, step: ScheduledStep) -> None:
    cfg = sched.config
    assert step.kind in ("prefill", "decode") and step.rows
    assert step.num_tokens <= cfg.max_num_batched_tokens
    assert len(step.rows) <= cfg.max_num_seqs
    seqs = [r.seq for r in step.rows]
    assert len({id(s) for s in seqs}) == len(seqs)
    blocks = [b for r in step.rows for b in r.block_ids]
    assert len(blocks) == len(set(blocks)), "two rows share a block"
    assert len({r.state_slot for r in step.rows}) == len(step.rows)
    if step.kind == "decode":
        assert all(r.num_tokens == 1 and r.sample for r in step.rows)
    else:
        assert all(r.token_ids is not None and len(r.token_ids) == r.num_tokens for r in step.rows)
        partial = [i for i, r in enumerate(step.rows) if not r.sample]
        assert len(partial) <= 1 and (not partial or partial[0] == len(step.rows) - 1), "chunked row ends the batch"
        for r in step.rows:
            assert r.sample == (r.end_pos == r.seq.prefill_len)


def drive(sched: Scheduler, device: FakeDevice, mode: str = "async", max_iters: int = 20000, hook=None):
    """Run the loop to completion. Returns (steps, finished, discarded_rows)."""
    inflight: deque = deque()
    steps, finished = [], []
    discarded = 0

    def process_one():
        nonlocal discarded
        old, out = inflight.popleft()
        discarded += sum(1 for r in old.rows if r.seq.finished)
        finished.extend(sched.process_step(old, out))

    it = 0
    while sched.has_unfinished() or inflight:
        it += 1
        assert it < max_iters, "no progress"
        step = sched.schedule()
        if step is None:
            assert inflight or not sched.has_unfinished(), "schedule() returned None with nothing in flight"
        else:
            check_step(sched, step)
            inflight.append((step, device.run(step)))
            steps.append(step)
            if hook:
                hook(sched, step)
        if mode == "sync":
            while inflight:
                process_one()
        else:
            while inflight and (step is None or len(inflight) > 1):
                process_one()
    finished.extend(sched.take_finished())
    return steps, finished, discarded


def make(num_blocks=64, block_size=4, num_slots=None, vocab=VOCAB, **cfg_kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=block_size)
    cfg.update(cfg_kw)
    config = SchedulerConfig(**cfg)
    bm = BlockManager(num_blocks, block_size)
    slots = StateSlots(num_slots if num_slots is not None else config.max_num_seqs * 2 + 1)
    return Scheduler(config, bm, slots, vocab)


def assert_no_leaks(sched: Scheduler) -> None:
    assert not sched.has_unfinished() and sched.num_inflight_steps == 0
    sched.block_manager.assert_all_free()
    sched.state_slots.assert_all_free()


def results(finished):
    return {s.request_id: (tuple(s.output_token_ids), s.finish_reason) for s in finished}


def expected_outputs(rid, prompt_len, n):
    return tuple(tok(rid, prompt_len + k) for k in range(n))


# ---------------------------------------------------------------------------------------------------------------------
# block pools
# ---------------------------------------------------------------------------------------------------------------------
def test_block_manager_fifo_refcounts_and_errors():
    bm = BlockManager(6, 4)
    assert bm.capacity == bm.num_free == 5 and bm.num_blocks == 6
    assert bm.blocks_for(0) == 0 and bm.blocks_for(4) == 1 and bm.blocks_for(5) == 2
    a = bm.allocate(2)
    assert a == [1, 2] and NULL_BLOCK not in a
    b = bm.allocate(2)
    assert b == [3, 4]
    assert bm.alloc_status(1) is AllocStatus.OK
    assert bm.alloc_status(2) is AllocStatus.LATER
    assert bm.alloc_status(6) is AllocStatus.NEVER
    with pytest.raises(RuntimeError):
        bm.allocate(2)
    assert bm.num_free == 1  # all-or-nothing
    bm.free(a)  # reverse order: tail first
    assert bm.free_ids() == [5, 2, 1]
    assert bm.allocate(1) == [5]  # FIFO: front first
    shared = bm.fork(b)
    assert shared == b and bm.refcount(3) == 2
    bm.free(b)
    assert bm.refcount(3) == 1 and 3 not in bm.free_ids()
    bm.free(shared)
    assert bm.free_ids()[-2:] == [4, 3]
    with pytest.raises(ValueError, match="double free"):
        bm.free([3])
    with pytest.raises(ValueError, match="null block"):
        bm.free([0])
    with pytest.raises(ValueError, match="out of range"):
        bm.free([6])
    with pytest.raises(TypeError):
        bm.free([1.0])
    with pytest.raises(ValueError, match="pin free"):
        bm.pin([3])
    # a rejected call changes nothing
    before = (bm.free_ids(), [bm.refcount(i) for i in range(1, 6)])
    with pytest.raises(ValueError):
        bm.free([5, 5])  # refcount 1, freed twice
    assert before == (bm.free_ids(), [bm.refcount(i) for i in range(1, 6)])
    bm.free([5])
    bm.assert_all_free()
    with pytest.raises(ValueError):
        BlockManager(1, 4)


def test_state_slots():
    s = StateSlots(4)
    assert s.capacity == 3
    assert [s.allocate(), s.allocate()] == [1, 2]
    s.free(1)
    assert s.allocate() == 3 and s.allocate() == 1  # FIFO
    assert not s.can_allocate()
    with pytest.raises(RuntimeError):
        s.allocate()
    assert s.fork(2) == 2 and s.refcount(2) == 2
    s.free(2)
    s.free(2)
    with pytest.raises(ValueError, match="double free"):
        s.free(2)
    with pytest.raises(ValueError, match="null slot"):
        s.free(0)
    s.free(1)
    s.free(3)
    s.assert_all_free()


def test_config_validation():
    ok = dict(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16, block_size=4)
    SchedulerConfig(**ok)
    for bad in (dict(max_num_seqs=0), dict(max_num_batched_tokens=1), dict(max_model_len=1), dict(block_size=0),
                dict(preemption_mode="swap"), dict(prefill_attempt_interval=0), dict(max_consecutive_prefill_steps=0),
                dict(prefill_kv_watermark=0.0), dict(prefill_kv_watermark=1.5)):
        with pytest.raises(ValueError):
            SchedulerConfig(**{**ok, **bad})
    with pytest.raises(TypeError):
        SchedulerConfig(**{**ok, "max_num_seqs": 2.0})
    with pytest.raises(ValueError, match="block size mismatch"):
        Scheduler(SchedulerConfig(**ok), BlockManager(8, 8), StateSlots(4), VOCAB)


# ---------------------------------------------------------------------------------------------------------------------
# admission, budget, chunking
# ---------------------------------------------------------------------------------------------------------------------
def test_fcfs_and_max_num_seqs():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64)
    for rid in range(5):
        sched.add_request(rid, prompt_of(rid, 6), SP(max_tokens=3 + rid))
    order = []
    dev = FakeDevice(sched)

    def hook(s, step):
        if step.kind == "prefill":
            order.extend(r.request_id for r in step.rows if r.start_pos == 0)
        assert len(s.running) + len(s.prefilling) <= 2

    _, finished, _ = drive(sched, dev, "sync", hook=hook)
    assert order == [0, 1, 2, 3, 4]
    res = results(finished)
    for rid in range(5):
        assert res[rid] == (expected_outputs(rid, 6, 3 + rid), "length")
    assert_no_leaks(sched)


def test_token_budget_and_chunked_prefill():
    sched = make(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    sched.add_request(0, prompt_of(0, 5), SP(max_tokens=2))
    sched.add_request(1, prompt_of(1, 20), SP(max_tokens=2))
    sched.add_request(2, prompt_of(2, 3), SP(max_tokens=2))
    s1 = sched.schedule()
    assert s1.kind == "prefill"
    assert [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in s1.rows] == [(0, 0, 5, True), (1, 0, 3, False)]
    assert s1.rows[1].token_ids == prompt_of(1, 20)[:3]
    assert s1.rows[1].seq.is_prefilling and s1.rows[1].seq.status is SequenceStatus.RUNNING
    sched.process_step(s1, [tok(0, 5), None])
    s2 = sched.schedule()
    assert s2.kind == "prefill"  # prefill attempted first; the partial sequence continues first and ends the batch
    assert [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in s2.rows] == [(1, 3, 8, False)]
    assert s2.rows[0].token_ids == prompt_of(1, 20)[3:11]
    sched.process_step(s2, [None])
    s3 = sched.schedule()
    assert [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in s3.rows] == [(1, 11, 8, False)]
    sched.process_step(s3, [None])
    s4 = sched.schedule()  # last chunk (1 token) samples, then request 2 fits in the rest of the budget
    assert [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in s4.rows] == [(1, 19, 1, True), (2, 0, 3, True)]
    sched.process_step(s4, [tok(1, 20), tok(2, 3)])
    s5 = sched.schedule()
    assert s5.kind == "decode" and [r.request_id for r in s5.rows] == [0, 1, 2]
    assert [r.token_ids for r in s5.rows] == [[tok(0, 5)], [tok(1, 20)], [tok(2, 3)]]
    done = sched.process_step(s5, [tok(0, 6), tok(1, 21), tok(2, 4)])
    assert {s.request_id for s in done} == {0, 1, 2} and all(s.finish_reason == "length" for s in done)
    assert_no_leaks(sched)


def test_yoco_split_keep_cuts_chunks_at_the_kept_suffix():
    """``yoco_split_keep=k`` (``yoco="compact"``): a prefill chunk never straddles ``prefill_len − k``: prompts longer
    than k are prefilled below it and then their kept suffix; shorter prompts are untouched."""
    sched = make(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, yoco_split_keep=6)
    sched.add_request(0, prompt_of(0, 10), SP(max_tokens=1))   # floor 4
    sched.add_request(1, prompt_of(1, 5), SP(max_tokens=1))    # shorter than k: one chunk
    sched.add_request(2, prompt_of(2, 30), SP(max_tokens=1))   # floor 24: chunks 16, 8, then the suffix 6
    spans = []
    while sched.has_unfinished():
        step = sched.schedule()
        spans.append([(r.request_id, r.start_pos, r.num_tokens) for r in step.rows])
        sched.process_step(step, [tok(r.request_id, r.start_pos + r.num_tokens) if r.sample else None
                                  for r in step.rows])
    assert spans[0] == [(0, 0, 4)]                          # cut at request 0's floor: ends the batch
    assert spans[1] == [(0, 4, 6), (1, 0, 5), (2, 0, 5)]      # its suffix, request 1 whole, request 2's first 5
    assert [s for s in spans[2:] if s and s[0][0] == 2 and len(s) == 1][:3] == [[(2, 5, 16)], [(2, 21, 3)],
                                                                                 [(2, 24, 6)]]
    for rows in spans:
        for rid, start, n in rows:
            floor = {0: 4, 1: -1, 2: 24}[rid]
            assert not start < floor < start + n, f"request {rid}: chunk [{start}, {start + n}) straddles {floor}"
    assert_no_leaks(sched)


def test_chunked_prefill_disabled():
    sched = make(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    bad = sched.add_request(0, prompt_of(0, 9), SP())
    assert bad.finish_reason == "error" and "chunked prefill is disabled" in bad.error
    sched.add_request(1, prompt_of(1, 5), SP(max_tokens=2))
    sched.add_request(2, prompt_of(2, 5), SP(max_tokens=2))  # does not fit the rest of the budget: waits
    s1 = sched.schedule()
    assert [(r.request_id, r.num_tokens) for r in s1.rows] == [(1, 5)]
    dev = FakeDevice(sched)
    finished = sched.process_step(s1, dev.run(s1))
    finished += drive(sched, dev, "sync")[1]
    assert results(finished)[2] == (expected_outputs(2, 5, 2), "length")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_decode_grows_block_tables_exactly(mode):
    sched = make(block_size=4, max_model_len=64)
    seq = sched.add_request(7, prompt_of(7, 6), SP(max_tokens=20))
    seen = []

    def hook(s, step):
        for r in step.rows:
            assert len(r.block_ids) == math.ceil(r.end_pos / 4)
            assert len(seq.block_ids) == math.ceil(seq.num_computed_tokens / 4)
            seen.append(len(r.block_ids))

    _, finished, _ = drive(sched, FakeDevice(sched), mode, hook=hook)
    assert results(finished)[7] == (expected_outputs(7, 6, 20), "length")
    # prefill of 6 tokens: 2 blocks; decode rows feed positions 6..24 -> tables of ceil((pos+1)/4)
    assert seen == [2] + [math.ceil((p + 1) / 4) for p in range(6, 25)]
    assert_no_leaks(sched)


def test_steps_never_mixed_and_policy_knobs():
    # decode-first DeepInfer-style interval: prefill attempted every 3 decode steps
    sched = make(max_num_seqs=4, max_num_batched_tokens=16, prefill_attempt_interval=3)
    sched.add_request(0, prompt_of(0, 4), SP(max_tokens=12))
    kinds = []
    added = []

    def hook(s, step):
        kinds.append(step.kind)
        if len(kinds) == 2:
            added.append(s.add_request(1, prompt_of(1, 4), SP(max_tokens=3)))

    drive(sched, FakeDevice(sched), "sync", hook=hook)
    # step 1 prefill; step 2 decode (dsp=0 -> attempt, but request 1 arrives only after step 2); dsp=1,2 decode;
    # dsp=3 -> prefill
    assert kinds[:5] == ["prefill", "decode", "decode", "decode", "prefill"]
    # consecutive-prefill cap keeps decode going while a long prompt is chunked
    sched = make(max_num_seqs=4, max_num_batched_tokens=4, max_consecutive_prefill_steps=2)
    sched.add_request(0, prompt_of(0, 4), SP(max_tokens=30))
    sched.add_request(1, prompt_of(1, 40), SP(max_tokens=2))
    steps, finished, _ = drive(sched, FakeDevice(sched), "async")
    ks = [s.kind for s in steps]
    assert "prefill,prefill,prefill" not in ",".join(ks[:12])
    assert results(finished)[1] == (expected_outputs(1, 40, 2), "length")
    assert_no_leaks(sched)


# ---------------------------------------------------------------------------------------------------------------------
# preemption
# ---------------------------------------------------------------------------------------------------------------------
def _tight_pool(mode, sync_mode):
    # 9 usable blocks of 4 tokens (A alone needs 6, B and C 3 each). A starts alone, so it has the longest output
    # when B and C join.
    sched = make(num_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
                 preemption_mode=mode)
    dev = FakeDevice(sched)
    a = sched.add_request(0, prompt_of(0, 4), SP(max_tokens=24))
    added = []
    victims_front = []

    def hook(s, step):
        if len(added) == 0 and a.num_tokens_total >= 10:
            added.append(s.add_request(1, prompt_of(1, 4), SP(max_tokens=8)))
            added.append(s.add_request(2, prompt_of(2, 4), SP(max_tokens=8)))
        if a.status is SequenceStatus.WAITING and a.num_preemptions and s.waiting and s.waiting[0] is a:
            victims_front.append(step.step_id)

    _, finished, _ = drive(sched, dev, sync_mode, hook=hook)
    return sched, a, added, finished, victims_front


def test_preemption_stop_mode():
    res = {}
    for sync_mode in ("sync", "async"):
        sched, a, (b, c), finished, _ = _tight_pool("stop", sync_mode)
        assert a.finish_reason == "preempted" and "preempted" in a.error and a.num_preemptions == 1
        assert sched.num_preemptions == 1
        n = len(a.output_token_ids)
        assert 6 <= n < 24 and tuple(a.output_token_ids) == expected_outputs(0, 4, n)
        res[sync_mode] = results(finished)
        assert res[sync_mode][1] == (expected_outputs(1, 4, 8), "length")
        assert res[sync_mode][2] == (expected_outputs(2, 4, 8), "length")
        assert_no_leaks(sched)
    # the victim keeps the token its in-flight row computed, so the async order stops it at the same length
    assert res["sync"] == res["async"]


def test_preemption_recompute_mode():
    for sync_mode in ("sync", "async"):
        sched, a, (b, c), finished, front = _tight_pool("recompute", sync_mode)
        assert a.num_preemptions >= 1 and front, "the victim went back to the front of the waiting queue"
        res = results(finished)
        assert res[0] == (expected_outputs(0, 4, 24), "length")
        assert res[1] == (expected_outputs(1, 4, 8), "length")
        assert res[2] == (expected_outputs(2, 4, 8), "length")
        assert_no_leaks(sched)


def test_structured_victim_is_not_recomputed():
    # the same tight pool in recompute mode, but A asks for structured output: its grammar state is not replayed,
    # so the preemption ends it ("preempted"), keeping the tokens it had; B and C are unaffected (DeepInfer)
    for sync_mode in ("sync", "async"):
        sched = make(num_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
                     preemption_mode="recompute")
        a = sched.add_request(0, prompt_of(0, 4), SP(max_tokens=24, so_args={"schema_type": "regex", "schema": "a"}))
        assert not a.recomputable
        added = []

        def hook(s, step, a=a, added=added):
            if not added and a.num_tokens_total >= 10:
                added += [s.add_request(r, prompt_of(r, 4), SP(max_tokens=8)) for r in (1, 2)]

        _, finished, _ = drive(sched, FakeDevice(sched), sync_mode, hook=hook)
        assert a.finish_reason == "preempted" and "not recomputed" in a.error and a.num_preemptions == 1
        n = len(a.output_token_ids)
        assert 6 <= n < 24 and tuple(a.output_token_ids) == expected_outputs(0, 4, n)
        res = results(finished)
        assert res[1] == (expected_outputs(1, 4, 8), "length") and res[2] == (expected_outputs(2, 4, 8), "length")
        assert_no_leaks(sched)


def test_fail_ends_only_that_request():
    sched = make()
    a = sched.add_request(0, prompt_of(0, 4), SP(max_tokens=6))
    b = sched.add_request(1, prompt_of(1, 4), SP(max_tokens=6))
    failed = []

    def hook(s, step):
        if not failed and len(a.output_token_ids) >= 2:
            failed.append(s.fail(0, "grammar rejected a token"))

    _, finished, _ = drive(sched, FakeDevice(sched), "async", hook=hook)
    assert failed == [a] and a.finish_reason == "error" and a.error == "grammar rejected a token"
    assert a in finished and sched.fail(0, "again") is None
    assert results(finished)[1] == (expected_outputs(1, 4, 6), "length") and b.finish_reason == "length"
    assert_no_leaks(sched)


def test_recompute_victims_requeued_in_front_in_arrival_order():
    # all three start together; pool too small for all to grow: the two longest are preempted in one step
    sched = make(num_blocks=7, block_size=2, max_num_seqs=3, max_num_batched_tokens=16, preemption_mode="recompute")
    seqs = [sched.add_request(r, prompt_of(r, 2), SP(max_tokens=6)) for r in range(3)]
    sched.add_request(9, prompt_of(9, 2), SP(max_tokens=2))  # arrives after the three, waits behind them
    seen = []

    def hook(s, step):
        waiting = [x.request_id for x in s.waiting]
        if any(x.num_preemptions for x in seqs) and not seen:
            seen.append(waiting)

    _, finished, _ = drive(sched, FakeDevice(sched), "sync", hook=hook)
    assert seen and seen[0][-1] == 9 and seen[0][:-1] == sorted(seen[0][:-1]), seen
    res = results(finished)
    for r in range(3):
        assert res[r] == (expected_outputs(r, 2, 6), "length")
    assert res[9] == (expected_outputs(9, 2, 2), "length")
    assert_no_leaks(sched)


def test_recompute_cannot_progress_finishes_preempted():
    # a lone request that outgrows the whole pool: recomputing cannot help
    sched = make(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, preemption_mode="recompute")
    seq = sched.add_request(0, prompt_of(0, 5), SP(max_tokens=30))
    _, finished, _ = drive(sched, FakeDevice(sched), "async")
    assert seq.finish_reason == "preempted" and "could not make progress" in seq.error
    n = len(seq.output_token_ids)
    assert 5 + n <= 13 and tuple(seq.output_token_ids) == expected_outputs(0, 5, n)
    assert_no_leaks(sched)


# ---------------------------------------------------------------------------------------------------------------------
# stop conditions
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sync_mode", ["sync", "async"])
def test_stop_conditions(sync_mode):
    sched = make(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=24)
    overrides = {(1, 8): EOS, (2, 8): EOS, (3, 9): 555, (4, 7): EOS}
    s0 = sched.add_request(0, prompt_of(0, 5), SP(max_tokens=4), eos_token_ids=EOS)
    s1 = sched.add_request(1, prompt_of(1, 5), SP(max_tokens=10), eos_token_ids=(EOS, 2))
    s2 = sched.add_request(2, prompt_of(2, 5), SP(max_tokens=10, ignore_eos=True), eos_token_ids=EOS)
    s3 = sched.add_request(3, prompt_of(3, 5), SP(max_tokens=10, stop_token_ids=[555], ignore_eos=True), EOS)
    s4 = sched.add_request(4, prompt_of(4, 5), SP(max_tokens=None), eos_token_ids=())  # EOS not an eos here
    s5 = sched.add_request(5, prompt_of(5, 20), SP(max_tokens=None), eos_token_ids=EOS)
    dev = FakeDevice(sched, overrides=overrides)
    _, finished, _ = drive(sched, dev, sync_mode)
    assert len(finished) == 6

    def exp(rid, plen, n):
        return tuple(dev.sample(rid, plen + k) for k in range(n))

    assert (tuple(s0.output_token_ids), s0.finish_reason) == (exp(0, 5, 4), "length")
    assert (tuple(s1.output_token_ids), s1.finish_reason) == (exp(1, 5, 4), "stop")  # EOS kept as last token
    assert s1.output_token_ids[-1] == EOS
    assert (tuple(s2.output_token_ids), s2.finish_reason) == (exp(2, 5, 10), "length")  # EOS ignored
    assert EOS in s2.output_token_ids
    assert (tuple(s3.output_token_ids), s3.finish_reason) == (exp(3, 5, 5), "stop")  # stop id despite ignore_eos
    assert s3.output_token_ids[-1] == 555
    assert (s4.num_tokens, s4.finish_reason) == (24, "length")  # max_model_len
    assert (s5.num_tokens, s5.finish_reason) == (24, "length") and len(s5.output_token_ids) == 4
    assert_no_leaks(sched)


# ---------------------------------------------------------------------------------------------------------------------
# request validation
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_requests_finish_with_error_and_do_not_disturb_others():
    sched = make(num_blocks=11, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48)
    good0 = sched.add_request(0, prompt_of(0, 5), SP(max_tokens=5))
    bad = {
        "empty": sched.add_request(10, [], SP()),
        "vocab_neg": sched.add_request(11, [5, -1, 6], SP()),
        "vocab_big": sched.add_request(12, [5, VOCAB], SP()),
        "too_long": sched.add_request(13, prompt_of(13, 48), SP()),  # == max_model_len: no room to generate
        "never_fits": sched.add_request(14, prompt_of(14, 41), SP()),  # 11 blocks > 10 usable
        "max_tokens": sched.add_request(15, [5], SP(max_tokens=0)),
        "not_ints": sched.add_request(16, [5, "x"], SP()),
        "duplicate": sched.add_request(0, [5], SP()),
    }
    good1 = sched.add_request(1, prompt_of(1, 40), SP(max_tokens=5))  # exactly fills the pool: allowed
    msgs = {"empty": "empty prompt", "vocab_neg": "outside the vocabulary", "vocab_big": "outside the vocabulary",
            "too_long": "max_model_len", "never_fits": "can never be scheduled", "max_tokens": "max_tokens",
            "not_ints": "is not an int", "duplicate": "already in use"}
    for k, s in bad.items():
        assert s.finished and s.finish_reason == "error" and msgs[k] in s.error, (k, s.error)
        assert s not in sched.waiting and not s.block_ids and s.state_slot == -1
    assert len(sched.waiting) == 2
    _, finished, _ = drive(sched, FakeDevice(sched), "async")
    # invalid requests are reported by add_request's return value only; the others through process_step
    assert {s.request_id for s in finished} == {0, 1} and good0 in finished and good1 in finished
    assert (tuple(good0.output_token_ids), good0.finish_reason) == (expected_outputs(0, 5, 5), "length")
    # 40 prompt tokens fill all 10 blocks: one token from the prefill, then the first decode cannot grow
    assert (tuple(good1.output_token_ids), good1.finish_reason) == (expected_outputs(1, 40, 1), "preempted")
    assert_no_leaks(sched)


@pytest.mark.parametrize("sync_mode", ["sync", "async"])
def test_prompt_of_max_model_len_minus_one(sync_mode):
    sched = make(num_blocks=20, block_size=4, max_model_len=40)
    s = sched.add_request(1, prompt_of(1, 39), SP(max_tokens=5))  # exactly max_model_len - 1: allowed
    drive(sched, FakeDevice(sched), sync_mode)
    # 39 + 1 = 40 = max_model_len: stops by length after one token
    assert (tuple(s.output_token_ids), s.finish_reason) == (expected_outputs(1, 39, 1), "length")
    assert_no_leaks(sched)


# ---------------------------------------------------------------------------------------------------------------------
# asynchronous processing order
# ---------------------------------------------------------------------------------------------------------------------
def _workload(sched, seed, n=12, eos_rate=0.3):
    rng = random.Random(seed)
    overrides = {}
    for rid in range(n):
        plen = rng.randint(1, 30)
        max_tokens = rng.choice([1, 2, 5, 9, 17, None])
        if rng.random() < eos_rate:
            overrides[(rid, plen + rng.randint(0, 6))] = EOS
        sched.add_request(rid, prompt_of(rid, plen), SP(max_tokens=max_tokens, ignore_eos=rng.random() < 0.1),
                          eos_token_ids=EOS)
    return overrides


@pytest.mark.parametrize("kw", [
    dict(),  # ample pool
    dict(max_num_batched_tokens=8),  # heavy chunking
    dict(num_blocks=18, preemption_mode="recompute"),  # tight pool, recompute preemption
    dict(num_blocks=14, max_num_seqs=6, preemption_mode="recompute", max_num_batched_tokens=7),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=32, prefill_attempt_interval=4),
])
def test_async_matches_sync(kw):
    outs = {}
    for mode in ("sync", "async"):
        sched = make(**{"num_blocks": 80, "max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 48, **kw})
        overrides = _workload(sched, seed=123)
        dev = FakeDevice(sched, overrides=overrides)
        _, finished, discarded = drive(sched, dev, mode)
        assert len(finished) == 12
        outs[mode] = (results(finished), discarded)
        assert_no_leaks(sched)
        if mode == "sync":
            assert discarded == 0
    assert outs["async"][0] == outs["sync"][0]
    for toks, reason in outs["sync"][0].values():
        assert reason in ("stop", "length")
        assert (reason == "stop") == (toks[-1] == EOS)


def test_async_finish_then_extra_row_then_release():
    """A sequence that hits EOS at step N is already in step N+1; its N+1 token is discarded and its blocks/slot are
    released only after step N+1 is processed."""
    sched = make(max_num_seqs=2, max_num_batched_tokens=32)
    a = sched.add_request(0, prompt_of(0, 4), SP(max_tokens=50), eos_token_ids=EOS)
    b = sched.add_request(1, prompt_of(1, 4), SP(max_tokens=6), eos_token_ids=EOS)
    dev = FakeDevice(sched, overrides={(0, 6): EOS})
    s0 = sched.schedule()
    o0 = dev.run(s0)  # prefill samples position 4
    s1 = sched.schedule()  # decode, inputs in flight
    assert [r.token_ids for r in s1.rows] == [None, None] and [r.input_src for r in s1.rows] == [(0, 0), (0, 1)]
    o1 = dev.run(s1)  # samples position 5
    assert sched.process_step(s0, o0) == []
    s2 = sched.schedule()  # feeds position 5 (in flight), samples 6 = EOS for request 0
    o2 = dev.run(s2)
    assert sched.process_step(s1, o1) == []
    s3 = sched.schedule()  # request 0 still scheduled: its EOS is not known yet
    assert [r.request_id for r in s3.rows] == [0, 1]
    o3 = dev.run(s3)
    done = sched.process_step(s2, o2)
    assert done == [a] and a.finish_reason == "stop" and a.output_token_ids[-1] == EOS
    assert a.block_ids and a.state_slot > 0, "still referenced by the in-flight step 3"
    s4 = sched.schedule()
    assert [r.request_id for r in s4.rows] == [1]
    o4 = dev.run(s4)
    sched.process_step(s3, o3)
    assert len(a.output_token_ids) == 3 and not a.block_ids and a.state_slot == -1
    assert sched.num_discarded_rows == 1
    sched.process_step(s4, o4)
    while sched.has_pending_work():
        st = sched.schedule()
        if st is not None:
            sched.process_step(st, dev.run(st))
    assert (tuple(b.output_token_ids), b.finish_reason) == (expected_outputs(1, 4, 6), "length")
    assert_no_leaks(sched)


def test_length_limits_known_at_schedule_time():
    """max_tokens reached by an in-flight token: the sequence is not scheduled again (no wasted row)."""
    sched = make()
    s = sched.add_request(0, prompt_of(0, 4), SP(max_tokens=2))
    st0 = sched.schedule()
    st1 = sched.schedule()  # decode, samples token 2 of 2
    assert st1.kind == "decode"
    assert sched.schedule() is None  # nothing left to plan until the in-flight steps are processed
    sched.process_step(st0, [tok(0, 4)])
    assert sched.process_step(st1, [tok(0, 5)]) == [s] and s.finish_reason == "length"
    assert_no_leaks(sched)


def test_abort_and_processing_order():
    sched = make(max_num_seqs=2)
    a = sched.add_request(0, prompt_of(0, 4), SP(max_tokens=10))
    b = sched.add_request(1, prompt_of(1, 4), SP(max_tokens=10))
    c = sched.add_request(2, prompt_of(2, 4), SP(max_tokens=3))
    dev = FakeDevice(sched)
    st0 = sched.schedule()
    o0 = dev.run(st0)
    st1 = sched.schedule()
    o1 = dev.run(st1)
    with pytest.raises(ValueError, match="in schedule order"):
        sched.process_step(st1, o1)
    with pytest.raises(ValueError, match="rows"):
        sched.process_step(st0, o0[:1])
    assert sched.abort(2) is c and c.finish_reason == "abort" and c not in sched.waiting
    assert sched.abort(0) is a and a.finish_reason == "abort"
    assert a.block_ids, "in flight: released after processing"
    assert sched.abort(0) is None and sched.abort(99) is None
    done = sched.process_step(st0, o0)
    assert done == []  # aborts are reported by abort()'s return value
    assert a.block_ids  # still in step 1
    sched.process_step(st1, o1)
    assert not a.block_ids and a.output_token_ids == []
    _, finished, _ = drive(sched, dev, "async")
    assert (tuple(b.output_token_ids), b.finish_reason) == (expected_outputs(1, 4, 10), "length")
    assert_no_leaks(sched)


def _random_workload(mode: str, seed: int, kw: dict, num_slots: int) -> tuple[dict, int]:
    """One run of test_randomized_invariants' workload in ``mode`` ("sync" / "async"), its invariants checked;
    returns (results, number of preemptions)."""
    sched = make(num_slots=num_slots, **kw)
    rng2 = random.Random(seed + 1000)
    overrides, reported, nreq = {}, [], [0]

    def add():
        rid = nreq[0]
        nreq[0] += 1
        plen = rng2.randint(0, 30)
        if rng2.random() < 0.3:
            overrides[(rid, plen + rng2.randint(0, 5))] = EOS
        sp = SP(max_tokens=rng2.choice([1, 3, 8, None]), ignore_eos=rng2.random() < 0.1)
        seq = sched.add_request(rid, prompt_of(rid, plen), sp, EOS)
        if seq.finished:
            reported.append(seq)

    def hook(s, step):
        if rng2.random() < 0.2 and nreq[0] < 25:
            add()
        if rng2.random() < 0.05:
            seq = s.abort(rng2.randrange(nreq[0]))
            if seq is not None:
                reported.append(seq)

    for _ in range(10):
        add()
    _, finished, _ = drive(sched, FakeDevice(sched, overrides=overrides), mode, hook=hook)
    reported += finished
    assert sorted(s.request_id for s in reported) == list(range(nreq[0])), "each request reported exactly once"
    assert_no_leaks(sched)
    for s in reported:
        n = len(s.output_token_ids)
        assert s.output_token_ids == [overrides.get((s.request_id, s.prompt_len + k),
                                                    tok(s.request_id, s.prompt_len + k)) for k in range(n)]
        if s.finish_reason != "error":
            assert s.num_tokens <= kw["max_model_len"]
        if s.finish_reason == "length":
            assert s.num_tokens == kw["max_model_len"] or n == s.max_tokens
        elif s.finish_reason == "stop":
            assert s.output_token_ids[-1] == EOS and not s.ignore_eos
        elif s.finish_reason == "error":
            assert n == 0 and s.error
    return results(reported), sched.num_preemptions


@pytest.mark.parametrize("seed", range(12))
def test_randomized_invariants(seed):
    """Random configs and workloads, with requests added and aborted while steps are in flight. The fake device checks
    every row's inputs, block table and state slot; at the end no block or slot is leaked, every request is reported
    finished exactly once, and every output is the model's token sequence."""
    rng = random.Random(seed)
    kw = dict(num_blocks=rng.randint(4, 40), block_size=rng.choice([1, 2, 3, 4, 8]), max_num_seqs=rng.randint(1, 6),
              max_model_len=rng.randint(4, 60), preemption_mode=rng.choice(["stop", "recompute"]),
              enable_chunked_prefill=rng.random() < 0.8, prefill_attempt_interval=rng.choice([1, 1, 5]),
              max_consecutive_prefill_steps=rng.choice([None, 1, 3]), prefill_kv_watermark=rng.choice([1.0, 0.9]))
    kw["max_num_batched_tokens"] = rng.randint(kw["max_num_seqs"], 24)
    num_slots = rng.randint(2, 8)
    outs = {}
    for mode in ("sync", "async"):
        outs[mode] = _random_workload(mode, seed, kw, num_slots)
    (res_s, pre_s), (res_a, pre_a) = outs["sync"], outs["async"]
    aborted = any(r == "abort" for res in (res_s, res_a) for _, r in res.values())
    if pre_s == pre_a == 0 and not aborted:  # the first 10 requests are the same in both runs
        assert {k: res_a[k] for k in range(10)} == {k: res_s[k] for k in range(10)}


def test_numpy_inputs_and_snapshot():
    import numpy as np
    sched = make()
    seq = sched.add_request(3, np.asarray(prompt_of(3, 5), dtype=np.int32), SP(max_tokens=np.int64(2)),
                            eos_token_ids=np.asarray([EOS]))
    assert not seq.finished and seq.max_tokens == 2 and seq.eos_token_ids == (EOS,)
    st = sched.schedule()
    sched.process_step(st, np.asarray([tok(3, 5)], dtype=np.int32))
    assert st.rows[0].accepted_token == tok(3, 5)
    st = sched.schedule()
    done = sched.process_step(st, np.asarray([tok(3, 6)], dtype=np.int32))
    assert done == [seq]
    snap = seq.snapshot()
    assert snap.output_token_ids == (tok(3, 5), tok(3, 6)) and snap.finished and snap.finish_reason == "length"
    assert all(type(t) is int for t in seq.output_token_ids)
    assert_no_leaks(sched)


def test_process_step_rejects_missing_tokens_without_side_effects():
    sched = make()
    seq = sched.add_request(0, prompt_of(0, 3), SP(max_tokens=3))
    dev = FakeDevice(sched)
    st = sched.schedule()
    out = dev.run(st)
    with pytest.raises(ValueError, match="samples a token"):
        sched.process_step(st, [None])
    assert sched.num_inflight_steps == 1 and seq.output_token_ids == []  # nothing consumed
    sched.process_step(st, out)
    drive(sched, dev, "sync")
    assert (tuple(seq.output_token_ids), seq.finish_reason) == (expected_outputs(0, 3, 3), "length")
    assert_no_leaks(sched)
