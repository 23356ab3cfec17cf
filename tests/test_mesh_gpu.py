"""Attention-DP engines and expert parallelism on two GPUs (``docs/dp_engines.md``; issue 10). Marked ``gpu``
(excluded from CI); run on ``nvidia-h200-x2`` with ``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu
tests/test_mesh_gpu.py``.

A small bf16 model whose MXFP4 experts fit the Mosaic GPU expert kernel (so the EP ranks run the kernel on their
own experts, pairs of the other rank taking no tile) must give, greedy, exactly the one-GPU engine's tokens:
``(1, 1, 2)`` (one engine on two copies, experts split) against the one-GPU engine on all prompts;
``(2, 1, 1)`` and ``(2, 1, 2)`` (two engines) against the one-GPU engine on each engine's own prompts
(round-robin), which then runs the same steps with the same shapes. Tokens, not a tolerance: each device computes
the same rows at the same shapes, and the EP combine sums a token's expert outputs in the one-device order.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.buckets import Buckets

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BATCH, PROMPT = 8, 24


def _gpus() -> list:
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs, found {len(gpus)}")
    return gpus


@pytest.fixture(scope="module")
def setup():
    from dinfer_jax.models import load_config, random_model
    from dinfer_jax.models.config import QuantConfig
    from dinfer_jax.models.expert_kernel import kernel_unsupported

    gpus = _gpus()
    cfg = load_config("tiny-v4").replace(quantization=QuantConfig((128, 128), "ue8m0", "fp4"), hidden_size=512,
                                         moe_inter_dim=512)
    with jax.default_device(gpus[0]):
        model = random_model(cfg, seed=5, include_mtp=False, weights="native", dtype="bfloat16")
    assert kernel_unsupported(model.params["layers"][0]["ffn"]["experts"], jax.numpy.bfloat16) is None
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, cfg.vocab_size, PROMPT).tolist() for _ in range(BATCH)]
    kw = dict(dtype="bfloat16", max_num_seqs=BATCH, max_model_len=64, max_num_batched_tokens=PROMPT, progress=False,
              buckets=Buckets(decode_batch=(BATCH // 2, BATCH), prefill_batch=(1,), prefill_len=(PROMPT,)),
              kv_cache_memory_bytes=1 << 30, decode_compiler_options={})
    single = LLM(model, **kw)
    ref = {1: [o.token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)], 2: [None] * BATCH}
    for e in range(2):
        ref[2][e::2] = [o.token_ids for o in single.generate(prompts[e::2], GREEDY, use_tqdm=False)]
    return model, prompts, ref, kw


@pytest.mark.parametrize("dp,ep", [(1, 2), (2, 1), (2, 2)])
def test_two_gpu_engines_give_one_gpu_tokens(setup, dp, ep):
    model, prompts, ref, kw = setup
    llm = LLM(model, dp_size=dp, ep_size=ep, **kw)
    compiled = llm.metrics()["compilations"]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == ref[dp]
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"
