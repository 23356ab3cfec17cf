"""The row-gather probe's kernels (``scripts/probe_row_gather.py``): one asynchronous copy per gathered row into a
ring of shared-memory buffers, or per-thread register loads of each row into one buffer, stored back out with TMA.
Their GPU timing is the probe's job; here: they lower for CUDA (jax 0.10.2 and 0.11.2) and, in the Mosaic GPU
interpreter (jax ≥ 0.11), equal ``pool[idx]`` exactly, including repeated and out-of-order indices and buffers
refilled several times."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_row_gather.py"
_spec = importlib.util.spec_from_file_location("probe_row_gather", SCRIPT)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


KERNELS = {
    "copies, 2 stages": functools.partial(probe.gather_rows, stages=2),
    "copies, 2 stages, no auto barriers": functools.partial(probe.gather_rows, stages=2, no_auto_barriers=True),
    "copies, 3 stages": functools.partial(probe.gather_rows, stages=3),
    "registers, 16 rows in flight": functools.partial(probe.gather_rows_registers, group=16),
}


@pytest.mark.parametrize("name", ["copies, 2 stages", "copies, 3 stages", "registers, 16 rows in flight"])
def test_kernel_lowers_for_cuda_at_the_decode_shape(name):
    s = jax.ShapeDtypeStruct
    fn = jax.jit(KERNELS[name])
    text = fn.trace(s((1 << 17, 2, 256), jnp.bfloat16), s((64, 640), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_equals_xla_gather_in_the_interpreter(name):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not hasattr(plgpu, "force_gpu_interpret_mode"):
        pytest.skip(f"jax {jax.__version__}: no plgpu.force_gpu_interpret_mode (the Mosaic GPU interpreter arrived "
                    "with jax 0.11)")
    pool, idx = probe.case(3, 320, 512, 700, seed=len(name))
    idx = idx.at[0, :64].set(5).at[1, 64:128].set(jnp.arange(63, -1, -1))   # repeats, descending rows
    fn = jax.jit(KERNELS[name])
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = np.asarray(fn(pool, idx))
    np.testing.assert_array_equal(got, np.asarray(pool)[np.asarray(idx)])
