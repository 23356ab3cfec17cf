"""Confidence-scheduled verification on fixed-shape decode buckets (``docs/speculative_decoding.md``,
``docs/spec/engine.md`` §5).

DeepInfer packs a variable number of query tokens per request (varlen) and picks the step's total ``total_q`` that
maximises expected emitted tokens per unit of step time. Here a decode step is a compiled ``[B, Q, P]`` bucket, so
the choice is the step's *width* ``Q`` among the compiled widths: every row verifies ``min(its drafts, Q − 1)``
drafts (verifying fewer drafts inside a bucket would save nothing), and the expected tokens of a row are

    E_r(Q) = 1 + Σ_{j < min(Q − 1, d_r)} a_{r,j},    a_{r,j} = Π_{i ≤ j} c_{r,i}

with ``c_{r,i}`` the drafter's confidence in its draft ``i`` (DSpark's confidence head; for V4's MTP block, the
drafter's own temperature-1 probability of the token it drafted). The width maximises ``Σ_r E_r(Q) / time(Q)``,
``time`` being the measured step time of the bucket (``ModelRunner.decode_step_ms``).

Which confidences: the budget uses *round N − 2* rates in both loops — for decode step N, each request's rates come
from the drafts published by its latest step numbered ≤ N − 2, never from the drafts step N verifies. So whether a
draft is verified never depends on that draft's own value or on the drafts sampled after it (their confidences read
it), which keeps the verification a stopping rule that preserves the target distribution, and the choice needs
nothing the asynchronous loop has not yet seen (no host sync). A request with drafts but no such rates yet
(its first verify after its prefill) counts as fully confident (DeepInfer pads pre-scheduled requests with 1).

Online correction (DeepInfer's ``ForwardRuntimeEstimator``): the curve is measured once, on all-padding rows; steps
of real rows can take longer (they attend to real pages, sample with filters, the host adds its part). Every decode
step the engine could time adds its residual per query token, ``(measured ms − curve ms) / (B · Q)``, to
:class:`StepTimeCorrection`; the width choice then times a bucket as ``curve + max(0, slope) · B · Q``.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Mapping, Sequence

import numpy as np

# how many published rate rows a sequence keeps (the choice for step N reads the latest one numbered ≤ N − 2;
# the sequence's next rows add newer ones meanwhile)
RATE_HISTORY = 3
# DeepInfer's ForwardRuntimeEstimator constants: residuals of the last 5000 timed steps are kept, and a bucket's
# median counts once the bucket has 10 of them
SLOPE_WINDOW = 5000
SLOPE_MIN_SAMPLES = 10
# a wait for a step's tokens shorter than this found the step already done: its end is then only bounded, not seen
MIN_OBSERVED_WAIT_S = 1e-4


def acceptance_rates(confidences: np.ndarray) -> np.ndarray:
    """``a_j = Π_{i ≤ j} c_i`` of confidences ``[..., k]`` (clipped to [0, 1]; NaN counts as 0), float64."""
    c = np.nan_to_num(np.asarray(confidences, np.float64), nan=0.0)
    return np.cumprod(np.clip(c, 0.0, 1.0), axis=-1)


def expected_tokens(rates: Sequence[np.ndarray], num_drafts: Sequence[int], width: int) -> float:
    """``Σ_r E_r(width)``: tokens the rows are expected to emit in a step of ``width`` query tokens. ``rates[r]``
    ``[k]`` (:func:`acceptance_rates`), ``num_drafts[r]`` the drafts row r has to verify."""
    total = 0.0
    for a, d in zip(rates, num_drafts, strict=True):
        total += 1.0 + float(np.sum(a[: max(0, min(width - 1, int(d)))]))
    return total


def choose_width(rates: Sequence[np.ndarray], num_drafts: Sequence[int], widths: Sequence[int],
                 step_ms: Callable[[int], float]) -> int:
    """The width among ``widths`` (increasing) maximising :func:`expected_tokens` per ``step_ms(width)``
    milliseconds. Ties go to the larger width (more drafts verified for the same rate). Widths above the
    narrowest one that holds every row's drafts are not considered (they would verify nothing more)."""
    if not widths:
        raise ValueError("no decode widths to choose from")
    most = 1 + max([0, *(int(d) for d in num_drafts)])
    useful = [w for w in widths if w < most]
    useful += [w for w in widths if w >= most][:1]
    best, best_rate = useful[0], -1.0
    for w in useful:
        ms = float(step_ms(w))
        if not ms > 0.0:
            raise ValueError(f"decode step time of width {w} must be positive, got {ms}")
        rate = expected_tokens(rates, num_drafts, w) / ms
        if rate >= best_rate:
            best, best_rate = w, rate
    return best


def rates_before(history: Sequence[tuple[int, np.ndarray]], step_id: int, k: int) -> np.ndarray:
    """The acceptance rates ``[k]`` a request contributes to the choice for decode step ``step_id``: those of its
    latest published drafts from a step numbered ≤ ``step_id − 2`` (``history``: ``(step_id, rates)`` in
    publication order), else all ones (no rates seen yet: counted as confident)."""
    for sid, rates in reversed(history):
        if sid <= step_id - 2:
            return rates
    return np.ones((k,), np.float64)


def check_widths(widths: Sequence[int] | str | None, k: int) -> tuple[int, ...] | None:
    """Validate ``LLM(speculative_widths=...)`` for ``k`` drafts: None (only ``1 + k``: no confidence scheduling),
    ``"all"`` (``1 … 1 + k``) or distinct ints in ``[1, 1 + k]`` that include ``1 + k``. Returns the increasing
    tuple, or None."""
    if widths is None:
        return None
    if isinstance(widths, str):
        if widths != "all":
            raise ValueError(f"speculative_widths must be None, 'all' or a sequence of ints, got {widths!r}")
        return tuple(range(1, k + 2))
    try:
        out = sorted({int(w) for w in widths})
        bad = any(isinstance(w, bool) or int(w) != w for w in widths)
    except (TypeError, ValueError):
        raise ValueError(f"speculative_widths must be None, 'all' or a sequence of ints, got {widths!r}") from None
    if bad or not out or out[0] < 1 or out[-1] != 1 + k:
        raise ValueError(f"speculative_widths must be ints in [1, {1 + k}] including {1 + k} "
                         f"(1 + num_speculative_tokens), got {widths!r}")
    return tuple(out)


class StepTimeCorrection:
    """The online slope of the step-time curve: ``update`` after each timed decode step, ``step_ms`` for the width
    choice. Residuals ``(measured − curve) / (B · Q)`` ms per query token of the last ``window`` timed steps are
    kept per bucket ``(B, Q, P)``; each bucket holding at least ``min_samples`` of them contributes its median,
    and the slope is the median of those medians (every bucket weighs the same; 0 while none qualifies). A
    negative slope is not applied (the measured curve stays a lower bound). Host-side state of one engine."""

    def __init__(self, window: int = SLOPE_WINDOW, min_samples: int = SLOPE_MIN_SAMPLES) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError(f"window and min_samples must be >= 1, got {window}, {min_samples}")
        self.window, self.min_samples = int(window), int(min_samples)
        self._recent: collections.deque[tuple[tuple[int, int, int], float]] = collections.deque()
        self._by_bucket: dict[tuple[int, int, int], list[float]] = {}   # each list sorted
        self._slope = 0.0   # recomputed on update: the width choice reads it several times per decode step
        self.num_updates = 0

    def update(self, bucket: tuple[int, int, int], measured_ms: float, curve_ms: float) -> None:
        """Add one timed step of ``bucket`` ``(B, Q, P)``: ``measured_ms`` against the curve's ``curve_ms``."""
        b, q, _ = bucket
        if len(self._recent) == self.window:
            old, value = self._recent.popleft()
            values = self._by_bucket[old]
            del values[bisect.bisect_left(values, value)]
            if not values:
                del self._by_bucket[old]
        value = (float(measured_ms) - float(curve_ms)) / (b * q)
        self._recent.append((bucket, value))
        bisect.insort(self._by_bucket.setdefault(bucket, []), value)
        self.num_updates += 1
        medians = [_sorted_median(v) for v in self._by_bucket.values() if len(v) >= self.min_samples]
        self._slope = float(np.median(medians)) if medians else 0.0

    def slope_ms(self) -> float:
        """The median over qualifying buckets of their median residual, ms per query token (may be negative)."""
        return self._slope

    def step_ms(self, bucket: tuple[int, int, int], curve_ms: float) -> float:
        """The corrected time of one step of ``bucket``: ``curve_ms + max(0, slope) · B · Q``."""
        b, q, _ = bucket
        return float(curve_ms) + max(0.0, self.slope_ms()) * b * q


def _sorted_median(values: list[float]) -> float:
    """The median of an already sorted list (the mean of the two middle values for an even count)."""
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


class StepClock:
    """When each step ran on the device, as far as the host loop can see it without device events: a step of an
    in-order stream starts when it is called or when the step before it ends, whichever is later, and ends when
    the host, waiting for its tokens, gets them. A step whose tokens were already there when the host asked has
    its end only bounded (by the moment of asking), so it is not timed, and the next step is timed only if it was
    called after that bound. One per host loop."""

    def __init__(self) -> None:
        self._prev_end = None   # (time, exact) of the previous step's end, or None before the first step

    def observe(self, called_at: float, asked_at: float, got_at: float) -> float | None:
        """Milliseconds the step took on the device, or None where the host could not see it. ``called_at``: its
        program was called; ``asked_at`` / ``got_at``: the host started waiting for its tokens / had them."""
        start = called_at
        if self._prev_end is not None:
            end, exact = self._prev_end
            if exact:
                start = max(called_at, end)
            elif end > called_at:
                start = None   # the previous step ended at an unknown moment after this one was called
        exact = got_at - asked_at >= MIN_OBSERVED_WAIT_S
        self._prev_end = (got_at if exact else asked_at, exact)
        if start is None or not exact or called_at <= 0.0:
            return None
        return 1e3 * (got_at - start)


def step_time_lookup(curve: Mapping[tuple[int, int, int], float], b: int, p: int) -> Callable[[int], float]:
    """``width -> ms`` of the measured curve at batch bucket ``b`` and page bucket ``p``."""
    return lambda w: curve[(b, w, p)]
