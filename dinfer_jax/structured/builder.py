"""Off-critical-path matcher construction: a thread pool compiles grammars, an LRU cache skips repeated schemas.

The engine calls :meth:`MatcherBuilder.submit` when a structured request arrives and polls the returned
:class:`MatcherFuture` with :meth:`~MatcherFuture.try_result` each step (non-blocking) until it yields a matcher: a
working one, or a failed one (compile error or timeout) whose ``error`` says why. llguidance releases the GIL while
it builds a grammar, so compilation overlaps the engine's own Python work.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Sequence

import llguidance

from .compiler import GrammarCompileError, compile_grammar
from .matcher import DEFAULT_MAX_ROLLBACK, StructuredMatcher
from .spec import StructuredSpec


class MatcherFuture:
    """A matcher being built. Timeouts are measured with ``time.monotonic`` from the submit.

    Resolution is sticky: once :meth:`try_result` or :meth:`result` returned a matcher (working or failed), every
    later call returns that same object, even if a timed-out compilation finishes afterwards.
    """

    def __init__(self, task: concurrent.futures.Future[tuple[StructuredMatcher, float]] | None, timeout_s: float,
                 start: float):
        # the task yields (matcher, the monotonic time it finished): a build that finished after the deadline counts
        # as timed out however late the engine looks at it, so the outcome does not depend on the engine's timing
        self._task = task
        self._timeout_s = timeout_s
        self._start = start
        self._res: StructuredMatcher | None = None

    @classmethod
    def resolved(cls, matcher: StructuredMatcher) -> MatcherFuture:
        """A future that already holds ``matcher``."""
        fut = cls(None, 0.0, time.monotonic())
        fut._res = matcher
        return fut

    def _timed_out(self) -> StructuredMatcher:
        if self._task is not None:
            self._task.cancel()  # only helps while it has not started; a running compilation finishes unobserved
        return StructuredMatcher.failed(f"structured output: grammar compilation timed out after {self._timeout_s:g} s")

    def _collect(self, task: concurrent.futures.Future[tuple[StructuredMatcher, float]]) -> StructuredMatcher:
        if task.cancelled():
            return StructuredMatcher.failed("structured output: matcher build cancelled (builder closed)")
        exc = task.exception()
        if exc is not None:  # the worker turns every expected failure into a failed matcher; this is a bug
            return StructuredMatcher.failed(f"structured output: matcher build crashed: {exc!r}")
        matcher, finished = task.result()
        return matcher if finished - self._start <= self._timeout_s else self._timed_out()

    def try_result(self) -> StructuredMatcher | None:
        """The matcher if it is ready, a failed matcher once the timeout has passed, else None (never blocks)."""
        if self._res is None:
            assert self._task is not None
            if self._task.done():
                self._res = self._collect(self._task)
            elif time.monotonic() - self._start > self._timeout_s:
                self._res = self._timed_out()
        return self._res

    def result(self) -> StructuredMatcher:
        """The matcher, blocking for at most the rest of the timeout (then a failed matcher)."""
        if self._res is None:
            assert self._task is not None
            remaining = self._timeout_s - (time.monotonic() - self._start)
            try:
                self._task.result(timeout=max(remaining, 0.0))
            except (TimeoutError, concurrent.futures.CancelledError):
                pass
            except Exception:
                pass  # reported by _collect
            self._res = self._collect(self._task) if self._task.done() else self._timed_out()
        return self._res

    def cancel(self) -> None:
        """Give up on the matcher (e.g. the request was aborted): later calls return a failed matcher."""
        if self._res is None:
            if self._task is not None:
                self._task.cancel()
            self._res = StructuredMatcher.failed("structured output: matcher build cancelled")


class MatcherBuilder:
    """Builds :class:`StructuredMatcher` s for :class:`StructuredSpec` s on a thread pool.

    Args:
        tokenizer: the engine's :func:`grammar_tokenizer` (shared by all grammars).
        vocab_size: the model's vocabulary (mask width ``ceil(vocab_size / 32)`` words).
        eos_token_ids: end-of-sequence ids.
        workers: compilation threads.
        timeout_s: per-request limit, from :meth:`submit`, after which the future yields a failed matcher.
        cache_size: compiled grammars kept (LRU, keyed by ``(schema_type, schema)``); 0 disables the cache.
        max_rollback: passed to every matcher.
        strict_json: close JSON objects as xgrammar's strict mode does (``compiler.py``).

    Concurrent submits of one uncached schema compile it once (the others wait for that compilation).
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        workers: int = 2,
        timeout_s: float = 20.0,
        cache_size: int = 256,
        max_rollback: int = DEFAULT_MAX_ROLLBACK,
        strict_json: bool = True,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(int(t) for t in eos_token_ids)
        self._timeout_s = timeout_s
        self._cache_size = cache_size
        self._max_rollback = max_rollback
        self._strict_json = strict_json
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._inflight: dict[tuple[str, str], concurrent.futures.Future[str]] = {}
        self._compiled = 0
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dinfer-grammar")

    @property
    def compiled_count(self) -> int:
        """How many compilations ran (cache hits and waits on an in-flight compilation do not count)."""
        return self._compiled

    @property
    def cache_len(self) -> int:
        """Compiled grammars currently cached."""
        return len(self._cache)

    def submit(self, spec: StructuredSpec) -> MatcherFuture:
        """Start building the matcher for ``spec``; the future's timeout runs from now."""
        start = time.monotonic()
        if not self._closed:
            try:
                return MatcherFuture(self._pool.submit(self._timed_build, spec), self._timeout_s, start)
            except RuntimeError:  # shut down concurrently
                pass
        return MatcherFuture.resolved(StructuredMatcher.failed("structured output: the matcher builder is closed"))

    def close(self, wait: bool = True) -> None:
        """Stop the pool: queued builds are cancelled (their futures yield failed matchers); with ``wait``, block
        until running compilations end."""
        self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> MatcherBuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- worker side -------------------------------------------------------------------------------------------

    def _grammar(self, schema_type: str, schema: str) -> str:
        """The compiled grammar for ``(schema_type, schema)``: cached, awaited from another worker, or compiled."""
        key = (schema_type, schema)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            pending = self._inflight.get(key)
            owner = pending is None
            if owner:
                pending = self._inflight[key] = concurrent.futures.Future()
                self._compiled += 1
        assert pending is not None
        if not owner:
            return pending.result()  # re-raises the owner's GrammarCompileError
        try:
            grammar = compile_grammar(self._tokenizer, schema_type, schema, strict_json=self._strict_json)
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[key]
            if self._cache_size:
                self._cache[key] = grammar
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        pending.set_result(grammar)
        return grammar

    def _timed_build(self, spec: StructuredSpec) -> tuple[StructuredMatcher, float]:
        matcher = self._build(spec)
        return matcher, time.monotonic()

    def _build(self, spec: StructuredSpec) -> StructuredMatcher:
        try:
            grammar = self._grammar(spec.schema_type, spec.schema)
        except GrammarCompileError as exc:
            return StructuredMatcher.failed(str(exc))
        except Exception as exc:
            return StructuredMatcher.failed(
                f"structured output: compiling the {spec.schema_type} schema failed: {exc!r}"
            )
        try:
            return StructuredMatcher(
                self._tokenizer,
                grammar,
                self._vocab_size,
                self._eos,
                trigger_token_ids=spec.trigger_token_ids,
                bound_token_id=spec.bound_token_id,
                max_rollback=self._max_rollback,
            )
        except ValueError as exc:
            return StructuredMatcher.failed(f"structured output: {exc}")
