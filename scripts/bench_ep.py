"""All-gather vs all-to-all expert-parallel dispatch on 8 forced CPU devices (one MoE layer's routed experts).

Usage::

    python scripts/bench_ep.py [--experts 32 --topk 4 --hidden 256 --inter 128 --ep 8 --reps 5]

Prints a Markdown table: median wall time per call of :func:`dinfer_jax.models.expert_parallel.ep_experts` for
decode- and prefill-sized token counts per EP group, both dispatches (lossless capacity). CPU timings only say how
the two compare on XLA:CPU's collectives (memory copies between host "devices"); they are no GPU prediction.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dinfer_jax.models.expert_parallel import ep_experts  # noqa: E402
from sharding import Sharder, make_mesh  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256, 1024, 4096],
                    help="tokens per EP group and step")
    args = ap.parse_args(argv)
    E, k, D, Inter, ep = args.experts, args.topk, args.hidden, args.inter, args.ep
    mesh = make_mesh(dp=ep, cp=1, ep=ep)
    key = jax.random.PRNGKey(0)
    experts = {"w1": jax.random.normal(key, (E, Inter, D)) * 0.05, "w3": jax.random.normal(key, (E, Inter, D)) * 0.05,
               "w2": jax.random.normal(key, (E, D, Inter)) * 0.05}
    print(f"E={E} k={k} D={D} I={Inter} ep={ep}, fp32, {len(jax.devices())} CPU devices\n")
    print("| tokens / EP group | all-gather ms | all-to-all ms | all-to-all, capacity 2·n·k/ep ms (rows dropped) |"
          " fastest lossless |")
    print("|---:|---:|---:|---:|---|")
    for n in args.tokens:
        x = jax.random.normal(key, (n, 1, D))
        idx = jax.random.randint(key, (n, 1, k), 0, E)
        w = jnp.full((n, 1, k), 1.0 / k)
        spec = Sharder(mesh).spec(("act_batch", "act_seq"), (n, 1))
        per_rank = max(1, n // ep)
        ms, dropped = {}, {}
        for name, dispatch, cap in (("allgather", "allgather", None), ("alltoall", "alltoall", None),
                                    ("capped", "alltoall", max(1, 2 * per_rank * k // ep))):
            fn = jax.jit(lambda x, i, w, d=dispatch, s=spec, c=cap: ep_experts(
                experts, x, i, w, mesh=mesh, token_spec=s, swiglu_limit=10.0, dispatch=d, capacity=c))
            dropped[name] = int(fn(x, idx, w)[1].sum())
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, idx, w))
                times.append(time.perf_counter() - t0)
            ms[name] = 1e3 * statistics.median(times)
        best = min(("allgather", "alltoall"), key=ms.get)
        print(f"| {n} | {ms['allgather']:.2f} | {ms['alltoall']:.2f} | {ms['capped']:.2f} ({dropped['capped']}) "
              f"| {best} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
