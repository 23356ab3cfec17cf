"""Where the Python time of lowering a serving step goes (issue 8: the warm-up's lowerings run one after another on
the calling thread, ~40 s for the 8 programs of a 4-layer V4-Flash slice on the H200 host, so they bound the cold
warm-up). Builds the engine of ``bench_serving.py``'s lean buckets without warming up, then lowers each step
program the warm-up would (decode page widths first, then prefill) under ``cProfile``: seconds per program, and the
functions taking the most time over all of them (cumulative and own).

    python3 scripts/probe_lowering.py --preset deepseek-v4-flash --layers 4 --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402


def main() -> None:
    from bench_compile import first_layers

    from dinfer_jax import LLM
    from dinfer_jax.engine.buckets import Buckets
    from dinfer_jax.models import random_model
    from dinfer_jax.models.config import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v4-flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--weights", default="native", choices=["native", "dense"])
    args = ap.parse_args()
    cfg = first_layers(load_config(args.preset), args.layers)
    if cfg.is_v41:
        cfg = cfg.replace(engram_layer_ids=(), engram_num_embeddings=())
    model = random_model(cfg, dtype="bfloat16", include_mtp=False, weights=args.weights)
    buckets = Buckets(decode_batch=(args.batch,), prefill_batch=(1,), prefill_len=(args.prefill_tokens,))
    llm = LLM(model, dtype="bfloat16", max_num_seqs=args.batch, max_model_len=args.prefill_tokens + 64,
              max_num_batched_tokens=args.prefill_tokens, kv_cache_memory_bytes=8 << 30, progress=False,
              buckets=buckets, warmup=False)
    runner = llm.runner
    decode = set(llm.buckets.decode_shapes())
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; linear_impl {llm.model.linear_impl}", flush=True)
    prof = cProfile.Profile()
    for shape in llm.buckets.shapes():
        t0 = time.perf_counter()
        prof.enable()
        runner._lower_step(shape, shape in decode)
        prof.disable()
        print(f"lowered {'decode' if shape in decode else 'prefill'} {list(shape)} in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(f"--- by {key} ---")
        print("\n".join(line[:200] for line in out.getvalue().splitlines()[6:]), flush=True)


if __name__ == "__main__":
    main()
