"""Per-request sampling parameters and their per-row device form.

``SamplingParams`` is the user-facing, immutable request option set (``from dinfer_jax import SamplingParams``).
``SamplingTensors`` is the small pytree of per-row arrays that :func:`dinfer_jax.sampling.sample` consumes inside a
jitted step, built on the host by :meth:`SamplingTensors.from_params`.

DeepInfer semantics kept here (``deepinfer/sampling_params.py``: ``SamplingParams.__init__``/``_verify_args``):
``temperature < SAMPLING_EPS`` (1e-5) means greedy, and DeepInfer then runs the row through the ordinary sampler with
``temperature = 1e-5, top_p = 1, top_k = -1``; :meth:`SamplingTensors.from_params` applies exactly that
substitution (``min_p`` is also disabled), so logprobs of greedy rows are those of DeepInfer. ``seq_seed`` is a uint64;
DeepInfer draws ``random.getrandbits(64)`` when it is absent, which here is the caller's job (once per request, so
every step of the request uses the same seed; see :func:`draw_seed`).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.structured.spec import StructuredSpec, parse_so_args

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (DeepInfer ``SAMPLING_EPS``)."""
INT32_MAX = 2**31 - 1
UINT64_LIMIT = 2**64
MTP_SEED_OFFSET = 1000000007
"""DeepInfer's RNG namespace offset for draft (MTP) sampling (``fused_sample.py: _MTP_SEED_OFFSET``)."""
DRAFT_POS_HASH_MUL = 10000019
"""Sample-position stride between packed rows of one request (``tilelang_ops/common.py``)."""


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens.

    Attributes:
        temperature: >= 0. Logits are multiplied by ``1 / temperature``; below 1e-5 (e.g. 0) the request is greedy.
        top_p: in (0, 1]; nucleus filter (1 disables).
        top_k: -1 (disabled) or >= 1; keep the k most likely tokens.
        min_p: in [0, 1]; keep tokens with probability >= ``min_p`` times the most likely one's (0 disables).
            Not a DeepInfer option; applied after top-p/top-k (see ``sampler.py``).
        max_tokens: >= 1; maximum number of generated tokens.
        seq_seed: None or an int in [0, 2**64); the request's RNG seed (None: the caller draws one per request).
        stop_token_ids: non-negative token ids that end the request.
        ignore_eos: keep generating after EOS.
        logprobs: None (no logprobs) or n >= 0: return the sampled token's logprob and the n most likely tokens'.
        so_args: None, or structured output as DeepInfer reads it: ``{"schema_type": "json" | "regex" | "ebnf",
            "schema": str, "trigger_token_ids": [int, ...] (optional), "bound_token_id": int (optional)}``
            (``docs/structured_outputs.md``). Its form is checked here (ValueError); the schema itself is compiled
            by the engine, and a schema that does not compile ends only its own request (``finish_reason="error"``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    seq_seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    so_args: Mapping[str, Any] | None = field(default=None, hash=False)
    structured: StructuredSpec | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if not _is_int(k) or not (k == -1 or 1 <= k <= INT32_MAX):
            raise ValueError(f"top_k must be -1 (disabled) or an int in [1, 2**31 - 1], got {k!r}")
        mp = self.min_p
        if not _is_real(mp) or not (0.0 <= mp <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {mp!r}")
        mt = self.max_tokens
        if not _is_int(mt) or not (1 <= mt <= INT32_MAX):
            raise ValueError(f"max_tokens must be an int in [1, 2**31 - 1], got {mt!r}")
        s = self.seq_seed
        if s is not None and (not _is_int(s) or not (0 <= s < UINT64_LIMIT)):
            raise ValueError(f"seq_seed must be None or an int in [0, 2**64), got {s!r}")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or lp < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {lp!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (Sequence, np.ndarray)):
            raise ValueError(f"stop_token_ids must be a sequence of non-negative ints, got {stops!r}")
        stops = tuple(stops)
        for tok in stops:
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"stop_token_ids must contain non-negative ints, got {tok!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if self.so_args is not None:
            try:
                spec = parse_so_args(self.so_args)
            except ValueError as e:
                raise ValueError(f"so_args: {e}") from None
            object.__setattr__(self, "structured", spec)

    @property
    def greedy(self) -> bool:
        """True when sampling is greedy (``temperature < 1e-5``)."""
        return self.temperature < SAMPLING_EPS

    def replace(self, **changes) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def draw_seed(params: SamplingParams, rng: random.Random | None = None) -> int:
    """The request's seed: ``params.seq_seed``, else 64 fresh random bits (draw once per request, then reuse)."""
    if params.seq_seed is not None:
        return int(params.seq_seed)
    return (rng or random).getrandbits(64)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling inputs for :func:`~dinfer_jax.sampling.sample` (a pytree; all leaves shape [N]).

    Leaves (numpy arrays from :meth:`from_params`, device arrays or tracers once inside a jitted consumer):
        temperature: f32, already clamped to >= 1e-5 (greedy rows hold 1e-5, as in DeepInfer).
        top_p: f32 in (0, 1]; 1 disables. top_k: int32, -1 disables. min_p: f32, 0 disables.
        greedy: bool, the request asked for temperature < 1e-5.
        seed_hi, seed_lo: uint32 halves of the row's uint64 seed.
        position: int32 sample position (RNG counter, see docs/spec/engine.md §7).
        valid: bool; False marks padding rows (their outputs are zeros).
    Static (part of the jit cache key):
        num_top_logprobs: n of the top-n logprobs output (max requested over the rows, or the caller's bucket).
        use_filters: False when no row uses top-p / top-k / min-p, which lets ``sample`` skip the sorts.
        all_greedy: True when every valid row is greedy, which lets ``sample`` skip the random draw.
    Both flags are decided on the host, not with a ``lax.cond`` in the step: XLA's GPU runtime evaluates a
    conditional whose branches it cannot capture (a sort, a loop) by copying the predicate to the host and waiting,
    which blocks the dispatching thread until the device reaches it (measured on the H200:
    ``scripts/probe_cond_sync.py``, docs/perf/serving_h200.md) and so defeats asynchronous scheduling.
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    greedy: jax.Array
    seed_hi: jax.Array
    seed_lo: jax.Array
    position: jax.Array
    valid: jax.Array
    num_top_logprobs: int = field(default=0, metadata=dict(static=True))
    use_filters: bool = field(default=True, metadata=dict(static=True))
    all_greedy: bool = field(default=False, metadata=dict(static=True))

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int] | np.ndarray | None,
        positions: Sequence[int] | np.ndarray,
        *,
        pad_to: int | None = None,
        num_top_logprobs: int | None = None,
        use_filters: bool | None = None,
        all_greedy: bool | None = None,
    ) -> SamplingTensors:
        """Build the per-row tensors on the host.

        Args:
            params: one :class:`SamplingParams` per row (repeat a request's params for each of its rows).
            seeds: per-row uint64 seeds (ints in [0, 2**64) or a numpy uint64 array); None takes each row's
                ``seq_seed`` (which must then be set; draw missing seeds once per request with :func:`draw_seed`).
            positions: per-row int32 sample positions (see :func:`draft_positions` for packed draft rows).
            pad_to: pad to this many rows (a compiled-step bucket) with ``valid=False`` rows.
            num_top_logprobs: static top-n size; default the max ``logprobs`` over the rows (0 if none).
            use_filters: static; default True iff some non-greedy row uses top-p < 1, top-k != -1 or min-p > 0.
                Pass True to keep one compiled variant per bucket.
            all_greedy: static; default True iff every row is greedy (no rows: True). Pass False to keep one
                compiled variant.
        """
        n = len(params)
        if seeds is None:
            missing = [i for i, p in enumerate(params) if p.seq_seed is None]
            if missing:
                raise ValueError(f"seeds is None but rows {missing[:8]} have seq_seed=None; draw a seed once per "
                                 "request (draw_seed) and pass seeds")
            seeds = [p.seq_seed for p in params]
        seeds_arr = np.asarray([int(s) % UINT64_LIMIT for s in np.asarray(seeds, dtype=object).reshape(-1)],
                               dtype=np.uint64) if n else np.zeros((0,), np.uint64)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if seeds_arr.shape != (n,) or pos.shape != (n,):
            raise ValueError(f"need {n} seeds and positions, got {seeds_arr.shape[0]} and {pos.shape[0]}")
        if n and (pos.min() < -(2**31) or pos.max() > INT32_MAX):
            raise ValueError("positions must fit in int32")
        total = n if pad_to is None else pad_to
        if total < n:
            raise ValueError(f"pad_to={pad_to} is smaller than the number of rows {n}")

        greedy = np.zeros(total, bool)
        temp = np.ones(total, np.float32)
        top_p = np.ones(total, np.float32)
        top_k = np.full(total, -1, np.int32)
        min_p = np.zeros(total, np.float32)
        for i, p in enumerate(params):
            if p.greedy:  # DeepInfer: temperature -> 1e-5, top_p -> 1, top_k -> -1 (min_p off as well)
                greedy[i], temp[i] = True, SAMPLING_EPS
            else:
                temp[i], top_p[i], top_k[i], min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
        valid = np.zeros(total, bool)
        valid[:n] = True
        s = np.zeros(total, np.uint64)
        s[:n] = seeds_arr
        position = np.zeros(total, np.int32)
        position[:n] = pos.astype(np.int32)
        if num_top_logprobs is None:
            num_top_logprobs = max([p.logprobs or 0 for p in params], default=0)
        if use_filters is None:
            use_filters = bool(np.any((top_p < 1.0) | (top_k != -1) | (min_p > 0.0)))
        if all_greedy is None:
            all_greedy = bool(np.all(greedy[:n]))
        # host arrays: a jitted consumer transfers them with its other inputs in one dispatch (nine eager
        # device_puts per engine step cost ~1.5 ms of host time, measured with cProfile on this CPU)
        return cls(
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            greedy=greedy,
            seed_hi=(s >> np.uint64(32)).astype(np.uint32),
            seed_lo=(s & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            position=position,
            valid=valid,
            num_top_logprobs=int(num_top_logprobs),
            use_filters=bool(use_filters),
            all_greedy=bool(all_greedy),
        )


def draft_positions(base_positions: jax.Array, local_step: jax.Array) -> jax.Array:
    """Sample positions of packed rows: ``base + local_step * 10000019`` with int32 wrap-around, as DeepInfer's
    ``expand_sampling_params`` (``tilelang_ops/sampler.py``). Both args int32 of one shape; returns int32."""
    base = jnp.asarray(base_positions, jnp.int32)
    step = jnp.asarray(local_step, jnp.int32)
    return base + step * jnp.int32(DRAFT_POS_HASH_MUL)
