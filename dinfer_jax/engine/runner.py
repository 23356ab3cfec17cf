"""Device side of the engine: the serving cache, the jitted step per shape bucket, and dispatch of scheduled steps.

A scheduled step becomes a padded ``[B, Q]`` batch (B and Q from the bucket lists, the JAX analogue of DeepInfer's
CUDA-graph sizes, ``docs/spec/engine.md`` §13): padding rows have ``n = 0``, slot 0 and null pages, so they write
nowhere.
The cache (a :class:`ModelCache`) is donated to the step. The runner holds the layer weights stacked in scan layout
(:func:`stack_params`, done once here), a second copy next to the model's checkpoint-layout parameters. A decode row
whose input token is still in flight reads it from the previous
step's device output (``docs/spec/engine.md`` §4), so step N+1 can be dispatched before the host has seen step N's
tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.engine.kv_cache import CacheConfig, init_cache
from dinfer_jax.engine.model_step import model_step
from dinfer_jax.engine.scheduler import ScheduledStep
from dinfer_jax.models import Model
from dinfer_jax.models.layer_plan import stack_params
from dinfer_jax.models.step_state import StepInput
from dinfer_jax.progress import PhaseProgress
from dinfer_jax.sampling import SamplingTensors, sample


def _pow2_buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(sorted(set(out)))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded shapes the step is compiled for: decode ``[B, 1]``, prefill ``[B, Q]``."""

    decode_batch: tuple[int, ...]
    prefill_batch: tuple[int, ...]
    prefill_len: tuple[int, ...]

    @classmethod
    def default(cls, max_num_seqs: int, max_num_batched_tokens: int, max_prefill_batch: int = 4,
                short_prefill: int = 64) -> Buckets:
        """Lean defaults (each shape is one compilation): decode batches in powers of two up to ``max_num_seqs``;
        prefill batches {1, min(max_num_seqs, max_prefill_batch)}; prefill lengths {short, budget}."""
        pb = min(max_num_seqs, max_prefill_batch)
        return cls(decode_batch=_pow2_buckets(max_num_seqs),
                   prefill_batch=tuple(sorted({1, pb})),
                   prefill_len=tuple(sorted({min(short_prefill, max_num_batched_tokens), max_num_batched_tokens})))

    def shapes(self) -> list[tuple[int, int]]:
        return [(b, 1) for b in self.decode_batch] + [(b, q) for b in self.prefill_batch for q in self.prefill_len]

    @staticmethod
    def pick(sizes: tuple[int, ...], n: int, what: str) -> int:
        for s in sizes:
            if s >= n:
                return s
        raise ValueError(f"{what} {n} exceeds the largest compiled bucket {sizes[-1]}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InFlight:
    """Rows whose first token is still on the device: ``use_prev [B]`` bool, ``prev_row [B]`` int32 (row of the
    previous step's sampled tokens to read)."""

    use_prev: jax.Array
    prev_row: jax.Array


@dataclasses.dataclass
class StepOutput:
    """Device futures of one dispatched step (row order = the step's rows, padded to ``max_rows``)."""

    step: ScheduledStep
    tokens: jax.Array  # [max_rows] int32
    logprobs: Any
    dispatched_at: float


class ModelRunner:
    """Owns the cache and the compiled steps; turns :class:`ScheduledStep` into device work."""

    def __init__(self, model: Model, cache_config: CacheConfig, max_model_len: int, buckets: Buckets,
                 max_logprobs: int = 0):
        self.model = model
        self.cfg = model.config
        self.cache_config = cache_config
        self.buckets = buckets
        self.max_rows = max(max(buckets.decode_batch), max(buckets.prefill_batch))
        self.pages_per_seq = math.ceil(max_model_len / cache_config.block_size)
        self.max_logprobs = max_logprobs
        self.cache = init_cache(self.cfg, cache_config, model.dtype)
        self.params = stack_params(self.cfg, model.params)
        self.compiled_shapes: set[tuple[int, int]] = set()
        self.num_compilations = 0
        cmap = None
        efn = None
        if self.cfg.engram_layer_ids:
            cmap = jnp.asarray(model.engram.compressed_map, jnp.int32)
            efn = functools.partial(_engram_callback, self.cfg, model.engram.tables)
        self._cmap = cmap
        step_fn = functools.partial(_device_step, cfg=self.cfg, dtype=model.dtype, moe_impl=model.moe_impl,
                                    engram_fn=efn, max_rows=self.max_rows)
        self._step = jax.jit(step_fn, donate_argnums=(1,))
        self._prev_tokens = jnp.zeros((self.max_rows,), jnp.int32)
        self._prev_step_id: int | None = None

    # ------------------------------------------------------------------ compile
    def warmup(self, progress: bool = False) -> float:
        """Compile every bucket by running an all-padding batch (writes nothing). Returns seconds spent.
        ``progress`` draws a bar over the buckets."""
        t0 = time.perf_counter()
        shapes = list(self.buckets.shapes())
        with PhaseProgress("compile buckets", len(shapes), enabled=progress) as bar:
            for b, q in shapes:
                toks, _, self.cache = self._call(*self._empty_inputs(b, q), self._sampling([], [], [], b), (b, q))
                toks.block_until_ready()
                bar.advance()
        return time.perf_counter() - t0

    def _call(self, inp: dict[str, np.ndarray], feed: dict[str, np.ndarray], samp: Any, shape: tuple[int, int]):
        self.compiled_shapes.add(shape)
        out = self._step(self.params, self.cache, StepInput(**inp), InFlight(**feed), self._prev_tokens, samp,
                         self._cmap)
        # jit's own cache size when available (counts any retrace, not just new shapes); else distinct shapes.
        cache_size = getattr(self._step, "_cache_size", None)
        self.num_compilations = cache_size() if callable(cache_size) else len(self.compiled_shapes)
        return out

    def _empty_inputs(self, b: int, q: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Host buffers of an all-padding ``[b, q]`` step: the :class:`StepInput` fields and the in-flight feed."""
        def z() -> np.ndarray:
            return np.zeros((b,), np.int32)

        inp = dict(tokens=np.zeros((b, q), np.int32), start=z(), n=z(), slot=z(), last=z(),
                   pages=np.zeros((b, self.pages_per_seq), np.int32))
        return inp, dict(use_prev=np.zeros((b,), bool), prev_row=z())

    # ------------------------------------------------------------------ dispatch
    def _sampling(self, params: list[Any], seeds: list[int], positions: list[int], b: int) -> SamplingTensors:
        # Static fields fixed per engine (one compiled variant per bucket).
        return SamplingTensors.from_params(params, seeds, positions, pad_to=b, num_top_logprobs=self.max_logprobs,
                                           use_filters=True)

    def dispatch(self, step: ScheduledStep, params: list[Any], seeds: list[int]) -> StepOutput:
        """Build the padded inputs of ``step`` (``params``/``seeds``: one per row) and launch it asynchronously.

        Each row samples at its RNG position ``end_pos`` — the absolute position of the generated token
        (DeepInfer's ``seqlen_k``) — so a request's draws never depend on its row or its batch."""
        rows = step.rows
        if step.kind == "decode":
            b, q = Buckets.pick(self.buckets.decode_batch, len(rows), "decode batch"), 1
        else:
            b = Buckets.pick(self.buckets.prefill_batch, len(rows), "prefill batch")
            q = Buckets.pick(self.buckets.prefill_len, max(r.num_tokens for r in rows), "prefill chunk")
        inp, feed = self._empty_inputs(b, q)
        for i, r in enumerate(rows):
            inp["start"][i], inp["n"][i], inp["slot"][i] = r.start_pos, r.num_tokens, r.state_slot
            inp["last"][i] = r.num_tokens - 1
            inp["pages"][i, : len(r.block_ids)] = r.block_ids
            if r.token_ids is None:
                src_step, src_row = r.input_src
                if src_step != self._prev_step_id:
                    raise RuntimeError(f"row of request {r.request_id} reads step {src_step}'s output, but the "
                                       f"previous dispatched step is {self._prev_step_id}")
                feed["use_prev"][i], feed["prev_row"][i] = True, src_row
            else:
                inp["tokens"][i, : r.num_tokens] = r.token_ids
        sampling = self._sampling(params, seeds, [r.end_pos for r in rows], b)
        toks, logprobs, self.cache = self._call(inp, feed, sampling, (b, q))
        self._prev_tokens, self._prev_step_id = toks, step.step_id
        return StepOutput(step, toks, logprobs, time.perf_counter())


def _engram_callback(cfg: Any, tables: list[Any], rows: jax.Array) -> jax.Array:
    """Host gather of Engram rows for device n-gram rows ``[B,Q,M]`` → ``[n_engram, B, Q, E_in]`` fp32."""
    e_in = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    shape = jax.ShapeDtypeStruct((len(tables), *rows.shape[:-1], e_in), jnp.float32)

    def host(r: np.ndarray) -> np.ndarray:
        from dinfer_jax.models.engram import engram_hash

        ids = engram_hash(cfg, np.asarray(r, np.int64))
        return np.stack([t.gather(ids[i]).reshape(*r.shape[:-1], -1) for i, t in enumerate(tables)]).astype(np.float32)

    return jax.pure_callback(host, shape, rows)


def _device_step(params: Any, cache: Any, inp: StepInput, feed: InFlight, prev_tokens: jax.Array, samp: Any,
                 cmap: Any, *, cfg: Any, dtype: str, moe_impl: str, engram_fn: Any, max_rows: int):
    """Traced step: resolve in-flight inputs on device, run the model, sample. Outputs padded to ``max_rows``."""
    first = jnp.where(feed.use_prev, prev_tokens[feed.prev_row], inp.tokens[:, 0])
    inp = dataclasses.replace(inp, tokens=inp.tokens.at[:, 0].set(first))
    logits, cache = model_step(params, cache, inp, cfg=cfg, dtype=dtype, moe_impl=moe_impl, engram_fn=engram_fn,
                               cmap=cmap)
    toks, logprobs = sample(logits, samp)
    out = jnp.zeros((max_rows,), jnp.int32).at[: toks.shape[0]].set(toks)
    return out, logprobs, cache
