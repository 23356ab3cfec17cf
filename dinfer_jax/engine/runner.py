"""Device side of the engine: the serving cache, the jitted step per shape bucket, and dispatch of scheduled steps.

A scheduled step becomes a padded ``[B, Q]`` batch with a ``[B, P]`` page table (B, Q and P from the bucket lists
of :mod:`dinfer_jax.engine.buckets`, the JAX analogue of DeepInfer's CUDA-graph sizes,
``docs/spec/engine.md`` §13): padding rows have ``n = 0``, slot 0 and null pages, so they write nowhere. P is the
smallest page bucket covering the batch's longest context after the step, so a step reads only pages that exist.
The cache (a :class:`ModelCache`) is donated to the step. The runner holds the layer weights stacked in scan layout
(:func:`stack_params`, done once here) and its ``model`` refers to those, not to the checkpoint layout, so the
engine itself never keeps two copies (a caller that still holds the Model it passed keeps the other). A decode row
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

from dinfer_jax.engine.buckets import Buckets
from dinfer_jax.engine.compile_pool import (
    CompilerOptions,
    CompileTiming,
    LoweringJob,
    compile_programs,
    compiler_options_key,
    default_compile_threads,
)
from dinfer_jax.engine.kv_cache import CacheConfig, init_cache
from dinfer_jax.engine.model_step import _engram_rows_device, model_step
from dinfer_jax.engine.records import NONFINITE_TOKEN
from dinfer_jax.engine.scheduler import ScheduledStep
from dinfer_jax.engine.speculative import SpecState, draft, draft_dspark, init_spec_state, verify
from dinfer_jax.models import Model
from dinfer_jax.models.backbone import head_logits
from dinfer_jax.models.engram_lookup import EngramLookup, EngramState
from dinfer_jax.models.invariant import batch_invariant as invariant_tracing
from dinfer_jax.models.invariant import token_tiled
from dinfer_jax.models.layer_plan import stack_params
from dinfer_jax.models.linear_impl import linear_impl as linear_impl_scope
from dinfer_jax.models.linear_impl import resolve_linear_impl
from dinfer_jax.models.step_state import StepInput
from dinfer_jax.progress import PhaseProgress
from dinfer_jax.sampling import SamplingTensors, sample
from dinfer_jax.structured.bitmask import apply_token_bitmask, mask_words
from pallas_kernels.lowering_reuse import platform_from_env, reuse_kernel_lowerings

__all__ = ["Buckets", "InFlight", "ModelRunner", "StepOutput"]


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
    tokens: jax.Array | None  # [max_rows] int32; None while the sampler is not dispatched yet (pending)
    logprobs: Any
    dispatched_at: float
    shape: tuple[int, int, int] = (0, 0, 0)  # the compiled bucket (B, Q, P) it ran in
    # speculative decode steps: tokens is [max_rows, Q] and row i emitted tokens[i, :num_accepted[i] + 1]
    num_accepted: Any = None
    # a step dispatched with ``defer_sample``: the model's logits and the rows' sampling inputs, waiting for
    # :meth:`ModelRunner.sample_step` (structured-output rows need token masks built from committed tokens)
    pending: tuple[jax.Array, SamplingTensors] | None = None
    # speculative steps: the drafter's confidences in the drafts each row published, [max_rows, k] f32
    draft_confidences: Any = None
    # time.perf_counter() just before the step's program was called (its inputs already built): the start of
    # what ModelRunner.decode_time_ms times, for the online step-time correction (spec_schedule.StepTimeCorrection)
    called_at: float = 0.0


class ModelRunner:
    """Owns the cache and the compiled steps; turns :class:`ScheduledStep` into device work.

    ``buckets`` with ``pages=None`` get the default page buckets for ``max_model_len`` (:meth:`Buckets.resolve`);
    ``self.buckets`` holds the resolved set."""

    def __init__(self, model: Model, cache_config: CacheConfig, max_model_len: int, buckets: Buckets,
                 max_logprobs: int = 0, speculative: str | None = None, num_speculative_tokens: int = 0,
                 attention: str = "auto", engram_tables: str = "device", compiler_options: CompilerOptions = (),
                 yoco_keep: int | None = None, batch_invariant: int = 0, yoco_compact: bool = False,
                 decode_compiler_options: CompilerOptions | None = None):
        self.cfg = model.config
        self.yoco_keep = yoco_keep  # V4.1 yoco="mask"/"compact": rows carry their window floor (fill_step_inputs)
        if yoco_compact and yoco_keep is None:
            raise ValueError("yoco_compact needs yoco_keep")
        # yoco="compact": prefill steps whose rows all lie below their floor run the YOCO region's sources only
        self.yoco_compact = yoco_compact
        self.yoco_skip_steps = 0  # prefill steps that ran so (LLM.metrics()["yoco_skipped_steps"])
        self._programs = step_programs(compiler_options)
        # decode buckets may compile with other XLA options (LLM decode_compiler_options; None: the same)
        decode_options = compiler_options if decode_compiler_options is None else decode_compiler_options
        self._decode_programs = step_programs(decode_options)
        # The speculative decode step samples (verification, drafts) under data-dependent conditionals inside the
        # model's program: compiled as the sampler is on a GPU (GPU_SAMPLER_OPTIONS), it no longer blocks the host
        # (V4-Flash 4-layer slice + MTP, batch 64, k = 4, H100: returned after 23.5 ms = its completion, now after
        # 4.8 ms; 23.2 -> 20.6 ms a step greedy, 34.1 -> 30.6 at temperature 1; same tokens;
        # docs/perf/speculative_h200.md). Prefill steps keep the model's options (unmeasured with these).
        self._spec_decode_programs = step_programs(sampler_program_options(decode_options, jax.default_backend()))
        self.cache_config = cache_config
        self.max_pages = math.ceil(max_model_len / cache_config.block_size)
        self.buckets = buckets.resolve(self.max_pages, cache_config.block_size)
        self._decode_shapes = set(self.buckets.decode_shapes())
        self.max_rows = max(max(buckets.decode_batch), max(buckets.prefill_batch))
        self.max_logprobs = max_logprobs
        self.cache = init_cache(self.cfg, cache_config, model.dtype)
        self.params = stack_params(self.cfg, model.params)
        # The runner keeps only the scan layout: the checkpoint-layout layer weights stay alive only while the
        # caller holds its own Model (LLM(path) holds none), instead of two copies of every layer for the engine's
        # life. Every model function accepts either layout.
        self.model = dataclasses.replace(model, params=self.params)
        self.compiled_shapes: set[tuple[int, int, int]] = set()
        self.compiled_samplers: set[tuple[int, bool, bool]] = set()  # (batch, use_filters, all_greedy)
        self.num_compilations = 0  # compilations this runner's calls caused (shared steps: see _CompileCounter)
        self.launch_seconds = 0.0  # host time inside the jitted step calls of dispatch (argument transfer, launch)
        self.sampler_launch_seconds = 0.0  # of which the separate sampler program's calls (sample_step)
        self.warmup_timings: tuple[CompileTiming, ...] = ()  # per program of the last threaded warm-up, lowering order
        # confidence-scheduled verification: ms per decode step of each (B, Q, P) bucket, measured at warm-up (or
        # on first use) when several widths are compiled; the width choice reads it (decode_time_ms)
        self.decode_step_ms: dict[tuple[int, int, int], float] = {}
        self._forward_static, self._engram = step_statics(model, attention, engram_tables, batch_invariant)
        self._sample_static = {"max_rows": self.max_rows, "batch_invariant": batch_invariant}
        self._static = {**self._forward_static, "max_rows": self.max_rows}  # the speculative step also samples
        self.speculative = speculative
        self.k = num_speculative_tokens if speculative else 0
        self.spec: SpecState | None = None
        if speculative:
            if self.buckets.decode_len != 1 + self.k:
                raise ValueError(f"speculative decode buckets need decode_len = 1 + {self.k}")
            widths = self.buckets.widths()
            if widths != tuple(sorted(set(widths))) or widths[0] < 1 or widths[-1] != 1 + self.k:
                raise ValueError(f"speculative decode widths {widths} must increase from >= 1 to 1 + {self.k}")
            self.spec = init_spec_state(self.cfg, cache_config, self.k, model.dtype, speculative)
        self._prev_tokens = jnp.zeros((self.max_rows,), jnp.int32)
        self._prev_nacc = jnp.zeros((self.max_rows,), jnp.int32)  # speculative: the last step's accepted drafts
        # A step's outputs are committed to its device, so from the second step on the state fed back (cache,
        # previous tokens, drafter state) is committed; it is committed from the start, with the sampler's warm-up
        # logits, so warm-up lowers and compiles what serving runs. (Where the lowering and the call differ in it,
        # jax lowers and compiles the call's program again for a program that embeds exported kernels
        # (pallas_kernels/lowering_reuse.py: measured on the H100, every bucket compiled twice), and for
        # host-placed Engram tables, whose memory kind commits every output.)
        device = next(iter(jax.tree.leaves(self.cache)[0].devices()))   # where the cache was made (default device)
        self._commit = jax.sharding.SingleDeviceSharding(device)
        self.cache, self._prev_tokens, self._prev_nacc, self.spec = jax.device_put(
            (self.cache, self._prev_tokens, self._prev_nacc, self.spec), self._commit)
        self._prev_step_id: int | None = None
        self.mask_words = mask_words(self.cfg.vocab_size)
        self._full_masks: dict[Any, jax.Array] = {}  # b or (b, "spec") -> all-allowed masks kept on the device

    # ------------------------------------------------------------------ compile
    def warmup(self, progress: bool = False, compile_threads: int | None = None, staged: bool | None = None) -> float:
        """Compile every bucket, then run each once on an all-padding batch (writes nothing). Returns seconds
        spent. The programs are compiled ahead of time on ``compile_threads`` threads (default
        :func:`default_compile_threads`; 1 compiles each bucket by running it, one after another), so the runs
        find them in jax's compilation cache: lowered one after another, each compiled as soon as it is lowered
        (:func:`lower_then_compile`), one program of each ``(rows, tokens)`` shape first. ``staged`` (default
        :func:`default_staged`: on a GPU) makes the other page-table widths of a shape compile after its first
        (XLA's autotuning results are then reused instead of recomputed). Per-program times:
        :attr:`warmup_timings`. ``progress`` draws a bar over the programs."""
        t0 = time.perf_counter()
        shapes = list(self.buckets.shapes())
        n_decode = len(self.buckets.decode_shapes())  # shapes() lists decode first
        # (shape, decode, yoco_skip) of every model program: yoco="compact" adds each prefill shape's skip variant
        programs = [(shape, idx < n_decode, False) for idx, shape in enumerate(shapes)]
        programs += [(shape, False, True) for shape in shapes[n_decode:] if self.yoco_compact]
        samplers = [] if self.spec is not None else [  # the speculative step samples inside its own program
            (b, *variant) for b in sorted({b for b, _, _ in shapes}) for variant in SAMPLER_VARIANTS]
        threads = default_compile_threads() if compile_threads is None else compile_threads
        with PhaseProgress("compile buckets", len(programs) + len(samplers), enabled=progress) as bar:
            if threads > 1:
                jobs = [LoweringJob(_program_name(*prog), functools.partial(self._lower_step, *prog),
                                    (prog[0][:2], prog[1], prog[2])) for prog in programs]
                tail = [LoweringJob(_sampler_name(*smp), functools.partial(self._lower_sampler, *smp), smp)
                        for smp in samplers]   # last: short compiles
                self.warmup_timings = tuple(compile_programs(jobs, threads, staged, tail=tail, on_done=bar.advance))
            for (b, q, p), decode, skip in programs:
                if self.spec is not None:
                    inp, feed = self._empty_inputs(b, q, p)
                    toks = self._call_spec(inp, feed, self._sampling([], [], [], b), (b, q, p), decode,
                                           *self._spec_extra(b))[0]
                else:
                    toks, _, self.cache = self._call(*self._empty_inputs(b, q, p), self._sampling([], [], [], b),
                                                     (b, q, p), skip)
                toks.block_until_ready()
                if threads <= 1:
                    bar.advance()
            for b, use_filters, all_greedy in samplers:
                self._sample(*self._sampler_args(b, use_filters, all_greedy))[0].block_until_ready()
                if threads <= 1:
                    bar.advance()
        if self.spec is not None and len(self.buckets.widths()) > 1:
            for shape in self.buckets.decode_shapes():
                self.decode_time_ms(*shape)
        return time.perf_counter() - t0

    def decode_time_ms(self, b: int, q: int, p: int, reps: int = 3) -> float:
        """Milliseconds of one speculative decode step of bucket ``(b, q, p)`` (the median of ``reps`` runs on an
        all-padding batch, which writes nothing), measured once and kept in :attr:`decode_step_ms`; warm-up
        measures every decode bucket when several widths are compiled. All-padding rows take the greedy path of
        the verifying sampler, so the curve leaves out the random draws of sampled rows."""
        if (b, q, p) not in self.decode_step_ms:
            if self.spec is None:
                raise ValueError("decode step times are measured for speculative decoding only")
            inp, feed = self._empty_inputs(b, q, p)
            samp, extra = self._sampling([], [], [], b), self._spec_extra(b)
            times = []
            for _ in range(reps + 1):   # the first run may compile (warmup=False) or page in: not counted
                t0 = time.perf_counter()
                self._call_spec(inp, feed, samp, (b, q, p), True, *extra)[0].block_until_ready()
                times.append(time.perf_counter() - t0)
            self.decode_step_ms[(b, q, p)] = 1e3 * float(np.median(times[1:]))
        return self.decode_step_ms[(b, q, p)]

    def _lower_step(self, shape: tuple[int, int, int], decode: bool, yoco_skip: bool = False) -> Any:
        """The lowered model program of bucket ``shape`` (as :meth:`_call` / :meth:`_call_spec` will run it)."""
        b, q, p = shape
        inp, feed = self._empty_inputs(b, q, p)
        if self.spec is not None:
            args, kw = self._spec_args(inp, feed, self._sampling([], [], [], b), decode, *self._spec_extra(b))
            return self._spec_program(decode).lower(*args, **kw)
        forward = self._programs_for(shape in self._decode_shapes).forward   # as _forward picks it
        return forward.lower(*self._forward_args(inp, feed), **self._forward_kw(yoco_skip))

    def _programs_for(self, decode: bool) -> StepPrograms:
        return self._decode_programs if decode else self._programs

    def _spec_program(self, decode: bool) -> Any:
        """The speculative step's jitted program for decode or prefill buckets."""
        return (self._spec_decode_programs if decode else self._programs).step_spec

    def _forward_kw(self, yoco_skip: bool) -> dict[str, Any]:
        return {**self._forward_static, "yoco_skip": True} if yoco_skip else self._forward_static

    def _forward_args(self, inp: dict[str, np.ndarray], feed: dict[str, np.ndarray]) -> tuple[Any, ...]:
        """Positional arguments of the model program (``StepPrograms.forward``) for one step's host inputs."""
        return self.params, self.cache, StepInput(**inp), InFlight(**feed), self._prev_tokens, self._engram

    def _spec_args(self, inp: dict[str, np.ndarray], feed: dict[str, np.ndarray], samp: Any, decode: bool,
                   ndraft: np.ndarray, next_tok: np.ndarray, sample_mask: np.ndarray,
                   token_masks: Any, chain_row: np.ndarray,
                   chain_room: np.ndarray) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments of the speculative program (``StepPrograms.step_spec``): ``(positional, keyword)``."""
        return ((self.params, self.cache, self.spec, StepInput(**inp), InFlight(**feed), self._prev_tokens, samp,
                 self._engram, ndraft, next_tok, sample_mask, token_masks, self._prev_nacc, chain_row, chain_room),
                dict(k=self.k, method=self.speculative, decode=decode, **self._static))

    def _sampler_args(self, b: int, use_filters: bool,
                      all_greedy: bool) -> tuple[jax.Array, SamplingTensors, jax.Array]:
        logits = jnp.zeros((b, self.cfg.vocab_size), jnp.float32)
        logits = jax.device_put(logits, self._commit)
        return logits, SamplingTensors.from_params([], [], [], pad_to=b, num_top_logprobs=self.max_logprobs,
                                                   use_filters=use_filters, all_greedy=all_greedy), self.full_mask(b)

    def full_spec_masks(self, b: int) -> jax.Array:
        """The speculative step's all-allowed token masks ``int32 [b, 1 + k, ceil(V / 32)]`` (one per verified
        position), created once per batch size on the device."""
        if (b, "spec") not in self._full_masks:
            self._full_masks[(b, "spec")] = jnp.full((b, 1 + self.k, self.mask_words), -1, jnp.int32)
        return self._full_masks[(b, "spec")]

    def draft_tokens(self) -> np.ndarray:
        """The drafts each state slot will have verified next ``int32 [slots, k]`` (waits for the steps in flight)."""
        return np.asarray(self.spec.draft_tokens)

    def full_mask(self, b: int) -> jax.Array:
        """The all-allowed token mask ``int32 [b, ceil(V / 32)]`` (every bit set), created once per batch size on
        the device: steps without structured-output rows upload no mask."""
        if b not in self._full_masks:
            self._full_masks[b] = jnp.full((b, self.mask_words), -1, jnp.int32)
        return self._full_masks[b]

    def _lower_sampler(self, b: int, use_filters: bool, all_greedy: bool) -> Any:
        return self._programs.sample.lower(*self._sampler_args(b, use_filters, all_greedy), **self._sample_static)

    def _call(self, inp: dict[str, np.ndarray], feed: dict[str, np.ndarray], samp: SamplingTensors,
              shape: tuple[int, int, int], yoco_skip: bool = False):
        logits, cache = self._forward(inp, feed, shape, yoco_skip)
        toks, logprobs = self._sample(logits, samp, self.full_mask(shape[0]))
        return toks, logprobs, cache

    def _forward(self, inp: dict[str, np.ndarray], feed: dict[str, np.ndarray],
                 shape: tuple[int, int, int], yoco_skip: bool = False) -> tuple[jax.Array, Any]:
        key = (*shape, "yoco_skip") if yoco_skip else shape
        forward = self._programs_for(shape in self._decode_shapes).forward
        with _CompileCounter(self, forward, key):
            return forward(*self._forward_args(inp, feed), **self._forward_kw(yoco_skip))

    def _sample(self, logits: jax.Array, samp: SamplingTensors, token_mask: Any) -> tuple[jax.Array, Any]:
        key = (logits.shape[0], samp.use_filters, samp.all_greedy)
        with _CompileCounter(self, self._programs.sample, key, self.compiled_samplers):
            return self._programs.sample(logits, samp, token_mask, **self._sample_static)

    def _spec_extra(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, jax.Array, np.ndarray, np.ndarray]:
        """Speculative per-row inputs: drafts to verify, next token of a prefill chunk, rows that sample, the
        token masks of the verified positions (all allowed), and for chained rows the previous step's row whose
        accepted drafts move their start (-1: none) and their draft room (``ScheduledRow.draft_room``)."""
        return (np.zeros((b,), np.int32), np.zeros((b,), np.int32), np.zeros((b,), bool), self.full_spec_masks(b),
                np.full((b,), -1, np.int32), np.zeros((b,), np.int32))

    def _call_spec(self, inp: dict[str, np.ndarray], feed: dict[str, np.ndarray], samp: Any,
                   shape: tuple[int, int, int], decode: bool, ndraft: np.ndarray, next_tok: np.ndarray,
                   sample_mask: np.ndarray, token_masks: Any, chain_row: np.ndarray, chain_room: np.ndarray):
        args, kw = self._spec_args(inp, feed, samp, decode, ndraft, next_tok, sample_mask, token_masks, chain_row,
                                   chain_room)
        step_spec = self._spec_program(decode)
        with _CompileCounter(self, step_spec, (*shape, decode)):
            toks, nacc, logprobs, self.cache, self.spec, conf = step_spec(*args, **kw)
        return toks, nacc, logprobs, conf

    def _empty_inputs(self, b: int, q: int, p: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return empty_inputs(b, q, p, window_floor=self.yoco_keep is not None)

    # ------------------------------------------------------------------ dispatch
    def _sampling(self, params: list[Any], seeds: list[int], positions: list[int], b: int) -> SamplingTensors:
        # The plain step's sampler variant follows the rows (SAMPLER_VARIANTS); the speculative step samples inside
        # its own program, so it keeps one variant per bucket.
        greedy = self.spec is None and all(p.greedy for p in params)
        return SamplingTensors.from_params(params, seeds, positions, pad_to=b, num_top_logprobs=self.max_logprobs,
                                           use_filters=not greedy, all_greedy=greedy)

    def dispatch(self, step: ScheduledStep, params: list[Any], seeds: list[int],
                 defer_sample: bool = False, spec_masks: np.ndarray | None = None) -> StepOutput:
        """Build the padded inputs of ``step`` (``params``/``seeds``: one per row) and launch it asynchronously.

        ``defer_sample`` launches only the model: the returned output is pending until :meth:`sample_step` gives
        the rows' token masks (structured outputs); the next step must not be dispatched before that. Not with
        speculative decoding (its step samples inside the model's program): there ``spec_masks``
        ``int32 [len(step.rows), 1 + k, ceil(V / 32)]`` gives the token masks of each row's verified positions
        (position 0: the target's own token; j: after draft j − 1), built before the dispatch.

        Each row samples at its RNG position ``end_pos`` — the absolute position of the generated token
        (DeepInfer's ``seqlen_k``) — so a request's draws never depend on its row or its batch. The page table
        has the smallest page bucket covering the longest ``start + n`` of the rows; a row's block table is cut to
        it (blocks past the step's context, e.g. those of a prompt's later chunks, cannot be read yet)."""
        if defer_sample and self.spec is not None:
            raise ValueError("defer_sample (token masks) is not available with speculative decoding")
        rows = step.rows
        if step.kind == "decode":
            b = Buckets.pick(self.buckets.decode_batch, len(rows), "decode batch")
            q = Buckets.pick(self.buckets.widths(), 1 + max(r.num_drafts for r in rows), "decode width")
        else:
            b = Buckets.pick(self.buckets.prefill_batch, len(rows), "prefill batch")
            q = Buckets.pick(self.buckets.prefill_len, max(r.num_tokens for r in rows), "prefill chunk")
        bs = self.cache_config.block_size
        p = self.buckets.pages_for((r.reach_pos for r in rows), bs)
        inp, feed = fill_step_inputs(step, b, q, p, bs, self._prev_step_id, self.yoco_keep)
        sampling = self._sampling(params, seeds, [r.end_pos for r in rows], b)
        if self.spec is not None:
            extra = self._spec_extra(b)
            for i, r in enumerate(rows):
                extra[0][i], extra[1][i], extra[2][i] = r.num_drafts, r.next_token, r.sample
                if r.chained:
                    extra[4][i], extra[5][i] = r.input_src[1], r.draft_room
            if spec_masks is not None:
                masks = np.full((b, 1 + self.k, self.mask_words), -1, np.int32)
                masks[: len(rows)] = spec_masks
                extra = (*extra[:3], jax.device_put(masks), *extra[4:])  # a device array like the warm-up's
            decode = step.kind == "decode"
            t0 = time.perf_counter()
            toks, nacc, logprobs, conf = self._call_spec(inp, feed, sampling, (b, q, p), decode, *extra)
            self.launch_seconds += time.perf_counter() - t0
            # what the next step's in-flight rows read: each row's last emitted token and its accepted drafts
            first = jnp.take_along_axis(toks, nacc[:, None], axis=1)[:, 0] if decode else toks
            self._prev_tokens, self._prev_nacc, self._prev_step_id = first, nacc, step.step_id
            return StepOutput(step, toks, logprobs, time.perf_counter(), (b, q, p), nacc if decode else None,
                              draft_confidences=conf, called_at=t0)
        # yoco="compact": no row reaches its kept suffix [prefill_len − keep, prefill_len) (the scheduler cuts a
        # prompt's chunks at that floor), so the YOCO region only writes its sources' rows
        skip = self.yoco_compact and step.kind == "prefill" and all(
            r.start_pos + r.num_tokens <= r.seq.prefill_len - self.yoco_keep for r in rows)
        self.yoco_skip_steps += skip
        t0 = time.perf_counter()
        logits, self.cache = self._forward(inp, feed, (b, q, p), skip)
        self.launch_seconds += time.perf_counter() - t0
        out = StepOutput(step, None, None, time.perf_counter(), (b, q, p), pending=(logits, sampling))
        if not defer_sample:
            self.sample_step(out)
        return out

    def sample_step(self, out: StepOutput, token_mask: np.ndarray | None = None) -> None:
        """Launch the sampler of a pending step (:meth:`dispatch` with ``defer_sample``), with ``token_mask``
        ``int32 [B, ceil(V / 32)]`` (bit ``v % 32`` of word ``v // 32`` set: token ``v`` allowed; None: all
        allowed) applied to the logits first. Fills ``out.tokens`` / ``out.logprobs``."""
        if out.pending is None:
            raise ValueError(f"step {out.step.step_id} has no pending sampler")
        logits, sampling = out.pending
        b = out.shape[0]
        if token_mask is None:
            mask = self.full_mask(b)
        else:
            mask = np.asarray(token_mask)
            if mask.shape != (b, self.mask_words) or mask.dtype != np.int32:
                raise ValueError(f"token_mask must be int32 {(b, self.mask_words)}, got {mask.dtype} {mask.shape}")
            mask = jax.device_put(mask)  # a device array like full_mask's: the same compiled sampler serves both
        t0 = time.perf_counter()
        out.tokens, out.logprobs = self._sample(logits, sampling, mask)
        dt = time.perf_counter() - t0
        self.launch_seconds += dt
        self.sampler_launch_seconds += dt
        out.pending = None
        self._prev_tokens, self._prev_step_id = out.tokens, out.step.step_id


def step_statics(model: Model, attention: str = "auto", engram_tables: str = "device",
                 batch_invariant: int = 0) -> tuple[dict[str, Any], EngramState | None]:
    """The model program's static keyword arguments for ``model`` (configuration, dtype, MoE implementation,
    Engram lookup, compressed-row attention mode, the batch-invariant tile when on; steps that also sample add
    ``max_rows``) and the Engram state it
    reads (V4.1: the compressed-id map and the tables placed by ``engram_tables``, one of
    :data:`~dinfer_jax.models.engram_lookup.ENGRAM_PLACEMENTS`;
    None otherwise)."""
    cfg = model.config
    state = lookup = None
    if cfg.engram_layer_ids:
        state = model.engram.state(engram_tables)
        lookup = EngramLookup(cfg, placement=engram_tables)
    statics = dict(cfg=cfg, dtype=model.dtype, moe_impl=model.moe_impl, engram_fn=lookup, attention=attention,
                   mhc_impl=model.mhc_impl, linear_impl=model.linear_impl, attention_impl=model.attention_impl)
    if batch_invariant:   # only the one-device forward takes it (LLM refuses it with speculative decoding or DP)
        statics["batch_invariant"] = batch_invariant
    return statics, state


def empty_inputs(b: int, q: int, p: int, window_floor: bool = False) -> tuple[dict[str, np.ndarray],
                                                                            dict[str, np.ndarray]]:
    """Host buffers of an all-padding ``[b, q]`` step with ``[b, p]`` page tables: the :class:`StepInput` fields and
    the in-flight feed; ``window_floor``: with the ``[b]`` YOCO window floor (the engine's ``yoco="mask"``)."""
    def z() -> np.ndarray:
        return np.zeros((b,), np.int32)

    inp = dict(tokens=np.zeros((b, q), np.int32), start=z(), n=z(), slot=z(), last=z(),
               pages=np.zeros((b, p), np.int32))
    if window_floor:
        inp["window_floor"] = z()
    return inp, dict(use_prev=np.zeros((b,), bool), prev_row=z())


def fill_step_inputs(step: ScheduledStep, b: int, q: int, p: int, block_size: int, prev_step_id: int | None,
                     yoco_keep: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Host buffers of ``step``'s rows padded to the bucket ``(b, q, p)``; ``prev_step_id``: the step whose
    device outputs in-flight input tokens are read from (RuntimeError if a row names another). ``yoco_keep``
    (V4.1 ``yoco="mask"``): each row's window floor is ``prefill_len − yoco_keep`` of its sequence's admission, so
    the YOCO layers' window keys before the last ``yoco_keep`` prefilled tokens are hidden, in every chunk and in
    decode (where the window lies above the floor: ``yoco_keep`` ≥ window + backtracking)."""
    inp, feed = empty_inputs(b, q, p, window_floor=yoco_keep is not None)
    rows = step.rows
    n = len(rows)
    start = np.fromiter((r.start_pos for r in rows), np.int32, n)
    count = np.fromiter((r.num_tokens for r in rows), np.int32, n)
    inp["start"][:n], inp["n"][:n] = start, count
    inp["slot"][:n] = np.fromiter((r.state_slot for r in rows), np.int32, n)
    inp["last"][:n] = count - 1
    if yoco_keep is not None:
        inp["window_floor"][:n] = np.fromiter((max(0, r.seq.prefill_len - yoco_keep) for r in rows), np.int32, n)
    # a chained row's start may move up by its slack on the device: its page table covers that
    reach = np.fromiter((r.reach_pos for r in rows), np.int64, n)
    need = -(-reach // block_size)
    for i, r in enumerate(rows):
        if len(r.block_ids) < need[i]:
            raise RuntimeError(f"row of request {r.request_id} covers positions < {reach[i]} "
                               f"but has {len(r.block_ids)} blocks of {block_size} tokens")
        inp["pages"][i, : need[i]] = r.block_ids[: need[i]]
        if r.token_ids is None:
            src_step, src_row = r.input_src
            if src_step != prev_step_id:
                raise RuntimeError(f"row of request {r.request_id} reads step {src_step}'s output, but the "
                                   f"previous dispatched step is {prev_step_id}")
            feed["use_prev"][i], feed["prev_row"][i] = True, src_row
        else:
            inp["tokens"][i, : len(r.token_ids)] = r.token_ids
    return inp, feed


def _device_forward(params: Any, cache: Any, inp: StepInput, feed: InFlight, prev_tokens: jax.Array, engram: Any, *,
                    cfg: Any, dtype: str, moe_impl: str, engram_fn: Any, ep_manual: int = 0, cp_manual: int = 0,
                    copies_manual: int = 0, attention: str = "auto", count_experts: bool = False,
                    batch_invariant: int = 0, yoco_skip: bool = False, mhc_impl: str = "auto",
                    linear_impl: str = "xla", attention_impl: str = "auto") -> tuple[Any, ...]:
    """Traced model part of a step: resolve in-flight inputs on device, run the model. Returns ``(logits [B, V]
    fp32 at each row's last token, cache)``, plus the expert loads ``[L, E]`` with ``count_experts``.
    ``batch_invariant``: token rows per fixed-shape product (0: off; :mod:`dinfer_jax.models.invariant`).
    ``yoco_skip``: a V4.1 ``yoco="compact"`` prefill step of kept-out rows (:func:`model_step`)."""
    first = jnp.where(feed.use_prev, prev_tokens[feed.prev_row], inp.tokens[:, 0])
    inp = dataclasses.replace(inp, tokens=inp.tokens.at[:, 0].set(first))
    return model_step(params, cache, inp, cfg=cfg, dtype=dtype, moe_impl=moe_impl, engram_fn=engram_fn, engram=engram,
                      ep_manual=ep_manual, cp_manual=cp_manual, copies_manual=copies_manual, attention=attention,
                      count_experts=count_experts, batch_invariant=batch_invariant, yoco_skip=yoco_skip,
                      mhc_impl=mhc_impl, linear_impl=linear_impl, attention_impl=attention_impl)


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """``x [B, ...]`` padded with zero rows to ``[rows, ...]`` (``rows >= B``).

    A pad, not ``zeros(...).at[:B].set(x)``: under ``jax.shard_map`` (the DP engines' step) jax 0.11.2's Shardy
    partitioner crashes the process (segmentation fault) on a scatter that overwrites a whole fresh array, as
    that is when ``B == rows`` (bisected on CPU with jax 0.11.2; the two-H200 engines crashed in the same pass,
    2026-12-04; ``docs/dp_engines.md``)."""
    if x.shape[0] == rows:
        return x
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _sample_rows(logits: jax.Array, samp: SamplingTensors, token_mask: jax.Array | None) -> tuple[jax.Array, Any]:
    """Tokens ``[N]`` int32 (:data:`NONFINITE_TOKEN` for rows whose logits are not all finite) and logprobs of
    ``N`` rows of logits ``[N, V]`` fp32."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)  # before the mask: masked-out entries are -inf by design
    if token_mask is not None:
        logits = apply_token_bitmask(logits, token_mask)
    toks, logprobs = sample(logits, samp)
    return jnp.where(finite, toks, NONFINITE_TOKEN), logprobs


def _device_sample(logits: jax.Array, samp: SamplingTensors, token_mask: jax.Array | None = None, *,
                   max_rows: int, batch_invariant: int = 0) -> tuple[jax.Array, Any]:
    """Traced sampling part of a step: tokens padded to ``max_rows`` ``[max_rows]`` int32, and the logprobs.
    ``token_mask`` ``int32 [B, ceil(V / 32)]`` (structured outputs): tokens whose bit is clear get ``-inf`` logits
    before sampling; an all-set row leaves its logits bit for bit. ``batch_invariant`` (rows per tile, 0: off):
    the rows are sampled ``batch_invariant`` at a time by one fixed-shape program (:func:`~dinfer_jax.models.
    invariant.token_tiled`): XLA reduces a ``[1, V]`` and a ``[64, V]`` array in different orders on the H200
    (the log-softmax's sums then differ by an ulp), so the row count must not reach the sampler's shapes."""
    if batch_invariant:
        leaves, tree = jax.tree.flatten(samp)
        masks = () if token_mask is None else (token_mask,)

        def tile(lg: jax.Array, *rest: jax.Array) -> tuple[jax.Array, Any]:
            s = jax.tree.unflatten(tree, rest[: len(leaves)])
            return _sample_rows(lg, s, rest[len(leaves)] if masks else None)

        toks, logprobs = token_tiled(tile, logits, *leaves, *masks, lead=1, tile=batch_invariant)
    else:
        toks, logprobs = _sample_rows(logits, samp, token_mask)
    return pad_rows(toks, max_rows), logprobs


def _device_step_spec(params: Any, cache: Any, spec: SpecState, inp: StepInput, feed: InFlight,
                      prev_tokens: jax.Array, samp: Any, engram: Any, ndraft: jax.Array, next_tok: jax.Array,
                      sample_mask: jax.Array, token_masks: jax.Array, prev_nacc: jax.Array, chain_row: jax.Array,
                      chain_room: jax.Array, *, cfg: Any, dtype: str, moe_impl: str, engram_fn: Any, attention: str,
                      max_rows: int, k: int, decode: bool, method: str, mhc_impl: str = "auto",
                      linear_impl: str = "xla", attention_impl: str = "auto", batch_invariant: int = 0):
    """:func:`_step_spec` with the FP8 linears of the model and the drafter on ``linear_impl``
    (:mod:`dinfer_jax.models.linear_impl`); ``batch_invariant`` (rows per tile, 0: off) traces the whole step — the
    target's forward and head, the verification and the drafter — with :func:`~dinfer_jax.models.invariant.
    batch_invariant`."""
    with (invariant_tracing(batch_invariant),
          linear_impl_scope(resolve_linear_impl(linear_impl, bool(batch_invariant))),
          reuse_kernel_lowerings(platform_from_env())):
        return _step_spec(params, cache, spec, inp, feed, prev_tokens, samp, engram, ndraft, next_tok, sample_mask,
                          token_masks, prev_nacc, chain_row, chain_room, cfg=cfg, dtype=dtype, moe_impl=moe_impl,
                          engram_fn=engram_fn, attention=attention, max_rows=max_rows, k=k, decode=decode,
                          method=method, mhc_impl=mhc_impl, attention_impl=attention_impl,
                          batch_invariant=batch_invariant)


def _step_spec(params: Any, cache: Any, spec: SpecState, inp: StepInput, feed: InFlight,
               prev_tokens: jax.Array, samp: Any, engram: Any, ndraft: jax.Array, next_tok: jax.Array,
               sample_mask: jax.Array, token_masks: jax.Array, prev_nacc: jax.Array, chain_row: jax.Array,
               chain_room: jax.Array, *, cfg: Any, dtype: str, moe_impl: str,
               engram_fn: Any, attention: str, max_rows: int, k: int, decode: bool, method: str,
               mhc_impl: str = "auto", attention_impl: str = "auto", batch_invariant: int = 0):
    """Traced step with speculative decoding (V4 MTP drafter, ``engine/speculative.py``).

    decode: rows ``[t, d1..dk]`` (drafts read from the slot's draft pool, ``ndraft [B]`` of them valid) are verified
    (``verify``), then the drafter sees the accepted positions and publishes the next drafts. The bucket's width
    Q ≤ 1 + k (confidence-scheduled verification, :mod:`~dinfer_jax.engine.spec_schedule`) caps the drafts a row
    verifies at Q − 1 (the host passes ``ndraft ≤ Q − 1``). Returns ``(tokens [max_rows, Q], num_accepted
    [max_rows], logprobs, cache, spec, confidences [max_rows, k])``.
    prefill: the ordinary sample of each row's last token, then the drafter runs over the chunk (next token of a
    position: the chunk's following token, ``next_tok`` after its end, or the sampled one) and rows that sample
    publish drafts. Returns ``(tokens [max_rows], zeros, logprobs, cache, spec, confidences [max_rows, k])``.
    ``confidences``: the drafter's confidence in each draft it published (zeros for rows that did not publish).
    ``token_masks [B, 1+k, ceil(V/32)]`` int32 (structured outputs): the target's logits at verified position j
    are masked before verification (a draft the grammar forbids is rejected); prefill rows use position 0.
    ``chain_row [B]`` (-1: none): a decode row scheduled behind the previous step's verify row ``chain_row`` starts
    ``shift = prev_nacc[chain_row]`` positions later than the host knew (the drafts that row accepted; its input
    token, read through ``feed``, is that row's last emitted one) and verifies ``min(ndraft, chain_room − shift)``
    drafts (``chain_room [B]``: its room for emitted tokens before the shift), as it would have once the host knew.
    """
    chained = chain_row >= 0
    shift = jnp.where(chained, prev_nacc[jnp.maximum(chain_row, 0)], 0)
    ndraft = jnp.minimum(ndraft, inp.tokens.shape[1] - 1)   # the host keeps it ≤ Q − 1 already
    ndraft = jnp.where(chained, jnp.clip(chain_room - shift, 0, ndraft), ndraft)
    n = jnp.where(chained & (inp.n > 0), 1 + ndraft, inp.n)
    inp = dataclasses.replace(inp, start=inp.start + shift, n=n, last=jnp.where(chained, jnp.maximum(n - 1, 0),
                                                                                   inp.last))
    first = jnp.where(feed.use_prev, prev_tokens[feed.prev_row], inp.tokens[:, 0])
    tokens = inp.tokens.at[:, 0].set(first)
    B, Q = tokens.shape
    if decode:
        drafts = spec.draft_tokens[inp.slot, : Q - 1]
        dlp = spec.draft_logprobs[inp.slot, : Q - 1]
        tokens = tokens.at[:, 1:].set(jnp.where(jnp.arange(Q - 1)[None, :] < ndraft[:, None], drafts, 0))
    inp = dataclasses.replace(inp, tokens=tokens)
    hist0 = cache.ngram_hist
    logits, cache, carry = model_step(params, cache, inp, cfg=cfg, dtype=dtype, moe_impl=moe_impl, attention=attention,
                                      engram_fn=engram_fn, engram=engram, return_carry=True, mhc_impl=mhc_impl,
                                      attention_impl=attention_impl, batch_invariant=batch_invariant)
    streams = carry["streams"]
    kw = dict(cfg=cfg, dtype=dtype, moe_impl=moe_impl, k=k)
    if decode:
        all_logits, _ = head_logits(params, {k_: v for k_, v in carry.items() if k_ in ("streams", "premix")}, cfg)
        finite = jnp.all(jnp.isfinite(all_logits), axis=-1)  # before the masks: masked entries are -inf
        V = all_logits.shape[-1]
        all_logits = apply_token_bitmask(all_logits.reshape(-1, V),
                                         token_masks[:, :Q].reshape(B * Q, -1)).reshape(B, Q, V)
        toks, nacc, logprobs = verify(all_logits, drafts, dlp, ndraft, inp.start, samp, samp.num_top_logprobs)
        toks = jnp.where(finite, toks, NONFINITE_TOKEN)
        if hist0 is not None:  # V4.1 Engram history: rewind to the committed tokens (rejected drafts leave no trace)
            committed = dataclasses.replace(inp, n=jnp.where(inp.n > 0, nacc + 1, 0))
            cache = dataclasses.replace(cache, ngram_hist=_engram_rows_device(hist0, committed, cfg, engram.cmap)[1])
        if method == "dspark":
            golden = jnp.take_along_axis(toks, nacc[:, None], axis=1)[:, 0]
            spec, conf = draft_dspark(params, spec, carry["dspark_features"], golden, inp, nacc + 1, inp.n > 0, samp,
                                      **kw)
        else:
            spec, conf = draft(params, spec, streams, toks, inp, nacc + 1, inp.n > 0, samp, **kw)
        conf = jnp.where((inp.n > 0)[:, None], conf, 0.0)
        return pad_rows(toks, max_rows), pad_rows(nacc, max_rows), logprobs, cache, spec, pad_rows(conf, max_rows)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    toks, logprobs = sample(apply_token_bitmask(logits, token_masks[:, 0]), samp)
    toks = jnp.where(finite, toks, NONFINITE_TOKEN)
    j = jnp.arange(Q)[None, :]
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    nxt = jnp.where(j == (inp.n - 1)[:, None], jnp.where(sample_mask, toks, next_tok)[:, None], nxt)
    if method == "dspark":
        golden = jnp.where(sample_mask, toks, next_tok)
        spec, conf = draft_dspark(params, spec, carry["dspark_features"], golden, inp, inp.n, sample_mask, samp, **kw)
    else:
        spec, conf = draft(params, spec, streams, nxt, inp, inp.n, sample_mask, samp, **kw)
    conf = jnp.where((sample_mask & (inp.n > 0))[:, None], conf, 0.0)
    return (pad_rows(toks, max_rows), jnp.zeros((max_rows,), jnp.int32), logprobs, cache, spec,
            pad_rows(conf, max_rows))


_STATIC = ("cfg", "dtype", "moe_impl", "engram_fn", "max_rows", "attention", "mhc_impl", "linear_impl",
           "attention_impl")
# Module-level jits with the engine's configuration as static arguments: engines over the same model and shapes
# share compiled steps within a process (what the on-disk compilation cache would otherwise provide).
# The plain engine runs a step as two programs: the model (one per bucket) and the sampler (one per batch size and
# host-decided variant: SamplingTensors.use_filters / all_greedy), so the sampler's variants cost small compiles
# and the model step holds no data-dependent conditional (docs/perf/serving_h200.md).
_FORWARD_STATIC = ("cfg", "dtype", "moe_impl", "engram_fn", "ep_manual", "cp_manual", "copies_manual", "attention",
                   "batch_invariant", "yoco_skip", "mhc_impl", "linear_impl", "attention_impl")
# the sampler variants every warm-up compiles, (use_filters, all_greedy): all rows greedy (argmax only), or some row
# draws (filters on, skipped on the device when no row filters: that variant syncs with the host for its draw anyway)
SAMPLER_VARIANTS = ((False, True), (True, False))


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The engine's jitted programs for one set of XLA compile options: ``forward`` (the model step, one program
    per bucket), ``sample`` (the sampler) and ``step_spec`` (model + verify + draft of a speculative step)."""

    forward: Any
    sample: Any
    step_spec: Any


# The sampler program's conditionals (the exact draw for rows the fast search cannot certify; the full vocabulary
# sorts when some row's top-p / top-k cut lies beyond the 1,024 candidates) are host syncs on a GPU unless XLA
# records them into a command buffer: a conditional outside one copies its predicate to the host and waits, which
# blocked the host once per sampled step (batch-64 decode of a V4-Flash slice: 11.6-12.4 ms sampled against ~6 ms
# greedy). Conditionals and loops become command-buffer kinds (the default kinds kept: per-program options take the
# enum names, not the flag's "+KIND" form), and the sorts use XLA's own sort kernels, since cub's radix sort cannot
# be recorded. Measured on an H100 (docs/perf/serving_h200.md, "sampled steps no longer block the host"): every sampler
# variant then returns to the host in 0.15-0.43 ms instead of 8.2-12.8 ms, same tokens.
GPU_SAMPLER_OPTIONS: CompilerOptions = (
    ("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"),
    ("xla_gpu_enable_cub_radix_sort", False),
)


def sampler_program_options(compiler_options: CompilerOptions, backend: str) -> CompilerOptions:
    """The sampler program's XLA options: ``compiler_options`` over :data:`GPU_SAMPLER_OPTIONS` on a GPU (a key the
    caller gives wins), ``compiler_options`` alone elsewhere."""
    if backend != "gpu":
        return compiler_options
    return compiler_options_key({**dict(GPU_SAMPLER_OPTIONS), **dict(compiler_options)})


@functools.cache
def step_programs(compiler_options: CompilerOptions = (), backend: str | None = None) -> StepPrograms:
    """The shared programs compiled with ``compiler_options`` (:func:`~dinfer_jax.engine.compile_pool.
    compiler_options_key`; ``()``: XLA's defaults), the sampler with :func:`sampler_program_options` for
    ``backend`` (None: the default backend). Engines with the same options share compiled steps."""
    opts = dict(compiler_options) or None
    sampler_opts = dict(sampler_program_options(compiler_options, backend or jax.default_backend())) or None
    return StepPrograms(
        forward=jax.jit(_device_forward, static_argnames=_FORWARD_STATIC, donate_argnums=(1,), compiler_options=opts),
        sample=jax.jit(_device_sample, static_argnames=("max_rows", "batch_invariant"),
                       compiler_options=sampler_opts),
        step_spec=jax.jit(_device_step_spec, static_argnames=_STATIC + ("k", "decode", "method", "batch_invariant"),
                          donate_argnums=(1, 2), compiler_options=opts))


class _CompileCounter:
    """Adds to ``runner.num_compilations`` the entries a call adds to a shared jit's cache (any retrace counts);
    without ``_cache_size`` (other jax versions) a shape new to this runner counts as one."""

    def __init__(self, runner: Any, fn: Any, key: tuple, seen: set | None = None) -> None:
        self.runner, self.size = runner, getattr(fn, "_cache_size", None)
        seen = runner.compiled_shapes if seen is None else seen
        self.new = key not in seen
        seen.add(key)

    def __enter__(self) -> None:
        self.before = self.size() if callable(self.size) else 0

    def __exit__(self, *exc: Any) -> None:
        grown = (self.size() - self.before) if callable(self.size) else int(self.new)
        self.runner.num_compilations += grown


def _program_name(shape: tuple[int, int, int], decode: bool, yoco_skip: bool) -> str:
    b, q, p = shape
    kind = "decode" if decode else "prefill"
    return f"{kind} [{b}, {q}] pages {p}" + (" yoco-skip" if yoco_skip else "")


def _sampler_name(b: int, use_filters: bool, all_greedy: bool) -> str:
    return f"sampler [{b}] " + ("greedy" if all_greedy else "filters" if use_filters else "draw")
