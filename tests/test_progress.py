"""Start-up progress bars: counted items and bytes, and the switches that silence them."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from dinfer_jax import progress as progress_mod
from dinfer_jax.progress import PhaseProgress, progress_wanted


def test_switches(monkeypatch):
    monkeypatch.setenv("DINFER_JAX_PROGRESS", "1")
    assert progress_wanted(True) and not progress_wanted(False)
    monkeypatch.setenv("DINFER_JAX_PROGRESS", "0")
    assert not progress_wanted(True)


def test_bar_counts_items_and_bytes(monkeypatch):
    monkeypatch.setenv("DINFER_JAX_PROGRESS", "1")
    buf = io.StringIO()
    monkeypatch.setattr(progress_mod, "_console", lambda: Console(file=buf, force_terminal=True, width=100),
                        raising=False)
    with PhaseProgress("load ckpt", 3, unit_bytes=True) as bar:
        for n in (2**29, 2**29, 2**30):
            bar.advance(nbytes=n)
    assert (bar.items, bar.nbytes) == (3, 2**31)
    out = buf.getvalue()
    assert "load ckpt" in out and "3/3" in out and "2.00 GiB" in out


def test_silenced_draws_nothing(monkeypatch, capsys):
    monkeypatch.setenv("DINFER_JAX_PROGRESS", "1")
    with PhaseProgress("compile buckets", 2, enabled=False) as bar:
        bar.advance()
        bar.advance()
    assert bar.items == 2
    captured = capsys.readouterr()
    assert "compile buckets" not in captured.err + captured.out


@pytest.mark.parametrize("flag", [True, False])
def test_load_model_progress_flag(flag, monkeypatch, capfd):
    """load_model on the bundled checkpoint draws the bar only when asked (forced on through the environment)."""
    from dinfer_jax.models import load_model

    monkeypatch.setenv("DINFER_JAX_PROGRESS", "1")
    load_model("default", dtype="float32", progress=flag)
    err = capfd.readouterr().err
    assert ("load default" in err) == flag
