"""Deterministic, batch-invariant sampling (docs/spec/engine.md §7), ported from DeepInfer.

* :class:`SamplingParams` — per-request options (validated, frozen).
* :class:`SamplingTensors` — their per-row device form (a pytree), built by ``SamplingTensors.from_params``.
* :func:`sample` — logits -> tokens + logprobs: temperature -> top-p -> top-k -> (min-p) -> log-softmax -> sample.
* :func:`fused_sample` — DeepInfer's ``fused_sample_ref``: the same filtering and sampling plus per-row speculative
  verification of draft tokens (acceptance test, residual resample, ``accept_probs``; see ``verify.py``).
* :func:`random_sampling` — DeepInfer's counter-hash CDF sampler, token-for-token equal to ``random_sampling_ref``
  without enabling x64 (uint32-pair integers and exactly rounded emulated fp64; see ``random.py``).

Modules: ``params.py`` (options, seeds, positions), ``sampler.py`` (filtering, logprobs, :func:`sample`),
``random.py`` (hash + exact CDF inversion), ``verify.py`` (:func:`fused_sample`), ``_fastcdf.py``
(vocabulary-parallel certified CDF search), ``_f64.py`` / ``_u64.py`` (emulated binary64 / uint64 arithmetic on
uint32 lanes).
"""

from .params import (
    DRAFT_POS_HASH_MUL,
    MTP_SEED_OFFSET,
    SAMPLING_EPS,
    SamplingParams,
    SamplingTensors,
    draft_positions,
    draw_seed,
)
from .random import (
    CASE_ACCEPT,
    CASE_RESAMPLE,
    CASE_SAMPLE,
    acceptance_u53,
    random_sampling,
    seeds_to_u64,
    u53_to_f32,
    uniform_u53,
)
from .sampler import SampleLogprobs, min_p_mask, process_logits, processed_logprobs, sample, top_p_top_k_mask
from .verify import DRAFT_PROB_PENALTY, FusedSampleResult, fused_sample

__all__ = [
    "CASE_ACCEPT",
    "CASE_RESAMPLE",
    "CASE_SAMPLE",
    "DRAFT_POS_HASH_MUL",
    "DRAFT_PROB_PENALTY",
    "FusedSampleResult",
    "MTP_SEED_OFFSET",
    "SAMPLING_EPS",
    "SampleLogprobs",
    "SamplingParams",
    "SamplingTensors",
    "acceptance_u53",
    "draft_positions",
    "draw_seed",
    "fused_sample",
    "min_p_mask",
    "process_logits",
    "processed_logprobs",
    "random_sampling",
    "sample",
    "seeds_to_u64",
    "top_p_top_k_mask",
    "u53_to_f32",
    "uniform_u53",
]
