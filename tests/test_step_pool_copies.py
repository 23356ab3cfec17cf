"""The compiled serving step updates the paged caches in place: no copy of a page pool.

XLA simplifies a one-index scatter (a batch-1 decode step writes one compressed row) into a dynamic-update-slice
and, if nothing prevents it, fuses that update into the gather that reads the written pool next; the fused gather
then reads the old pool while the update writes the new one in place, so XLA copies the whole pool twice per step
(found on CPU: 65 ms instead of 3 ms for the default model's batch-1 decode step; ``cache_io.pages_write`` now keeps
such writes scatters). Checked on the optimised HLO of the step at batch 1 and 2, one and two query tokens,
for V4.1 (compressed KV and index-key pools) and V4 (compressed KV and CSA index-key pools).

Second way to copy a pool: XLA:CPU has no bf16 scatter, so its float normalisation widens a bf16 pool to f32 around
the write and narrows it back — two conversions of the whole pool per step (found on CPU: a batch-8 decode step of
a 2-layer tiny-v4 slice in bf16 took 307 ms with a 1 GiB pool, 18 ms with 64 MiB, 0.3 ms in fp32). So the bf16
cases also require that no array of a pool's shape appears in another element type.
"""

from __future__ import annotations

import re

import pytest

from dinfer_jax import LLM
from dinfer_jax.engine.runner import Buckets, empty_inputs
from dinfer_jax.models import load_config, random_model

POOL_COPY = re.compile(r"copy\(%cache_layers_\d+__\d+__(ckv|ik|ikv)\b")
POOL_PARAM = re.compile(r"%?(cache_layers_\d+__\d+__(?:ckv|ik|ikv))(?:\.\d+)?: (\w+)\[([\d,]+)\]")


def retyped_pools(text: str) -> list[str]:
    """Arrays of a page pool's exact shape in another element type anywhere in the optimised HLO ``text``: a
    widened copy of the whole pool (a pool's page count makes its dimensions specific enough not to collide; the
    small per-slot rings are left out, as a batch's gathered ring rows can share their shape)."""
    found = set()
    for name, dtype, dims in {m.groups() for m in POOL_PARAM.finditer(text)}:
        for other in re.findall(r"(?<![\w.])(\w+)\[" + dims + r"\]", text):
            if other != dtype:
                found.add(f"{name}: {dtype}[{dims}] also as {other}")
    return sorted(found)


@pytest.mark.parametrize("preset,batch,q,dtype", [
    ("tiny-v41", 1, 1, "float32"),     # one compressed row written (ratio 2): failed before the fix
    ("tiny-v4", 1, 1, "float32"),      # ratio 4: one row per step at one or two query tokens, both failed before it
    ("tiny-v4", 1, 2, "float32"),
    ("tiny-v41", 2, 1, "float32"),     # two rows: a scatter all along
    ("tiny-v4", 8, 1, "bfloat16"),     # bf16 pools (V4's exact cache; V4.1's are bytes): widened to f32 around
    ("tiny-v4", 1, 1, "bfloat16"),     # the write on CPU, all three failed before the pools were held as bits
    ("tiny-v4", 1, 2, "bfloat16"),
])
def test_step_copies_no_page_pool(preset, batch, q, dtype):
    model = random_model(load_config(preset), seed=0, include_mtp=False, dtype=dtype)
    buckets = Buckets(decode_batch=(batch,), prefill_batch=(1,), prefill_len=(64,), pages=(4,), decode_len=q)
    runner = LLM(model, buckets=buckets, max_num_seqs=batch, max_model_len=64, max_num_batched_tokens=64,
                 progress=False, warmup=False, dtype=dtype,
                 kv_cache_memory_bytes=1 << 24).runner
    inp, feed = empty_inputs(batch, q, 4)
    text = runner._programs.forward.lower(*runner._forward_args(inp, feed),
                                          **runner._forward_kw(False)).compile().as_text()
    assert "cache_layers" in text, "the step's cache parameters are no longer named as this test expects"
    copies = sorted({m.group(0) for m in POOL_COPY.finditer(text)})
    assert not copies, copies
    assert POOL_PARAM.search(text), "the step's pool parameters are no longer declared as this test expects"
    assert not retyped_pools(text)
