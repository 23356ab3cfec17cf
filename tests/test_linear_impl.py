"""The FP8 linears' implementation switch (dinfer_jax.models.linear_impl): which calls the Mosaic GPU kernel takes
(checked by lowering for CUDA on this CPU machine: the kernel appears as a ``mosaic_gpu`` custom call), that XLA's
path is the default, and that settings which cannot run are refused by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dinfer_jax.models.linear_impl import linear_impl
from dinfer_jax.models.ops import linear
from dinfer_jax.models.qweights import QuantizedWeight

S = jax.ShapeDtypeStruct


def fp8_weight(n: int, k: int, block=(128, 128), scale_dtype=jnp.float8_e8m0fnu) -> QuantizedWeight:
    return QuantizedWeight(S((n, k), jnp.float8_e4m3fn), S((-(-n // block[0]), -(-k // block[1])), scale_dtype),
                           "fp8", block)


def cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lowered_with(impl: str | None, x: S, w: QuantizedWeight) -> str:
    def f(x, w):
        if impl is None:
            return linear(x, w)
        with linear_impl(impl):
            return linear(x, w)
    return cuda_text(f, x, w)


@pytest.mark.parametrize("x_shape,n,k,block", [((64, 4096), 1024, 4096, (128, 128)),
                                               ((2, 5, 1280), 4096, 1280, (32, 32))])
def test_kernel_takes_fp8_linears_it_supports(x_shape, n, k, block):
    w = fp8_weight(n, k, block)
    x = S(x_shape, jnp.bfloat16)
    assert "mosaic_gpu" in lowered_with("pallas", x, w)
    assert "mosaic_gpu" not in lowered_with(None, x, w)        # the default is XLA's path
    assert "mosaic_gpu" not in lowered_with("xla", x, w)


@pytest.mark.parametrize("case", ["fp32 scales", "fp32 activations", "K not a multiple of the tiles", "fp4",
                                  "more tokens than the crossover"])
def test_other_calls_keep_xla(case):
    x, w = S((16, 4096), jnp.bfloat16), fp8_weight(1024, 4096)
    if case == "more tokens than the crossover":   # prefill: XLA's GEMM measured faster (pallas_kernels/linear/tuning)
        x = S((2, 33, 4096), jnp.bfloat16)
    elif case == "fp32 scales":
        w = fp8_weight(1024, 4096, scale_dtype=jnp.float32)
    elif case == "fp32 activations":
        x = S((16, 4096), jnp.float32)
    elif case == "K not a multiple of the tiles":
        x, w = S((16, 96), jnp.bfloat16), fp8_weight(1024, 96)
    else:
        w = QuantizedWeight(S((1024, 2048), jnp.uint8), S((1024, 128), jnp.float8_e8m0fnu), "fp4", (1, 32))
    assert "mosaic_gpu" not in lowered_with("pallas", x, w)


def test_bad_names_and_settings_are_refused():
    from dinfer_jax import LLM
    from dinfer_jax.models import random_model

    with pytest.raises(ValueError, match="linear_impl must be one of"):
        with linear_impl("cuda"):
            pass
    model = random_model("tiny-v4")
    with pytest.raises(ValueError, match="linear_impl must be one of"):
        LLM(dataclasses.replace(model, linear_impl="triton"), warmup=False, progress=False)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="linear_impl='pallas' .* needs a GPU"):
            LLM(dataclasses.replace(model, linear_impl="pallas"), warmup=False, progress=False)


def test_serving_step_routes_its_fp8_linears_to_the_kernel():
    """``model_step(linear_impl="pallas")`` on a one-layer real-dimension V4-Flash slice (abstract native weights,
    lowered for CUDA): the step holds more Mosaic GPU calls than with XLA's linears (the attention projections'
    kernels; the expert kernel is in both)."""
    import functools

    from dinfer_jax.engine.model_step import model_step
    from dinfer_jax.models.config import load_config
    from dinfer_jax.models.layer_plan import stack_params
    from dinfer_jax.models.params import abstract_params
    from dinfer_jax.models.step_state import CacheConfig, StepInput, cache_shapes

    base = load_config("deepseek-v4-flash")
    cfg = base.replace(num_layers=1, attn_kinds=base.attn_kinds[:1], compress_ratios=base.compress_ratios[:1],
                       hash_layers=base.hash_layers[:1], n_mtp_layers=0, mtp_compress_ratios=())
    params = jax.eval_shape(functools.partial(stack_params, cfg),
                            abstract_params(cfg, "bfloat16", include_mtp=False, weights="native"))
    b, pages = 8, 4
    i32 = lambda *s: S(s, jnp.int32)  # noqa: E731
    inp = StepInput(tokens=i32(b, 1), start=i32(b), n=i32(b), slot=i32(b), pages=i32(b, pages), last=i32(b))
    cache = cache_shapes(cfg, CacheConfig(num_slots=b + 1, num_blocks=b * pages + 1, block_size=128), "bfloat16")

    def calls(impl: str) -> int:
        step = jax.jit(functools.partial(model_step, cfg=cfg, dtype="bfloat16", mhc_impl="jnp", linear_impl=impl))
        return step.trace(params, cache, inp).lower(lowering_platforms=("cuda",)).as_text().count(
            "stablehlo.custom_call @mosaic_gpu")

    assert calls("pallas") > calls("xla")


def test_auto_is_the_kernel_on_a_gpu_for_the_one_device_engine(monkeypatch):
    """``linear_impl="auto"`` (the default) resolves to the kernel only on a GPU, outside the batch-invariant mode
    and the mesh engines; on this CPU the LLM's model holds ``"xla"``."""
    from dinfer_jax import LLM
    from dinfer_jax.models import Model, random_model
    from dinfer_jax.models.linear_impl import resolve_linear_impl

    assert Model.__dataclass_fields__["linear_impl"].default == "auto"
    assert resolve_linear_impl("xla") == "xla" and resolve_linear_impl("pallas", batch_invariant=True) == "pallas"
    if jax.default_backend() != "gpu":
        assert resolve_linear_impl("auto") == "xla"
        assert LLM(random_model("tiny-v4"), warmup=False, progress=False).model.linear_impl == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_linear_impl("auto") == "pallas"
    assert resolve_linear_impl("auto", batch_invariant=True) == "xla"
    assert resolve_linear_impl("auto", one_device=False) == "xla"


def test_grouped_output_projection_reads_fp8_wo_a_through_the_kernel():
    """V4-Flash's grouped output projection (``wo_a``: 8 groups of ``[1024, 4096]`` FP8) at a batch-64 decode step:
    with the kernel on, ``wo_a`` goes through the kernel's grouped form and ``wo_b`` through the plain one (two
    Mosaic GPU calls) and no ``[8192, 4096]`` dequantised copy of ``wo_a`` is built; with XLA's linears, none.
    (Numerics: tests/test_linear_kernel_gpu.py, per group against the reference.)"""
    from dinfer_jax.models.attention import RopeTable, output_projection
    from dinfer_jax.models.config import load_config

    cfg = load_config("deepseek-v4-flash")
    h, d, g, r = cfg.num_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    p = {"wo_a": fp8_weight(g * r, h * d // g), "wo_b": fp8_weight(cfg.hidden_size, g * r)}
    o = S((64, 1, h, d), jnp.bfloat16)
    half = S((1, cfg.rope_head_dim // 2), jnp.float32)

    def text(impl: str) -> str:
        def f(p, o, cos, sin):
            with linear_impl(impl):
                return output_projection(p, o, cfg=cfg, rope=RopeTable(cos, sin))
        return cuda_text(f, p, o, half, half)

    kernel, xla = text("pallas"), text("xla")
    assert kernel.count("stablehlo.custom_call @mosaic_gpu") == 2
    assert xla.count("stablehlo.custom_call @mosaic_gpu") == 0
    dense_wo_a = f"tensor<{g * r}x{h * d // g}xbf16>"
    assert dense_wo_a in xla and dense_wo_a not in kernel
