"""Which part of a two-GPU engine's step crashes XLA's GPU compiler (issue 10 triage).

Each variant builds a small bf16 model (tiny-v4 widened to 512 so the MXFP4 expert kernel fits) and constructs
``LLM(dp_size=, ep_size=)`` with warm-up (every program compiled) in its own subprocess, so a segmentation fault
ends only that variant; the parent prints each variant's exit status and the last lines it wrote.

    python scripts/probe_mesh_gpu.py            # every variant
    python scripts/probe_mesh_gpu.py --child dp2-kernels    # one variant, in this process
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name → (dp, ep, weights, mhc_impl, attention_impl, linear_impl)
VARIANTS = {
    "dp2-no-kernels": (2, 1, "dense", "jnp", "jnp", "xla"),
    "dp2-mhc-kernel": (2, 1, "dense", "pallas", "jnp", "xla"),
    "dp2-attn-kernel": (2, 1, "dense", "jnp", "pallas", "xla"),
    "dp2-expert-kernel": (2, 1, "native", "jnp", "jnp", "xla"),
    "dp2-kernels": (2, 1, "native", "auto", "auto", "xla"),
    "ep2-no-kernels": (1, 2, "dense", "jnp", "jnp", "xla"),
    "ep2-expert-kernel": (1, 2, "native", "jnp", "jnp", "xla"),
    "ep2-kernels": (1, 2, "native", "auto", "auto", "xla"),
}


BASIC = ("basic-sharded", "basic-psum", "basic-allgather", "basic-scan-psum")


def basic(name: str) -> None:
    """Plain two-device programs, no model: does multi-GPU compilation work at all?"""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    x = jax.device_put(jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128), NamedSharding(mesh, P("d")))
    if name == "basic-sharded":
        y = jax.jit(lambda a: a * 2 + 1)(x)
    elif name == "basic-psum":
        y = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
    elif name == "basic-allgather":
        y = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "d", tiled=True), mesh=mesh, in_specs=P("d"),
                                  out_specs=P("d")))(x)
    else:
        def body(a):
            return jax.lax.scan(lambda c, _: (jax.lax.psum(c, "d") * 0.5, None), a, None, length=3)[0]
        y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))(x)
    print(f"{name}: OK, sum {float(jnp.sum(y))}", flush=True)


def child(name: str) -> None:
    if name in BASIC:
        return basic(name)
    import jax

    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine.buckets import Buckets
    from dinfer_jax.models import load_config, random_model
    from dinfer_jax.models.config import QuantConfig

    dp, ep, weights, mhc, attn, linear = VARIANTS[name]
    cfg = load_config("tiny-v4").replace(quantization=QuantConfig((128, 128), "ue8m0", "fp4"), hidden_size=512,
                                         moe_inter_dim=512)
    model = random_model(cfg, seed=5, include_mtp=False, weights=weights, dtype="bfloat16")
    model = dataclasses.replace(model, mhc_impl=mhc, attention_impl=attn, linear_impl=linear)
    t0 = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", dp_size=dp, ep_size=ep, max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=16, progress=False, compile_threads=1, kv_cache_memory_bytes=1 << 30,
              buckets=Buckets(decode_batch=(4,), prefill_batch=(1,), prefill_len=(16,)))
    out = llm.generate([[5] * 16, [7] * 12], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    print(f"{name}: OK in {time.perf_counter() - t0:.1f} s, {jax.device_count()} devices, tokens "
          f"{[o.token_ids for o in out]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [*BASIC, *VARIANTS]
    ap.add_argument("--child", default=None, choices=names)
    ap.add_argument("--variants", nargs="+", default=names, choices=names)
    ap.add_argument("--xla-flags", nargs="+", default=[""], help="XLA_FLAGS values, each variant run under each")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    for name, flags in [(n, f) for f in args.xla_flags for n in args.variants]:
        t0 = time.perf_counter()
        env = {**os.environ, "XLA_FLAGS": flags}
        try:
            p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--child", name], capture_output=True,
                               text=True, timeout=args.timeout, env=env)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", (e.stdout or b"").decode() + (e.stderr or b"").decode()
        lines = [ln for ln in text.splitlines() if not ln.startswith(("W1", "I1")) and "cuda_timer" not in ln]
        keep = [ln for ln in lines if "OK" in ln or "Error" in ln or "error" in ln or "dinfer_jax/" in ln][-8:]
        print(f"== {name} [XLA_FLAGS={flags!r}]: rc {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        for ln in keep:
            print("   ", ln[:300], flush=True)


if __name__ == "__main__":
    main()
