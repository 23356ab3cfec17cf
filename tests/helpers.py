"""Shared helpers of the test suite: reference-model builders and error metrics."""

from __future__ import annotations

import numpy as np
import pytest


def require_reference():
    """Import torch + transformers 5.24.0 or skip (``.ci/run`` installs the reference extra, so CI never skips).

    Other transformers versions differ in V4 numerics (5.17 casts RMSNorm differently), so they are no reference.
    """
    from dinfer_jax.reference.transformers_v4 import REFERENCE_TRANSFORMERS

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if transformers.__version__ != REFERENCE_TRANSFORMERS:
        pytest.skip(f"transformers {transformers.__version__} is not the reference {REFERENCE_TRANSFORMERS}")
    return torch


def rel_err(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |error|, mean |error|) divided by the reference's scale max |ref|."""
    scale = float(np.abs(ref).max())
    err = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    return float(err.max()) / scale, float(err.mean()) / scale
