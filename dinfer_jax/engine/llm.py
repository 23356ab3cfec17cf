"""Offline batch inference: ``LLM(model=...).generate(prompts, sampling_params)``, named as in DeepInfer.

The host loop keeps one step in flight (``async_scheduling=True``, DeepInfer's zero-overhead scheduling,
``docs/spec/engine.md`` §4): it dispatches step N+1 — whose decode inputs come from step N's device outputs — before it
reads step N's tokens, so the device never waits for host bookkeeping. ``async_scheduling=False`` processes every
step before scheduling the next; both produce the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jax
import numpy as np

from dinfer_jax.engine.block_manager import BlockManager, StateSlots
from dinfer_jax.engine.compile_pool import compiler_options_key
from dinfer_jax.engine.dp_runner import DPModelRunner, DPStepOutput, engine_sharder, parallel_layout
from dinfer_jax.engine.kv_cache import CacheConfig, size_pools
from dinfer_jax.engine.launcher import Launched, StepLauncher, step_launcher
from dinfer_jax.engine.memory_plan import MemoryPlan, plan_memory
from dinfer_jax.engine.runner import Buckets, ModelRunner, StepOutput
from dinfer_jax.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from dinfer_jax.engine.spec_schedule import (
    RATE_HISTORY,
    StepClock,
    StepTimeCorrection,
    acceptance_rates,
    check_widths,
    choose_width,
    rates_before,
)
from dinfer_jax.engine.structured_rows import StructuredOutputs
from dinfer_jax.models import Model, load_config, load_model, random_model
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.engram_lookup import ENGRAM_PLACEMENTS
from dinfer_jax.models.invariant import CPU_INVARIANT_OPTIONS, DEFAULT_TILE
from dinfer_jax.models.linear_impl import resolve_linear_impl
from dinfer_jax.sampling import SamplingParams
from sharding.rules import Sharder

DEFAULT_KV_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass
class RequestOutput:
    """Result of one prompt, in prompt order."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None
    logprobs: list[dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class EngineMetrics:
    """Counters of an :class:`LLM` (see :meth:`LLM.metrics`)."""

    requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    output_tokens: int = 0  # sampled tokens, including each request's first (sampled by its last prefill chunk)
    prefill_steps: int = 0
    decode_steps: int = 0
    compilations: int = 0
    warmup_seconds: float = 0.0
    eplb_rebalances: int = 0
    generate_seconds: float = 0.0
    device_waited_for_host_seconds: float = 0.0
    host_waited_for_device_seconds: float = 0.0
    preemptions: int = 0
    spec_draft_tokens: int = 0  # drafts verified (sum of the verify rows' draft counts)
    spec_accepted_tokens: int = 0  # of those, accepted by the target
    spec_verify_steps: int = 0  # verify rows: (request, decode step) pairs that verified at least one draft
    # decode rows scheduled behind their request's verify row still in flight (asynchronous loop): the device
    # moved their start by the drafts that row accepted (ScheduledRow.chained)
    spec_chained_rows: int = 0
    # confidence-scheduled verification: decode steps per chosen width (query tokens per row)
    spec_step_widths: dict[int, int] = dataclasses.field(default_factory=dict)
    # host time of the generate loop by phase (the device runs meanwhile under async scheduling): choosing the
    # next step, building its inputs and launching it (of which the jitted call itself: the runner's
    # launch_seconds), and folding a finished step's tokens back into the requests
    host_schedule_seconds: float = 0.0
    host_dispatch_seconds: float = 0.0
    host_process_seconds: float = 0.0
    # the decode pace: time between the host getting the tokens of two decode steps in a row (no prefill step
    # between them), summed, and how many such pairs — in a steady decode phase their ratio is the period of a
    # decode step whatever bounds it (device or host), free of the prefill steps' time
    decode_paced_seconds: float = 0.0
    decode_paced_steps: int = 0


PACE_HISTORY = 4096  # decode-pace intervals an engine keeps (LLM.decode_pace_ms)


def _enable_compilation_cache() -> None:
    """JAX's persistent compilation cache (``$DINFER_JAX_COMPILATION_CACHE`` or ``~/.cache/dinfer_jax/xla``)."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get("DINFER_JAX_COMPILATION_CACHE", str(Path.home() / ".cache" / "dinfer_jax" / "xla"))
    if path.lower() in ("", "0", "off", "none"):
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _draft_pool_bytes(cfg: Any, method: str | None, k: int, max_num_seqs: int, block_size: int, dtype: str) -> int:
    """Device bytes of the speculative drafter's per-slot state (draft tokens, their log-prob rows, the drafter's
    own rings; ``engine/speculative.py``), which the KV budget must also hold. 0 without speculation."""
    if not method:
        return 0
    from dinfer_jax.engine.speculative import init_spec_state

    cc = CacheConfig(num_slots=max_num_seqs + 1, num_blocks=1, block_size=block_size, backtrack=k + 1)
    shapes = jax.eval_shape(lambda: init_spec_state(cfg, cc, k, dtype, method))
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(shapes))


def _largest_steps(buckets: Buckets) -> list[tuple[int, int, int]]:
    """The step shapes whose activations bound the engine's: the largest prefill and decode buckets at the most
    pages."""
    p = max(buckets.pages)
    return [(max(buckets.prefill_batch), max(buckets.prefill_len), p),
            (max(buckets.decode_batch), buckets.decode_len, p)]


def _resolve_model(model: str | Path | Model, dtype: str, seed: int, progress: bool,
                   stacked: bool = False, sharder: Sharder | None = None) -> tuple[Model, Path | None]:
    """The engine's Model: as given, loaded from a checkpoint, or random for a preset name; ``stacked``: built in
    the one-device runner's scan layout (no checkpoint-layout copy beside it at any time). ``sharder`` (the mesh
    engines', :func:`~dinfer_jax.engine.dp_runner.engine_sharder`): a checkpoint is loaded in scan layout straight
    onto that mesh, each weight placed shard by shard as it is read (the Model keeps no sharder: the engines run
    their own per-device step; its MoE switch stays what a plain load gives)."""
    if isinstance(model, Model):
        return model, None
    from dinfer_jax.checkpoints import resolve_checkpoint

    path = resolve_checkpoint(str(model))
    if path is not None and sharder is not None:
        loaded = load_model(path, dtype=dtype, progress=progress, stacked=True, sharder=sharder, moe_impl="auto")
        return dataclasses.replace(loaded, sharder=None), path
    if path is not None:
        return load_model(path, dtype=dtype, progress=progress, stacked=stacked), path
    cfg = load_config(model)  # a preset: random weights (benchmarks, smoke tests)
    return random_model(cfg, seed=seed, dtype=dtype, include_mtp=False, stacked=stacked), None


def _with_kv_cache_dtype(model: Model, kv_cache_dtype: str) -> Model:
    """``model`` with ``kv_fake_quant`` set for ``kv_cache_dtype="fp8"`` (ValueError naming the rule when its head
    sizes have no such byte form or the option is unknown)."""
    from dinfer_jax.engine.kv_cache import KV_CACHE_DTYPES
    from dinfer_jax.engine.kv_formats import layout

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    cfg = model.config
    if kv_cache_dtype == "auto" or cfg.kv_fake_quant:
        return model
    if not cfg.is_v41:
        layout("model1", cfg.head_dim, rope_dim=cfg.rope_head_dim)
        layout("fp4_index", cfg.index_head_dim)
        di = cfg.index_head_dim
        if di & (di - 1):
            raise ValueError(f"kv_cache_dtype='fp8' rotates index keys with a Hadamard matrix: index_head_dim {di} "
                             "must be a power of two")
    return dataclasses.replace(model, config=dataclasses.replace(cfg, kv_fake_quant=True))


def check_mhc_impl(impl: str) -> None:
    """ValueError unless the model's ``mhc_impl`` can run here (the Mosaic GPU kernel needs a GPU)."""
    from dinfer_jax.models.mhc import resolve_mhc_impl

    if resolve_mhc_impl(impl) == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"mhc_impl='pallas' (the Mosaic GPU Sinkhorn kernel) needs a GPU; the backend is "
                         f"{jax.default_backend()!r}")


def check_attention_impl(impl: str) -> None:
    """ValueError unless the model's ``attention_impl`` names an implementation that can run here (``"pallas"``:
    the Mosaic GPU attention kernels need a GPU)."""
    from dinfer_jax.models.attention import ATTENTION_IMPLS

    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl in ("pallas", "pallas_gather") and jax.default_backend() != "gpu":
        raise ValueError(f"attention_impl={impl!r} (the Mosaic GPU attention kernels) needs a GPU; the backend is "
                         f"{jax.default_backend()!r}")


# XLA options of the one-device GPU engine's programs when the FP8 linear kernel serves decode steps (the experts,
# FP8 linears and Sinkhorn run in our kernels; the fp32 projections are split-K and the mHC mixes elementwise): no
# Triton GEMM fusions, so the GEMMs left to XLA are cuBLAS calls, which need no kernel search; decode programs
# skip GEMM autotuning altogether. V4-Flash 4-layer slice on the H200: cold warm-up 118 -> 58-63 s (two runs) at
# the autotuned speed, decode 6.07-6.10 ms and prefill 69-70K tok/s (docs/perf/serving_h200.md, 2026-12-04 sixth
# session).
GPU_PROGRAM_OPTIONS: Mapping[str, str | int | float | bool] = MappingProxyType({"xla_gpu_enable_triton_gemm": False})
GPU_DECODE_OPTIONS: Mapping[str, str | int | float | bool] = MappingProxyType({"xla_gpu_autotune_level": 0})


def program_options(given: Mapping[str, str | int | float | bool] | None,
                    linear_impl: str) -> dict[str, str | int | float | bool]:
    """Every program's XLA options (``LLM(compiler_options=...)``): ``given``, or by default
    :data:`GPU_PROGRAM_OPTIONS` when the FP8 linear kernel (``linear_impl``, resolved) serves the decode steps,
    else XLA's own."""
    if given is not None:
        return dict(given)
    return dict(GPU_PROGRAM_OPTIONS) if linear_impl == "pallas" else {}


def decode_program_options(given: Mapping[str, str | int | float | bool] | None,
                           linear_impl: str) -> dict[str, str | int | float | bool]:
    """The decode programs' extra XLA options (``LLM(decode_compiler_options=...)``): ``given``, or by default
    :data:`GPU_DECODE_OPTIONS` when the FP8 linear kernel (``linear_impl``, resolved) serves the decode steps."""
    if given is not None:
        return dict(given)
    return dict(GPU_DECODE_OPTIONS) if linear_impl == "pallas" else {}


def step_program_options(given: Mapping[str, str | int | float | bool] | None,
                         given_decode: Mapping[str, str | int | float | bool] | None,
                         linear_impl: str) -> tuple[dict[str, str | int | float | bool],
                                                    dict[str, str | int | float | bool]]:
    """``(every program's XLA options, the decode programs' XLA options)`` for ``LLM(compiler_options=given,
    decode_compiler_options=given_decode)``: :func:`program_options`, and for decode those plus
    :func:`decode_program_options`."""
    options = program_options(given, linear_impl)
    return options, {**options, **decode_program_options(given_decode, linear_impl)}


def default_block_size(cfg: ModelConfig) -> int:
    """KV page size in tokens when ``LLM(block_size=None)``: the smallest multiple of every compression ratio of
    the model's layers that holds at least 16 tokens."""
    lcm = int(np.lcm.reduce([r for r in cfg.compress_ratios if r] or [1]))
    return lcm * max(1, -(-16 // lcm))


def check_linear_impl(impl: str, batch_invariant: bool) -> None:
    """ValueError unless the model's ``linear_impl`` can run here: the Mosaic GPU kernel needs a GPU, and the
    batch-invariant mode keeps XLA's tiled products."""
    from dinfer_jax.models.linear_impl import check_linear_impl as check_name

    if check_name(impl) == "pallas":   # "auto" resolves to what can run (resolve_linear_impl)
        if jax.default_backend() != "gpu":
            raise ValueError(f"linear_impl='pallas' (the Mosaic GPU FP8 linear kernel) needs a GPU; the backend is "
                             f"{jax.default_backend()!r}")
        if batch_invariant:
            raise ValueError("linear_impl='pallas' does not run in batch-invariant mode (its products are tiled by "
                             "XLA in fixed row tiles); use linear_impl='xla'")


def _check_speculative(model: Model, speculative: str | None, k: int) -> str | None:
    """Validate ``LLM(speculative=..., num_speculative_tokens=...)``; returns the method (None: off)."""
    if speculative is None:
        return None
    if speculative not in ("mtp", "dspark"):
        raise ValueError(f"speculative must be None, 'mtp' or 'dspark', got {speculative!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
    cfg = model.config
    if speculative == "dspark":
        if not cfg.is_v41 or not cfg.dspark_block_size:
            raise ValueError("speculative='dspark' needs a V4.1 model with a DSpark drafter; V4 models use 'mtp'")
        if k > cfg.dspark_block_size:
            raise ValueError(f"num_speculative_tokens={k} exceeds the DSpark block size {cfg.dspark_block_size}")
    elif cfg.is_v41:
        raise ValueError("speculative='mtp' is V4's MTP block; V4.1 models draft with 'dspark'")
    if not model.params.get("mtp"):
        raise ValueError(f"speculative={speculative!r} needs the model's MTP parameters (load or build it with "
                         "include_mtp)")
    return speculative


def _check_yoco(cfg: Any, yoco: str, keep: Any, num_speculative_tokens: int, one_device: bool,
                chunked_prefill: bool = True) -> int | None:
    """The engine's YOCO keep (None when ``yoco="off"``); ValueError for an unknown mode, a DP layout, a V4 model, a
    keep that does not cover the sliding window plus the speculative backtracking (``docs/spec/engine.md`` §12.2's
    invariant), and for ``"compact"`` speculative decoding or unchunked prefill."""
    if yoco not in ("off", "mask", "compact"):
        raise ValueError(f"yoco must be 'off', 'mask' or 'compact', got {yoco!r}")
    if yoco == "off":
        return None
    if not one_device:
        raise ValueError(f"yoco={yoco!r} runs on the one-device engine only (dp_size = cp_size = ep_size = 1)")
    if not cfg.is_v41:
        raise ValueError(f"yoco={yoco!r} is V4.1's prefill truncation; V4 models have no YOCO layers")
    if yoco == "compact" and num_speculative_tokens:
        raise ValueError("yoco='compact' is not combined with speculative decoding (the drafter reads the YOCO "
                         "layers' hidden states of every prompt row); use yoco='mask'")
    if yoco == "compact" and not chunked_prefill:
        raise ValueError("yoco='compact' needs enable_chunked_prefill=True (a prompt's kept suffix is its own chunk)")
    backtrack = num_speculative_tokens + 1 if num_speculative_tokens else 0
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < cfg.sliding_window + backtrack:
        raise ValueError(f"yoco_keep={keep!r} must be an int covering the sliding window ({cfg.sliding_window}) plus "
                         f"the speculative backtracking ({backtrack})")
    return int(keep)


def _check_engram_tables(engram_tables: Any, one_device: bool) -> None:
    """ValueError unless ``LLM(engram_tables=...)`` names a placement that runs here: host placements on the
    one-device engine, ``"host-direct"`` (a Mosaic GPU kernel reads the host rows) on a GPU."""
    if engram_tables not in ENGRAM_PLACEMENTS:
        raise ValueError(f"engram_tables must be one of {ENGRAM_PLACEMENTS}, got {engram_tables!r}")
    if engram_tables != "device" and not one_device:
        raise ValueError(f"engram_tables={engram_tables!r} runs on the one-device engine only; the DP engines keep "
                         "the tables in every device's memory ('device')")
    if engram_tables == "host-direct" and jax.default_backend() != "gpu":
        raise ValueError(f"engram_tables='host-direct' (a Mosaic GPU kernel reads the rows from pinned host memory) "
                         f"needs a GPU; the backend is {jax.default_backend()!r}; use 'host' or 'device'")


def _check_launch_thread(launch_thread: Any, engram_tables: str, one_device: bool) -> bool:
    """``LLM(launch_thread=...)`` resolved: None → on iff the Engram tables are in host memory."""
    if launch_thread is None:
        return engram_tables == "host"
    if not isinstance(launch_thread, bool):
        raise ValueError(f"launch_thread must be True, False or None, got {launch_thread!r}")
    if launch_thread and not one_device:
        raise ValueError("launch_thread=True runs on the one-device engine only (dp_size = cp_size = ep_size = 1)")
    return launch_thread


def _check_batch_invariant(batch_invariant: Any, one_device: bool) -> int:
    """The engine's batch-invariant tile (0: off); ValueError for a non-bool or a DP layout."""
    if not isinstance(batch_invariant, (bool, np.bool_)):
        raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    if not batch_invariant:
        return 0
    if not one_device:
        raise ValueError("batch_invariant=True runs on the one-device engine only (dp_size = cp_size = ep_size = 1)")
    return DEFAULT_TILE


class LLM:
    """An offline engine over one model.

    Args:
        model: checkpoint directory, ``"default"`` (the bundled model), a preset name (random weights) or a
            :class:`~dinfer_jax.models.Model`.
        dtype: ``"bfloat16"`` or ``"float32"``.
        max_num_seqs: running sequences (decode batch); max_model_len: prompt + generated tokens per sequence
            (default: min(config, 4096)); max_num_batched_tokens: tokens per prefill step.
        kv_cache_memory_bytes: device memory for the paged cache and state slots (pools are sized from it).
            Default (None): planned from the device (:mod:`~dinfer_jax.engine.memory_plan`): ``memory_utilization``
            of the memory the device offers (or of ``device_memory_bytes``), less the weights and the measured
            activation peak of the largest prefill and decode steps; on a backend that reports no memory (XLA:CPU)
            and without ``device_memory_bytes``, 256 MiB. ``memory_plan`` and ``kv_capacity_tokens`` say what was
            chosen. Mesh engines (``dp_size`` / ``cp_size`` / ``ep_size``) plan per device, each engine's pool
            whole on each of its devices (:meth:`~dinfer_jax.engine.dp_runner.DPModelRunner.plan_memory`).
        memory_utilization: fraction of the device's memory the engine may use in all (vLLM's
            ``gpu_memory_utilization``); device_memory_bytes: the memory to plan against instead of the device's
            own figure (e.g. to share an accelerator).
        block_size: tokens per KV page (default: the smallest multiple of every compression ratio ≥ 16).
        async_scheduling: keep one step in flight (default, zero overhead); False = synchronous.
        enable_chunked_prefill / preemption_mode: scheduler policies (``"stop"`` or ``"recompute"``).
        warmup: compile every shape bucket at start, so serving triggers no compilation.
        compile_threads: threads compiling the buckets at warm-up (default: the host's cores, or
            ``DINFER_JAX_COMPILE_THREADS``; 1 = one after another; always 1 across several processes).
        buckets: compiled shapes (:class:`~dinfer_jax.engine.buckets.Buckets`); default from ``max_num_seqs``,
            ``max_num_batched_tokens`` and, for page tables, ``max_model_len`` (a few geometric page counts, so a
            step's cost follows its batch's context, not ``max_model_len``).
        progress: progress bars for checkpoint loading and bucket warm-up (``False`` silences them; see
            :mod:`dinfer_jax.progress`). ``generate``'s own bar is ``use_tqdm``.
        dp_size / cp_size / ep_size: attention-DP engines, CP ranks per engine, EP group size
            (``docs/dp_engines.md``). Each engine has its own scheduler and KV pool (sized as above, per engine);
            prompts go to the engines round-robin; all engines step together on one mesh. ``(1, 1, 1)`` (default)
            is the one-device engine. Invalid layouts raise ValueError (:func:`~dinfer_jax.engine.dp_runner.
            parallel_layout`).
        num_redundant_experts: EPLB (``ep_size > 1``): redundant expert slots per MoE layer; ``E + R`` must split
            evenly over the EP group. Experts start in DeepInfer's start-up placement; :meth:`rebalance_experts`
            moves them from measured loads without changing any output (``docs/expert_parallel.md``).
        eplb_interval: with ``num_redundant_experts``, rebalance automatically every this many mesh steps from the
            tokens each expert received since the last rebalance (DeepInfer's periodic EPLB); None: only on request.
        speculative: ``None`` (off), ``"mtp"`` (V4's MTP block drafts) or ``"dspark"`` (V4.1's DSpark drafter);
            the target verifies the drafts in its next decode step (``docs/speculative_decoding.md``).
            Under ``async_scheduling`` a sequence's next row is chained behind its verify row in flight (the
            device moves its start by the drafts that row accepts).
        num_speculative_tokens: drafts the drafter publishes per sequence and step (k).
        speculative_widths: confidence-scheduled verification (:mod:`~dinfer_jax.engine.spec_schedule`): the decode
            widths (query tokens per row, ``1 + drafts verified``) compiled, ``"all"`` for ``1 … 1 + k`` or
            ints in ``[1, 1 + k]`` including ``1 + k``; each decode step takes the width that maximises the tokens
            expected from the drafts' confidences per millisecond of its bucket's step time (measured at
            warm-up). ``None`` (default): one width, every row verifies all its drafts. Each width is one more
            program per decode bucket; seeded sampled output then depends on the batch (greedy output does not).
        speculative_time_correction: with ``speculative_widths``, correct the measured step times online as
            DeepInfer does (:class:`~dinfer_jax.engine.spec_schedule.StepTimeCorrection`: a per-token slope from
            the decode steps the host loop times). Off by default: the widths then follow wall-clock timings, so
            seeded sampled output is no longer reproducible run to run (greedy output still is).
        attention: how a query reads the compressed rows of CSA / V4.1 compressed layers: ``"auto"`` (default)
            gathers each query's top-k rows when that reads fewer rows than masking all of the step's pages (decode
            at long context), ``"sparse"`` always gathers, ``"dense"`` always masks; the same attention either way
            (``docs/architecture.md``). The DP engines use ``"auto"``.
        kv_cache_dtype: ``"auto"`` (default: the model's own numerics — V4 exact, V4.1 its FP8/FP4 caches) or
            ``"fp8"``: quantised caches with the reference's numerics (``cfg.kv_fake_quant``), for V4 FlashMLA's
            ``model1`` rows (FP8 non-RoPE dims, bf16 RoPE dims; 584 B a row in the release instead of 1024) and
            Hadamard-rotated FP4 index keys (68 B instead of 512). This changes V4's values, in the full forward
            as in serving (measured: ``docs/kv_formats.md``).
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer`` to use instead of the checkpoint's (text
            prompts, output text, and the vocabulary of structured-output grammars); default: the checkpoint's.
        structured_timeout_s: limit on compiling one request's structured-output grammar (``so_args``); a request
            whose grammar is not ready by then ends with ``finish_reason="error"`` (``docs/structured_outputs.md``).
        engram_tables: V4.1 Engram tables for the compiled steps: ``"device"`` (default; copied once into device
            memory), ``"host"`` (pinned host memory, gathered on the host inside the step; one-device engine) or
            ``"host-direct"`` (pinned host memory, read over PCIe by a Mosaic GPU kernel inside the step; GPU,
            one-device engine). Every way the n-gram hash and the gather run inside the step, with no host
            callback (``docs/engram.md``).
        launch_thread: launch the steps from a second host thread (:mod:`~dinfer_jax.engine.launcher`), so that
            the loop prepares the next step while a launch blocks. Default (None): on when ``engram_tables="host"``,
            whose step holds a host computation and returns only once it has run; one-device engine only.
        compiler_options: XLA compile options for the engine's programs (``DebugOptions`` fields by name, as
            ``XLA_FLAGS`` takes them without the dashes); checked at start (ValueError naming an option XLA
            rejects). Default (None): :data:`GPU_PROGRAM_OPTIONS` (Triton's GEMM fusions off, so XLA's remaining
            GEMMs are cuBLAS calls) when the FP8 linear kernel serves decode (a GPU, the one-device engine,
            ``Model.linear_impl`` "auto" or "pallas"), else XLA's own; ``{}``: XLA's own. GEMM autotuning of
            Triton fusions was most of a real-dimension GPU warm-up (``docs/perf/serving_h200.md``).
        decode_compiler_options: options added to ``compiler_options`` for the decode steps' programs only.
            Default (None): :data:`GPU_DECODE_OPTIONS` (GEMM autotuning off) under the same condition, else none;
            ``{}``: the decode steps use ``compiler_options`` alone. With both defaults a V4-Flash 4-layer slice
            warms up in 58–63 s instead of 118 s on the H200 at equal decode and prefill speed.
        yoco / yoco_keep: V4.1 SWA bounded replay (DeepInfer's YOCO prefill truncation, ``docs/yoco.md``):
            ``"off"`` (default, exact), ``"mask"``: from the first YOCO layer on, the window keys a prefill sees
            are cut to the last ``yoco_keep`` tokens of the sequence's prefill (chunked or not), so a request's
            first token is the full forward's ``yoco="compact"`` one on its prompt (decode then runs as usual); or
            ``"compact"``: the same values, with the YOCO layers run on the kept rows only (a prompt's kept suffix
            is its own prefill chunk; before it those layers only write their KV sources' compressed rows): the
            prefill speed-up. ``yoco_keep`` must cover the window plus the speculative backtracking; one-device
            engine only; ``"compact"`` without speculative decoding.
        batch_invariant: ``True``: a request's logits (hence logprobs and seeded samples) are bitwise the same
            whatever else is in its batch, its row in it and how its prompt is chunked (DeepInfer's batch-invariant
            inference; ``docs/batch_invariance.md``): every product runs at fixed shapes (tiles of 16 token rows,
            experts densely per tile, attention per query over fixed key blocks). It costs throughput (measured
            there); one-device engine. With speculative decoding the whole speculative step is traced invariantly
            (greedy output = the invariant non-speculative engine's, token for token). Its values are the default
            path's up to fp32 rounding, not bit for bit.
    """

    def __init__(self, model: str | Path | Model, dtype: str = "float32", max_num_seqs: int = 8,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 256,
                 kv_cache_memory_bytes: int | None = None, block_size: int | None = None,
                 async_scheduling: bool = True, enable_chunked_prefill: bool = True, preemption_mode: str = "stop",
                 max_logprobs: int = 5, warmup: bool = True, seed: int = 0, buckets: Buckets | None = None,
                 num_kv_blocks: int | None = None, progress: bool = True, dp_size: int = 1, cp_size: int = 1,
                 ep_size: int = 1, speculative: str | None = None,
                 num_speculative_tokens: int = 5, memory_utilization: float = 0.9,
                 device_memory_bytes: int | None = None, attention: str = "auto", kv_cache_dtype: str = "auto",
                 compile_threads: int | None = None, num_redundant_experts: int | None = None,
                 eplb_interval: int | None = None, tokenizer: str | Path | Any | None = None,
                 structured_timeout_s: float = 20.0, engram_tables: str = "device",
                 compiler_options: Mapping[str, str | int | float | bool] | None = None, yoco: str = "off",
                 yoco_keep: int = 140, batch_invariant: bool = False, launch_thread: bool | None = None,
                 decode_compiler_options: Mapping[str, str | int | float | bool] | None = None,
                 speculative_widths: Sequence[int] | str | None = None, speculative_time_correction: bool = False):
        _enable_compilation_cache()
        compiler_options_key(compiler_options)   # a malformed mapping fails here, before anything is built
        if attention not in ("auto", "sparse", "dense"):
            raise ValueError(f"attention must be 'auto', 'sparse' or 'dense', got {attention!r}")
        # settings checked before anything is built or any device is asked for
        one_device = (dp_size, cp_size, ep_size) == (1, 1, 1)
        _check_engram_tables(engram_tables, one_device)
        self.launch_thread = _check_launch_thread(launch_thread, engram_tables, one_device)
        self.batch_invariant_tile = _check_batch_invariant(batch_invariant, one_device)
        self.parallel = parallel_layout(dp_size, cp_size, ep_size)
        self.dp_size = dp_size
        self.model, self.path = _resolve_model(model, dtype, seed, progress, stacked=one_device,
                                               sharder=None if one_device else engine_sharder(self.parallel))
        built_here = not isinstance(model, Model)
        self.model = _with_kv_cache_dtype(self.model, kv_cache_dtype)
        cfg = self.model.config
        self.config = cfg
        self.speculative = _check_speculative(self.model, speculative, num_speculative_tokens)
        check_mhc_impl(self.model.mhc_impl)
        check_linear_impl(self.model.linear_impl, bool(batch_invariant))
        self.model = dataclasses.replace(self.model, linear_impl=resolve_linear_impl(
            self.model.linear_impl, bool(batch_invariant), one_device))
        options, decode_options = map(compiler_options_key, step_program_options(
            compiler_options, decode_compiler_options, self.model.linear_impl))
        check_attention_impl(self.model.attention_impl)
        if num_redundant_experts is not None and ep_size < 2:
            raise ValueError(f"num_redundant_experts (EPLB) needs expert parallelism: ep_size > 1, got {ep_size}")
        if eplb_interval is not None and (num_redundant_experts is None or int(eplb_interval) < 1):
            raise ValueError(f"eplb_interval={eplb_interval!r} needs num_redundant_experts and must be >= 1")
        self.eplb_interval = int(eplb_interval) if eplb_interval is not None else 0
        self._mesh_steps = 0
        if self.speculative and (dp_size, cp_size, ep_size) != (1, 1, 1):
            raise ValueError("speculative decoding runs on the one-device engine only (dp_size = cp_size = "
                             f"ep_size = 1), got dp_size={dp_size}, cp_size={cp_size}, ep_size={ep_size}")
        k = int(num_speculative_tokens) if speculative else 0
        self.num_speculative_tokens = k
        if speculative_widths is not None and not k:
            raise ValueError("speculative_widths needs speculative decoding (speculative='mtp' or 'dspark')")
        widths = check_widths(speculative_widths, k)
        self.confidence_scheduling = widths is not None and len(widths) > 1
        # the online slope of the step-time curve, fed by every decode step the host loop can time (engine life)
        self._step_time_fix = self._time_correction(speculative_time_correction)
        self._clock = StepClock()
        self._last_decode_done: float | None = None   # when the newest processed step's tokens came, if a decode step
        # the newest paced intervals (seconds), for their distribution: a mean hides rare long steps
        self._paced_intervals: collections.deque[float] = collections.deque(maxlen=PACE_HISTORY)
        self.yoco_keep = _check_yoco(cfg, yoco, yoco_keep, k, one_device,
                                     enable_chunked_prefill)
        self.yoco = yoco
        if self.batch_invariant_tile and jax.default_backend() == "cpu":
            options = compiler_options_key({**dict(options), **CPU_INVARIANT_OPTIONS})
            decode_options = compiler_options_key({**dict(decode_options), **CPU_INVARIANT_OPTIONS})
        self.max_model_len = int(max_model_len or min(cfg.max_position_embeddings, 4096))
        self.block_size = int(block_size or default_block_size(cfg))
        buckets = buckets or Buckets.default(max_num_seqs, max_num_batched_tokens)
        buckets = dataclasses.replace(buckets, decode_len=1 + k, decode_widths=widths)
        self.buckets = buckets.resolve(-(-self.max_model_len // self.block_size), self.block_size)
        if max(self.buckets.decode_batch) < max_num_seqs or max(self.buckets.prefill_len) < max_num_batched_tokens:
            raise ValueError(f"buckets {self.buckets} must cover max_num_seqs={max_num_seqs} decode rows and "
                             f"max_num_batched_tokens={max_num_batched_tokens} prefill tokens")
        self.memory_plan: MemoryPlan | None = None
        # the mesh engines plan their pools once their weights are on the mesh: they start with a minimal pool,
        # measure the mesh step against it, then get the planned one (DPModelRunner.plan_memory)
        plan_on_mesh = not one_device and num_kv_blocks is None and kv_cache_memory_bytes is None
        if num_kv_blocks is not None:
            cache_cfg = CacheConfig(num_slots=max_num_seqs + 1, num_blocks=num_kv_blocks + 1,
                                    block_size=self.block_size)
        elif plan_on_mesh:
            cache_cfg = CacheConfig(num_slots=max_num_seqs + 1, num_blocks=max(self.buckets.pages) + 1,
                                    block_size=self.block_size)
        else:
            if kv_cache_memory_bytes is None and one_device:
                self.memory_plan = plan_memory(
                    self.model, _largest_steps(self.buckets), block_size=self.block_size,
                    max_rows=max(max(self.buckets.decode_batch), max(self.buckets.prefill_batch)),
                    max_logprobs=max_logprobs, utilization=memory_utilization,
                    device_memory_bytes=device_memory_bytes, engram_tables=engram_tables, compiler_options=options)
            budget = (kv_cache_memory_bytes if kv_cache_memory_bytes is not None
                      else self.memory_plan.kv_bytes if self.memory_plan is not None else DEFAULT_KV_BYTES)
            budget -= _draft_pool_bytes(cfg, self.speculative, k, max_num_seqs, self.block_size, self.model.dtype)
            cache_cfg = size_pools(cfg, memory_bytes=budget, block_size=self.block_size,
                                   max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, dtype=self.model.dtype,
                                   backtrack=k + 1 if k else 0)
        if k:  # rings keep k + 1 extra entries: speculative writes never evict committed state (docs/spec/engine.md §5)
            cache_cfg = dataclasses.replace(cache_cfg, backtrack=k + 1)
        cache_cfg.validate(cfg)
        self.sched_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                            max_model_len=self.max_model_len, block_size=self.block_size,
                                            enable_chunked_prefill=enable_chunked_prefill,
                                            preemption_mode=preemption_mode,
                                            max_prefill_seqs=max(self.buckets.prefill_batch),
                                            cp_align=2 * cp_size if cp_size > 1 else 1,
                                            num_speculative_tokens=k,
                                            yoco_split_keep=self.yoco_keep if yoco == "compact" else 0)
        self.cache_config = cache_cfg
        self.async_scheduling = async_scheduling
        if (dp_size, cp_size, ep_size) == (1, 1, 1):
            self.runner: ModelRunner | DPModelRunner = ModelRunner(self.model, cache_cfg, self.max_model_len,
                                                                   self.buckets, max_logprobs=max_logprobs,
                                                                   speculative=self.speculative,
                                                                   num_speculative_tokens=k, attention=attention,
                                                                   engram_tables=engram_tables,
                                                                   compiler_options=options,
                                                                   decode_compiler_options=decode_options,
                                                                   yoco_keep=self.yoco_keep,
                                                                   batch_invariant=self.batch_invariant_tile,
                                                                   yoco_compact=yoco == "compact")
            self.model = self.runner.model   # the scan-layout weights: no second copy held by the engine
        else:
            self.runner = DPModelRunner(self.model, cache_cfg, self.max_model_len, self.buckets, self.parallel,
                                        max_logprobs=max_logprobs, num_redundant_experts=num_redundant_experts,
                                        compiler_options=options, donate_params=built_here)
            if built_here:
                self.model = self.runner.model   # the mesh's weights (experts placed): no second copy held
            if plan_on_mesh:
                self.memory_plan = self.runner.plan_memory(_largest_steps(self.buckets), memory_utilization,
                                                           device_memory_bytes)
                budget = self.memory_plan.kv_bytes if self.memory_plan is not None else DEFAULT_KV_BYTES
                self.cache_config = size_pools(cfg, memory_bytes=budget, block_size=self.block_size,
                                               max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                               dtype=self.model.dtype)
                self.cache_config.validate(cfg)
                self.runner.resize_cache(self.cache_config)
        self.max_logprobs = max_logprobs
        self.tokenizer = self._load_tokenizer(tokenizer)
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, (list, tuple)) else [cfg.eos_token_id]
        self._structured = StructuredOutputs(self.tokenizer.to_str() if self.tokenizer is not None else None,
                                             cfg.vocab_size, [int(t) for t in eos if t is not None],
                                             timeout_s=structured_timeout_s)
        self._metrics = EngineMetrics()
        self._seed_rng = np.random.default_rng(seed)
        self._next_id = 0
        if warmup:
            self._metrics.warmup_seconds = self.runner.warmup(progress=progress, compile_threads=compile_threads)

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings use the checkpoint's ``tokenizer.json``; lists are token ids).

        Returns one :class:`RequestOutput` per prompt, in order. A bad prompt ends with ``finish_reason="error"``
        and a message; the others are unaffected.
        """
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        t0 = time.perf_counter()
        scheds = [Scheduler(self.sched_config, BlockManager(self.cache_config.num_blocks, self.block_size),
                            StateSlots(self.cache_config.num_slots), vocab_size=self.config.vocab_size,
                            draft_width=self._draft_width if self.confidence_scheduling else None)
                  for _ in range(self.dp_size)]
        records: list[dict[str, Any]] = []
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=False)):
            records.append(self._add(scheds[i % self.dp_size], prompt, sp))  # round-robin over the engines
        if isinstance(self.runner, DPModelRunner):
            self._run_dp(scheds, records, use_tqdm)
        else:
            self._run(scheds[0], records, use_tqdm)
        self._metrics.generate_seconds += time.perf_counter() - t0
        self._metrics.compilations = self.runner.num_compilations
        return [self._output(r) for r in records]

    def configure(self, *, async_scheduling: bool | None = None, max_num_batched_tokens: int | None = None,
                  enable_chunked_prefill: bool | None = None, preemption_mode: str | None = None,
                  eplb_interval: int | None = None, structured_timeout_s: float | None = None,
                  launch_thread: bool | None = None, speculative_time_correction: bool | None = None) -> None:
        """Change host-side scheduling switches between ``generate`` calls (no recompilation). Chunks must still
        fit the compiled prefill buckets. ``eplb_interval`` (EPLB engines): mesh steps between automatic
        rebalances, 0 = only on request. ``structured_timeout_s``: grammar compilation limit for later requests.
        ``launch_thread``: launch steps from a second host thread (as the constructor's; None leaves it).
        ``speculative_time_correction``: as the constructor's; switching it on starts a new correction (no
        samples), off drops it."""
        if speculative_time_correction is not None:
            self._step_time_fix = self._time_correction(speculative_time_correction)
        if launch_thread is not None:
            self.launch_thread = _check_launch_thread(launch_thread, "device", isinstance(self.runner, ModelRunner))
        if structured_timeout_s is not None:
            self._structured.timeout_s = structured_timeout_s
        if async_scheduling is not None:
            self.async_scheduling = bool(async_scheduling)
        if eplb_interval is not None:
            if int(eplb_interval) < 0 or not isinstance(self.runner, DPModelRunner) or self.runner.placements is None:
                raise ValueError(f"eplb_interval={eplb_interval!r} needs an EPLB engine and must be >= 0")
            self.eplb_interval = int(eplb_interval)
        changes = {k: v for k, v in (("max_num_batched_tokens", max_num_batched_tokens),
                                     ("enable_chunked_prefill", enable_chunked_prefill),
                                     ("preemption_mode", preemption_mode)) if v is not None}
        if "max_num_batched_tokens" in changes and changes["max_num_batched_tokens"] > max(self.buckets.prefill_len):
            raise ValueError(f"max_num_batched_tokens {changes['max_num_batched_tokens']} exceeds the largest compiled "
                             f"prefill bucket {max(self.buckets.prefill_len)}")
        if changes.get("enable_chunked_prefill") is False and self.yoco == "compact":
            raise ValueError("yoco='compact' needs enable_chunked_prefill=True (a prompt's kept suffix is its own "
                             "chunk)")
        if changes:
            self.sched_config = dataclasses.replace(self.sched_config, **changes)

    def rebalance_experts(self, tokens_per_expert: Any = None) -> list[Any]:
        """EPLB: re-place every MoE layer's experts over the EP group from ``tokens_per_expert`` (``[layers, E]``
        token counts, or ``[steps, layers, E]``; default: the tokens the engine measured since it started or last
        rebalanced, :meth:`expert_loads`), DeepInfer's rebalance rule (:func:`~dinfer_jax.models.eplb.rebalance`).
        Outputs are unchanged and nothing recompiles. Returns the per-layer placements. Needs
        ``num_redundant_experts`` (see also ``eplb_interval``)."""
        if not isinstance(self.runner, DPModelRunner) or self.runner.placements is None:
            raise ValueError("rebalance_experts needs an EPLB engine (ep_size > 1 and num_redundant_experts)")
        if tokens_per_expert is None:
            tokens_per_expert = self.runner.take_expert_loads()
        return self.runner.rebalance(tokens_per_expert)

    def decode_pace_ms(self, last: int | None = None) -> np.ndarray:
        """The newest ``last`` (None: all kept, at most :data:`PACE_HISTORY`) decode-pace intervals in ms, oldest
        first: float64 ``[n]``, the pairs ``metrics()["decode_paced_steps"]`` counts. Their median against their
        mean tells steady steps from rare long ones."""
        if last is not None and last < 0:
            raise ValueError(f"last must be >= 0 (or None for all kept intervals), got {last}")
        kept = list(self._paced_intervals)
        if last is not None:
            kept = kept[len(kept) - min(last, len(kept)):]
        return 1e3 * np.asarray(kept, np.float64)

    def expert_loads(self) -> np.ndarray:
        """EPLB engines: tokens routed to each (layer, logical expert) ``[L, E]`` since the engine started or last
        rebalanced, over every engine's real prefill and decode tokens (without resetting the count)."""
        if not isinstance(self.runner, DPModelRunner) or self.runner.placements is None:
            raise ValueError("expert_loads needs an EPLB engine (ep_size > 1 and num_redundant_experts)")
        return self.runner.expert_loads()

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the paged pool holds (all pages but the null page, per engine)."""
        return (self.cache_config.num_blocks - 1) * self.cache_config.block_size

    def metrics(self) -> dict[str, Any]:
        """Counters: tokens, steps, compilations, and the time the device waited for the host (``async`` keeps it
        near zero) and the host waited for the device. Structured outputs: ``structured_requests`` (with
        ``so_args``), ``structured_failed`` (ended by a grammar error), ``structured_mask_seconds`` (host time
        filling token masks: the device can wait on the masks only while the host fills them) and
        ``structured_build_wait_seconds`` (host time blocked on a grammar compilation with nothing else to run).
        ``decode_paced_step_ms``: the mean time between the tokens of consecutive decode steps reaching the host
        (pairs with no prefill step between them): a decode step's period, prefills excluded."""
        m = dataclasses.asdict(self._metrics)
        m["compilations"] = self.runner.num_compilations
        so = self._structured
        m.update(structured_requests=so.requests, structured_failed=so.failed,
                 structured_mask_seconds=so.mask_seconds, structured_build_wait_seconds=so.build_wait_seconds)
        m["host_launch_seconds"] = getattr(self.runner, "launch_seconds", 0.0)
        m["host_sampler_launch_seconds"] = getattr(self.runner, "sampler_launch_seconds", 0.0)
        m["yoco_skipped_steps"] = getattr(self.runner, "yoco_skip_steps", 0)
        busy = m["generate_seconds"]
        m["device_wait_fraction"] = m["device_waited_for_host_seconds"] / busy if busy else 0.0
        m["output_tokens_per_second"] = m["output_tokens"] / busy if busy else 0.0
        n = m["decode_paced_steps"]
        m["decode_paced_step_ms"] = 1e3 * m["decode_paced_seconds"] / n if n else 0.0
        fix = self._step_time_fix
        m["spec_timed_steps"] = fix.num_updates if fix is not None else 0
        m["spec_step_time_slope_ms"] = max(0.0, fix.slope_ms()) if fix is not None else 0.0
        v = m["spec_verify_steps"]
        m["mean_acceptance_length"] = (m["spec_accepted_tokens"] + v) / v if v else 0.0
        return m

    # ------------------------------------------------------------------ internals
    def _draft_width(self, step_id: int, rows: list[tuple[Any, int, int]]) -> int:
        """The scheduler's draft cap for decode step ``step_id`` (confidence-scheduled verification): the width
        :func:`~dinfer_jax.engine.spec_schedule.choose_width` picks from the rows' round N − 2 rates and the
        measured step times of the step's batch and page buckets, minus one. ``rows``: (sequence, drafts it could
        verify, one past its furthest position)."""
        k = self.num_speculative_tokens
        rates = [rates_before(seq.draft_rates, step_id, k) for seq, _, _ in rows]
        b = Buckets.pick(self.buckets.decode_batch, len(rows), "decode batch")
        p = self.buckets.pages_for((reach for _, _, reach in rows), self.block_size)
        fix = self._step_time_fix

        def step_ms(w: int) -> float:
            curve = self.runner.decode_time_ms(b, w, p)
            return fix.step_ms((b, w, p), curve) if fix is not None else curve

        width = choose_width(rates, [nd for _, nd, _ in rows], self.buckets.widths(), step_ms)
        widths = self._metrics.spec_step_widths
        widths[width] = widths.get(width, 0) + 1
        return width - 1

    def _time_correction(self, enabled: bool) -> StepTimeCorrection | None:
        """A new online step-time correction (no samples) when ``enabled``, else None; it needs several widths."""
        if enabled and not self.confidence_scheduling:
            raise ValueError("speculative_time_correction needs confidence-scheduled verification: "
                             "speculative_widths with more than one width")
        return StepTimeCorrection() if enabled else None

    def _time_step(self, done: StepOutput, asked_at: float, got_at: float) -> None:
        """Feed a speculative decode step's device time, where the host loop saw it (:class:`StepClock`), to the
        online correction of the step-time curve (confidence-scheduled verification only)."""
        if self._step_time_fix is None:
            return
        ms = self._clock.observe(done.called_at, asked_at, got_at)
        curve = self.runner.decode_step_ms.get(done.shape)
        if ms is not None and done.num_accepted is not None and curve is not None:
            self._step_time_fix.update(done.shape, ms, curve)

    def _pace(self, decode: bool, got_at: float) -> None:
        """Count a processed step into the decode pace (``EngineMetrics.decode_paced_seconds``): a decode step whose
        predecessor was one too adds the time between their tokens reaching the host (``got_at``)."""
        last, m = self._last_decode_done, self._metrics
        if decode and last is not None:
            m.decode_paced_seconds += got_at - last
            m.decode_paced_steps += 1
            self._paced_intervals.append(got_at - last)
        self._last_decode_done = got_at if decode else None

    def _record_draft_rates(self, done: StepOutput) -> None:
        """Keep each row's acceptance rates of the drafts it published in ``done`` on its sequence (the width
        choice of later steps reads them, :func:`~dinfer_jax.engine.spec_schedule.rates_before`)."""
        conf = np.asarray(done.draft_confidences)
        for i, row in enumerate(done.step.rows):
            seq = row.seq
            if row.epoch != seq.num_preemptions or not row.sample:
                continue   # stale (preempted since), or a non-final prefill chunk (publishes no drafts)
            seq.draft_rates.append((done.step.step_id, acceptance_rates(conf[i])))
            del seq.draft_rates[:-RATE_HISTORY]

    def _load_tokenizer(self, tokenizer: str | Path | Any | None):
        from tokenizers import Tokenizer

        if tokenizer is not None:
            if isinstance(tokenizer, Tokenizer):
                return tokenizer
            if not Path(tokenizer).is_file():
                raise ValueError(f"tokenizer: no tokenizer.json file at {tokenizer!s}")
            return Tokenizer.from_file(str(tokenizer))
        if self.path is None or not (self.path / "tokenizer.json").is_file():
            return None
        return Tokenizer.from_file(str(self.path / "tokenizer.json"))

    def _add(self, sched: Scheduler, prompt: Any, sp: SamplingParams) -> dict[str, Any]:
        rid = self._next_id
        self._next_id += 1
        text = prompt if isinstance(prompt, str) else None
        error = None
        if text is not None:
            if self.tokenizer is None:
                ids, error = [], "this model has no tokenizer.json: pass token ids instead of text"
            else:
                ids = self.tokenizer.encode(text).ids
        else:
            ids = [int(t) for t in prompt] if all(isinstance(t, (int, np.integer)) for t in prompt) else None
            if ids is None:
                ids, error = [], "prompt must be a string or a list of integer token ids"
        seed = sp.seq_seed if sp.seq_seed is not None else int(self._seed_rng.integers(0, 2**63, dtype=np.int64))
        rec = {"id": rid, "text": text, "ids": ids, "params": sp, "seed": seed, "error": error, "seq": None,
               "logprobs": [] if sp.logprobs is not None else None, "matcher": None, "build": None, "so_fed": 0}
        self._metrics.requests += 1
        if error is None and sp.structured is not None:
            if isinstance(self.runner, DPModelRunner):
                rec["error"] = self._structured.refuse("structured output (so_args) runs on the one-device engine; "
                                                       "this engine has several DP/CP/EP ranks")
            else:
                rec["error"] = self._structured.submit(rec)  # admitted to the scheduler once its matcher is built
            return rec
        if error is None:
            rec["seq"] = sched.add_request(rid, ids, sp, eos_token_ids=self.config.eos_token_id)
        return rec

    def _admit_structured(self, sched: Scheduler, pending: list[dict[str, Any]], block: bool,
                          progress: _Progress) -> list[dict[str, Any]]:
        """Give the scheduler the structured requests whose matcher is built (a failed build ends the request with
        its error); returns those still building."""
        for rec, matcher in self._structured.ready(pending, block):
            if matcher.error is not None:
                rec["error"] = matcher.error
                progress.done()
                continue
            rec["matcher"] = matcher
            rec["seq"] = sched.add_request(rec["id"], rec["ids"], rec["params"], eos_token_ids=self.config.eos_token_id)
            if rec["seq"].finished:  # a bad prompt
                progress.done()
        return [r for r in pending if r["build"] is not None]

    @staticmethod
    def _row_sampling(step: ScheduledStep, by_id: dict[int, dict[str, Any]]) -> tuple[list[Any], list[int]]:
        recs = [by_id[r.request_id] for r in step.rows]
        return [r["params"] for r in recs], [r["seed"] for r in recs]

    def _run(self, sched: Scheduler, records: list[dict[str, Any]], use_tqdm: bool) -> None:
        with step_launcher(self.launch_thread) as launcher:
            self._serve(sched, records, use_tqdm, launcher)

    def _serve(self, sched: Scheduler, records: list[dict[str, Any]], use_tqdm: bool, launcher: StepLauncher) -> None:
        """The one-device engine's host loop; ``launcher`` runs the step launches (here or on its thread)."""
        by_id = {r["id"]: r for r in records}
        inflight: collections.deque[Launched] = collections.deque()
        self._clock = StepClock()   # the device is idle when a loop starts
        self._last_decode_done = None
        deferred = False   # the newest step was launched without its sampler (structured rows: masks first)
        progress = _Progress(len(records), use_tqdm)
        idle_since: float | None = None
        for r in records:
            if (r["seq"] is not None and r["seq"].finished) or (r["seq"] is None and r["build"] is None):
                progress.done()  # rejected at once (bad prompt, structured output unavailable)
        m = self._metrics
        so = self._structured
        pending = [r for r in records if r["build"] is not None]  # structured requests whose grammar is building
        any_structured = bool(pending)  # otherwise no step needs masks: skip the per-row check
        while sched.has_unfinished() or inflight or pending:
            if pending:
                pending = self._admit_structured(sched, pending, not (sched.has_unfinished() or inflight), progress)
            t_sched = time.perf_counter()
            step = sched.schedule()
            t_disp = time.perf_counter()
            m.host_schedule_seconds += t_disp - t_sched
            if step is not None:
                if idle_since is not None:  # the device had finished everything queued; it waited until now
                    m.device_waited_for_host_seconds += t_disp - idle_since
                if self.speculative:
                    m.spec_chained_rows += sum(r.chained for r in step.rows)
                structured = any_structured and so.needs_masks(step, by_id)
                spec_masks = None
                if structured and self.speculative:
                    # the speculative step samples and verifies inside the model's program: its masks (one per
                    # verified position, from drafts the device holds) are built first, from fully processed state
                    t_idle = idle_since
                    while inflight:
                        t_idle = self._process_done(inflight.popleft(), sched, by_id, progress)
                    spec_masks = so.spec_masks(step, self.num_speculative_tokens, by_id, sched,
                                               self.runner.draft_tokens)
                    t_now = time.perf_counter()
                    if t_idle is not None:  # the device idles from then on (the part before t_disp is counted)
                        m.device_waited_for_host_seconds += t_now - max(t_idle, t_disp)
                    t_disp = t_now
                # rows of structured requests sample after the host has folded the previous step's tokens into
                # their matchers (below): the model is launched now, the sampler once the masks exist
                deferred = structured and not self.speculative
                inflight.append(launcher.launch(self.runner.dispatch, step, *self._row_sampling(step, by_id),
                                                defer_sample=deferred, spec_masks=spec_masks))
                m.host_dispatch_seconds += time.perf_counter() - t_disp
                idle_since = None
                if step.kind == "prefill":
                    m.prefill_steps += 1
                    m.prefill_tokens += step.num_tokens
                else:
                    m.decode_steps += 1
            keep = 1 if (self.async_scheduling and step is not None) else 0
            while len(inflight) > keep:
                if deferred and len(inflight) == 1:  # synchronous mode: the newest step's masks, then its sampler
                    first = inflight[0].result()
                    if first.pending is not None:
                        self.runner.sample_step(first, so.masks(first.step, first.shape[0], by_id, sched))
                t1 = self._process_done(inflight.popleft(), sched, by_id, progress)
                if not inflight:
                    idle_since = t1  # nothing queued on the device from now until the next dispatch
            if inflight and deferred and inflight[-1].result().pending is not None:
                last = inflight[-1].result()   # async: step N's masks from state through step N - 1
                self.runner.sample_step(last, so.masks(last.step, last.shape[0], by_id, sched))
                for seq in sched.take_finished():  # requests whose matcher failed while filling a mask
                    progress.done(len(seq.output_token_ids))
            # Device idle detection (a lower bound: the moment we first see the queued step done, not when it ended).
            if idle_since is None and inflight and inflight[-1].finished():
                idle_since = time.perf_counter()
        progress.close()

    def _process_done(self, launched: Launched, sched: Scheduler, by_id: dict[int, dict[str, Any]],
                      progress: _Progress) -> float:
        """Fold a finished step's tokens into the scheduler, the structured-output matchers, the logprobs and the
        metrics. Returns the time its tokens reached the host."""
        m, so = self._metrics, self._structured
        t0 = time.perf_counter()
        done = launched.result()
        t_ask = time.perf_counter()
        tokens = np.asarray(done.tokens)
        self._time_step(done, t_ask, time.perf_counter())
        wants_lp = any(by_id[r.request_id]["logprobs"] is not None for r in done.step.rows)
        logprobs = jax.device_get(done.logprobs) if wants_lp else None
        t1 = time.perf_counter()
        m.host_waited_for_device_seconds += t1 - t0
        self._pace(done.step.kind == "decode", t1)
        if self.confidence_scheduling and done.draft_confidences is not None:
            self._record_draft_rates(done)
        if done.num_accepted is not None:  # speculative decode step: each row emitted a run
            nacc = np.asarray(done.num_accepted)
            sampled = [[int(t) for t in tokens[i, : nacc[i] + 1]] if row.num_drafts else int(tokens[i, 0])
                       for i, row in enumerate(done.step.rows)]
            for i, row in enumerate(done.step.rows):
                if row.num_drafts:
                    m.spec_verify_steps += 1
                    m.spec_draft_tokens += row.num_drafts
                    m.spec_accepted_tokens += int(nacc[i])
        else:
            sampled = [int(tokens[i]) if row.sample else None for i, row in enumerate(done.step.rows)]
        n_sampled = sum(len(s) if isinstance(s, list) else 1 for s in sampled if s is not None)
        m.output_tokens += n_sampled
        if done.step.kind == "decode":
            m.decode_tokens += n_sampled
        finished = sched.process_step(done.step, sampled)
        so.advance(done.step, by_id, sched)
        finished += sched.take_finished()  # requests whose grammar rejected a token
        self._record_logprobs(done, logprobs, by_id)
        for seq in finished:
            progress.done(len(seq.output_token_ids))
            if seq.finish_reason == "preempted":
                m.preemptions += 1
        m.host_process_seconds += time.perf_counter() - t1
        return t1

    def _run_dp(self, scheds: list[Scheduler], records: list[dict[str, Any]], use_tqdm: bool) -> None:
        """The host loop of the DP engines (``docs/dp_engines.md``): every engine schedules its own step; the
        steps of one kind run together as one mesh step (prefill ones first), the engines without a step of that
        kind running padding; with ``async_scheduling`` one mesh step stays in flight while the older ones are
        processed, each engine's steps in its own order."""
        by_id = {r["id"]: r for r in records}
        inflight: collections.deque[DPStepOutput] = collections.deque()
        progress = _Progress(len(records), use_tqdm)
        for r in records:
            if r["seq"] is not None and r["seq"].finished:
                progress.done()
        m = self._metrics
        runner = self.runner
        assert isinstance(runner, DPModelRunner)
        self._last_decode_done = None
        while any(s.has_unfinished() for s in scheds) or inflight:
            steps = [s.schedule() for s in scheds]
            dispatched = False
            for kind in ("prefill", "decode"):
                group = [st if st is not None and st.kind == kind else None for st in steps]
                if all(st is None for st in group):
                    continue
                samp = [self._row_sampling(st, by_id) if st is not None else ([], []) for st in group]
                inflight.append(runner.dispatch(group, [p for p, _ in samp], [sd for _, sd in samp]))
                dispatched = True
                self._mesh_steps += 1
                if self.eplb_interval and self._mesh_steps % self.eplb_interval == 0:
                    # EPLB mid-run: the step just dispatched keeps the weights it was launched with; the next ones
                    # read the new placement (reading the loads waits for the steps in flight)
                    runner.rebalance(runner.take_expert_loads())
                    m.eplb_rebalances += 1
                if kind == "prefill":
                    m.prefill_steps += 1
                    m.prefill_tokens += sum(st.num_tokens for st in group if st is not None)
                else:
                    m.decode_steps += 1
            keep = 1 if (self.async_scheduling and dispatched) else 0
            while len(inflight) > keep:
                done = inflight.popleft()
                t0 = time.perf_counter()
                tokens = np.asarray(done.tokens)
                wants_lp = any(by_id[r.request_id]["logprobs"] is not None
                               for st in done.steps if st is not None for r in st.rows)
                logprobs = jax.device_get(done.logprobs) if wants_lp else None
                t1 = time.perf_counter()
                m.host_waited_for_device_seconds += t1 - t0
                self._pace(any(st is not None and st.kind == "decode" for st in done.steps), t1)
                for e, st in enumerate(done.steps):
                    if st is None:
                        continue
                    i = done.engine_index(e)
                    sampled = [int(tokens[i, j]) if row.sample else None for j, row in enumerate(st.rows)]
                    n_sampled = sum(1 for x in sampled if x is not None)
                    m.output_tokens += n_sampled
                    if st.kind == "decode":
                        m.decode_tokens += n_sampled
                    finished = scheds[e].process_step(st, sampled)
                    lp = None if logprobs is None else jax.tree.map(lambda x, i=i: x[i], logprobs)
                    self._record_logprobs(StepOutput(st, tokens[i], lp, done.dispatched_at), lp, by_id)
                    for seq in finished:
                        progress.done(len(seq.output_token_ids))
                        if seq.finish_reason == "preempted":
                            m.preemptions += 1
        for s in scheds:
            for seq in s.take_finished():
                progress.done(len(seq.output_token_ids))
        progress.close()

    def _record_logprobs(self, done: StepOutput, logprobs: Any, by_id: dict[int, dict[str, Any]]) -> None:
        """Logprobs of the tokens the scheduler accepted (``row.accepted_token``), in output order."""
        if logprobs is None:
            return
        for i, row in enumerate(done.step.rows):
            rec = by_id[row.request_id]
            if row.accepted_token is None or rec["logprobs"] is None:
                continue
            n = rec["params"].logprobs
            if done.num_accepted is None:
                runs = [(row.accepted_token, logprobs.token_logprobs[i], logprobs.top_token_ids[i],
                         logprobs.top_logprobs[i])]
            else:  # speculative decode step: [rows, 1 + k] entries, one per emitted token
                toks = row.accepted_tokens if row.num_drafts else [row.accepted_token]
                runs = [(t, logprobs.token_logprobs[i][j], logprobs.top_token_ids[i][j], logprobs.top_logprobs[i][j])
                        for j, t in enumerate(toks)]
            for tok, lp, top_ids, top_lp in runs:
                entry = {"token": tok, "logprob": float(lp)}
                if n:
                    entry["top"] = [(int(t), float(v)) for t, v in zip(top_ids[:n], top_lp[:n], strict=False)]
                rec["logprobs"].append(entry)

    def _output(self, rec: dict[str, Any]) -> RequestOutput:
        seq = rec["seq"]
        if seq is None:
            return RequestOutput(rec["id"], rec["text"], rec["ids"], [], "", "error", rec["error"], rec["logprobs"])
        toks = list(seq.output_token_ids)
        text = self.tokenizer.decode(toks) if self.tokenizer is not None and toks else ""
        lp = rec["logprobs"][: len(toks)] if rec["logprobs"] is not None else None
        return RequestOutput(rec["id"], rec["text"], list(seq.prompt_token_ids), toks, text, seq.finish_reason,
                             seq.error, lp)


class _Progress:
    """rich progress bar: requests done and output tokens/s."""

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        self.tokens = 0
        self.t0 = time.perf_counter()
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), transient=False)
            self.task = self.bar.add_task("gen", total=total, rate="")
            self.bar.start()

    def done(self, n_tokens: int = 0) -> None:
        self.tokens += n_tokens
        if self.enabled:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(self.task, advance=1, rate=f"{rate:.1f} tok/s")

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()
