"""Test session setup: 8 host CPU devices (for the dp/cp/ep mesh tests) before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No on-disk compilation cache in tests: a run must not depend on what earlier runs compiled. (Two full-suite runs
# on 2026-12-01 died with SIGSEGV inside XLA's CPU compile, once with the cache on and once with it off, at a test
# that passes alone; see _release_compiled_programs below.) Engines over the same model and shapes share compiled
# steps in-process anyway (the runner's jits take the configuration as static arguments).
os.environ["DINFER_JAX_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


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
