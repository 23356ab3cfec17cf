"""Where the compile time of a serving step goes, and whether the mHC Sinkhorn loop form matters (issue 8).

For each layer count and each Sinkhorn form (``unrolled``: the Python loop the model uses; ``looped``: the same
rounds under ``lax.fori_loop``), lowers and compiles one decode step bucket of a real-dimension slice with
abstract weights, and reports jax's own durations (trace, jaxpr -> MLIR, backend compile), the optimized HLO's
fusion and loop counts. Then times the two Sinkhorn forms alone on the device: 8 sites (a V4-Flash decode step has
~90 mHC sites) on ``[64, 1, 4, 4]`` and on ``[8192, 4, 4]``.

    python3 scripts/probe_compile.py --preset deepseek-v4-flash --layers 2 4
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_compile import _engram_stub, first_layers  # noqa: E402

from dinfer_jax.engine.model_step import model_step  # noqa: E402
from dinfer_jax.models import mhc  # noqa: E402
from dinfer_jax.models.config import load_config  # noqa: E402
from dinfer_jax.models.layer_plan import stack_params  # noqa: E402
from dinfer_jax.models.params import abstract_params  # noqa: E402
from dinfer_jax.models.step_state import CacheConfig, StepInput, cache_shapes  # noqa: E402

UNROLLED = mhc.sinkhorn


def looped(comb_logits: jax.Array, iters: int, eps: float) -> jax.Array:
    c = jax.nn.softmax(comb_logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, c)


DURATIONS: dict[str, float] = collections.defaultdict(float)


def _listen(name: str, secs: float, **_: object) -> None:
    DURATIONS[name.rsplit("/", 1)[-1]] += secs


def compile_step(cfg, batch: int, q: int, pages: int, block: int) -> dict:
    sds = jax.ShapeDtypeStruct
    params = jax.eval_shape(functools.partial(stack_params, cfg),
                            abstract_params(cfg, "bfloat16", include_mtp=False, weights="native"))
    cc = CacheConfig(num_slots=batch + 1, num_blocks=batch * pages + 1, block_size=block)
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    inp = StepInput(tokens=i32(batch, q), start=i32(batch), n=i32(batch), slot=i32(batch), pages=i32(batch, pages),
                    last=i32(batch))
    step = jax.jit(functools.partial(model_step, cfg=cfg, dtype="bfloat16",
                                     engram_fn=functools.partial(_engram_stub, cfg)), donate_argnums=(1,))
    DURATIONS.clear()
    t0 = time.perf_counter()
    exe = step.lower(params, cache_shapes(cfg, cc, "bfloat16"), inp, cmap=None).compile()
    total = time.perf_counter() - t0
    hlo = exe.as_text()
    return dict(total=total, **{k: round(v, 2) for k, v in DURATIONS.items()}, fusions=hlo.count(" fusion("),
                whiles=hlo.count(" while("), custom_calls=hlo.count(" custom-call("))


def time_sinkhorn(fn, shape, sites: int = 8, reps: int = 20) -> float:
    xs = jax.random.normal(jax.random.key(0), (sites, *shape), jnp.float32)

    @jax.jit
    def run(xs):
        return [fn(xs[i], 20, 1e-6) for i in range(sites)]

    jax.block_until_ready(run(xs))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = run(xs)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v4-flash")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pages", type=int, default=65)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_listen)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}", flush=True)
    for shape in [(64, 1, 4, 4), (8192, 4, 4)]:
        a, b = time_sinkhorn(UNROLLED, shape), time_sinkhorn(looped, shape)
        print(f"sinkhorn x8 sites on {shape}: unrolled {a:.3f} ms, looped {b:.3f} ms", flush=True)
    base = load_config(args.preset)
    for n in args.layers:
        for name, fn in (("unrolled", UNROLLED), ("looped", looped)):
            mhc.sinkhorn = fn
            r = compile_step(first_layers(base, n), args.batch, 1, args.pages, args.block)
            print(f"layers {n} sinkhorn {name}: {r}", flush=True)
    mhc.sinkhorn = UNROLLED


if __name__ == "__main__":
    main()
