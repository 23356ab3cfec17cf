"""What a speculative step costs against a plain one on this backend (``docs/perf/speculative_cpu.md``).

Times the engine's own compiled programs on all-padding rows of the bundled default model (a row's shape, not its
content, sets the work): the plain model step at ``[B, q]`` for q = 1, 2, 3, 5 (a verify row carries 1 + k query
tokens), the plain sampler, and the whole speculative step (model + verification + drafter) for k = 4 and 2.
Speculation pays when ``E[tokens per row per step] / (speculative step / plain step + sampler)`` exceeds 1::

    python3 scripts/probe_spec_step.py [--batch 10] [--pages 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--pages", type=int, default=16, help="page-table width of the bucket (16 tokens a page)")
    args = ap.parse_args()
    B, P = args.batch, args.pages

    def buckets(decode_len: int) -> Buckets:
        return Buckets(decode_batch=(B,), prefill_batch=(1,), prefill_len=(256,), pages=tuple(sorted({P, 16})),
                       decode_len=decode_len)

    kw = dict(max_num_seqs=B, max_model_len=256, progress=False, warmup=False)
    plain = LLM("default", buckets=buckets(1), **kw).runner
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; default model, batch {B}, {P} pages")
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
    for k in (4, 2):
        spec = LLM("default", buckets=buckets(1 + k), speculative="dspark", num_speculative_tokens=k, **kw).runner
        inp, feed = empty_inputs(B, 1 + k, P)
        s_samp = spec._sampling([], [], [], B)
        rows.append((f"speculative step, k={k}", f"[{B}, {1 + k}]", per_call_ms(
            lambda spec=spec, inp=inp, feed=feed, s_samp=s_samp, k=k: spec._call_spec(
                inp, feed, s_samp, (B, 1 + k, P), True, *spec._spec_extra(B))[0])))
    base = rows[0][2] + rows[4][2]
    for name, shape, ms in rows:
        print(f"| {name} | {shape} | {ms:.2f} | {ms / base:.2f}× |")


if __name__ == "__main__":
    main()
