"""Shared helpers of the test suite: reference-model builders and error metrics."""

from __future__ import annotations

import numpy as np
import pytest


def require_reference():
    """Import torch + transformers or skip (the reference extra is installed by .ci/run, so CI never skips)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return torch


def rel_err(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |error|, mean |error|) divided by the reference's scale max |ref|."""
    scale = float(np.abs(ref).max())
    err = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    return float(err.max()) / scale, float(err.mean()) / scale
