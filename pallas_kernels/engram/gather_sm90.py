"""Engram line gather for Hopper (Mosaic GPU): ``out[i] = lines[line_ids[i]]``, the table read where it lies.

Contract: :func:`pallas_kernels.engram.reference.gather_lines_ref` (int32 line table ``[lines, line_words]``,
``line_words`` a multiple of 128, int32 ``line_ids [N]`` in range → ``[N, line_words]`` int32).

Why a kernel: with the Engram tables in pinned host memory, an XLA gather cannot read them from the device, and a
host computation inside the step makes the device wait for the host (``docs/engram.md``). A Mosaic GPU kernel given
a ``pinned_host`` array receives its host pointer (measured on the H200: a call costs the same for a 64 MiB and a
4 GiB table, and the program holds no copy; ``scripts/probe_host_read_kernel.py``) and reads the rows over PCIe
itself, in stream order with the step's other kernels — what DeepInfer's ``EngramBuffer`` does with CUDA's mapped
host memory. The same kernel reads a device-memory table.

Organisation: grid ``(N / group,)``, one warpgroup per CTA. A CTA reads its ``group`` line ids (scalar loads),
issues the ``group`` line loads (one vector load each, ``line_words / 128`` words per thread) before any store, so
their PCIe round trips overlap, then stores the lines to the output. ``N`` is padded to a multiple of ``group`` with
line 0 (always valid), dropped after.

Imports of Mosaic GPU are lazy so that CPU-only machines can import this module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.engram.reference import LINE_WORDS, gather_lines_ref

__all__ = ["check_inputs", "gather_lines", "gather_lines_ref"]


def check_inputs(lines: jax.Array, line_ids: jax.Array, group: int) -> None:
    """ValueError unless ``lines`` is int32 ``[lines, multiple of 128]``, ``line_ids`` int32 ``[N]`` and ``group``
    positive."""
    if lines.ndim != 2 or lines.dtype != jnp.int32 or lines.shape[1] % LINE_WORDS:
        raise ValueError(f"a line table must be int32 [lines, multiple of {LINE_WORDS}], got "
                         f"{lines.dtype}{list(lines.shape)}")
    if line_ids.ndim != 1 or line_ids.dtype != jnp.int32:
        raise ValueError(f"line ids must be int32 [N], got {line_ids.dtype}{list(line_ids.shape)}")
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")


def _kernel_call(lines: jax.Array, line_ids: jax.Array, group: int) -> jax.Array:
    """The Mosaic GPU kernel on ``line_ids [N]`` with ``N`` a multiple of ``group``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = line_ids.shape[0]
    width = lines.shape[1]

    def body(t_ref, ids_ref, o_ref):
        base = lax.axis_index("rows") * group
        ids = [ids_ref[base + g] for g in range(group)]
        values = [t_ref[pl.ds(i, 1), :] for i in ids]          # every load issued before the first store
        for g, v in enumerate(values):
            o_ref[pl.ds(base + g, 1), :] = v

    body.__name__ = f"engram_gather_w{width}_g{group}"
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n, width), jnp.int32),
        grid=(n // group,),
        grid_names=("rows",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    return kernel(lines, line_ids)


@functools.partial(jax.jit, static_argnames=("group",))
def gather_lines(lines: jax.Array, line_ids: jax.Array, *, group: int = 8) -> jax.Array:
    """``lines[line_ids]`` int32 ``[N, line_words]`` through the Mosaic GPU kernel; ``lines`` may be in device or
    pinned host memory, ``line_ids`` in device memory. Ids must be in range (not checked on the device)."""
    check_inputs(lines, line_ids, group)
    n = line_ids.shape[0]
    padded = -(-max(n, 1) // group) * group
    out = _kernel_call(lines, jnp.pad(line_ids, (0, padded - n)), group)
    return out[:n]
