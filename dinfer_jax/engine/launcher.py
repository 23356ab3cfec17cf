"""Launching steps from a second host thread, for programs whose launch blocks the caller.

A jitted call normally returns as soon as its program is queued on the device, and the host loop prepares the
next step while the device runs this one (``docs/spec/engine.md`` §4). A program that holds a host computation —
the step with Engram tables in pinned host memory, whose gather runs on the host inside the program (XLA host
offloading) — returns only when the whole program has run (measured on the H200: the call takes as long as the
step). The loop's own work (reading the previous step's tokens, scheduling, building the next inputs: about a
millisecond a step) then no longer overlaps the device: it adds to every step.

:class:`StepLauncher` moves the launches onto one worker thread, in submission order, so the loop goes on while a
launch blocks; the worker starts the next launch as soon as the previous one returns. The loop holds a
:class:`Launched` per step and waits on it only when it needs that step's outputs. Without a worker the launch
runs on the caller's thread, as before.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from dinfer_jax.engine.runner import StepOutput


class Launched:
    """One launched step: its :class:`StepOutput` once the launch has returned (at once on the caller's thread)."""

    def __init__(self, out: StepOutput | concurrent.futures.Future) -> None:
        self._out = out

    def result(self) -> StepOutput:
        """The step's output (device futures), waiting for its launch to return."""
        if isinstance(self._out, concurrent.futures.Future):
            self._out = self._out.result()
        return self._out

    def finished(self) -> bool:
        """Whether the launch has returned and the step's tokens are computed (never waits)."""
        if isinstance(self._out, concurrent.futures.Future) and not self._out.done():
            return False
        out = self.result()
        return out.tokens is not None and out.tokens.is_ready()


class StepLauncher:
    """Runs step launches on a worker thread (``threaded``) or on the caller's thread."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor | None) -> None:
        self._pool = pool

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def launch(self, fn: Callable[..., StepOutput], *args: Any, **kwargs: Any) -> Launched:
        """``fn(*args, **kwargs)`` (a runner's dispatch), after every launch submitted before it."""
        if self._pool is None:
            return Launched(fn(*args, **kwargs))
        return Launched(self._pool.submit(fn, *args, **kwargs))


@contextlib.contextmanager
def step_launcher(threaded: bool) -> Iterator[StepLauncher]:
    """A :class:`StepLauncher` for one ``generate`` call; its worker (one thread) ends with the call, after the
    launches it holds."""
    if not threaded:
        yield StepLauncher(None)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dinfer_jax-launch") as pool:
        yield StepLauncher(pool)


__all__ = ["Launched", "StepLauncher", "step_launcher"]
