"""Serving benchmark of a real-dimension model slice on the accelerator (issue 8: prefill at real size, warm-up).

For each layer count, the preset is cut to its first N layers (:func:`bench_compile.first_layers`), random weights
are built on the device in the release's formats (``weights="native"``: FP4 experts, FP8 linears), and an
:class:`~dinfer_jax.LLM` is constructed with warm-up (every shape bucket compiled, cold: a fresh compilation cache
directory per run). Then:

* **prefill**: one prompt of ``--prefill-tokens`` tokens (one prefill step of that many tokens), greedy, 2 tokens;
* **decode**: ``--batch`` prompts of ``--prompt-len`` tokens, ``--max-tokens`` greedy tokens each
  (``ignore_eos``), decode tokens/s and mean decode step time, against the weight-streaming roofline of the same
  slice: the weight bytes a decode step reads (:func:`decode_read_bytes`: all weights but the routed experts and
  the embedding table, plus the experts the batch is expected to touch — 78% of them at batch 64, 2.3% at batch 1)
  ÷ the device-to-device copy bandwidth measured in the same run. The JSON rows also carry the all-weights figure
  (``roofline_all_weights_ms``, what this table showed before 2026-12-02).

Prints a Markdown table (and writes it under ``--out``).

    python scripts/bench_serving.py --preset deepseek-v4-flash --layers 2 4 --out /tmp/serving

V4.1 slices keep their Engram layers with ``--engram-vocab`` (random FP8 tables of that hash vocabulary) and compare
table placements with ``--engram-tables device host host-direct`` (issue 13: host tables within 5% of device
tables; ``--breakdown`` adds the device's busy share of a decode step, the kernels of a decode step (with their
launches per step) and of one prefill):

    python scripts/bench_serving.py --preset deepseek-v4.1-flash --layers 4 --engram-vocab 1000000 \
        --engram-tables device host host-no-thread host-direct --lean-buckets --out /tmp/serving
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dinfer_jax.engine.buckets import Buckets  # noqa: E402
from dinfer_jax.models import random_model  # noqa: E402
from dinfer_jax.models.config import load_config  # noqa: E402
from dinfer_jax.models.engram import engram_table_sizes  # noqa: E402
from dinfer_jax.sampling.params import SamplingParams  # noqa: E402

# the engine's host-time counters (LLM.metrics()["host_<phase>_seconds"]) reported per step
HOST_PHASES = ("schedule", "dispatch", "launch", "sampler_launch", "process", "waited_for_device")


def host_seconds(before: dict, after: dict) -> dict[str, float]:
    """Host seconds by phase (:data:`HOST_PHASES`) between two ``LLM.metrics()`` snapshots."""
    return {k: after[f"host_{k}_seconds"] - before[f"host_{k}_seconds"] for k in HOST_PHASES}


def pace_quantiles(intervals_ms: np.ndarray) -> dict[str, float]:
    """Median, 90th percentile and maximum of decode-pace intervals (``LLM.decode_pace_ms``), NaN when empty."""
    if not intervals_ms.size:
        return dict.fromkeys(("decode_paced_median_ms", "decode_paced_p90_ms", "decode_paced_max_ms"), float("nan"))
    return dict(decode_paced_median_ms=float(np.median(intervals_ms)),
                decode_paced_p90_ms=float(np.percentile(intervals_ms, 90)),
                decode_paced_max_ms=float(intervals_ms.max()))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, the same ceiling as ``bench_kernels.py`` (PyTorch ``copy_``
    where torch is installed, else an XLA elementwise pass, which reads lower: 2.4-3.4 TB/s vs 4.3 on the H200)."""
    from bench_kernels import ceilings

    return ceilings()["copy_GBps"] * 1e9


def kernel_launches(fn, longest: list | None = None) -> dict[str, tuple[float, int]] | None:
    """Device milliseconds and launch count per kernel name, over everything ``fn()`` launches (CUPTI, through the
    extension behind ``jax.experimental.mosaic.gpu.profiler``; None where it is unavailable). The engine's host loop
    is not a single jitted function, so the profiler's ``measure`` wrapper cannot take it; this opens the same CUPTI
    window around a plain call. ``longest``, where given, receives the ten longest single launches as
    ``(name, ms)``."""
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        ext = mosaic_gpu_lib._mosaic_gpu_ext
    except Exception as e:  # noqa: BLE001 - an optional breakdown; the benchmark stands without it
        print("kernel breakdown unavailable:", e)
        return None
    ext._cupti_init()
    try:
        fn()
    finally:
        timings = ext._cupti_get_timings(True)
    out: dict[str, tuple[float, int]] = {}
    for name, ms in timings or []:
        total, count = out.get(name, (0.0, 0))
        out[name] = (total + ms, count + 1)
    if longest is not None:
        longest.extend(sorted(timings or [], key=lambda t: -t[1])[:10])
    return out


def kernel_times(fn) -> dict[str, float] | None:
    """Device milliseconds per kernel name, summed over everything ``fn()`` launches (:func:`kernel_launches`)."""
    launches = kernel_launches(fn)
    return None if launches is None else {name: ms for name, (ms, _) in launches.items()}


class StepKernels(NamedTuple):
    """One decode step's kernels as the device ran them (:func:`decode_breakdown`)."""

    parts: list[tuple[str, float]]     # (kernel name, device ms per step), largest first
    launches: dict[str, float]         # kernel name -> launches per step
    wall_ms: float                     # wall ms per step in the profiled window (NaN without CUPTI)


def decode_breakdown(llm, prompts, steps: int, **sampling: float) -> StepKernels:
    """Per-kernel device ms and launches of one decode step and the wall ms of one decode step in the same CUPTI
    window: kernel times, launch counts and wall time of ``generate`` with ``1 + steps`` tokens minus those with 1
    token (the prefills and first token), divided by ``steps``, with the run's ``sampling`` parameters
    (``temperature``, ``top_p``, ``top_k``; default greedy). Kernels sorted, largest first; empty parts and NaN
    where CUPTI is unavailable.

    The kernel sum over the wall is the device's busy share of a decode step as the device saw it — a stall *inside*
    a step (a host computation the program waits for) shows here, where the engine's own idle estimate, taken
    between steps, cannot see it. Kernels on concurrent streams would add up past the wall; XLA ran these steps on
    one stream."""
    from dinfer_jax.sampling.params import SamplingParams as SP

    def gen(n):
        return lambda: llm.generate(prompts, SP(**{"temperature": 0.0, **sampling}, max_tokens=n, ignore_eos=True),
                                    use_tqdm=False)

    (short, short_s), (full, full_s) = timed(kernel_launches, gen(1)), timed(kernel_launches, gen(1 + steps))
    if short is None or full is None:
        return StepKernels([], {}, float("nan"))
    per_step = {k: ((ms - s_ms) / steps, (n - s_n) / steps)
                for k, (ms, n) in full.items() for s_ms, s_n in [short.get(k, (0.0, 0))]}
    kernels = sorted(((k, ms) for k, (ms, _) in per_step.items() if ms > 1e-4), key=lambda kv: -kv[1])
    return StepKernels(kernels, {k: n for k, (_, n) in per_step.items() if n > 0}, 1e3 * (full_s - short_s) / steps)


def launch_summary(parts: list[tuple[str, float]], launches: dict[str, float],
                   short_us: float = 10.0) -> dict[str, float]:
    """Launches per step and how much of the step's kernel time is spent in kernels whose average launch is shorter
    than ``short_us`` microseconds (many small fusions cost their fixed per-launch time each)."""
    short = [(ms, launches.get(k, 0.0)) for k, ms in parts
             if launches.get(k, 0.0) > 0 and 1e3 * ms / launches[k] < short_us]
    return dict(launches_per_step=float(sum(launches.get(k, 0.0) for k, _ in parts)),
                short_launches_per_step=float(sum(n for _, n in short)),
                short_kernel_ms_per_step=float(sum(ms for ms, _ in short)))


def prefill_breakdown(llm, prompt: list[int]) -> tuple[list[tuple[str, float]], float]:
    """Per-kernel device ms of one prefill of ``prompt`` (and its first token) and its wall ms, in one CUPTI
    window (``--breakdown``). Kernels sorted, largest first; ``([], nan)`` where CUPTI is unavailable."""
    from dinfer_jax.sampling.params import SamplingParams as SP

    one = SP(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, wall_s = timed(kernel_times, lambda: llm.generate([prompt], one, use_tqdm=False))
    if times is None:
        return [], float("nan")
    return sorted(((k, v) for k, v in times.items() if v > 1e-3), key=lambda kv: -kv[1]), 1e3 * wall_s


def print_kernels(what: str, parts: list[tuple[str, float]], wall_ms: float, top: int = 40,
                  launches: dict[str, float] | None = None) -> None:
    """The kernels' table: device ms, share of the kernel sum and, where ``launches`` (per step) are given, launches
    per step of each kernel name."""
    total = sum(v for _, v in parts)
    print(f"{what}, device time by kernel (sum {total:.2f} ms of {wall_ms:.2f} ms wall in the profiled window):")
    for name, v in parts[:top]:
        n = f"  {launches.get(name, 0.0):6.1f}x" if launches is not None else ""
        print(f"  {v:8.3f} ms  {100 * v / max(total, 1e-9):5.1f}%{n}  {name[:110]}")


def timed(fn, *args):
    """``(fn(*args), seconds it took)``."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


# --engram-tables choices: name → (LLM engram_tables, LLM launch_thread); "host-no-thread" is the host placement
# with steps launched on the serving thread, to measure what the launch thread buys; "host-direct": host tables read
# by the device's gather kernel
ENGRAM_PLACEMENTS = {"device": ("device", None), "host": ("host", None), "host-no-thread": ("host", False),
                     "host-direct": ("host-direct", None)}


def run_one(preset: str, layers: int, args, bw: float, placement: str = "device") -> dict:
    from bench_compile import first_layers  # scripts/ is on sys.path when run as a script

    from dinfer_jax import LLM

    engram_tables, launch_thread = ENGRAM_PLACEMENTS[placement]
    cfg = first_layers(load_config(preset), layers)
    if args.no_engram and cfg.is_v41:
        # V4.1-Flash's Engram tables (~384M rows per layer) are not built at random: the slice keeps the layer,
        # without its Engram branch
        cfg = cfg.replace(engram_layer_ids=(), engram_num_embeddings=())
    elif args.engram_vocab and cfg.engram_layer_ids:
        # smaller hash vocabulary: tables of about (M−1)·heads·vocab rows per layer, drawn at random in the release's
        # FP8 format (the release's 16,000,000 gives 384M rows, 101 GB a layer)
        cfg = cfg.replace(engram_vocab_size=args.engram_vocab)
        cfg = cfg.replace(engram_num_embeddings=engram_table_sizes(cfg))
    t0 = time.perf_counter()
    # stacked: the engine's scan layout from the start; built in checkpoint layout, the layer weights were held
    # twice (the model here, the engine's stacked copy): V4.1's 4-layer slice ran out of an H100's 78 GiB
    model = random_model(cfg, dtype="bfloat16", include_mtp=False, weights="native", stacked=True)
    model = dataclasses.replace(model, mhc_impl=args.mhc_impl, linear_impl=args.linear_impl,
                                attention_impl=args.attention_impl)
    jax.block_until_ready(model.params)
    init_s = time.perf_counter() - t0
    buckets = None
    if args.lean_buckets:
        buckets = Buckets(decode_batch=(args.batch,), prefill_batch=(1,), prefill_len=(args.prefill_tokens,))
    llm = LLM(model, dtype="bfloat16", max_num_seqs=args.batch, max_model_len=args.prefill_tokens + 64,
              max_num_batched_tokens=args.prefill_tokens,
              kv_cache_memory_bytes=(args.kv_gib << 30) if args.kv_gib > 0 else None,
              progress=False, buckets=buckets, compile_threads=args.compile_threads, engram_tables=engram_tables,
              launch_thread=launch_thread, compiler_options=args.compiler_options,
              decode_compiler_options=args.decode_compiler_options)
    warm = llm.metrics()["warmup_seconds"]
    timings = llm.runner.warmup_timings
    if timings:
        print_warmup_timings(timings, warm)
    compiled_in_warmup = llm.metrics()["compilations"]
    plan = llm.memory_plan
    if plan is not None:
        print(f"memory plan: {plan}", flush=True)
    n_shapes = len(llm.buckets.shapes())
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long_prompt = rng.integers(10, cfg.vocab_size - 10, args.prefill_tokens).tolist()
    llm.generate([long_prompt], greedy, use_tqdm=False)                   # first run: no compilation expected
    t0 = time.perf_counter()
    out = llm.generate([long_prompt], greedy, use_tqdm=False)
    prefill_s = time.perf_counter() - t0
    prompts = [rng.integers(10, cfg.vocab_size - 10, args.prompt_len).tolist() for _ in range(args.batch)]
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
                        ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    tracked = len(gc.get_objects())  # before a freeze: afterwards they are out of the collector's sight
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()
    m0 = llm.metrics()
    prof = None
    if args.host_profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with gc_pauses() as pauses:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        gen_s = time.perf_counter() - t0
    if prof is not None:
        import pstats

        prof.disable()
        print("host profile of the timed generate (cProfile, by own time):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    m1 = llm.metrics()
    paced_all = llm.decode_pace_ms(last=m1["decode_paced_steps"] - m0["decode_paced_steps"])
    dsteps = m1["decode_steps"] - m0["decode_steps"]
    dtoks = m1["decode_tokens"] - m0["decode_tokens"]
    # decode time ≈ total minus the prefill steps, which we time separately as one batched prefill
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                         max_tokens=1, ignore_eos=True), use_tqdm=False)
    short_prefill_s = time.perf_counter() - t0
    m2 = llm.metrics()
    decode_s = max(gen_s - short_prefill_s, 1e-9)
    step_ms = 1e3 * decode_s / max(dsteps, 1)
    # the decode pace: time between consecutive decode steps' tokens reaching the host, prefill steps excluded
    # (EngineMetrics.decode_paced_seconds) — unlike step_ms, not a difference of two prefill-dominated wall times
    paced_n = m1["decode_paced_steps"] - m0["decode_paced_steps"]
    paced_ms = 1e3 * (m1["decode_paced_seconds"] - m0["decode_paced_seconds"]) / paced_n if paced_n else float("nan")
    timed_host, prefill_host = host_seconds(m0, m1), host_seconds(m1, m2)
    roofline_all_ms = 1e3 * model.param_bytes / bw
    read_bytes, expert_frac = decode_read_bytes(model.params, cfg, args.batch)
    roofline_ms = 1e3 * read_bytes / bw
    engram_gb = model.engram.table_bytes / 1e9 if model.engram is not None else 0.0
    row = dict(layers=layers, param_GB=model.param_bytes / 1e9, engram_tables=placement if engram_gb else "-",
               engram_GB=engram_gb, init_s=init_s, warmup_s=warm, shapes=n_shapes,
               compilations_after_warmup=m1["compilations"] - compiled_in_warmup,
               prefill_tokens=args.prefill_tokens, prefill_s=prefill_s,
               prefill_tok_per_s=args.prefill_tokens / prefill_s, first_tokens=out[0].token_ids,
               batch=args.batch, decode_steps=dsteps, decode_tokens=dtoks, decode_tok_per_s=dtoks / decode_s,
               decode_step_ms=step_ms, decode_paced_step_ms=paced_ms, decode_paced_steps=paced_n,
               # the paced intervals' distribution: a median well under the mean means rare long steps
               **pace_quantiles(paced_all),
               decode_paced_intervals_ms=[round(float(v), 3) for v in paced_all],
               # Python's garbage collections during the timed run: objects tracked when it began, and per
               # generation the collections and their longest pause (ms)
               gc_mode=args.gc, gc_tracked_objects=tracked,
               gc_collections={g: sum(1 for k, _ in pauses if k == g) for g in range(3)},
               gc_longest_ms={g: max((ms for k, ms in pauses if k == g), default=0.0) for g in range(3)},
               decode_read_GB=read_bytes / 1e9, experts_touched=expert_frac,
               roofline_step_ms=roofline_ms, roofline_fraction=roofline_ms / step_ms,
               roofline_fraction_paced=roofline_ms / paced_ms,
               roofline_all_weights_ms=roofline_all_ms,
               warmup_programs=[dataclasses.asdict(t) for t in timings],
               # over the timed decode run: how long the host sat waiting for results, and the engine's estimate
               # of how long the device sat idle waiting for the host
               host_waited_s=m1["host_waited_for_device_seconds"] - m0["host_waited_for_device_seconds"],
               device_waited_s=m1["device_waited_for_host_seconds"] - m0["device_waited_for_host_seconds"],
               generate_s=gen_s, kv_capacity_tokens=llm.kv_capacity_tokens,
               # host time per step of the timed run by phase (ms): schedule, dispatch (inputs + launch), launch
               # (the jitted calls alone), sampler_launch (of which the sampler program's call), process (tokens
               # back into the requests)
               host_ms_per_step={k: 1e3 * v / max(m1["decode_steps"] + m1["prefill_steps"]
                                                  - m0["decode_steps"] - m0["prefill_steps"], 1)
                                 for k, v in timed_host.items()},
               # the same per decode step: the timed run's host times minus those of the max_tokens=1 run (the
               # same prefill steps, no decode step), over the timed run's decode steps
               host_ms_per_decode_step={k: 1e3 * (v - prefill_host[k]) / max(dsteps, 1)
                                        for k, v in timed_host.items()})
    if args.timed_kernels:
        longest: list[tuple[str, float]] = []
        launches, window_s = timed(functools.partial(kernel_launches, longest=longest),
                                   functools.partial(llm.generate, prompts, sp, use_tqdm=False))
        if launches:
            top = sorted(launches.items(), key=lambda kv: -kv[1][0])[:15]
            row["timed_run_kernels"] = [(name, ms, n) for name, (ms, n) in top]
            print(f"kernels of the timed run again in a CUPTI window ({window_s:.2f} s wall, "
                  f"{sum(ms for ms, _ in launches.values()):.1f} ms of kernels, "
                  f"{sum(n for _, n in launches.values())} launches), by device time:", flush=True)
            for name, ms, n in row["timed_run_kernels"]:
                print(f"  {ms:9.2f} ms  {n:7d} launches  {name[:100]}", flush=True)
            # a stall made of one long kernel shows in the longest launches; one made of a device loop (many short
            # launches of its body) in the most-launched kernels
            row["timed_run_longest_launches"] = longest
            row["timed_run_most_launched"] = [(name, ms, n) for name, (ms, n) in
                                              sorted(launches.items(), key=lambda kv: -kv[1][1])[:15]]
            print("longest single launches:", flush=True)
            for name, ms in longest:
                print(f"  {ms:9.2f} ms  {name[:100]}", flush=True)
            print("most launched:", flush=True)
            for name, ms, n in row["timed_run_most_launched"]:
                print(f"  {ms:9.2f} ms  {n:7d} launches  {name[:100]}", flush=True)
    if args.breakdown:
        step_kernels = decode_breakdown(llm, prompts, args.max_tokens, temperature=args.temperature,
                                        top_p=args.top_p, top_k=args.top_k)
        parts, window_step_ms = step_kernels.parts, step_kernels.wall_ms
        row["decode_kernels_ms"] = parts
        row["decode_kernel_launches"] = step_kernels.launches
        total = sum(v for _, v in parts)
        row.update(kernel_ms_per_step=total, window_step_ms=window_step_ms,
                   device_busy=total / window_step_ms if parts else float("nan"),
                   **launch_summary(parts, step_kernels.launches))
        print_kernels(f"decode step ({step_ms:.2f} ms unprofiled)", parts, window_step_ms,
                      launches=step_kernels.launches)
        if parts:
            print(f"decode step launches: {row['launches_per_step']:.0f} a step; kernels averaging < 10 us: "
                  f"{row['short_launches_per_step']:.0f} launches, {row['short_kernel_ms_per_step']:.2f} ms of "
                  f"{total:.2f} ms", flush=True)
        pparts, prefill_wall_ms = prefill_breakdown(llm, long_prompt)
        row.update(prefill_kernels_ms=pparts, prefill_kernel_ms=sum(v for _, v in pparts),
                   prefill_window_ms=prefill_wall_ms)
        print_kernels(f"prefill of {args.prefill_tokens} tokens ({1e3 * prefill_s:.1f} ms unprofiled)", pparts,
                      prefill_wall_ms)
    print(f"decode pace ms: mean {row['decode_paced_step_ms']:.2f}, median {row['decode_paced_median_ms']:.2f}, "
          f"p90 {row['decode_paced_p90_ms']:.2f}, max {row['decode_paced_max_ms']:.2f} ({paced_n} intervals)",
          flush=True)
    if len(paced_all):
        longest = np.argsort(paced_all)[::-1][:3]
        print("longest decode-pace intervals (index of " + str(len(paced_all)) + ": ms): "
              + ", ".join(f"{i}: {paced_all[i]:.2f}" for i in longest), flush=True)
    print(f"gc ({args.gc}, {tracked} objects tracked): collections by generation {row['gc_collections']}, longest "
          + ", ".join(f"gen {g} {ms:.1f} ms" for g, ms in row["gc_longest_ms"].items()), flush=True)
    print("host ms per decode step: " + ", ".join(f"{k} {v:.2f}" for k, v in row["host_ms_per_decode_step"].items()),
          flush=True)
    print(json.dumps(row, default=str), flush=True)
    del llm, model
    return row


def print_warmup_timings(timings, warm_s: float) -> None:
    """Where the warm-up went, per program (``ModelRunner.warmup_timings``, lowering order): the lowerings run one
    after another (Python's lock), each program's backend compile starts when it is lowered (or, staged, when the
    first program of its shape is compiled)."""
    print("| program | lower from s | lower s | compile from s | compile s | done at s |")
    print("|---|---:|---:|---:|---:|---:|")
    for t in timings:
        print(f"| {t.program} | {t.lower_start_s:.1f} | {t.lower_s:.1f} | {t.compile_start_s:.1f} | "
              f"{t.compile_s:.1f} | {t.end_s:.1f} |")
    print(f"warm-up {warm_s:.1f} s: lowering {sum(t.lower_s for t in timings):.1f} s in all, backend compiles "
          f"{sum(t.compile_s for t in timings):.1f} s in all, last compile done at "
          f"{max(t.end_s for t in timings):.1f} s (the rest: one run of each bucket)", flush=True)


def decode_read_bytes(params, cfg, batch: int) -> tuple[float, float]:
    """Weight bytes one decode step of ``batch`` rows reads, and the expected fraction of routed experts it touches.

    Every weight is read once except the routed experts and the embedding table: the embedding contributes the
    ``batch`` rows looked up; a MoE layer's E experts are each touched with probability ``1 − (1 − k/E)^batch``
    (top-k of E, or hash routing, uniform over random tokens; the random-weight gate is close to that) — 78% of them
    at batch 64 with k = 6, E = 256, 2.3% at batch 1. Engram tables (not in ``params``) and the KV cache (prompts of
    ``--prompt-len``) are left out. ``params`` may be abstract (``jax.ShapeDtypeStruct`` leaves)."""
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    frac = 1.0 - (1.0 - k / E) ** batch
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = jax.tree_util.keystr(path)
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if key.startswith("['embed']"):
            nbytes = nbytes * min(1.0, batch / leaf.shape[0])
        elif "['ffn']['experts']" in key:
            nbytes = nbytes * frac
        total += nbytes
    return total, frac


def options_arg(given: list[str] | None) -> dict[str, str | int | float | bool] | None:
    """A repeatable ``NAME=VALUE`` flag's values → options: None (not given: the engine's default), ``{}``
    (``none``) or the parsed mapping."""
    if given is None:
        return None
    return {} if given == ["none"] else dict(parse_option(o) for o in given)


def describe_options(options: dict | None, empty: str) -> str:
    """The table caption's words for an options setting (:func:`options_arg`)."""
    return "engine default" if options is None else str(options) if options else empty


def parse_option(text: str) -> tuple[str, str | int | float | bool]:
    """``NAME=VALUE`` → (name, value as int, float or bool when it reads as one, else the string)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--compiler-option wants NAME=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


def busy_cell(r: dict) -> str:
    """The table's CUPTI cell: decode kernel ms ÷ wall ms per step in the profiled window (``--breakdown``)."""
    if not r.get("decode_kernels_ms"):
        return "-"
    return f"{r['kernel_ms_per_step']:.2f} ÷ {r['window_step_ms']:.2f} = {100 * r['device_busy']:.1f}%"


@contextlib.contextmanager
def gc_pauses():
    """Record Python's garbage collections while the block runs: yields a list that fills with one
    ``(generation, milliseconds)`` pair per collection (``gc.callbacks``). A full (generation-2) collection walks
    every tracked object of the process — after a real-dimension warm-up, millions — and stops the host loop."""
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((int(info["generation"]), 1e3 * (time.perf_counter() - started.pop())))

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v4-flash")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    # long enough that the decode part dominates the difference of two generate calls (the prefill part of each
    # is seconds with --lean-buckets, where every prompt prefills as its own [1, --prefill-tokens] step)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--kv-gib", type=int, default=8,
                    help="KV pool GiB; 0 = planned from device memory (LLM's memory_utilization)")
    ap.add_argument("--lean-buckets", action="store_true",
                    help="compile only decode batch --batch and prefill [1, --prefill-tokens] (times the minimum)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="decode sampling temperature (0 = greedy; > 0 runs the sampler's draw variant)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="decode top-p (with --temperature > 0: the sampler's filters, < 1 runs them)")
    ap.add_argument("--top-k", type=int, default=-1, help="decode top-k (with --temperature > 0; -1 disables)")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile the timed decode run and print the host functions by own time")
    ap.add_argument("--breakdown", action="store_true",
                    help="also list the device time of one decode step and of one prefill by kernel (CUPTI)")
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="threads compiling the buckets at warm-up (LLM compile_threads; default: the cores)")
    ap.add_argument("--no-engram", action="store_true",
                    help="V4.1 presets: leave out the Engram branches (real-size tables cannot be built at random)")
    ap.add_argument("--engram-vocab", type=int, default=None,
                    help="V4.1 presets: Engram hash vocabulary for random FP8 tables that fit (e.g. 1000000: ~24M "
                         "rows, 6.3 GB a layer); the release's 16,000,000 does not fit")
    ap.add_argument("--engram-tables", nargs="+", default=["device"], choices=list(ENGRAM_PLACEMENTS),
                    help="V4.1: Engram table placements to run (LLM engram_tables), each a full run; "
                         "host-no-thread: host tables with the launch thread off (LLM launch_thread=False)")
    ap.add_argument("--copy-gbps", type=float, default=None,
                    help="roofline copy bandwidth, GB/s, instead of measuring it (CUPTI: GPUs only; a CPU smoke run)")
    ap.add_argument("--compiler-option", action="append", default=None, metavar="NAME=VALUE",
                    help="XLA compile option for the engine's programs (LLM compiler_options), e.g. "
                         "xla_gpu_autotune_level=0; repeatable; 'none': XLA's defaults; default: the engine's "
                         "(Triton GEMMs off when the linear kernel serves decode)")
    ap.add_argument("--mhc-impl", default="auto", choices=["auto", "jnp", "pallas"],
                    help="the mHC Sinkhorn: XLA (jnp), the Mosaic GPU kernel (pallas_kernels/mhc) or auto "
                         "(the kernel on a GPU)")
    ap.add_argument("--attention-impl", default="auto", choices=["auto", "jnp", "pallas", "pallas_gather"],
                    help="Model.attention_impl: 'pallas' also gives prefill chunks the decode-attention kernel; "
                         "'pallas_gather' as 'pallas', the kernel reading the selected rows from the cache itself")
    ap.add_argument("--linear-impl", default="auto", choices=["auto", "xla", "pallas"],
                    help="the FP8 linears: XLA's autotuned GEMM fusions, the Mosaic GPU kernel (pallas_kernels/linear) "
                         "for calls of up to 64 tokens, or auto (the engine's default: the kernel on a GPU)")
    ap.add_argument("--decode-compiler-option", action="append", default=None, metavar="NAME=VALUE",
                    help="XLA option added for the decode programs only (LLM decode_compiler_options); 'none': no "
                         "extra options; default: the engine's (GEMM autotuning off when the linear kernel serves "
                         "decode)")
    ap.add_argument("--timed-kernels", action="store_true",
                    help="after the timed run, one more run of it in a CUPTI window: the kernels with the most device "
                         "time over the whole run, with their launch counts (a rare long device step — e.g. the "
                         "draw's exact scan, a loop of ~16K iterations — shows as thousands of launches of its body)")
    ap.add_argument("--gc", default="default", choices=["default", "freeze"],
                    help="Python's garbage collector during the timed runs: as the process has it, or 'freeze': "
                         "gc.collect() then gc.freeze() after warm-up (what survived warm-up is never traversed "
                         "again)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.compiler_options = options_arg(args.compiler_option)
    args.decode_compiler_options = options_arg(args.decode_compiler_option)
    cache = tempfile.mkdtemp(prefix="dinfer_jax_cold_cache_")
    jax.config.update("jax_compilation_cache_dir", cache)     # cold: nothing compiled before this run
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    bw = args.copy_gbps * 1e9 if args.copy_gbps else copy_bandwidth()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for where, n in [(w, n) for w in args.engram_tables for n in args.layers]:
        rows.append(run_one(args.preset, n, args, bw, where))
        if args.out:   # after every slice, so a run cut short by a time limit keeps what it measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_serving.json").write_text(json.dumps(rows, default=str, indent=1))
    bw_src = "given (--copy-gbps)" if args.copy_gbps else "measured in this run"
    lines = [f"{args.preset} slices, random native weights (FP4 experts, FP8 linears), bf16 compute; "
             f"copy bandwidth {bw / 1e9:.0f} GB/s {bw_src}; jax {jax.__version__}; "
             f"compiler options {describe_options(args.compiler_options, 'XLA defaults')}, decode programs "
             f"{describe_options(args.decode_compiler_options, 'same')}"
             f"; FP8 linears: {args.linear_impl}", "",
             "| layers | weights GB | Engram tables (GB) | warm-up s (shapes) | prefill tokens | prefill s "
             "| prefill tok/s | batch | decode tok/s | decode step ms (generate − prefill) | decode step ms (paced) "
             "| GB read (experts touched) | roofline ms | % roofline, difference (paced) "
             "| device idle % (engine) | kernel ms ÷ step ms (CUPTI) |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        idle = 100 * r["device_waited_s"] / max(r["generate_s"], 1e-9)
        lines.append(f"| {r['layers']} | {r['param_GB']:.1f} | {r['engram_tables']} ({r['engram_GB']:.1f}) | "
                     f"{r['warmup_s']:.1f} ({r['shapes']}) | "
                     f"{r['prefill_tokens']} | {r['prefill_s']:.2f} | {r['prefill_tok_per_s']:.0f} | {r['batch']} | "
                     f"{r['decode_tok_per_s']:.0f} | {r['decode_step_ms']:.2f} | {r['decode_paced_step_ms']:.2f} | "
                     f"{r['decode_read_GB']:.1f} ({100 * r['experts_touched']:.0f}%) | {r['roofline_step_ms']:.2f} | "
                     f"{100 * r['roofline_fraction']:.0f}% ({100 * r['roofline_fraction_paced']:.0f}%) | "
                     f"{idle:.1f} | {busy_cell(r)} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_serving.md").write_text(text + "\n")
        (out / "bench_serving.json").write_text(json.dumps(rows, default=str, indent=1))


if __name__ == "__main__":
    main()
