"""Batch-invariant computation: a row's results do not depend on the other rows of its step.

``LLM(batch_invariant=True)`` (DeepInfer, ``docs/spec/engine.md`` §6) asks that a request's logits be bitwise the
same whether it runs alone or among any other requests, at any row of the batch, whatever the chunking of its
prefill. XLA picks
a contraction's algorithm from its operand shapes (measured on XLA:CPU: a ``[T, 256] · [256, 512]`` product gives
a row different bits at T = 1, 2 and 64), and a step's shapes follow the batch. So in this mode every contraction
a token takes part in runs at a shape fixed by the model alone:

* products with a weight (linears, the mHC mixes, the grouped output projection, the experts, the head) run over
  tiles of ``tile`` token rows (:func:`token_tiled`): one program of shape ``[tile, in] · [in, out]`` applied to
  every tile in turn (``lax.map``), whatever the number of tokens; padding rows are zeros and are dropped;
* attention and the indexer contract per query over fixed-size key blocks, in the keys' position order, with an
  online softmax across blocks (:mod:`dinfer_jax.models.attention_invariant`): a block with no visible key
  changes nothing (``max(m, −inf) = m``, a rescale by ``exp(0) = 1``, a sum of zeros), so how many pages a
  step's batch makes the program read does not matter;
* the per-row reductions that remain (norms, softmaxes, the sampler) reduce a fixed-length axis of one row; a
  reduction over a middle axis outside a tile (the compressors' pooling) is a chain of adds (:func:`ordered_sum`);
* on CPU the programs are compiled without XLA's YNNPACK fusions (:data:`CPU_INVARIANT_OPTIONS`).

Each tile's outputs pass an ``optimization_barrier`` so that XLA cannot fuse them with their consumers differently
when a loop runs once (XLA inlines one-trip loops).

The tile size is a trace-time choice, held for the duration of tracing one step by :func:`batch_invariant` (a
context variable, like ``jax.default_matmul_precision``): the step functions take it as a static argument and
enter the context themselves, so two programs traced with different settings never share a jit cache entry.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

DEFAULT_TILE = 16   # token rows per fixed-shape product (the engine's ``batch_invariant=True``)
# XLA:CPU compiles some fusions through YNNPACK, whose kernels were measured to give a row different bits with the
# batch size even at fixed tile shapes; the batch-invariant engine's programs are compiled without them on CPU
CPU_INVARIANT_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
KV_BLOCK = 64       # keys per attention / indexer block

_TILE: contextvars.ContextVar[int] = contextvars.ContextVar("dinfer_jax_batch_invariant_tile", default=0)


@contextlib.contextmanager
def batch_invariant(tile: int) -> Iterator[None]:
    """Trace the enclosed model code batch-invariantly with ``tile`` token rows per product (0: off)."""
    if tile < 0:
        raise ValueError(f"batch-invariant tile must be >= 0, got {tile}")
    token = _TILE.set(int(tile))
    try:
        yield
    finally:
        _TILE.reset(token)


def active_tile() -> int:
    """Token rows per product while tracing batch-invariantly, else 0."""
    return _TILE.get()


def token_tiled(fn: Callable[..., Any], *xs: jax.Array, lead: int, tile: int | None = None) -> Any:
    """``fn`` over tiles of token rows: the first ``lead`` axes of every ``xs`` (equal across them) are flattened
    to ``T`` rows, zero-padded to a multiple of ``tile`` and fed to ``fn`` ``tile`` rows at a time; ``fn`` must
    treat its rows independently and return a pytree of ``[tile, ...]`` arrays. Returns that pytree with the rows
    back in the ``xs``' leading shape. ``fn`` is traced with tiling off (its shapes are fixed already)."""
    tile = tile or active_tile()
    if tile <= 0:
        raise ValueError("token_tiled needs a tile size (or an active batch_invariant context)")
    shape = xs[0].shape[:lead]
    for x in xs:
        if x.shape[:lead] != shape:
            raise ValueError(f"token_tiled: leading shapes differ: {x.shape[:lead]} vs {shape}")
    t = math.prod(shape)
    nt = max(1, -(-t // tile))

    def tiles(x: jax.Array) -> jax.Array:
        x = x.reshape(t, *x.shape[lead:])
        x = jnp.pad(x, [(0, nt * tile - t)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(nt, tile, *x.shape[1:])

    def body(args: tuple[jax.Array, ...]) -> Any:
        with batch_invariant(0):   # a tile's shapes are fixed already: no tiling inside it
            return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))

    out = jax.lax.map(body, tuple(tiles(x) for x in xs))
    return jax.tree.map(lambda y: y.reshape(nt * tile, *y.shape[2:])[:t].reshape(*shape, *y.shape[2:]), out)


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """``Σ`` over ``axis`` as a left-to-right chain of elementwise adds: the order is fixed by construction, whatever
    XLA makes of the surrounding shapes (its reduction of a middle axis was measured to change a row's bits with the
    batch size even inside fixed tiles, in context)."""
    parts = jnp.moveaxis(x, axis, 0)
    acc = parts[0]
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i]
    return acc


__all__ = ["CPU_INVARIANT_OPTIONS", "DEFAULT_TILE", "KV_BLOCK", "active_tile", "batch_invariant", "ordered_sum",
           "token_tiled"]
