"""The compiled serving step updates the paged caches in place: no copy of a page pool.

XLA simplifies a one-index scatter (a batch-1 decode step writes one compressed row) into a dynamic-update-slice
and, if nothing prevents it, fuses that update into the gather that reads the written pool next; the fused gather
then reads the old pool while the update writes the new one in place, so XLA copies the whole pool twice per step
(found on CPU: 65 ms instead of 3 ms for the default model's batch-1 decode step; ``cache_io.pages_write`` now keeps
such writes scatters). Checked on the optimised HLO of the step at batch 1 and 2, one and two query tokens,
for V4.1 (compressed KV and index-key pools) and V4 (compressed KV and CSA index-key pools).
"""

from __future__ import annotations

import re

import pytest

from dinfer_jax import LLM
from dinfer_jax.engine.runner import Buckets, empty_inputs
from dinfer_jax.models import load_config, random_model

POOL_COPY = re.compile(r"copy\(%cache_layers_\d+__\d+__(ckv|ik|ikv)\b")


@pytest.mark.parametrize("preset,batch,q", [
    ("tiny-v41", 1, 1),     # one compressed row written (ratio 2): failed before the fix
    ("tiny-v4", 1, 1),      # ratio 4: one row per step at one or two query tokens, both failed before the fix
    ("tiny-v4", 1, 2),
    ("tiny-v41", 2, 1),     # two rows: a scatter all along
])
def test_step_copies_no_page_pool(preset, batch, q):
    model = random_model(load_config(preset), seed=0, include_mtp=False)
    buckets = Buckets(decode_batch=(batch,), prefill_batch=(1,), prefill_len=(64,), pages=(4,), decode_len=q)
    runner = LLM(model, buckets=buckets, max_num_seqs=batch, max_model_len=64, max_num_batched_tokens=64,
                 progress=False, warmup=False,
                 kv_cache_memory_bytes=1 << 24).runner
    inp, feed = empty_inputs(batch, q, 4)
    text = runner._programs.forward.lower(*runner._forward_args(inp, feed),
                                          **runner._forward_kw(False)).compile().as_text()
    assert "cache_layers" in text, "the step's cache parameters are no longer named as this test expects"
    copies = sorted({m.group(0) for m in POOL_COPY.finditer(text)})
    assert not copies, copies
