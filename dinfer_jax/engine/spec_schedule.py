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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

# how many published rate rows a sequence keeps (the choice for step N reads the latest one numbered ≤ N − 2;
# the sequence's next rows add newer ones meanwhile)
RATE_HISTORY = 3


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


def step_time_lookup(curve: Mapping[tuple[int, int, int], float], b: int, p: int) -> Callable[[int], float]:
    """``width -> ms`` of the measured curve at batch bucket ``b`` and page bucket ``p``."""
    return lambda w: curve[(b, w, p)]
