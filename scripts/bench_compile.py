"""Compile time of the serving step and the full forward vs number of layers (layer scan; issue 8 part 3).

For each layer count the preset is cut to its first N layers (V4.1 cross-layer ids are filtered to the kept
layers), parameters and cache are abstract (``jax.ShapeDtypeStruct``, nothing allocated, so real-dimension presets
work on any host), and ``jax.jit(...).lower(...).compile()`` is timed for one serving step bucket ``[B, Q]`` and the
full forward ``[B, S]``. Prints a Markdown table and the 8-layer / 2-layer ratio.

    python scripts/bench_compile.py --preset tiny-v4 --layout deepseek-v4-flash --layers 2 4 8 16
    python scripts/bench_compile.py --preset deepseek-v4-flash --layers 2 4 8 --dtype bfloat16   # on the GPU
    python scripts/bench_compile.py --preset deepseek-v4-flash --layers 2 4 8 --dtype bfloat16 --weights native \
        --batch 64 --q 1 --engine-defaults     # the engine's decode program as LLM compiles it on this backend

``--engine-defaults`` compiles the step as ``LLM`` does on this backend: the FP8 linear kernel where ``LLM`` takes
it (``linear_impl="auto"``) and ``LLM``'s default XLA options for the bucket (on a GPU with that kernel: Triton's GEMM
fusions off for every program, GEMM autotuning off for decode buckets, ``q = 1``). Without it the step is compiled
with XLA's own options and XLA's linears, as the tables of 2026-12-01 were.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dinfer_jax.engine.llm import step_program_options  # noqa: E402
from dinfer_jax.engine.model_step import model_step  # noqa: E402
from dinfer_jax.models.config import ModelConfig, load_config  # noqa: E402
from dinfer_jax.models.engram_lookup import EngramLookup, abstract_state  # noqa: E402
from dinfer_jax.models.layer_plan import plan_layers, stack_params  # noqa: E402
from dinfer_jax.models.linear_impl import resolve_linear_impl  # noqa: E402
from dinfer_jax.models.params import abstract_params  # noqa: E402
from dinfer_jax.models.step_state import CacheConfig, StepInput, cache_shapes  # noqa: E402
from dinfer_jax.models.v4 import ForwardOptions, forward  # noqa: E402


def first_layers(base: ModelConfig, n: int, layout: ModelConfig | None = None) -> ModelConfig:
    """``base``'s dimensions with the first ``n`` layers of ``layout``'s layer structure (default: base's own;
    no MTP / DSpark blocks)."""
    cfg = layout or base
    if n > cfg.num_layers:
        raise ValueError(f"{n} layers requested, the preset has {cfg.num_layers}")
    keep = lambda ids: tuple(i for i in ids if i < n)  # noqa: E731
    changes = dict(num_layers=n, attn_kinds=cfg.attn_kinds[:n], compress_ratios=cfg.compress_ratios[:n],
                   hash_layers=cfg.hash_layers[:n], n_mtp_layers=0, mtp_compress_ratios=())
    if cfg.is_v41:
        eng = keep(cfg.engram_layer_ids)
        changes.update(
            kv_source_layer_ids=keep(cfg.kv_source_layer_ids), index_source_layer_ids=keep(cfg.index_source_layer_ids),
            index_k_source_layer_ids=keep(cfg.index_k_source_layer_ids),
            candidate_source_layer_id=cfg.candidate_source_layer_id if cfg.candidate_source_layer_id < n else -1,
            engram_layer_ids=eng, engram_num_embeddings=cfg.engram_num_embeddings[:len(eng)],
            dspark_target_layer_ids=keep(cfg.dspark_target_layer_ids))
    return base.replace(**changes)


def pick_layers(base: ModelConfig, ids: Sequence[int]) -> ModelConfig:
    """``base``'s dimensions with the layers ``ids`` of its own structure, in that order (attention kind, compression
    ratio, hash routing each as in the preset; no MTP / DSpark blocks), e.g. V4-Flash ``(2,)`` for one CSA layer:
    to time one layer kind's share of a compile. V4.1 (layers that read other layers' caches) is refused."""
    if base.is_v41:
        raise ValueError("pick_layers takes V4 presets only: V4.1 layers read KV / index sources of other layers")
    if not ids or any(not 0 <= i < base.num_layers for i in ids):
        raise ValueError(f"layer ids {tuple(ids)} must be non-empty and within 0..{base.num_layers - 1}")
    pick = lambda xs: tuple(xs[i] for i in ids)  # noqa: E731
    return base.replace(num_layers=len(ids), attn_kinds=pick(base.attn_kinds),
                        compress_ratios=pick(base.compress_ratios), hash_layers=pick(base.hash_layers),
                        n_mtp_layers=0, mtp_compress_ratios=())


def engine_settings(q: int) -> tuple[str, dict, dict]:
    """What ``LLM`` compiles a ``q``-token bucket with on this backend, by default: ``(linear_impl, step XLA
    options, forward XLA options)``."""
    impl = resolve_linear_impl("auto")
    program, decode = step_program_options(None, None, impl)
    return impl, decode if q == 1 else program, program


def compile_seconds(cfg: ModelConfig, dtype: str, batch: int, q: int, seq: int, block_size: int,
                    weights: str = "dense", linear_impl: str = "xla", step_options: dict | None = None,
                    forward_options: dict | None = None, with_forward: bool = True) -> tuple[float, float]:
    """Seconds to lower + compile one serving step ``[batch, q]`` and the full forward ``[batch, seq]``
    (``weights="native"``: the release's FP8/FP4 weights as they stay on the device; ``linear_impl`` of the step's
    FP8 linears; ``step_options`` / ``forward_options``: XLA compiler options of each program, None = XLA's own;
    ``with_forward=False``: the step only, the forward's time is NaN)."""
    sds = jax.ShapeDtypeStruct
    params = jax.eval_shape(functools.partial(stack_params, cfg),
                            abstract_params(cfg, dtype, include_mtp=False, weights=weights))
    pages = -(-seq // block_size)
    cc = CacheConfig(num_slots=batch + 1, num_blocks=batch * pages + 1, block_size=block_size)
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    inp = StepInput(tokens=i32(batch, q), start=i32(batch), n=i32(batch), slot=i32(batch), pages=i32(batch, pages),
                    last=i32(batch))
    engram, lookup = (abstract_state(cfg), EngramLookup(cfg)) if cfg.engram_layer_ids else (None, None)
    step = jax.jit(functools.partial(model_step, cfg=cfg, dtype=dtype, engram_fn=lookup, linear_impl=linear_impl),
                   donate_argnums=(1,), compiler_options=step_options or None)
    t0 = time.perf_counter()
    step.lower(params, cache_shapes(cfg, cc, dtype), inp, engram=engram).compile()
    t_step = time.perf_counter() - t0
    if not with_forward:
        return t_step, float("nan")
    n_eng = len(cfg.engram_layer_ids)
    e_in = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    emb = sds((n_eng, batch, seq, e_in), jnp.dtype(dtype)) if n_eng else None
    fwd = jax.jit(functools.partial(forward, cfg=cfg, dtype=dtype, options=ForwardOptions()),
                  compiler_options=forward_options or None)
    t0 = time.perf_counter()
    fwd.lower(params, i32(batch, seq), engram_emb=emb).compile()
    return t_step, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-v4")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layout", default=None, help="take the layer structure from this preset (e.g. "
                    "deepseek-v4-flash with --preset tiny-v4: real layer kinds at tiny dimensions)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--q", type=int, default=64, help="serving-step bucket length (1 = decode)")
    ap.add_argument("--seq", type=int, default=256, help="full-forward length and pages per sequence")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--weights", default="dense", choices=["dense", "native"])
    ap.add_argument("--engine-defaults", action="store_true",
                    help="compile as LLM does here: its linear_impl and default XLA options (module docstring)")
    ap.add_argument("--step-only", action="store_true", help="skip the full forward's compile")
    args = ap.parse_args()
    impl, step_opts, fwd_opts = engine_settings(args.q) if args.engine_defaults else ("xla", {}, {})
    base = load_config(args.preset)
    layout = load_config(args.layout) if args.layout else None
    print(f"preset {args.preset}, layout {args.layout or args.preset}, {args.dtype}, {args.weights} weights, "
          f"step [{args.batch},{args.q}], "
          f"forward [{args.batch},{args.seq}], linear_impl {impl}, step options {step_opts or 'XLA'}, "
          f"forward options {fwd_opts or 'XLA'}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}\n")
    print("| layers | scan plan (start×period×repeats) | step compile s | forward compile s |")
    print("|---:|---|---:|---:|")
    times = {}
    for n in args.layers:
        cfg = first_layers(base, n, layout)
        plan = " ".join(f"{g.start}:{g.period}×{g.repeats}" for g in plan_layers(cfg))
        times[n] = compile_seconds(cfg, args.dtype, args.batch, args.q, args.seq, args.block_size, args.weights,
                                   impl, step_opts, fwd_opts, with_forward=not args.step_only)
        print(f"| {n} | {plan} | {times[n][0]:.2f} | {times[n][1]:.2f} |", flush=True)
    lo, hi = min(times), max(times)
    print(f"\nratio {hi}/{lo} layers: step {times[hi][0] / times[lo][0]:.2f}×, "
          f"forward {times[hi][1] / times[lo][1]:.2f}×")


if __name__ == "__main__":
    main()
