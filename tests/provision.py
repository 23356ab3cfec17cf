"""Where the test suite's inputs come from, and what happens when one is missing.

Inputs: the golden fixtures (in the repository, ``tests/data/fixtures/``), the bundled default model (in the
package), the PyTorch reference (the ``reference`` extra) and DeepInfer's source (fetched by
``scripts/fetch_deepinfer_source.py`` into a cache on first use).

A missing input is never a silent pass. Outside CI the test is skipped with a reason that says how to provide the
input (``-rs``, on by default in ``pyproject.toml``, lists them); with the ``CI`` environment variable set (to
anything but ``""``, ``0`` or ``false``) the test fails with that message instead.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES_DIR = REPO_ROOT / "tests" / "data" / "fixtures"
INSTALL_HINT = 'install the test extras: pip install -e ".[reference,test]"'


def in_ci() -> bool:
    """Whether ``CI`` is set to a true-ish value (GitHub Actions, GitLab and most runners set ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str, how: str) -> NoReturn:
    """Skip (locally) or fail (under ``CI``) the calling test because ``what`` is unavailable; ``how`` fixes it."""
    msg = f"{what} is unavailable. To provide it: {how}"
    if in_ci():
        pytest.fail(f"{msg} (CI is set, so a missing test input is a failure, not a skip)", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def fixture_dir(name: str) -> Path:
    """Directory of the golden fixture ``name`` (``v41-tiny``, ``v41-tiny-quant``) inside the repository."""
    path = FIXTURES_DIR / name
    if not (path / "config.json").is_file() or not (path / "reference.npz").is_file():
        missing(f"golden fixture {name} ({path})",
                "it is part of the repository; restore it with `git checkout -- tests/data/fixtures` "
                "(see tests/data/fixtures/README.md)")
    return path


def require_module(name: str) -> ModuleType:
    """Import ``name`` (torch, transformers, …) or report it missing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(f"Python module {name} ({e})", INSTALL_HINT)
