"""Attention-DP engines and expert parallelism on two GPUs (``docs/dp_engines.md``; issue 10). Marked ``gpu``
(excluded from CI); run on ``nvidia-h200-x2`` with ``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu
tests/test_mesh_gpu.py``.

* fp32, dense weights (the CPU tests' setting, ``tests/test_dp_engines.py``): ``(1, 1, 2)``, ``(2, 1, 1)`` and
  ``(2, 1, 2)`` give the one-GPU engine's greedy tokens.
* bf16 with MXFP4 experts that fit the Mosaic GPU expert kernel (each EP rank runs the kernel on its own experts;
  the other rank's pairs take no tile): the two-engine layouts ``(2, 1, 1)`` and ``(2, 1, 2)`` against the one-GPU
  engine serving each engine's own prompts (round-robin), which runs the same steps at the same shapes, so tokens
  must be equal bit for bit (the kernel's rows do not depend on which other rows share its tiles, and the EP
  combine adds a token's choices in the one-device order: ``tests/test_moe_kernel_gpu.py``). ``(1, 1, 2)`` is
  not compared in bf16: it splits the engine's MoE tokens over its two copies, so the router and shared-expert
  GEMMs run at half the rows and may round differently (its fp32 case is above; ``scripts/bench_mesh.py`` reports
  where a bf16 run's tokens part and the reference's top-2 gap there).

On CPU (jax 0.11.2, two forced devices, the ``jnp`` expert path instead of the kernel) the fp32 cases and the bf16
``(2, 1, 1)`` pass; bf16 ``(2, 1, 2)`` does not there, as XLA:CPU's grouped GEMM rounds a row differently at the
EP rank's row count — the GPU case rests on the kernel's row independence.
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


def _kw(dtype: str) -> dict:
    return dict(dtype=dtype, max_num_seqs=BATCH, max_model_len=64, max_num_batched_tokens=PROMPT, progress=False,
                buckets=Buckets(decode_batch=(BATCH // 2, BATCH), prefill_batch=(1,), prefill_len=(PROMPT,)),
                kv_cache_memory_bytes=1 << 30, decode_compiler_options={})


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _references(model, prompts: list[list[int]], dtype: str) -> dict:
    """One GPU's tokens on all prompts (key 1) and on each of two engines' prompts (key 2)."""
    single = LLM(model, **_kw(dtype))
    ref = {1: _tokens(single, prompts), 2: [None] * BATCH}
    for e in range(2):
        ref[2][e::2] = _tokens(single, prompts[e::2])
    return ref


@pytest.fixture(scope="module")
def prompts():
    _gpus()
    from dinfer_jax.models import load_config

    rng = np.random.default_rng(1)
    return [rng.integers(4, load_config("tiny-v4").vocab_size, PROMPT).tolist() for _ in range(BATCH)]


@pytest.fixture(scope="module")
def fp32_setup(prompts):
    from dinfer_jax.models import load_config, random_model

    with jax.default_device(_gpus()[0]):
        model = random_model(load_config("tiny-v4"), seed=3, std=0.1, include_mtp=False)
    return model, _references(model, prompts, "float32")


@pytest.fixture(scope="module")
def kernel_setup(prompts):
    from dinfer_jax.models import load_config, random_model
    from dinfer_jax.models.config import QuantConfig
    from dinfer_jax.models.expert_kernel import kernel_unsupported

    cfg = load_config("tiny-v4").replace(quantization=QuantConfig((128, 128), "ue8m0", "fp4"), hidden_size=512,
                                         moe_inter_dim=512)
    with jax.default_device(_gpus()[0]):
        model = random_model(cfg, seed=5, include_mtp=False, weights="native", dtype="bfloat16")
    assert kernel_unsupported(model.params["layers"][0]["ffn"]["experts"], jax.numpy.bfloat16) is None
    return model, _references(model, prompts, "bfloat16")


@pytest.mark.parametrize("dp,ep", [(1, 2), (2, 1), (2, 2)])
def test_two_gpu_engines_give_one_gpu_tokens_fp32(fp32_setup, prompts, dp, ep):
    model, ref = fp32_setup
    llm = LLM(model, dp_size=dp, ep_size=ep, **_kw("float32"))
    compiled = llm.metrics()["compilations"]
    assert _tokens(llm, prompts) == ref[dp]
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"


@pytest.mark.parametrize("dp,ep", [(2, 1), (2, 2)])
def test_two_gpu_kernel_engines_give_one_gpu_tokens(kernel_setup, prompts, dp, ep):
    model, ref = kernel_setup
    llm = LLM(model, dp_size=dp, ep_size=ep, **_kw("bfloat16"))
    assert _tokens(llm, prompts) == ref[2]

