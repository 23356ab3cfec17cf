"""Batch-invariant computation: a row's results do not depend on the other rows of its step.

``LLM(batch_invariant=True)`` (DeepInfer, ``docs/spec/engine.md`` §6) asks that a request's logits be bitwise the
same whether it runs alone or among any other requests, at any row of the batch, whatever the chunking of its
prefill. XLA picks
a contraction's algorithm from its operand shapes (measured on XLA:CPU: a ``[T, 256] · [256, 512]`` product gives
a row different bits at T = 1, 2 and 64), and a step's shapes follow the batch. So in this mode every contraction
a token takes part in runs at a shape fixed by the model alone:

* everything a token computes on its own (mHC mixes, collapse and expansion, norms, RoPE, projections, the router
  and experts, the head) runs in :func:`rowwise` segments over tiles of ``tile`` token rows (:func:`token_tiled`):
  one fixed-shape program applied to every tile in turn (``lax.map``), whatever the number of tokens; padding rows
  are zeros and are dropped. Tiling only the products is not enough on a GPU: XLA fuses and tiles the
  elementwise and reduction chains between them by the shapes around them (measured on the H200 to change a row's
  bits), so a layer is two segments around its attention core;
* a product with a weight outside a segment (:func:`~dinfer_jax.models.ops.linear` and the other leaf functions)
  tiles itself the same way;
* attention and the indexer contract per query over fixed-size key blocks, in the keys' position order, with an
  online softmax across blocks (:mod:`dinfer_jax.models.attention_invariant`): a block with no visible key
  changes nothing (``max(m, −inf) = m``, a rescale by ``exp(0) = 1``, a sum of zeros), so how many pages a
  step's batch makes the program read does not matter;
* the compressors' pooling (a reduction over a middle axis) is a chain of adds (:func:`ordered_sum`); the engine's
  sampler runs in row tiles the same way (``engine.runner._device_sample``);
* on CPU the programs are compiled without XLA's YNNPACK fusions (:data:`CPU_INVARIANT_OPTIONS`).

Every call runs at least two tiles (a padding tile when the rows fit in one): XLA inlines a loop of one trip, and
the inlined products are then compiled with their neighbours (measured on the H200: two linears of the same rows,
each its own loop elsewhere, merged into one GEMM of another shape, whose sums round differently). A loop of two or
more trips keeps its body, which is the same computation in every program. Each tile's inputs and outputs also
pass an ``optimization_barrier``.

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
MIN_TILES = 2       # tiles per token_tiled call at least: XLA inlines one-trip loops (see the module docstring)

# (tile rows, inside a tile): the tile size while tracing batch-invariantly (0: off), and whether the code being
# traced is already one tile's body (its shapes fixed: no further tiling, but still the invariant algorithms)
_STATE: contextvars.ContextVar[tuple[int, bool]] = contextvars.ContextVar("dinfer_jax_batch_invariant",
                                                                          default=(0, False))


@contextlib.contextmanager
def batch_invariant(tile: int) -> Iterator[None]:
    """Trace the enclosed model code batch-invariantly with ``tile`` token rows per product (0: off)."""
    if tile < 0:
        raise ValueError(f"batch-invariant tile must be >= 0, got {tile}")
    token = _STATE.set((int(tile), False))
    try:
        yield
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def _inside_tile() -> Iterator[None]:
    token = _STATE.set((_STATE.get()[0], True))
    try:
        yield
    finally:
        _STATE.reset(token)


def active_tile() -> int:
    """Token rows per product while tracing batch-invariantly outside a tile's body, else 0 (code that sees 0
    runs at the shapes it is given)."""
    tile, inside = _STATE.get()
    return 0 if inside else tile


def invariant_tracing() -> bool:
    """Whether the code being traced is batch-invariant (outside or inside a tile's body): where an algorithm's
    result for a row can depend on the other rows of a fixed-shape tile (grouped expert GEMMs), the invariant one
    is used."""
    return _STATE.get()[0] > 0


def token_tiled(fn: Callable[..., Any], *xs: jax.Array, lead: int, tile: int | None = None) -> Any:
    """``fn`` over tiles of token rows: the first ``lead`` axes of every ``xs`` (equal across them) are flattened
    to ``T`` rows, zero-padded to a multiple of ``tile`` (at least :data:`MIN_TILES` tiles) and fed to ``fn``
    ``tile`` rows at a time; ``fn`` must treat its rows independently and return a pytree of ``[tile, ...]``
    arrays. Returns that pytree with the rows back in the ``xs``' leading shape. ``fn`` is traced as a tile's
    body (:func:`active_tile` 0 inside: its shapes are fixed already)."""
    tile = tile or active_tile()
    if tile <= 0:
        raise ValueError("token_tiled needs a tile size (or an active batch_invariant context)")
    shape = xs[0].shape[:lead]
    for x in xs:
        if x.shape[:lead] != shape:
            raise ValueError(f"token_tiled: leading shapes differ: {x.shape[:lead]} vs {shape}")
    t = math.prod(shape)
    nt = max(MIN_TILES, -(-t // tile))

    def tiles(x: jax.Array) -> jax.Array:
        x = x.reshape(t, *x.shape[lead:])
        x = jnp.pad(x, [(0, nt * tile - t)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(nt, tile, *x.shape[1:])

    def body(args: tuple[jax.Array, ...]) -> Any:
        with _inside_tile():
            return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))

    out = jax.lax.map(body, tuple(tiles(x) for x in xs))
    return jax.tree.map(lambda y: y.reshape(nt * tile, *y.shape[2:])[:t].reshape(*shape, *y.shape[2:]), out)


def rowwise(fn: Callable[..., Any], *xs: jax.Array | None, lead: int = 2) -> Any:
    """``fn(*xs)`` for a computation whose rows (the first ``lead`` axes, e.g. ``[B, Q]`` tokens) are
    independent: called directly, or while tracing batch-invariantly over fixed tiles of rows, ``fn`` then seeing
    ``[1, tile, ...]`` arrays (``None`` entries passed through). Every operation a row takes part in then runs in
    one fixed-shape program, whatever the step's shapes (XLA fuses and tiles untiled elementwise and reduction
    chains by the shapes around them: measured on the H200 to change a row's bits)."""
    if not active_tile():
        return fn(*xs)
    present = [i for i, x in enumerate(xs) if x is not None]

    def one(*tiles: jax.Array) -> Any:
        args: list[Any] = [None] * len(xs)
        for i, t in zip(present, tiles, strict=True):
            args[i] = t.reshape(1, *t.shape)
        return jax.tree.map(lambda y: y.reshape(y.shape[1:]), fn(*args))

    flat = [xs[i].reshape(math.prod(xs[i].shape[:lead]), *xs[i].shape[lead:]) for i in present]
    out = token_tiled(one, *flat, lead=1)
    shape = xs[present[0]].shape[:lead]
    return jax.tree.map(lambda y: y.reshape(*shape, *y.shape[1:]), out)


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """``Σ`` over ``axis`` as a left-to-right chain of elementwise adds: the order is fixed by construction, whatever
    XLA makes of the surrounding shapes (its reduction of a middle axis was measured to change a row's bits with the
    batch size even inside fixed tiles, in context)."""
    parts = jnp.moveaxis(x, axis, 0)
    acc = parts[0]
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i]
    return acc


__all__ = ["CPU_INVARIANT_OPTIONS", "DEFAULT_TILE", "KV_BLOCK", "MIN_TILES", "active_tile", "batch_invariant",
           "invariant_tracing", "ordered_sum", "rowwise", "token_tiled"]
