"""Test session setup: 8 host CPU devices (for the dp/cp/ep mesh tests) before jax is imported."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The on-disk compilation cache lives in a directory of this run only: the first process of a run (pytest itself,
# or xdist's controller, before it starts its workers, which inherit the environment) makes it and removes it at the
# end (pytest_unconfigure). So a run never depends on what earlier runs compiled, while the programs that several
# test modules compile alike (the same tiny models and buckets; each module drops its compiled programs when it
# ends, see _release_compiled_programs) are compiled once per run: -17% wall time on five engine-heavy test files.
# DINFER_JAX_TEST_CACHE=off compiles everything afresh. (Two full-suite runs on 2026-12-01 died with SIGSEGV inside
# XLA's CPU compile, once with a cache on and once with it off, at a test that passes alone.)
_USE_RUN_CACHE = os.environ.get("DINFER_JAX_TEST_CACHE", "on").lower() not in ("off", "0", "no")
_OWN_RUN_CACHE = _USE_RUN_CACHE and "DINFER_JAX_TEST_RUN_CACHE" not in os.environ
if _OWN_RUN_CACHE:
    os.environ["DINFER_JAX_TEST_RUN_CACHE"] = tempfile.mkdtemp(prefix="dinfer_jax_test_xla_")
os.environ["DINFER_JAX_COMPILATION_CACHE"] = os.environ["DINFER_JAX_TEST_RUN_CACHE"] if _USE_RUN_CACHE else "off"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
if _USE_RUN_CACHE:
    jax.config.update("jax_compilation_cache_dir", os.environ["DINFER_JAX_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_unconfigure(config) -> None:  # noqa: ARG001 - pytest's hook signature
    if _OWN_RUN_CACHE:
        shutil.rmtree(os.environ["DINFER_JAX_TEST_RUN_CACHE"], ignore_errors=True)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop every module's compiled programs and engines when it ends. Twice (2026-12-01) jaxlib 0.10.2's XLA CPU
    compiler segfaulted late in a full-suite run, at a compile that passes when its test file runs alone; keeping
    the process's accumulated executables small is the mitigation (cross-module reuse of compiled steps is rare)."""
    yield
    gc.collect()
    jax.clear_caches()
