"""Where the compile time of a serving step goes (issue 8).

Lowers and compiles the serving step of a real-dimension slice with abstract weights, for each layer count, at a
decode bucket (``[batch, 1]``) and a prefill bucket (``[1, prefill]``), the two on a pool of threads as the
engine's warm-up does. Reports jax's own durations (trace, jaxpr -> MLIR, backend compile; summed over both
programs), each program's wall time, and the optimized HLO's fusion / while / custom-call counts. Run it under
different ``XLA_FLAGS`` (``--xla_gpu_autotune_level=0``, ...) to see what the backend spends its time on. Then
times the mHC Sinkhorn normalisation, unrolled (the model's form) against a ``lax.fori_loop`` form, on the device:
8 sites (a V4-Flash decode step has ~90 mHC sites) on ``[64, 1, 4, 4]`` and on ``[8192, 4, 4]``.

    python3 scripts/probe_compile.py --preset deepseek-v4-flash --layers 2 4
    python3 scripts/probe_compile.py --preset deepseek-v4-flash --layer-sets 0 0,2 0,3 --no-sinkhorn   # per kind

"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_compile import first_layers, pick_layers  # noqa: E402

from dinfer_jax.engine.model_step import model_step  # noqa: E402
from dinfer_jax.models import mhc  # noqa: E402
from dinfer_jax.models.config import load_config  # noqa: E402
from dinfer_jax.models.engram_lookup import EngramLookup, abstract_state  # noqa: E402
from dinfer_jax.models.layer_plan import stack_params  # noqa: E402
from dinfer_jax.models.params import abstract_params  # noqa: E402
from dinfer_jax.models.step_state import CacheConfig, StepInput, cache_shapes  # noqa: E402


def looped(comb_logits: jax.Array, iters: int, eps: float) -> jax.Array:
    c = jax.nn.softmax(comb_logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, c)


def chunked(comb_logits: jax.Array, iters: int, eps: float, every: int = 5) -> jax.Array:
    """The model's Sinkhorn with an optimisation barrier every ``every`` rounds (bounds each fusion's chain)."""
    c = jax.nn.softmax(comb_logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    for i in range(iters - 1):
        if i and i % every == 0:
            c = jax.lax.optimization_barrier(c)
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    return c


DURATIONS: dict[str, float] = collections.defaultdict(float)


def _listen(name: str, secs: float, **_: object) -> None:
    DURATIONS[name.rsplit("/", 1)[-1]] += secs


def compile_step(cfg, batch: int, q: int, pages: int, block: int, tile: int = 0, weights: str = "native",
                 mhc_impl: str = "auto") -> dict:
    """Lower and compile one serving-step bucket ``[batch, q]`` (``tile`` > 0: traced batch-invariantly with that
    token tile); wall seconds and optimized-HLO counts."""
    sds = jax.ShapeDtypeStruct
    params = jax.eval_shape(
        functools.partial(stack_params, cfg), abstract_params(cfg, "bfloat16", include_mtp=False, weights=weights)
    )
    cc = CacheConfig(num_slots=batch + 1, num_blocks=batch * pages + 1, block_size=block)
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    inp = StepInput(
        tokens=i32(batch, q), start=i32(batch), n=i32(batch), slot=i32(batch), pages=i32(batch, pages), last=i32(batch)
    )
    engram, lookup = (abstract_state(cfg), EngramLookup(cfg)) if cfg.engram_layer_ids else (None, None)
    step = jax.jit(functools.partial(model_step, cfg=cfg, dtype="bfloat16", engram_fn=lookup, batch_invariant=tile,
                                     mhc_impl=mhc_impl),
                   donate_argnums=(1,))
    t0 = time.perf_counter()
    lowered = step.lower(params, cache_shapes(cfg, cc, "bfloat16"), inp, engram=engram)
    t1 = time.perf_counter()
    hlo = lowered.compile().as_text()
    return dict(
        lower_s=round(t1 - t0, 1),
        compile_s=round(time.perf_counter() - t1, 1),
        fusions=hlo.count(" fusion("),
        whiles=hlo.count(" while("),
        custom_calls=hlo.count(" custom-call("),
        instructions=hlo.count("\n  "),
    )


def time_sinkhorn(fn, shape, sites: int = 8, reps: int = 20) -> tuple[float, float]:
    """(compile s, run ms) of ``sites`` independent Sinkhorn projections in one program."""
    xs = jax.random.normal(jax.random.key(0), (sites, *shape), jnp.float32)

    @jax.jit
    def run(xs):
        return [fn(xs[i], 20, 1e-6) for i in range(sites)]

    t0 = time.perf_counter()
    run = run.lower(xs).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(run(xs))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = run(xs)
    jax.block_until_ready(out)
    return compile_s, 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v4-flash")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layer-sets", nargs="+", default=None, metavar="IDS",
                    help="instead of --layers: slices of chosen layers, each a comma list of the preset's layer ids "
                         "(V4 presets; e.g. 0 0,2 0,3 for sliding only, with a CSA layer, with an HCA layer)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=8192, help="prefill bucket length (0: decode bucket only)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--no-sinkhorn", action="store_true", help="skip the Sinkhorn micro-benchmark")
    ap.add_argument("--override", action="append", default=[], metavar="FIELD=INT",
                    help="replace an integer config field (e.g. hc_sinkhorn_iters=1) to see its share of the compile")
    ap.add_argument("--batch-invariant", type=int, default=0, metavar="TILE",
                    help="trace the steps batch-invariantly with this token tile (docs/batch_invariance.md)")
    ap.add_argument("--mhc-impl", default="auto", choices=["auto", "jnp", "pallas"],
                    help="the mHC Sinkhorn: XLA (jnp), the Mosaic GPU kernel (pallas_kernels/mhc) or auto "
                         "(the kernel on a GPU)")
    ap.add_argument("--weights", default="native", choices=["native", "dense"],
                    help="the weights' form (tiny presets have no native quantization: dense)")
    args = ap.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_listen)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    if not args.no_sinkhorn:
        forms = [("model (XLA)", mhc.sinkhorn), ("looped", looped), ("barrier/5", chunked)]
        if jax.default_backend() == "gpu":
            forms.append(("kernel", functools.partial(mhc.sinkhorn, impl="pallas")))
        for shape in [(64, 1, 4, 4), (8192, 4, 4)]:
            for name, fn in forms:
                c, r = time_sinkhorn(fn, shape)
                print(f"sinkhorn x8 sites on {shape}, {name}: compile {c:.2f} s, run {r:.3f} ms", flush=True)
    base = load_config(args.preset)
    for item in args.override:
        field, value = item.split("=")
        base = base.replace(**{field: int(value)})
    pages = -(-max(args.prefill, 4096) // args.block) + 1
    buckets = [(args.batch, 1)] + ([(1, args.prefill)] if args.prefill else [])
    slices = ([(f"layers {ids}", pick_layers(base, [int(i) for i in ids.split(",")])) for ids in args.layer_sets]
              if args.layer_sets else [(f"layers {n}", first_layers(base, n)) for n in args.layers])
    for name, cfg in slices:
        DURATIONS.clear()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(buckets)) as pool:
            futs = {bq: pool.submit(compile_step, cfg, bq[0], bq[1], pages, args.block,
                                      args.batch_invariant, args.weights, args.mhc_impl) for bq in buckets}
            results = {bq: f.result() for bq, f in futs.items()}
        wall = time.perf_counter() - t0
        phases = {k: round(v, 1) for k, v in DURATIONS.items()}
        print(f"{name} ({', '.join(cfg.attn_kinds)}): wall {wall:.1f} s for {len(buckets)} programs; jax phases "
              f"(summed) {phases}", flush=True)
        for (b, q), r in results.items():
            print(f"  bucket [{b}, {q}]: {r}", flush=True)


if __name__ == "__main__":
    main()
