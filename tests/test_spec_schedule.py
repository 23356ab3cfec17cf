"""Confidence-scheduled verification (issue 11 item 4): the width choice of ``engine/spec_schedule.py`` against
hand-computed expectations, its round N − 2 rule, the option's validation, the scheduler's draft cap, and the online
correction of the step-time curve (DeepInfer's ``ForwardRuntimeEstimator`` of ``csrc/engine/mtp_varlen.hpp``) against
a brute-force recomputation of its median of medians. The
engine's greedy / seeded behaviour with it is in ``tests/test_speculative.py``."""

from __future__ import annotations

import numpy as np
import pytest

from dinfer_jax.engine.block_manager import BlockManager, StateSlots
from dinfer_jax.engine.buckets import Buckets
from dinfer_jax.engine.scheduler import Scheduler, SchedulerConfig
from dinfer_jax.engine.spec_schedule import (
    MIN_OBSERVED_WAIT_S,
    SLOPE_MIN_SAMPLES,
    SLOPE_WINDOW,
    StepClock,
    StepTimeCorrection,
    acceptance_rates,
    check_widths,
    choose_width,
    expected_tokens,
    rates_before,
)


def test_acceptance_rates_are_cumulative_products():
    np.testing.assert_allclose(acceptance_rates([0.9, 0.5, 1.0, 0.2]), [0.9, 0.45, 0.45, 0.09])
    # out-of-range and NaN confidences are clipped / zeroed, never amplify
    np.testing.assert_allclose(acceptance_rates([1.5, np.nan, 0.5]), [1.0, 0.0, 0.0])


def test_expected_tokens_counts_only_verified_drafts():
    rates = [np.array([0.9, 0.45, 0.2]), np.array([0.5, 0.25, 0.125])]
    # width 1: no drafts verified, one token per row
    assert expected_tokens(rates, [3, 3], 1) == pytest.approx(2.0)
    # width 3: two drafts per row: (1 + 0.9 + 0.45) + (1 + 0.5 + 0.25)
    assert expected_tokens(rates, [3, 3], 3) == pytest.approx(4.1)
    # a row with one draft left verifies at most that one
    assert expected_tokens(rates, [1, 3], 4) == pytest.approx((1 + 0.9) + (1 + 0.5 + 0.25 + 0.125))


def test_choose_width_maximises_tokens_per_time():
    rates = [np.array([0.9, 0.8, 0.1, 0.1])] * 2
    nd = [4, 4]
    widths = (1, 2, 3, 4, 5)
    # tokens per row by width: 1, 1.9, 2.7, 2.8, 2.9
    ms = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 14.0}
    # rates 2/10 = .2, 3.8/11 = .345, 5.4/12 = .45, 5.6/13 = .431, 5.8/14 = .414 -> width 3
    assert choose_width(rates, nd, widths, ms.__getitem__) == 3
    # flat cost: every extra draft adds expected tokens, so the widest
    assert choose_width(rates, nd, widths, lambda w: 5.0) == 5
    # steep cost: verifying costs more than it can return
    assert choose_width(rates, nd, widths, lambda w: 1.0 + 100.0 * (w - 1)) == 1
    # only some widths compiled: among (1, 5), 2/10 = .2 vs 5.8/14 = .414
    assert choose_width(rates, nd, (1, 5), ms.__getitem__) == 5
    # rows with at most 2 drafts: widths above 3 verify nothing more and are not taken, even when free
    assert choose_width(rates, [2, 1], widths, lambda w: 5.0) == 3
    # ... and with widths (1, 2, 5) compiled, 5 is the narrowest that holds both rows' drafts
    assert choose_width(rates, [2, 1], (1, 2, 5), lambda w: 5.0) == 5
    # no row has drafts: the narrowest width
    assert choose_width(rates, [0, 0], widths, lambda w: 5.0) == 1
    assert choose_width(rates, [0, 0], (2, 5), lambda w: 5.0) == 2
    with pytest.raises(ValueError, match="positive"):
        choose_width(rates, nd, widths, lambda w: 0.0)


def test_rates_before_reads_round_n_minus_2():
    hist = [(3, np.array([0.1, 0.1])), (5, np.array([0.5, 0.25])), (6, np.array([0.9, 0.8]))]
    # step 8 may use step 6's rates; step 7 only step 5's (step 6 is in flight in the asynchronous loop, and
    # its drafts are the ones step 7 verifies); step 5 only step 3's
    np.testing.assert_array_equal(rates_before(hist, 8, 2), [0.9, 0.8])
    np.testing.assert_array_equal(rates_before(hist, 7, 2), [0.5, 0.25])
    np.testing.assert_array_equal(rates_before(hist, 5, 2), [0.1, 0.1])
    # nothing published two steps back yet: counted as confident
    np.testing.assert_array_equal(rates_before(hist, 4, 2), [1.0, 1.0])
    np.testing.assert_array_equal(rates_before([], 10, 3), [1.0, 1.0, 1.0])


def test_check_widths():
    assert check_widths(None, 3) is None
    assert check_widths("all", 3) == (1, 2, 3, 4)
    assert check_widths([4, 2, 2], 3) == (2, 4)
    for bad in ([1, 2, 3], [0, 4], [4, 5], [2.5, 4], "some", [True, 4], []):
        with pytest.raises(ValueError, match="speculative_widths"):
            check_widths(bad, 3)


def test_buckets_compile_every_width():
    b = Buckets(decode_batch=(1, 4), prefill_batch=(1,), prefill_len=(32,), pages=(2, 8), decode_len=4,
                decode_widths=(1, 4))
    assert b.widths() == (1, 4)
    assert b.decode_shapes() == [(1, 1, 2), (1, 1, 8), (1, 4, 2), (1, 4, 8), (4, 1, 2), (4, 1, 8), (4, 4, 2),
                                 (4, 4, 8)]
    assert Buckets(decode_batch=(1,), prefill_batch=(1,), prefill_len=(8,), pages=(2,), decode_len=3).widths() == (3,)


def _scheduler(policy, k: int = 4) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16,
                          num_speculative_tokens=k)
    return Scheduler(cfg, BlockManager(64, 16), StateSlots(5), vocab_size=100, draft_width=policy)


def _to_decode(sched: Scheduler, n: int) -> None:
    for i in range(n):
        sched.add_request(i, [5, 6, 7, 8])
    step = sched.schedule()
    assert step.kind == "prefill"
    sched.process_step(step, [9] * len(step.rows))
    assert all(row.seq.has_drafts for row in step.rows)   # the prompt's last chunk published drafts


def test_scheduler_caps_drafts_by_the_policy():
    calls = []

    def policy(step_id, rows):
        calls.append((step_id, [(seq.request_id, nd, reach) for seq, nd, reach in rows]))
        return 2

    sched = _scheduler(policy)
    _to_decode(sched, 2)
    step = sched.schedule()
    assert step.kind == "decode"
    # the policy saw every row with its full draft count (k = 4) and its furthest position (start 4 + 1 + 4)
    assert calls == [(step.step_id, [(0, 4, 9), (1, 4, 9)])]
    for row in step.rows:
        assert row.num_drafts == 2 and row.num_tokens == 3 and row.seq.inflight_drafts == 2
    # the emitted runs are read up to the capped count
    sched.process_step(step, [[11, 12, 13], [21, 22, 23]])
    assert [row.seq.output_token_ids for row in step.rows] == [[9, 11, 12, 13], [9, 21, 22, 23]]


def test_scheduler_without_policy_verifies_all_drafts():
    sched = _scheduler(None)
    _to_decode(sched, 1)
    step = sched.schedule()
    assert step.rows[0].num_drafts == 4 and step.rows[0].num_tokens == 5


def _slope_by_brute_force(history: list, window: int, min_samples: int) -> float:
    """DeepInfer's estimator recomputed from scratch: the last ``window`` (bucket, residual) samples grouped by
    bucket, the median of each bucket holding ``min_samples`` or more, the median of those (0 if none)."""
    groups: dict = {}
    for bucket, value in history[-window:]:
        groups.setdefault(bucket, []).append(value)
    medians = [float(np.median(v)) for v in groups.values() if len(v) >= min_samples]
    return float(np.median(medians)) if medians else 0.0


@pytest.mark.parametrize("window,min_samples", [(40, 4), (7, 3), (SLOPE_WINDOW, SLOPE_MIN_SAMPLES)])
def test_step_time_correction_is_the_median_of_bucket_medians(window, min_samples):
    rng = np.random.default_rng(window)
    buckets = [(4, 1, 8), (4, 3, 8), (8, 5, 16), (8, 2, 16)]
    fix, history = StepTimeCorrection(window, min_samples), []
    assert fix.slope_ms() == 0.0
    for i in range(3 * max(window, 60)):
        bucket = buckets[int(rng.integers(len(buckets)))] if i % 9 else buckets[0]   # uneven bucket counts
        measured, curve = float(rng.uniform(1.0, 9.0)), float(rng.uniform(0.5, 6.0))
        if i % 13 == 0:
            measured = curve   # exact zeros and repeated values (equal residuals in one bucket)
        fix.update(bucket, measured, curve)
        history.append((bucket, (measured - curve) / (bucket[0] * bucket[1])))
        assert fix.slope_ms() == _slope_by_brute_force(history, window, min_samples), i
    assert fix.num_updates == len(history)


def test_step_time_correction_times_a_bucket_by_its_tokens():
    fix = StepTimeCorrection(window=100, min_samples=2)
    # one bucket of B·Q = 4 tokens, steps 2 ms slower than the curve: 0.5 ms per token once 2 samples exist
    fix.update((2, 2, 8), 7.0, 5.0)
    assert fix.slope_ms() == 0.0 and fix.step_ms((4, 3, 8), 2.0) == 2.0
    fix.update((2, 2, 8), 7.0, 5.0)
    assert fix.slope_ms() == 0.5
    assert fix.step_ms((4, 3, 8), 2.0) == pytest.approx(2.0 + 0.5 * 12)
    # steps faster than the curve: a negative slope, never applied (the curve stays the floor)
    neg = StepTimeCorrection(window=100, min_samples=1)
    neg.update((1, 1, 1), 1.0, 3.0)
    assert neg.slope_ms() == -2.0 and neg.step_ms((4, 3, 8), 2.0) == 2.0
    with pytest.raises(ValueError, match="window"):
        StepTimeCorrection(window=0)


def test_choose_width_with_a_corrected_curve():
    """A slope turns a flat curve (widest width) into one where verifying costs: the choice moves to 1."""
    rates, nd, widths = [np.array([0.5, 0.25, 0.125, 0.0625])] * 2, [4, 4], (1, 2, 3, 4, 5)
    fix = StepTimeCorrection(window=10, min_samples=1)
    assert choose_width(rates, nd, widths, lambda w: fix.step_ms((2, w, 8), 5.0)) == 5
    fix.update((2, 5, 8), 25.0, 5.0)   # 2 ms per query token
    # time(w) = 5 + 4w; tokens 2·(1, 1.5, 1.75, 1.875, 1.9375): per ms .222, .231, .206, .179, .156 -> width 2
    assert choose_width(rates, nd, widths, lambda w: fix.step_ms((2, w, 8), 5.0)) == 2


def test_step_clock_sees_only_what_the_host_waited_for():
    w = 10 * MIN_OBSERVED_WAIT_S
    clock = StepClock()
    # first step: called at 1.0, the host waited from 1.5 to 3.0 -> 2000 ms
    assert clock.observe(1.0, 1.5, 3.0) == pytest.approx(2000.0)
    # the next one was called at 2.0 while the first ran (async loop): it starts when the first ends (3.0)
    assert clock.observe(2.0, 3.5, 4.0) == pytest.approx(1000.0)
    # called after the previous end: starts when called
    assert clock.observe(4.5, 5.0, 5.0 + w) == pytest.approx(1e3 * (0.5 + w))
    # tokens already there when asked (no wait): not timed; its end is only known to be <= 6.0
    assert clock.observe(5.2, 6.0, 6.0) is None
    # called at 5.9, before that bound: its start is unknown -> not timed
    assert clock.observe(5.9, 7.0, 8.0) is None
    # that one's end was seen (8.0): the next is timed again
    assert clock.observe(7.5, 8.5, 9.0) == pytest.approx(1000.0)
    # not-waited step whose bound (9.1) precedes the next call (9.2): the next starts when called
    assert clock.observe(9.05, 9.1, 9.1) is None
    assert clock.observe(9.2, 9.3, 9.7) == pytest.approx(500.0)
    # a step without a recorded call time (non-speculative output) is never timed, but still ends
    assert clock.observe(0.0, 10.0, 11.0) is None
    assert clock.observe(10.5, 11.5, 12.0) == pytest.approx(1000.0)
