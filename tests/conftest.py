"""Test session setup: 8 host CPU devices (for the dp/cp/ep mesh tests) before jax is imported."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The on-disk compilation cache LLM turns on is a fresh directory per test run: engines built with the same shapes
# in one run still share compiled steps (turning it off made test_step_pages several times slower), but a run never
# depends on what earlier runs compiled nor shares files with concurrent runs (a suite whose cache directory was
# written by other processes at the same time died with SIGSEGV in jax's cache write, 2026-12-01).
os.environ.setdefault("DINFER_JAX_COMPILATION_CACHE", tempfile.mkdtemp(prefix="dinfer_jax_test_xla_cache_"))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
