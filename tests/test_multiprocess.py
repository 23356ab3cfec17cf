"""The attention-DP engine across processes (issue 10, item 5): two ``jax.distributed`` processes on localhost with
four CPU devices each form one 8-device mesh; ``dp=2, cp=1, ep=8`` puts engine 0 on the first process's devices
and engine 1 on the second's, with the experts (and their token exchange) spread over both. Every process runs the
same scheduler over the same requests; each must return exactly the one-device engine's greedy tokens. The engines
run with EPLB (8 redundant slots, a rebalance every 3 mesh steps), so the expert placements also move across
processes mid-run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from dinfer_jax import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multiprocess_worker as worker  # noqa: E402

WORKER = Path(worker.__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path: Path, *extra: str) -> list[dict]:
    """Both processes of the job (8 redundant expert slots, a rebalance every 3 mesh steps); their JSON results."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--process-id", str(i), "--num-processes", "2",
                               "--port", str(port), "--redundant-experts", "8", "--eplb-interval", "3",
                               "--out", str(tmp_path / f"out{i}.json"), *extra],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:  # a worker that hangs dumps its stacks and exits after 540 s (--hang-seconds)
            logs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            p.kill()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]   # every process's log: the first to fail
    assert not failed, "\n".join(f"process {i} (exit {procs[i].returncode}):\n{logs[i][-3000:]}" for i in range(2))
    return [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]


def _check(results: list[dict], ref: list[list[int]], n_prompts: int) -> None:
    for i, got in enumerate(results):
        assert (got["process_id"], got["process_count"]) == (i, 2)
        assert (got["global_devices"], got["local_devices"]) == (8, 4)
        assert got["mesh_processes"] == [0, 1]          # the mesh really spans both processes
        assert got["finish"] == ["length"] * n_prompts
        assert got["tokens"] == ref, f"process {i}"
        assert got["compiled_after_warmup"] == 0
        assert got["eplb_rebalances"] >= 4


def _reference(model) -> tuple[list[list[int]], int]:
    _, prompts = worker.model_and_prompts()
    single = LLM(model, buckets=worker.buckets(), **worker.LLM_KW)
    return [o.token_ids for o in single.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=worker.MAX_TOKENS, ignore_eos=True),
        use_tqdm=False)], len(prompts)


def test_two_processes_give_the_single_device_tokens(tmp_path):
    results = _run_workers(tmp_path)
    _check(results, *_reference(worker.model_and_prompts()[0]))


def test_two_processes_load_a_checkpoint_onto_the_global_mesh(tmp_path):
    """The same job serving a checkpoint directory: each process reads it straight onto the global mesh in scan
    layout (its own devices' shards of the routed experts; LLM's engine_sharder), plans the engines' KV pools
    against 64 MiB per device (both processes must plan alike: one program), and both give the one-device engine's
    tokens on that checkpoint."""
    from dinfer_jax.loading.writer import write_release_checkpoint

    model = worker.model_and_prompts()[0]
    ckpt = tmp_path / "ckpt"
    write_release_checkpoint(model.config, model.params, ckpt)
    results = _run_workers(tmp_path, "--checkpoint", str(ckpt), "--device-memory-bytes", str(1 << 26))
    _check(results, *_reference(str(ckpt)))
    assert results[0]["kv_bytes"] is not None and results[0]["kv_bytes"] > 0
    assert (results[0]["kv_bytes"], results[0]["num_blocks"]) == (results[1]["kv_bytes"], results[1]["num_blocks"])
