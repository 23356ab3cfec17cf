"""What a speculative step costs against a plain one on this backend (``docs/perf/speculative_cpu.md``).

Times the engine's own compiled programs on all-padding rows (a row's shape, not its content, sets the work) of
the bundled default model, or of a random real-dimension slice of a preset (``--preset deepseek-v4-flash
--layers 4``: native FP8/FP4 weights, bf16; V4 drafts with its MTP block, V4.1 with DSpark reading the slice's
last layers): the plain model step at ``[B, q]`` for q = 1, 2, 3, 5 (a verify row carries 1 + k query tokens),
the plain sampler, and the whole speculative step (model + verification + drafter) for k = 4 and 2 (with
``--widths``: for k = 4 at every decode width, the curve confidence-scheduled verification reads).
Speculation pays when ``E[tokens per row per step] / (speculative step / plain step + sampler)`` exceeds 1::

    python3 scripts/probe_spec_step.py [--batch 10] [--pages 16]
    JAX_PLATFORMS=cuda,cpu python3 scripts/probe_spec_step.py --preset deepseek-v4-flash --layers 4 --batch 64
    JAX_PLATFORMS=cuda,cpu python3 scripts/probe_spec_step.py --preset deepseek-v4-flash --layers 4 --batch 64 --kernels
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dinfer_jax import LLM  # noqa: E402
from dinfer_jax.engine.runner import Buckets, empty_inputs  # noqa: E402


def per_call_ms(fn: Callable[[], jax.Array], reps: int = 30) -> float:
    """Mean wall milliseconds of ``fn`` over ``reps`` calls, after two warm calls."""
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / reps


def drafting_slice(base, n: int):
    """The first ``n`` layers of ``base`` (:func:`first_layers`) with its drafter kept: V4's MTP block, or V4.1's
    DSpark layers reading the slice's last layers (as the full model's read its last ones)."""
    from bench_compile import first_layers  # scripts/ is on sys.path when run as a script

    if base.is_v41 and base.dspark_target_layer_ids:
        n_targets = len(base.dspark_target_layer_ids)
        if n < n_targets:
            raise ValueError(f"a V4.1 slice with DSpark needs at least {n_targets} layers, got {n}")
        base = base.replace(dspark_target_layer_ids=tuple(range(n - n_targets, n)))
    return first_layers(base, n).replace(n_mtp_layers=base.n_mtp_layers, mtp_compress_ratios=base.mtp_compress_ratios)


def k4_step(spec, B: int, P: int, temperature: float) -> Callable[[], jax.Array]:
    """One call of the engine's k = 4 speculative decode program on all-padding ``[B, 5]`` rows with ``P`` pages,
    every row sampled at ``temperature`` (returns the step's tokens)."""
    from dinfer_jax.sampling import SamplingParams

    inp, feed = empty_inputs(B, 5, P)
    samp = spec._sampling([SamplingParams(temperature=temperature)] * B, list(range(B)), [100] * B, B)
    return lambda: spec._call_spec(inp, feed, samp, (B, 5, P), True, *spec._spec_extra(B))[0]


def dispatch_table(model, method: str, buckets, kw: dict, B: int, P: int, what: str) -> None:
    """The k = 4 speculative step's dispatch against completion (``probe_cond_sync.time_dispatch``, median of 10)
    with the engine's own options, then with the decode programs' default options plus
    :data:`~dinfer_jax.engine.runner.GPU_SAMPLER_OPTIONS` given explicitly (the engine applies the latter to its
    speculative decode programs on a GPU since 2026-12-06, so on a GPU both rows now compile the same options), at
    temperature 0 and 1 (the draw's conditionals), tokens compared between the two."""
    from probe_cond_sync import time_dispatch  # scripts/ is on sys.path when run as a script

    from dinfer_jax.engine.llm import step_program_options
    from dinfer_jax.engine.runner import GPU_SAMPLER_OPTIONS

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {what}, batch {B}, {P} pages")
    print("| decode options | sampling | ms per call | returns after ms | done after ms | tokens |\n"
          "|---|---|---:|---:|---:|---|")
    reference: dict[str, np.ndarray] = {}
    base: dict = {}   # the decode programs' default options, read from the first engine
    for label, extra in (("engine defaults", {}), ("+ GPU_SAMPLER_OPTIONS", dict(GPU_SAMPLER_OPTIONS))):
        options = {"decode_compiler_options": {**base, **extra}} if extra else {}
        probe = LLM(model, buckets=buckets, speculative=method, num_speculative_tokens=4, **options, **kw)
        base = base or step_program_options(None, None, probe.model.linear_impl)[1]
        for temp in (0.0, 1.0):
            call = k4_step(probe.runner, B, P, temp)
            ret, done = time_dispatch(call, reps=10)
            toks = np.asarray(call())
            key = f"t={temp}"
            same = "—" if key not in reference else ("equal" if np.array_equal(toks, reference[key]) else "DIFFER")
            reference.setdefault(key, toks)
            print(f"| {label} | temperature {temp} | {per_call_ms(call, reps=10):.2f} | {ret:.2f} | {done:.2f} | "
                  f"{same} |", flush=True)
        del probe, call


def kernels_table(model, method: str, buckets, kw: dict, B: int, P: int, what: str, top: int = 25,
                  reps: int = 10) -> None:
    """Where the k = 4 speculative step's time goes at temperature 1 against greedy: each kernel's device ms and
    launches per call (CUPTI over ``reps`` back-to-back calls of the engine's own program,
    ``bench_serving.kernel_launches``), the kernels whose time grows most with sampling first, then the largest at
    temperature 1."""
    from bench_serving import kernel_launches  # scripts/ is on sys.path when run as a script

    spec = LLM(model, buckets=buckets, speculative=method, num_speculative_tokens=4, **kw).runner
    per_temp: dict[float, dict[str, tuple[float, float]]] = {}
    walls: dict[float, float] = {}
    for temp in (0.0, 1.0):
        call = k4_step(spec, B, P, temp)
        walls[temp] = per_call_ms(call, reps=reps)

        def run(call=call) -> None:
            out = None
            for _ in range(reps):
                out = call()
            jax.block_until_ready(out)

        launches = kernel_launches(run)
        if launches is None:
            return
        per_temp[temp] = {k: (ms / reps, n / reps) for k, (ms, n) in launches.items()}
    t0, t1 = per_temp[0.0], per_temp[1.0]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {what}, batch {B}, {P} pages, k = 4")
    print(f"wall ms per call: greedy {walls[0.0]:.2f}, temperature 1 {walls[1.0]:.2f}; kernel ms per call: greedy "
          f"{sum(v[0] for v in t0.values()):.2f} ({sum(v[1] for v in t0.values()):.0f} launches), temperature 1 "
          f"{sum(v[0] for v in t1.values()):.2f} ({sum(v[1] for v in t1.values()):.0f} launches)")

    def row(name: str) -> str:
        (a, _), (b, n) = t0.get(name, (0.0, 0.0)), t1.get(name, (0.0, 0.0))
        return f"| `{name[:90]}` | {a:.3f} | {b:.3f} | {b - a:+.3f} | {n:.1f} |"

    head = "| kernel | greedy ms | temperature 1 ms | difference | launches (t = 1) |\n|---|---:|---:|---:|---:|"
    names = set(t0) | set(t1)
    print("grown most with sampling:\n" + head)
    for name in sorted(names, key=lambda k: -(t1.get(k, (0.0, 0.0))[0] - t0.get(k, (0.0, 0.0))[0]))[:top]:
        print(row(name))
    print("largest at temperature 1:\n" + head)
    for name in sorted(t1, key=lambda k: -t1[k][0])[:top]:
        print(row(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--pages", type=int, default=16, help="page-table width of the bucket (16 tokens a page)")
    ap.add_argument("--preset", default=None, help="a real-dimension preset instead of the default model")
    ap.add_argument("--layers", type=int, default=4, help="with --preset: the slice's first layers")
    ap.add_argument("--widths", action="store_true",
                    help="also the k = 4 speculative step at every decode width 1..5 (the step-time curve that "
                         "confidence-scheduled verification chooses from, LLM(speculative_widths='all'))")
    ap.add_argument("--dispatch", action="store_true",
                    help="instead: whether the k = 4 speculative step blocks the host that dispatches it (its "
                         "verification and drafts sample under data-dependent conditionals), with the decode "
                         "programs' default XLA options and with runner.GPU_SAMPLER_OPTIONS added")
    ap.add_argument("--kernels", action="store_true",
                    help="instead: the k = 4 speculative step's kernels by device time at temperature 1 against "
                         "greedy (CUPTI; GPUs only)")
    args = ap.parse_args()
    B, P = args.batch, args.pages
    model, method, extra, what = "default", "dspark", {}, "default model"
    if args.preset:
        from dinfer_jax.models import random_model
        from dinfer_jax.models.config import load_config

        cfg = drafting_slice(load_config(args.preset), args.layers)
        model = random_model(cfg, dtype="bfloat16", include_mtp=True, weights="native")
        method = "dspark" if cfg.is_v41 else "mtp"
        extra = dict(dtype="bfloat16")
        what = f"{args.preset}, {args.layers} layers (random native weights, bf16), {method} drafts"

    def buckets(decode_len: int) -> Buckets:
        return Buckets(decode_batch=(B,), prefill_batch=(1,), prefill_len=(256,), pages=tuple(sorted({P, 16})),
                       decode_len=decode_len)

    # A fixed pool (1 GiB holds every row's 256 tokens many times over): the default plan sizes the pool from the
    # device memory left, so a second engine built while the first lives would find none left.
    kw = dict(max_num_seqs=B, max_model_len=256, progress=False, warmup=False, kv_cache_memory_bytes=1 << 30, **extra)
    if args.dispatch:
        return dispatch_table(model, method, buckets(5), kw, B, P, what)
    if args.kernels:
        return kernels_table(model, method, buckets(5), kw, B, P, what)
    plain = LLM(model, buckets=buckets(1), **kw).runner
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {what}, batch {B}, {P} pages")
    print("| program | shape | ms per call | vs plain [B, 1] step + sampler |\n|---|---|---:|---:|")
    rows = []
    for q in (1, 2, 3, 5):
        inp, feed = empty_inputs(B, q, P)

        def forward(inp=inp, feed=feed, q=q) -> jax.Array:
            logits, plain.cache = plain._forward(inp, feed, (B, q, P))
            return logits

        rows.append(("plain model step", f"[{B}, {q}]", per_call_ms(forward)))
    logits = forward()
    samp = plain._sampling([], [], [], B)
    rows.append(("plain sampler", f"[{B}]", per_call_ms(lambda: plain._sample(logits, samp, plain.full_mask(B))[0])))
    plain = logits = None  # release the plain engine (its pool and programs) before building the speculative ones
    for k in (4, 2):
        spec = LLM(model, buckets=buckets(1 + k), speculative=method, num_speculative_tokens=k, **kw).runner
        inp, feed = empty_inputs(B, 1 + k, P)
        s_samp = spec._sampling([], [], [], B)
        rows.append((f"speculative step, k={k}", f"[{B}, {1 + k}]", per_call_ms(
            lambda spec=spec, inp=inp, feed=feed, s_samp=s_samp, k=k: spec._call_spec(
                inp, feed, s_samp, (B, 1 + k, P), True, *spec._spec_extra(B))[0])))
        del spec
    if args.widths:
        spec = LLM(model, buckets=buckets(5), speculative=method, num_speculative_tokens=4, speculative_widths="all",
                   **kw).runner
        for q in range(1, 6):
            rows.append((f"speculative step, k=4, width {q}", f"[{B}, {q}]", spec.decode_time_ms(B, q, P, reps=10)))
        del spec
    base = rows[0][2] + rows[4][2]
    for name, shape, ms in rows:
        print(f"| {name} | {shape} | {ms:.2f} | {ms / base:.2f}× |")


if __name__ == "__main__":
    main()
