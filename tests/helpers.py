"""Shared helpers of the test suite: reference-model builders and error metrics."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from provision import INSTALL_HINT, missing, require_module


def require_reference() -> ModuleType:
    """Import torch + transformers 5.24.0 and return torch; a missing or other version is reported by
    :func:`provision.missing` (a skip locally, a failure under ``CI``).

    Other transformers versions differ in V4 numerics (5.17 casts RMSNorm differently), so they are no reference.
    """
    from dinfer_jax.reference.transformers_v4 import REFERENCE_TRANSFORMERS

    torch = require_module("torch")
    transformers = require_module("transformers")
    if transformers.__version__ != REFERENCE_TRANSFORMERS:
        missing(f"the reference transformers {REFERENCE_TRANSFORMERS} (found {transformers.__version__})", INSTALL_HINT)
    return torch


def rel_err(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |error|, mean |error|) divided by the reference's scale max |ref|."""
    scale = float(np.abs(ref).max())
    err = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    return float(err.max()) / scale, float(err.mean()) / scale
