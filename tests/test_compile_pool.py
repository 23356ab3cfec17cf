"""The warm-up's parallel compilation (engine/compile_pool.py): programs are lowered
in turn on the calling thread and compiled on the pool (staged: a repeated shape after its first), and programs
compiled ahead of time on threads are the ones jit then runs (no second compilation)."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.engine.compile_pool import (
    LoweringJob,
    compiler_options_key,
    default_compile_threads,
    lower_then_compile,
)


class _FakeLowered:
    """Stands for a ``jax.stages.Lowered``: ``compile()`` sleeps ``secs`` and records its thread and interval."""

    def __init__(self, name: str, secs: float, log: dict, fail: bool = False):
        self.name, self.secs, self.log, self.fail = name, secs, log, fail

    def compile(self):
        t0 = time.perf_counter()
        time.sleep(self.secs)
        if self.fail:
            raise RuntimeError(f"program {self.name} does not compile")
        self.log[self.name] = (threading.get_ident(), t0, time.perf_counter())
        return self.name


def _job(name: str, key, lower_log: list, compile_log: dict, lower_s: float = 0.02, compile_s: float = 0.05,
         fail_lower: bool = False, fail_compile: bool = False) -> LoweringJob:
    def lower():
        t0 = time.perf_counter()
        time.sleep(lower_s)
        if fail_lower:
            raise ValueError(f"program {name} does not lower")
        lower_log.append((name, threading.get_ident(), t0, time.perf_counter()))
        return _FakeLowered(name, compile_s, compile_log, fail_compile)

    return LoweringJob(name, lower, key)


def test_lower_then_compile_lowers_in_turn_and_compiles_on_the_pool():
    """Lowering runs on the calling thread in the order given, never two at once; each compile runs on a pool
    thread and starts once its program is lowered (not after all lowerings); timings come back in job order."""
    lowers, compiles, done = [], {}, []
    names = ["d16", "p16", "d64", "p64", "s1"]
    jobs = [_job(n, n, lowers, compiles, lower_s=0.05, compile_s=0.3) for n in names]
    timings = lower_then_compile(jobs, threads=4, on_done=lambda: done.append(1))
    assert [t.program for t in timings] == names and len(done) == 5
    assert [name for name, *_ in lowers] == names
    assert {tid for _, tid, _, _ in lowers} == {threading.get_ident()}
    assert all(a[3] <= b[2] for a, b in zip(lowers[:-1], lowers[1:], strict=True))   # one lowering at a time
    assert threading.get_ident() not in {tid for tid, _, _ in compiles.values()}
    # the first program's compile (0.3 s) overlaps the next lowerings: it started before the last lowering ended
    assert compiles["d16"][1] < lowers[-1][3]
    for t in timings:
        assert t.lower_s >= 0.05 and t.compile_s >= 0.3 and t.compile_start_s >= t.lower_start_s + t.lower_s
        assert t.end_s == pytest.approx(t.compile_start_s + t.compile_s)


def test_staged_repeats_compile_after_their_first():
    """Staged: a job whose key came earlier compiles only after that earlier job's compile has finished; other
    keys do not wait for it (no barrier between waves)."""
    lowers, compiles = [], {}
    jobs = [_job("d16", "decode", lowers, compiles, compile_s=0.4),
            _job("p16", "prefill", lowers, compiles, compile_s=0.05),
            _job("d64", "decode", lowers, compiles, compile_s=0.05),
            _job("s1", "sampler", lowers, compiles, compile_s=0.05)]
    timings = {t.program: t for t in lower_then_compile(jobs, threads=2, staged=True)}
    assert timings["d64"].compile_start_s >= timings["d16"].end_s - 1e-3
    assert timings["p16"].end_s < timings["d16"].end_s                     # another key ran meanwhile
    unstaged = {t.program: t for t in lower_then_compile(jobs, threads=4, staged=False)}
    assert unstaged["d64"].compile_start_s < unstaged["d16"].end_s          # without staging it does not wait


def test_lower_then_compile_errors_are_raised_after_started_compiles():
    lowers, compiles = [], {}
    jobs = [_job("a", 1, lowers, compiles, compile_s=0.2), _job("b", 2, lowers, compiles, fail_lower=True),
            _job("c", 3, lowers, compiles)]
    with pytest.raises(ValueError, match="program b does not lower"):
        lower_then_compile(jobs, threads=2)
    assert "a" in compiles and "c" not in compiles    # a's compile finished; nothing after b was lowered
    jobs = [_job("a", 1, lowers, compiles, fail_compile=True), _job("d", 1, lowers, compiles)]
    with pytest.raises(RuntimeError, match="program a does not compile"):
        lower_then_compile(jobs, threads=2, staged=True)
    assert "d" in compiles                             # its staged wait ended with a's failure
    with pytest.raises(ValueError, match="compile threads must be >= 1"):
        lower_then_compile(jobs, threads=0)


def test_thread_count_validation(monkeypatch):
    with pytest.raises(ValueError, match="compile threads must be >= 1"):
        lower_then_compile([], threads=0)
    monkeypatch.setenv("DINFER_JAX_COMPILE_THREADS", "0")
    with pytest.raises(ValueError, match="DINFER_JAX_COMPILE_THREADS"):
        default_compile_threads()
    monkeypatch.setenv("DINFER_JAX_COMPILE_THREADS", "3")
    assert default_compile_threads() == 3


def test_ahead_of_time_compiles_are_reused_by_the_jitted_calls():
    """What the warm-up relies on: after ``f.lower(x).compile()`` on a thread, calling ``f(x)`` compiles nothing
    (jax's backend-compile event does not fire) and gives the compiled program's result."""
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=-1) * 3.0)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)), jnp.float32)
    shapes = [(n, 16) for n in (1, 3, 5, 7)]
    events: list[str] = []

    def listen(name: str, secs: float, **kw) -> None:
        if name.endswith("backend_compile_duration"):
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        lower_then_compile([LoweringJob(str(s), lambda s=s: f.lower(jax.ShapeDtypeStruct(s, jnp.float32), w), s)
                            for s in shapes], threads=2)
        assert len(events) == len(shapes)
        for s in shapes:
            x = np.ones(s, np.float32)
            np.testing.assert_allclose(np.asarray(f(x, w)), np.tanh(x @ np.asarray(w)).sum(-1) * 3.0, rtol=1e-5)
        assert len(events) == len(shapes), "a jitted call compiled again what the pool had compiled"
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_bad_compiler_option_is_refused_by_name():
    with pytest.raises(ValueError, match="xla_no_such_option"):
        compiler_options_key({"xla_no_such_option": 1})
    with pytest.raises(ValueError, match="names are strings"):
        compiler_options_key({"xla_gpu_autotune_level": [0]})
    assert compiler_options_key(None) == () == compiler_options_key({})
    assert compiler_options_key({"xla_gpu_autotune_level": 0, "xla_disable_hlo_passes": "fusion"}) == (
        ("xla_disable_hlo_passes", "fusion"), ("xla_gpu_autotune_level", 0))


def test_engine_compiles_its_steps_with_the_given_options():
    """``LLM(compiler_options=...)`` reaches XLA for the model step and the sampler: with HLO fusion disabled XLA:CPU
    wraps every op left unfused in a fusion of its own (``wrapped_*``): many more of them than its default
    pipeline leaves."""
    from dinfer_jax import LLM
    from dinfer_jax.engine.buckets import Buckets
    from dinfer_jax.models import random_model
    from dinfer_jax.models.config import load_config

    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)
    buckets = Buckets(decode_batch=(2,), prefill_batch=(1,), prefill_len=(16,), pages=(2,))
    texts = {}
    for name, opts in (("default", None), ("no fusion", {"xla_disable_hlo_passes": "fusion"})):
        llm = LLM(model, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, buckets=buckets, warmup=False,
                  progress=False, kv_cache_memory_bytes=8 << 20, compiler_options=opts)
        r = llm.runner
        texts[name] = (r._lower_step((2, 1, 2), True).compile().as_text(),
                       r._lower_sampler(2, False, True).compile().as_text())
    for default, unfused in zip(texts["default"], texts["no fusion"], strict=True):
        assert unfused.count("wrapped_") > 2 * default.count("wrapped_") + 10


def test_first_of_each_splits_the_warmup_into_two_waves():
    """The first wave holds one job per key, in order; the second every repeat, in order."""
    from dinfer_jax.engine.compile_pool import first_of_each

    keys = [(64, 1), (64, 1), (1, 8192), (64, 1), (1, 8192), (8, 1)]
    assert first_of_each(keys) == ([0, 2, 5], [1, 3, 4])
    assert first_of_each([]) == ([], [])


def test_staged_warmup_setting(monkeypatch):
    from dinfer_jax.engine.compile_pool import default_staged

    monkeypatch.setenv("DINFER_JAX_STAGED_WARMUP", "1")
    assert default_staged() is True
    monkeypatch.setenv("DINFER_JAX_STAGED_WARMUP", "0")
    assert default_staged() is False
    monkeypatch.setenv("DINFER_JAX_STAGED_WARMUP", "yes")
    with pytest.raises(ValueError, match="DINFER_JAX_STAGED_WARMUP must be 0 or 1"):
        default_staged()
    monkeypatch.delenv("DINFER_JAX_STAGED_WARMUP")
    assert default_staged() is (jax.default_backend() == "gpu")


def test_staged_warmup_compiles_every_bucket_once():
    """A staged warm-up (forced on this CPU) lowers one program per (rows, tokens) shape first, the other page-table
    widths next and the samplers last; a shape's other widths compile after its first; serving then compiles
    nothing."""
    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine.buckets import Buckets
    from dinfer_jax.models import random_model
    from dinfer_jax.models.config import load_config

    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)
    buckets = Buckets(decode_batch=(2,), prefill_batch=(1,), prefill_len=(16,), pages=(1, 2))
    llm = LLM(model, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, buckets=buckets, warmup=False,
              progress=False, kv_cache_memory_bytes=8 << 20)
    llm.runner.warmup(compile_threads=2, staged=True)
    timings = llm.runner.warmup_timings
    # programs [2,1] and [1,16] at 1 and 2 pages; samplers for batches 1 and 2, two variants each
    assert [t.program for t in timings[:4]] == ["decode [2, 1] pages 1", "prefill [1, 16] pages 1",
                                                "decode [2, 1] pages 2", "prefill [1, 16] pages 2"]
    assert len(timings) == 8 and all(t.program.startswith("sampler") for t in timings[4:])
    for first, repeat in ((timings[0], timings[2]), (timings[1], timings[3])):
        assert repeat.compile_start_s >= first.end_s - 1e-3
    compiled = llm.runner.num_compilations
    llm.generate([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert llm.runner.num_compilations == compiled, "compiled outside the staged warm-up"


def test_decode_options_reach_the_decode_programs_only():
    """``LLM(decode_compiler_options=...)``: the decode bucket compiles with them (fusion disabled: many more
    ``wrapped_*`` ops), the prefill bucket and the sampler without; serving a decode step runs the program the
    warm-up compiled. By default on CPU (no FP8 kernel) the decode programs take ``compiler_options`` alone."""
    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine.buckets import Buckets
    from dinfer_jax.models import random_model
    from dinfer_jax.models.config import load_config

    model = random_model(load_config("tiny-v4"), seed=0, include_mtp=False)
    buckets = Buckets(decode_batch=(2,), prefill_batch=(1,), prefill_len=(16,), pages=(2,))
    kw = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, buckets=buckets, progress=False,
              kv_cache_memory_bytes=8 << 20)
    plain = LLM(model, warmup=False, **kw).runner
    assert plain._decode_programs is plain._programs
    llm = LLM(model, decode_compiler_options={"xla_disable_hlo_passes": "fusion"}, compile_threads=2, **kw)
    r = llm.runner
    decode = r._lower_step((2, 1, 2), True).compile().as_text()
    prefill = r._lower_step((1, 16, 2), False).compile().as_text()
    assert decode.count("wrapped_") > 2 * plain._lower_step((2, 1, 2), True).compile().as_text().count("wrapped_") + 10
    assert prefill.count("wrapped_") == plain._lower_step((1, 16, 2), False).compile().as_text().count("wrapped_")
    compiled = r.num_compilations
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert r.num_compilations == compiled, "serving compiled a program the warm-up had not"
    assert llm.runner._decode_programs is not llm.runner._programs


def test_gpu_option_defaults_follow_the_linear_kernel():
    """With the FP8 linear kernel serving decode (resolved ``linear_impl="pallas"``: a GPU, one device) every
    program defaults to Triton's GEMMs off and decode programs also to no GEMM autotuning; with XLA's linears (CPU,
    mesh engines) both default to XLA's own; a given mapping, ``{}`` included, replaces the default."""
    from dinfer_jax.engine.llm import decode_program_options, program_options

    assert program_options(None, "pallas") == {"xla_gpu_enable_triton_gemm": False}
    assert decode_program_options(None, "pallas") == {"xla_gpu_autotune_level": 0}
    assert program_options(None, "xla") == {} == decode_program_options(None, "xla")
    assert program_options({}, "pallas") == {} == decode_program_options({}, "pallas")
    assert decode_program_options({"xla_gpu_autotune_level": 1}, "pallas") == {"xla_gpu_autotune_level": 1}
