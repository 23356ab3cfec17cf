"""Kernel lowerings reused across programs (``pallas_kernels/lowering_reuse.py``, issue 8's warm-up): lowered for
CUDA on this CPU-only machine, two different programs that call the FP8-linear and the expert kernels at the same
shapes embed the same Mosaic GPU kernels (their IR, debug locations and dump names aside) with and without reuse,
and with reuse the kernels are exported once (the second program lowers none of them again). Running the reused
kernels is a GPU check (``tests/test_linear_kernel_gpu.py``, ``STAGE=warmup-reuse``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import lowering_reuse
from pallas_kernels.lowering_reuse import kernel_call, platform_from_env, reuse_kernel_lowerings

s = jax.ShapeDtypeStruct


def _program(variant: int):
    """A program with two FP8 linears and one routed-expert layer (two grouped GEMMs) of fixed shapes; ``variant``
    makes the programs differ elsewhere (as the engine's page-width buckets do)."""
    from pallas_kernels.linear.kernel_sm90 import fp8_linear_sm90
    from pallas_kernels.linear.tuning import config_for
    from pallas_kernels.moe.kernel_sm90 import experts_sm90
    from pallas_kernels.moe.tuning import configs_for

    up, down = configs_for(16 * 6)

    def step(x_a, w_a, s_a, x_b, w_b, s_b, x, ids, rw, w1, w3, w2):
        # the shapes of tests/test_linear_kernel_cpu.py and tests/test_moe_kernel_cpu.py
        # as the model calls them (dinfer_jax/models/linear_impl.py, expert_kernel.py)
        a = kernel_call(fp8_linear_sm90, x_a, w_a, s_a, config=config_for(16, 4096, 1280), block=(32, 32))
        b = kernel_call(fp8_linear_sm90, x_b, w_b, s_b, config=config_for(1, 512, 4096), block=(128, 128))
        y = kernel_call(experts_sm90, x, ids, rw, w1, w3, w2, swiglu_limit=10.0, up_config=up, down_config=down)
        return jnp.tanh(y).sum() + a.sum() + b.sum() + variant

    return step


def _args():
    from pallas_kernels.moe import reference

    g, d, i = 16, 1024, 512

    def fp4w(o, inn):
        return reference.ExpertWeight(s((g, o, inn // 2), jnp.uint8), s((g, o, inn // 32), jnp.uint8), "fp4")

    return (s((16, 1280), jnp.bfloat16), s((4096, 1280), jnp.float8_e4m3fn), s((128, 40), jnp.float8_e8m0fnu),
            s((1, 4096), jnp.bfloat16), s((512, 4096), jnp.float8_e4m3fn), s((4, 32), jnp.float8_e8m0fnu),
            s((16, d), jnp.bfloat16), s((16, 6), jnp.int32), s((16, 6), jnp.float32), fp4w(i, d), fp4w(i, d),
            fp4w(d, i))


def _unescape(text: str) -> bytes:
    """The bytes of an MLIR string attribute as printed (``\\XX`` hex escapes)."""
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] != "\\":
            out.append(ord(text[i]))
            i += 1
        elif text[i + 1] in "\\\"":
            out.append(ord(text[i + 1]))
            i += 2
        else:
            out.append(int(text[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def _kernels(text: str) -> list[str]:
    """The Mosaic GPU modules a lowered program embeds (serialized bytecode in the custom calls' configuration),
    printed without debug locations (which name the enclosing program) and dump names, in order."""
    from jax._src.interpreters import mlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir

    out = []
    for blob in re.findall(r'module = "([^"]*)"', text):
        ctx = mlir.make_ir_context()
        mosaic_gpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True   # the serialized form's stable_mosaic_gpu ops
        module = ir.Module.parse(_unescape(blob), context=ctx)
        asm = module.operation.get_asm(enable_debug_info=False)
        # jax 0.11 names each lowering for dumps with a process-wide counter ("fp8_linear_4")
        out.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*", ', "", asm))
    return out


def _lower(variant: int, platform: str | None) -> str:
    with reuse_kernel_lowerings(platform):
        return jax.jit(_program(variant)).trace(*_args()).lower(lowering_platforms=("cuda",)).as_text()


def test_reused_lowerings_embed_the_same_kernels():
    lowering_reuse._exported.cache_clear()
    direct = [_lower(v, None) for v in (0, 1)]
    assert lowering_reuse._exported.cache_info().currsize == 0   # no scope: kernels are called directly
    kernels = _kernels(direct[0])
    assert len(kernels) >= 4 and _kernels(direct[1]) == kernels   # 2 linears + 2 grouped GEMMs at least
    first = _lower(0, "cuda")
    exported = lowering_reuse._exported.cache_info()
    assert exported.misses == 3 and exported.currsize == 3, exported   # each call site exported once
    second = _lower(1, "cuda")
    again = lowering_reuse._exported.cache_info()
    assert again.misses == 3 and again.hits == 3, again   # the second program lowered no kernel again
    assert sorted(_kernels(first)) == sorted(kernels) and sorted(_kernels(second)) == sorted(kernels)


def test_kernel_call_without_scope_is_a_plain_call():
    calls = []

    def fn(x, *, scale):
        calls.append(scale)
        return x * scale

    assert float(kernel_call(fn, jnp.float32(2.0), scale=3.0)) == 6.0 and calls == [3.0]


@pytest.mark.parametrize("value", ["0", "1", None])
def test_platform_from_env_only_on_a_gpu(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(lowering_reuse.ENV, raising=False)
    else:
        monkeypatch.setenv(lowering_reuse.ENV, value)
    # this machine has no GPU: reuse stays off whatever the variable says
    assert jax.default_backend() != "gpu" and platform_from_env() is None
