"""Test session setup: 8 host CPU devices (for the dp/cp/ep mesh tests) before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests neither read nor write the user's on-disk compilation cache (LLM turns it on by default): a test run must not
# depend on what earlier runs compiled, and jaxlib 0.10.2 once crashed (SIGSEGV) serialising an executable into it
# mid-suite (test_step_pages, 2026-12-01).
os.environ.setdefault("DINFER_JAX_COMPILATION_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
