"""One process of the multi-process engine test (tests/test_multiprocess.py): joins a ``jax.distributed`` job on
localhost with its own CPU devices, runs greedy ``LLM.generate`` with attention-DP engines over the global mesh,
and writes the tokens as JSON. Every process builds the same model (same seed) and submits the same prompts.

    python tests/multiprocess_worker.py --process-id 0 --num-processes 2 --port 12355 --out out0.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path

LENGTHS = [5, 23, 41, 12, 30]  # as tests/test_dp_engines.py: chunked prefill, uneven work over the engines
MAX_TOKENS = 12
LLM_KW = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, progress=False)


def model_and_prompts():
    """The tiny random V4 model and the mixed-length prompts every process (and the reference) uses."""
    import numpy as np

    from dinfer_jax.models import load_config, random_model

    cfg = load_config("tiny-v4")
    model = random_model(cfg, seed=3, std=0.1, include_mtp=False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, size=n)] for n in LENGTHS]
    return model, prompts


def buckets():
    from dinfer_jax.engine.runner import Buckets

    return Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--devices", type=int, default=4, help="CPU devices of this process")
    ap.add_argument("--layout", type=int, nargs=3, default=[2, 1, 8], metavar=("DP", "CP", "EP"))
    ap.add_argument("--redundant-experts", type=int, default=None, help="EPLB: num_redundant_experts")
    ap.add_argument("--eplb-interval", type=int, default=None)
    ap.add_argument("--checkpoint", default=None,
                    help="serve this checkpoint directory (read straight onto the global mesh) instead of the "
                         "random model")
    ap.add_argument("--device-memory-bytes", type=int, default=None,
                    help="plan the engines' KV pools against this much memory per device (LLM(device_memory_bytes=))")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hang-seconds", type=float, default=float(os.environ.get("HANG_S", 540)),
                    help="print every thread's Python stack and exit after this long (a collective that never meets; "
                         "default: $HANG_S or 540)")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["DINFER_JAX_COMPILATION_CACHE"] = "off"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id)
    from dinfer_jax import LLM, SamplingParams

    model, prompts = model_and_prompts()
    dp, cp, ep = args.layout
    llm = LLM(args.checkpoint or model, dp_size=dp, cp_size=cp, ep_size=ep, buckets=buckets(),
              num_redundant_experts=args.redundant_experts, eplb_interval=args.eplb_interval,
              device_memory_bytes=args.device_memory_bytes, **LLM_KW)
    compiled = llm.metrics()["compilations"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    plan = llm.memory_plan
    result = dict(process_id=jax.process_index(), process_count=jax.process_count(),
                  kv_bytes=None if plan is None else plan.kv_bytes, num_blocks=llm.cache_config.num_blocks,
                  global_devices=len(jax.devices()), local_devices=len(jax.local_devices()),
                  mesh_processes=sorted({d.process_index for d in llm.runner.mesh.devices.flat}),
                  tokens=[o.token_ids for o in outs], finish=[o.finish_reason for o in outs],
                  compiled_after_warmup=llm.metrics()["compilations"] - compiled,
                  eplb_rebalances=llm.metrics()["eplb_rebalances"])
    Path(args.out).write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
