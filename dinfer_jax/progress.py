"""Progress bars for the long start-up phases (checkpoint loading, bucket warm-up), drawn with ``rich``.

A real-dimension checkpoint takes minutes to read and a serving engine minutes to compile its buckets; a user
needs to see that it is moving. ``enabled=False`` (the ``progress=False`` flags of ``load_model`` and ``LLM``)
silences them; they also stay silent when stderr is not a terminal and ``DINFER_JAX_PROGRESS`` is not ``1`` (CI
logs, pipes), and ``DINFER_JAX_PROGRESS=0`` silences them everywhere.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType


def _console():
    from rich.console import Console

    return Console(stderr=True)


def progress_wanted(enabled: bool) -> bool:
    """Whether to draw: the caller's flag, then the environment override, then "is stderr a terminal"."""
    if not enabled:
        return False
    env = os.environ.get("DINFER_JAX_PROGRESS", "").strip()
    if env:
        return env not in ("0", "false", "no")
    return sys.stderr.isatty()


class PhaseProgress:
    """One bar for one phase: ``with PhaseProgress("load", total=n, unit_bytes=True) as p: p.advance(nbytes=...)``.

    ``total`` counts items (parameters, buckets); with ``unit_bytes`` the bar also shows the bytes moved so far.
    """

    def __init__(self, description: str, total: int, *, enabled: bool = True, unit_bytes: bool = False):
        self.description = description
        self.total = total
        self.unit_bytes = unit_bytes
        self.enabled = progress_wanted(enabled)
        self.items = 0
        self.nbytes = 0
        self._bar = None
        self._task = None

    def __enter__(self) -> PhaseProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            columns = [TextColumn(self.description), BarColumn(), MofNCompleteColumn()]
            if self.unit_bytes:
                columns.append(TextColumn("{task.fields[gib]}"))
            columns.append(TimeElapsedColumn())
            self._bar = Progress(*columns, console=_console(), transient=False)
            self._task = self._bar.add_task(self.description, total=self.total, gib="")
            self._bar.start()
        return self

    def advance(self, *, nbytes: int = 0, note: str = "") -> None:
        """One more item done (``nbytes`` of it moved)."""
        self.items += 1
        self.nbytes += nbytes
        if self._bar is not None:
            fields = {"gib": f"{self.nbytes / 2**30:.2f} GiB"} if self.unit_bytes else {}
            self._bar.update(self._task, advance=1, **fields)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
