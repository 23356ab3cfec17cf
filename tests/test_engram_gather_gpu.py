"""Engram gather kernel (Mosaic GPU, ``pallas_kernels/engram/gather_sm90.py``) on an H100/H200, tables in device
memory and in pinned host memory. Marked ``gpu`` (excluded from CI); run with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu -q tests/test_engram_gather_gpu.py``.

References: NumPy indexing of the host table (the kernel moves bits: equality, no tolerance); the host gather
``EngramTable.gather`` for the lookup (as tests/test_engram_lookup.py); the engine with device-placed tables for
the served tokens (same programs but the gather, whose values are bit-identical).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import gpu_device
from pallas_kernels.engram.gather_sm90 import gather_lines

pytestmark = pytest.mark.gpu


def _placed(table: np.ndarray, memory_kind: str):
    return jax.device_put(table, jax.sharding.SingleDeviceSharding(gpu_device(), memory_kind=memory_kind))


@pytest.mark.parametrize("memory_kind", ["device", "pinned_host"])
@pytest.mark.parametrize("width,n,group", [(128, 1536, 8), (128, 7, 8), (256, 300, 4), (128, 1, 1)])
def test_kernel_gathers_the_lines(memory_kind, width, n, group):
    rng = np.random.default_rng(width + n)
    table = rng.integers(-2**31, 2**31 - 1, size=(5000, width), dtype=np.int64).astype(np.int32)
    ids = rng.integers(0, len(table), size=n).astype(np.int32)
    ids[:2] = [0, len(table) - 1][:n]
    t = _placed(table, memory_kind)
    assert t.sharding.memory_kind == memory_kind
    fn = jax.jit(lambda t, i: gather_lines(t, i, group=group) + 0)   # the kernel inside a larger program
    d_ids = jax.device_put(ids, gpu_device())
    compiled = fn.lower(t, d_ids).compile()
    if memory_kind == "pinned_host":   # the host pointer reaches the kernel: no copy of the table to the device
        text = compiled.as_text()
        assert "copy-start" not in text
    np.testing.assert_array_equal(np.asarray(compiled(t, d_ids)), table[ids])


@pytest.mark.parametrize("kind", ["fp8", "fp32"])
def test_lookup_reads_host_line_tables_on_the_device(kind):
    """``EngramLookup(placement="host-direct")`` with the tables in pinned host memory = the host pipeline, bit for
    bit."""
    from dinfer_jax.models.engram import engram_hash
    from dinfer_jax.models.engram_lookup import EngramLookup, place_tables
    from test_engram_lookup import _tables

    cfg, tables = _tables(kind)
    placed = place_tables(tables, "host-direct")
    assert {a.sharding.memory_kind for a in jax.tree.leaves(placed)} == {"pinned_host"}
    rows = np.random.default_rng(2).integers(0, cfg.engram_compressed_vocab_size,
                                             size=(64, 3, cfg.engram_max_ngram_size))
    got = np.asarray(jax.jit(EngramLookup(cfg, placement="host-direct"))(
        placed, jax.device_put(jnp.asarray(rows, jnp.int32), gpu_device())))
    ids = engram_hash(cfg, rows)
    want = np.stack([t.gather(ids[i]).reshape(*rows.shape[:-1], -1) for i, t in enumerate(tables)])
    np.testing.assert_array_equal(got, want)


def test_engine_with_host_direct_tables_serves_the_device_placements_tokens():
    """A V4.1 engine with ``engram_tables="host-direct"`` gives the device placement's greedy tokens, compiles
    nothing after warm-up, and its steps hold no host computation (no launch thread needed)."""
    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine.runner import Buckets
    from dinfer_jax.models import load_config, random_model

    gpu_device()
    model = random_model(load_config("tiny-v41"), seed=3, std=0.1, include_mtp=False)
    buckets = Buckets(decode_batch=(2,), prefill_batch=(2,), prefill_len=(32,), pages=(4,))
    # a fixed cache budget: after earlier tests in the same process the H200 reported 90% of its memory in use
    # (memory_stats' bytes_in_use), which left the memory plan nothing to size the cache from
    kw = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, progress=False, buckets=buckets,
              kv_cache_memory_bytes=1 << 28)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(4, model.config.vocab_size, size=n)] for n in (9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for where in ("device", "host-direct"):
        llm = LLM(model, engram_tables=where, **kw)
        assert not llm.launch_thread
        if where == "host-direct":
            text = llm.runner._lower_step((2, 1, 4), True).as_text()
            assert '"pinned_host"' in text and "device_host" not in text
        compiled = llm.metrics()["compilations"]
        tokens[where] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.metrics()["compilations"] == compiled, f"{where}: compiled outside warm-up"
    assert tokens["host-direct"] == tokens["device"]
