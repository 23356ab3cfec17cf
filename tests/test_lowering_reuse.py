"""Kernel lowerings reused across programs (``pallas_kernels/lowering_reuse.py``, issue 8's warm-up): lowered for
CUDA on this CPU-only machine, two different programs that call the FP8-linear, expert and mHC Sinkhorn kernels at
the same shapes embed the same Mosaic GPU kernels (their IR, debug locations and dump names aside) with and without
reuse, and with reuse the kernels are exported once (the second program lowers none of them again). Running the reused
kernels is a GPU check (``tests/test_linear_kernel_gpu.py``, ``STAGE=warmup-reuse``)."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import lowering_reuse
from pallas_kernels.lowering_reuse import kernel_call, platform_from_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_lowering_reuse.py"
_spec = importlib.util.spec_from_file_location("bench_lowering_reuse", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
_lower = bench.lower_for_cuda   # the program of scripts/bench_lowering_reuse.py
_spec_compile = importlib.util.spec_from_file_location("bench_compile", SCRIPT.parent / "bench_compile.py")
_bench_compile = importlib.util.module_from_spec(_spec_compile)
_spec_compile.loader.exec_module(_bench_compile)   # first_layers: a real-dimension slice's config


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


def test_reused_lowerings_embed_the_same_kernels():
    lowering_reuse._exported.cache_clear()
    direct = [_lower(v, None) for v in (0, 1)]
    assert lowering_reuse._exported.cache_info().currsize == 0   # no scope: kernels are called directly
    kernels = _kernels(direct[0])
    assert len(kernels) >= 5 and _kernels(direct[1]) == kernels   # 2 linears, 2 grouped GEMMs, the Sinkhorn
    first = _lower(0, "cuda")
    exported = lowering_reuse._exported.cache_info()
    assert exported.misses == 4 and exported.currsize == 4, exported   # each call site exported once
    second = _lower(1, "cuda")
    again = lowering_reuse._exported.cache_info()
    assert again.misses == 4 and again.hits == 4, again   # the second program lowered no kernel again
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


@pytest.mark.parametrize("value,expected", [(None, "cuda"), ("1", "cuda"), ("true", "cuda"), ("0", None),
                                            ("False", None)])
def test_platform_from_env_is_on_by_default_on_a_gpu(monkeypatch, value, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    if value is None:
        monkeypatch.delenv(lowering_reuse.ENV, raising=False)
    else:
        monkeypatch.setenv(lowering_reuse.ENV, value)
    assert platform_from_env() == expected


def test_platform_from_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(lowering_reuse.ENV, "yes")
    with pytest.raises(ValueError, match="DINFER_JAX_REUSE_KERNEL_LOWERINGS='yes'"):
        platform_from_env()


def _one_layer_step_lowering(pages: int, preset: str = "deepseek-v4-flash", layers: int = 1, **kw) -> str:
    """The serving step of the first ``layers`` layers of a real-dimension slice (abstract native weights, batch 8,
    the FP8 linear kernel) lowered for CUDA, as the one-device engine traces it unless ``kw`` says otherwise."""
    from dinfer_jax.engine.model_step import model_step
    from dinfer_jax.models.config import load_config
    from dinfer_jax.models.layer_plan import stack_params
    from dinfer_jax.models.params import abstract_params
    from dinfer_jax.models.step_state import CacheConfig, StepInput, cache_shapes

    cfg = _bench_compile.first_layers(load_config(preset), layers)
    if cfg.is_v41:
        cfg = cfg.replace(engram_layer_ids=(), engram_num_embeddings=())
    params = jax.eval_shape(functools.partial(stack_params, cfg),
                            abstract_params(cfg, "bfloat16", include_mtp=False, weights="native"))
    b = 8
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    inp = StepInput(tokens=i32(b, 1), start=i32(b), n=i32(b), slot=i32(b), pages=i32(b, pages), last=i32(b))
    cache = cache_shapes(cfg, CacheConfig(num_slots=b + 1, num_blocks=b * 8 + 1, block_size=128), "bfloat16")
    opts = dict(moe_impl="pallas", mhc_impl="pallas", linear_impl="pallas") | kw
    step = jax.jit(functools.partial(model_step, cfg=cfg, dtype="bfloat16", **opts))
    return step.trace(params, cache, inp).lower(lowering_platforms=("cuda",)).as_text()


def test_the_engine_step_reuses_its_kernels_when_switched_on(monkeypatch):
    """The switch must reach the one-device engine's step (a default argument once kept it off there: the first
    H200 measurement of reuse measured nothing). Two decode programs differing only in their page-table width:
    with ``DINFER_JAX_REUSE_KERNEL_LOWERINGS`` unset (on by default) on a GPU (the backend query answered "gpu",
    lowering for CUDA on this CPU) the first exports its FP8-linear, expert and Sinkhorn kernels, the second finds
    every one of them exported, and both embed the same kernels as the direct lowering; a mesh program's step
    (``copies_manual`` ≥ 1) never reuses."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv(lowering_reuse.ENV, "0")
    lowering_reuse._exported.cache_clear()
    direct = _kernels(_one_layer_step_lowering(4))
    assert lowering_reuse._exported.cache_info().currsize == 0 and len(direct) >= 4
    monkeypatch.delenv(lowering_reuse.ENV)
    _one_layer_step_lowering(4, copies_manual=1)   # as the mesh engine calls it: no export
    assert lowering_reuse._exported.cache_info().currsize == 0
    first = _kernels(_one_layer_step_lowering(4))
    exported = lowering_reuse._exported.cache_info()
    assert exported.currsize >= 3, exported    # linears, experts, Sinkhorn
    second = _kernels(_one_layer_step_lowering(8))
    again = lowering_reuse._exported.cache_info()
    assert again.misses == exported.misses and again.hits > exported.hits, again
    assert sorted(first) == sorted(direct) and sorted(second) == sorted(direct)


@functools.partial(jax.jit, static_argnames=("s",))
def _sin_kernel(x, *, s):
    return jnp.sin(x) * s


@pytest.mark.parametrize("commit", [True, False])
def test_programs_with_reused_kernels_are_found_by_their_calls(commit):
    """The engine's warm-up lowers and compiles each bucket, then serving calls it and must find that compile.
    Two programs (widths of ``y``) embedding the same exported call, the state donated and fed back: with the
    state committed to its device from the start (as :class:`~dinfer_jax.engine.runner.ModelRunner` does), both
    calls find their warm-up compiles; with an uncommitted initial state jax lowers and compiles the second call's
    program again — the H100 measurement of 2026-12-05 (every bucket compiled twice) — which is why the runner
    commits it."""
    from jax._src import monitoring

    lowering_reuse._exported.cache_clear()   # the first program exports, as in a fresh process
    params = {"x": jnp.ones((128, 128)), "w": jnp.ones((4, 128, 128)) / 128}
    state = jnp.zeros((16,))
    if commit:
        state = jax.device_put(state, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    def program(params, state, y):   # a new function per test: jax's caches are keyed on it
        def body(c, w):
            return kernel_call(_sin_kernel, c @ w, s=2.0), None

        with lowering_reuse.reuse_kernel_lowerings("cpu"):
            c, _ = jax.lax.scan(body, params["x"], params["w"])
        return c + y.sum(), state + 1

    step = jax.jit(program, donate_argnums=(1,))
    ys = [jnp.ones((8, p)) for p in (2, 4)]
    for lowered in [step.lower(params, state, y) for y in ys]:
        lowered.compile()
    compiles: list[str] = []

    def listen(event: str, *_: object, **__: object) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache" or event.endswith("backend_compile_duration"):
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        for y in ys:
            out, state = step(params, state, y)
            out.block_until_ready()
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert (compiles == []) == commit, compiles


def test_the_decode_attention_kernel_is_reused_across_page_widths(monkeypatch):
    """The decode-attention kernel reads each query's window + top-k rows, whose count does not follow the
    page-table width, so the programs of one batch bucket share it: in a V4.1-Flash slice reaching its first
    compressed layer (page widths of 24 and 32 pages: more compressed rows than the top-k, so the step gathers the
    selected rows), the second program finds the attention kernel (and every other wrapped kernel) already
    exported."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv(lowering_reuse.ENV, "1")
    lowering_reuse._exported.cache_clear()
    names: list[str] = []
    real = lowering_reuse._exported

    def recording(fn, *args):
        names.append(fn.__name__)
        return real(fn, *args)

    monkeypatch.setattr(lowering_reuse, "_exported", recording)
    # (abstract released-layout expert weights: the kernel needs the layout the engine converts to on a GPU)
    _one_layer_step_lowering(24, preset="deepseek-v4.1-flash", layers=3, moe_impl="ragged")
    first = real.cache_info()
    names.clear()
    _one_layer_step_lowering(32, preset="deepseek-v4.1-flash", layers=3, moe_impl="ragged")
    again = real.cache_info()
    assert "sparse_decode_attention" in names, names
    assert again.misses == first.misses and again.hits == first.hits + len(names), (first, again, names)
