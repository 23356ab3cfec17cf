"""How much device memory the paged KV pool gets: the memory the device offers, less what is already allocated
(weights), less the activation peak of the largest compiled step, times a utilisation fraction — vLLM's
``gpu_memory_utilization``, with the peak measured the JAX way: XLA's buffer assignment of the compiled step
(``Compiled.memory_analysis()``), which is exact for the program that will run, rather than a profiling forward.

The steps whose peak is measured are compiled against a minimal pool (one page per page-table entry, one state slot
per row): the cache is donated and updated in place, so the temporaries do not depend on the pool's size. Those
two compilations (largest prefill bucket, largest decode bucket; the plain step, also for speculative engines,
whose verify step adds ``k`` rows per sequence) are the price of planning; the persistent
compilation cache makes them reads on later runs, and ``LLM(kv_cache_memory_bytes=...)`` skips planning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.engine.compile_pool import CompilerOptions


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Device memory at engine start and the KV pool budget derived from it (bytes).

    device_bytes: what the device offers (its ``bytes_limit``, or the caller's ``device_memory_bytes``).
    in_use_bytes: already allocated when planning (the weights; on a backend without memory statistics, the
      model's parameter bytes), plus the scan-layout copy of the layer weights the runner is about to make
      (:func:`restack_bytes`).
    activation_bytes: XLA's temporary buffers of the largest step, max over the measured shapes.
    activation_by_shape: ``{(B, Q, P): temporary bytes}`` of each measured step shape.
    utilization: the fraction of ``device_bytes`` the engine may use in all.
    """

    device_bytes: int
    in_use_bytes: int
    activation_bytes: int
    activation_by_shape: dict[tuple[int, int, int], int]
    utilization: float

    @property
    def kv_bytes(self) -> int:
        """What the paged pools and state slots may take: ``utilization · device − in use − activations``."""
        return int(self.utilization * self.device_bytes) - self.in_use_bytes - self.activation_bytes

    def check(self) -> MemoryPlan:
        """Raise ValueError naming the numbers when nothing is left for the cache."""
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.utilization}")
        if self.kv_bytes <= 0:
            raise ValueError(f"no device memory left for the KV cache: {self.utilization:.2f} × {self.device_bytes} B "
                             f"offered, {self.in_use_bytes} B in use (weights), {self.activation_bytes} B for the "
                             "largest step's activations; raise memory_utilization, lower max_num_batched_tokens / "
                             "max_num_seqs, or pass kv_cache_memory_bytes")
        return self


def device_memory(device: jax.Device) -> tuple[int | None, int | None]:
    """``(bytes_limit, bytes_in_use)`` the device reports; ``(None, None)`` where it reports nothing (XLA:CPU)."""
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit"), stats.get("bytes_in_use")


def temp_bytes(compiled: Any) -> int:
    """Bytes of XLA's temporary buffers for a compiled executable (0 if the backend gives no analysis)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    if isinstance(analysis, (list, tuple)):   # one per device on some versions
        return max(int(a.temp_size_in_bytes) for a in analysis)
    return int(analysis.temp_size_in_bytes)


def measure_step_activations(model: Any, shapes: list[tuple[int, int, int]], block_size: int, max_rows: int,
                             max_logprobs: int, engram_tables: str = "device",
                             compiler_options: CompilerOptions = ()) -> dict[tuple[int, int, int], int]:
    """Temporary bytes of the engine step compiled for each ``(B, Q, P)`` shape against a minimal pool.

    ``model``: a :class:`~dinfer_jax.models.Model`; ``max_rows``: the runner's output width (largest bucket
    batch); ``engram_tables``: where V4.1 Engram tables are placed (the runner's placement); ``compiler_options``:
    the runner's XLA options (:func:`~dinfer_jax.engine.compile_pool.compiler_options_key`)."""
    from dinfer_jax.engine.runner import InFlight, empty_inputs, step_programs, step_statics
    from dinfer_jax.models.layer_plan import stack_params
    from dinfer_jax.models.step_state import CacheConfig, StepInput, cache_shapes
    from dinfer_jax.sampling.params import SamplingTensors

    cfg = model.config
    params = jax.eval_shape(lambda p: stack_params(cfg, p), model.params)
    statics, engram = step_statics(model, engram_tables=engram_tables)
    programs = step_programs(compiler_options)
    out = {}
    for b, q, p in shapes:
        cache = cache_shapes(cfg, CacheConfig(num_slots=b + 1, num_blocks=p + 1, block_size=block_size), model.dtype)
        inp, feed = empty_inputs(b, q, p)
        forward = programs.forward.lower(params, cache, StepInput(**inp), InFlight(**feed),
                                         np.zeros((max_rows,), np.int32), engram, **statics).compile()
        # the sampler runs after the model (its own program): the step's peak is the larger of the two; the
        # filtering variant (two sorts over the vocabulary) is the largest
        samp = SamplingTensors.from_params([], [], [], pad_to=b, num_top_logprobs=max_logprobs, use_filters=True,
                                           all_greedy=False)
        mask = jax.ShapeDtypeStruct((b, -(-cfg.vocab_size // 32)), jnp.int32)  # structured outputs' token mask
        sampler = programs.sample.lower(jax.ShapeDtypeStruct((b, cfg.vocab_size), jnp.float32), samp, mask,
                                        max_rows=max_rows).compile()
        out[(b, q, p)] = max(temp_bytes(forward), temp_bytes(sampler))
    return out


def restack_bytes(model: Any) -> int:
    """Bytes the runner will add by stacking the layer weights into scan layout: all of them when ``model`` holds
    them in checkpoint layout (that copy stays alive as long as the caller holds the Model), else 0."""
    from dinfer_jax.models.layer_plan import StackedLayers
    from dinfer_jax.models.qweights import tree_nbytes

    layers = model.params["layers"]
    return 0 if isinstance(layers, StackedLayers) else tree_nbytes(layers)


def plan_memory(model: Any, shapes: list[tuple[int, int, int]], *, block_size: int, max_rows: int,
                max_logprobs: int, utilization: float, device_memory_bytes: int | None = None,
                device: jax.Device | None = None, engram_tables: str = "device",
                compiler_options: CompilerOptions = ()) -> MemoryPlan | None:
    """The plan for ``model`` on ``device`` (default: the first device), or None when neither the device reports
    its memory nor ``device_memory_bytes`` is given (the caller then uses a fixed budget)."""
    device = device or jax.devices()[0]
    if model.engram is not None:  # the runner's Engram tables, placed (once) before the device's use is read
        model.engram.state(engram_tables)
    limit, in_use = device_memory(device)
    limit = device_memory_bytes or limit
    if limit is None:
        return None
    if in_use is None:
        in_use = model.param_bytes
        if model.engram is not None and engram_tables == "device":
            in_use += model.engram.table_bytes
    in_use += restack_bytes(model)
    by_shape = measure_step_activations(model, shapes, block_size, max_rows, max_logprobs, engram_tables,
                                        compiler_options)
    return MemoryPlan(device_bytes=int(limit), in_use_bytes=int(in_use), activation_bytes=max(by_shape.values()),
                      activation_by_shape=by_shape, utilization=float(utilization)).check()
